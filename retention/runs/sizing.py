"""Sizing a job to a host: how many problems fit in a time budget, from a short measurement.

Hosts differ (the same batch-1 decode ran 4x slower on one than on another), so a job meant to take
minutes can take an hour. `retention size` measures this host's decode step and picks the problem
count and token limit, at most the requested ones, whose predicted time fits the seconds left; the
job then runs those and says so on the terminal and, through the note it writes into the runs folder
(`sizing.json`, `protocol.runs.SIZING_NOTE`), in the report.

Which pair: the one generating the most tokens (`P x T`), longer answers first among equals, with
`T` on a grid of 64 tokens between `min_tokens` and the requested `T` and `P` at least `min_problems`
(a paired report needs two). On a CPU a decode step costs nearly the same at 1 and at 16 slots
(the weights are read once per step), so a slow host keeps its problems and shortens the answers
before it drops problems; more truncated answers is the price, and the note says it. When even the
smallest job does not fit with the fidelity proxy, the proxy goes (its full caches are two of the five
caches the main job decodes per step) and the job is fitted again without it; the note says that too.

The prediction is deliberately pessimistic and simple. A run of `P` problems at `S` slots decodes
`ceil(P / S')` waves of `T` steps at `S' = min(S, P)` slots (every slot of a wave decodes until its
longest answer ends, at worst `T` tokens). One job step is one decode of every cache the job's arms
carry: a retention arm its budget cache, plus a full cache when it carries the fidelity proxy; a full
arm a full cache. Each is priced at one measured full-cache decode step of the job's first prompt:
on the models a CPU runs (0.5B and smaller) a step's time is the weights read and multiplied, the
attention over a few hundred tokens a few percent of it, so the budget cache and the full cache's
later steps cost about the same (the margin below covers the rest). The step time at `S'` slots
comes from a line through the measured 1 and `S` slots (`t(S) = a + b S`: the weights are read once
per step, the arithmetic grows with the rows). Each wave also prefills its prompts once per arm
(the fidelity proxy copies the prefill), priced by the same kind of line through the measured
prefills of 1 and of `S` prompts, and each run command loads the model once (measured here). The
time left is shrunk by `margin` for what the model does not cover (compactions, the fidelity
proxy's divergence, grading, the report and the viewer). Its default, 0.6, comes from three jobs on
a host emulated about 4x slower than the project's (a CPU-quota cgroup: `results/slow-host/`): from
the note to the viewer they took 1.40x, 1.52x and 1.49x their prediction (the run commands alone
1.30x, 1.35x, 1.40x), within the 1/0.6 = 1.67x the margin leaves.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from protocol.runs import SIZING_NOTE
from retention.models import format_prompt, load_model
from retention.runs.bench import speed_rows



@dataclass(frozen=True)
class JobShape:
    """What a job decodes: `retention_arms` arms at the budget (each with a full cache alongside when
    `fidelity`), `full_arms` full-cache arms, `commands` run commands (one model load each)."""

    tokens: int
    batch: int
    retention_arms: int = 2
    full_arms: int = 1
    fidelity: bool = True
    commands: int = 2

    def full_caches(self) -> int:
        """Full-cache decodes per job step."""
        return self.full_arms + (self.retention_arms if self.fidelity else 0)


@dataclass(frozen=True)
class StepLine:
    """Seconds of one decode step (or one prefill) of one cache at `S` slots: `a + b S`."""

    a: float
    b: float

    def at(self, slots: int) -> float:
        return self.a + self.b * slots


@dataclass(frozen=True)
class Sizing:
    """The decision, as the note records it."""

    requested: int
    problems: int
    requested_tokens: int
    tokens: int
    seconds_left: float
    predicted_seconds: float
    load_seconds: float
    margin: float
    shape: dict
    steps: dict
    fidelity: bool = True  # the job keeps the fidelity proxy (False: dropped so that it fits)
    solved_tokens: int | None = None  # the answer length the model's solved answers need (`solved_tokens`)

    @property
    def reduced(self) -> bool:
        return self.problems < self.requested or self.tokens < self.requested_tokens

    def line(self) -> str:
        fit = "fits" if self.predicted_seconds <= self.seconds_left * self.margin else "does not fit"
        what = (f"sized to {self.problems} of {self.requested} problems at {self.tokens} of {self.requested_tokens} "
                "new tokens" if self.reduced else
                f"all {self.requested} problems at {self.tokens} new tokens fit")
        if self.shape["fidelity"] and not self.fidelity:
            what += " without the fidelity proxy (the smallest job with it does not fit)"
        if self.solved_tokens is not None:
            what += (f"; answers of at least {self.solved_tokens} tokens kept (what the model's solved answers need)"
                     if self.tokens >= min(self.solved_tokens, self.requested_tokens) else
                     f"; below the {self.solved_tokens} tokens its solved answers need: no accuracy signal expected")
        return (f"{what}: predicted {self.predicted_seconds:.0f} s of the {self.seconds_left:.0f} s left "
                f"({fit} within {100 * self.margin:.0f}% of it) from a measured decode step "
                f"({self.steps['step_ms'][0]:.1f} ms at {self.steps['slots'][0]} slot, "
                f"{self.steps['step_ms'][-1]:.1f} ms at {self.steps['slots'][-1]}; prefill "
                f"{self.steps['prefill_ms'][-1]:.0f} ms at {self.steps['slots'][-1]})")


def predicted_seconds(problems: int, shape: JobShape, line: StepLine, load_seconds: float,
                      prefill: StepLine = StepLine(0.0, 0.0)) -> float:
    """The pessimistic time of the job at `problems` problems of `shape.tokens` new tokens (module doc):
    per wave `T` steps of every cache and one prefill per arm, plus a model load per command."""
    slots = min(shape.batch, problems)
    waves = math.ceil(problems / slots)
    decode = shape.tokens * (shape.retention_arms + shape.full_caches()) * line.at(slots)
    fill = (shape.retention_arms + shape.full_arms) * prefill.at(slots)
    return shape.commands * load_seconds + waves * (decode + fill)


def fit_job(requested: int, shape: JobShape, line: StepLine, load_seconds: float, seconds_left: float,
            margin: float, min_problems: int = 2, min_tokens: int = 128,
            prefill: StepLine = StepLine(0.0, 0.0)) -> tuple[int, int, float]:
    """(P, T, predicted seconds): of the pairs within `margin * seconds_left`, the one with the most
    tokens `P x T`, then the larger `T` (module doc). When none fits, the smallest job
    (`min_problems`, `min_tokens`, each at most what was asked), and the line says it does not fit."""
    low_p, low_t = min(min_problems, requested), min(min_tokens, shape.tokens)
    grid = sorted({shape.tokens, *range(low_t, shape.tokens, 64)}, reverse=True)
    best = None
    for t in grid:
        sized = dataclasses.replace(shape, tokens=t)
        p = next((p for p in range(requested, low_p - 1, -1)
                  if predicted_seconds(p, sized, line, load_seconds, prefill) <= margin * seconds_left), None)
        if p is not None and (best is None or (p * t, t) > (best[0] * best[1], best[1])):
            best = (p, t, predicted_seconds(p, sized, line, load_seconds, prefill))
    if best is None:
        return low_p, low_t, predicted_seconds(low_p, dataclasses.replace(shape, tokens=low_t), line, load_seconds,
                                              prefill)
    return best


def step_line(points: list[tuple[int, float]]) -> StepLine:
    """The line through the first and last (slots, seconds) points, slope and intercept clipped at 0
    (timing noise can tilt a short measurement); one slot count: all of it per row."""
    (s0, t0), (s1, t1) = points[0], points[-1]
    if s1 == s0:
        return StepLine(0.0, t1 / s1)
    b = max((t1 - t0) / (s1 - s0), 0.0)
    return StepLine(max(t1 - b * s1, 0.0), b)


def measure_step_line(loaded, problems, shape: JobShape, steps: int = 6) -> tuple[StepLine, StepLine, dict]:
    """(decode step line, prefill line, figures): the median of `steps` full-cache decode steps of the
    first problem's prompt, and the wall time of its prefill (the measurement's time outside its
    timed steps), at 1 and at `shape.batch` slots (the engine's own step, as `retention bench` times it)."""
    prompt = format_prompt(loaded.tokenizer, problems[0].problem, getattr(loaded, "prompt", "chat"))
    points, fills = [], []
    for s in sorted({1, shape.batch}):
        t0 = time.perf_counter()
        (row,) = speed_rows(loaded, prompt, ["full"], 0, steps + 1, ["mean"], s, None, {}, None)
        wall = time.perf_counter() - t0
        points.append((s, row["step_ms_median"] / 1e3))
        fills.append((s, max(wall - s * row["steps"] / row["tokens_per_second"], 0.0)))
    return step_line(points), step_line(fills), {
        "slots": [s for s, _ in points], "step_ms": [1e3 * t for _, t in points],
        "prefill_ms": [1e3 * t for _, t in fills], "prompt_tokens": len(prompt), "steps": steps}


def fit_or_lighten(requested: int, shape: JobShape, line: StepLine, load_seconds: float, seconds_left: float,
                   margin: float, min_problems: int = 2, min_tokens: int = 128,
                   prefill: StepLine = StepLine(0.0, 0.0)) -> tuple[int, int, float, bool]:
    """`fit_job`'s (P, T, predicted seconds) and whether the job keeps the fidelity proxy: it is
    dropped only when the smallest job with it does not fit (module doc)."""
    n, tokens, t = fit_job(requested, shape, line, load_seconds, seconds_left, margin, min_problems, min_tokens,
                           prefill)
    if not shape.fidelity or t <= margin * seconds_left:
        return n, tokens, t, shape.fidelity
    lean = dataclasses.replace(shape, fidelity=False)
    return (*fit_job(requested, lean, line, load_seconds, seconds_left, margin, min_problems, min_tokens, prefill),
            False)


def size_job(loaded, problems, shape: JobShape, requested: int, seconds_left: float, load_seconds: float,
             margin: float = 0.6, min_problems: int = 2, min_tokens: int = 128, solved: int | None = None) -> Sizing:
    """Measure this host (`measure_step_line`) and fit the job (`fit_or_lighten`; with `solved`, the
    answer length the model's solved answers need, `fit_keeping_answers`) into what is left of
    `seconds_left` after the measurement."""
    t0 = time.perf_counter()
    line, prefill, figures = measure_step_line(loaded, problems, shape)
    seconds_left -= time.perf_counter() - t0
    if solved is None:
        n, tokens, t, fidelity = fit_or_lighten(min(requested, len(problems)), shape, line, load_seconds, seconds_left,
                                                margin, min_problems, min_tokens, prefill)
    else:
        n, tokens, t, fidelity = fit_keeping_answers(min(requested, len(problems)), shape, line, load_seconds,
                                                     seconds_left, margin, solved, min_problems, min_tokens, prefill)
    return Sizing(requested=requested, problems=n, requested_tokens=shape.tokens, tokens=tokens,
                  seconds_left=seconds_left, predicted_seconds=t, load_seconds=load_seconds, margin=margin,
                  shape=asdict(shape), steps=figures, fidelity=fidelity, solved_tokens=solved)


def solved_tokens(runs: Path, model: str, quantile: float = 0.5) -> int | None:
    """The output tokens that `quantile` of `model`'s solved answers needed in the committed runs under
    `runs` (every `records.jsonl` of a run folder named `<model>-...`; a record counts when its
    verdict is True), rounded up to the sizing grid of 64 tokens; None when no answer was solved."""
    got = sorted(int(r["output_tokens"]) for f in sorted(Path(runs).glob(f"**/{model}-*/records.jsonl"))
                 for r in map(json.loads, f.read_text().splitlines()) if r.get("verdict") is True)
    if not got:
        return None
    need = got[min(len(got) - 1, math.ceil(quantile * len(got)) - 1)] if quantile > 0 else got[0]
    return -(-need // 64) * 64


def fit_keeping_answers(requested: int, shape: JobShape, line: StepLine, load_seconds: float, seconds_left: float,
                        margin: float, solved: int, min_problems: int = 2, min_tokens: int = 128,
                        prefill: StepLine = StepLine(0.0, 0.0)) -> tuple[int, int, float, bool]:
    """`fit_or_lighten`, but the accuracy signal goes last: answers stay at least `solved` tokens long
    (what the model's solved answers need, `solved_tokens`). Every problem with the fidelity proxy if
    that fits; else without it, the most tokens `P x T` down to `min_problems`; only when that does not
    fit either are the answers cut below `solved` (`fit_or_lighten`, down to `min_tokens`; the note
    then says no accuracy signal is expected)."""
    floor = min(solved, shape.tokens)
    tries = [(shape, requested)] if shape.fidelity else []
    tries.append((dataclasses.replace(shape, fidelity=False), min_problems))
    for sized, fewest in tries:
        n, tokens, t = fit_job(requested, sized, line, load_seconds, seconds_left, margin, fewest, floor, prefill)
        if t <= margin * seconds_left:
            return n, tokens, t, sized.fidelity
    return fit_or_lighten(requested, shape, line, load_seconds, seconds_left, margin, min_problems, min_tokens, prefill)


def write_note(sizing: Sizing, path: Path, model: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"model": model, "written": time.strftime("%Y-%m-%dT%H:%M:%S"),
                               "line": sizing.line(), **asdict(sizing)}, indent=1) + "\n")
    tmp.replace(path)


def confirm_seconds(sequences: int, tokens: int, slots: int, evicting_arms: int, full_arms: int, line: StepLine,
                    prefill: StepLine, load_seconds: float) -> float:
    """The pessimistic wall time of one cell's confirmation (`predicted_seconds`): `sequences` (problems
    x samples) per arm at `slots` slots, every answer `tokens` long, each arm its own command (one
    model load each), no fidelity proxy (a confirmation carries none)."""
    shape = JobShape(tokens=tokens, batch=slots, retention_arms=evicting_arms, full_arms=full_arms, fidelity=False,
                     commands=evicting_arms + full_arms)
    return predicted_seconds(sequences, shape, line, load_seconds, prefill)


def measure_host(model: str, dtype: str, slots: int, problems, tokens: int) -> tuple[StepLine, StepLine, dict, float]:
    """(decode line, prefill line, figures, model load seconds) of `model` on this host: a load and a
    few full-cache decode steps of the first of `problems` (a dev problem) at 1 and `slots` slots."""
    t0 = time.perf_counter()
    loaded = load_model(model, dtype=dtype, device="cpu")
    load_seconds = time.perf_counter() - t0
    line, prefill, figures = measure_step_line(loaded, problems, JobShape(tokens=tokens, batch=slots))
    return line, prefill, figures, load_seconds

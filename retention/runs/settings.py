"""Run settings: everything a run is run with besides its arms, as one frozen, typed object.

`RunSettings` (the model, its dtype and device, the engine, the problems, the sampling, the output)
is built once, by `RunSettings.build`, from each of the ways a run starts: `retention run`'s options
and the notebook API (`from_options`), a plan's arm as the built-in confirm runner receives it
(`from_plan`) and a recorded `config.json` (`from_config`, which `reproduce` and `validate_arm` use).
Each value is validated there, in one line (`RetentionError`) naming the option. From then on the
object travels whole: `retention.runs.jobs.execute`, `retention.runs.runner.run_arms`, the engines
and the Ray launcher read it instead of a score of loose keywords.

`Budget` is the other half of an arm's configuration that a run's options give every arm alike: the
cache budget (tokens, or KiB per sequence converted once through the model's cache layout), the
meter's accounting, the compaction interval, the protected sink/recent tokens and the prompt rule.

`RunSettings.config()` and `Budget.config()` write exactly the run-configuration keys
(docs/records.md) each path wrote before these types existed, so every configuration keeps its hash.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from protocol.data import DATASETS, check_limit
from protocol.errors import ProtocolError
from protocol.splits import run_problems
from retention.errors import RetentionError
from retention.host import portable_problem
from retention.models import model_layout, resolve_device, resolve_dtype, resolve_model
from retention.models.layouts import tokens_for_bytes
from retention.runtime.sampling import DEFAULT_SAMPLER, LEGACY_SAMPLER, SAMPLERS

# What `--engine` (and a plan arm's "engine") may name: this project's batched engine (every model,
# DeepSeek checkpoints on the reference MLA included), vLLM for non-evicting arms.
ENGINES = ("hf", "vllm")
# Upper bounds that keep a typo from allocating or generating without bound.
MAX_SAMPLES = 10_000
MAX_NEW_TOKENS = 1 << 20
# A cache budget (tokens per layer and KV head) beyond any context a model is run at; larger values
# only overflow the preallocated buffers.
MAX_BUDGET = 1 << 24
ACCOUNTINGS = ("mean", "prefill", "peak")


def check_number(value, kind, flag: str, *, lo=None, hi=None, lo_open=False):
    """`value` (None passes) refused in one line unless it is a finite `kind` within [lo, hi]
    (`lo_open`: (lo, hi]); a bool is no number."""
    if value is None:
        return None
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok:
        raise RetentionError(f"{flag} must be a finite {'integer' if kind is int else 'number'}, got {value!r}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise RetentionError(f"{flag} must be {'>' if lo_open else '>='} {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise RetentionError(f"{flag} must be <= {hi}, got {value!r}")
    return value


def _flag(value, key: str) -> bool:
    if not isinstance(value, bool):
        raise RetentionError(f"{key} must be true or false, got {value!r}")
    return value


@dataclass(frozen=True)
class Sampling:
    """How each token is drawn, and the seed each (problem, sample) derives its own from.

    sampler: as recorded, None when the configuration leaves the key out (the legacy sampler: every
    run before `--sampler`, a greedy arm, an engine that samples its own way)."""

    max_new_tokens: int = 8192
    temperature: float = 0.6
    top_p: float = 0.95
    ignore_eos: bool = False
    seed: int = 0
    sampler: str | None = None

    @property
    def drawn_with(self) -> str:
        """The sampler that draws (absent from the configuration: the legacy one)."""
        return self.sampler or LEGACY_SAMPLER

    def engine_args(self) -> dict:
        """The sampling dict the engines take (`retention.runs.engines.base.Engine.complete`)."""
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "ignore_eos": self.ignore_eos}


@dataclass(frozen=True)
class Problems:
    """Which problems a run decodes, and how many samples of each: the first `limit` problems of
    `split` of `dataset` (`data`: another MATH-500 copy; `splits_dir`: where the manifest is)."""

    split: str = "dev"
    dataset: str = "math500"
    data: str | None = None
    limit: int | None = None
    samples: int = 1
    splits_dir: Path | None = None

    @property
    def explores(self) -> bool:
        """A dev run of an AIME set, which has no dev split, explores its confirm set."""
        return self.split == "dev" and self.dataset != "math500"

    def load(self) -> list:
        """The problems, in the split's order, `limit` applied."""
        problems = run_problems(self.split, self.dataset, data_path=self.data, splits_dir=self.splits_dir)
        return problems[: self.limit] if self.limit else problems


@dataclass(frozen=True)
class Output:
    """Where and how the records are written; none of it is part of the configuration hash.

    out: parent folder of the run directories; batch_size: the slot count (None: chosen for the
    device's memory, printed); grade: grade records as they are written; trace: record what each
    record's cache held (`--trace`); progress: a progress bar."""

    out: Path = Path("results")
    batch_size: int | None = None
    grade: bool = True
    trace: bool = False
    progress: bool = True


@dataclass(frozen=True)
class RunSettings:
    """What a run is run with besides its arms (module docstring). Build it with `build` or one of
    its adapters: those validate each value once; the constructor itself checks nothing.

    record_engine: the configuration names `engine` (a plan's arm that sets it); `run` and the API
    leave it out for this project's engine and another engine adds its own name and version."""

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    engine: str = "hf"
    fidelity: bool = False
    problems: Problems = field(default_factory=Problems)
    sampling: Sampling = field(default_factory=Sampling)
    output: Output = field(default_factory=Output)
    isa_portable: bool = False
    record_engine: bool = False

    @classmethod
    def build(cls, model, *, dtype="float32", device="cpu", engine="hf", fidelity=False, problems: Problems,
              sampling: Sampling, output: Output | None = None, isa_portable=False,
              record_engine=False) -> RunSettings:
        """The one validation of every run setting, in `validate_arm`'s words and order (model, dtype,
        engine, device, sampling, problems); each refusal is one line naming the option."""
        if not isinstance(model, str) or not model:
            raise RetentionError("an arm configuration needs a 'model'")
        resolve_model(model)
        resolve_dtype(str(dtype))
        if engine not in ENGINES:
            raise RetentionError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        resolve_device(str(device))
        s = sampling
        check_number(s.temperature, float, "--temperature", lo=0, hi=100)
        check_number(s.top_p, float, "--top-p", lo=0, hi=1, lo_open=True)
        if s.top_p is not None and s.top_p < 1e-6:
            raise RetentionError(f"--top-p must be at least 1e-6 (a nucleus of at least one token), got {s.top_p!r}")
        if (s.sampler or LEGACY_SAMPLER) not in SAMPLERS:
            raise RetentionError(f"--sampler must be one of {', '.join(SAMPLERS)}, got {s.sampler!r}")
        check_number(s.max_new_tokens, int, "--max-new-tokens", lo=1, hi=MAX_NEW_TOKENS)
        p = problems
        check_number(p.samples, int, "--samples", lo=1, hi=MAX_SAMPLES)
        check_number(s.seed, int, "--seed", lo=0, hi=2**63 - 1)
        check_number(p.limit, int, "--limit", lo=1)
        if p.split not in ("dev", "confirm"):
            raise RetentionError(f"--split must be dev or confirm, got {p.split!r}")
        if p.dataset not in DATASETS:
            raise RetentionError(f"--dataset must be one of {', '.join(DATASETS)} (math500 is written by leaving it "
                                 f"out), got {p.dataset!r}")
        if p.dataset != "math500":
            if p.data is not None:
                raise RetentionError(f"--data gives a MATH-500 copy; {p.dataset} is always the shipped copy")
            try:  # an AIME set: a limit above its 30 problems would silently run 30
                check_limit(p.dataset, p.limit)
            except ProtocolError as exc:
                raise RetentionError(str(exc)) from None
        _flag(fidelity, "fidelity")
        _flag(s.ignore_eos, "ignore_eos")
        output = output or Output()
        if output.trace and engine != "hf":
            raise RetentionError(f"--trace records this project's cache and needs --engine hf, not {engine}")
        return cls(model, dtype, device, engine, fidelity, problems, sampling, output, isa_portable, record_engine)

    @classmethod
    def from_options(cls, model: str, *, dtype: str = "float32", device: str = "cpu", engine: str = "hf",
                     split: str = "dev", dataset: str = "math500", data_path: str | None = None,
                     splits_dir: Path | None = None, limit: int | None = None, samples: int = 1,
                     max_new_tokens: int = 8192, temperature: float = 0.6, top_p: float = 0.95,
                     sampler: str = DEFAULT_SAMPLER, seed: int = 0, ignore_eos: bool = False,
                     fidelity: bool = False, trace: bool = False, grade: bool = True, out="results",
                     batch_size: int | None = None, progress: bool = True,
                     isa_portable: bool = False) -> RunSettings:
        """The settings of `retention run`'s options (the API's arguments have the same names). The
        confirm split is refused here: it is reachable only through a plan (`from_plan`)."""
        if isa_portable:
            problem = portable_problem(dtype) or (
                None if device == "cpu" else f"--isa-portable is a CPU mode, got --device {device}")
            if problem:
                raise RetentionError(problem)
        if split == "confirm":
            raise RetentionError("the confirm split is reachable only through a pre-registered plan: "
                                 "`retention preregister` then `retention confirm --plan PLAN.json`")
        return cls.build(
            model, dtype=dtype, device=device, engine=engine, fidelity=fidelity, isa_portable=isa_portable,
            problems=Problems(split, dataset, data_path, limit, samples, splits_dir),
            # vLLM samples its own way: the key is left out rather than recorded as if it drew
            sampling=Sampling(max_new_tokens, temperature, top_p, ignore_eos, seed,
                              sampler if engine == "hf" else None),
            output=Output(Path(out), batch_size, grade, trace, progress))

    @classmethod
    def from_config(cls, cfg: dict, output: Output | None = None, splits_dir: Path | None = None) -> RunSettings:
        """The settings a run configuration (`config.json`'s `config`, a plan's arm) names, absent keys
        at their defaults (docs/records.md)."""
        if "sampler" in cfg and cfg["sampler"] not in SAMPLERS:  # null included: absent is how the key says legacy
            raise RetentionError(f"--sampler must be one of {', '.join(SAMPLERS)}, got {cfg['sampler']!r}")
        if cfg.get("dataset") == "math500":  # absent means math500 (configurations before AIME keep their hash)
            raise RetentionError(f"--dataset must be one of {', '.join(DATASETS)} (math500 is written by leaving it "
                                 "out), got 'math500'")
        return cls.build(
            cfg.get("model"), dtype=cfg.get("dtype", "float32"), device=cfg.get("device", "cpu"),
            engine=cfg.get("engine", "hf"), fidelity=cfg.get("fidelity", False), output=output,
            record_engine="engine" in cfg,
            problems=Problems(cfg.get("split", "dev"), cfg.get("dataset", "math500"), cfg.get("data"),
                              cfg.get("limit"), cfg.get("samples", 1), splits_dir),
            sampling=Sampling(cfg.get("max_new_tokens", 8192), cfg.get("temperature", 0.6), cfg.get("top_p", 0.95),
                              cfg.get("ignore_eos", False), cfg.get("seed", 0), cfg.get("sampler")))

    @classmethod
    def from_plan(cls, cfg: dict, output: Output, splits_dir: Path | None = None) -> RunSettings:
        """The settings of one arm of a registered cell (`protocol.plans.arm_config`) on the confirm
        split. A plan's JSON may write a whole number for temperature or top_p: the built-in runner
        has always run (and recorded) them as floats, so its configurations keep their hash."""
        settings = cls.from_config(cfg, output, splits_dir)
        s = settings.sampling
        return replace(settings, sampling=replace(s, temperature=float(s.temperature), top_p=float(s.top_p)))

    def config(self) -> dict:
        """The run-configuration keys these settings give every arm (docs/records.md)."""
        s, p = self.sampling, self.problems
        cfg = {"model": self.model, "dtype": self.dtype, "device": self.device, "split": p.split, "data": p.data,
               "limit": p.limit, "samples": p.samples, "seed": s.seed, "fidelity": self.fidelity,
               "max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
               "ignore_eos": s.ignore_eos}
        if p.dataset != "math500":  # absent means math500: earlier configurations keep their hash
            cfg["dataset"] = p.dataset
        if s.sampler is not None:  # `normalize_arm` drops it where it says nothing (legacy, greedy)
            cfg["sampler"] = s.sampler
        if self.record_engine:
            cfg["engine"] = self.engine
        return cfg

    def with_output(self, **changes) -> RunSettings:
        """The same run written otherwise (a Ray shard: no progress bar of its own)."""
        return replace(self, output=replace(self.output, **changes))


def tokens_for_kib(model: str, dtype: str, budget: int | None, budget_kib: float | None) -> int | None:
    """The token budget: `budget`, or `budget_kib` KiB per sequence converted through the model's
    cache layout (`--budget-bytes`: `retention run` and `retention bench`)."""
    if budget_kib is None:
        return budget
    if budget is not None:
        raise RetentionError("give --budget (tokens) or --budget-bytes (KiB), not both")
    if not (0 < budget_kib < float("inf")):
        raise RetentionError(f"--budget-bytes must be a positive number of KiB, got {budget_kib:g}")
    layout = model_layout(model, dtype)
    if budget_kib * 1024 / layout.bytes_per_token > MAX_BUDGET:  # checked in floats: 1e308 KiB is no integer
        raise RetentionError(f"--budget-bytes {budget_kib:g} KiB holds more than {MAX_BUDGET:,} tokens of {model}'s "
                             "cache; give a budget a run can use")
    return tokens_for_bytes(layout, budget_kib * 1024)


@dataclass(frozen=True)
class Budget:
    """An arm's cache budget and meter: `tokens` per (layer, KV head) (None: no budget, a scorer that
    never evicts), `kib` when given as KiB per sequence (`--budget-bytes`, recorded), the compaction
    `interval`, the meter's `accounting`, the protected `sink`/`recent` tokens, the prompt kept on top
    of b (`on_top`, `--protect-prompt`) or counted inside it (`counted`; None: the scorer's own rule).

    Constructing one checks each value, in one line naming its option; the cadence each arm runs at
    is derived from it once, in `retention.runs.arms.build_arm_config`."""

    tokens: int | None = None
    kib: float | None = None
    interval: int | None = None
    accounting: str = "mean"
    sink: int | None = None
    recent: int | None = None
    on_top: bool = False
    counted: bool | None = None

    def __post_init__(self):
        check_number(self.kib, float, "--budget-bytes", lo=0, lo_open=True)
        check_number(self.tokens, int, "--budget", lo=1, hi=MAX_BUDGET)
        check_number(self.interval, int, "--interval", lo=1, hi=MAX_BUDGET)
        check_number(self.sink, int, "--sink", lo=0)
        check_number(self.recent, int, "--recent", lo=0)
        if self.accounting not in ACCOUNTINGS:
            raise RetentionError(f"--accounting must be mean, prefill or peak, got {self.accounting!r}")

    @classmethod
    def from_options(cls, settings: RunSettings, *, budget=None, budget_kib=None, interval=None, accounting="mean",
                     sink=None, recent=None, protect_prompt=False, prompt_rule=None) -> Budget:
        """`retention run`'s budget options: --budget-bytes converted to tokens here, once, through
        the model's cache layout; --protect-prompt and --prompt-rule as one rule."""
        if protect_prompt and prompt_rule not in (None, "keep-on-top"):
            raise RetentionError(f"--protect-prompt keeps the prompt on top of b; --prompt-rule {prompt_rule} "
                                 "says otherwise")
        tokens = tokens_for_kib(settings.model, settings.dtype, budget, budget_kib)
        counted = None if prompt_rule not in ("evict", "keep") else prompt_rule == "keep"
        return cls(tokens, budget_kib, interval, accounting, sink, recent,
                   bool(protect_prompt or prompt_rule == "keep-on-top"), counted)

    @classmethod
    def from_config(cls, cfg: dict) -> Budget:
        """The budget a run configuration names (absent keys at their defaults)."""
        return cls(cfg.get("budget"), cfg.get("budget_kib"), cfg.get("interval"), cfg.get("accounting", "mean"),
                   cfg.get("sink"), cfg.get("recent"), bool(cfg.get("protect_prompt", False)),
                   cfg.get("protect_prompt_counted"))

    def config(self) -> dict:
        """The run-configuration keys of the budget (`budget_kib` and `protect_prompt_counted` only
        when set: configurations from before them keep their hash)."""
        cfg = {"budget": self.tokens, "interval": self.interval, "accounting": self.accounting, "sink": self.sink,
               "recent": self.recent, "protect_prompt": self.on_top}
        if self.counted is not None:  # unset: each scorer's own rule (build_arm_config records it canonically)
            cfg["protect_prompt_counted"] = self.counted
        if self.kib is not None:
            cfg["budget_kib"] = self.kib
        return cfg

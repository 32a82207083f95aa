"""Golden records: the behaviour the one-runtime refactor (issue 20) must keep, recorded before it.

    python scripts/golden_records.py           # (re)record tests/retention/golden_records/
    python scripts/golden_records.py --check   # re-run everything and compare with the recorded data

Rewriting the records is legitimate only BEFORE the refactor (or for a deliberate, reviewed change of
behaviour, said in the commit): after it, `--check` (and `tests/retention/test_golden_records.py`)
is the proof that the refactor kept behaviour, and rerecording would erase that proof.

What runs: every built-in scorer on `tiny-random` and on every tiny layout model, at batch sizes 1
and 8, float64, greedy, fidelity on, the first `LIMIT` dev problems, `MAX_NEW_TOKENS` tokens each
(EOS ignored, so every sequence has the same length), budget `BUDGET` tokens with interval
`INTERVAL` (mean accounting: nominal b = 12), so the prompt is compacted at prefill and decoding
compacts every `INTERVAL` steps. A pair that `retention run` refuses (a layout model and a scorer
that reads per-head keys) is recorded as the one `Error:` line the CLI prints.

How: each run goes through what `retention run` calls, `retention.runs.arms.validate_arm` then
`retention.runs.jobs.execute` (run directories under a temporary `--out`, temporary
`RETENTION_STATE_DIR` and `RETENTION_CACHE_DIR`), and the records and traces are read back from the
run directory. Two things are not reachable from the command line and are done here:
* float64: `--dtype` offers float32/bfloat16/float16; `retention.dtypes.DTYPES` is extended with
  float64 while recording (nothing else changes; the model builders accept any dtype).
* kept sets: no record holds them. A hook wraps the cache compactions (`RetentionCache.compact_rows`,
  the one cache of transformers and layout models; before issue 20 also `retention.models.arch.retention.compact`
  of the layout models' own cache) and, after each, reads the compacted rows' absolute positions. A kept set is stored canonically, independent of how
  a runtime groups its stores: per layer (a sharing group's set repeated for each layer that reads
  it), per eviction head, sorted positions; each (compaction, row) event is stored as the kept count
  and a sha256 digest of that canonical form. After the refactor only `_compaction_hooks` needs to
  follow the new cache class; the data stays.
Batch 1 events are compared in order; batch 8 events as a multiset (row order inside a batch is the
runtime's business, the kept sets are not). The recorded data says, per model, which dtype ran.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = ROOT / "tests" / "retention" / "golden_records"
RUNS_FILE = "runs.jsonl"
MANIFEST_FILE = "manifest.json"

MODELS = ("tiny-random", "tiny-kv", "tiny-cla", "tiny-mla", "tiny-qk-norm-mla", "tiny-path-concat",
          "tiny-path-residual", "tiny-path-mla")
SCORERS = ("full", "random", "streaming", "h2o", "snapkv", "rkv", "triattention", "alpha")
BATCH_SIZES = (1, 8)
CALIBRATED = ("tiny-random", "tiny-mla", "tiny-qk-norm-mla")
DTYPE = "float64"
LIMIT = 2
MAX_NEW_TOKENS = 24
BUDGET = 16
INTERVAL = 8
SEED = 0
CALIBRATION_TEXT = b"Let x be a real number such that x^2 - 5x + 6 = 0. Find the sum of all possible values of x. " * 3
# Float comparison: relative 1e-12, with an absolute floor for values that are zero in exact
# arithmetic (the KL of two equal distributions computed along different operation orders).
RTOL, ATOL = 1e-12, 1e-18
# Record fields compared (wall times, tokens/s, hashes and versions are not behaviour).
RECORD_KEYS = ("problem_id", "sample", "prompt_tokens", "output_token_ids", "finish_reason", "cache_mean_tokens",
               "cache_peak_tokens", "cache_final_tokens", "cache_prefill_tokens", "kib_per_token", "cache_mean_kib",
               "budget_exceeded", "compactions", "decode_steps", "budget", "fidelity")


# --------------------------------------------------------------------------------------------
# Hooks
# --------------------------------------------------------------------------------------------

def kept_digest(per_layer: list[list[list[int]]]) -> str:
    """sha256 (16 hex digits) of a kept set `[layer][head] -> sorted absolute positions`."""
    return hashlib.sha256(json.dumps(per_layer, separators=(",", ":")).encode()).hexdigest()[:16]


def _event(per_layer: list[list[list[int]]]) -> list:
    return [len(per_layer[0][0]), kept_digest(per_layer)]


@contextlib.contextmanager
def _compaction_hooks(events: list):
    """Append `[kept count, digest]` to `events` for every row every compaction leaves compacted."""
    from retention.runtime.cache import RetentionCache

    plain_compact_rows = RetentionCache.compact_rows

    def compact_rows(self, rows, keep):
        plain_compact_rows(self, rows, keep)
        for r in rows:
            n = self.lengths[r]
            # One kept set per eviction group (a layer on the K/V layout), repeated for each layer it serves.
            groups = [sorted_rows(layer.positions[r, :, :n]) for layer in self.layers]
            events.append(_event([groups[self.group_of_layer[i]] for i in range(len(self.group_of_layer))]))

    RetentionCache.compact_rows = compact_rows
    try:
        yield
    finally:
        RetentionCache.compact_rows = plain_compact_rows


def sorted_rows(positions) -> list[list[int]]:
    """`[G, n]` positions -> per head, sorted."""
    return [sorted(int(p) for p in head) for head in positions.tolist()]


@contextlib.contextmanager
def _float64_admitted():
    """Let `float64` through `retention.dtypes.resolve_dtype` (the CLI offers three run dtypes)."""
    import torch

    from retention import dtypes

    had = "float64" in dtypes.DTYPES
    dtypes.DTYPES["float64"] = torch.float64
    try:
        yield
    finally:
        if not had:
            dtypes.DTYPES.pop("float64", None)


@contextlib.contextmanager
def _one_thread():
    """One intra-op thread while recording: tiny models gain nothing from more, and on a loaded
    machine several threads per op made a check several times slower (the records were the same)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _private_dirs():
    """A temporary state and cache root (never the user's), and the folder run directories go to."""
    saved = {k: os.environ.get(k) for k in ("RETENTION_STATE_DIR", "RETENTION_CACHE_DIR")}
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp:
        os.environ["RETENTION_STATE_DIR"] = str(Path(tmp) / "state")
        os.environ["RETENTION_CACHE_DIR"] = str(Path(tmp) / "cache")
        try:
            yield Path(tmp)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------

def _refusal(model: str, scorer: str, out: Path, stats: str | None) -> str | None:
    """The `Error:` line `retention run` prints for this pair, or None when it accepts the pair."""
    from retention.runs.arms import validate_arm
    from retention.errors import RetentionError

    try:
        validate_arm(_base(model, scorer, stats))
        return None
    except RetentionError:
        pass
    from click.testing import CliRunner

    from retention.cli import main

    res = CliRunner().invoke(main, ["run", "--model", model, "--scorer", scorer, "--budget", str(BUDGET),
                                    "--interval", str(INTERVAL), "--limit", str(LIMIT), "--max-new-tokens",
                                    str(MAX_NEW_TOKENS), "--temperature", "0", "--ignore-eos", "--fidelity",
                                    "--no-grade", "--quiet", "--out", str(out / "refused")])
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    if res.exit_code != 1 or len(lines) != 1 or not lines[0].startswith("Error: "):
        raise RuntimeError(f"{model}/{scorer}: expected one Error: line and exit 1, got {res.exit_code}: "
                           f"{res.stderr!r}")
    return lines[0]


def _base(model: str, scorer: str, stats: str | None = None) -> dict:
    cfg = {"model": model, "dtype": DTYPE, "device": "cpu", "budget": BUDGET, "interval": INTERVAL,
           "accounting": "mean", "sink": None, "recent": None, "protect_prompt": False, "split": "dev", "data": None,
           "limit": LIMIT, "samples": 1, "seed": SEED, "fidelity": True, "max_new_tokens": MAX_NEW_TOKENS,
           "temperature": 0.0, "top_p": 1.0, "ignore_eos": True, "scorer": scorer, "scorer_params": {}}
    if stats is not None and scorer in ("triattention", "alpha"):
        cfg["scorer_params"] = {"stats": stats}
    return cfg


def _stats_file(model: str, out: Path) -> str:
    """Calibration statistics of `model` (float64) on a fixed text, as `retention calibrate` writes them
    (per-head, or latent for an MLA model)."""
    from retention.policy.scoring.calibration import calibrate
    from retention.policy.scoring.calibration_latent import calibrate_latent, latent_model
    from retention.models import load_model

    loaded = load_model(model, dtype=DTYPE, device="cpu")
    ids = list(CALIBRATION_TEXT)
    how = calibrate_latent if latent_model(loaded.model) is not None else calibrate
    return str(how(loaded.model, ids, model_id=model).save(out / f"{model}.safetensors"))


def run_one(model: str, scorer: str, batch_size: int, problems, out: Path, stats: str | None) -> dict:
    """One golden run: its records (compared fields), traces and kept-set events, or its refusal."""
    from retention.runs.arms import validate_arm
    from retention.runs.jobs import execute
    from retention.runs.settings import Output, RunSettings

    row = {"model": model, "scorer": scorer, "batch_size": batch_size, "dtype": DTYPE}
    refused = _refusal(model, scorer, out, stats)
    if refused is not None:
        return dict(row, refusal=refused)
    cfg = _base(model, scorer, stats)
    settings = RunSettings.from_config(cfg, Output(out / f"b{batch_size}", batch_size, grade=False, progress=False))
    spec = validate_arm(cfg)
    events: list = []
    with _compaction_hooks(events):
        (run_dir,) = execute(settings, [spec], problems=problems)
    records = [json.loads(x) for x in (run_dir / "records.jsonl").read_text().splitlines()]
    trace_rows = map(json.loads, (run_dir / "trace.jsonl").read_text().splitlines())
    traces = {(t["problem_id"], t["sample"]): t for t in trace_rows}
    out_records = []
    for rec in sorted(records, key=lambda r: (r["problem_id"], r["sample"])):
        trace = traces[(rec["problem_id"], rec["sample"])]
        out_records.append(dict({k: rec[k] for k in RECORD_KEYS}, trace_steps=trace["steps"],
                                trace_tokens=trace["tokens"]))
    kept = events if batch_size == 1 else sorted(events)
    return dict(row, refusal=None, records=out_records, kept=kept)


def record_model(model: str) -> list[dict]:
    """Every golden run of one model (all scorers, both batch sizes), in a fresh private folder."""
    from protocol.splits import load_split

    with _private_dirs() as tmp, _float64_admitted(), _one_thread():
        problems = load_split("dev")[:LIMIT]
        # The models `retention calibrate` writes statistics for (MLA: latent statistics, issue 20 item 4).
        stats = _stats_file(model, tmp) if model in CALIBRATED else None
        return [run_one(model, s, b, problems, tmp / s, stats) for s in SCORERS for b in BATCH_SIZES]


def manifest() -> dict:
    import torch
    import transformers

    from retention.runs.runner import code_version

    return {"code_version": code_version(), "models": list(MODELS), "scorers": list(SCORERS), "batch_sizes": list(BATCH_SIZES), "dtype": DTYPE,
            "limit": LIMIT, "max_new_tokens": MAX_NEW_TOKENS, "budget": BUDGET, "interval": INTERVAL,
            "accounting": "mean", "seed": SEED, "temperature": 0.0, "ignore_eos": True, "fidelity": True,
            "split": "dev", "rtol": RTOL, "atol": ATOL, "recorded_with": {"torch": torch.__version__,
                                                                           "transformers": transformers.__version__},
            "recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


# --------------------------------------------------------------------------------------------
# Comparing
# --------------------------------------------------------------------------------------------

def differences(expected, actual, where: str = "") -> list[str]:
    """Where `actual` differs from `expected`: integers, strings, booleans and None exactly,
    floats to RTOL relative (ATOL absolute floor), containers element by element."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        out = [f"{where}: keys {sorted(set(expected) ^ set(actual))} differ"] if set(expected) != set(actual) else []
        for k in expected:
            if k in actual:
                out += differences(expected[k], actual[k], f"{where}.{k}")
        return out
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            return [f"{where}: length {len(actual)}, recorded {len(expected)}"]
        return [d for i, (e, a) in enumerate(zip(expected, actual)) for d in differences(e, a, f"{where}[{i}]")]
    numbers = (int, float)
    if (isinstance(expected, float) or isinstance(actual, float)) and all(
            isinstance(x, numbers) and not isinstance(x, bool) for x in (expected, actual)):
        if math.isclose(expected, actual, rel_tol=RTOL, abs_tol=ATOL):
            return []
        return [f"{where}: {actual!r}, recorded {expected!r}"]
    if type(expected) is not type(actual) or expected != actual:
        return [f"{where}: {actual!r}, recorded {expected!r}"]
    return []


def load_recorded(data_dir: Path = DATA_DIR) -> list[dict]:
    return [json.loads(x) for x in (data_dir / RUNS_FILE).read_text().splitlines() if x.strip()]


def check_model(model: str, data_dir: Path = DATA_DIR) -> list[str]:
    """Differences between a fresh run of `model`'s golden configurations and the recorded ones."""
    recorded = [r for r in load_recorded(data_dir) if r["model"] == model]
    fresh = record_model(model)
    key = lambda r: (r["scorer"], r["batch_size"])  # noqa: E731
    if sorted(map(key, recorded)) != sorted(map(key, fresh)):
        return [f"{model}: runs {sorted(map(key, fresh))}, recorded {sorted(map(key, recorded))}"]
    by_key = {key(r): r for r in recorded}
    return [d for r in fresh for d in differences(by_key[key(r)], r, f"{model}/{r['scorer']}/b{r['batch_size']}")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the recorded data instead of rewriting it")
    ap.add_argument("--models", default=",".join(MODELS), help="comma list (default: all)")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    t0 = time.perf_counter()
    if args.check:
        diffs = [d for m in models for d in check_model(m)]
        for d in diffs[:50]:
            print(d)
        print(f"{len(diffs)} difference(s) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        return 1 if diffs else 0
    if set(models) != set(MODELS):
        print("Error: rewriting records needs every model (no --models)", file=sys.stderr)
        return 1
    runs = [r for m in models for r in record_model(m)]
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    (DATA_DIR / RUNS_FILE).write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in runs))
    (DATA_DIR / MANIFEST_FILE).write_text(json.dumps(manifest(), indent=1) + "\n")
    print(f"{len(runs)} runs recorded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())

"""Ray launcher: the shards of one `retention run` as Ray tasks, one progress bar, merged at the end.

Each shard (`retention.runs.shard`) is one Ray task that runs `retention.runs.jobs.execute` for its
pairs, on `gpus_per_shard` GPUs (Ray sets `CUDA_VISIBLE_DEVICES`, so `--device cuda` is the
task's own GPU) or on CPU workers. All tasks write into the same run directories under `out`,
which must be on a file system that every node and the driver share (the usual set-up of a Ray or
Slurm cluster). A task whose worker process dies (killed, out of memory, node lost) is retried by
Ray up to `retries` times; the retry resumes from the records its shard already wrote, so nothing
is generated twice and nothing is lost. An error raised by the run itself (bad input) is not
retried. When every shard has finished, each run directory is consolidated into the layout of an
unsharded run (`retention.runs.merge.consolidate`), which checks that no pair is missing or duplicated.

`ray` is an optional dependency (`pip install 'retention[ray]'`), imported only here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from protocol import shards as layout
from retention.errors import RetentionError
from retention.runs.jobs import execute
from retention.runs.merge import consolidate
from retention.runs.settings import RunSettings
from retention.runs.shard import Shard


@dataclass(frozen=True)
class RayOptions:
    """How to run the shards: `address` None or "local" starts a private single-node cluster
    bound to the loopback address; anything else is passed to `ray.init(address=...)` ("auto",
    "ray://head:10001")."""

    address: str | None
    shards: int
    gpus_per_shard: float = 0.0
    cpus_per_shard: float = 1.0
    retries: int = 3

    def __post_init__(self):
        if not 1 <= self.shards <= 100_000:
            raise RetentionError(f"--shards must be in [1, 100000], got {self.shards}")
        if not (0 <= self.gpus_per_shard <= 1024) or not (0 < self.cpus_per_shard <= 1024):
            raise RetentionError("--gpus-per-shard must be in [0, 1024] and --cpus-per-shard in (0, 1024]")
        if not 0 <= self.retries <= 100:
            raise RetentionError(f"--retries must be in [0, 100], got {self.retries}")


def _import_ray():
    try:
        # deferred: optional dependency (ray extra)
        import ray
    except ImportError:
        raise RetentionError("--ray needs the ray package: pip install 'retention[ray]'") from None
    return ray


def _connect(ray, address: str | None) -> None:
    if ray.is_initialized():
        return
    if address in (None, "local"):
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    else:
        try:
            ray.init(address=address, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise RetentionError(f"cannot connect to the Ray cluster at {address!r}: {exc}") from None


def run_shard(settings: RunSettings, arm_specs: list, shard: Shard) -> list[str]:
    """The body of one Ray task: generate one shard (resuming its records), without a progress bar
    of its own (the driver shows one for all). Returns run dirs."""
    return [str(p) for p in execute(settings.with_output(progress=False), arm_specs, shard=shard)]


def _arm_configs(arm_specs: list) -> list[dict]:
    """The configurations the driver expects to find in config.json (before the model's id and
    revision are added), to find the run directories to watch."""
    return [spec.config for spec in arm_specs]


def _count_done(out: Path, configs: list[dict], count: int, cache: dict) -> int:
    """Records written so far by the shards of this run (all arms), read from their files."""
    done = 0
    for cfg_path in Path(out).glob("*/config.json"):
        run_dir = cfg_path.parent
        if run_dir not in cache:
            try:
                cfg = json.loads(cfg_path.read_text(encoding="utf-8")).get("config", {})
            except (ValueError, OSError):
                continue  # being written
            core = {k: v for k, v in cfg.items() if k not in ("model_id", "model_revision")}
            cache[run_dir] = core in configs
        if cache[run_dir]:
            for i in range(count):
                f = run_dir / layout.records_name(i, count)
                if f.is_file():
                    done += f.read_bytes().count(b"\n")
    return done


def launch(settings: RunSettings, arm_specs: list, opts: RayOptions, *, n_pairs: int) -> list[Path]:
    """Run the arms `arm_specs` of a run with `settings` (what `execute` takes, without `shard`) as
    `opts.shards` Ray tasks and consolidate the run directories. n_pairs: (problem, sample) pairs of
    the whole run, for the progress bar (the settings' `output.progress`). Returns the run directories."""
    ray = _import_ray()
    _connect(ray, opts.address)
    task = ray.remote(run_shard).options(num_cpus=opts.cpus_per_shard, num_gpus=opts.gpus_per_shard,
                                         max_retries=opts.retries, retry_exceptions=False)
    pending = {task.remote(settings, arm_specs, Shard(i, opts.shards)): i for i in range(opts.shards)}
    configs = _arm_configs(arm_specs)
    out = Path(settings.output.out)
    progress = settings.output.progress
    total = n_pairs * len(configs)
    bar = tqdm(total=total, disable=not progress, unit="gen", dynamic_ncols=True, desc=f"{opts.shards} shards")
    cache: dict = {}
    run_dirs: list[Path] = []
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
            for ref in ready:
                i = pending.pop(ref)
                try:
                    dirs = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - a Ray error wraps the task's own
                    raise RetentionError(_explain(ray, exc, Shard(i, opts.shards))) from None
                run_dirs = [Path(d) for d in dirs]
            bar.n = min(total, _count_done(out, configs, opts.shards, cache))
            bar.set_postfix_str(f"{opts.shards - len(pending)}/{opts.shards} shards done", refresh=False)
            bar.refresh()
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)
        bar.close()
    for d in run_dirs:
        if not d.is_dir():
            raise RetentionError(f"{d} is not visible from the driver: --out must be on a file system every "
                                 "Ray node shares")
        consolidate(d)
    return run_dirs


def _explain(ray, exc: Exception, shard: Shard) -> str:
    cause = getattr(exc, "cause", None)
    if isinstance(cause, RetentionError):
        return f"shard {shard}: {cause}"
    if isinstance(exc, (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError)):
        return (f"shard {shard}: its worker died and the retries are spent ({type(exc).__name__}); "
                "rerun the same command to resume")
    first = str(cause or exc).strip().splitlines()
    return f"shard {shard} failed: {type(cause or exc).__name__}: {first[-1] if first else ''}"


def ray_options(device: str, *, address: str | None, shards: int | None, gpus_per_shard: float | None,
                cpus_per_shard: float, retries: int, shard: Shard | None) -> RayOptions:
    """The launcher options of `retention run --ray [ADDRESS] --shards N ...`, checked (before any
    model or data is touched)."""
    if shard is not None:
        raise RetentionError("--shard and --ray exclude each other: the launcher assigns the shards")
    if address is None:
        raise RetentionError("--shards needs --ray [ADDRESS] (or run one process per --shard I/N)")
    if not address.strip():
        raise RetentionError("--ray: the address is empty; give none for a local cluster, or auto, or HOST:PORT")
    if shards is None:
        raise RetentionError("--ray needs --shards N")
    if gpus_per_shard is None:
        gpus_per_shard = 1.0 if str(device).startswith("cuda") else 0.0
    if gpus_per_shard > 0 and str(device) not in ("cuda", "cuda:0"):
        raise RetentionError("with --gpus-per-shard, pass --device cuda: each shard sees only its own GPUs")
    return RayOptions(address, shards, gpus_per_shard, cpus_per_shard, retries)


def launch_from_cli(settings: RunSettings, arm_specs: list, opts: RayOptions) -> list[Path]:
    """`retention run --ray`: count the pairs, launch the shards, merge them."""
    n_pairs = len(settings.problems.load()) * settings.problems.samples
    return launch(settings, arm_specs, opts, n_pairs=n_pairs)

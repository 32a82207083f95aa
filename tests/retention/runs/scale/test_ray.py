"""Ray launcher on a local cluster bound to the loopback address: 3 shards merged equal the
unsharded run, and a shard whose worker is killed mid-way is retried with nothing lost or duplicated.

Skipped when ray is not installed (`make test-ray` installs the extra and runs these)."""

import json
import os
import signal
import threading
import time

import pytest
from click.testing import CliRunner

from retention.cli import main

ray = pytest.importorskip("ray")

VOLATILE = {"wall_seconds", "tokens_per_second"}
ARGS = ["run", "--model", "tiny-random", "--quiet", "--scorer", "streaming", "--budget", "40", "--interval", "8",
        "--limit", "3", "--samples", "2", "--temperature", "0.7", "--ignore-eos"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray")
    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", _temp_dir=str(tmp), include_dashboard=False,
             log_to_driver=False)
    yield
    ray.shutdown()


def _stable(run_dir):
    return [{k: v for k, v in json.loads(line).items() if k not in VOLATILE}
            for line in (run_dir / "records.jsonl").read_text().splitlines() if line.strip()]


def _run(*args):
    res = CliRunner().invoke(main, [*ARGS, *map(str, args)])
    assert res.exit_code == 0, res.output
    return res


def _only_run(out):
    (d,) = [p for p in out.iterdir() if p.is_dir()]
    return d


@pytest.mark.slow
def test_three_ray_shards_equal_unsharded(cluster, tmp_path):
    _run("--max-new-tokens", 16, "--out", tmp_path / "full")
    _run("--max-new-tokens", 16, "--out", tmp_path / "ray", "--ray", "--shards", 3)
    got, want = _only_run(tmp_path / "ray"), _only_run(tmp_path / "full")
    assert got.name == want.name
    assert _stable(got) == _stable(want)
    assert (got / "trace.jsonl").read_text() == (want / "trace.jsonl").read_text()
    assert sorted(p.name for p in (got / "shards").glob("records.*")) == [
        f"records.shard-{i}-of-3.jsonl" for i in range(3)]


def _kill_when_halfway(out, stop, killed):
    """SIGKILL shard 1's worker once it has written one of its two records."""
    while not stop.is_set():
        for run_dir in out.glob("*"):
            side, recs = run_dir / "shard-1-of-3.json", run_dir / "records.shard-1-of-3.jsonl"
            if side.is_file() and recs.is_file() and recs.read_bytes().count(b"\n") == 1:
                pid = json.loads(side.read_text())["pid"]
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
        time.sleep(0.01)


@pytest.mark.slow
def test_killed_worker_is_retried_without_loss_or_duplicates(cluster, tmp_path):
    # A fraction of a second per record, one sequence at a time (a batch would finish shard 1's two
    # records in the same step): the kill lands between shard 1's two records.
    tokens = 96
    out = tmp_path / "ray"
    stop, killed = threading.Event(), []
    killer = threading.Thread(target=_kill_when_halfway, args=(out, stop, killed), daemon=True)
    killer.start()
    try:
        _run("--max-new-tokens", tokens, "--out", out, "--ray", "--shards", 3, "--retries", 2, "--batch-size", 1)
    finally:
        stop.set()
        killer.join(5)
    assert killed, "the worker finished before it could be killed"
    run_dir = _only_run(out)
    side = json.loads((run_dir / "shards" / "shard-1-of-3.json").read_text())
    assert side["pid"] != killed[0], "shard 1 was not restarted in a new worker"
    _run("--max-new-tokens", tokens, "--out", tmp_path / "full", "--batch-size", 1)
    got = _stable(run_dir)
    assert len({(r["problem_id"], r["sample"]) for r in got}) == len(got) == 6
    assert got == _stable(_only_run(tmp_path / "full"))

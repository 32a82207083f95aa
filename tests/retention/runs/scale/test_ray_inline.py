"""The Ray launcher's own code without Ray: a stand-in that runs each task inline, in order, so the
settings and arms reach every shard as `run` built them and the merged run equals the unsharded one
(the real cluster: test_ray.py, `make test-ray`)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from click.testing import CliRunner

from retention.cli import main
from retention.runs.scale import ray as launcher

VOLATILE = {"wall_seconds", "tokens_per_second"}
ARGS = ["run", "--model", "tiny-random", "--quiet", "--scorer", "streaming", "--budget", "40", "--interval", "8",
        "--limit", "2", "--samples", "2", "--max-new-tokens", "12", "--temperature", "0.7", "--ignore-eos"]


class _Ref:
    """A finished task's result (hashable, as Ray's object refs are)."""

    def __init__(self, value):
        self.value = value


class _InlineRay:
    """What the launcher calls of `ray`, each task run when it is submitted."""

    exceptions = SimpleNamespace(WorkerCrashedError=RuntimeError, NodeDiedError=RuntimeError)

    def __init__(self):
        self.calls = []

    def is_initialized(self):
        return True

    def remote(self, fn):
        calls = self.calls

        class Task:
            def options(self, **kw):
                return self

            def remote(self, *args):
                calls.append(args)
                return _Ref(fn(*args))

        return Task()

    def wait(self, refs, num_returns, timeout):
        return refs[:num_returns], refs[num_returns:]

    def get(self, ref):
        return ref.value

    def cancel(self, ref, force):
        pass


def _records(out):
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    rows = [json.loads(x) for x in (run_dir / "records.jsonl").read_text().splitlines()]
    return run_dir.name, sorted(({k: v for k, v in r.items() if k not in VOLATILE} for r in rows),
                                key=lambda r: (r["problem_id"], r["sample"]))


def test_inline_shards_merge_to_the_unsharded_run(tmp_path, monkeypatch):
    fake = _InlineRay()
    monkeypatch.setattr(launcher, "_import_ray", lambda: fake)
    res = CliRunner().invoke(main, [*ARGS, "--ray", "--shards", "2", "--out", str(tmp_path / "ray")])
    assert res.exit_code == 0, res.output
    assert CliRunner().invoke(main, [*ARGS, "--out", str(tmp_path / "one")]).exit_code == 0
    assert _records(tmp_path / "ray") == _records(tmp_path / "one")
    settings, specs, shard = fake.calls[0]
    assert (settings.model, settings.problems.samples, settings.sampling.max_new_tokens) == ("tiny-random", 2, 12)
    assert [str(c[2]) for c in fake.calls] == ["0/2", "1/2"] and specs[0].name == "streaming"

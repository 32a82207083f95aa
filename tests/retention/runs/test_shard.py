"""The shard rule: every (problem, sample) pair in exactly one shard, balanced, from I/N or the environment."""

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from retention.cli import main
from retention.errors import RetentionError
from retention.runs.shard import Shard, parse_shard, shard_pairs


@settings(max_examples=200, deadline=None)
@given(n_problems=st.integers(0, 200), samples=st.integers(1, 8), count=st.integers(1, 64))
def test_every_pair_in_exactly_one_shard(n_problems, samples, count):
    everything = list(shard_pairs(n_problems, samples, None))
    assert len(everything) == n_problems * samples
    parts = [list(shard_pairs(n_problems, samples, Shard(i, count))) for i in range(count)]
    union = [pair for part in parts for pair in part]
    assert len(union) == len(set(union)), "a pair is in two shards"
    assert set(union) == set(everything), "a pair is in no shard"
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    for part in parts:  # each shard keeps the run's order
        assert part == sorted(part)


def test_parse_explicit_and_auto():
    assert parse_shard(None) is None
    assert parse_shard("2/8") == Shard(2, 8)
    assert parse_shard("auto", {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "4"}) == Shard(3, 4)
    assert parse_shard("auto", {"RANK": "5", "WORLD_SIZE": "8"}) == Shard(5, 8)
    # Slurm wins over a RANK that some launchers also export
    env = {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2", "RANK": "0", "WORLD_SIZE": "1"}
    assert parse_shard("auto", env) == Shard(1, 2)


@pytest.mark.parametrize("text,env,needle", [
    ("3/3", {}, "0 <= I < N"),
    ("-1/3", {}, "expected I/N"),
    ("1/0", {}, "0 <= I < N"),
    ("a/b", {}, "expected I/N"),
    ("1", {}, "expected I/N"),
    ("1/999999999999", {}, "0 <= I < N"),
    ("auto", {}, "no SLURM_ARRAY_TASK_ID"),
    ("auto", {"RANK": "1"}, "must both be integers"),
    ("auto", {"SLURM_ARRAY_TASK_ID": "8", "SLURM_ARRAY_TASK_COUNT": "8", "SLURM_ARRAY_TASK_MIN": "1"}, "--array=0-7"),
])
def test_parse_refuses(text, env, needle):
    with pytest.raises(RetentionError, match=needle.replace("(", r"\(")):
        parse_shard(text, env)


def test_cli_refuses_bad_shard_with_one_line(tmp_path):
    res = CliRunner().invoke(main, ["run", "--model", "tiny-random", "--scorer", "full", "--shard", "4/4",
                                    "--out", str(tmp_path / "o")])
    assert res.exit_code != 0
    assert res.output.strip().count("\n") == 0 and res.output.startswith("Error: ")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("extra,needle", [
    (["--shards", "3"], "--shards needs --ray"),
    (["--ray", "--shards", "0"], "--shards must be in"),
    (["--ray"], "--ray needs --shards"),
    (["--ray", "--shards", "2", "--shard", "0/2"], "exclude each other"),
    (["--ray", "--shards", "2", "--gpus-per-shard", "nan"], "--gpus-per-shard"),
    (["--ray", "--shards", "2", "--gpus-per-shard", "1", "--device", "cuda:1"], "cuda"),  # no CUDA here: refused at the device
])
def test_launcher_options_refused_before_anything_runs(tmp_path, extra, needle):
    res = CliRunner().invoke(main, ["run", "--model", "tiny-random", "--scorer", "full", *extra,
                                    "--out", str(tmp_path / "o")])
    assert res.exit_code != 0 and res.output.startswith("Error: "), res.output
    assert needle in res.output, res.output
    assert not (tmp_path / "o").exists()

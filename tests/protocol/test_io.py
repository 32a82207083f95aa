"""protocol.io: strict JSON, atomic writes, JSONL reading rules, locks."""

import json
import os
import stat
from pathlib import Path

import pytest

from protocol import io
from protocol.errors import ProtocolError


@pytest.mark.parametrize("value", ["\ud800", "a\udfffb", "\x00", "nul\x00 and \ud83d lone", "é ✓ 😀"])
def test_any_json_string_round_trips_through_every_writer(tmp_path, value):
    obj = {"s": value, value: [value]}
    assert json.loads(io.dumps(obj)) == obj
    assert json.loads(io.canonical_json(obj)) == obj
    io.write_json(tmp_path / "a.json", obj)
    assert io.load_json(tmp_path / "a.json") == obj
    io.write_jsonl(tmp_path / "a.jsonl", [obj, obj])
    assert io.read_jsonl(tmp_path / "a.jsonl").objects == [obj, obj]
    io.append_line(tmp_path / "b.jsonl", io.jsonl_line(obj))
    assert io.read_jsonl(tmp_path / "b.jsonl").objects == [obj]
    (tmp_path / "a.json").read_bytes().decode("utf-8")  # the file itself is valid UTF-8


def test_canonical_json_is_stable_for_plain_text():
    assert io.canonical_json({"b": 1, "a": "é"}) == '{"a":"é","b":1}'


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), {"x": [float("-inf")]}])
def test_no_nan_out(bad, tmp_path):
    with pytest.raises(ProtocolError, match="not plain JSON"):
        io.dumps(bad)
    with pytest.raises(ProtocolError):
        io.canonical_json(bad)
    with pytest.raises(ProtocolError):
        io.write_json(tmp_path / "x.json", bad)
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("text", ["NaN", '{"a": Infinity}', "[-Infinity]", "[" * 100_000 + "]" * 100_000,
                                  '{"a": 1', b"\xff\xfe{}"])
def test_strict_json_in(text, tmp_path):
    p = tmp_path / "in.json"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ProtocolError, match=str(p)):
        io.load_json(p)


def test_write_atomic_keeps_mode_and_names_user_path(tmp_path):
    p = tmp_path / "out.jsonl"
    p.write_text("old\n")
    os.chmod(p, 0o640)
    io.write_atomic(p, "new\n")
    assert p.read_text() == "new\n"
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o640
    fresh = tmp_path / "fresh.txt"
    io.write_atomic(fresh, "x")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o666 & ~umask
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ProtocolError) as info:
        io.write_atomic(blocker / "under.json", "x")
    assert str(blocker / "under.json") in str(info.value) and ".tmp" not in str(info.value)
    assert [q.name for q in tmp_path.iterdir() if q.name.startswith(".")] == []


def test_read_jsonl_tolerates_only_a_half_written_last_line(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_bytes(b'{"a": 1}\n{"a": 2}\n{"a": 3')
    got = io.read_jsonl(p, "record")
    assert got.objects == [{"a": 1}, {"a": 2}] and got.partial_tail
    assert got.valid_end == len(b'{"a": 1}\n{"a": 2}\n')
    # a complete object whose newline was lost is still an unfinished write
    p.write_bytes(b'{"a": 1}\n{"a": 2}')
    got = io.read_jsonl(p)
    assert got.objects == [{"a": 1}] and got.partial_tail and got.valid_end == 9
    # strict input files take the unterminated last line as a line
    assert io.read_jsonl(p, tolerate_partial_tail=False).objects == [{"a": 1}, {"a": 2}]


@pytest.mark.parametrize("middle", [b"garbage", b'{"a": NaN}', b"\xff\xfe", b"[1, 2]", b'{"a": 1'])
def test_read_jsonl_refuses_a_corrupt_earlier_line_with_its_number(tmp_path, middle):
    p = tmp_path / "r.jsonl"
    p.write_bytes(b'{"a": 1}\n' + middle + b'\n{"a": 3}\n')
    with pytest.raises(ProtocolError, match=r"r\.jsonl:2: .*unreadable record line"):
        io.read_jsonl(p, "record")


def test_read_jsonl_missing_and_blank_lines(tmp_path):
    with pytest.raises(ProtocolError, match="not found"):
        io.read_jsonl(tmp_path / "none.jsonl")
    p = tmp_path / "b.jsonl"
    p.write_bytes(b'\n{"a": 1}\n\n')
    assert io.read_jsonl(p).rows == [(2, {"a": 1})]


def test_exclusive_lock_refuses_a_second_holder(tmp_path):
    with io.exclusive_lock(tmp_path / ".lock", "run"):
        with pytest.raises(ProtocolError, match="another run is using"):
            with io.exclusive_lock(tmp_path / ".lock", "run"):
                pass
    with io.exclusive_lock(tmp_path / ".lock", "run"):
        pass


def test_ensure_dir_errors_are_one_line(tmp_path):
    f = tmp_path / "f"
    f.write_text("")
    for bad in (f, f / "sub"):
        with pytest.raises(ProtocolError, match=str(f)):
            io.ensure_dir(bad)


def test_check_writable_probes_without_creating(tmp_path):
    target = tmp_path / "a" / "b" / "out.json"
    assert io.check_writable(target) == target
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ProtocolError, match="cannot write in /proc"):
        io.check_writable(Path("/proc/nonexistent/x"))
    (tmp_path / "f").write_text("")
    with pytest.raises(ProtocolError, match="is a file"):
        io.check_writable(tmp_path / "f" / "x")
    with pytest.raises(ProtocolError, match="is a folder"):
        io.check_writable(tmp_path)

"""`retention splits verify|show` and `retention grade`: frozen splits and answer grading.

Everything heavy (the data, sympy, the grading workers) is imported inside the commands, so
`retention --help` stays fast. Expected failures raise `ProtocolError` / `click.ClickException`,
which the CLI prints as one line with exit status 1.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import click

from protocol.errors import ProtocolError
from retention.cli.options import splits_dir_option

_DATA_HELP = "MATH-500 JSONL to use (default: the verified copy shipped in the package)."


@click.group("splits")
def splits() -> None:
    """Frozen dev/confirm splits of MATH-500 (recomputed from the data on every use)."""


@splits.command("verify")
@click.option("--data", type=click.Path(dir_okay=False, path_type=Path), default=None, help=_DATA_HELP)
@splits_dir_option
def splits_verify(data: Path | None, splits_dir: Path | None) -> None:
    """Recompute the splits from the data and compare with the committed lists and manifest."""
    from protocol.splits import verify_splits

    info = verify_splits(data, splits_dir)
    counts = info["counts"]
    click.echo(f"splits OK: dev {counts['dev']} + confirm {counts['confirm']} ids, "
               f"salt {info['salt']!r}, dataset sha256 {info['dataset_sha256']}, "
               f"manifest sha256 {info['manifest_sha256']}")


@splits.command("show")
@click.option("--split", "name", type=click.Choice(["dev", "confirm"]), required=True,
              help="Which split to list.")
@click.option("--data", type=click.Path(dir_okay=False, path_type=Path), default=None, help=_DATA_HELP)
@splits_dir_option
def splits_show(name: str, data: Path | None, splits_dir: Path | None) -> None:
    """Print the problem ids of a split, one per line, after verifying the splits."""
    from protocol.splits import split_ids

    click.echo("\n".join(split_ids(name, data, splits_dir)))


def _read_records(path: Path) -> list[tuple[int, dict]]:
    from protocol.data import read_json_objects

    records = read_json_objects(path)
    if not records:
        raise ProtocolError(f"{path}: no records")
    return records


def _problem_texts(records: list[tuple[int, dict]], data: Path | None) -> list[str | None]:
    """Each record's problem text (its own `problem`, else the MATH-500 problem of its `problem_id`;
    None when neither is known): the grader reads a multiple-choice problem's options from it."""
    from protocol.splits import problems_by_id

    by_id = problems_by_id(data) if any(isinstance(r.get("problem_id"), str) for _, r in records) else {}
    out = []
    for _, rec in records:
        text = rec.get("problem")
        if not isinstance(text, str):
            p = by_id.get(rec.get("problem_id")) if isinstance(rec.get("problem_id"), str) else None
            text = p.problem if p is not None else None
        out.append(text)
    return out


def _finish_reasons(path: Path, records: list[tuple[int, dict]]) -> list[str | None]:
    """Each record's `finish_reason` as a run writes it ("length": cut off at the token limit, so
    only an explicitly marked final is graded); None where the record has none."""
    out = []
    for n, rec in records:
        reason = rec.get("finish_reason")
        if reason is not None and not isinstance(reason, str):
            raise ProtocolError(f"{path}:{n}: 'finish_reason' must be a string or null")
        out.append(reason)
    return out


def _pairs(path: Path, records: list[tuple[int, dict]], data: Path | None) -> list[tuple]:
    by_id = None
    pairs = []
    for n, rec in records:
        if "pred" in rec:
            pred = rec["pred"]
        elif "text" in rec:
            pred = rec["text"]
        else:
            raise ProtocolError(f"{path}:{n}: record has neither 'pred' nor 'text'")
        if pred is not None and not isinstance(pred, str):
            raise ProtocolError(f"{path}:{n}: 'pred'/'text' must be a string or null")
        gold = rec.get("gold")
        if gold is None:
            pid = rec.get("problem_id")
            if pid is None:
                raise ProtocolError(f"{path}:{n}: record has neither 'gold' nor 'problem_id'")
            if not isinstance(pid, str):
                raise ProtocolError(f"{path}:{n}: 'problem_id' must be a string, got {type(pid).__name__}")
            if by_id is None:
                from protocol.splits import problems_by_id

                by_id = problems_by_id(data)
            if pid not in by_id:
                raise ProtocolError(f"{path}:{n}: unknown problem_id {pid!r}")
            gold = by_id[pid].answer
        elif isinstance(gold, (int, float)) and not isinstance(gold, bool):
            gold = str(gold)
        elif not isinstance(gold, str):
            raise ProtocolError(f"{path}:{n}: 'gold' must be a string")
        pairs.append((pred, gold))
    return pairs


def summary_line(grades) -> str:
    n = len(grades)
    correct = sum(g.verdict is True for g in grades)
    wrong = sum(g.verdict is False for g in grades)
    reasons = Counter(g.reason for g in grades if g.verdict is None)
    detail = ", ".join(f"{r} {reasons.get(r, 0)}" for r in ("no_answer", "timeout", "unparsable"))
    return f"graded {n}: {correct} correct, {wrong} wrong, {n - correct - wrong} ungradable ({detail})"


def _second_opinions(pairs, judge: str, timeout: float, workers: int):
    from protocol.grading import second_opinions

    return second_opinions(pairs, judge, timeout=timeout, workers=workers)


def compare_line(grades, opinions) -> str:
    """How the two graders' credit compares: agreement and the two kinds of disagreement."""
    n = len(grades)
    only_ours = sum(g.verdict is True and o.verdict is not True for g, o in zip(grades, opinions))
    only_theirs = sum(g.verdict is not True and o.verdict is True for g, o in zip(grades, opinions))
    ungradable = sum(o.verdict is None for o in opinions)
    return (f"math-verify agrees on {n - only_ours - only_theirs}/{n}; disagreements "
            f"{only_ours + only_theirs} (credited only by this grader {only_ours}, only by "
            f"math-verify {only_theirs}); math-verify ungradable {ungradable}")


@click.command("grade")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the graded records here (atomically; may name FILE to update it in place). "
                   "Default: records to stdout, the summary to stderr.")
@click.option("--data", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="MATH-500 JSONL for records that carry 'problem_id' instead of 'gold' "
                   "(default: the shipped copy).")
@click.option("--timeout", type=click.FloatRange(min=0, max=3600, min_open=True), default=5.0,
              show_default=True, help="Seconds allowed per answer before it is 'timeout'.")
@click.option("--workers", type=click.IntRange(min=1, max=64), default=2, show_default=True,
              help="Grading processes run in parallel.")
@click.option("--compare", type=click.Choice(["math-verify"]), default=None,
              help="Also grade with math-verify (optional extra 'mathverify'), in the same killable "
                   "workers and timeout; each record gets its verdict under 'math_verify'.")
@click.option("--disagreements", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --compare: write every record on which the two graders disagree about "
                   "credit here (JSONL, both verdicts; atomically).")
def grade(file: Path, out: Path | None, data: Path | None, timeout: float, workers: int,
          compare: str | None, disagreements: Path | None) -> None:
    """Grade the JSONL records of FILE: each needs 'pred' (or 'text') and 'gold' (or 'problem_id').

    A record's 'problem' (else the MATH-500 problem of its 'problem_id') is read too: an answer that
    restates the problem's own expression earns no credit. A record whose 'finish_reason' is
    'length' (cut off at the token limit) is graded only on an explicitly marked final answer.
    Each record is written back with 'extracted', 'verdict', 'reason' and 'rule' added.
    """
    from protocol.grading import grade_many
    from protocol.io import dumps, write_atomic

    from protocol.io import check_writable

    if timeout != timeout:  # click's FloatRange lets nan through (every comparison is false)
        raise click.BadParameter("nan is not a number of seconds", param_hint="'--timeout'")
    if out is not None:
        check_writable(out, "--out")
    if data is not None:
        from protocol.splits import problems_by_id

        problems_by_id(data)  # a given --data is verified now, used or not
    if disagreements is not None and compare is None:
        raise ProtocolError("--disagreements needs --compare")
    if compare is not None:
        from protocol.grading import mathverify

        if mathverify.version() is None:
            raise ProtocolError("math-verify is not installed: pip install 'retention[mathverify]'")
    records = _read_records(file)
    pairs = _pairs(file, records, data)
    grades = grade_many(pairs, timeout=timeout, workers=workers, problems=_problem_texts(records, data),
                        finish_reasons=_finish_reasons(file, records))
    opinions = _second_opinions(pairs, compare, timeout, workers) if compare else None
    lines, differ = [], []
    for k, ((n, rec), g) in enumerate(zip(records, grades)):
        rec.update(g.as_record())
        if opinions is not None:
            rec["math_verify"] = opinions[k].as_record()
            if (g.verdict is True) != (opinions[k].verdict is True):
                differ.append(dumps({"line": n, "pred": pairs[k][0], "gold": pairs[k][1],
                                     "extracted": g.extracted, "verdict": g.verdict,
                                     "reason": g.reason, "math_verify": rec["math_verify"]}) + "\n")
        lines.append(dumps(rec) + "\n")
    line = summary_line(grades)
    if opinions is not None:
        line += "; " + compare_line(grades, opinions)
        if disagreements is not None:
            write_atomic(disagreements, "".join(differ))
            line += f" (written to {disagreements})"
    if out is None:
        # Bytes, not text: a terminal's encoding must not fail on text the JSON escapes carry.
        sys.stdout.buffer.write("".join(lines).encode("utf-8"))
        sys.stdout.flush()
        click.echo(line, err=True)
    else:
        write_atomic(out, "".join(lines))
        click.echo(f"{line} -> {out}")


commands = [splits, grade]

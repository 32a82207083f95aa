"""Answer equivalence with sympy. Runs inside a grading worker process (see `worker`).

`judge(pred, gold)` returns True/False or raises `Unparsable`. It never evaluates model text as
Python: answers are normalised and parsed into a tree (`normalize`), leaves become sympy values
under guards (`evaluate`), scalars are compared by `scalars`, and this module compares the trees
(lists, tuples, sets, intervals, equations, inequalities, times, text). The guards that keep
hostile leaves cheap (lengths, nesting, digit counts, powers, factorials, opaque sums and
integrals, matrix sizes) are listed in `evaluate`'s docstring.

The hard wall-clock and memory limits are the worker's job; these guards make the common hostile
inputs cheap instead of relying on the kill.

Equality rules (the protocol's): exact string equality after normalisation is always equal;
otherwise exact symbolic equality (rationals compared exactly, decimals read as exact rationals),
then a numeric tolerance only when one side is a bare decimal with at least 3 significant digits
and the other an exact value that is not a terminating decimal (``\\sqrt{17}`` vs
``4.123105625617661``: equal when they agree to within one unit of the decimal's last place).
"""

from __future__ import annotations

import re

import sympy
from sympy.core.function import AppliedUndef
from sympy.matrices import MatrixBase

from protocol.grading.evaluate import MAX_DEPTH, Scalar, Unparsable, nesting, to_relations, to_scalar
from protocol.grading.normalize import (MAX_ANSWER_CHARS, Chain, Clock, Dots, Interval, Leaf, Member, Node,
                                        NormalizeError, Rel, Seq, Text, Union, canonical, compact,
                                        parse)
from protocol.grading.leaves import text_key
from protocol.grading.notation import decimal_comma
from protocol.grading.scalars import const_ratio, expr_equal, free, scalar_equal

__all__ = ["judge", "Unparsable", "MAX_INPUT_CHARS"]

MAX_INPUT_CHARS = MAX_ANSWER_CHARS  # one whole answer


def judge(pred: str, gold: str) -> bool:
    """Whether the extracted answer `pred` means the same as the reference `gold`."""
    if len(pred) > MAX_INPUT_CHARS or len(gold) > MAX_INPUT_CHARS:
        if pred.strip() == gold.strip():
            return True
        raise Unparsable(f"answer longer than {MAX_INPUT_CHARS} characters")
    cp, cg = canonical(pred), canonical(gold)
    if compact(cp) == compact(cg):
        return True
    for c in (cp, cg):  # the structure parser recurses per bracket level: bound it first
        if nesting(c) > 2 * MAX_DEPTH:
            raise Unparsable(f"nesting deeper than {2 * MAX_DEPTH}")
    try:
        cg = decimal_comma(cg, strict=True) or cg  # `3{,}5`, `1.234,56`: never a list
        ng = parse(cg)
        if isinstance(ng, Leaf):
            # against one number, `3,5` can only mean 3.5 (a list never equals a number)
            cp = decimal_comma(cp) or cp
        np_ = parse(cp)
    except NormalizeError as exc:
        raise Unparsable(str(exc)) from None
    return _Comparator().equal(np_, ng)


# --------------------------------------------------------------------------------- comparator

class _Comparator:
    def __init__(self):
        self._scalars: dict[Leaf, Scalar] = {}

    # ---- leaves
    def scalar(self, leaf: Leaf) -> Scalar:
        got = self._scalars.get(leaf)
        if got is None:
            got = self._scalars[leaf] = to_scalar(leaf)
        return got

    # ---- dispatch
    def equal(self, a: Node, b: Node) -> bool:
        if a == b:
            return True
        if isinstance(a, Text) or isinstance(b, Text):
            return self._text_equal(a, b)
        if isinstance(a, Dots) or isinstance(b, Dots):
            return False
        if isinstance(a, Chain) or isinstance(b, Chain):
            return self._chain_equal(a, b)
        if isinstance(a, Clock) or isinstance(b, Clock):
            return isinstance(a, Clock) and isinstance(b, Clock) and _clock_equal(a, b)
        if isinstance(a, Member) and isinstance(b, Member):
            return self.equal(a.elem, b.elem) and self.equal(a.container, b.container)
        if isinstance(a, Member):
            return self.equal(a.container, b)
        if isinstance(b, Member):
            return self.equal(a, b.container)
        if isinstance(a, Rel) and isinstance(b, Rel):
            return self._rel_equal(a, b)
        if self._setlike(a) or self._setlike(b) or isinstance(a, Rel) or isinstance(b, Rel):
            return self._set_equal(a, b)  # `-793 < a < 10` vs `(-793, 10)`: compared as sets
        if isinstance(a, Seq) and isinstance(b, Seq):
            return self._seq_equal(a, b)
        if isinstance(a, Seq):
            return self._list_vs_one(a, b)
        if isinstance(b, Seq):
            return self._list_vs_one(b, a)
        if isinstance(a, Leaf) and isinstance(b, Leaf):
            return scalar_equal(self.scalar(a), self.scalar(b))
        return False

    # ---- text
    def _text_equal(self, a: Node, b: Node) -> bool:
        ta = a.text if isinstance(a, Text) else (text_key(a.text) if isinstance(a, Leaf) else None)
        tb = b.text if isinstance(b, Text) else (text_key(b.text) if isinstance(b, Leaf) else None)
        return ta is not None and ta == tb

    # ---- lists, tuples, sets
    @staticmethod
    def _kind(s: Seq) -> str:
        return "list" if s.kind == "pm" else s.kind

    def _seq_equal(self, a: Seq, b: Seq) -> bool:
        ka, kb = self._kind(a), self._kind(b)
        if {ka, kb} == {"set", "tuple"}:
            return False
        # `a = 3, b = 4` against `3, 4`: the names give the unnamed list its order
        named = self._distinct_names(a) != self._distinct_names(b)
        ordered = named or "tuple" in (ka, kb) or any(isinstance(x, Dots) for x in a.items + b.items)
        if ordered:
            return len(a.items) == len(b.items) and all(
                self.equal(x, y) for x, y in zip(a.items, b.items))
        ua, ub = self._dedupe(a.items), self._dedupe(b.items)
        if len(ua) != len(ub):
            return False
        unused = list(ub)
        for x in ua:
            hit = next((i for i, y in enumerate(unused) if self.equal(x, y)), None)
            if hit is None:
                return False
            unused.pop(hit)
        return True

    def _distinct_names(self, s: Seq) -> bool:
        """Whether every item is an equation naming a different unknown (`a = 3, b = 4`): the
        answers to different parts, never an unordered set of values."""
        if len(s.items) < 2 or not all(isinstance(x, Chain) for x in s.items):
            return False
        labels = [self._label_of(x) for x in s.items]
        if any(lb is None for lb in labels):
            return False
        names = [compact(_node_text(lb)) for lb in labels]
        return len(set(names)) == len(names)

    def _dedupe(self, items) -> list[Node]:
        out: list[Node] = []
        for x in items:
            if not any(x == y for y in out) and not any(self.equal(x, y) for y in out):
                out.append(x)
        return out

    def _list_vs_one(self, seq: Seq, other: Node) -> bool:
        if self._kind(seq) == "tuple":
            if isinstance(other, Leaf):
                return self._vector_equal(other, seq)
            return False
        # `\boxed{15\frac{39}{40}} or \boxed{\frac{639}{40}}`: every item states the same answer
        return bool(seq.items) and all(self.equal(x, other) for x in seq.items)

    def _vector_equal(self, leaf: Leaf, seq: Seq) -> bool:
        v = self.scalar(leaf).expr
        if not isinstance(v, MatrixBase) or min(v.shape) != 1 or len(v) != len(seq.items):
            return False
        return all(isinstance(y, Leaf) and expr_equal(v[i], self.scalar(y).expr, False)
                   for i, y in enumerate(seq.items))

    # ---- equations
    def _label_of(self, c: Chain) -> Node | None:
        first = c.parts[0]
        try:
            if isinstance(first, Leaf) and self.scalar(first).label:
                return first
            if isinstance(first, Seq) and first.kind == "tuple" and all(
                    isinstance(x, Leaf) and self.scalar(x).label for x in first.items):
                return first
        except Unparsable:
            return None
        return None

    def _value_of(self, c: Chain) -> Node | None:
        """The value a chain states: after a label (`x = 5+5+1 = 11`), or the last of a chain of
        constants (`\\frac12 = \\frac{10}{9}` written as working)."""
        if self._label_of(c) is not None:
            return c.parts[-1]
        try:
            if all(isinstance(p, Leaf) and not free(self.scalar(p).expr) for p in c.parts):
                return c.parts[-1]
        except Unparsable:
            return None
        return None

    def _chain_equal(self, a: Node, b: Node) -> bool:
        if isinstance(a, Chain) and isinstance(b, Chain):
            la, lb = self._label_of(a), self._label_of(b)
            if la is not None and lb is not None:
                if (compact(_node_text(la)) == compact(_node_text(lb)) or self._same_label(la, lb)
                        or _function_names(la, lb)):
                    return self.equal(a.parts[-1], b.parts[-1])
            if self._equations_equal(a, b):
                return True
            va, vb = self._value_of(a), self._value_of(b)
            if va is not None and vb is not None and (la is None or lb is None):
                return self.equal(va, vb)
            return False
        chain, other = (a, b) if isinstance(a, Chain) else (b, a)
        v = self._value_of(chain)
        return v is not None and self.equal(v, other)

    def _same_label(self, la: Node, lb: Node) -> bool:
        if isinstance(la, Leaf) and isinstance(lb, Leaf):
            return self.scalar(la).expr == self.scalar(lb).expr
        return False

    def _equations_equal(self, a: Chain, b: Chain) -> bool:
        """Same equation up to a nonzero constant factor: `y = -x/2 + 3/4` ~ `2x + 4y - 3 = 0`."""
        sides = []
        for c in (a, b):
            l, r = c.parts[0], c.parts[-1]
            if not (isinstance(l, Leaf) and isinstance(r, Leaf)):
                return False
            sl, sr = self.scalar(l), self.scalar(r)
            if isinstance(sl.expr, MatrixBase) or isinstance(sr.expr, MatrixBase):
                return False
            sides.append((sl.expr - sr.expr, sl.heavy or sr.heavy))
        (ea, ha), (eb, hb) = sides
        if not (free(ea) or free(eb)):
            return False  # constant chains are values, handled by the caller
        ratio = const_ratio(ea, eb, ha or hb)
        return ratio is not None and ratio != 0

    # ---- inequalities and sets
    def _relations(self, r: Rel):
        return to_relations(r.text)

    @staticmethod
    def _normal_ineq(lhs, op, rhs):
        """(e, op') with op' in {'>', '>=', '!='} such that the relation is `e op' 0`."""
        if op in (">", ">="):
            return lhs - rhs, op
        if op in ("<", "<="):
            return rhs - lhs, ">" if op == "<" else ">="
        if op == "!=":
            return lhs - rhs, "!="
        return None, None

    def _rel_equal(self, a: Rel, b: Rel) -> bool:
        ra, rb = self._relations(a), self._relations(b)
        if len(ra) == 1 and len(rb) == 1:
            ea, oa = self._normal_ineq(*ra[0][:3])
            eb, ob = self._normal_ineq(*rb[0][:3])
            if ea is not None and oa == ob:
                ratio = const_ratio(ea, eb, ra[0][3] or rb[0][3])
                if ratio is not None:
                    return ratio != 0 if oa == "!=" else bool(ratio > 0)
        sa, sb = self._rel_set(ra), self._rel_set(rb)
        return sa is not None and sb is not None and self._sympy_sets_equal(sa, sb)

    def _rel_set(self, rels):
        """The solution set over the reals of a univariate (chained) inequality, or None."""
        if any(h for *_, h in rels):
            return None
        exprs = [e for l, _, r, _ in rels for e in (l, r)]
        undefs = set().union(*(e.atoms(AppliedUndef) for e in exprs))
        free = set().union(*(e.free_symbols for e in exprs))
        inside = set().union(*(u.free_symbols for u in undefs)) if undefs else set()
        if len(undefs) == 1 and not (free - inside):
            var = next(iter(undefs))  # 0 < f(x) < 1: f(x) is the unknown
        elif not undefs and len(free) == 1:
            var = next(iter(free))
        else:
            return None
        t = sympy.Dummy("t", real=True)
        conds = []
        for l, op, r, _ in rels:
            conds.append(sympy.Rel(l.xreplace({var: t}), r.xreplace({var: t}), op))
        try:
            return sympy.And(*conds).as_set()
        except Exception:  # not solvable by sympy's univariate solver
            return None

    @staticmethod
    def _setlike(n: Node) -> bool:
        return isinstance(n, (Interval, Union)) or (isinstance(n, Seq) and n.kind == "set")

    def _to_set(self, n: Node):
        if isinstance(n, Interval):
            a, b = self._real_const(n.a), self._real_const(n.b)
            if a is None or b is None:
                return None
            return sympy.Interval(a, b, n.left == "(", n.right == ")")
        if isinstance(n, Seq) and n.kind == "tuple" and len(n.items) == 2:
            a, b = self._real_const(n.items[0]), self._real_const(n.items[1])  # (a, b) as an interval
            return None if a is None or b is None else sympy.Interval.open(a, b)
        if isinstance(n, Seq) and self._kind(n) in ("set", "list"):
            vals = [self._real_const(x) for x in n.items]
            return None if any(v is None for v in vals) else sympy.FiniteSet(*vals)
        if isinstance(n, Union):
            parts = [self._to_set(p) for p in n.parts]
            return None if any(p is None for p in parts) else sympy.Union(*parts)
        if isinstance(n, Rel):
            return self._rel_set(self._relations(n))
        if isinstance(n, Member):
            return self._to_set(n.container)
        return None

    def _real_const(self, n: Node):
        if not isinstance(n, Leaf):
            return None
        v = self.scalar(n).expr
        if isinstance(v, MatrixBase) or free(v) or v.is_extended_real is False:
            return None
        return v

    def _set_equal(self, a: Node, b: Node) -> bool:
        if isinstance(a, Interval) and isinstance(b, Interval):
            if a.left == b.left and a.right == b.right and self.equal(a.a, b.a) and self.equal(a.b, b.b):
                return True
        if isinstance(a, Union) and isinstance(b, Union) and len(a.parts) == len(b.parts):
            if self._seq_equal(Seq("set", a.parts), Seq("set", b.parts)):
                return True
        sa, sb = self._to_set(a), self._to_set(b)
        if sa is None or sb is None:
            return False
        return self._sympy_sets_equal(sa, sb)

    @staticmethod
    def _sympy_sets_equal(sa, sb) -> bool:
        if sa == sb:
            return True
        try:
            diff = sa.symmetric_difference(sb)
            return diff.is_empty is True
        except Exception:  # sympy cannot decide: not provably equal
            return False


_FUNCTION = re.compile(r"[A-Za-z]\(([A-Za-z])\)")


def _function_names(la: Node, lb: Node) -> bool:
    """`y` against `f(x)`, or `f(x)` against `g(x)` (one-letter functions of the same variable):
    names for the same function, so `f(x) = 2x + 3` ~ `y = 2x + 3` when the right sides are
    equal. Only those pairs: `x = 3` and `y = 3` name different unknowns, `f(x) = 3` is not
    `x = 3`, and `y = 2` is not `f(2) = 2`."""
    a, b = compact(_node_text(la)), compact(_node_text(lb))
    fa, fb = _FUNCTION.fullmatch(a), _FUNCTION.fullmatch(b)
    if fa and fb:
        return fa.group(1) == fb.group(1)
    return (a == "y" and fb is not None) or (b == "y" and fa is not None)


def _clock_equal(a: Clock, b: Clock) -> bool:
    """Same time of day. A bare ``5:30`` (hour 1-12, no a.m./p.m.) is read on a 12-hour dial:
    it matches ``5:30 a.m.`` and ``5:30 p.m.``, never ``6:30``. Everything else must name the
    same instant: ``17:30`` = ``5:30 p.m.``, but ``5:30`` is not ``17:30`` (a bare 24-hour time
    is not the spelling of an a.m./p.m. one, and two different spellings of times that may
    differ are not credited)."""
    if a.seconds == b.seconds:
        return True
    if {a.meridiem, b.meridiem} in ({None, "am"}, {None, "pm"}):
        return a.seconds % 43200 == b.seconds % 43200
    return False


def _node_text(n: Node) -> str:
    if isinstance(n, Leaf):
        return n.text
    if isinstance(n, Seq):
        return "(" + ",".join(_node_text(x) for x in n.items) + ")"
    return repr(n)

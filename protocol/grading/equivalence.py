"""Answer equivalence with sympy. Runs inside a grading worker process (see `worker`).

`judge(pred, gold)` returns True/False or raises `Unparsable`. It never evaluates model text as
Python: leaves are parsed by `latex2sympy2_extended` (an ANTLR LaTeX grammar that builds sympy
objects with ``evaluate=False``), then rebuilt bottom-up by `_Evaluator`, which refuses work that
can blow up before sympy sees it:

* string guards per answer and per leaf: length, bracket nesting depth, digits per number
  literal, and no constructs the grammar would compute while parsing (matrix operations behind
  ``\operatorname``, large ``\det``, ``\gcd``/``\binom``/``\Gamma`` of non-small arguments);
* powers and ``exp``/``sinh``/``cosh`` whose value would have more than `MAX_VALUE_DIGITS` digits,
  factorials above `MAX_FACTORIAL`, binomials of big arguments, sums, products, integrals,
  limits and derivatives are never evaluated: each becomes an *opaque symbol* named by a hash of
  its (unevaluated) tree, so two identical spellings still compare equal and ``4^{10^{10}}`` can
  never equal ``4``;
* a power with an integer exponent above `MAX_SYMBOLIC_POWER` (or a non-rational numeric one)
  marks the value *heavy*: no expand/simplify on it, only numeric evaluation;
* matrices above `MAX_MATRIX_ENTRIES` entries are refused; matrix products/sums are computed only
  for explicit small matrices.

The hard wall-clock and memory limits are the worker's job; these guards make the common hostile
inputs cheap instead of relying on the kill.

Equality rules (the protocol's): exact string equality after normalisation is always equal;
otherwise exact symbolic equality (rationals compared exactly, decimals read as exact rationals),
then a numeric tolerance only when one side is a bare decimal with at least 3 significant digits
and the other an exact value that is not a terminating decimal (``\\sqrt{17}`` vs
``4.123105625617661``: equal when they agree to within one unit of the decimal's last place).
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from dataclasses import dataclass

import sympy
from latex2sympy2_extended import latex2sympy
from latex2sympy2_extended.latex2sympy2 import ConversionConfig
from sympy.core.evalf import PrecisionExhausted
from sympy.core.function import AppliedUndef
from sympy.core.relational import Relational
from sympy.matrices import MatrixBase
from sympy.matrices.expressions import MatrixExpr

from protocol.grading.normalize import (MAX_ANSWER_CHARS, Chain, Clock, Dots, Interval, Leaf, Member, Node,
                                        NormalizeError, Rel, Seq, Text, Union, canonical, compact,
                                        parse)
from protocol.grading.normalize import _text_key
from protocol.grading.notation import decimal_comma

__all__ = ["judge", "Unparsable", "MAX_INPUT_CHARS"]

MAX_INPUT_CHARS = MAX_ANSWER_CHARS  # one whole answer
MAX_LEAF_CHARS = 600         # one scalar in LaTeX
MAX_DEPTH = 24               # bracket nesting inside a leaf (the ANTLR parser recurses on it)
MAX_LITERAL_DIGITS = 60      # digits in one number as written
MAX_VALUE_DIGITS = 3000      # digits of an exact number built while evaluating
MAX_SYMBOLIC_POWER = 64      # larger integer exponents on symbolic bases are never expanded
MAX_FACTORIAL = 20
MAX_MATRIX_ENTRIES = 100
PREC = 50                    # working digits of numeric checks
_LOG10_2 = math.log10(2)

_CONV = ConversionConfig(interpret_as_mixed_fractions=True, interpret_simple_eq_as_assignment=False,
                         interpret_contains_as_eq=False, lowercase_symbols=False)
_DECIMAL = re.compile(r"(?<![\d.])(\d*)\.(\d+)(?![\d.])")
_DIGIT_RUN = re.compile(r"\d{%d,}" % (MAX_LITERAL_DIGITS + 1))
_PRIME = re.compile(r"(?<![A-Za-z\\])([A-Za-z])('+)")
_OPAQUE_TYPES = (sympy.Sum, sympy.Product, sympy.Integral, sympy.Limit, sympy.Derivative,
                 sympy.Subs)
_FACTORIALS = (sympy.factorial, sympy.factorial2, sympy.subfactorial, sympy.RisingFactorial,
               sympy.FallingFactorial, sympy.gamma)


class Unparsable(Exception):
    """The answer cannot be read safely (grammar error, guard tripped)."""


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
        if _nesting(c) > 2 * MAX_DEPTH:
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


# ------------------------------------------------------------------------------------ scalars

@dataclass(frozen=True)
class Scalar:
    expr: object              # sympy Expr or Matrix, evaluated under the guards
    float_digits: int | None  # decimals, when the leaf is a bare decimal with >= 3 significant digits
    percent: bool
    degrees: bool
    heavy: bool               # holds a big symbolic power: numeric checks only
    label: bool               # a name such as x, f(x), A:B, |AB| (left side of `x = 3`)


# latex2sympy2_extended computes some constructs while parsing (before `_Evaluator` can look at
# them): matrix operations behind \operatorname, \det, \gcd/\lcm, \binom and \Gamma. Those are
# only let through with small literal arguments.
_MATRIX_OPS = re.compile(r"\\operatorname\s*\{\s*(?:eye|rank|trace|tr|rref|nullspace|norm|cols|rows|eig|"
                         r"eigen|diagonalize|eigenvals|eigenvalues|eigenvects|eigenvectors|svd|SVD|"
                         r"zeros|ones|diag|hstack|vstack|orth|ortho|orthogonal|orthogonalize)\s*\}")
_EAGER = re.compile(r"\\(?:gcd|lcm|binom|dbinom|tbinom|choose|Gamma)(?![a-zA-Z])|"
                    r"\\operatorname\s*\{\s*(?:gcd|lcm)\s*\}")


def _nesting(s: str) -> int:
    depth = peak = 0
    for c in s:
        if c in "([{":
            depth += 1
            if depth > peak:
                peak = depth
        elif c in ")]}":
            depth -= 1
    return peak


def _guard_leaf(s: str) -> None:
    if _MATRIX_OPS.search(s):
        raise Unparsable("matrix operations are not evaluated")
    if _EAGER.search(s) and (re.search(r"\d{5,}|[!^]", s) or len(s) > 200):
        raise Unparsable("gcd/lcm/binomial/Gamma only with small literal arguments")
    if "\\det" in s and (s.count("&") + s.count("\\\\") > 16 or len(s) > 300):
        raise Unparsable("determinants of large matrices are not evaluated")
    if len(s) > MAX_LEAF_CHARS:
        raise Unparsable(f"expression longer than {MAX_LEAF_CHARS} characters")
    if _DIGIT_RUN.search(s):
        raise Unparsable(f"number with more than {MAX_LITERAL_DIGITS} digits")
    if _nesting(s) > MAX_DEPTH:
        raise Unparsable(f"nesting deeper than {MAX_DEPTH}")


def _prepare(s: str) -> str:
    """LaTeX handed to the grammar: decimals as exact fractions, and primes kept in the name
    (the grammar drops a bare `'`, which would make f' equal f)."""
    s = _PRIME.sub(lambda m: f"{m.group(1)}_{{p{len(m.group(2))}}}", s)
    return _DECIMAL.sub(_decimal_to_fraction, s)


def _decimal_to_fraction(m: re.Match) -> str:
    whole, frac = m.group(1), m.group(2)
    num = (whole + frac).lstrip("0") or "0"
    return "(\\frac{%s}{1%s})" % (num, "0" * len(frac))


def _is_label(e) -> bool:
    """A name rather than a value: symbols, f(x), |AB|, ratios/products of symbols."""
    if isinstance(e, sympy.Symbol):
        return True
    if isinstance(e, AppliedUndef):
        return True
    if isinstance(e, sympy.Abs):
        return _is_label(e.args[0])
    if isinstance(e, sympy.Mul):
        return all(_is_label(a) for a in e.args)
    if isinstance(e, sympy.Pow):
        return e.exp == -1 and _is_label(e.base)
    return False


def _log10_magnitude(b, x) -> float:
    """About log10 |b^x| (digits of the value) for numbers b, x whose own size is already bounded;
    inf when it cannot be estimated cheaply."""
    try:
        if isinstance(x, sympy.Rational) and _log10_height(x) > 15:
            return math.inf
        bv, xv = complex(b.evalf(15)), complex(x.evalf(15))
        if bv == 0:
            return 0.0
        return abs(xv) * abs(math.log10(abs(bv))) + abs(xv.imag)
    except (TypeError, ValueError, OverflowError, ZeroDivisionError, AttributeError):
        return math.inf


def _opaque(e) -> sympy.Symbol:
    """A stand-in symbol for a value that must not be computed; equal trees give equal names."""
    digest = hashlib.sha1(sympy.srepr(e).encode()).hexdigest()[:16]
    return sympy.Symbol(f"_opaque_{digest}")


def _log10_height(r: sympy.Rational) -> float:
    return max(int(r.p).bit_length(), int(r.q).bit_length()) * _LOG10_2


class _Evaluator:
    """Rebuild an unevaluated sympy tree with evaluation, refusing oversized work."""

    def __init__(self):
        self.heavy = False

    def __call__(self, e):
        if isinstance(e, MatrixBase):
            if e.rows * e.cols > MAX_MATRIX_ENTRIES:
                raise Unparsable(f"matrix larger than {MAX_MATRIX_ENTRIES} entries")
            return e.applyfunc(self)
        if isinstance(e, sympy.Symbol):
            return sympy.I if e.name == "i" else e
        if isinstance(e, sympy.Float):
            return sympy.Rational(str(e))
        if not isinstance(e, sympy.Basic):
            raise Unparsable(f"unexpected {type(e).__name__}")
        if e.is_Atom:
            return e
        if isinstance(e, sympy.UnevaluatedExpr):
            return self(e.args[0])
        if isinstance(e, _OPAQUE_TYPES):
            return _opaque(e)
        if isinstance(e, MatrixExpr):
            return self._matrix_expr(e)
        args = [self(a) for a in e.args]
        if isinstance(e, _FACTORIALS):
            if all(a.is_Integer and 0 <= a <= MAX_FACTORIAL for a in args):
                return e.func(*args)
            if all(a.is_number for a in args):
                return _opaque(e.func(*args, evaluate=False))
            return e.func(*args)
        if isinstance(e, sympy.binomial):
            if all(a.is_number for a in args) and not all(a.is_Integer and abs(a) <= 1000 for a in args):
                return _opaque(e.func(*args, evaluate=False))
            return e.func(*args)
        if isinstance(e, sympy.Pow):
            return self._pow(*args)
        if isinstance(e, (sympy.exp, sympy.sinh, sympy.cosh)) and args[0].is_number:
            # e^x has ~x/2.3 digits: e^{e^{e^{e^{10}}}} must stay a symbol
            if _log10_magnitude(sympy.E, args[0]) > MAX_VALUE_DIGITS:
                return _opaque(e.func(*args, evaluate=False))
        try:
            out = e.func(*args)
        except (TypeError, ValueError, AttributeError, ZeroDivisionError) as exc:
            raise Unparsable(f"cannot evaluate {type(e).__name__}: {exc}") from None
        return self._check(out)

    def _check(self, out):
        if isinstance(out, sympy.Rational) and _log10_height(out) > 3 * MAX_VALUE_DIGITS:
            return _opaque(out)
        if isinstance(out, sympy.Pow) and out.exp.is_Integer and abs(out.exp) > MAX_SYMBOLIC_POWER:
            self.heavy = True  # (x^a)^b folds into x^(ab): judge the folded exponent
        return out

    def _pow(self, b, x):
        unevaluated = sympy.Pow(b, x, evaluate=False)
        if b.is_Number and x.is_Number:
            if b in (0, 1, -1) or not (b.is_Rational and x.is_Rational):
                return sympy.Pow(b, x)
            # size of the exact result ~ |x| * digits(b); float(x) only once x is known to be small
            if _log10_height(x) > 15 or abs(float(x)) * _log10_height(b) > MAX_VALUE_DIGITS:
                return _opaque(unevaluated)
            return sympy.Pow(b, x)
        if b.is_number and x.is_number:
            # sqrt(2)^n, pi^{10^6}, 2^{\pi 10^6}: sympy or mpmath would build the whole number
            if _log10_magnitude(b, x) > MAX_VALUE_DIGITS:
                return _opaque(unevaluated)
            if not (x.is_Rational and abs(x) <= MAX_SYMBOLIC_POWER):
                self.heavy = True
        if not b.is_number and x.is_Rational and abs(x) > MAX_SYMBOLIC_POWER:
            self.heavy = True
        return self._check(sympy.Pow(b, x))

    def _matrix_expr(self, e):
        args = [self(a) for a in e.args]
        if isinstance(e, (sympy.MatMul, sympy.MatAdd)):
            mats = [a for a in args if isinstance(a, MatrixBase)]
            if len(mats) != sum(1 for a in args if getattr(a, "is_Matrix", False)):
                raise Unparsable("symbolic matrix expression")
            out = args[0]
            for a in args[1:]:
                try:
                    out = out * a if isinstance(e, sympy.MatMul) else out + a
                except Exception as exc:  # shape mismatch
                    raise Unparsable(f"matrix arithmetic: {exc}") from None
            if isinstance(out, MatrixBase) and out.rows * out.cols > MAX_MATRIX_ENTRIES:
                raise Unparsable("matrix too large")
            return out.applyfunc(lambda v: v) if isinstance(out, MatrixBase) else out
        if isinstance(e, sympy.MatPow) and isinstance(args[0], MatrixBase) and args[1].is_Integer \
                and 0 <= args[1] <= 8 and args[0].is_square:
            return args[0] ** int(args[1])
        raise Unparsable(f"{type(e).__name__} is not evaluated")


def _sample_points(symbols, n=3):
    """Deterministic rational sample points (> 1, distinct per symbol) for identity checks."""
    rng = random.Random(20240607)
    pts = []
    for _ in range(n):
        pts.append({s: sympy.Rational(rng.randint(1100, 3900), rng.choice((97, 101, 103, 107)))
                    for s in symbols})
    return pts


def _is_bad(v) -> bool:
    return v.has(sympy.nan, sympy.zoo, sympy.oo, -sympy.oo) or not v.is_number


def _terminating(r: sympy.Rational) -> bool:
    q = int(r.q)
    for p in (2, 5):
        while q % p == 0:
            q //= p
    return q == 1


# --------------------------------------------------------------------------------- comparator

class _Comparator:
    def __init__(self):
        self._scalars: dict[Leaf, Scalar] = {}

    # ---- leaves
    def scalar(self, leaf: Leaf) -> Scalar:
        got = self._scalars.get(leaf)
        if got is not None:
            return got
        s = leaf.text
        _guard_leaf(s)
        float_digits = None
        m = re.fullmatch(r"-?(\d*)\.(\d+)", s)
        if m and len((m.group(1) + m.group(2)).lstrip("0")) >= 3:
            float_digits = len(m.group(2))
        raw = self._parse(_prepare(s), s)
        if isinstance(raw, (Relational, sympy.And, sympy.Or, sympy.Set, sympy.Tuple, list, tuple)):
            raise Unparsable(f"unexpected structure in {s!r}")
        ev = _Evaluator()
        value = ev(raw)
        out = Scalar(value, float_digits, leaf.percent, leaf.degrees, ev.heavy, _is_label(raw))
        self._scalars[leaf] = out
        return out

    @staticmethod
    def _parse(latex: str, shown: str):
        try:
            return latex2sympy(latex, normalization_config=None, conversion_config=_CONV)
        except RecursionError:
            raise Unparsable(f"too deeply nested: {shown[:60]!r}") from None
        except Exception as exc:  # the grammar's own errors are plain Exceptions
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise Unparsable(f"cannot parse {shown[:60]!r}: {first[:80]}") from None

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
            return self._scalar_equal(self.scalar(a), self.scalar(b))
        return False

    # ---- text
    def _text_equal(self, a: Node, b: Node) -> bool:
        ta = a.text if isinstance(a, Text) else (_text_key(a.text) if isinstance(a, Leaf) else None)
        tb = b.text if isinstance(b, Text) else (_text_key(b.text) if isinstance(b, Leaf) else None)
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
        return all(isinstance(y, Leaf) and self._expr_equal(v[i], self.scalar(y).expr, False)
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
            if all(isinstance(p, Leaf) and not self._free(self.scalar(p).expr) for p in c.parts):
                return c.parts[-1]
        except Unparsable:
            return None
        return None

    @staticmethod
    def _free(e) -> bool:
        return bool(getattr(e, "free_symbols", ()))

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
        if not (self._free(ea) or self._free(eb)):
            return False  # constant chains are values, handled by the caller
        ratio = self._const_ratio(ea, eb, ha or hb)
        return ratio is not None and ratio != 0

    # ---- inequalities and sets
    def _relations(self, r: Rel):
        _guard_leaf(r.text)
        raw = self._parse(_prepare(r.text), r.text)
        parts = list(getattr(raw, "_unsorted_args", None) or (raw.args if isinstance(raw, sympy.And)
                                                                else [raw]))
        out = []
        for p in parts:
            if not isinstance(p, Relational):
                raise Unparsable(f"not a relation: {r.text[:60]!r}")
            ev = _Evaluator()
            out.append((ev(p.lhs), p.rel_op, ev(p.rhs), ev.heavy))
        return out

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
                ratio = self._const_ratio(ea, eb, ra[0][3] or rb[0][3])
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
        if isinstance(v, MatrixBase) or self._free(v) or v.is_extended_real is False:
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

    # ---- scalars
    def _scalar_equal(self, A: Scalar, B: Scalar) -> bool:
        a, b = A.expr, B.expr
        if isinstance(a, MatrixBase) or isinstance(b, MatrixBase):
            return self._matrix_equal(a, b)
        heavy = A.heavy or B.heavy
        if self._expr_equal(a, b, heavy):
            return True
        if self._float_close(A, B):
            return True
        if A.percent != B.percent:  # 20\% vs 0.2
            pa = a / 100 if A.percent else a
            pb = b / 100 if B.percent else b
            if self._expr_equal(pa, pb, heavy):
                return True
        if A.degrees != B.degrees:  # 30^\circ vs \frac{\pi}{6}
            deg, rad = (a, b) if A.degrees else (b, a)
            if getattr(rad, "has", lambda *_: False)(sympy.pi) and \
                    self._expr_equal(deg * sympy.pi / 180, rad, heavy):
                return True
        return False

    def _matrix_equal(self, a, b) -> bool:
        if not (isinstance(a, MatrixBase) and isinstance(b, MatrixBase)) or a.shape != b.shape:
            return False
        return all(self._expr_equal(x, y, False) for x, y in zip(a, b))

    def _expr_equal(self, a, b, heavy: bool) -> bool:
        if a == b:
            return True
        try:
            d = a - b
        except Exception:  # incompatible objects
            return False
        if d == 0:
            return True
        if d.has(sympy.nan, sympy.zoo) or a.has(sympy.oo, -sympy.oo) or b.has(sympy.oo, -sympy.oo):
            return False
        if not self._free(d):
            return self._const_equal(a, b, d, heavy)
        return self._identity_zero(d, a, b, heavy)

    def _const_equal(self, a, b, d, heavy: bool) -> bool:
        """Equality of two constants that sympy did not already reduce to the same object."""
        if d.is_Rational:
            return d == 0
        try:
            # strict: sympy raises instead of returning digits it could not certify
            av, bv = a.evalf(PREC, strict=True), b.evalf(PREC, strict=True)
        except PrecisionExhausted:  # e.g. tan(10^100): no trustworthy value, so only a proof counts
            return self._simplify_zero(d, heavy)
        except Exception:
            return False
        if not (av.is_number and bv.is_number) or _is_bad(av) or _is_bad(bv):
            return self._simplify_zero(d, heavy)
        if abs(av - bv) > sympy.Float(10) ** (10 - PREC) * max(abs(av), abs(bv)):
            return False
        try:
            dv = d.evalf(PREC, strict=True)
            if dv != 0:
                return False  # a certified nonzero difference: sqrt(10^100 + 1) vs 10^50
        except PrecisionExhausted:
            pass  # the difference cancels at every working precision sympy tried
        except Exception:
            return False
        if self._simplify_zero(d, heavy):
            return True
        # Both sides certified to PREC digits, equal to PREC digits, and their difference has no
        # digit at any precision sympy tried: equal (guards keep literals small, so distinct
        # closed forms this close do not occur). Rationals never reach this line.
        return True

    def _identity_zero(self, d, a, b, heavy: bool) -> bool:
        """d == 0 for all values of its symbols (expression identity), by exact evaluation at
        sample points; inconclusive evaluations fall back to sympy.simplify."""
        if d.atoms(AppliedUndef):
            return self._simplify_zero(d, heavy)
        syms = sorted(d.free_symbols, key=lambda s: s.name)
        checked = 0
        for pt in _sample_points(syms):
            try:
                if heavy:
                    v = d.evalf(PREC, subs=pt)
                    scale = max(abs(a.evalf(20, subs=pt)), abs(b.evalf(20, subs=pt)), sympy.Float(1))
                else:
                    v = d.xreplace(pt)
                    if v.is_Rational:
                        if v != 0:
                            return False
                        checked += 1
                        continue
                    # a Float 1, not int 1: `_is_bad` needs a sympy number
                    scale = max(abs(a.xreplace(pt).evalf(20)), abs(b.xreplace(pt).evalf(20)), sympy.Float(1))
                    v = v.evalf(PREC)
            except Exception:
                continue
            if _is_bad(v) or _is_bad(scale):
                continue
            if abs(v) > sympy.Float(10) ** (10 - PREC) * scale:
                return False
            checked += 1
        if checked >= 2:
            return True
        return self._simplify_zero(d, heavy)

    @staticmethod
    def _simplify_zero(d, heavy: bool) -> bool:
        if heavy or sympy.count_ops(d) > 200:
            return False
        try:
            return sympy.simplify(d) == 0
        except Exception:
            return False

    def _const_ratio(self, ea, eb, heavy: bool):
        """The constant c with ea = c * eb, or None."""
        if eb == 0:
            return None
        r = ea / eb
        if not heavy:
            try:
                r2 = sympy.cancel(sympy.together(r))
                if not self._free(r2):
                    return r2
            except Exception:
                pass
        syms = sorted(r.free_symbols, key=lambda s: s.name)
        values = []
        for pt in _sample_points(syms, 4):
            try:
                v = r.evalf(PREC, subs=pt)
            except Exception:
                continue
            if not _is_bad(v):
                values.append(v)
        if len(values) < 2:
            return None
        first = values[0]
        if all(abs(v - first) <= sympy.Float(10) ** (10 - PREC) * max(abs(first), 1) for v in values):
            try:
                return sympy.nsimplify(first, rational=True) if first.is_real else first
            except Exception:
                return first
        return None

    @staticmethod
    def _float_close(A: Scalar, B: Scalar) -> bool:
        """One side a bare decimal, the other an exact non-terminating value: agree to within one
        unit of the decimal's last place."""
        for F, X in ((A, B), (B, A)):
            if F.float_digits is None or X.float_digits is not None:
                continue
            x = X.expr
            if getattr(x, "free_symbols", True) or not getattr(x, "is_number", False):
                continue
            if x.is_Rational and _terminating(x):
                continue  # 1/4 vs 0.3: exact values are compared exactly
            try:
                xv = x.evalf(F.float_digits + 30, strict=True)
                if not xv.is_real:
                    continue
                if abs(xv - F.expr) <= sympy.Rational(1, 10 ** F.float_digits):
                    return True
            except Exception:
                continue
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

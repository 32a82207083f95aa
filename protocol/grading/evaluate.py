"""LaTeX leaves to sympy values under guards: nothing in model text is evaluated as Python.

Leaves are parsed by `latex2sympy2_extended` (an ANTLR LaTeX grammar that builds sympy objects with
``evaluate=False``), then rebuilt bottom-up by `_Evaluator`, which refuses work that can blow up
before sympy sees it:

* string guards per leaf: length, bracket nesting depth, digits per number literal, and no
  constructs the grammar would compute while parsing (matrix operations behind
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

`to_scalar(leaf)` gives the `Scalar` of a normalised leaf; `equivalence` compares them.
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
from sympy.core.function import AppliedUndef
from sympy.core.relational import Relational
from sympy.matrices import MatrixBase
from sympy.matrices.expressions import MatrixExpr

from protocol.grading.normalize import Leaf

__all__ = ["Unparsable", "Scalar", "to_scalar", "to_relations", "sample_points", "is_bad", "terminating",
           "nesting", "PREC", "MAX_DEPTH"]

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


def nesting(s: str) -> int:
    depth = peak = 0
    for c in s:
        if c in "([{":
            depth += 1
            if depth > peak:
                peak = depth
        elif c in ")]}":
            depth -= 1
    return peak


def guard_leaf(s: str) -> None:
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
    if nesting(s) > MAX_DEPTH:
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


def sample_points(symbols, n=3):
    """Deterministic rational sample points (> 1, distinct per symbol) for identity checks."""
    rng = random.Random(20240607)
    pts = []
    for _ in range(n):
        pts.append({s: sympy.Rational(rng.randint(1100, 3900), rng.choice((97, 101, 103, 107)))
                    for s in symbols})
    return pts


def is_bad(v) -> bool:
    return v.has(sympy.nan, sympy.zoo, sympy.oo, -sympy.oo) or not v.is_number


def terminating(r: sympy.Rational) -> bool:
    q = int(r.q)
    for p in (2, 5):
        while q % p == 0:
            q //= p
    return q == 1


def to_scalar(leaf: Leaf) -> Scalar:
    """The value of a normalised leaf, parsed and evaluated under the guards."""
    s = leaf.text
    guard_leaf(s)
    float_digits = None
    m = re.fullmatch(r"-?(\d*)\.(\d+)", s)
    if m and len((m.group(1) + m.group(2)).lstrip("0")) >= 3:
        float_digits = len(m.group(2))
    raw = _parse(_prepare(s), s)
    if isinstance(raw, (Relational, sympy.And, sympy.Or, sympy.Set, sympy.Tuple, list, tuple)):
        raise Unparsable(f"unexpected structure in {s!r}")
    ev = _Evaluator()
    value = ev(raw)
    return Scalar(value, float_digits, leaf.percent, leaf.degrees, ev.heavy, _is_label(raw))


def _parse(latex: str, shown: str):
    try:
        return latex2sympy(latex, normalization_config=None, conversion_config=_CONV)
    except RecursionError:
        raise Unparsable(f"too deeply nested: {shown[:60]!r}") from None
    except Exception as exc:  # the grammar's own errors are plain Exceptions
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise Unparsable(f"cannot parse {shown[:60]!r}: {first[:80]}") from None


def to_relations(text: str) -> list[tuple]:
    """The relations of an inequality leaf (``1 \\le x < 3``) as (lhs, op, rhs, heavy), each side
    evaluated under the guards."""
    guard_leaf(text)
    raw = _parse(_prepare(text), text)
    parts = list(getattr(raw, "_unsorted_args", None) or (raw.args if isinstance(raw, sympy.And)
                                                            else [raw]))
    out = []
    for p in parts:
        if not isinstance(p, Relational):
            raise Unparsable(f"not a relation: {text[:60]!r}")
        ev = _Evaluator()
        out.append((ev(p.lhs), p.rel_op, ev(p.rhs), ev.heavy))
    return out

"""Equality of two evaluated scalars (`evaluate.Scalar`): numbers, constants, expressions, matrices.

Numbers are compared exactly (rationals as rationals, decimals read as exact rationals);
constants by certified 50-digit values and their certified difference; expressions by exact
evaluation at fixed rational points, `simplify` deciding when the points cannot be evaluated; a
numeric tolerance only when one side is a bare decimal with at least 3 significant digits and the
other an exact value that is not a terminating decimal (``\\sqrt{17}`` vs ``4.123105625617661``:
equal when they agree to within one unit of the decimal's last place).
"""

from __future__ import annotations

import sympy
from sympy.core.evalf import PrecisionExhausted
from sympy.core.function import AppliedUndef
from sympy.matrices import MatrixBase

from protocol.grading.evaluate import PREC, Scalar, is_bad, sample_points, terminating

__all__ = ["scalar_equal", "expr_equal", "const_ratio", "free"]


def free(e) -> bool:
    return bool(getattr(e, "free_symbols", ()))


def scalar_equal(A: Scalar, B: Scalar) -> bool:
    a, b = A.expr, B.expr
    if isinstance(a, MatrixBase) or isinstance(b, MatrixBase):
        return matrix_equal(a, b)
    heavy = A.heavy or B.heavy
    if expr_equal(a, b, heavy):
        return True
    if float_close(A, B):
        return True
    if A.percent != B.percent:  # 20\% vs 0.2
        pa = a / 100 if A.percent else a
        pb = b / 100 if B.percent else b
        if expr_equal(pa, pb, heavy):
            return True
    if A.degrees != B.degrees:  # 30^\circ vs \frac{\pi}{6}
        deg, rad = (a, b) if A.degrees else (b, a)
        if getattr(rad, "has", lambda *_: False)(sympy.pi) and \
                expr_equal(deg * sympy.pi / 180, rad, heavy):
            return True
    return False

def matrix_equal(a, b) -> bool:
    if not (isinstance(a, MatrixBase) and isinstance(b, MatrixBase)) or a.shape != b.shape:
        return False
    return all(expr_equal(x, y, False) for x, y in zip(a, b))

def expr_equal(a, b, heavy: bool) -> bool:
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
    if not free(d):
        return const_equal(a, b, d, heavy)
    return identity_zero(d, a, b, heavy)

def const_equal(a, b, d, heavy: bool) -> bool:
    """Equality of two constants that sympy did not already reduce to the same object."""
    if d.is_Rational:
        return d == 0
    try:
        # strict: sympy raises instead of returning digits it could not certify
        av, bv = a.evalf(PREC, strict=True), b.evalf(PREC, strict=True)
    except PrecisionExhausted:  # e.g. tan(10^100): no trustworthy value, so only a proof counts
        return simplify_zero(d, heavy)
    except Exception:
        return False
    if not (av.is_number and bv.is_number) or is_bad(av) or is_bad(bv):
        return simplify_zero(d, heavy)
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
    if simplify_zero(d, heavy):
        return True
    # Both sides certified to PREC digits, equal to PREC digits, and their difference has no
    # digit at any precision sympy tried: equal (guards keep literals small, so distinct
    # closed forms this close do not occur). Rationals never reach this line.
    return True

def identity_zero(d, a, b, heavy: bool) -> bool:
    """d == 0 for all values of its symbols (expression identity), by exact evaluation at
    sample points; inconclusive evaluations fall back to sympy.simplify."""
    if d.atoms(AppliedUndef):
        return simplify_zero(d, heavy)
    syms = sorted(d.free_symbols, key=lambda s: s.name)
    checked = 0
    for pt in sample_points(syms):
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
                # a Float 1, not int 1: `is_bad` needs a sympy number
                scale = max(abs(a.xreplace(pt).evalf(20)), abs(b.xreplace(pt).evalf(20)), sympy.Float(1))
                v = v.evalf(PREC)
        except Exception:
            continue
        if is_bad(v) or is_bad(scale):
            continue
        if abs(v) > sympy.Float(10) ** (10 - PREC) * scale:
            return False
        checked += 1
    if checked >= 2:
        return True
    return simplify_zero(d, heavy)

def simplify_zero(d, heavy: bool) -> bool:
    if heavy or sympy.count_ops(d) > 200:
        return False
    try:
        return sympy.simplify(d) == 0
    except Exception:
        return False

def const_ratio(ea, eb, heavy: bool):
    """The constant c with ea = c * eb, or None."""
    if eb == 0:
        return None
    r = ea / eb
    if not heavy:
        try:
            r2 = sympy.cancel(sympy.together(r))
            if not free(r2):
                return r2
        except Exception:
            pass
    syms = sorted(r.free_symbols, key=lambda s: s.name)
    values = []
    for pt in sample_points(syms, 4):
        try:
            v = r.evalf(PREC, subs=pt)
        except Exception:
            continue
        if not is_bad(v):
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

def float_close(A: Scalar, B: Scalar) -> bool:
    """One side a bare decimal, the other an exact non-terminating value: agree to within one
    unit of the decimal's last place."""
    for F, X in ((A, B), (B, A)):
        if F.float_digits is None or X.float_digits is not None:
            continue
        x = X.expr
        if getattr(x, "free_symbols", True) or not getattr(x, "is_number", False):
            continue
        if x.is_Rational and terminating(x):
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

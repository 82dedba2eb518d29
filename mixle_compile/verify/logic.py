"""The few logical connectives rules need, over Z3 terms or over plain numbers.

Rules import these instead of z3 itself so that listing and explaining rules (which never builds
a constraint) does not pay for importing the solver; z3 is imported on the first call.

The same rules can also be read with concrete values instead of solver terms (the plan search
screens many candidate plans this way, then confirms each one it returns with the solver): inside
:func:`concrete`, the connectives work on Python booleans and numbers, and
:class:`~mixle_compile.verify.symbols.Symbols` built with ``values`` holds integers that divide
as Z3's integers do (:class:`Integer`). One statement of each rule serves both readings.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from fractions import Fraction
from typing import Any

_concrete = False
_exact = False


@contextmanager
def concrete(*, exact: bool = False) -> Iterator[None]:
    """Within the block the connectives take and return plain values (no solver). ``exact``: reals
    are fractions rather than floats, so that every comparison is decided as the solver decides it
    (a verdict); without it they are floats (a screen, faster)."""
    global _concrete, _exact
    before = _concrete, _exact
    _concrete, _exact = True, exact
    try:
        yield
    finally:
        _concrete, _exact = before


def implies(premise: Any, conclusion: Any) -> Any:
    if _concrete:
        return bool(conclusion) or not premise
    import z3

    return z3.Implies(premise, conclusion)


def all_of(*terms: Any) -> Any:
    if _concrete:
        return all(terms)
    import z3

    return z3.And(*terms) if terms else z3.BoolVal(True)


def any_of(*terms: Any) -> Any:
    if _concrete:
        return any(terms)
    import z3

    return z3.Or(*terms) if terms else z3.BoolVal(False)


def negation(term: Any) -> Any:
    if _concrete:
        return not term
    import z3

    return z3.Not(term)


def when(condition: Any, then: Any, otherwise: Any) -> Any:
    if _concrete:
        return then if condition else otherwise
    import z3

    return z3.If(condition, then, otherwise)


def larger(a: Any, b: Any) -> Any:
    if _concrete:
        return a if a >= b else b
    import z3

    return z3.If(a >= b, a, b)


def smaller(a: Any, b: Any) -> Any:
    if _concrete:
        return a if a <= b else b
    import z3

    return z3.If(a <= b, a, b)


def real(term: Any) -> Any:
    """An integer term as a real, so that divisions are exact (read with values: a fraction under
    ``concrete(exact=True)``, otherwise a float, whose rounding can only matter at a bound met to the
    last byte, which the solver then decides)."""
    if _concrete:
        return Fraction(term) if _exact else float(term)
    import z3

    if isinstance(term, int):
        return z3.RealVal(term)
    return z3.ToReal(term) if z3.is_int(term) else term


def truth(value: bool) -> Any:
    if _concrete:
        return bool(value)
    import z3

    return z3.BoolVal(value)


def number(value: int) -> Any:
    if _concrete:
        return Integer(value)
    import z3

    return z3.IntVal(value)


class Integer(int):
    """A concrete integer with Z3's integer arithmetic: ``/`` and ``%`` are Euclidean division and
    remainder (SMT-LIB ``div`` and ``mod``), so that a rule written for solver integers means the
    same with values. Mixed with a real it divides as a real, as Z3 promotes it."""

    __slots__ = ()

    def _wrap(self, value: Any) -> Any:
        return Integer(value) if isinstance(value, int) and not isinstance(value, bool) else value

    def __add__(self, other: Any) -> Any:
        return self._wrap(int(self) + other) if isinstance(other, int) else int(self) + other

    __radd__ = __add__

    def __sub__(self, other: Any) -> Any:
        return self._wrap(int(self) - other) if isinstance(other, int) else int(self) - other

    def __rsub__(self, other: Any) -> Any:
        return self._wrap(other - int(self)) if isinstance(other, int) else other - int(self)

    def __mul__(self, other: Any) -> Any:
        return self._wrap(int(self) * other) if isinstance(other, int) else int(self) * other

    __rmul__ = __mul__

    def __neg__(self) -> Any:
        return Integer(-int(self))

    def __truediv__(self, other: Any) -> Any:
        if isinstance(other, int):
            return Integer(_div(int(self), int(other)))
        return int(self) / other

    def __rtruediv__(self, other: Any) -> Any:
        if isinstance(other, int):
            return Integer(_div(int(other), int(self)))
        return other / int(self)

    def __mod__(self, other: Any) -> Any:
        return Integer(_mod(int(self), int(other)))

    def __rmod__(self, other: Any) -> Any:
        return Integer(_mod(int(other), int(self)))

    def __hash__(self) -> int:
        return int.__hash__(self)


def _div(a: int, b: int) -> int:
    # SMT-LIB: a = b * q + r with 0 <= r < |b|; a division by zero is left open by the theory, and
    # no rule relies on it (each guards its divisor), so any value will do.
    if b == 0:
        return 0
    return a // b if b > 0 else -(a // -b)


def _mod(a: int, b: int) -> int:
    if b == 0:
        return a
    return a - b * _div(a, b)


class _Terms:
    """The solver's reading of the formula sets written once for numbers and terms: the memory
    model's arithmetic (:class:`mixle_compile.memory_model.Arithmetic`: ``when``, ``smaller``,
    ``exact``) and the schedules' and mesh's (:class:`mixle_compile.schedules.Logic`: ``all_of``,
    ``larger``, ``quotient``). Read inside :func:`concrete` they work on values."""

    when = staticmethod(when)
    smaller = staticmethod(smaller)
    exact = staticmethod(real)
    all_of = staticmethod(all_of)
    any_of = staticmethod(any_of)
    larger = staticmethod(larger)

    @staticmethod
    def quotient(a: Any, b: Any) -> Any:
        return a / b  # integer division of positive terms rounds down (Z3, and Integer with values)


#: What rules pass to the formulas of :mod:`mixle_compile.memory_model` and
#: :mod:`mixle_compile.schedules` (which pass their ``NUMBERS`` to the lowering's).
TERMS = _Terms()

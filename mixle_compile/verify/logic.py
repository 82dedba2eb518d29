"""The few logical connectives rules need, over Z3 terms.

Rules import these instead of z3 itself so that listing and explaining rules (which never builds
a constraint) does not pay for importing the solver; z3 is imported on the first call.
"""

from __future__ import annotations

from typing import Any


def implies(premise: Any, conclusion: Any) -> Any:
    import z3

    return z3.Implies(premise, conclusion)


def all_of(*terms: Any) -> Any:
    import z3

    return z3.And(*terms) if terms else z3.BoolVal(True)


def any_of(*terms: Any) -> Any:
    import z3

    return z3.Or(*terms) if terms else z3.BoolVal(False)


def negation(term: Any) -> Any:
    import z3

    return z3.Not(term)


def when(condition: Any, then: Any, otherwise: Any) -> Any:
    import z3

    return z3.If(condition, then, otherwise)


def larger(a: Any, b: Any) -> Any:
    import z3

    return z3.If(a >= b, a, b)


def smaller(a: Any, b: Any) -> Any:
    import z3

    return z3.If(a <= b, a, b)


def real(term: Any) -> Any:
    """An integer term as a real, so that divisions are exact."""
    import z3

    if isinstance(term, int):
        return z3.RealVal(term)
    return z3.ToReal(term) if z3.is_int(term) else term


def truth(value: bool) -> Any:
    import z3

    return z3.BoolVal(value)


def number(value: int) -> Any:
    import z3

    return z3.IntVal(value)

"""Elastic proofs: every world size of an elastic range gives a valid plan, or the smallest one fails.

The world size ``W`` is the one free variable. ``dp_shard`` is ``auto`` (D002), so it is
``W / (dp_replicate * tp * pp * cp)``, and the global batch is held while the accumulation steps
follow the data-parallel size. The solver is asked for a ``W`` in the range that breaks any error
rule; *unsat* is the proof. Otherwise bisection on ``W`` finds the smallest failing size, and the
rules it breaks there are named with their messages at that size.
"""

from __future__ import annotations

from dataclasses import dataclass

import z3

from mixle_compile.diagnostics import Severity
from mixle_compile.verify.engine import Finding, Values
from mixle_compile.verify.facts import ElasticRange, PlanFacts
from mixle_compile.verify.rule import Rule, rules_for
from mixle_compile.verify.symbols import Symbols

PROOF_RESOURCE_LIMIT = 20_000_000


@dataclass(frozen=True)
class ElasticProof:
    world_sizes: ElasticRange
    proved: bool  # every world size of the range gives a valid plan
    smallest_failure: int | None = None
    broken: tuple[Finding, ...] = ()  # the rules broken at the smallest failing size
    decided: bool = True  # False when the solver ran out of its resource limit

    @property
    def sizes(self) -> int:
        return len(self.world_sizes.world_sizes())


def _solver() -> z3.Solver:
    solver = z3.Then("simplify", "propagate-values", "solve-eqs", "simplify", "smt").solver()
    solver.set("rlimit", PROOF_RESOURCE_LIMIT)
    return solver


def prove_elastic(facts: PlanFacts) -> ElasticProof:
    assert facts.elastic is not None and facts.dp_shard_auto
    sizes = facts.elastic
    rules = tuple(
        r for r in rules_for(facts) if r.constraint is not None and r.elastic and r.severity is Severity.error
    )
    symbols = Symbols(facts, elastic_world=True)
    world = symbols.devices
    solver = _solver()
    solver.add(*symbols.domain)
    # Every field keeps its value except the world size (and what follows from it).
    solver.add(*[symbols.pin(f.symbol, f.value) for f in facts.fields if f.symbol != "devices"])
    solver.add(world >= sizes.min_world_size, world <= sizes.max_world_size, world % sizes.multiple_of == 0)
    ok = {r.code: z3.Bool(f"ok {r.code}") for r in rules}
    for r in rules:
        solver.add(ok[r.code] == r.constraint(symbols))
    solver.add(z3.Not(z3.And(*ok.values())))

    result = solver.check()
    if result == z3.unsat:
        return ElasticProof(sizes, proved=True)
    if result != z3.sat:
        return ElasticProof(sizes, proved=False, decided=False)

    # Bisection: `low` is known to have no failing size at or below it, `high` fails.
    low, high = sizes.min_world_size - 1, solver.model().eval(world).as_long()
    decided = True
    while high - low > 1:
        middle = (low + high) // 2
        solver.push()
        solver.add(world <= middle)
        result = solver.check()
        if result == z3.sat:
            high = solver.model().eval(world).as_long()
        elif result == z3.unsat:
            low = middle
        else:
            decided = False
            solver.pop()
            break
        solver.pop()

    solver.push()
    solver.add(world == high)
    solver.check()
    model = solver.model()
    solver.pop()
    values = Values(symbols, model, facts)
    # At another world size not every spec value is in force (dp_shard, the accumulation steps),
    # so the rules speak through their explanations at that size rather than the spec's fields.
    broken = tuple(
        Finding(r, _named_fields(r, facts), r.explain(values), r.hint(values))
        for r in rules
        if z3.is_false(model.eval(ok[r.code], model_completion=True))
    )
    return ElasticProof(sizes, proved=False, smallest_failure=high, broken=broken, decided=decided)


def _named_fields(rule: Rule, facts: PlanFacts) -> tuple:
    return tuple(facts.field(s) for s in rule.fields if facts.has(s) and s not in ("devices", "dp_shard_auto"))

"""The nearest valid plan on the same devices: fewest fields changed, then the smallest change.

Only the settings of *how* to train may change: the mesh degrees (``dp_shard`` only when it is
not ``auto``), micro-batching, virtual stages, the schedule, activation checkpointing, sequence
parallelism, the distributed optimizer and the precision. The model, the devices, the backend,
the global batch size and the sequence length are what the user asked for and stay fixed.

Each changeable integer ranges over the values it can take in a valid plan (degrees divide the
device count, micro-batch settings divide the global batch, virtual stages divide the layers), and
the objective is lexicographic: the number of changed fields, then the sum of absolute changes
(a changed flag or choice counts 1). ``z3.Optimize`` does not terminate on these nonlinear
constraints, so the solver is asked directly: for k = 0, 1, 2, ... whether a valid plan changes at
most k fields (the first *sat* gives the fewest, every *unsat* before it proves there is no nearer
count), then bisection on the total change among plans with exactly k changes, then (so that the
answer does not depend on the solver's state) the fields earlier in CHANGEABLE kept where they
can be and each changed field at its smallest fitting value. A search that may
change only a few fields is small, which is why counting up is fast; plans needing more than
MAX_CHANGES changes are not offered as fixes.

Every solver call runs after a preprocessing pass (simplification, value propagation and equation
solving) that substitutes the pinned fields into the nonlinear byte counts before search: without
it one *unsat* answer over a memory rule could take Z3's default solver a minute or more, in a time
that varied with the order its terms were built in. Each call also has a resource limit and a
wall-clock limit, and the whole search a deadline: a call that runs out answers *unknown*, which
leaves the suggestion marked as not proved nearest rather than a check that never returns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import z3

from mixle_compile.diagnostics import Severity
from mixle_compile.schedules import NUMBERS
from mixle_compile.spec.models import auto_dp_shard
from mixle_compile.verify.facts import ENUMS, Field, PlanFacts
from mixle_compile.verify.rule import rules_for
from mixle_compile.verify.symbols import Symbols
from mixle_compile.verify.wording import divisors

CHANGEABLE = (
    "dp_replicate",
    "dp_shard",
    "tp",
    "pp",
    "cp",
    "ep",
    "etp",
    "microbatches",
    "gradient_accumulation_steps",
    "micro_batch_size",
    "virtual_pipeline_stages",
    "pipeline_schedule",
    "activation_checkpointing",
    "sequence_parallel",
    "distributed_optimizer",
    "precision",
)
_DEGREES = {"dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "etp"}
_BATCH = {"microbatches", "gradient_accumulation_steps", "micro_batch_size"}
SEARCH_RESOURCE_LIMIT = 20_000_000  # per solver call: bounds the time of a hopeless search
SEARCH_TIMEOUT_MS = 10_000  # per solver call, beside the resource limit (nonlinear search can stall between counts)
SEARCH_DEADLINE_S = 60.0  # the whole search; later calls answer unknown at once
MAX_CHANGES = 4  # a plan needing more changes than this is a different plan, not a fix


@dataclass(frozen=True)
class Change:
    field: Field
    value: int | bool

    def display(self) -> str:
        if self.field.kind == "bool":
            return "true" if self.value else "false"
        if self.field.kind in ENUMS:
            return ENUMS[self.field.kind][int(self.value)]
        return str(self.value)


@dataclass(frozen=True)
class Suggestion:
    changes: tuple[Change, ...]
    devices: int
    proved_nearest: bool  # every step of the search was decided, so nothing nearer exists
    dp_shard_auto_value: int | None = None  # what `dp_shard: auto` resolves to afterwards
    new_warnings: tuple[str, ...] = ()  # warning rules the fix breaks (only when no clean fix exists)
    out_of_time: bool = False  # a solver call or the whole search ran out of time before any plan was found

    def yaml_patch(self) -> str:
        """The changes as YAML to merge into the spec, each with the value it replaces."""
        lines: list[str] = []
        section = None
        for change in self.changes:
            head, *rest = change.field.path
            if head != section:
                lines.append(f"{head}:")
                section = head
            key = ".".join(str(p) for p in rest)
            lines.append(f"  {key}: {change.display()}  # was {change.field.display()}")
        if self.dp_shard_auto_value is not None:
            lines.append(f"# mesh.dp_shard: auto now resolves to {self.dp_shard_auto_value}")
        if self.new_warnings:
            lines.append(
                f"# no plan within {MAX_CHANGES} changes avoids warning {', '.join(self.new_warnings)}, "
                "which this one brings"
            )
        return "\n".join(lines) + "\n"


class _Clock:
    """The deadline one search shares among its solver calls."""

    def __init__(self, seconds: float | None = None) -> None:
        self.deadline = time.monotonic() + (SEARCH_DEADLINE_S if seconds is None else seconds)

    def check(self, solver: z3.Solver) -> z3.CheckSatResult:
        """``solver.check()`` within the per-call limit and what is left of the deadline."""
        left_ms = int((self.deadline - time.monotonic()) * 1000)
        if left_ms <= 0:
            return z3.unknown
        solver.set("timeout", min(SEARCH_TIMEOUT_MS, left_ms))
        return solver.check()


def _solver() -> z3.Solver:
    """A solver that substitutes pinned values before it searches, within the resource limit."""
    solver = z3.Then("simplify", "propagate-values", "solve-eqs", "simplify", "smt").solver()
    solver.set("rlimit", SEARCH_RESOURCE_LIMIT)
    return solver


def _domain(symbol: str, facts: PlanFacts) -> list[int]:
    """The values an integer setting can take in a valid plan on these devices."""
    if symbol in _DEGREES:
        values = divisors(facts.value("devices"))
    elif symbol in _BATCH:
        values = divisors(facts.value("global_batch_size"))
    else:  # virtual_pipeline_stages: a divisor of the layers (a distribution model has none)
        layers = next((facts.value(s) for s in ("num_layers", "layers") if facts.has(s)), 1)
        values = divisors(max(1, layers))
    return sorted(set(values) | {facts.value(symbol)})


def nearest_valid_plan(facts: PlanFacts) -> Suggestion | None:
    """The nearest plan that breaks no error rule, or None when no plan within MAX_CHANGES changes exists
    (a search whose deadline passed before it found any plan says so: :attr:`Suggestion.out_of_time`).

    A fix must not trade an error for a warning the spec does not have (a large pipeline bubble):
    the search first asks for a plan that also keeps every warning rule the spec passes; only
    when none exists within MAX_CHANGES is the nearest plan without errors offered, naming the
    warnings it brings (:attr:`Suggestion.new_warnings`).
    """
    from mixle_compile.verify.engine import PlanVerifier

    # Rules about the elastic section (D002, D004, C005) are fixed there, not by the plan's settings.
    errors = _fix_rules(facts)
    broken = {r.code for r in PlanVerifier().violated(facts)}
    held = [
        r
        for r in rules_for(facts)
        if r.constraint is not None and r.severity is Severity.warning and r.code not in broken
    ]
    clock = _Clock()
    found = _search(facts, errors + held, clock) if held else None
    if found is not None and not found.out_of_time:
        return found
    found = _search(facts, errors, clock)
    if found is None or not held or found.out_of_time:
        return found
    return Suggestion(
        found.changes,
        found.devices,
        found.proved_nearest,
        found.dp_shard_auto_value,
        tuple(r.code for r in held if not _holds(facts, r, found, clock)),
    )


def _holds(facts: PlanFacts, rule, suggestion: Suggestion, clock: _Clock) -> bool:
    """Whether ``rule`` holds on the plan ``suggestion`` makes (undecided counts as broken)."""
    symbols = Symbols(facts)
    solver = _solver()
    solver.add(*symbols.domain)
    changed = {c.field.symbol: c.value for c in suggestion.changes}
    solver.add(*[symbols.pin(f.symbol, changed.get(f.symbol, f.value)) for f in facts.fields])
    solver.add(rule.constraint(symbols))
    return clock.check(solver) == z3.sat


def _search(facts: PlanFacts, rules: list, clock: _Clock | None = None) -> Suggestion | None:
    """The nearest plan on these devices under ``rules``: fewest changes, then the smallest."""
    clock = clock or _Clock()
    symbols = Symbols(facts)
    solver = _solver()
    solver.add(*symbols.domain)
    changeable = [f for f in facts.fields if f.symbol in CHANGEABLE]
    free = {f.symbol for f in changeable}
    solver.add(*[symbols.pin(f.symbol, f.value) for f in facts.fields if f.symbol not in free])
    changed_terms, distance_terms = [], []
    for f in changeable:
        var = symbols.variables[f.symbol]
        if f.kind == "bool":
            differs = var != z3.BoolVal(bool(f.value))
            distance_terms.append(z3.If(differs, 1, 0))
        else:
            if f.kind not in ENUMS:
                solver.add(z3.Or(*[var == v for v in _domain(f.symbol, facts)]))
            differs = var != int(f.value)
            distance_terms.append(
                z3.If(differs, 1, 0) if f.kind in ENUMS else z3.If(var >= f.value, var - f.value, f.value - var)
            )
        changed_terms.append(z3.If(differs, 1, 0))
    for r in rules:
        solver.add(r.constraint(symbols))
    changed, distance = z3.Sum(*changed_terms), z3.Sum(*distance_terms)

    # Fewest changes first, counting up: a search that may change only k fields is small, while a
    # search over every field at once is the hardest question of all (and usually not needed).
    decided = True
    model = None
    for k in range(min(MAX_CHANGES, len(changeable)) + 1):
        solver.push()
        solver.add(changed <= k)
        result = clock.check(solver)
        if result == z3.sat:
            model = solver.model()
        solver.pop()
        if result == z3.sat:
            solver.add(changed == k)
            break
        if result != z3.unsat:
            decided = False
    if model is None:
        return None if decided else Suggestion((), facts.value("devices"), False, out_of_time=True)
    best, model, settled = _minimise(solver, distance, model, clock)
    decided = decided and settled
    if settled:
        model = _canonical(solver, distance, best, changeable, symbols, model, facts, clock)

    changes = []
    for f in changeable:
        value = model.eval(symbols.variables[f.symbol], model_completion=True)
        new = z3.is_true(value) if f.kind == "bool" else value.as_long()
        if new != f.value:
            changes.append(Change(f, new))
    auto_value = None
    if facts.dp_shard_auto:
        auto_value = model.eval(symbols.dp_shard, model_completion=True).as_long()
        before = auto_dp_shard(
            NUMBERS,
            devices=facts.value("devices"),
            **{name: facts.value(name) for name in ("dp_replicate", "tp", "pp", "cp")},
        )
        auto_value = auto_value if auto_value != before else None
    return Suggestion(tuple(changes), facts.value("devices"), decided, auto_value)


def _canonical(
    solver: z3.Solver,
    distance: Any,
    best: int,
    changeable: list[Field],
    symbols: Symbols,
    model: Any,
    facts: PlanFacts,
    clock: _Clock,
) -> Any:
    """One answer among equally near plans, whatever the solver's state: fields earlier in
    CHANGEABLE are kept as they are where the nearest plans allow (so which of two equally near
    plans is offered follows that order, never chance), then each changed field takes its
    smallest value."""
    solver.push()
    try:
        solver.add(distance == best)
        order = sorted(changeable, key=lambda f: CHANGEABLE.index(f.symbol))
        kept = set()
        for f in order:
            var = symbols.variables[f.symbol]
            keep = var == (z3.BoolVal(bool(f.value)) if f.kind == "bool" else int(f.value))
            if _add_if_satisfiable(solver, keep, clock):
                kept.add(f.symbol)
        for f in order:
            if f.symbol in kept:
                continue
            var = symbols.variables[f.symbol]
            if f.kind == "bool":
                values = [not bool(f.value)]
            elif f.kind in ENUMS:
                values = [v for v in range(len(ENUMS[f.kind])) if v != f.value]
            else:
                values = [v for v in _domain(f.symbol, facts) if v != f.value]
            for value in values:
                if _add_if_satisfiable(solver, var == (z3.BoolVal(value) if f.kind == "bool" else value), clock):
                    break
        return solver.model() if clock.check(solver) == z3.sat else model
    finally:
        solver.pop()


def _minimise(solver: z3.Solver, objective: Any, model: Any, clock: _Clock) -> tuple[int, Any, bool]:
    """Bisection for the least value of ``objective``: (value, a model at it, whether decided)."""
    high = model.eval(objective, model_completion=True).as_long()
    low = -1  # no model at or below `low`
    while high - low > 1:
        middle = (low + high) // 2
        solver.push()
        solver.add(objective <= middle)
        result = clock.check(solver)
        if result == z3.sat:
            model = solver.model()
            high = model.eval(objective, model_completion=True).as_long()
        solver.pop()
        if result == z3.unsat:
            low = middle
        elif result != z3.sat:
            return high, model, False
    return high, model, True


def _fix_rules(facts: PlanFacts) -> list:
    """The error rules a fix must satisfy (the elastic section's own rules are fixed there)."""
    return [
        r
        for r in rules_for(facts)
        if r.constraint is not None and r.severity is Severity.error and "elastic_min_world_size" not in r.needs
    ]


def passing_values(facts: PlanFacts, symbol: str, candidates: list | None = None) -> list[str] | None:
    """The values of one changeable setting that, every other field as in the spec, break no error
    rule: what a finding's hint may offer. None when the setting is not one a fix changes.
    ``candidates``: the values to try instead of the setting's domain (then any field may be asked)."""
    if not facts.has(symbol) or (candidates is None and symbol not in CHANGEABLE):
        return None
    field = facts.field(symbol)
    symbols = Symbols(facts)
    solver = _solver()
    clock = _Clock()
    solver.add(*symbols.domain)
    solver.add(*[symbols.pin(f.symbol, f.value) for f in facts.fields if f.symbol != symbol])
    for r in _fix_rules(facts):
        solver.add(r.constraint(symbols))
    var = symbols.variables[symbol]
    if candidates is not None:
        pass
    elif field.kind == "bool":
        candidates = [False, True]
    elif field.kind in ENUMS:
        candidates = list(range(len(ENUMS[field.kind])))
    else:
        candidates = _domain(symbol, facts)
    out = []
    for value in candidates:
        if value == field.value:
            continue
        solver.push()
        solver.add(var == (z3.BoolVal(value) if field.kind == "bool" else value))
        ok = clock.check(solver) == z3.sat
        solver.pop()
        if ok:
            out.append(Change(field, value).display())
    return out


def _add_if_satisfiable(solver, constraint, clock: _Clock) -> bool:
    """Add ``constraint`` to ``solver`` where the solver can still be satisfied with it."""
    solver.push()
    solver.add(constraint)
    result = clock.check(solver)
    solver.pop()
    if result == z3.sat:
        solver.add(constraint)
    return result == z3.sat

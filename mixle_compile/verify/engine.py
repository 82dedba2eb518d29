"""Verdicts and minimal conflicts: which rules a plan breaks, and which fields make it so.

The verdict comes from the encoding: one solver holds ``ok_RULE == constraint(RULE)`` for every
rule of the plan's rule set, the plan's values are pinned, and the model says which ``ok_RULE``
are false. The solver is kept per plan *structure* (rule set, family, the fields present, the
parameter footprint), so evaluating many plans of one shape reuses it through push/pop.

For a failing rule, each field is pinned behind its own tracking literal; the unsat core over
those literals is then shrunk by deletion (drop a field, keep it dropped while the rest stays
unsat) until no field can be removed: a minimal set of conflicting fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import z3

from mixle_compile.diagnostics import Severity
from mixle_compile.spec.source import Path_
from mixle_compile.verify.facts import ENUMS, Field, PlanFacts
from mixle_compile.verify.rule import Rule, rules_for
from mixle_compile.verify.symbols import Symbols
from mixle_compile.verify.wording import divisors

# Bounds on the work of one solver call, so that a pathological query ends (deterministically)
# instead of hanging: an undecided refutation keeps the field it was testing in the conflict, an
# undecided first core starts the deletion from every field.
RESOURCE_LIMIT = 300_000
CORE_RESOURCE_LIMIT = 5_000_000
# And on their time: Z3's nonlinear arithmetic can spend long between resource counts on the
# memory rule's products of byte counts, so each call also stops after these milliseconds (only
# such a query comes near them; what an undecided call means is as above).
TIMEOUT_MS = 2_000
CORE_TIMEOUT_MS = 10_000


class Values:
    """The plan's concrete values, read from a Z3 model of its symbols (for messages)."""

    def __init__(self, symbols: Symbols, model: Any, facts: PlanFacts):
        self.symbols = symbols
        self.model = model
        self.facts = facts
        self.cache: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        term = getattr(self.symbols, name)
        value = self.eval(term)
        if name in ENUMS:
            return ENUMS[name][value]
        return value

    def value_of(self, symbol: str) -> Any:
        return self.eval(self.symbols.variables[symbol])

    def eval(self, term: Any) -> Any:
        if not z3.is_expr(term):
            return term
        value = self.model.eval(term, model_completion=True)
        if z3.is_true(value) or z3.is_false(value):
            return z3.is_true(value)
        if z3.is_int_value(value):
            return value.as_long()
        if z3.is_rational_value(value):
            fraction = value.as_fraction()
            return Fraction(fraction.numerator, fraction.denominator)
        raise ValueError(f"cannot read {term} = {value} as a number")


@dataclass(frozen=True)
class Finding:
    """One rule a plan breaks, with the minimal set of fields that conflict under it."""

    rule: Rule
    fields: tuple[Field, ...]  # in the order a person should read them
    message: str
    hint: str

    @property
    def code(self) -> str:
        return self.rule.code

    @property
    def severity(self) -> Severity:
        return self.rule.severity

    @property
    def paths(self) -> tuple[Path_, ...]:
        return tuple(f.path for f in self.fields) + tuple((c,) for c in self.rule.context)


class _Encoding:
    """Symbols and a verdict solver for one plan structure."""

    def __init__(self, facts: PlanFacts, rules: tuple[Rule, ...]):
        self.symbols = Symbols(facts)
        self.rules = tuple(r for r in rules if r.constraint is not None)
        # Every field is pinned for a verdict, so eliminating the pinned variables first leaves
        # ground terms that simplify to constants: far faster than search on the nonlinear terms.
        self.solver = z3.Then("simplify", "propagate-values", "solve-eqs", "simplify", "smt").solver()
        self.solver.add(*self.symbols.domain)
        self.ok: dict[str, Any] = {}
        for rule in self.rules:
            ok = z3.Bool(f"ok {rule.code}")
            self.ok[rule.code] = ok
            self.solver.add(ok == rule.constraint(self.symbols))
        # One integer carries the whole verdict (bit i set: rule i broken), so that reading it
        # back from a model is one evaluation rather than one per rule.
        self.broken = z3.Int("broken rules")
        self.solver.add(
            self.broken
            == z3.Sum([z3.If(self.ok[r.code], 0, 1 << i) for i, r in enumerate(self.rules)] or [z3.IntVal(0)])
        )
        self._pins: dict[tuple[str, Any], Any] = {}
        self._core_solvers: dict[str, Any] = {}

    def pins(self, facts: PlanFacts) -> list[Any]:
        out = []
        for f in facts.fields:
            key = (f.symbol, f.value)
            pin = self._pins.get(key)
            if pin is None:
                pin = self._pins[key] = self.symbols.pin(f.symbol, f.value)
            out.append(pin)
        return out

    def model(self, facts: PlanFacts) -> Any:
        self.solver.push()
        try:
            self.solver.add(*self.pins(facts))
            result = self.solver.check()
            if result != z3.sat:
                # Pinned values with a consistent encoding always have a model; anything else is a bug.
                raise RuntimeError(f"the verifier's encoding has no model for this plan ({result})")
            return self.solver.model()
        finally:
            self.solver.pop()

    def violated(self, model: Any) -> tuple[Rule, ...]:
        mask = model.eval(self.broken, model_completion=True).as_long()
        return tuple(r for i, r in enumerate(self.rules) if mask >> i & 1)

    def core_solvers(self, rule: Rule) -> tuple[Any, Any]:
        """Two solvers holding the rule: one for cores over tracked pins, one for refutations."""
        pair = self._core_solvers.get(rule.code)
        if pair is None:
            constraint = rule.constraint(self.symbols)
            tracked = z3.Solver()
            tracked.set("rlimit", CORE_RESOURCE_LIMIT)
            tracked.set("timeout", CORE_TIMEOUT_MS)
            tracked.add(*self.symbols.domain, constraint)
            refuter = z3.Then("simplify", "propagate-values", "solve-eqs", "simplify", "smt").solver()
            refuter.set("rlimit", RESOURCE_LIMIT)
            refuter.set("timeout", TIMEOUT_MS)
            refuter.add(*self.symbols.domain, constraint)
            pair = self._core_solvers[rule.code] = (tracked, refuter)
        return pair


def _structure(facts: PlanFacts, rules: tuple[Rule, ...]) -> tuple:
    """What the encoding depends on besides the pinned values."""
    return (
        tuple(r.code for r in rules),
        facts.family,
        facts.backend,
        facts.capabilities,
        tuple((f.symbol, f.kind) for f in facts.fields),
        facts.dp_shard_auto,
        repr(facts.footprint),
        facts.split_dimensions,
        # the memory rule reads a listed split, and the pipeline degree it is listed for, as numbers
        facts.layer_split,
        facts.pipeline_layers,
        facts.value("pp") if facts.pipeline_layers is not None else None,
    )


class PlanVerifier:
    """Checks plans against their backend's rule set.

    Keeps one encoding per plan structure, so a caller checking many plans (a sweep, a test)
    creates one verifier and reuses it; a single check creates its own.
    """

    def __init__(self) -> None:
        self._encodings: dict[tuple, _Encoding] = {}

    def encoding(self, facts: PlanFacts, rules: tuple[Rule, ...] | None = None) -> _Encoding:
        rules = rules_for(facts) if rules is None else rules
        key = _structure(facts, rules)
        enc = self._encodings.get(key)
        if enc is None:
            enc = self._encodings[key] = _Encoding(facts, rules)
        return enc

    def violated(self, facts: PlanFacts) -> tuple[Rule, ...]:
        """The rules (errors and warnings) the plan breaks, in catalogue order."""
        enc = self.encoding(facts)
        return enc.violated(enc.model(facts))

    def findings(self, facts: PlanFacts, *, errors_only: bool = False) -> tuple[Finding, ...]:
        """What the plan breaks, each with its minimal conflict; with ``errors_only`` the errors alone
        (the warnings' conflicts are not looked for)."""
        enc = self.encoding(facts)
        model = enc.model(facts)
        values = Values(enc.symbols, model, facts)
        return tuple(
            describe(rule, self.conflict(facts, rule), values, facts)
            for rule in enc.violated(model)
            if not errors_only or rule.severity is Severity.error
        )

    def conflict(self, facts: PlanFacts, rule: Rule) -> tuple[Field, ...]:
        """A minimal set of fields whose values alone break ``rule``.

        Z3's unsat core over one tracking literal per pinned field gives a first conflict; each
        of its fields is then dropped in turn while the rest still conflicts. A field stays when
        some other value of it satisfies the rule (a witness) or when the solver cannot show
        within its resource limit that the rest conflicts without it.
        """
        if not rule.minimal_conflict:  # the rule's own fields, as the spec states them
            named = set(rule.fields)
            return _in_reading_order([f for f in facts.fields if f.symbol in named], rule, facts)
        enc = self.encoding(facts)
        symbols = enc.symbols
        tracked, refuter = enc.core_solvers(rule)
        literals: dict[int, Field] = {}
        tracked.push()
        try:
            for f in facts.fields:
                literal = z3.Bool(f"pin {f.symbol}")
                literals[literal.get_id()] = f
                tracked.add(z3.Implies(literal, symbols.pin(f.symbol, f.value)))
            everything = [z3.Bool(f"pin {f.symbol}") for f in facts.fields]
            if tracked.check(*everything) == z3.unsat:
                core = [literals[lit.get_id()] for lit in tracked.unsat_core()]
            else:  # undecided within the limit: shrink from every field instead
                core = list(facts.fields)
        finally:
            tracked.pop()

        # Fields with few values go first: once dropped they are cheap for the solver to leave free,
        # while a free integer under division makes every later refutation harder. Among them the
        # model's own fields go first, so that where several minimal conflicts exist the one named
        # is stated in the fields a user tunes; then the spec's order, so that the answer does not
        # depend on the order of the solver's core.
        position = {f.symbol: i for i, f in enumerate(facts.fields)}
        core.sort(key=lambda f: (f.kind == "int", f.path[0] != "model", position[f.symbol]))
        i = 0
        while i < len(core):
            candidate, rest = core[i], core[:i] + core[i + 1 :]
            if self._has_witness(refuter, symbols, candidate, facts) or not self._refuted(refuter, symbols, rest):
                i += 1
            else:
                core = rest
        return _in_reading_order(core, rule, facts)

    @staticmethod
    def _has_witness(solver: Any, symbols: Symbols, field: Field, facts: PlanFacts) -> bool:
        """Whether another value of ``field``, every other field as in the spec, satisfies the rule.

        Each try pins every field, so it is a ground evaluation and cheap.
        """
        var = symbols.variables[field.symbol]
        solver.push()
        try:
            solver.add(*[symbols.pin(f.symbol, f.value) for f in facts.fields if f.symbol != field.symbol])
            for value in _other_values(field, facts):
                solver.push()
                solver.add(var == (z3.BoolVal(value) if field.kind == "bool" else value))
                found = solver.check() == z3.sat
                solver.pop()
                if found:
                    return True
            return False
        finally:
            solver.pop()

    @staticmethod
    def _refuted(solver: Any, symbols: Symbols, pinned: list[Field]) -> bool:
        """Whether these fields alone break the rule (every other field free)."""
        solver.push()
        try:
            solver.add(*[symbols.pin(f.symbol, f.value) for f in pinned])
            return solver.check() == z3.unsat
        finally:
            solver.pop()


def _other_values(field: Field, facts: PlanFacts) -> list[Any]:
    """Values worth trying for a field when looking for a witness (any value is sound)."""
    value = field.value
    if field.kind == "bool":
        return [not value]
    if field.kind in ENUMS:
        return [i for i in range(len(ENUMS[field.kind])) if i != value]
    tries = {1, 2, value * 2, value * 4, value * 1024, max(1, value // 2), max(1, value // 4)}
    tries |= set(divisors(facts.value("devices")))  # the degrees a mesh of these devices can have
    tries.discard(value)
    return sorted(tries)


def _in_reading_order(fields: list[Field], rule: Rule, facts: PlanFacts) -> tuple[Field, ...]:
    rank = {symbol: i for i, symbol in enumerate(rule.fields)}
    position = {f.symbol: i for i, f in enumerate(facts.fields)}
    ordered = sorted(fields, key=lambda f: (rank.get(f.symbol, len(rank)), position[f.symbol]))
    out: list[Field] = []
    seen: set[Path_] = set()
    for f in ordered:  # two symbols may come from one field (e.g. dp_shard and its auto flag)
        if f.path not in seen:
            seen.add(f.path)
            out.append(f)
    return tuple(out)


def describe(rule: Rule, fields: tuple[Field, ...], values: Values, facts: PlanFacts) -> Finding:
    shown = [f"{f.dotted}={f.display()}" for f in fields]
    shown += [f"{c}={getattr(facts, c)}" for c in rule.context]
    reason = rule.explain(values)
    if not shown:
        message = reason
    elif rule.severity is Severity.warning:
        message = f"{_joined(shown)}: {reason}"
    elif len(shown) == 1:
        message = f"{shown[0]} breaks the rule: {reason}"
    else:
        message = f"{_joined(shown)} conflict: {reason}"
    return Finding(rule, fields, message, rule.hint(values))


def _joined(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]

"""The spec's symbolic variables: one Z3 variable per :class:`~mixle_compile.verify.facts.Field`.

Rules read attributes (``v.tp``, ``v.num_kv_heads``, ``v.data_parallel``) and build constraints
with Python operators and :mod:`mixle_compile.verify.logic`. Nothing here fixes a value: values
enter as *pins* (``var == value``), so the same variables serve three questions:

* is this plan valid? (every field pinned),
* which fields conflict? (an unsat core over the pins),
* what is the nearest valid plan, or the smallest failing world size? (some fields left free).

Quantities the spec derives are terms, not variables, so a conflict through them is blamed on
the fields they come from: ``dp_shard: auto`` is ``devices / (dp_replicate * tp * pp * cp)``, an
omitted ``num_kv_heads`` is ``num_heads``.
"""

from __future__ import annotations

from typing import Any

from mixle_compile.spec.kinds import Family
from mixle_compile.spec.models import auto_dp_shard
from mixle_compile.verify.facts import ENUMS, PlanFacts
from mixle_compile.verify.logic import TERMS, Integer, concrete, larger

# Optional model fields and what they default to in the spec.
_DEFAULTS = {"num_kv_heads": "num_heads", "moe_ffn_hidden_size": "ffn_hidden_size"}
_COUNTS = {"num_experts", "moe_first_layer", "mtp_layers", "microbatch_group"}  # may be 0; every other integer is >= 1


class Symbols:
    """Z3 terms for one spec's values and the quantities derived from them.

    With ``values`` (symbol -> value, the facts' own values for the symbols it omits) every
    variable is that concrete value instead (integers as :class:`~mixle_compile.verify.logic.Integer`),
    and rules read inside :func:`mixle_compile.verify.logic.concrete` evaluate to plain booleans:
    :func:`broken_rules`.
    """

    def __init__(self, facts: PlanFacts, *, elastic_world: bool = False, values: dict[str, Any] | None = None):
        self.facts = facts
        self.variables: dict[str, Any] = {}
        self.domain: list[Any] = []  # what every value satisfies whatever the pins say
        # With values, what several rules derive alike is kept for the others (read in one mode: the
        # concrete reading a caller opens around them)
        self.memo: dict[str, Any] | None = {} if values is not None else None
        if values is not None:
            self._concrete(facts, values)
            return
        import z3  # here, not at the top: the concrete reading (a plain check's verdict) needs no solver

        for f in facts.fields:
            if f.kind == "bool":
                var = z3.Bool(f.symbol)
            else:
                var = z3.Int(f.symbol)
                low = 0 if f.symbol in _COUNTS or f.kind in ENUMS else 1
                self.domain.append(var >= low)
                if f.kind in ENUMS:
                    self.domain.append(var < len(ENUMS[f.kind]))
            self.variables[f.symbol] = var
            if f.symbol.isidentifier():
                setattr(self, f.symbol, var)

        if facts.dp_shard_auto:
            unpinned = z3.Int("mesh.dp_shard")
            self.domain.append(unpinned >= 1)
            self.dp_shard = z3.If(self.dp_shard_auto, self._auto_dp_shard(), unpinned)
        self.data_parallel = self.dp_replicate * self.dp_shard
        self.world = self.data_parallel * self.tp * self.pp * self.cp

        # Under an elastic proof the global batch is held and the accumulation steps follow the
        # data-parallel size (what elastic launchers do); otherwise they are the spec's.
        if elastic_world:
            steps = self.global_batch_size / (self.micro_batch_size * self.microbatches * self.data_parallel)
            self.gradient_accumulation_steps = z3.If(steps >= 1, steps, 1)

        self._derived(facts, z3.IntVal(0))

    def _concrete(self, facts: PlanFacts, values: dict[str, Any]) -> None:
        """The same attributes as the solver terms, as values (``dp_shard`` must be a number)."""
        for f in facts.fields:
            value = values.get(f.symbol, f.value)
            var = bool(value) if f.kind == "bool" else Integer(int(value))
            self.variables[f.symbol] = var
            if f.symbol.isidentifier():
                setattr(self, f.symbol, var)
        if facts.dp_shard_auto:
            if not self.dp_shard_auto:
                raise ValueError("concrete symbols need dp_shard: auto resolved, or dp_shard given as a number")
            with concrete():  # what the solver's term reads when the auto flag is pinned true
                self.dp_shard = self._auto_dp_shard()
        self.data_parallel = self.dp_replicate * self.dp_shard
        self.world = self.data_parallel * self.tp * self.pp * self.cp
        self._derived(facts, Integer(0))

    def _auto_dp_shard(self) -> Any:
        """What dp_shard: auto resolves to: the ranks left over, kept >= 1 so that no term ever
        divides by zero (a world too small for the other degrees fails the world rule)."""
        quotient = auto_dp_shard(
            TERMS, devices=self.devices, dp_replicate=self.dp_replicate, tp=self.tp, pp=self.pp, cp=self.cp
        )
        return larger(quotient, Integer(1))

    def _derived(self, facts: PlanFacts, zero: Any) -> None:
        """What both readings name the same way: defaults taken from other fields, the layer count,
        no experts where the model has none, the split dimensions."""
        for name, default in _DEFAULTS.items():
            if name not in self.variables and default in self.variables:
                setattr(self, name, self.variables[default])
        if facts.family == Family.TRANSFORMER:
            self.layers = self.num_layers
        if "num_experts" not in self.variables:
            self.num_experts = zero
        if "moe_first_layer" not in self.variables:
            self.moe_first_layer = zero  # MoE layers from layer 0
        if "moe_shared_expert_hidden_size" not in self.variables:
            self.moe_shared_expert_hidden_size = zero  # no shared expert
        self.split_dimensions = tuple((d, self.variables[d.symbol]) for d in facts.split_dimensions)

    # -- enumerations --------------------------------------------------------------------------

    def is_(self, enum: str, *choices: str) -> Any:
        """``v.is_("pipeline_schedule", "1f1b", "interleaved_1f1b")``: the field is one of these."""
        values = ENUMS[enum]
        var = self.variables[enum]
        if isinstance(var, int):  # the concrete reading
            return any(var == values.index(c) for c in choices)
        import z3

        return z3.Or(*[var == values.index(c) for c in choices]) if choices else z3.BoolVal(False)

    # -- pins ------------------------------------------------------------------------------------

    def pin(self, symbol: str, value: Any = None) -> Any:
        """The constraint fixing one field to its value (the spec's unless given)."""
        import z3

        var = self.variables[symbol]
        value = self.facts.value(symbol) if value is None else value
        if z3.is_bool(var):
            return var == z3.BoolVal(bool(value))
        return var == int(value)


def broken_rules(facts: PlanFacts, rules: tuple, values: dict[str, Any], *, exact: bool = False) -> list:
    """The rules of ``rules`` that the plan of ``facts`` with ``values`` breaks, read with concrete
    values rather than solved: the same constraints, no solver. With every field pinned the
    solver's reading is a ground evaluation, so with ``exact`` (reals as fractions) this is its
    verdict; without, a faster screen whose floats may differ from it at a bound met to the last
    byte."""
    facts = with_values(facts, values)
    symbols = Symbols(facts, values={})
    with concrete(exact=exact):
        return [r for r in rules if r.constraint is not None and not r.constraint(symbols)]


def with_values(facts: PlanFacts, values: dict[str, Any]) -> PlanFacts:
    """The facts with some fields' values replaced (a rule may read ``v.facts.value(...)``)."""
    from dataclasses import replace

    from mixle_compile.verify.facts import Field

    fields = tuple(
        Field(f.symbol, f.path, values[f.symbol], f.kind) if f.symbol in values and values[f.symbol] != f.value else f
        for f in facts.fields
    )
    return replace(facts, fields=fields)


class _Reads:
    """Concrete symbols that note which attributes a rule reads (for ``is_``, the enumeration). A
    rule that reaches past the attributes (``facts``, ``variables``) reads "everything"."""

    _OPAQUE = frozenset({"facts", "variables", "split_dimensions", "domain"})

    def __init__(self, symbols: Symbols):
        self._symbols = symbols
        self.read: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        symbols = self.__dict__["_symbols"]
        if name == "is_":

            def is_(enum: str, *choices: str) -> Any:
                self.read.add(enum)
                return symbols.is_(enum, *choices)

            return is_
        self.read.add("*" if name in self._OPAQUE else name)
        return getattr(symbols, name)


def broken_rules_reading(facts: PlanFacts, rules: tuple, values: dict[str, Any]) -> list[tuple[Any, frozenset[str]]]:
    """:func:`broken_rules`, each with the attributes its constraint read ("*": more than attributes).
    A plan that agrees on those attributes takes the same path through the rule and breaks it too.
    Derived attributes (``data_parallel``, ``world``) are read as themselves: a plan agrees on them
    when it agrees on the degrees they are made of."""
    symbols = Symbols(with_values(facts, values), values={})
    out = []
    with concrete():
        for rule in rules:
            if rule.constraint is None:
                continue
            reads = _Reads(symbols)
            if not rule.constraint(reads):
                out.append((rule, frozenset(reads.read)))
    return out

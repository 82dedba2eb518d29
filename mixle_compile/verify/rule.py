"""One verifier rule = one :class:`Rule`: code, title, constraint, message, hint, docs, source.

A rule module defines each rule with :func:`define`, which puts it in the rule catalogue
(:data:`RULES`, the verifier's one registry) and registers its code with the diagnostics
catalogue so that ``mixle-compile explain CODE`` finds it. Codes are stable forever.

A rule's ``constraint`` maps the spec's symbolic variables to a Z3 formula that holds exactly
when the plan is valid under the rule. ``explain`` and ``hint`` receive the plan's concrete
values and say, in a person's words, why the formula fails and what would satisfy it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mixle_compile.diagnostics import Code, Severity, register_code
from mixle_compile.engines import EngineProfile, version_key
from mixle_compile.spec.kinds import NEURAL, Engine, Family
from mixle_compile.verify.facts import PlanFacts

# Engines with a rule set of their own. A backend registered under another name is checked with
# the rules every engine shares (the common set) plus its declared capabilities.
ENGINES = tuple(Engine)
COMMON = "common"  # the rule set of every other backend
RULE_SETS = (*ENGINES, COMMON)
# The families a rule applies to (Rule.families).
EVERY_FAMILY = frozenset(Family)
TRANSFORMER = frozenset({Family.TRANSFORMER})
MODULES = frozenset({Family.MODULES})


@dataclass(frozen=True)
class Rule:
    code: str
    name: str  # kebab-case, stable like the code
    title: str  # one line: what must hold
    docs: str  # markdown: what the rule checks and why
    engine_reference: str  # the engine documentation, source or issue the rule comes from
    constraint: Callable[[Any], Any] | None  # Symbols -> z3 formula; None for a proof rule
    explain: Callable[[Any], str]  # Values -> why the constraint fails, e.g. "6 % 8 != 0"
    hint: Callable[[Any], str] = lambda values: ""
    fields: tuple[str, ...] = ()  # the symbols a person should see first, in that order
    context: tuple[str, ...] = ()  # spec paths always named (e.g. `backend` for capabilities)
    engines: frozenset[str] | None = None  # None: every engine
    # Per engine, the versions the rule holds for: ">=0.16", "<0.16" or ">=0.12,<0.16"; an engine
    # not named holds at every version. Megatron's rules also name their front end: "arguments"
    # or "core" in `entries` (None: both).
    versions: tuple[tuple[str, str], ...] = ()
    entries: frozenset[str] | None = None
    families: frozenset[str] = NEURAL
    needs: tuple[str, ...] = ()  # symbols the spec must have for the rule to apply
    severity: Severity = Severity.error
    elastic: bool = True  # whether the elastic proof checks it at every world size
    # Whether a finding names a minimal set of conflicting fields (a solver search), or the rule's
    # `fields` as they are: for a warning whose formula is a disjunction the search is costly and says
    # no more than the rule's error twin.
    minimal_conflict: bool = True

    def applies_to(self, facts: PlanFacts) -> bool:
        return facts.family in self.families and all(facts.has(s) for s in self.needs)

    def in_rule_set(self, rule_set: str, engine: EngineProfile | None = None) -> bool:
        if self.engines is not None and rule_set not in self.engines:
            return False
        if engine is None or not engine.known:
            return True
        if self.entries is not None and engine.entry is not None and engine.entry not in self.entries:
            return False
        return all(version_holds(engine.version, bound) for name, bound in self.versions if name == engine.name)

    @property
    def engines_text(self) -> str:
        names = ENGINES if self.engines is None else [e for e in ENGINES if e in self.engines]
        if self.engines is None and not self.versions and self.entries is None:
            return "all"
        out = []
        for e in names:
            bounds = [b for n, b in self.versions if n == e]
            text = e + (" " + " ".join(bounds) if bounds else "")
            if e == Engine.MEGATRON and self.entries is not None:
                text += " (" + "/".join(sorted(self.entries)) + ")"
            out.append(text)
        return ", ".join(out)


RULES: dict[str, Rule] = {}


def define(rule: Rule) -> Rule:
    if rule.code in RULES and RULES[rule.code] != rule:
        raise ValueError(f"verifier rule {rule.code} is defined twice")
    RULES[rule.code] = rule
    register_code(
        Code(
            code=rule.code,
            title=rule.name,
            summary=rule.title,
            docs=rule.docs,
            severity=rule.severity,
            engine_reference=rule.engine_reference,
        )
    )
    return rule


def rule_set_name(backend: str) -> str:
    """The rule set a backend is checked with: its own, or ``common``."""
    return backend if backend in ENGINES else COMMON


def rules_for(facts: PlanFacts) -> tuple[Rule, ...]:
    """The rules that apply to one spec: its backend's rule set at its version, filtered by what
    the spec has."""
    name = rule_set_name(facts.backend)
    return tuple(r for r in RULES.values() if r.in_rule_set(name, facts.engine) and r.applies_to(facts))


def version_holds(version: str | None, bounds: str) -> bool:
    """Whether ``version`` satisfies every comma-separated bound, e.g. ``">=0.12,<0.16"``."""
    if version is None:
        return True
    key = version_key(version)
    for bound in bounds.split(","):
        bound = bound.strip()
        op = ">=" if bound.startswith(">=") else "<" if bound.startswith("<") else None
        if op is None:
            raise ValueError(f"a rule's version bound must start with '>=' or '<', got {bound!r}")
        limit = version_key(bound[len(op) :])
        if (op == ">=" and key < limit) or (op == "<" and key >= limit):
            return False
    return True

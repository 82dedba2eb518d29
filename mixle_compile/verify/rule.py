"""One verifier rule = one :class:`Rule`: code, title, constraint, message, hint, docs, source.

A rule module defines each rule with :func:`define`, which puts it in the rule catalogue
(:data:`RULES`, the verifier's one registry) and registers its code with the diagnostics
catalogue so that ``mixle-compile explain CODE`` finds it. Codes are stable forever.

A rule's ``constraint`` maps the spec's symbolic variables to a Z3 formula that holds exactly
when the plan is valid under the rule. ``explain`` and ``hint`` receive the plan's concrete
values and say, in a person's words, why the formula fails and what would satisfy it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from mixle_compile.diagnostics import Code, Severity, register_code
from mixle_compile.verify.facts import NEURAL, PlanFacts

# Engines with a rule set of their own. A backend registered under another name is checked with
# the rules every engine shares (the common set) plus its declared capabilities.
ENGINES = ("torch", "megatron")
EVERY_FAMILY = frozenset({"transformer", "modules", "distribution"})


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
    families: frozenset[str] = NEURAL
    needs: tuple[str, ...] = ()  # symbols the spec must have for the rule to apply
    severity: Severity = Severity.error
    elastic: bool = True  # whether the elastic proof checks it at every world size

    def applies_to(self, facts: PlanFacts) -> bool:
        return facts.family in self.families and all(facts.has(s) for s in self.needs)

    def in_rule_set(self, rule_set: str) -> bool:
        return self.engines is None or rule_set in self.engines

    @property
    def engines_text(self) -> str:
        return "all" if self.engines is None else ", ".join(e for e in ENGINES if e in self.engines)


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
    return backend if backend in ENGINES else "common"


def rules_for(facts: PlanFacts) -> tuple[Rule, ...]:
    """The rules that apply to one spec: its backend's rule set, filtered by what the spec has."""
    name = rule_set_name(facts.backend)
    return tuple(r for r in RULES.values() if r.in_rule_set(name) and r.applies_to(facts))

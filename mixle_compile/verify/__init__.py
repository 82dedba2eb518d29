"""The static verifier: Z3 rules with minimal conflicts, fix suggestions and elastic proofs.

Entry points (frozen data in, frozen data out):

* :func:`verify_plan` - the rules a validated spec breaks, each with its minimal set of
  conflicting fields, and the elastic proof when the spec has an elastic range;
* :func:`suggest_fix` - the nearest valid plan on the same devices;
* :func:`memory_bound` - the memory rule's bytes for a spec, by kind;
* :data:`RULES` - the rule catalogue (what ``mixle-compile rules`` lists).

Importing this package does not import z3. With every field of a plan pinned, whether each rule
holds is a ground evaluation, so :func:`verify_plan` reads the rules' statements with exact values
first and loads the solver only for what needs search: a broken plan's minimal conflicts, fixes,
elastic proofs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mixle_compile.diagnostics import Severity
from mixle_compile.verify.facts import PlanFacts, plan_facts
from mixle_compile.verify.rule import ENGINES, RULES, Rule, rule_set_name, rules_for
from mixle_compile.verify.rules import RULES as _CATALOGUE  # noqa: F401  (defines every rule)

if TYPE_CHECKING:
    from fractions import Fraction

    from mixle_compile.spec.models import Spec
    from mixle_compile.verify.elastic import ElasticProof
    from mixle_compile.verify.engine import Finding, PlanVerifier
    from mixle_compile.verify.suggest import Suggestion

__all__ = [
    "ENGINES",
    "RULES",
    "Rule",
    "Verification",
    "memory_bound",
    "plan_facts",
    "rule_set_name",
    "rules_for",
    "suggest_fix",
    "verify_plan",
]


@dataclass(frozen=True)
class Verification:
    facts: PlanFacts
    findings: tuple[Finding, ...]
    elastic: ElasticProof | None = None

    @property
    def errors(self) -> int:
        return sum(f.severity is Severity.error for f in self.findings)


def verify_plan(spec: Spec, verifier: PlanVerifier | None = None, *, errors_only: bool = False) -> Verification:
    """Check a spec that passed its own checks against its backend's rule set; with ``errors_only``
    only the errors are reported (the solver is not started for warnings)."""
    from mixle_compile.verify.symbols import broken_rules

    facts = plan_facts(spec)
    findings: tuple[Finding, ...] = ()
    # Every field is pinned, so whether a rule holds is a ground evaluation: the rules' one statement
    # read with exact values gives the solver's verdict without starting it. The solver is needed
    # for what a broken plan reports (a minimal conflict per rule, the values in its messages).
    broken = broken_rules(facts, rules_for(facts), {}, exact=True)
    if any(not errors_only or r.severity is Severity.error for r in broken):
        from mixle_compile.verify.engine import PlanVerifier

        verifier = verifier or PlanVerifier()
        findings = verifier.findings(facts, errors_only=True) if errors_only else verifier.findings(facts)
    proof = None
    # The proof needs an elastic axis, and says something new only once the plan is valid at its own
    # size under the rules the proof checks (the capability to restart, C005, is reported apart).
    if (
        facts.elastic is not None
        and facts.dp_shard_auto
        and not any(f.severity is Severity.error and f.rule.elastic for f in findings)
    ):
        from mixle_compile.verify.elastic import prove_elastic

        proof = prove_elastic(facts)
    return Verification(facts, findings, proof)


def suggest_fix(spec: Spec) -> Suggestion | None:
    from mixle_compile.verify.suggest import nearest_valid_plan

    return nearest_valid_plan(plan_facts(spec))


def memory_bound(spec: Spec) -> dict[str, Fraction]:
    """The memory rule's (R001) bytes for the heaviest rank of a neural spec, by kind, at the spec's
    own values: the bound the verifier compares with device memory."""
    from mixle_compile.verify.engine import PlanVerifier, Values
    from mixle_compile.verify.rules.memory import DEVICE_MEMORY, per_rank_bytes

    facts = plan_facts(spec)
    if facts.footprint is None:
        raise ValueError(f"the memory rule does not apply to {str(facts.family)!r} models")
    encoding = PlanVerifier().encoding(facts, (DEVICE_MEMORY,))
    values = Values(encoding.symbols, encoding.model(facts), facts)
    return {kind: values.eval(term) for kind, term in per_rank_bytes(encoding.symbols).items()}

"""The verdict `check` gives without the solver is the solver's.

`verify_plan` reads every rule's one statement with the plan's exact values (reals as fractions)
and starts Z3 only when a rule is broken. These tests hold that reading to the solver's: on every
spec of the corpus and the examples, on random plans around them (dp_shard given and auto, listed
layer splits, distributions), and at the memory rule's bound met to the byte, where a float reading
could round either way.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from mixle_compile.spec import load_spec
from mixle_compile.verify import memory_bound, plan_facts, verify_plan
from mixle_compile.verify.engine import PlanVerifier
from mixle_compile.verify.rule import rules_for
from mixle_compile.verify.rules.memory import DEVICE_MEMORY, RESERVE
from mixle_compile.verify.symbols import broken_rules
from tests.conftest import ROOT

SPECS = sorted((ROOT / "tests" / "corpus").rglob("*.yaml")) + sorted((ROOT / "examples").glob("*.yaml"))


def _loaded_facts():
    out = []
    for path in SPECS:
        loaded = load_spec(path)
        if loaded.ok and loaded.spec is not None:
            out.append((path, loaded.spec, plan_facts(loaded.spec)))
    return out


@pytest.fixture(scope="module")
def corpus():
    facts = _loaded_facts()
    assert len(facts) >= 80
    return facts


def _codes(rules) -> set[str]:
    return {r.code for r in rules}


def test_the_exact_reading_agrees_with_the_solver_on_every_corpus_spec(corpus):
    verifier = PlanVerifier()
    broken = 0
    for path, _spec, facts in corpus:
        read = _codes(broken_rules(facts, rules_for(facts), {}, exact=True))
        assert read == _codes(verifier.violated(facts)), path.name
        broken += bool(read)
    assert broken >= 20  # the corpus's failing and oom specs break rules: both verdicts are exercised


def test_the_exact_reading_agrees_with_the_solver_on_random_plans(corpus):
    rng = random.Random(11)
    verifier = PlanVerifier()
    degrees = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "etp", "microbatches")
    degrees += ("gradient_accumulation_steps", "micro_batch_size", "virtual_pipeline_stages")
    compared = auto = 0
    # every spec whose dp_shard is `auto` (so that both readings fill it), and others drawn at random
    autos = [c for c in corpus if c[2].dp_shard_auto][:10]
    drawn = autos + rng.sample([c for c in corpus if not c[2].dp_shard_auto], 40 - len(autos))
    for path, _spec, facts in drawn:
        for _ in range(6):
            values = {s: rng.choice([1, 1, 2, 3, 4, 8]) for s in degrees if facts.has(s)}
            if facts.has("devices"):
                values["devices"] = rng.choice([facts.value("devices"), 8, 16, 64, 96])
            for enum in ("activation_checkpointing", "pipeline_schedule"):
                if facts.has(enum):
                    values[enum] = rng.randrange(3)
            fields = tuple(dataclasses.replace(f, value=values.get(f.symbol, f.value)) for f in facts.fields)
            pinned = dataclasses.replace(facts, fields=fields)
            read = _codes(broken_rules(pinned, rules_for(pinned), {}, exact=True))
            assert read == _codes(verifier.violated(pinned)), (path.name, values)
            compared += 1
            auto += facts.dp_shard_auto
    assert compared == 240 and auto > 0


def test_the_memory_rule_is_decided_to_the_byte(corpus):
    """At device memory equal to the live bytes (rounded up) the rule holds, one byte below them it is
    broken: both readings."""
    verifier = PlanVerifier()
    checked = 0
    for path, spec, facts in corpus:
        if facts.footprint is None or not facts.has("device_memory") or checked >= 6:
            continue
        bound = math.ceil(sum(v for kind, v in memory_bound(spec).items() if kind != RESERVE))  # what R001 compares
        for memory, holds in ((bound, True), (bound - 1, False)):
            fields = tuple(
                dataclasses.replace(f, value=memory) if f.symbol == "device_memory" else f for f in facts.fields
            )
            pinned = dataclasses.replace(facts, fields=fields)
            read = "R001" in _codes(broken_rules(pinned, (DEVICE_MEMORY,), {}, exact=True))
            solved = "R001" in _codes(verifier.violated(pinned))
            assert read == solved == (not holds), (path.name, memory)
        checked += 1
    assert checked == 6


def test_a_valid_spec_is_verified_without_starting_the_solver(corpus, monkeypatch):
    """A plan that breaks nothing has no findings without the solver; a broken one still gets the
    solver's findings (its minimal conflicts)."""
    valid = [(p, s) for p, s, facts in corpus if not broken_rules(facts, rules_for(facts), {}, exact=True)]
    broken = [(p, s) for p, s, facts in corpus if broken_rules(facts, rules_for(facts), {}, exact=True)]
    assert len(valid) >= 50 and broken
    assert all(verify_plan(s).findings for _, s in broken[:5])

    def no_solver(self, facts):
        raise AssertionError("the solver was started for a valid plan")

    monkeypatch.setattr(PlanVerifier, "findings", no_solver)
    for path, spec in valid[:10]:
        assert verify_plan(spec).findings == (), path.name
    for _, spec in broken[:5]:
        with pytest.raises(AssertionError, match="solver was started"):
            verify_plan(spec)

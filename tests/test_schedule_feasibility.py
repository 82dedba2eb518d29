"""Schedule feasibility is written once (mixle_compile/schedules.py) and read three ways: as solver
terms by the verifier's rules P003-P005, as values by the same rules under `concrete()` (the plan
search's screen), and as numbers by the lowering's schedule builder. The three readings must agree
on every (engine, schedule, pp, micro-batches, accumulation, virtual stages)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import z3

from mixle_compile.engines import engine_profile
from mixle_compile.lower.schedule import pipeline_schedule
from mixle_compile.schedules import SCHEDULES, bubble_fraction, pipelined, requirement, runs
from mixle_compile.verify.logic import Integer, concrete
from mixle_compile.verify.rule import RULES, rule_set_name
from mixle_compile.verify.rules import pipeline  # noqa: F401  (defines the rules)

FEASIBILITY = ("P003", "P004", "P005")


def _grid(groups=(0,)):
    """(schedule, pp, m, accumulation, v, group): ``groups`` are Megatron's interleaved micro-batch
    groups to try (0: its default, pp)."""
    for schedule, pp, m, accumulation in itertools.product(SCHEDULES, range(1, 6), range(1, 11), (1, 2)):
        for v in (1, 2, 3) if schedule == "interleaved_1f1b" and pp > 1 else (1,):
            for group in groups:
                yield schedule, pp, m, accumulation, v, group


def _symbols(engine, schedule, pp, m, accumulation, v, group, number):
    """What the schedule rules read of a spec, as solver numerals or as concrete integers."""
    return SimpleNamespace(
        facts=SimpleNamespace(engine=engine),
        pp=number(pp),
        microbatches=number(m),
        gradient_accumulation_steps=number(accumulation),
        virtual_pipeline_stages=number(v),
        microbatch_group=number(group),
        is_=lambda enum, *choices: (z3.BoolVal if number is z3.IntVal else bool)(schedule in choices),
    )


def _verifier_accepts(rules, engine, case) -> bool:
    terms = _symbols(engine, *case, number=z3.IntVal)
    verdict = z3.simplify(z3.And(*[r.constraint(terms) for r in rules]) if rules else z3.BoolVal(True))
    assert z3.is_true(verdict) or z3.is_false(verdict)
    return z3.is_true(verdict)


def _screen_accepts(rules, engine, case) -> bool:
    with concrete():
        values = _symbols(engine, *case, number=Integer)
        return all(bool(r.constraint(values)) for r in rules)


def _builder_accepts(engine, schedule, pp, m, accumulation, v, group) -> bool:
    schedule, v = pipelined(schedule, pp, v)
    try:
        pipeline_schedule(
            pp, engine.schedule_microbatches(m, accumulation), schedule, v, family=engine.schedules, group=group or None
        )
    except ValueError as exc:
        assert str(exc).startswith(FEASIBILITY), exc  # refused by a requirement, never for another reason
        return False
    return True


@pytest.mark.parametrize("backend", ["torch", "torchtitan", "megatron"])
def test_the_verifier_the_screen_and_the_builder_agree_over_a_grid(backend):
    engine = engine_profile(backend)
    rules = [RULES[c] for c in FEASIBILITY if RULES[c].in_rule_set(rule_set_name(backend), engine)]
    assert rules, backend
    refused = 0
    for case in _grid((0, 2, 3, 5, 7) if backend == "megatron" else (0,)):
        built = _builder_accepts(engine, *case)
        assert _verifier_accepts(rules, engine, case) == built, (backend, case)
        assert _screen_accepts(rules, engine, case) == built, (backend, case)
        refused += not built
    assert refused > 0  # the grid reaches the refusals, not only the schedules every number runs


def test_a_refusal_reads_the_same_sentence_in_the_rule_and_the_builder():
    req = requirement("P005")
    with pytest.raises(ValueError) as refused:
        pipeline_schedule(4, 9, "interleaved_1f1b", 2)
    assert str(refused.value) == f"P005: {req.broken(4, 9, 4)}; {req.fix(4, 9, 4)}"
    req = requirement("P004")
    with pytest.raises(ValueError) as refused:
        pipeline_schedule(4, 7, "interleaved_1f1b", 2, family="megatron", group=5)
    assert str(refused.value) == f"P004: {req.broken(4, 7, 5)}; {req.fix(4, 7, 5)}"


def test_without_a_pipeline_a_plan_states_gpipe_with_one_chunk():
    for schedule in SCHEDULES:
        assert pipelined(schedule, 1, 1) == ("gpipe", 1)
        assert runs(engine_profile("megatron").schedules, schedule, 1, 1) == "gpipe"
    assert pipelined("interleaved_1f1b", 2, 3) == ("interleaved_1f1b", 3)
    assert pipelined("1f1b", 4, 1) == ("1f1b", 1)


def test_the_bubble_fraction_is_narayanans():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)

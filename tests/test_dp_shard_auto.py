"""`mesh.dp_shard: auto` is written once (mixle_compile/spec/models.py) and read as numbers by the
loader (S012) and the plan's mesh (`parallel_plan`), and as solver terms by the verifier's symbols.
The readings must agree on every mesh."""

from __future__ import annotations

import itertools

import pytest
import z3

from mixle_compile.schedules import NUMBERS
from mixle_compile.spec import load_spec_text, parallel_plan
from mixle_compile.spec.models import AUTO, auto_divisor, auto_dp_shard, auto_resolves, is_auto
from mixle_compile.verify import plan_facts
from mixle_compile.verify.logic import TERMS
from mixle_compile.verify.symbols import Symbols
from tests.conftest import EXAMPLES

BASE = (EXAMPLES / "llama3-8b-hsdp-tp.yaml").read_text(encoding="utf-8")  # dp_shard: auto, 64 devices


def _spec_text(devices: int, dp_replicate: int, tp: int, pp: int) -> str:
    text = BASE.replace("  dp_replicate: 2\n", f"  dp_replicate: {dp_replicate}\n  pp: {pp}\n")
    text = text.replace("  tp: 8\n", f"  tp: {tp}\n").replace("  devices: 64\n", f"  devices: {devices}\n")
    assert text.count(f"devices: {devices}") == 1 and f"pp: {pp}" in text
    return text


def test_the_formula_reads_the_same_as_numbers_and_as_solver_terms():
    for devices, dp_replicate, tp, pp, cp in itertools.product(
        (1, 6, 8, 12, 64, 96), (1, 2, 3), (1, 2, 8), (1, 4), (1, 2)
    ):
        degrees = dict(dp_replicate=dp_replicate, tp=tp, pp=pp, cp=cp)
        number = auto_dp_shard(NUMBERS, devices=devices, **degrees)
        term = auto_dp_shard(TERMS, devices=z3.IntVal(devices), **{k: z3.IntVal(v) for k, v in degrees.items()})
        assert z3.simplify(term).as_long() == number, (devices, degrees)
        assert auto_resolves(devices, auto_divisor(**degrees)) == (number * auto_divisor(**degrees) == devices)


@pytest.mark.parametrize("devices", [8, 12, 64])
def test_the_loader_the_plan_and_the_verifier_resolve_auto_alike(devices):
    seen = set()
    for dp_replicate, tp, pp in itertools.product((1, 2, 3), (1, 2, 8), (1, 2)):
        loaded = load_spec_text(_spec_text(devices, dp_replicate, tp, pp), "auto.yaml")
        divisor = dp_replicate * tp * pp
        unresolvable = [d for d in loaded.diagnostics if d.code == "S012"]
        assert bool(unresolvable) == (devices % divisor != 0), (devices, dp_replicate, tp, pp)
        seen.add(bool(unresolvable))
        if unresolvable:
            continue
        spec = loaded.spec
        assert spec is not None and is_auto(spec.mesh.dp_shard)
        expected = parallel_plan(spec).dp_shard
        assert expected == devices // divisor
        facts = plan_facts(spec)
        symbols = Symbols(facts)
        solver = z3.Solver()
        solver.add(*symbols.domain, *[symbols.pin(f.symbol) for f in facts.fields])
        assert solver.check() == z3.sat
        assert solver.model().eval(symbols.dp_shard).as_long() == expected, (devices, dp_replicate, tp, pp)
    assert seen == {True, False}


def test_auto_is_only_the_word():
    assert is_auto(AUTO) and not is_auto(4) and not is_auto("Auto") and not is_auto(None)

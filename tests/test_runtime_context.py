"""Context parallelism in plain torch: which positions a cp rank holds, how its parts of a result
are checked, what the runtime refuses. (The distributed runs are in test_runtime_replay.py.)"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.test_runtime_support import compile_text, plan_for, spec_text

torch = pytest.importorskip("torch")

from mixle_compile.runtime.errors import RuntimeRefusal  # noqa: E402
from mixle_compile.runtime.instructions import read_instructions  # noqa: E402
from mixle_compile.runtime.model import cp_positions  # noqa: E402
from mixle_compile.runtime.reference import ReferenceRecords, compare  # noqa: E402


@given(st.sampled_from([1, 2, 3, 4, 8]), st.sampled_from([1, 2, 4]))
def test_cp_ranks_hold_every_position_once_and_equal_causal_work(cp, chunk):
    seq = 2 * cp * chunk
    held = [cp_positions(seq, cp, r) for r in range(cp)]
    assert sorted(p for mine in held for p in mine) == list(range(seq))
    # Causal attention costs a query at position p (p + 1) keys: an early and a late chunk balance it.
    assert len({sum(p + 1 for p in mine) for mine in held}) == 1
    assert held[0][:chunk] == list(range(chunk)) and held[0][chunk:] == list(range(seq - chunk, seq))


def test_a_sequence_that_does_not_cut_into_two_chunks_per_rank_is_an_error():
    with pytest.raises(ValueError, match="2 \\* cp = 4 equal chunks"):
        cp_positions(10, 2, 0)


def records_with(grad: torch.Tensor) -> ReferenceRecords:
    return ReferenceRecords(before={}, after={}, grads={(0, "w", 0, 0): grad}, acts={}, canonical={"w": "w"})


def run_of(entries):
    return {
        "first": [(key, expect, value, "d") for key, expect, value in entries],
        "repeat": {key: "d" for key, _, _ in entries},
    }


def test_parts_of_a_cp_group_are_compared_by_their_sum():
    grad = torch.tensor([1.0, 2.0, 3.0])
    key = ("w:grad/tp", 0, 0, None, 0)
    part = ("part", (0, 1), ("grad", "w", (0,), (0,), 1, ()))
    good = compare(
        records_with(grad),
        [run_of([(key, part, torch.tensor([0.5, 2.0, 1.0]))]), run_of([(key, part, torch.tensor([0.5, 0.0, 2.0]))])],
    )
    assert good["w:grad/tp"].samples == 1 and good["w:grad/tp"].max_rel == 0.0
    # One part alone (a missed reduction elsewhere would leave exactly this) is far off.
    wrong = compare(
        records_with(grad),
        [run_of([(key, part, torch.tensor([0.5, 2.0, 1.0]))]), run_of([(key, part, torch.tensor([0.5, 0.0, 0.0]))])],
    )
    assert wrong["w:grad/tp"].max_rel > 0.1
    with pytest.raises(ValueError, match="1 of the ranks \\[0, 1\\] recorded their part"):
        compare(records_with(grad), [run_of([(key, part, grad)])])


def test_cp_plans_are_executed_and_their_kv_gathers_are_activation_sites():
    instructions = read_instructions(plan_for(cp=2, tp=2))
    sites = set(instructions.activation_sites)
    assert {"layers.0.attn:kv", "layers.0.attn:kv/grad", "layers.1.attn:kv"} <= sites
    kv = instructions.collectives["layers.0.attn:kv"]
    # 2 (K and V) x 2 samples x 8 tokens x 2 KV heads of this tp rank x 8 wide x fp32, from both cp ranks.
    assert (kv.collective, kv.rule, kv.payload_bytes) == ("all_gather", "cp", 2 * 2 * 8 * 1 * 8 * 4 * 2)
    assert [c.rule for c in instructions.param("embed.weight").gradient] == ["cp"]


def test_sequence_parallelism_must_split_each_cp_ranks_tokens():
    text = spec_text(tp=4, cp=2, sp=True).replace("seq_len: 16", "seq_len: 12")
    from mixle_compile.spec import load_spec_text

    loaded = load_spec_text(text, "spec.yaml")
    if not loaded.ok:
        pytest.skip("the spec layer already rejects this sequence length")
    from mixle_compile.lower.lowering import lower
    from mixle_compile.plan import build_plan, load_plan_text, plan_text

    doc = load_plan_text(plan_text(build_plan(loaded.spec, lower(loaded.spec), loaded.diagnostics)))
    with pytest.raises(RuntimeRefusal, match="splits each rank's 6 tokens"):
        read_instructions(doc)


def test_modules_models_are_refused_under_cp():
    text = """\
model:
  family: modules
  parameters:
    - {name: embed.weight, shape: [64, 32], role: embedding}
    - {name: head.weight, shape: [64, 32], role: head}
mesh: {cp: 2}
training: {global_batch_size: 4, micro_batch_size: 4, seq_len: 8, precision: fp32, optimizer: sgd, steps: 1}
backend: torch
resources: {devices: 2, memory: 1GiB, kind: cpu}
"""
    with pytest.raises(RuntimeRefusal, match="context parallelism cannot split it"):
        read_instructions(compile_text(text))

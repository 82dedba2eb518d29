"""Activation checkpointing's recomputed forward issues collectives again: the plan lists them as
backward updates of their own (``layers.0.attn:in/recompute``), per the engine's policy."""

from __future__ import annotations

import pytest

from mixle_compile.engines import engine_profile
from mixle_compile.lower.lowering import lower
from mixle_compile.spec import load_spec_text
from mixle_compile.step_time import predict_lowered

SPEC = """\
model: {{family: transformer, vocab_size: 256, hidden_size: 64, num_layers: 4, num_heads: 4, ffn_hidden_size: 128,
        tie_embeddings: false{moe}}}
mesh: {{dp_replicate: 1, dp_shard: {ds}, tp: {tp}, pp: 1, cp: {cp}, ep: {ep}, microbatches: 1}}
training: {{global_batch_size: {ds}, micro_batch_size: 1, seq_len: 32, sequence_parallel: {sp},
           activation_checkpointing: {ckpt}}}
backend: {backend}
resources: {{devices: {world}, memory: 8GiB, kind: h100}}
"""


def lowered(backend, ckpt, tp=1, cp=1, ep=1, sp=True):
    moe = ", num_experts: 4, experts_per_token: 2" if ep > 1 else ""
    text = SPEC.format(
        tp=tp, cp=cp, ep=ep, ds=ep, sp=str(sp).lower(), ckpt=ckpt, backend=backend, world=tp * cp * ep, moe=moe
    )
    loaded = load_spec_text(text, "t.yaml")
    assert loaded.ok, [d.text() for d in loaded.diagnostics]
    return loaded.spec, lower(loaded.spec, schedule=False, each_layer=True)


def recomputed(low, layer=0):
    """The recomputed collectives of one block: id without the layer prefix -> its update."""
    prefix = f"layers.{layer}."
    return {
        u.update.node_id[len(prefix) :]: u
        for u in low.updates
        if u.update.node_id.startswith(prefix) and u.update.node_id.endswith("/recompute")
    }


TITAN = "{name: torchtitan, version: '0.3'}"
TITAN_02 = "{name: torchtitan, version: '0.2'}"
MEGATRON = "{name: megatron, version: '0.16'}"


def test_full_checkpointing_issues_every_forward_collective_of_a_block_again():
    _, low = lowered(TITAN, "full", tp=2)
    again = recomputed(low)
    assert set(again) == {"attn:in/recompute", "attn:out/recompute", "mlp:in/recompute", "mlp:out/recompute"}
    forward = {u.update.node_id: u for u in low.updates}
    for name, u in again.items():
        original = forward["layers.0." + name.removesuffix("/recompute")]
        assert u.phase == "backward" and original.phase == "forward"
        assert (u.update.collective, u.payload_bytes, u.group_size, u.occurrences_per_step, u.stage) == (
            original.update.collective,
            original.payload_bytes,
            original.group_size,
            original.occurrences_per_step,
            original.stage,
        )
    # every block, not just the one lowered first; the embedding and head are not checkpointed
    for layer in range(4):
        assert set(recomputed(low, layer)) == set(again)
    assert not [u for u in low.updates if u.update.node_id.endswith("/recompute") and u.layer is None]


def test_torchtitan_op_level_checkpointing_keeps_reduce_scatters_and_gathers_again():
    # the save list keeps reduce_scatter_tensor (and all_to_all_single from 0.3), never all_gather or all_reduce
    _, low = lowered(TITAN, "selective", tp=2)
    assert set(recomputed(low)) == {"attn:in/recompute", "mlp:in/recompute"}
    _, low = lowered(TITAN, "selective", tp=2, sp=False)
    assert set(recomputed(low)) == {"attn:out/recompute", "mlp:out/recompute"}  # the all_reduces
    _, low = lowered(TITAN, "selective", cp=2)
    assert set(recomputed(low)) == {"attn:kv/recompute"}


def test_torchtitan_before_0_3_recomputes_the_expert_all_to_all_and_0_3_saves_it():
    _, old = lowered(TITAN_02, "selective", ep=2)
    _, new = lowered(TITAN, "selective", ep=2)
    assert {"moe:dispatch/recompute", "moe:combine/recompute"} <= set(recomputed(old))
    assert not set(recomputed(new))


def test_megatron_selective_recomputes_core_attention_only():
    _, low = lowered(MEGATRON, "selective", tp=2)
    assert recomputed(low) == {}
    _, low = lowered(MEGATRON, "selective", cp=2)
    assert set(recomputed(low)) == {"attn:kv/recompute"}
    _, low = lowered(MEGATRON, "full", tp=2)
    assert len(recomputed(low)) == 4


@pytest.mark.parametrize("ckpt", ["none", "selective", "full"])
def test_the_in_tree_runtime_keeps_activations_so_nothing_is_issued_again(ckpt):
    _, low = lowered("torch", ckpt, tp=2)
    assert recomputed(low) == {}
    assert not engine_profile("torch").recomputes(ckpt, "all_gather", "mlp")


def test_recomputed_collectives_are_in_the_traffic_and_the_step_time():
    spec_none, none = lowered(TITAN, "none", tp=2)
    spec_full, full = lowered(TITAN, "full", tp=2)
    tp_bytes = lambda low: sum(t.bytes_per_rank_per_step for t in low.traffic if t.axes == ("tp",))  # noqa: E731
    assert tp_bytes(full) > tp_bytes(none)
    exposed = lambda spec, low: predict_lowered(spec, low).exposed_communication.get("tp", 0.0)  # noqa: E731
    # per block, 4 forward and 4 backward collectives and (full) the 4 forward ones again
    block = lambda low: [u for u in low.updates if u.layer == 1 and u.update.mesh_axes == ("tp",)]  # noqa: E731
    assert len(block(full)) == len(block(none)) + 4
    assert exposed(spec_full, full) > exposed(spec_none, none)

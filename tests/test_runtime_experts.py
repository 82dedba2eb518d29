"""Mixture-of-experts layers and expert parallelism in the torch runtime (runtime/experts.py).

Every replay case runs the plan's ranks as gloo processes with ``--reference`` and checks planned ==
observed for every update on every rank, evidence for every update (the expert-parallel token
exchanges included) within a bound that a wrong divisor or a lost token would break, and, under
expert parallelism, the measured all_to_all traffic next to the plan's model.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from mixle_compile.lower.lowering import lower
from mixle_compile.runtime import run_plan
from mixle_compile.runtime.errors import RuntimeRefusal
from mixle_compile.runtime.experts import ExpertShape, expert_output, moe_mlp, route, slot_ids
from mixle_compile.runtime.instructions import read_instructions
from mixle_compile.runtime.model import LocalOps, cp_positions
from mixle_compile.spec import load_spec_text
from tests.conftest import EXAMPLES
from tests.test_runtime_support import compile_text

BOUND = {"sgd": 1e-5, "adamw": 1e-3, "bf16": 1e-1}


def moe_spec(
    *,
    dr=1,
    ds=1,
    tp=1,
    ep=1,
    etp=1,
    sp=False,
    experts=4,
    k=2,
    frequency=1,
    activation="swiglu",
    optimizer="sgd",
    lr=1e-2,
    gas=1,
    mb=1,
    precision="fp32",
    pp=1,
    dopt=False,
    cp=1,
    shared=0,
    shared_gate=False,
    first=0,
) -> str:
    world = dr * ds * tp * pp * cp
    shared_fields = f", moe_shared_expert_hidden_size: {shared}" if shared else ""
    if shared_gate:
        shared_fields += ", moe_shared_expert_gate: true"
    if first:
        shared_fields += f", moe_first_layer: {first}"
    return textwrap.dedent(
        f"""\
        model: {{family: transformer, vocab_size: 128, hidden_size: 32, num_layers: 2, num_heads: 4, num_kv_heads: 2,
                ffn_hidden_size: 64, num_experts: {experts}, experts_per_token: {k}, moe_ffn_hidden_size: 48,
                moe_layer_frequency: {frequency}, activation: {activation}{shared_fields}}}
        mesh: {{dp_replicate: {dr}, dp_shard: {ds}, tp: {tp}, pp: {pp}, ep: {ep}, etp: {etp}, cp: {cp}, \
microbatches: {max(mb, pp)},
               gradient_accumulation_steps: {gas}}}
        training: {{global_batch_size: {2 * dr * ds * gas * max(mb, pp)}, micro_batch_size: 2, seq_len: 16, \
precision: {precision},
                   optimizer: {optimizer}, learning_rate: {lr}, sequence_parallel: {str(sp).lower()},
                   distributed_optimizer: {str(dopt).lower()}, steps: 3}}
        backend: torch
        resources: {{devices: {world}, memory: 1GiB, kind: cpu}}
        """
    )


def moe_plan(**kwargs):
    return compile_text(moe_spec(**kwargs))


# --- routing and the experts, in one process ----------------------------------------------------


def test_routing_takes_the_softmax_probabilities_of_the_top_k_experts_without_renormalising():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 3.0, 0.0, 0.0]])
    weights, experts = route(logits, 2)
    probs = torch.softmax(logits, dim=-1)
    assert experts.tolist() == [[1, 2], [0, 1]]  # most probable first; a tie goes to the lower index
    assert torch.allclose(weights, probs.gather(1, experts))
    assert float(weights[0].sum()) < 1.0  # not renormalised over the chosen experts


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_the_layer_is_every_tokens_weighted_sum_of_its_chosen_experts(activation):
    g = torch.Generator().manual_seed(0)
    e, f, h, k = 4, 6, 8, 2
    weights = {
        "u.moe.router.weight": torch.randn(e, h, generator=g),
        "u.moe.experts.gate_proj": torch.randn(e, f, h, generator=g),
        "u.moe.experts.up_proj": torch.randn(e, f, h, generator=g),
        "u.moe.experts.down_proj": torch.randn(e, h, f, generator=g),
    }
    x = torch.randn(5, 3, h, generator=g)
    y = moe_mlp(LocalOps(weights), ExpertShape(e, k, 1, activation), "u", x)
    gate = weights["u.moe.experts.gate_proj"] if activation == "swiglu" else None
    tokens = x.reshape(-1, h)
    for t in range(tokens.shape[0]):  # brute force, token by token
        probs = torch.softmax(weights["u.moe.router.weight"] @ tokens[t], dim=0)
        top = torch.argsort(probs, descending=True)[:k]
        want = sum(
            probs[j]
            * expert_output(
                tokens[t : t + 1],
                None if gate is None else gate[j],
                weights["u.moe.experts.up_proj"][j],
                weights["u.moe.experts.down_proj"][j],
                activation,
            )[0]
            for j in top.tolist()
        )
        assert torch.allclose(y.reshape(-1, h)[t], want, atol=1e-5)


def test_slot_ids_name_the_reference_rows_of_a_context_parallel_ranks_tokens():
    # cp rank 1 of 2 holds positions 4..7 and 8..11 of 16; under tp with whole experts tp rank 1 of 2
    # routes the second half of them. Rows are sequence-first ([s, b] flattened), k choices each.
    positions = torch.tensor(cp_positions(16, 2, 1))
    ids = slot_ids(positions, 8, 2, 3, (4, 8), positions.device).tolist()
    want = [(p * 2 + b) * 3 + j for p in [8, 9, 10, 11] for b in range(2) for j in range(3)]
    assert ids == want
    assert slot_ids(None, 4, 1, 2, None, positions.device).tolist() == list(range(8))


# --- the plan: expert gradients divided by the data degree --------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "edp"), [(dict(ds=2, ep=2), 1), (dict(ds=4, ep=2), 2), (dict(ds=2, tp=2, ep=2, sp=True), 2)]
)
def test_expert_gradients_are_divided_by_the_data_degree_whatever_the_expert_data_group(kwargs, edp):
    doc = moe_plan(**kwargs)
    assert doc.verdict.ok and doc.verdict.reductions_exactly_once
    data_degree = kwargs["ds"]
    for name in ("gate_proj", "up_proj", "down_proj"):
        (u,) = [u for u in doc.updates if u.tensor == f"layers.0.moe.experts.{name}" and u.payload == "gradient"]
        # With one expert-data rank (ep covers every data rank) the reduction is over that one rank
        # and only divides: every token already reached its expert.
        assert (u.mesh_axes, u.group_size, u.gradient_divisor) == (["edp"], edp, data_degree)


def test_experts_are_sharded_by_whole_experts_over_expert_data_when_they_split_evenly():
    spec = load_spec_text(moe_spec(ds=2), "spec.yaml").spec
    placed = {p.name: p for p in lower(spec).parameters}
    assert placed["layers.0.moe.experts.up_proj"].layout.placements == (("edp", "shard(0)"),)
    spec = load_spec_text(moe_spec(ds=2, experts=3, k=1), "spec.yaml").spec
    placed = {p.name: p for p in lower(spec).parameters}
    assert placed["layers.0.moe.experts.up_proj"].layout.placements == (("edp", "shard(1)"),)


def test_a_shared_expert_adds_its_gated_dense_mlp_of_every_token_to_the_routed_output():
    from dataclasses import replace

    from mixle_compile.runtime.model import TransformerShape, _feed_forward

    g = torch.Generator().manual_seed(1)
    e, f, s_, h, k = 4, 6, 5, 8, 2
    weights = {
        "u.moe.router.weight": torch.randn(e, h, generator=g),
        "u.moe.experts.gate_proj": torch.randn(e, f, h, generator=g),
        "u.moe.experts.up_proj": torch.randn(e, f, h, generator=g),
        "u.moe.experts.down_proj": torch.randn(e, h, f, generator=g),
        "u.moe.shared.gate_proj.weight": torch.randn(s_, h, generator=g),
        "u.moe.shared.up_proj.weight": torch.randn(s_, h, generator=g),
        "u.moe.shared.down_proj.weight": torch.randn(h, s_, generator=g),
        "u.moe.shared.gate.weight": torch.randn(1, h, generator=g),
    }
    x = torch.randn(5, 3, h, generator=g)
    routed = moe_mlp(LocalOps(weights), ExpertShape(e, k, 1, "swiglu"), "u", x)
    shape = TransformerShape(
        vocab_size=16,
        hidden_size=h,
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        head_dim=4,
        ffn_hidden_size=f,
        norm="rmsnorm",
        activation="swiglu",
        position_embedding="rope",
        compute_dtype=torch.float32,
        experts=ExpertShape(e, k, 1, "swiglu", shared=True, shared_gate=True),
    )
    y = _feed_forward(LocalOps(weights), shape, 0, "u", x)
    dense = (
        torch.nn.functional.silu(x @ weights["u.moe.shared.gate_proj.weight"].T)
        * (x @ weights["u.moe.shared.up_proj.weight"].T)
    ) @ weights["u.moe.shared.down_proj.weight"].T
    gate = torch.sigmoid(x @ weights["u.moe.shared.gate.weight"].T)
    assert torch.allclose(y, routed + gate * dense, atol=1e-5)
    ungated = _feed_forward(
        LocalOps(weights), replace(shape, experts=replace(shape.experts, shared_gate=False)), 0, "u", x
    )
    assert torch.allclose(ungated, routed + dense, atol=1e-5)


# --- replay against the single-process reference -----------------------------------------------

CASES = {
    "ep1-ddp-gelu-every-other-layer-top1": dict(dr=2, activation="gelu", frequency=2, k=1),
    "ep1-fsdp-accumulation-adamw": dict(ds=2, gas=2, optimizer="adamw", lr=1e-3),
    "ep1-tp2-sp-experts-whole": dict(tp=2, sp=True),
    "ep1-fsdp-tp2-sp-experts-split-over-tp": dict(ds=2, tp=2, etp=2, sp=True, optimizer="adamw", lr=1e-3),
    "ep1-cp2": dict(cp=2),
    "ep2-fsdp-world2": dict(ds=2, ep=2),
    "ep2-fsdp2-tp2-sp-world4": dict(ds=2, tp=2, ep=2, sp=True, optimizer="adamw", lr=1e-3),
    "ep1-pp2": dict(pp=2, mb=4),
    "ep2-fsdp2-pp2-world4": dict(ds=2, ep=2, pp=2, mb=4, optimizer="adamw", lr=1e-3),
    "ep2-cp2-world2": dict(cp=2, ep=2),
    "ep2-fsdp2-tp2-sp-experts-split-over-tp-world4": dict(ds=2, tp=2, ep=2, etp=2, sp=True),
    "ep2-fsdp2-shared-expert-gated": dict(ds=2, ep=2, shared=40, shared_gate=True, optimizer="adamw", lr=1e-3),
    "ep2-fsdp2-dense-first-layer-pp2": dict(ds=2, ep=2, first=1, pp=2, mb=4),
    "ep1-tp2-sp-shared-expert-gated": dict(tp=2, sp=True, shared=40, shared_gate=True),
    "ep2-fsdp2-tp2-sp-experts-split-over-tp-shared-expert-world4": dict(
        ds=2, tp=2, ep=2, etp=2, sp=True, shared=40, activation="gelu"
    ),
}

SLOW_CASES = {
    "ep2-fsdp4-world4": dict(ds=4, ep=2, gas=2),
    "ep2-hsdp-world4": dict(dr=2, ds=2, ep=2, optimizer="adamw", lr=1e-3),
    "ep1-fsdp-tp2-sp-experts-whole": dict(ds=2, tp=2, sp=True, mb=2),
    "ep2-fsdp-bf16": dict(ds=2, ep=2, precision="bf16", optimizer="adamw", lr=1e-3),
    "ep4-fsdp4-eight-experts": dict(ds=4, ep=4, experts=8),
    "ep1-tp2-cp2-sp": dict(tp=2, cp=2, sp=True),
    "ep1-pp2-tp2-sp-experts-split-over-tp": dict(pp=2, tp=2, etp=2, sp=True, mb=4),
    "ep1-pp2-cp2": dict(pp=2, cp=2, mb=4),
    "ep4-fsdp2-cp2-adamw": dict(ds=2, cp=2, ep=4, optimizer="adamw", lr=1e-3),
    "ep2-fsdp2-cp2-tp2-sp-eight-experts-world8": dict(ds=2, cp=2, tp=2, ep=2, sp=True, experts=8),
    "ep2-fsdp2-cp2-tp2-sp-experts-split-over-tp-top3-world8": dict(
        ds=2, cp=2, tp=2, ep=2, etp=2, sp=True, experts=8, k=3
    ),
    "ep2-fsdp4-tp2-sp-experts-split-over-tp-adamw-world8": dict(
        ds=4, tp=2, ep=2, etp=2, sp=True, optimizer="adamw", lr=1e-3
    ),
    "ep2-fsdp2-pp2-cp2": dict(ds=2, pp=2, cp=2, ep=2, mb=4),
    "ep2-fsdp2-pp2-tp2-sp-experts-split-over-tp-world8": dict(ds=2, pp=2, tp=2, ep=2, etp=2, sp=True, mb=4),
}


def check_replay(tmp_path, kwargs) -> dict:
    doc = moe_plan(**kwargs)
    report = run_plan(doc, steps=3, out_dir=tmp_path, reference=True, progress=False, timeout_s=90)
    assert report.ok, report.errors
    assert report.accounting_ok and report.updates_checked == len(doc.updates) > 0
    evidence = {u.node_id: u for u in report.evidence}
    assert set(evidence) == {u.node_id for u in doc.updates}
    for u in evidence.values():
        assert u.numerics_sample_count > 0 and u.determinism_observed is True, u.node_id
    bound = BOUND["bf16" if kwargs.get("precision") == "bf16" else kwargs.get("optimizer", "sgd")]
    assert report.max_relative_error <= bound, sorted(evidence.values(), key=lambda u: -u.maximum_relative_error)[:3]
    data = json.loads((tmp_path / "report.json").read_text())
    experts = [u for u in doc.updates if ".moe.experts." in u.tensor and u.payload == "gradient"]
    # Divided by the data degree, whatever group sums them (with one data rank, tp or cp ranks may
    # still hold parts of an expert's gradient: summed, not divided).
    data_degree = kwargs.get("dr", 1) * kwargs.get("ds", 1)
    assert all(u.gradient_divisor == data_degree for u in experts)
    # Expert-data ranks beyond the data degree are cp or tp ranks (etp = 1) routing other tokens of
    # the same samples: their parts are summed; when ep covers them, every token reached its expert.
    world = doc.mesh.degrees["world_size"]
    expert_data = world // (kwargs.get("etp", 1) * kwargs.get("ep", 1) * kwargs.get("pp", 1))
    assert bool(experts) == (data_degree > 1 or expert_data > 1)
    exchanges = [u for u in doc.updates if u.collective == "all_to_all"]
    traffic = data["accounting"]["all_to_all_traffic"]
    if kwargs.get("ep", 1) == 1:
        assert not exchanges and not traffic
        return data
    # The token exchanges: counted exactly as planned (the rows each rank routes), the count
    # exchange apart as bookkeeping, and the bytes that crossed between ranks next to the model.
    rows = {r["node_id"]: r for r in data["accounting"]["updates"]}
    assert {u.node_id for u in exchanges} == set(traffic)
    for u in exchanges:
        assert rows[u.node_id]["match"] and rows[u.node_id]["observed_bytes"] == rows[u.node_id]["planned_bytes"] > 0
        t = traffic[u.node_id]
        # Every rank of the update's pipeline stage issues it (all ranks without a pipeline).
        assert t["calls"] == rows[u.node_id]["planned_count"] * doc.mesh.degrees["world_size"] // doc.mesh.degrees.get(
            "pp", 1
        )
        assert t["sent_bytes"] == t["received_bytes"] > 0
        assert 0 < t["measured_over_modelled"] <= u.group_size / (u.group_size - 1)
    assert any(name.endswith("moe:counts") for name in data["accounting"]["bookkeeping"])
    return data


@pytest.mark.parametrize("case", CASES)
def test_moe_replay_matches_plan_and_reference(tmp_path, case):
    check_replay(tmp_path, CASES[case])


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES)
def test_moe_replay_matches_plan_and_reference_more_meshes(tmp_path, case):
    check_replay(tmp_path, SLOW_CASES[case])


# --- what is not executed is refused before anything starts -------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tp=2), "need sequence parallelism"),
        (dict(tp=4, ep=2, etp=2, sp=True), "etp=2"),
        (dict(ds=3, experts=4), "shards whole experts only"),
    ],
)
def test_what_the_expert_runtime_does_not_execute_is_refused_with_the_reason(kwargs, message):
    doc = moe_plan(**kwargs)
    assert doc.verdict.ok
    with pytest.raises(RuntimeRefusal, match=message):
        read_instructions(doc)


def test_the_every_axis_example_runs_and_matches_the_reference(tmp_path):
    # examples/tiny-moe-every-axis.yaml: pp 2 with tied embeddings x FSDP 2 x tp 2 (sequence parallel),
    # 4 experts over ep 2, each split over tp: 8 ranks, every update against the reference.
    report = run_plan(
        EXAMPLES / "tiny-moe-every-axis.yaml", out_dir=tmp_path, reference=True, progress=False, timeout_s=120
    )
    assert report.ok and report.accounting_ok, report.errors
    assert report.max_relative_error <= BOUND["adamw"]
    nodes = {u.node_id for u in report.evidence if u.has_numerics_evidence}
    assert {"tied_embedding:grad/tied", "layers.0.moe:dispatch", "stage.0->1:activation", "layers.3.mlp:in"} <= nodes
    assert report.losses[-1] < report.losses[0]


def test_expert_checkpoints_reshard_across_expert_layouts(tmp_path):
    # Saved with experts split over ep 2 and over tp (etp 2, dp_shard 2), resumed with whole experts
    # over ep 2 x cp 2: every expert's rows and features land where the new layout wants them, with
    # the AdamW state, and the run ends where the uninterrupted one ends.
    from mixle_compile.runtime import checkpoint as ckpt
    from mixle_compile.runtime import checkpoint_dcp

    def relative(a, b):
        return max(float((a[n] - b[n]).norm() / b[n].norm()) for n in b)

    steps = 3
    first = run_plan(
        moe_plan(ds=2, tp=2, ep=2, etp=2, sp=True, optimizer="adamw", lr=1e-3),
        steps=steps,
        out_dir=tmp_path / "a",
        save_every=1,
        progress=False,
        timeout_s=120,
    )
    assert first.ok, first.errors
    saved = tmp_path / "a" / "checkpoints"
    end = checkpoint_dcp.read_global_state(saved / ckpt.step_dir_name(steps))
    resumed = run_plan(
        moe_plan(ds=2, cp=2, ep=2, optimizer="adamw", lr=1e-3),
        steps=steps,
        out_dir=tmp_path / "b",
        resume=saved / ckpt.step_dir_name(1),
        save_every=steps,
        progress=False,
        timeout_s=120,
    )
    assert resumed.ok, resumed.errors
    assert list(resumed.losses) == pytest.approx(list(first.losses[1:]), rel=1e-5)
    one_step = relative(checkpoint_dcp.read_global_state(saved / ckpt.step_dir_name(steps - 1)), end)
    assert (
        relative(checkpoint_dcp.read_global_state(tmp_path / "b" / "checkpoints" / ckpt.step_dir_name(steps)), end)
        < 1e-4
        < one_step / 100
    )

"""Layouts and distributed updates: derived from placements, and checked independently."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mixle_compile.contracts import CollectiveKind, StateLayout
from mixle_compile.lower.exactly_once import check_exactly_once
from mixle_compile.lower.lowering import lower
from mixle_compile.memory_model import MEMORY_KINDS
from mixle_compile.spec import load_spec, load_spec_text
from tests.conftest import EXAMPLES

SPEC = """\
model: {{family: transformer, vocab_size: 256, hidden_size: 64, num_layers: 4, num_heads: 4, ffn_hidden_size: 128,
        tie_embeddings: {tie}, num_experts: {experts}, experts_per_token: {topk}}}
mesh: {{dp_replicate: {dr}, dp_shard: {ds}, tp: {tp}, pp: {pp}, cp: {cp}, ep: {ep}, microbatches: {mb}}}
training: {{global_batch_size: {gbs}, micro_batch_size: 1, seq_len: 32, sequence_parallel: {sp}, \
distributed_optimizer: {dopt}}}
backend: torch
resources: {{devices: {world}, memory: 8GiB}}
"""


def spec_of(
    dr=1, ds=1, tp=1, pp=1, cp=1, ep=1, experts=0, tie=False, sp=False, dopt=False, kv=None, ffn=128, moe_every=1
):
    mb = max(pp, 1)
    text = SPEC.format(
        dr=dr,
        ds=ds,
        tp=tp,
        pp=pp,
        cp=cp,
        ep=ep,
        mb=mb,
        gbs=mb * dr * ds,
        sp=str(sp).lower(),
        dopt=str(dopt).lower(),
        world=dr * ds * tp * pp * cp,
        tie=str(tie).lower(),
        experts=experts,
        topk=2 if experts else "null",
    )
    if not experts:
        text = text.replace(", num_experts: 0, experts_per_token: null", "")
    if kv is not None:
        text = text.replace("num_heads: 4,", f"num_heads: 4, num_kv_heads: {kv},")
    text = text.replace("ffn_hidden_size: 128", f"ffn_hidden_size: {ffn}")
    if moe_every != 1:
        text = text.replace("experts_per_token: 2", f"experts_per_token: 2, moe_layer_frequency: {moe_every}")
    loaded = load_spec_text(text, "t.yaml")
    assert loaded.ok, [d.text() for d in loaded.diagnostics]
    return loaded.spec


def lowered(**mesh):
    # Every block lowered, so that each block's own updates can be read (a compile lowers one block
    # of each run; tests/test_layer_runs.py holds the two to the same plan).
    return lower(spec_of(**mesh), each_layer=True)


def updates_of(low, tensor):
    return [u for u in low.updates if u.tensor == tensor and u.update.payload.value == "gradient"]


def recheck(low, updates, kv=None):
    sp = any(u.update.node_id.endswith("grad/tp") for u in low.updates)
    return check_exactly_once(low.parameters, tuple(updates), low.plan, sequence_parallel=sp, num_kv_heads=kv)


@pytest.mark.parametrize("name", ["llama3-8b-hsdp-tp.yaml", "mixtral-moe-ep.yaml", "tiny-transformer.yaml"])
def test_examples_reduce_every_gradient_exactly_once(name):
    low = lower(load_spec(EXAMPLES / name).spec)
    assert low.reduction_problems == ()
    assert low.updates and low.parameters


def test_hsdp_reduce_scatters_over_dp_shard_then_all_reduces_over_dp_replicate():
    low = lower(load_spec(EXAMPLES / "llama3-8b-hsdp-tp.yaml").spec)
    q = updates_of(low, "layers.0.attn.q_proj.weight")
    assert [(u.update.collective, u.update.mesh_axes) for u in q] == [
        (CollectiveKind.REDUCE_SCATTER, ("dp_shard",)),
        (CollectiveKind.ALL_REDUCE, ("dp_replicate",)),
    ]
    assert [u.gradient_divisor for u in q] == [1, 8]
    # Under sequence parallelism a tp-replicated norm also sums its gradient over tp.
    norm = updates_of(low, "layers.0.attn_norm.weight")
    assert [u.update.mesh_axes for u in norm] == [("tp",), ("dp_shard",), ("dp_replicate",)]
    placed = {p.name: p for p in low.parameters}
    assert placed["layers.0.attn.q_proj.weight"].layout.placements == (
        ("tp", "shard(0)"),
        ("dp_replicate", "replicate"),
        ("dp_shard", "shard(0)"),
    )
    assert placed["layers.0.attn.o_proj.weight"].layout.placements[0] == ("tp", "shard(1)")
    assert placed["layers.0.attn.q_proj.weight"].layout.optimizer_state is StateLayout.SHARDED


def test_replicated_state_all_reduces_over_every_data_axis_including_cp():
    low = lowered(dr=2, cp=2)
    (u,) = updates_of(low, "embed.weight")
    assert (u.update.collective, u.update.mesh_axes, u.gradient_divisor) == (
        CollectiveKind.ALL_REDUCE,
        ("dp_replicate", "cp"),
        2,
    )
    assert low.reduction_problems == ()


def test_distributed_optimizer_scatters_then_gathers_parameters():
    low = lowered(dr=2, dopt=True)
    kinds = [(u.update.collective, u.update.payload.value) for u in low.updates if u.tensor == "embed.weight"]
    assert kinds == [(CollectiveKind.REDUCE_SCATTER, "gradient"), (CollectiveKind.ALL_GATHER, "parameter")]


def test_tied_embeddings_across_stages_sync_first():
    low = lowered(ds=2, pp=2, tie=True)
    embed = updates_of(low, "embed.weight")
    assert embed[0].update.mesh_axes == ("tied",) and embed[1].update.collective is CollectiveKind.REDUCE_SCATTER
    assert low.reduction_problems == ()


def test_expert_gradients_reduce_over_expert_data_and_divide_by_data_degree():
    low = lowered(ds=4, tp=2, ep=4, experts=4, sp=True)
    (u,) = updates_of(low, "layers.0.moe.experts.up_proj")
    assert u.update.mesh_axes == ("edp",) and u.group_size == 2 and u.gradient_divisor == 4
    assert low.reduction_problems == ()


# --- KV heads shared over tp (num_kv_heads < tp) -----------------------------------------------


def test_kv_heads_shared_over_tp_are_placed_by_head_and_summed_over_the_ranks_sharing_each():
    low = lowered(ds=2, tp=4, kv=2)  # 4 query heads of 16, 2 KV heads: tp ranks {0,1} share head 0, {2,3} head 1
    placed = {p.name: p for p in low.parameters}
    k = placed["layers.0.attn.k_proj.weight"]
    assert k.layout.placements == (
        ("tp_kv_head", "shard(0)"),
        ("tp_kv_replica2", "replicate"),
        ("dp_shard", "shard(0)"),
    )
    assert k.local_shape == (8, 64) and k.kv_replicas == 2  # one head's 16 rows, then half of them per data shard
    assert placed["layers.0.attn.q_proj.weight"].layout.placements[0] == ("tp", "shard(0)")
    assert placed["layers.0.attn.o_proj.weight"].layout.placements[0] == ("tp", "shard(1)")
    for name in ("layers.0.attn.k_proj.weight", "layers.3.attn.v_proj.weight"):
        chain = updates_of(low, name)
        assert [(u.update.collective, u.update.mesh_axes, u.group_size, u.gradient_divisor) for u in chain] == [
            (CollectiveKind.ALL_REDUCE, ("tp_kv_replica2",), 2, 1),
            (CollectiveKind.REDUCE_SCATTER, ("dp_shard",), 2, 2),
        ]
        assert chain[0].payload_bytes == 16 * 64 * 4  # the head's whole fp32 gradient, before the data shard
        assert chain[0].occurrences_per_step == chain[1].occurrences_per_step
    assert not [u for u in updates_of(low, "layers.0.attn.q_proj.weight") if u.update.node_id.endswith("/kv")]
    # The activations are unchanged: query heads split, attention output row-parallel.
    by_id = {u.update.node_id: u for u in low.updates}
    assert (by_id["layers.0.attn:out"].update.collective, by_id["layers.0.attn:out"].update.mesh_axes) == (
        CollectiveKind.ALL_REDUCE,
        ("tp",),
    )
    assert by_id["layers.0.attn:in/grad"].update.mesh_axes == ("tp",)
    rule = low.grid.rule("tp_kv_replica2")
    assert list(rule.groups()) == [(0, 1), (2, 3), (4, 5), (6, 7)]  # tp innermost, dp_shard outside
    assert low.reduction_problems == () and low.schedule.check.ok


def test_a_single_kv_head_is_shared_by_every_tp_rank():
    low = lowered(tp=2, kv=1, dr=2)
    k = {p.name: p for p in low.parameters}["layers.0.attn.k_proj.weight"]
    assert k.layout.placements[:2] == (("tp_kv_head", "shard(0)"), ("tp_kv_replica2", "replicate"))
    assert k.local_shape == (16, 64)
    assert [u.update.mesh_axes for u in updates_of(low, k.name)] == [("tp_kv_replica2",), ("dp_replicate",)]
    assert list(low.grid.rule("tp_kv_replica2").groups()) == list(low.grid.rule("tp").groups())


def test_kv_heads_that_split_over_tp_are_sharded_as_before():
    low = lowered(tp=2, kv=2)
    k = {p.name: p for p in low.parameters}["layers.0.attn.k_proj.weight"]
    assert k.layout.placements == (("tp", "shard(0)"),) and k.kv_replicas == 1
    assert not [u for u in low.updates if u.update.node_id.endswith(":grad/kv")]


def test_memory_counts_one_kv_head_per_rank_when_heads_are_shared():
    shared, split = lowered(tp=4, kv=2, ds=2), lowered(tp=4, kv=4, ds=2)
    # Per layer, k and v each hold 16 rows of 64 on every tp rank with 2 KV heads, 16 rows with 4:
    # the same bytes, while a tp-split of 2 heads would have claimed 8.
    assert shared.memory[0].parameters == split.memory[0].parameters
    assert shared.memory[0].gathered_parameters == split.memory[0].gathered_parameters


# --- deliberately broken plans: the independent check must catch each one -------------------


def test_a_kv_head_gradient_left_unsummed_over_the_ranks_sharing_it_is_caught():
    low = lowered(tp=4, kv=2, dr=2)
    broken = [u for u in low.updates if not u.update.node_id.endswith(":grad/kv")]
    problems = recheck(low, broken, kv=2)
    assert {p.tensor for p in problems} == {f"layers.{i}.attn.{w}_proj.weight" for i in range(4) for w in "kv"}
    assert all(
        "partial sum over tp_kv_replica2 but is never reduced over tp_kv_replica2" in p.message for p in problems
    )
    # Summed over the wrong group (the whole of tp) is caught too.
    wrong = [
        dataclasses.replace(u, update=dataclasses.replace(u.update, mesh_axes=("tp",)), group_size=4)
        if u.update.node_id.endswith(":grad/kv")
        else u
        for u in low.updates
    ]
    assert any("reduced over tp, where it is not a partial sum" in p.message for p in recheck(low, wrong, kv=2))
    # The check derives the partial sums from the model, not from the plan's layouts.
    assert any("tp_kv_replica2, where it is not a partial sum" in p.message for p in recheck(low, low.updates, kv=4))


def test_cp_missing_from_the_gradient_reduction_is_caught():
    low = lowered(ds=2, cp=2)
    broken = [
        dataclasses.replace(u, update=dataclasses.replace(u.update, mesh_axes=("dp_shard",)))
        if u.update.collective is CollectiveKind.REDUCE_SCATTER
        else u
        for u in low.updates
    ]
    problems = recheck(low, broken)
    assert any("never reduced over cp" in p.message for p in problems)


def test_a_double_reduction_is_caught():
    low = lowered(dr=2)
    (u,) = updates_of(low, "layers.0.attn.q_proj.weight")
    problems = recheck(low, [*low.updates, dataclasses.replace(u, gradient_divisor=1)])
    assert any("reduced 2 times over dp_replicate" in p.message for p in problems)


def test_an_unsynced_tied_embedding_is_caught():
    low = lowered(dr=2, pp=2, tie=True)
    problems = recheck(low, [u for u in low.updates if "tied" not in u.update.mesh_axes])
    assert {p.tensor for p in problems} == {"embed.weight", "lm_head.weight"}
    assert all("never reduced over tied" in p.message for p in problems)


def test_a_tied_sync_after_the_reduce_scatter_is_caught():
    low = lowered(ds=2, pp=2, tie=True)
    embed = updates_of(low, "embed.weight")
    rest = [u for u in low.updates if u not in embed]
    problems = recheck(low, rest + [embed[1], embed[0], *embed[2:]])
    assert any("must see whole gradients" in p.message for p in problems)


@pytest.mark.parametrize("kwargs", [dict(ds=2), dict(dr=2, dopt=True), dict(dr=2, cp=2)])
def test_a_tensor_tied_on_one_stage_is_reduced_and_gathered_once(kwargs):
    # embed.weight and lm_head.weight are one tensor without a pipeline: the head's gradient is added
    # to the embedding's locally and reduced with it; reducing it again would count it twice.
    low = lowered(tie=True, **kwargs)
    assert low.reduction_problems == ()
    assert updates_of(low, "embed.weight") and not updates_of(low, "lm_head.weight")
    gathers = [u for u in low.updates if u.tensor == "lm_head.weight" and u.update.payload.value == "parameter"]
    # FSDP gathers per use (each use's unit); the distributed optimizer's gather of the updated tensor once
    assert len(gathers) == (2 if kwargs.get("ds", 1) > 1 else 0)
    (first,) = updates_of(low, "embed.weight")[:1]
    again = dataclasses.replace(first, tensor="lm_head.weight")
    problems = recheck(low, [*low.updates, again])
    assert [p.tensor for p in problems] == ["lm_head.weight"]
    assert "tied to embed.weight on the same stage" in problems[0].message and "a second time" in problems[0].message


def test_expert_gradients_divided_by_the_group_size_are_caught():
    low = lowered(ds=4, tp=2, ep=4, experts=4, sp=True)
    broken = [
        dataclasses.replace(u, gradient_divisor=u.group_size) if u.update.mesh_axes == ("edp",) else u
        for u in low.updates
    ]
    problems = recheck(low, broken)
    assert problems and all("divided by 2" in p.message and "data-parallel size 4" in p.message for p in problems)


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from([1, 2]),
    st.sampled_from([1, 2]),
    st.sampled_from([1, 2]),
    st.sampled_from([1, 2]),
    st.sampled_from([1, 2]),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
def test_emitted_updates_always_pass_the_independent_check(dr, ds, tp, pp, cp, tie, sp, dopt):
    low = lowered(dr=dr, ds=ds, tp=tp, pp=pp, cp=cp, tie=tie, sp=sp and tp > 1, dopt=dopt)
    assert low.reduction_problems == ()


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from([1, 2]),
    st.sampled_from([1, 2]),
    st.sampled_from([(2, 1), (4, 1), (4, 2)]),
    st.booleans(),
    st.booleans(),
)
def test_kv_heads_shared_over_tp_always_pass_the_independent_check(dr, ds, tp_kv, sp, dopt):
    tp, kv = tp_kv
    low = lowered(dr=dr, ds=ds, tp=tp, kv=kv, sp=sp, dopt=dopt)
    assert low.reduction_problems == ()
    assert recheck(low, low.updates, kv=kv) == ()
    assert low.schedule.check.ok, low.schedule.check.problems
    assert [u for u in low.updates if u.update.node_id.endswith(":grad/kv")]


def test_ring_costs():
    low = lowered(dr=2)
    u = updates_of(low, "embed.weight")[0]
    make = lambda kind, n: dataclasses.replace(  # noqa: E731
        u,
        update=dataclasses.replace(u.update, collective=kind),
        group_size=n,
        payload_bytes=100,
        occurrences_per_step=1,
    )
    assert make(CollectiveKind.ALL_REDUCE, 4).bytes_per_rank_per_step == 150
    assert make(CollectiveKind.REDUCE_SCATTER, 4).bytes_per_rank_per_step == 75
    assert make(CollectiveKind.ALL_GATHER, 4).bytes_per_rank_per_step == 75
    assert make(CollectiveKind.ALL_TO_ALL, 4).bytes_per_rank_per_step == 75
    assert make(CollectiveKind.P2P, 2).bytes_per_rank_per_step == 100


def test_memory_parameters_are_the_model_split_over_tp_and_fsdp():
    spec = load_spec(EXAMPLES / "llama3-8b-hsdp-tp.yaml").spec
    low = lower(spec)
    (stage,) = low.memory
    total_bytes = 2 * 8_030_261_248
    # tp 8 x dp_shard 4 shards every tensor 32 ways (FSDP rounds shards up, norms are tp-replicated)
    assert total_bytes / 32 <= stage.parameters <= total_bytes / 32 * 1.01
    assert stage.optimizer_state == stage.parameters // 2 * 12  # bf16 params: 2 fp32 moments + master
    assert stage.activations > 0 and stage.total == sum(stage.as_dict()[k] for k in MEMORY_KINDS)


# --- the step schedule ---------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from([1, 2]),
    st.sampled_from([1, 2]),
    st.sampled_from([1, 2]),
    st.sampled_from([1, 2]),
    st.booleans(),
    st.booleans(),
)
def test_step_schedules_check_clean(dr, ds, tp, pp, tie, sp):
    low = lowered(dr=dr, ds=ds, tp=tp, pp=pp, tie=tie, sp=sp and tp > 1)
    assert low.schedule.check.ok, low.schedule.check.problems
    assert len(low.schedule.programs) == pp


def test_step_programs_hold_every_planned_collective():
    low = lowered(ds=2, tp=2, pp=2, tie=True)
    ops = [op for program in low.schedule.programs for op in program if op.kind.value == "collective"]
    micro_steps = low.plan.microbatches * low.plan.gradient_accumulation_steps
    planned = [u for u in low.updates if u.update.collective is not CollectiveKind.P2P]
    expected = sum(u.occurrences_per_step for u in planned)
    assert all(u.occurrences_per_step == micro_steps for u in planned if u.phase in ("forward", "backward"))
    assert len(ops) == expected
    tp_forward = [op for op in ops if op.group == "tp" and op.name.startswith("layers.") and op.name.endswith(":out")]
    assert len(tp_forward) == 4 * 2 * micro_steps  # 4 layers x (attn, mlp) x micro-steps


def test_a_step_whose_stages_disagree_on_collective_order_is_caught():
    from mixle_compile.lower.schedule import check_schedule

    low = lowered(ds=2, pp=2, tie=True)
    first, last = low.schedule.programs
    tied = [i for i, op in enumerate(last) if op.group == "embedding"]
    assert tied, "the last stage syncs the tied head"
    # The last stage skips its tied all_reduce: stage 0 waits forever.
    broken = (first, tuple(op for i, op in enumerate(last) if i != tied[0]))
    result = check_schedule(broken, low.grid)
    assert not result.ok and any("embedding" in p for p in result.problems)


def test_sharded_payloads_count_the_padding_fsdp_adds():
    """Uneven shards are padded to equal ones, so the bytes that enter the collectives include the padding."""
    low = lowered(dr=2, ds=3)  # the 256-row embedding: 86 rows per shard, 258 rows gathered
    by_id = {u.update.node_id: u for u in low.updates}
    assert by_id["embed.weight:grad/scatter"].payload_bytes == 258 * 64 * 4  # fp32 gradients in
    assert by_id["embed.weight:grad/reduce"].payload_bytes == 86 * 64 * 4  # then one shard
    assert by_id["embed.weight:param/gather-forward"].payload_bytes == 258 * 64 * 2  # bf16 weights out
    even = {u.update.node_id: u for u in lowered(ds=2).updates}
    assert even["embed.weight:param/gather-forward"].payload_bytes == 256 * 64 * 2


def test_tensor_parallel_activations_have_both_halves_of_each_conjugate_pair():
    plain = {u.update.node_id: u for u in lowered(tp=2).updates}
    assert plain["lm_head:in/grad"].update.collective is CollectiveKind.ALL_REDUCE
    assert plain["lm_head:in/grad"].phase == "backward"
    sp = {u.update.node_id: u for u in lowered(tp=2, sp=True).updates}
    assert sp["embed:out/grad"].update.collective is CollectiveKind.ALL_GATHER
    assert (sp["lm_head:in"].update.collective, sp["lm_head:in/grad"].update.collective) == (
        CollectiveKind.ALL_GATHER,
        CollectiveKind.REDUCE_SCATTER,
    )
    loss = sp["lm_head:loss"]
    assert (
        loss.update.collective is CollectiveKind.ALL_GATHER and loss.payload_bytes == 2 * 2 * 32 * 4
    )  # tp x (lse, logit) x tokens x fp32


def test_step_programs_repeat_reductions_of_every_accumulation_window():
    low = lower(load_spec(EXAMPLES / "tiny-transformer.yaml").spec)  # dp_shard 2, accumulation 2
    (program,) = low.schedule.programs
    scatters = [op for op in program if op.kind.value == "collective" and op.tag == "reduce_scatter"]
    planned = [u for u in low.updates if u.update.collective is CollectiveKind.REDUCE_SCATTER]
    assert planned and all(u.occurrences_per_step == 2 for u in planned)
    assert len(scatters) == 2 * len(planned)


def test_context_parallel_kv_gathers_move_the_kv_heads_a_tp_rank_holds():
    def kv_payload(**kwargs):
        return {u.update.node_id: u for u in lowered(cp=2, **kwargs).updates}["layers.0.attn:kv"].payload_bytes

    whole = kv_payload(kv=2)
    assert kv_payload(tp=2, kv=2) == whole // 2  # one of the two heads per tp rank
    assert kv_payload(tp=4, kv=2) == whole // 2  # one head, shared by two tp ranks
    assert kv_payload(tp=2, kv=4) == kv_payload(kv=4) // 2 == whole


@pytest.mark.parametrize(
    "mesh",
    [
        dict(tp=2, sp=True),  # column- and row-parallel weights of one shape, sharded on different dims
        # gate (96, 64) and down (64, 96): as many elements, FSDP-padded apart over 3 shards
        dict(ds=3, tp=2, ffn=96),
        dict(ds=2, tp=2, pp=2, dopt=False),
        dict(dr=2, tp=2, dopt=True),
        dict(ds=2, ep=2, experts=4),
        dict(tp=4, kv=2, ds=2),  # KV heads replicated over tp pairs
    ],
)
def test_updates_derived_once_per_kind_of_parameter_equal_each_parameters_own(mesh):
    """gradient_updates derives one parameter of each kind (shape, dtype, role, layout) and renames
    it for the others; each parameter planned alone must give the same updates."""
    from mixle_compile.lower.updates import gradient_updates

    low = lowered(**mesh)
    plan = low.plan
    kwargs = dict(sequence_parallel=mesh.get("sp", False), distributed_optimizer=mesh.get("dopt", False))
    kwargs["microbatches_per_step"] = plan.microbatches * plan.gradient_accumulation_steps
    together = gradient_updates(low.parameters, plan, **kwargs)
    alone = [u for p in low.parameters for u in gradient_updates((p,), plan, **kwargs)]
    untied = {p.name for p in low.parameters if p.layout.shared_group is None}
    assert len({(p.parameter.shape, p.layout.placements) for p in low.parameters}) < len(low.parameters)
    assert [u for u in together if u.tensor in untied] == [u for u in alone if u.tensor in untied]


@pytest.mark.parametrize(
    "mesh",
    [
        dict(tp=2, sp=True),
        dict(tp=2, cp=2, pp=2),
        dict(ds=2, ep=2, experts=4, moe_every=2),  # dense and MoE blocks in turn
        dict(tp=2, ep=2, experts=4, sp=True),
    ],
)
def test_block_collectives_planned_once_per_kind_equal_each_blocks_own(mesh):
    """activation_updates plans the first block of each kind (dense, mixture-of-experts) and renames
    it for the others; each block planned alone must give the same collectives."""
    from mixle_compile.lower.updates import activation_updates

    spec = spec_of(**mesh)
    low = lower(spec, each_layer=True)
    stage_of = {p.parameter.layer: p.stage for p in low.parameters if p.parameter.layer is not None}
    blocks = sorted(stage_of)
    together = [u for u in activation_updates(spec, low.plan, stage_of, blocks) if u.layer is not None]
    alone = [u for i in blocks for u in activation_updates(spec, low.plan, stage_of, [i]) if u.layer is not None]
    assert len(blocks) > 2 and together
    assert together == alone


@pytest.mark.parametrize(
    "mesh",
    [
        dict(tp=2, sp=True),
        dict(ds=2, tp=4, kv=2, ffn=32),  # k and v (32, 64) replicated over tp pairs, gate and up (32, 64) not
        dict(ds=2, ep=2, experts=4, moe_every=2),
        dict(pp=2, tie=True),
    ],
)
def test_layouts_derived_once_per_kind_of_parameter_equal_each_parameters_own(mesh):
    """place_parameters lays out one block parameter of each kind and names the copies; each
    parameter laid out alone must get the same layout."""
    from mixle_compile.layer_split import split_layers
    from mixle_compile.lower.layouts import place_parameters
    from mixle_compile.parameters import model_parameters

    spec = spec_of(**mesh)
    plan = lower(spec, schedule=False).plan
    params = model_parameters(spec)
    split = split_layers(spec.model.num_layers, plan.pp, 1, None, "torch")
    kwargs = dict(num_layers=spec.model.num_layers, num_kv_heads=spec.model.num_kv_heads, layer_split=split)
    together = place_parameters(params, plan, **kwargs)
    alone = tuple(placed for p in params for placed in place_parameters((p,), plan, **kwargs))
    assert together == alone


@pytest.mark.parametrize(("dr", "ds", "dopt"), [(2, 1, False), (1, 2, False), (2, 1, True)])
def test_multi_token_predictions_embedding_copy_on_one_stage_is_folded_into_the_embedding(dr, ds, dopt):
    """Without a pipeline ``mtp_embed.weight`` is the embedding's tensor: its gradient is added to the
    embedding's and reduced with it, so it lists no gradient update of its own (it has the embedding's
    shape and role, which once made it take the embedding's reductions as its own)."""
    spec = spec_of(dr=dr, ds=ds, dopt=dopt)
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"mtp_num_layers": 1})})
    lowered = lower(spec)
    assert not lowered.reduction_problems, lowered.reduction_problems
    mine = {u.update.node_id for u in lowered.updates if u.tensor == "mtp_embed.weight"}
    assert not {n for n in mine if ":grad/" in n}
    # under FSDP each use gathers the tensor, as the tied head's does
    gathers = {"mtp_embed.weight:param/gather-forward", "mtp_embed.weight:param/gather-backward"}
    assert mine == (gathers if ds > 1 else set())
    assert {u.update.node_id for u in lowered.updates if u.tensor == "embed.weight" and ":grad/" in u.update.node_id}

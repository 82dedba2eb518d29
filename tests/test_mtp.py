"""Multi-token prediction depths (``model.mtp_num_layers``) as the compiler prices and plans them.

A depth is a block of the decoder's last layer's kind with its own norms and [2h -> h] projection,
on the last pipeline stage, reading the embedding (a tied copy there under a pipeline) and the
output head once more. Counted against torchtitan's own DeepSeek-V3 models with depths, placed,
reduced, priced (memory: the lowering and R001 agree to the byte on one stage; FLOPs: Megatron-LM's
formula) and refused where an engine does not run them.
"""

from __future__ import annotations

import textwrap

import pytest

from mixle_compile.layer_split import split_layers
from mixle_compile.lower.lowering import lower
from mixle_compile.parameters import (
    MTP_EMBEDDING,
    is_moe_layer,
    model_parameters,
    mtp_is_moe,
    transformer_parameters,
    unique_parameter_bytes,
)
from mixle_compile.spec import load_spec_text
from mixle_compile.step_time import model_flops_per_token
from mixle_compile.verify import memory_bound
from tests.test_memory_model import KINDS


def spec_text(
    *,
    depths=1,
    tp=1,
    pp=1,
    dp=2,
    sp=False,
    tie=False,
    experts=0,
    backend="torch",
    ckpt="none",
    freq=1,
    first=0,
    vp=1,
    layers=4,
) -> str:
    world = dp * tp * pp
    moe = ""
    if experts:
        moe = (
            f", num_experts: {experts}, experts_per_token: 2, moe_ffn_hidden_size: 24, "
            f"moe_layer_frequency: {freq}, moe_first_layer: {first}"
        )
    schedule = ", pipeline_schedule: interleaved_1f1b, virtual_pipeline_stages: 2" if vp > 1 else ""
    backend_text = backend if backend == "torch" else f"{{name: {backend}, version: '0.16'}}"
    return textwrap.dedent(
        f"""\
        model: {{family: transformer, vocab_size: 128, hidden_size: 32, num_layers: {layers}, num_heads: 4,
                ffn_hidden_size: 64, tie_embeddings: {str(tie).lower()}, mtp_num_layers: {depths}{moe}}}
        mesh: {{dp_shard: {dp}, tp: {tp}, pp: {pp}, microbatches: {4 * pp}}}
        training: {{global_batch_size: {8 * dp * pp}, micro_batch_size: 2, seq_len: 16, precision: bf16,
                   sequence_parallel: {str(sp).lower()}, activation_checkpointing: {ckpt}{schedule}}}
        backend: {backend_text}
        resources: {{devices: {world}, memory: 1GiB, kind: h100}}
        """
    )


def load(text: str):
    loaded = load_spec_text(text, "mtp.yaml")
    assert loaded.ok, [d.message for d in loaded.diagnostics]
    return loaded.spec


def test_torchtitans_deepseek_v3_models_with_depths_have_our_parameters():
    """torchtitan 0.3.0 builds DeepSeek-V3 flavors with ``num_mtp_layers`` depths (MTPDecoder, on the meta
    device): its parameters are ours, the depths' embedding being the model's own (one tensor)."""
    pytest.importorskip("torchtitan")
    import torch

    try:
        from torchtitan.models.deepseek_v3 import deepseekv3_configs
    except ImportError as exc:  # its model code imports what the torchtitan extra installs
        pytest.skip(f"torchtitan's DeepSeek-V3 model does not import here: {exc}")
    from mixle_compile.importers.flavors import FLAVORS
    from mixle_compile.spec.models import TransformerModel

    for name in ("debugmodel", "16B"):
        for depths in (1, 2):
            with torch.device("meta"):
                built = deepseekv3_configs[name](
                    attn_backend="flex", moe_comm_backend="standard", num_mtp_layers=depths
                ).build()
            theirs = sum(p.numel() for p in built.parameters())
            model = TransformerModel.model_validate({**FLAVORS["deepseek_v3"][name].model, "mtp_num_layers": depths})
            ours = transformer_parameters(model, "bf16")
            assert unique_parameter_bytes(ours) // 2 == theirs, (name, depths)
            # one depth's own tensors: a block of the last layer's kind, three norms and the projection
            block = sum(p.numel for p in ours if p.layer == model.num_layers - 1)
            h = model.hidden_size
            depth = sum(p.numel for p in ours if p.layer == model.num_layers)
            assert depth == block + 3 * h + 2 * h * h


def test_depths_take_the_last_layers_kind_even_where_the_spacing_would_not():
    spec = load(spec_text(experts=4, freq=2, first=1, layers=4))  # layers 1 and 3 are MoE; a depth is layer 4
    model = spec.model
    assert is_moe_layer(model, 3) and mtp_is_moe(model) and is_moe_layer(model, 4)
    names = {p.name for p in model_parameters(spec) if p.layer == 4}
    assert "layers.4.moe.router.weight" in names and "layers.4.mtp.eh_proj.weight" in names


def test_a_depth_sits_on_the_last_virtual_stage_with_the_embeddings_copy():
    spec = load(spec_text(pp=2, vp=2, depths=2, layers=8, dp=1))
    split = split_layers(8, 2, 2, None, "torch", 2)
    assert split.location(8) == split.location(9) == (1, 1)
    with pytest.raises(ValueError):
        split.location(10)
    lowered = lower(spec, schedule=False)
    where = {p.name: (p.stage, p.chunk) for p in lowered.parameters}
    assert where["layers.8.mtp.eh_proj.weight"] == (1, 1)
    assert where[MTP_EMBEDDING] == (1, 1) and where["embed.weight"] == (0, 0)
    tied = [u for u in lowered.updates if u.update.node_id == "tied_embedding:grad/tied"]
    assert {u.tensor for u in tied} == {"embed.weight", MTP_EMBEDDING}
    # without a pipeline the depths read the embedding itself: one tensor, one gradient reduction, no
    # tied sync (FSDP gathers it for each use, as it does a tied head)
    flat = lower(load(spec_text(depths=1)), schedule=False)
    assert not [u for u in flat.updates if "tied" in u.update.node_id]
    assert {u.update.node_id for u in flat.updates if u.tensor == MTP_EMBEDDING} == {
        f"{MTP_EMBEDDING}:param/gather-forward",
        f"{MTP_EMBEDDING}:param/gather-backward",
    }
    # tied embeddings: the head on the last stage is the copy the depths read
    assert MTP_EMBEDDING not in {p.name for p in model_parameters(load(spec_text(tie=True)))}


@pytest.mark.parametrize("sp", [False, True])
def test_a_depths_tensor_parallel_collectives_are_planned(sp):
    lowered = lower(load(spec_text(tp=2, dp=1, sp=sp, depths=2)), schedule=False, each_layer=True)
    ids = {
        u.update.node_id
        for u in lowered.updates
        if ".mtp." in u.update.node_id and u.update.payload.value == "activation"
    }
    expected = {"embed:out", "eh_proj:out", "head:loss"}
    expected |= (
        {"embed:out/grad", "eh_proj:in", "eh_proj:in/grad", "eh_proj:out/grad", "head:in", "head:in/grad"}
        if sp
        else {
            "eh_proj:in/grad",
            "head:in/grad",
        }
    )
    for depth in (4, 5):
        assert {i.split(".mtp.", 1)[1] for i in ids if i.startswith(f"layers.{depth}.mtp.")} == expected
    flat = lower(load(spec_text(depths=2)), schedule=False).updates
    assert not [u for u in flat if ".mtp." in u.update.node_id and u.update.payload.value == "activation"]


def test_megatron_runs_a_depths_projection_again_under_full_checkpointing_and_torchtitan_has_none():
    meg = lower(load(spec_text(tp=2, dp=1, sp=True, backend="megatron", ckpt="full")), schedule=False)
    again = {u.update.node_id for u in meg.updates if u.update.node_id.endswith("/recompute")}
    assert {"layers.4.mtp.eh_proj:in/recompute", "layers.4.mtp.eh_proj:out/recompute"} <= again
    titan = load(spec_text(tp=2, dp=1, sp=True).replace("backend: torch", "backend: torchtitan"))
    params = {p.name: p for p in model_parameters(titan)}
    assert params["layers.4.mtp.eh_proj.weight"].role == "latent"  # whole on every tp rank
    assert not [u for u in lower(titan, schedule=False).updates if ".eh_proj:" in u.update.node_id]


@pytest.mark.parametrize("ckpt", ["none", "full"])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("depths", [0, 1, 2])
def test_the_lowering_and_the_memory_rule_agree_to_the_byte_on_one_stage(depths, sp, ckpt):
    spec = load(spec_text(depths=depths, tp=2, dp=2, sp=sp, ckpt=ckpt, experts=4, backend="megatron"))
    (stage,) = lower(spec, schedule=False).memory
    bound = {kind: float(v) for kind, v in memory_bound(spec).items()}
    for ours, theirs in KINDS.items():
        assert getattr(stage, ours) == pytest.approx(bound[theirs], rel=1e-9, abs=1), ours


def test_depths_add_to_the_last_stage_only_and_the_bound_covers_it():
    base = lower(load(spec_text(depths=0, pp=2, dp=1, experts=4)), schedule=False).memory
    deep = lower(load(spec_text(depths=2, pp=2, dp=1, experts=4)), schedule=False).memory
    assert deep[0].total == base[0].total
    assert deep[1].activations > base[1].activations and deep[1].parameters > base[1].parameters
    assert deep[1].loss == 3 * base[1].loss  # the model's logits and each depth's
    spec = load(spec_text(depths=2, pp=2, dp=1, experts=4))
    live = sum(float(v) for k, v in memory_bound(spec).items() if k != "allocator reserve")
    assert max(s.total - s.reserve for s in deep) <= live * 1.01


def test_model_flops_count_the_depths_as_megatron_does():
    """Megatron-LM core_v0.16.1 megatron/training/training.py num_floating_point_operations: the depths'
    blocks with the layers (of the last layer's kind), their norms and projection, one more logit each."""
    model = {
        "vocab_size": 1000,
        "hidden_size": 64,
        "num_layers": 3,
        "num_heads": 4,
        "ffn_hidden_size": 128,
        "activation": "swiglu",
    }
    seq = 32
    without = model_flops_per_token(model, seq)
    one_layer = (without - 6 * 64 * 1000) / 3
    with_depths = model_flops_per_token({**model, "mtp_num_layers": 2}, seq)
    assert with_depths == pytest.approx(without + 2 * (one_layer + 6 * 2 * 64 * 64) + 2 * 6 * 64 * 1000)


def test_the_step_prices_the_depths_on_the_last_stage():
    from mixle_compile.step_time import predict_lowered

    def step(depths):
        spec = load(spec_text(depths=depths, pp=2, dp=1, backend="megatron"))
        return predict_lowered(spec, lower(spec, schedule=False))

    base, deep = step(0), step(2)
    assert deep.compute > base.compute  # the last stage was already the busiest (the head); now more so
    assert deep.model_flops_per_token > base.model_flops_per_token


def test_engines_refuse_depths_they_do_not_run():
    from mixle_compile.check import check_loaded

    def codes(text):
        return {d.code for d in check_loaded(load_spec_text(text, "x.yaml")).diagnostics}

    learned = spec_text(backend="megatron").replace(
        "ffn_hidden_size: 64,", "ffn_hidden_size: 64, position_embedding: learned,"
    )
    assert "C012" in codes(learned)
    assert "C012" not in codes(spec_text(backend="megatron"))
    titan = spec_text(pp=2, dp=1).replace("backend: torch", "backend: torchtitan")
    assert "C013" in codes(titan)  # no MLA, and a pipeline
    mla = "q_lora_rank: 16, kv_lora_rank: 16, qk_nope_head_dim: 8, qk_rope_head_dim: 4, v_head_dim: 8,"
    latent = titan.replace("ffn_hidden_size: 64,", f"ffn_hidden_size: 64, {mla}")
    assert "C013" in codes(latent)  # torchtitan's DeepSeek-V3 model, but under a pipeline
    assert "C013" not in codes(latent.replace("pp: 2", "pp: 1").replace("microbatches: 8", "microbatches: 4"))
    cp = spec_text().replace("mesh: {dp_shard: 2,", "mesh: {dp_shard: 1, cp: 2,")
    assert "C014" in codes(cp)


def test_a_loss_weight_without_depths_is_named():
    text = spec_text(depths=0).replace(
        "activation_checkpointing: none", "activation_checkpointing: none, mtp_loss_scaling_factor: 0.3"
    )
    loaded = load_spec_text(text, "x.yaml")
    assert [d.code for d in loaded.diagnostics] == ["S013"]
    assert "mtp_num_layers" in loaded.diagnostics[0].message

"""Megatron-Core's selective recomputation by submodule (``training.recompute_modules``,
megatron/core/transformer/transformer_config.py): what each module discards from a layer's stored
activations, what it runs again (FLOPs and collectives), how the spec refuses what Megatron refuses,
and a published configuration that fits only with its modules recomputed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mixle_compile.check import check_loaded
from mixle_compile.lower.lowering import lower
from mixle_compile.memory_model import NUMBERS, activation_bytes_per_layer, moe_layer_extra_bytes
from mixle_compile.spec import load_spec_text
from mixle_compile.step_time import _layer_flops
from tests.test_memory_model import LAYER, MOE_BLOCK
from tests.test_step_time import DEEPSEEK_V3

BRIDGE = Path(__file__).parent / "corpus" / "production" / "bridge_nemo"

SPEC = """\
model: {{family: transformer, vocab_size: 256, hidden_size: 64, num_layers: 4, num_heads: 4, ffn_hidden_size: 128,
        tie_embeddings: false{moe}{latent}}}
mesh: {{dp_shard: 2, tp: 2, ep: {ep}, cp: {cp}}}
training: {{global_batch_size: 2, seq_len: 32, sequence_parallel: true, activation_checkpointing: {ckpt}{modules}}}
backend: {backend}
resources: {{devices: {world}, memory: 8GiB, kind: h100}}
"""
LATENT = ", kv_lora_rank: 16, q_lora_rank: 16, qk_nope_head_dim: 8, qk_rope_head_dim: 8, v_head_dim: 16"


def loaded(modules=None, ckpt="selective", backend="megatron", latent=True, cp=1, first=1, experts=True):
    moe = f", num_experts: 4, experts_per_token: 2, moe_first_layer: {first}" if experts else ""
    text = SPEC.format(
        moe=moe,
        ep=2 if experts else 1,
        latent=LATENT if latent else "",
        ckpt=ckpt,
        modules=f", recompute_modules: {modules}" if modules is not None else "",
        backend=backend,
        cp=cp,
        world=4 * cp,
    )
    return load_spec_text(text, "t.yaml")


def messages(result):
    return [(d.code, d.severity.value, d.message) for d in result.diagnostics]


def test_what_megatron_refuses_or_ignores_is_said_at_the_field():
    assert loaded("[mla_up_proj, mlp]").ok
    (only,) = messages(loaded("[mla_up_proj]", latent=False))
    assert only[:2] == ("S013", "error") and "only supported with multi_latent_attention" in only[2]
    # Megatron raises it under selective granularity only: elsewhere the list is ignored, and said so
    assert [m[:2] for m in messages(loaded("[mla_up_proj]", latent=False, ckpt="full"))] == [("S013", "warning")]
    (only,) = messages(loaded("[mlp, mlp]"))
    assert only[:2] == ("S013", "error") and "twice" in only[2]
    (only,) = messages(loaded("[mlp]", ckpt="full"))
    assert only[:2] == ("S013", "warning") and "selective checkpointing only" in only[2]
    (only,) = messages(loaded("[mlp]", backend="torchtitan"))
    assert only[:2] == ("S013", "warning") and "does not read it" in only[2]
    refused = loaded("[attention]")
    assert not refused.ok and "recompute_modules" in refused.diagnostics[0].message


WIDTHS = dict(LAYER, latent_width=96, query_width=256, kv_width=128, up_projection_width=1024)


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize(
    ("module", "whole", "split"),
    [
        ("layernorm", 2 * 256, 0),  # MLA's input norm's output (the down projections' input)
        ("mla_up_proj", 0, 2 * 1024),  # queries, keys and values
        ("mlp", 0, 2 * 3 * 512),  # a gated MLP's first linear's outputs and its last one's input
    ],
)
def test_each_output_discarding_or_checkpointed_module_drops_its_tensors(sp, module, whole, split):
    base = activation_bytes_per_layer(NUMBERS, **WIDTHS, sequence_parallel=sp)
    less = activation_bytes_per_layer(
        NUMBERS, **WIDTHS, sequence_parallel=sp, recomputed_modules=frozenset({"core_attn", module})
    )
    tokens, t = 1024 * 2, 2
    assert base - less == pytest.approx(tokens * ((whole + split) / t if sp else whole + split / t))


def test_layernorm_discards_nothing_where_megatron_fuses_the_norms_into_the_linears():
    """Grouped-query attention's input norm is fused into linear_qkv and a dense layer's pre-MLP norm into
    fc1 (gpt_layer_specs.py): only MLA's input norm is a module of its own; under fp8 its linear keeps
    the fp8 copy it cast, so discarding the norm output frees one byte an element, not two."""
    plain = dict(WIDTHS, latent_width=0, sequence_parallel=True)
    assert activation_bytes_per_layer(NUMBERS, **plain) == activation_bytes_per_layer(
        NUMBERS, **plain, recomputed_modules=frozenset({"core_attn", "layernorm"})
    )
    fp8 = dict(WIDTHS, sequence_parallel=False, fp8_saved_inputs=True)
    base = activation_bytes_per_layer(NUMBERS, **fp8)
    less = activation_bytes_per_layer(NUMBERS, **fp8, recomputed_modules=frozenset({"core_attn", "layernorm"}))
    assert base - less == pytest.approx(1024 * 2 * 256)


def test_without_core_attn_eager_attention_stores_its_scores():
    eager = dict(WIDTHS, eager_attention=True, sequence_parallel=True)
    without = activation_bytes_per_layer(NUMBERS, **eager, recomputed_modules=frozenset({"mlp"}))
    mlp = activation_bytes_per_layer(NUMBERS, **eager, recomputed_modules=frozenset({"core_attn", "mlp"}))
    assert without - mlp == pytest.approx(5 * 4 * 1024 * 1024 * 2 / 2)  # Korthikanti's 5as^2b/t


def test_moe_act_and_shared_experts_drop_their_tensors_from_the_moe_block():
    base = dict(MOE_BLOCK, sequence_parallel=True, dense_ffn_width=64, shared_width=384)
    block = moe_layer_extra_bytes(NUMBERS, **base)
    routed = 1024 * 2 / 2 * 8  # tokens over tp under sequence parallelism, top-8
    act = moe_layer_extra_bytes(NUMBERS, **base, recomputed_modules=frozenset({"moe_act"}))
    assert block - act == pytest.approx(routed * 2 * 128)  # the activation output, 2 bytes a feature
    shared = moe_layer_extra_bytes(NUMBERS, **base, recomputed_modules=frozenset({"shared_experts"}))
    assert block - shared == pytest.approx(1024 * 2 * 6 * 384 / 2)  # its own widths, over tp


def _activations(modules):
    spec = loaded(modules).spec
    (stage,) = lower(spec, schedule=False).memory
    return stage.activations


def test_the_moe_block_recomputed_whole_keeps_nothing_beyond_a_dense_layer():
    assert _activations("[moe]") < _activations("[core_attn]")
    # with the dense MLP discarded too, an MoE layer keeps its attention and its input only
    assert _activations("[moe, mlp]") < _activations("[moe]") < _activations("[mlp]")


def test_the_rule_and_the_lowering_agree_on_every_module():
    from mixle_compile.verify import memory_bound

    every = ("[core_attn]", "[mla_up_proj]", "[layernorm, mlp]", "[moe]", "[moe, mlp]", "[moe_act]", "[mlp]")
    # every layer of one kind (the rule bounds a stage of mixed kinds by its most MoE layers)
    for modules, experts in [(m, True) for m in every] + [(m, False) for m in ("[mlp]", "[layernorm, mla_up_proj]")]:
        spec = loaded(modules, first=0, experts=experts).spec
        (stage,) = lower(spec, schedule=False).memory
        bound = {k: float(v) for k, v in memory_bound(spec).items()}
        assert stage.activations == pytest.approx(bound["activations"], rel=1e-2, abs=1), modules
        assert stage.recompute == pytest.approx(bound["recompute working set"], rel=1e-2, abs=1), modules


def test_what_runs_again_is_priced_and_its_collectives_issued_again():
    """mla_up_proj runs MLA's up projections again, mlp a dense MLP, moe an MoE block (with its dispatch and
    combine); without core_attn the attention core is not run again (nor its context-parallel exchange)."""
    up = sum(
        2 * i * o
        for i, o, split in __import__("mixle_compile.parameters").parameters.attention_widths(DEEPSEEK_V3).projections()
        if split
    )

    def again(modules, moe=False):
        training = {"activation_checkpointing": "selective", "recompute_modules": modules, "sequence_parallel": True}
        f = _layer_flops(DEEPSEEK_V3, training, 4096, "megatron", moe, 4)
        return f.recompute_linear, f.recompute_attention

    assert again(["mla_up_proj"]) == (pytest.approx(up), 0.0)
    linear, core = again(["core_attn", "mlp"])
    assert linear == pytest.approx(2 * 3 * 7168 * 18432) and core > 0
    assert again(["mlp"], moe=True)[0] == 0.0
    assert again(["moe"], moe=True)[0] > again(["shared_experts"], moe=True)[0] == pytest.approx(2 * 3 * 7168 * 2048)

    def reissued(modules, cp=1):
        spec = loaded(modules, cp=cp).spec
        return {
            u.update.node_id
            for u in lower(spec, schedule=False, each_layer=True).updates
            if "/recompute" in u.update.node_id
        }

    assert reissued("[mla_up_proj]", cp=2) == {f"layers.{i}.attn:in/recompute" for i in range(4)}  # no kv
    assert reissued("[core_attn]", cp=2) == {f"layers.{i}.attn:kv/recompute" for i in range(4)}
    moe = reissued("[moe]")
    assert {"layers.1.moe:dispatch/recompute", "layers.1.mlp:in/recompute"} <= moe
    assert not any(n.startswith("layers.0.") for n in moe)  # the dense first layer is not recomputed
    dense = reissued("[mlp]")
    assert "layers.0.mlp:in/recompute" in dense and not any(n.startswith("layers.1.") for n in dense)


def test_recomputed_up_projections_gather_the_latents_again_without_the_rotary_key():
    """Megatron's checkpointed qkv_up_proj_and_rope_apply runs the column-parallel up projections again, whose
    sequence-parallel input gather (the query and key/value latents, not the rotary key) runs again."""
    spec = loaded("[mla_up_proj]").spec
    updates = {u.update.node_id: u for u in lower(spec, schedule=False, each_layer=True).updates}
    gather, again = updates["layers.0.attn:in"], updates["layers.0.attn:in/recompute"]
    assert again.payload_bytes * (16 + 16 + 8) == gather.payload_bytes * (16 + 16)
    assert "layers.0.attn:in/recompute" not in {
        u.update.node_id for u in lower(loaded("[core_attn]").spec, schedule=False, each_layer=True).updates
    }


def test_a_published_deepseek_v3_run_fits_only_with_its_up_projections_recomputed():
    """Megatron-Bridge's DeepSeek-V3 on 256 GB200s recomputes the MLA up projections; priced as recomputing the
    attention core only, R001 refuses it."""
    text = (BRIDGE / "bridge_deepseek_v3_gb200_bf16.yaml").read_text()
    assert check_loaded(load_spec_text(text, "gb200.yaml")).errors == 0
    data = yaml.safe_load(text)
    data["training"].pop("recompute_modules")
    verdict = check_loaded(load_spec_text(yaml.safe_dump(data), "gb200.yaml"))
    assert verdict.errors and "R001" in {d.code for d in verdict.diagnostics}

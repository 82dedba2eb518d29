"""Multi-head Latent Attention (MLA) in the torch runtime (runtime/model.py ``_latent_attention``).

The layer is checked once against a computation written here head by head, then every replay case
runs the plan's ranks as gloo processes with ``--reference``: planned == observed for every update
on every rank and evidence for every update within the optimizer's bound, the latents' gather over
tp and the keys' and values' gather over cp included.
"""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from mixle_compile.lower.lowering import lower
from mixle_compile.parameters import attention_widths
from mixle_compile.runtime import run_plan
from mixle_compile.runtime.model import LocalOps, TransformerShape, _latent_attention, _rope_tables
from mixle_compile.spec import load_spec_text
from tests.test_runtime_support import compile_text

BOUND = {"sgd": 1e-5, "adamw": 1e-3}


def mla_spec(
    *,
    dr=1,
    ds=1,
    tp=1,
    pp=1,
    cp=1,
    ep=1,
    sp=False,
    q_lora=10,
    v=8,
    experts=0,
    optimizer="sgd",
    lr=1e-2,
    mb=1,
    position="rope",
) -> str:
    world = dr * ds * tp * pp * cp
    q_field = f"q_lora_rank: {q_lora}, " if q_lora else ""
    moe = ""
    if experts:
        moe = f", num_experts: {experts}, experts_per_token: 2, moe_ffn_hidden_size: 24, moe_first_layer: 1"
    return textwrap.dedent(
        f"""\
        model: {{family: transformer, vocab_size: 128, hidden_size: 32, num_layers: 2, num_heads: 4, {q_field}
                kv_lora_rank: 12, qk_nope_head_dim: 6, qk_rope_head_dim: 4, v_head_dim: {v}, ffn_hidden_size: 64,
                position_embedding: {position}{moe}}}
        mesh: {{dp_replicate: {dr}, dp_shard: {ds}, tp: {tp}, pp: {pp}, cp: {cp}, ep: {ep},
               microbatches: {max(mb, pp)}}}
        training: {{global_batch_size: {2 * dr * ds * max(mb, pp)}, micro_batch_size: 2, seq_len: 16, precision: fp32,
                   optimizer: {optimizer}, learning_rate: {lr}, sequence_parallel: {str(sp).lower()}, steps: 3}}
        backend: torch
        resources: {{devices: {world}, memory: 1GiB, kind: cpu}}
        """
    )


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def _rotated(x: torch.Tensor, position: int) -> torch.Tensor:
    """Rotary positions on one vector: feature i turns with feature i + d/2 by position * 10000^(-2i/d)."""
    d = x.shape[-1]
    out = x.clone()
    for i in range(d // 2):
        angle = position * 10000.0 ** (-2 * i / d)
        c, s = math.cos(angle), math.sin(angle)
        out[..., i] = x[..., i] * c - x[..., i + d // 2] * s
        out[..., i + d // 2] = x[..., i] * s + x[..., i + d // 2] * c
    return out


@pytest.mark.parametrize(("q_lora", "v"), [(10, 8), (0, 8), (10, 12)])
def test_the_layer_is_deepseeks_attention_written_head_by_head(q_lora, v):
    loaded = load_spec_text(mla_spec(q_lora=q_lora, v=v), "spec.yaml")
    assert loaded.ok, [d.text() for d in loaded.diagnostics]
    shape = TransformerShape.from_spec(loaded.spec)
    a = attention_widths(loaded.spec.model)
    g = torch.Generator().manual_seed(3)
    heads, nope, rope_dim, s, b = a.heads, a.qk_head_dim - a.rope, a.rope, 7, 2
    w = {
        "u.attn.kv_a_proj.weight": torch.randn(a.kv_lora + rope_dim, 32, generator=g) / 6,
        "u.attn.kv_a_norm.weight": 1 + torch.randn(a.kv_lora, generator=g) / 10,
        "u.attn.kv_b_proj.weight": torch.randn(heads * (nope + v), a.kv_lora, generator=g) / 4,
        "u.attn.o_proj.weight": torch.randn(32, heads * v, generator=g) / 6,
    }
    if q_lora:
        w["u.attn.q_a_proj.weight"] = torch.randn(q_lora, 32, generator=g) / 6
        w["u.attn.q_a_norm.weight"] = 1 + torch.randn(q_lora, generator=g) / 10
        w["u.attn.q_b_proj.weight"] = torch.randn(heads * a.qk_head_dim, q_lora, generator=g) / 4
    else:
        w["u.attn.q_proj.weight"] = torch.randn(heads * a.qk_head_dim, 32, generator=g) / 6
    h = torch.randn(s, b, 32, generator=g)
    got = _latent_attention(LocalOps(w), shape, a, "u", h, _rope_tables(s, rope_dim, h.dtype, h.device))

    want = torch.zeros(s, b, 32)
    for j in range(b):
        latent = _rms(h[:, j] @ w["u.attn.kv_a_proj.weight"][: a.kv_lora].T, w["u.attn.kv_a_norm.weight"])
        k_pos = h[:, j] @ w["u.attn.kv_a_proj.weight"][a.kv_lora :].T  # [s, rope], one for every head
        if q_lora:
            queries = _rms(h[:, j] @ w["u.attn.q_a_proj.weight"].T, w["u.attn.q_a_norm.weight"])
            queries = queries @ w["u.attn.q_b_proj.weight"].T
        else:
            queries = h[:, j] @ w["u.attn.q_proj.weight"].T
        up = latent @ w["u.attn.kv_b_proj.weight"].T  # [s, heads * (nope + v)]
        outputs = []
        for head in range(heads):
            q_h = queries[:, head * a.qk_head_dim : (head + 1) * a.qk_head_dim]
            kv_h = up[:, head * (nope + v) : (head + 1) * (nope + v)]
            out_h = torch.zeros(s, v)
            for t in range(s):
                q_t = torch.cat([q_h[t, :nope], _rotated(q_h[t, nope:], t)])
                keys = torch.stack([torch.cat([kv_h[u, :nope], _rotated(k_pos[u], u)]) for u in range(t + 1)])
                weights = torch.softmax(keys @ q_t / math.sqrt(nope + rope_dim), dim=0)
                out_h[t] = weights @ kv_h[: t + 1, nope:]
            outputs.append(out_h)
        want[:, j] = torch.cat(outputs, dim=-1) @ w["u.attn.o_proj.weight"].T
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_the_plan_gathers_the_latents_not_the_hidden_state_over_tp():
    """Under sequence parallelism the attention's input gather carries the query latent, the key/value
    latent and the rotary key ((10 + 12 + 4) / 32 of the hidden state's bytes), the MLP's the hidden
    state; under context parallelism keys and values at the larger head size (qk 10 here)."""
    doc = compile_text(mla_spec(tp=2, sp=True, cp=2))
    by_id = {u.node_id: u.payload_bytes for u in doc.updates}
    tokens_bytes = 2 * (16 // 2) * 4  # micro-batch 2, seq 16 over cp 2, fp32
    assert by_id["layers.0.attn:in"] == tokens_bytes * (10 + 12 + 4)
    assert by_id["layers.0.mlp:in"] == tokens_bytes * 32
    assert by_id["layers.0.attn:kv"] == 2 * tokens_bytes * (4 // 2) * 10 * 2  # k and v, 2 heads, cp 2
    direct = compile_text(mla_spec(tp=2, sp=True, q_lora=0))
    assert {u.node_id: u.payload_bytes for u in direct.updates}["layers.0.attn:in"] == 2 * 16 * 4 * (32 + 12 + 4)


def test_the_down_projections_are_whole_on_every_tp_rank_and_their_gradients_summed_under_sp():
    spec = load_spec_text(mla_spec(tp=2, sp=True), "spec.yaml").spec
    lowered = lower(spec)
    layouts = {p.parameter.name: p for p in lowered.parameters}
    for name in ("q_a_proj", "kv_a_proj", "q_a_norm", "kv_a_norm"):
        assert layouts[f"layers.0.attn.{name}.weight"].parameter.tp_dim is None
    for name in ("q_b_proj", "kv_b_proj"):
        assert layouts[f"layers.0.attn.{name}.weight"].parameter.tp_dim == 0
    tp_sums = {u.tensor for u in lowered.updates if u.update.mesh_axes == ("tp",) and u.update.payload == "gradient"}
    assert {"layers.0.attn.q_a_proj.weight", "layers.0.attn.kv_a_proj.weight"} <= tp_sums
    assert "layers.0.attn.kv_b_proj.weight" not in tp_sums


CASES = {
    "tp2-sp": dict(tp=2, sp=True),
    "tp2-cp2-values-wider-than-keys": dict(tp=2, cp=2, v=12, optimizer="adamw", lr=1e-3),
    "ep2-fsdp2-experts-after-a-dense-layer": dict(ds=2, ep=2, experts=4),
    "pp2-tp2": dict(pp=2, tp=2, mb=4),
    "tp2-cp2-learned-positions-beside-rotary": dict(tp=2, cp=2, position="learned"),
}

SLOW_CASES = {
    "fsdp2-cp2-values-wider-than-keys": dict(ds=2, cp=2, v=12, optimizer="adamw", lr=1e-3),
    "ddp2-tp2-sp-world4": dict(dr=2, tp=2, sp=True),
    "tp2-direct-queries": dict(tp=2, q_lora=0),
    "tp2-cp2-sp-world4": dict(tp=2, cp=2, sp=True),
    "fsdp2-tp2-cp2-sp-adamw-world8": dict(ds=2, tp=2, cp=2, sp=True, optimizer="adamw", lr=1e-3),
    "ep2-fsdp2-tp2-sp-world4": dict(ds=2, tp=2, ep=2, sp=True, experts=4),
}


def check_replay(tmp_path, kwargs) -> None:
    doc = compile_text(mla_spec(**kwargs))
    report = run_plan(doc, steps=3, out_dir=tmp_path, reference=True, progress=False, timeout_s=120)
    assert report.ok, report.errors
    assert report.accounting_ok and report.updates_checked == len(doc.updates) > 0
    evidence = {u.node_id: u for u in report.evidence}
    assert set(evidence) == {u.node_id for u in doc.updates}
    assert report.max_relative_error <= BOUND[kwargs.get("optimizer", "sgd")], sorted(
        evidence.values(), key=lambda u: -u.maximum_relative_error
    )[:3]


@pytest.mark.parametrize("case", CASES)
def test_latent_attention_replay_matches_plan_and_reference(tmp_path, case):
    check_replay(tmp_path, CASES[case])


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES)
def test_latent_attention_replay_matches_plan_and_reference_more_meshes(tmp_path, case):
    check_replay(tmp_path, SLOW_CASES[case])


@pytest.mark.slow
def test_the_latent_attention_example_runs_and_matches_the_reference(tmp_path):
    # examples/tiny-latent-attention.yaml: MLA with dense layers before the MoE ones and a shared expert,
    # FSDP 2 x tp 2 (sequence parallel) x ep 2 x pp 2 on 8 ranks, every update against the reference.
    from tests.conftest import EXAMPLES

    report = run_plan(
        EXAMPLES / "tiny-latent-attention.yaml",
        steps=3,
        out_dir=tmp_path,
        reference=True,
        progress=False,
        timeout_s=150,
    )
    assert report.ok and report.accounting_ok, report.errors
    assert report.max_relative_error <= BOUND["adamw"]
    nodes = {u.node_id for u in report.evidence if u.has_numerics_evidence}
    assert {"layers.0.attn:in", "layers.3.moe:dispatch", "layers.3.attn.kv_a_proj.weight:grad/tp"} <= nodes


@pytest.mark.parametrize(
    ("backend", "attn_in", "kv_head"),
    [
        # Megatron-Core projects down on the sequence shard and gathers the latents; Transformer Engine's ring
        # sends keys and values at their own head sizes (AttnFuncWithCPAndKVP2P handles k and v of two sizes)
        ("megatron", 10 + 12 + 4, (10 + 12) / 2),
        # torchtitan gathers the hidden state for its NoParallel wq_a/wkv_a; torch's ring sends k and v apart
        ("torchtitan", 32, (10 + 12) / 2),
        # the in-tree runtime gathers the latents and pads the values to the keys' head size
        ("torch", 10 + 12 + 4, 12),
    ],
)
def test_what_each_engine_gathers_for_latent_attention(backend, attn_in, kv_head):
    text = mla_spec(tp=2, sp=True, cp=2, v=12).replace("backend: torch", f"backend: {backend}")
    loaded = load_spec_text(text, "spec.yaml")
    assert loaded.ok, [d.text() for d in loaded.diagnostics]
    by_id = {u.node_id: u.payload_bytes for u in compile_text(text).updates}
    tokens_bytes = 2 * (16 // 2) * 4
    assert by_id["layers.0.attn:in"] == tokens_bytes * attn_in
    assert by_id["layers.0.attn:kv"] == 2 * tokens_bytes * (4 // 2) * kv_head * 2


def test_a_latent_attention_model_outside_torchtitans_flavors_is_not_exported_as_llama3(tmp_path):
    from mixle_compile.export import ExportRefused, export_spec

    text = mla_spec(tp=2, sp=True, optimizer="adamw").replace("backend: torch", "backend: torchtitan")
    spec = load_spec_text(text, "spec.yaml").spec
    with pytest.raises(ExportRefused) as refused:
        export_spec(spec, "torchtitan", torchtitan_version="0.2")
    assert "kv_lora_rank" in str(refused.value)


def test_learned_positions_keep_the_latent_attentions_rotary_part(monkeypatch):
    """Megatron-Core's MultiLatentAttention turns the rotary part of its keys and queries with its own
    rotary embedding whatever the position type: with learned positions the model adds the table and
    still rotates (undoing the rotation changes the loss)."""
    from mixle_compile.runtime import model as runtime_model
    from tests.test_runtime_mtp import _weights

    spec = load_spec_text(mla_spec(position="learned"), "spec.yaml").spec
    shape = TransformerShape.from_spec(spec)
    g = torch.Generator().manual_seed(5)
    weights = _weights(spec, g)
    assert "pos_embed.weight" in weights
    inputs, targets = torch.randint(0, 128, (2, 9), generator=g), torch.randint(0, 128, (2, 9), generator=g)
    rotated = runtime_model.transformer_loss(LocalOps(weights), shape, inputs, targets)
    monkeypatch.setattr(runtime_model, "_rotate", lambda x, rope: x)
    unrotated = runtime_model.transformer_loss(LocalOps(weights), shape, inputs, targets)
    assert not torch.allclose(rotated, unrotated)

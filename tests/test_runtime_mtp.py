"""Multi-token prediction (DeepSeek-V3's MTP, as Megatron-Core 0.16 runs it) in the torch runtime
(runtime/model.py ``_mtp_depth``).

A depth is checked once against a computation written here position by position, and the depths'
loss against the main loss it joins; then every replay case runs the plan's ranks as gloo processes
with ``--reference``: planned == observed for every update on every rank (the depths' embedding,
projection, head and loss collectives over tp included) and evidence for every update within the
optimizer's bound. Plans the runtime cannot execute are refused before any process starts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import textwrap

import pytest
import torch
import torch.nn.functional as F

from mixle_compile.parameters import transformer_parameters
from mixle_compile.runtime import run_plan
from mixle_compile.runtime.errors import RuntimeRefusal
from mixle_compile.runtime.model import (
    LocalOps,
    TransformerShape,
    _mtp_depth,
    _norm,
    _rope_tables,
    stage_forward,
    tokens_ahead,
    transformer_loss,
)
from mixle_compile.spec import load_spec_text
from tests.test_runtime_support import compile_text

BOUND = {"sgd": 1e-5, "adamw": 1e-3}


def mtp_spec(
    *,
    dr=1,
    ds=1,
    tp=1,
    pp=1,
    cp=1,
    ep=1,
    sp=False,
    depths=2,
    tie=False,
    experts=0,
    layers=2,
    backend="torch",
    optimizer="sgd",
    lr=1e-2,
    mb=1,
    seq=16,
    factor=None,
    position="rope",
    latent=False,
    checkpointing="none",
) -> str:
    world = dr * ds * tp * pp * cp
    moe = ""
    if experts:  # the last decoder layer is the MoE one, so the depths' blocks are too
        moe = f", num_experts: {experts}, experts_per_token: 2, moe_ffn_hidden_size: 24, moe_first_layer: {layers - 1}"
    mla = ", kv_lora_rank: 12, qk_nope_head_dim: 6, qk_rope_head_dim: 4, v_head_dim: 8" if latent else ""
    weight = f", mtp_loss_scaling_factor: {factor}" if factor is not None else ""
    micro = max(mb, pp)
    return textwrap.dedent(
        f"""\
        model: {{family: transformer, vocab_size: 128, hidden_size: 32, num_layers: {layers}, num_heads: 4,
                ffn_hidden_size: 64, tie_embeddings: {str(tie).lower()}, position_embedding: {position},
                mtp_num_layers: {depths}{moe}{mla}}}
        mesh: {{dp_replicate: {dr}, dp_shard: {ds}, tp: {tp}, pp: {pp}, cp: {cp}, ep: {ep}, microbatches: {micro}}}
        training: {{global_batch_size: {2 * dr * ds * micro}, micro_batch_size: 2, seq_len: {seq}, precision: fp32,
                   optimizer: {optimizer}, learning_rate: {lr}, sequence_parallel: {str(sp).lower()}, steps: 3,
                   activation_checkpointing: {checkpointing}{weight}}}
        backend: {backend}
        resources: {{devices: {world}, memory: 1GiB, kind: cpu}}
        """
    )


def _spec(**kwargs):
    loaded = load_spec_text(mtp_spec(**kwargs), "spec.yaml")
    assert loaded.ok, [d.text() for d in loaded.diagnostics]
    return loaded.spec


def _weights(spec, generator) -> dict[str, torch.Tensor]:
    """Every parameter of the spec's transformer, random (norms near 1), requiring gradients."""
    out = {}
    for p in transformer_parameters(spec.model, "fp32", spec.training.seq_len):
        if p.role == "norm":
            value = 1 + torch.randn(p.shape, generator=generator) / 10
        else:
            value = torch.randn(p.shape, generator=generator) / math.sqrt(p.shape[-1])
        out[p.name] = value.requires_grad_(True)
    return out


# --- a depth, written here by hand ------------------------------------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def _rotated(x: torch.Tensor, position: int) -> torch.Tensor:
    """Rotary positions on one vector: feature i turns with feature i + d/2 by position * 10000^(-2i/d)."""
    d = x.shape[-1]
    parts = []
    for i in range(d // 2):
        angle = position * 10000.0 ** (-2 * i / d)
        parts.append((x[..., i] * math.cos(angle) - x[..., i + d // 2] * math.sin(angle)).unsqueeze(-1))
    for i in range(d // 2):
        angle = position * 10000.0 ** (-2 * i / d)
        parts.append((x[..., i] * math.sin(angle) + x[..., i + d // 2] * math.cos(angle)).unsqueeze(-1))
    return torch.cat(parts, dim=-1)


def _block_by_hand(w: dict[str, torch.Tensor], unit: str, x: torch.Tensor, heads: int) -> torch.Tensor:
    """One sample's pre-norm block (``x``: ``[s, h]``): causal attention head by head with rotary
    positions 0 .. s - 1, then the SwiGLU MLP."""
    s, hidden = x.shape
    d = hidden // heads
    h = _rms(x, w[f"{unit}.attn_norm.weight"])
    q, k, v = (h @ w[f"{unit}.attn.{n}_proj.weight"].T for n in ("q", "k", "v"))
    outputs = []
    for head in range(heads):
        cut = slice(head * d, (head + 1) * d)
        rows = []
        for t in range(s):
            query = _rotated(q[t, cut], t)
            keys = torch.stack([_rotated(k[u, cut], u) for u in range(t + 1)])
            weights = torch.softmax(keys @ query / math.sqrt(d), dim=0)
            rows.append(weights @ v[: t + 1, cut])
        outputs.append(torch.stack(rows))
    x = x + torch.cat(outputs, dim=-1) @ w[f"{unit}.attn.o_proj.weight"].T
    h = _rms(x, w[f"{unit}.mlp_norm.weight"])
    inner = F.silu(h @ w[f"{unit}.mlp.gate_proj.weight"].T) * (h @ w[f"{unit}.mlp.up_proj.weight"].T)
    return x + inner @ w[f"{unit}.mlp.down_proj.weight"].T


def _depth_by_hand(w, unit, k, hidden, ids, targets, table, head, heads):
    """DeepSeek-V3's MTP module k on ``hidden`` (``[s, b, h]``), sample by sample and position by
    position: the token k + 1 ahead embedded and normalised beside the normalised hidden state,
    projected, one block, its own norm, the shared head; the loss against the token k + 2 ahead,
    averaged over the positions that have one."""
    s, b = ids.shape
    out = []
    total, count = 0.0, 0
    for j in range(b):
        ahead = [int(ids[t + k + 1, j]) if t + k + 1 < s else 0 for t in range(s)]
        e = table[ahead]
        joined = torch.cat(
            [_rms(e, w[f"{unit}.mtp.enorm.weight"]), _rms(hidden[:, j], w[f"{unit}.mtp.hnorm.weight"])], -1
        )
        x = _block_by_hand(w, unit, joined @ w[f"{unit}.mtp.eh_proj.weight"].T, heads)
        h = _rms(x, w[f"{unit}.mtp.final_norm.weight"])
        out.append(h)
        logits = h @ head.T
        for t in range(s - k - 1):
            label = int(targets[t + k + 1, j])
            total = total + torch.logsumexp(logits[t], 0) - logits[t, label]
            count += 1
    return torch.stack(out, dim=1), total / count


@pytest.mark.parametrize("k", [0, 1])
def test_a_depth_is_deepseeks_mtp_module_written_by_hand(k):
    spec = _spec(depths=2, layers=1)
    shape = TransformerShape.from_spec(spec)
    g = torch.Generator().manual_seed(5)
    w = _weights(spec, g)
    s, b = 7, 2
    ids = torch.randint(0, 128, (s, b), generator=g)
    targets = torch.randint(0, 128, (s, b), generator=g)
    hidden = torch.randn(s, b, 32, generator=g).requires_grad_(True)
    unit = f"layers.{1 + k}"
    rope = _rope_tables(s, 8, hidden.dtype, hidden.device)
    got_h, got_loss = _mtp_depth(
        LocalOps(w), shape, 1 + k, k, hidden, ids, targets, rope, w["mtp_embed.weight"], w["lm_head.weight"]
    )
    want_h, want_loss = _depth_by_hand(w, unit, k, hidden, ids, targets, w["mtp_embed.weight"], w["lm_head.weight"], 4)
    assert torch.allclose(got_h, want_h, atol=1e-5), (got_h - want_h).abs().max()
    assert torch.allclose(got_loss, want_loss, atol=1e-5), (got_loss, want_loss)
    # and the same gradients, the embedding's rows of the tokens ahead and the hidden state's included
    probe = torch.randn(s, b, 32, generator=g)
    inputs = [hidden, *(w[n] for n in sorted(w) if n.startswith(unit) or n in ("mtp_embed.weight", "lm_head.weight"))]
    got = torch.autograd.grad(got_loss + (got_h * probe).sum(), inputs)
    want = torch.autograd.grad(want_loss + (want_h * probe).sum(), inputs)
    for tensor_got, tensor_want in zip(got, want, strict=True):
        assert torch.allclose(tensor_got, tensor_want, atol=1e-5), (tensor_got - tensor_want).abs().max()


def test_the_tokens_ahead_are_megatrons_roll_with_zeros():
    # Megatron-Core's roll_tensor (multi_token_prediction.py) rolls left and zeroes the rolled-in position
    t = torch.arange(1, 6).unsqueeze(1)
    once = torch.roll(t, shifts=-1, dims=0)
    once[-1] = 0
    twice = torch.roll(once, shifts=-1, dims=0)
    twice[-1] = 0
    assert torch.equal(tokens_ahead(t, 1), once) and torch.equal(tokens_ahead(t, 2), twice)
    assert torch.equal(tokens_ahead(t, 5), torch.zeros_like(t))


@pytest.mark.parametrize(("tie", "factor"), [(False, None), (True, 0.5)])
def test_the_depths_loss_joins_the_main_losss_gradient_weighted_and_not_its_value(tie, factor):
    """The loss a micro-batch reports is the main one (Megatron-Core logs the MTP loss apart); its
    gradient is that of main + factor / D * (CE_0 + ... + CE_{D-1}), the depths chained on the final
    norm's output (factor null: Megatron-Core's 0.1)."""
    spec = _spec(depths=2, layers=1, tie=tie, factor=factor)
    shape = TransformerShape.from_spec(spec)
    assert shape.mtp_loss_scale == pytest.approx((factor or 0.1) / 2)
    g = torch.Generator().manual_seed(11)
    w = _weights(spec, g)
    inputs, targets = torch.randint(0, 128, (2, 9), generator=g), torch.randint(0, 128, (2, 9), generator=g)
    ops = LocalOps(w)
    loss = transformer_loss(ops, shape, inputs, targets)
    main = transformer_loss(ops, dataclasses.replace(shape, mtp_depths=0), inputs, targets)
    assert torch.equal(loss.detach(), main.detach())
    x = stage_forward(ops, shape, (0,), first=True, last=False, x=None, inputs=inputs, targets=targets)
    hidden = _norm(ops, shape, x, "final_norm")
    table = w["lm_head.weight" if tie else "mtp_embed.weight"]
    rope = _rope_tables(9, 8, x.dtype, x.device)
    ces = []
    for k in range(2):
        hidden, ce = _mtp_depth(ops, shape, 1 + k, k, hidden, inputs.t(), targets.t(), rope, table, w["lm_head.weight"])
        ces.append(ce)
    total = main + (factor or 0.1) / 2 * (ces[0] + ces[1])
    names = sorted(w)
    got = torch.autograd.grad(loss, [w[n] for n in names], allow_unused=True)
    want = torch.autograd.grad(total, [w[n] for n in names], allow_unused=True)
    for name, a, b in zip(names, got, want, strict=True):
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.allclose(a, b, atol=1e-6), (name, (a - b).abs().max())
    assert got[names.index("layers.2.mtp.eh_proj.weight")].abs().sum() > 0


# --- replays --------------------------------------------------------------------------------------

CASES = {
    # sequence parallelism, two depths, FSDP (each depth a unit inside the head's), the embedding copy on one stage
    "fsdp2-tp2-sp-two-depths": dict(ds=2, tp=2, sp=True),
    # no sequence parallelism; the embedding copy on the last stage summed with the first's (tied all_reduce)
    "pp2-tp2-untied-embedding-copy": dict(pp=2, tp=2, depths=1, mb=4),
}

SLOW_CASES = {
    "ddp2-tp2-tied-embeddings": dict(dr=2, tp=2, tie=True),
    "fsdp2-tp2-sp-ep2-moe-last-layer": dict(ds=2, tp=2, sp=True, ep=2, experts=4, depths=1),
    "pp2-tp2-sp-tied-embeddings-adamw": dict(pp=2, tp=2, sp=True, tie=True, mb=4, optimizer="adamw", lr=1e-3),
    "megatron-pp2-tp2-sp-weighted": dict(pp=2, tp=2, sp=True, mb=4, backend="megatron", factor=0.5),
    "fsdp2-pp2-three-depths": dict(ds=2, pp=2, depths=3, mb=4),
}


def _depth_sites(doc) -> set[str]:
    return {u.node_id for u in doc.updates if ".mtp." in u.node_id or u.tensor == "mtp_embed.weight"}


def check_replay(tmp_path, kwargs) -> None:
    doc = compile_text(mtp_spec(**kwargs))
    report = run_plan(doc, steps=3, out_dir=tmp_path, reference=True, progress=False, timeout_s=120)
    assert report.ok, report.errors
    nodes = {u.node_id for u in doc.updates}
    assert report.accounting_ok and report.updates_checked == len(nodes) > 0
    evidence = {u.node_id: u for u in report.evidence if u.has_numerics_evidence}
    assert set(evidence) == nodes
    assert report.max_relative_error <= BOUND[kwargs.get("optimizer", "sgd")], sorted(
        evidence.values(), key=lambda u: -u.maximum_relative_error
    )[:3]
    # the depths' own updates are among them
    depth = 2  # num_layers: the first depth's block
    mine = _depth_sites(doc)
    assert f"layers.{depth}.mtp.eh_proj.weight" in {p.logical_id for p in doc.parameters}
    if kwargs.get("tp", 1) > 1:
        assert {f"layers.{depth}.mtp.eh_proj:out", f"layers.{depth}.mtp.head:loss"} <= mine
        if kwargs.get("sp"):
            assert f"layers.{depth}.mtp.eh_proj:out/grad" in mine
    if kwargs.get("pp", 1) > 1:
        assert "tied_embedding:grad/tied" in nodes


@pytest.mark.parametrize("case", CASES)
def test_mtp_replay_matches_plan_and_reference(tmp_path, case):
    check_replay(tmp_path, CASES[case])


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES)
def test_mtp_replay_matches_plan_and_reference_more_meshes(tmp_path, case):
    check_replay(tmp_path, SLOW_CASES[case])


@pytest.mark.slow
def test_a_torchtitan_plan_runs_the_projection_whole_on_every_tp_rank(tmp_path):
    """torchtitan keeps eh_proj whole on every tp rank (EngineProfile.mtp_projection_split): no gather
    of its output, its gradient over the sequence shards summed by its ``:grad/tp`` all_reduce. Every
    update of the depths runs as planned and matches the reference; the decoder's attention input
    gathers (the depth's block's too) do not, because torchtitan gathers Multi-head Latent Attention's
    hidden state where this runtime gathers the latents (tests/test_runtime_latent.py), and torchtitan
    runs MTP with MLA only."""
    doc = compile_text(mtp_spec(ds=2, tp=2, sp=True, latent=True, depths=1, backend="torchtitan"))
    assert not {u.node_id for u in doc.updates if ".eh_proj:" in u.node_id}
    assert "layers.2.mtp.eh_proj.weight:grad/tp" in {u.node_id for u in doc.updates}
    report = run_plan(doc, steps=3, out_dir=tmp_path, reference=True, progress=False, timeout_s=120)
    updates = report.data["accounting"]["updates"]
    differing = {u["node_id"] for u in updates if not u["match"]}
    assert differing and all(
        n.split(":")[0].endswith(".attn") and n.split(":")[1] in ("in", "in/grad") for n in differing
    )
    mine = _depth_sites(doc)
    assert "layers.2.mtp.eh_proj.weight:grad/tp" in mine and not differing & mine
    assert report.max_relative_error <= BOUND["sgd"]


@pytest.mark.slow
def test_the_mtp_example_runs_and_matches_the_reference(tmp_path):
    from tests.conftest import EXAMPLES

    report = run_plan(
        EXAMPLES / "tiny-mtp.yaml", steps=3, out_dir=tmp_path, reference=True, progress=False, timeout_s=150
    )
    assert report.ok and report.accounting_ok, report.errors
    assert report.max_relative_error <= BOUND["adamw"]
    nodes = {u.node_id for u in report.evidence if u.has_numerics_evidence}
    assert {"layers.4.mtp.eh_proj:out", "layers.4.mtp.head:loss", "tied_embedding:grad/tied"} <= nodes


@pytest.mark.slow
def test_a_checkpoint_of_the_embedding_copy_resumes_without_a_pipeline(tmp_path):
    """Saved under pp 2 (the last stage's copy of the embedding, summed with the first's) and resumed
    without a pipeline (the copy is the embedding's own tensor): the checkpoint holds the weight once,
    and the resumed run ends where the uninterrupted one does."""
    from mixle_compile.runtime import checkpoint as ckpt
    from mixle_compile.runtime import checkpoint_dcp

    base = dict(depths=1, optimizer="adamw", lr=1e-3)
    whole = run_plan(
        compile_text(mtp_spec(pp=2, tp=2, mb=4, **base)), steps=3, out_dir=tmp_path / "a", progress=False, save_every=1
    )
    assert whole.ok, whole.errors
    root = tmp_path / "a" / "checkpoints"
    manifest = json.loads((root / ckpt.step_dir_name(1) / "manifest.json").read_text())
    assert manifest["tied"] == {"mtp_embed.weight": "embed.weight"}  # saved once, as the embedding
    assert "mtp_embed.weight" not in {p["name"] for p in manifest["parameters"]}
    resumed = run_plan(
        compile_text(mtp_spec(ds=2, tp=1, mb=2, **base)),
        steps=3,
        out_dir=tmp_path / "b",
        progress=False,
        save_every=1,
        resume=root / ckpt.step_dir_name(1),
    )
    assert resumed.ok, resumed.errors
    want = checkpoint_dcp.read_global_state(root / ckpt.step_dir_name(3))
    got = checkpoint_dcp.read_global_state(tmp_path / "b" / "checkpoints" / ckpt.step_dir_name(3))
    assert sorted(got) == sorted(want)
    worst = max(float((got[k] - want[k]).norm() / want[k].norm()) for k in want)
    assert worst < 1e-4, worst
    assert list(resumed.losses) == pytest.approx(list(whole.losses)[1:], rel=1e-5)


# --- refused before anything starts -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        # Megatron rolls the tokens ahead across cp ranks; this runtime does not (the torch rules refuse it: C014)
        (dict(cp=2, tp=1, backend="megatron"), ("cp=2", "cp: 1")),
        # the last depth would have no position with a token ahead
        (dict(depths=2, seq=2), ("seq_len=2", "above 2")),
        # Megatron issues the projection's gathers again under full recomputation; this runtime never does
        (dict(tp=2, sp=True, backend="megatron", checkpointing="full"), ("recompute", "activation_checkpointing")),
    ],
)
def test_what_the_runtime_cannot_execute_is_refused_before_starting(tmp_path, kwargs, words):
    doc = compile_text(mtp_spec(**kwargs))
    if kwargs.get("checkpointing") == "full":
        assert "layers.2.mtp.eh_proj:in/recompute" in {u.node_id for u in doc.updates}
    with pytest.raises(RuntimeRefusal) as refused:
        run_plan(doc, steps=1, out_dir=tmp_path, progress=False)
    assert all(w in str(refused.value) for w in words), str(refused.value)
    assert not (tmp_path / "logs").exists()  # no rank was started


def test_a_depth_placed_before_the_last_stage_is_refused():
    from mixle_compile.runtime.instructions import read_instructions
    from mixle_compile.runtime.pipeline_plan import check_pipeline

    doc = compile_text(mtp_spec(pp=2, depths=1, mb=2))
    instructions = read_instructions(doc)
    check_pipeline(doc, instructions)
    moved = doc.model_copy(
        update={"parameters": [p.model_copy(update={"stage": 0}) if p.layer == 2 else p for p in doc.parameters]}
    )
    with pytest.raises(RuntimeRefusal) as refused:
        check_pipeline(moved, instructions)
    assert "multi-token prediction blocks [2] on stage 0" in str(refused.value)


def test_learned_positions_are_refused_by_the_rules_and_by_the_runtime(tmp_path):
    """The position table is the first stage's embedding unit's; Megatron refuses learned positions with
    MTP too. `run` checks the plan's spec again (C012); a plan read without that check (one compiled
    before C012 covered the torch rule set) is refused by the runtime itself."""
    from mixle_compile.runtime.instructions import read_instructions

    doc = compile_text(mtp_spec(position="learned"))  # compiled without the rules, as before C012 covered torch
    with pytest.raises(RuntimeRefusal) as refused:
        run_plan(doc, steps=1, out_dir=tmp_path, progress=False)
    assert "C012" in str(refused.value)
    with pytest.raises(RuntimeRefusal) as refused:
        read_instructions(doc)
    assert "learned positions" in str(refused.value) and "position_embedding: rope" in str(refused.value)

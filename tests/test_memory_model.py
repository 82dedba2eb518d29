"""One memory model: the verifier's memory rule (R001) bounds what the lowering prices exactly.

The lowering prices every rank's memory parameter by parameter and stage by stage; R001 states a
symbolic bound on the heaviest rank. Both read the formulas of `mixle_compile.memory_model`, so:
without a pipeline and with identical layers the two agree kind by kind; otherwise the bound is
never below the heaviest stage (up to the rounding of uneven shards).
"""

from __future__ import annotations

import random
import re

import pytest

from mixle_compile.lower.lowering import lower
from mixle_compile.memory_model import NUMBERS, MoESaved, activation_bytes_per_layer, micro_batches_in_flight
from mixle_compile.schedules import NUMBERS as SCHEDULE_NUMBERS
from mixle_compile.schedules import microbatches_per_round
from mixle_compile.spec import load_spec_text
from mixle_compile.spec.models import TransformerModel
from mixle_compile.verify import memory_bound
from tests.conftest import EXAMPLES

KINDS = {  # lowering's name -> the rule's name
    "parameters": "weights",
    "gathered_parameters": "gathered weights",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations",
    "recompute": "recompute working set",
    "loss": "logits and loss",
    "buffers": "communication buffers",
    "reserve": "allocator reserve",
}

TRANSFORMER = """\
model: {{family: transformer, vocab_size: {vocab}, hidden_size: {hidden}, num_layers: {layers}, num_heads: {heads},
        {attention}, ffn_hidden_size: {ffn}, tie_embeddings: {tie}{moe}}}
mesh: {{dp_replicate: {dr}, dp_shard: {ds}, tp: {tp}, pp: {pp}, cp: {cp}, ep: {ep}, microbatches: {mb}}}
training: {{global_batch_size: {gbs}, micro_batch_size: 2, seq_len: 32, precision: {precision}, optimizer: {opt},
           sequence_parallel: {sp}, activation_checkpointing: {ckpt}, distributed_optimizer: {dopt},
           pipeline_schedule: {schedule}}}
backend: {backend}
resources: {{devices: {world}, memory: 1TiB}}
"""


def _transformer(**fields) -> str:
    """TRANSFORMER with grouped-query attention unless ``attention`` says otherwise."""
    return TRANSFORMER.format(**{"attention": "num_kv_heads: 4", **fields})


def moe(experts: int, frequency: int) -> str:
    return f", num_experts: {experts}, experts_per_token: 1, moe_layer_frequency: {frequency}" if experts else ""


#: Multi-head Latent Attention with and without the query latent, values narrower than keys
LATENT = (
    "kv_lora_rank: 12, q_lora_rank: 10, qk_nope_head_dim: 6, qk_rope_head_dim: 4, v_head_dim: 8",
    "kv_lora_rank: 16, qk_nope_head_dim: 8, qk_rope_head_dim: 4, v_head_dim: 8",
)


def transformer_spec(rng: random.Random, latent: bool = False):
    while True:
        dr, ds, tp, pp, cp = (rng.choice(c) for c in ([1, 2], [1, 2, 4], [1, 2], [1, 1, 2, 4], [1, 1, 2]))
        experts = rng.choice([0, 0, 4])
        ep = rng.choice([e for e in (1, 2) if experts and (ds * cp * dr) % e == 0] or [1])
        mb = rng.choice([1, 4]) if pp > 1 else 1
        text = _transformer(
            vocab=rng.choice([64, 128]),
            hidden=32,
            layers=rng.choice([4, 8]),
            heads=4,
            attention=rng.choice(LATENT) if latent else "num_kv_heads: 4",
            ffn=rng.choice([64, 96]),
            tie=str(rng.random() < 0.5).lower(),
            moe=moe(experts, rng.choice([1, 2])),
            dr=dr,
            ds=ds,
            tp=tp,
            pp=pp,
            cp=cp,
            ep=ep,
            mb=mb,
            gbs=2 * mb * dr * ds,
            precision=rng.choice(["fp32", "bf16"]),
            opt=rng.choice(["sgd", "adamw"]),
            sp=str(tp > 1 and rng.random() < 0.5).lower(),
            ckpt=rng.choice(["none", "selective", "full"]),
            dopt=str(rng.random() < 0.3).lower(),
            schedule=rng.choice(["gpipe", "1f1b"]) if pp > 1 else "1f1b",
            world=dr * ds * tp * pp * cp,
            backend=rng.choice(["torch", "torchtitan"]),
        )
        loaded = load_spec_text(text, "sample.yaml")
        assert loaded.ok, [d.text() for d in loaded.diagnostics]
        return loaded.spec


def sample(count: int, seed: int, latent: bool = False):
    rng = random.Random(seed)
    return [transformer_spec(rng, latent) for _ in range(count)]


def _figures(spec):
    stages = lower(spec, schedule=False).memory
    bound = {kind: float(v) for kind, v in memory_bound(spec).items()}
    return stages, bound


@pytest.mark.parametrize(
    "spec",
    sample(60, 7) + sample(20, 11, latent=True),
    ids=lambda s: (
        f"{'mla-' if s.model.latent_attention else ''}"
        f"{s.mesh.dp_replicate}x{s.mesh.dp_shard}x{s.mesh.tp}x{s.mesh.pp}x{s.mesh.cp}"
    ),
)
def test_the_rule_bounds_the_heaviest_stage_the_lowering_prices(spec):
    stages, bound = _figures(spec)
    heaviest = max(s.total for s in stages)
    assert heaviest <= sum(bound.values()) * 1.01  # padding of shards smaller than their group
    uniform = spec.model.num_experts == 0 or spec.model.moe_layer_frequency == 1
    if spec.mesh.pp == 1 and uniform:
        (only,) = stages
        for ours, theirs in KINDS.items():
            assert getattr(only, ours) == pytest.approx(bound[theirs], rel=1e-2, abs=1), ours


def test_examples_agree_exactly_without_a_pipeline():
    for name in ("tiny-transformer.yaml", "llama3-8b-hsdp-tp.yaml", "modules-mlp.yaml"):
        spec = load_spec_text((EXAMPLES / name).read_text(), name).spec
        (stage,), bound = _figures(spec)
        assert {k: getattr(stage, k) for k in KINDS} == {k: int(bound[v]) for k, v in KINDS.items()}, name


def test_a_pipeline_bound_covers_every_stage_and_is_reached_by_the_first():
    spec = load_spec_text(
        _transformer(
            vocab=64,
            hidden=32,
            layers=8,
            heads=4,
            ffn=64,
            tie="false",
            moe="",
            dr=1,
            ds=1,
            tp=1,
            pp=4,
            cp=1,
            ep=1,
            mb=8,
            gbs=16,
            precision="fp32",
            opt="adamw",
            sp="false",
            ckpt="none",
            dopt="false",
            schedule="1f1b",
            world=4,
            backend="torch",
        ),
        "pp.yaml",
    ).spec
    stages, bound = _figures(spec)
    assert len(stages) == 4
    # 1F1B: stage s keeps min(microbatches, pp - s) micro-batches in flight, so activations fall by stage.
    acts = [s.activations for s in stages]
    assert acts[0] > acts[1] > acts[2]
    assert acts[0] <= bound["activations"] <= acts[0] + stages[-1].activations


def test_in_flight_micro_batches_follow_the_schedule():
    def flight(pp, stage, mb, gpipe=False, interleaved=False, v=1):
        return micro_batches_in_flight(
            NUMBERS,
            pp=pp,
            stage=stage,
            microbatches=mb,
            gpipe=gpipe,
            interleaved=interleaved,
            virtual_stages=v,
            group=microbatches_per_round(SCHEDULE_NUMBERS, pp, mb),
        )

    assert flight(1, 0, 8) == 1  # no pipeline: each micro-batch's backward frees it
    assert flight(4, 0, 8, gpipe=True) == 8
    assert [flight(4, s, 8) for s in range(4)] == [4, 3, 2, 1]
    assert flight(4, 0, 2) == 2
    # Narayanan et al.'s factor on the first stage when the warm-up fits in the step ...
    assert flight(4, 0, 8, interleaved=True, v=2) == pytest.approx(4 * (1 + 3 / 8))
    # ... and never more than every micro-batch of every chunk (pp 8, 8 micro-batches, 2 chunks)
    assert flight(8, 0, 8, interleaved=True, v=2) == 8
    assert [flight(4, s, 8, interleaved=True, v=2) for s in range(4)] == [5.5, 4.5, 3.5, 2.5]


def test_activation_formula_matches_korthikanti():
    s, b, h, a, t = 32, 2, 64, 4, 2

    def per_layer(**kw):
        base = dict(
            seq_len=s,
            cp=1,
            micro_batch_size=b,
            hidden_size=h,
            num_heads=a,
            tp=t,
            sequence_parallel=False,
            full_recompute=False,
            selective_recompute=False,
            fp32=False,
        )
        return activation_bytes_per_layer(NUMBERS, **{**base, **kw})

    assert per_layer() == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert per_layer(sequence_parallel=True) == pytest.approx(s * b * h / t * (34 + 5 * a * s / h))
    assert per_layer(selective_recompute=True) == pytest.approx(s * b * h * (10 + 24 / t))
    assert per_layer(full_recompute=True) == pytest.approx(2 * s * b * h)
    assert per_layer(fp32=True) == pytest.approx(2 * per_layer())
    assert per_layer(cp=2) < per_layer()


def test_the_count_by_tensor_is_korthikantis_for_gpt_shapes_and_drops_the_masks_of_a_gated_block():
    s, b, h, q, kv, f, t = 32, 2, 64, 64, 16, 160, 4
    base = dict(
        seq_len=s,
        cp=1,
        micro_batch_size=b,
        hidden_size=h,
        num_heads=4,
        tp=t,
        full_recompute=False,
        selective_recompute=False,
        fp32=False,
        eager_attention=False,
    )
    for sp in (False, True):
        gpt = activation_bytes_per_layer(
            NUMBERS, **base, sequence_parallel=sp, query_width=h, kv_width=h, dense_ffn_width=4 * h, gated=False
        )
        assert gpt == pytest.approx(activation_bytes_per_layer(NUMBERS, **base, sequence_parallel=sp))
    # a gated block with grouped keys: norms' and linears' inputs (4h), q, k, v, the attention output,
    # gate and up outputs (2F) and the last linear's input (F), two bytes each, no dropout masks
    llama = activation_bytes_per_layer(
        NUMBERS, **base, sequence_parallel=True, query_width=q, kv_width=kv, dense_ffn_width=f, gated=True
    )
    assert llama == pytest.approx(s * b * 2 * (4 * h + q + 2 * kv + q + 3 * f) / t)


LLAMA_FP8 = """\
model: {family: transformer, vocab_size: 256, hidden_size: 64, num_layers: 4, num_heads: 4, num_kv_heads: 2,
        ffn_hidden_size: 160}
mesh: {dp_replicate: 1, dp_shard: 2, tp: 2, pp: 1}
training: {global_batch_size: 4, micro_batch_size: 2, seq_len: 32, precision: PRECISION, optimizer: adamw,
           sequence_parallel: true, activation_checkpointing: CKPT}
backend: BACKEND
resources: {devices: 4, memory: 1TiB}
"""


@pytest.mark.parametrize("ckpt", ["none", "selective", "full"])
def test_transformer_engine_keeps_its_linears_fp8_inputs(ckpt):
    """Megatron's TE linears keep the fp8 copy of their inputs (the q/k/v and first MLP linear's
    normalised input and the last MLP linear's input shrink to a byte an element, the output
    projection's copy comes besides the attention output); torchtitan's float8 keeps them in 16 bits;
    full recomputation keeps the layer input alone either way. The rule prices what the lowering does."""

    def activations(backend: str, precision: str) -> float:
        text = LLAMA_FP8.replace("PRECISION", precision).replace("CKPT", ckpt).replace("BACKEND", backend)
        spec = load_spec_text(text, "llama.yaml").spec
        (stage,), bound = _figures(spec)
        assert stage.activations == int(bound["activations"])
        return stage.activations

    sb, h, q, f, t, layers = 32 * 2, 64, 64, 160, 2, 4
    saved = 0 if ckpt == "full" else layers * sb * (2 * h + f - q) / t
    assert activations("megatron", "bf16") - activations("megatron", "fp8") == pytest.approx(saved, abs=layers)
    assert activations("torchtitan", "bf16") == activations("torchtitan", "fp8")


def test_a_transformers_footprint_is_read_from_one_layer_of_each_kind():
    # Layers of one kind hold the same tensors, so two layers show both kinds: the footprint of a
    # model of 2 layers priced for L layers equals the one enumerated over all L (dense and MoE).
    from mixle_compile.parameters import is_moe_layer, model_parameters
    from mixle_compile.spec import load_spec_text
    from mixle_compile.verify.memory import _CATEGORY_OF_ROLE, CATEGORIES, ZERO, _share_of, parameter_footprint

    text = """\
model: {family: transformer, vocab_size: 96, hidden_size: 32, num_layers: 7, num_heads: 4, ffn_hidden_size: 64,
        num_experts: 4, experts_per_token: 2, moe_ffn_hidden_size: 48, moe_layer_frequency: 3}
mesh: {dp_shard: 2}
training: {global_batch_size: 2, seq_len: 16}
backend: torch
resources: {devices: 2, memory: 1GiB}
"""
    spec = load_spec_text(text, "moe.yaml").spec
    fp = parameter_footprint(spec)
    by_layer: dict = {}
    for p in model_parameters(spec):
        if p.layer is not None:
            kind = by_layer.setdefault(is_moe_layer(spec.model, p.layer), {}).setdefault(p.layer, {})
            category = _CATEGORY_OF_ROLE.get(p.role, "replicated")
            kind[category] = kind.get(category, ZERO) + _share_of(p.numel, None)
    for category in CATEGORIES:
        dense = {layer[category].elements for layer in by_layer[False].values() if category in layer}
        moe = {layer[category].elements for layer in by_layer[True].values() if category in layer}
        assert len(dense) <= 1 and len(moe) <= 1  # layers of one kind are alike
        every = fp.share("every_layer", category).elements
        assert every + fp.share("dense_layer", category).elements == (dense or {0}).pop()
        assert every + fp.share("moe_layer", category).elements == (moe or {0}).pop()


def test_check_answers_for_a_million_layers():
    from mixle_compile.check import check_loaded
    from mixle_compile.spec import load_spec_text

    text = (EXAMPLES / "tiny-transformer.yaml").read_text().replace("num_layers: 2", "num_layers: 1000000")
    assert "num_layers: 1000000" in text
    result = check_loaded(load_spec_text(text, "million.yaml"))
    assert [d.code for d in result.diagnostics if d.severity.value == "error"] == ["R001"]


LOSS_SPEC = """\
model: {{family: transformer, vocab_size: 1024, hidden_size: 64, num_layers: 2, num_heads: 4, ffn_hidden_size: 128}}
mesh: {{dp_shard: 2, tp: 2}}
training: {{global_batch_size: 4, micro_batch_size: 2, seq_len: 32, precision: {precision}, compile: {compile}}}
backend: {backend}
resources: {{devices: 4, memory: 1TiB}}
"""


@pytest.mark.parametrize(
    "backend, compile, precision, per_logit",
    [
        ("torch", "false", "bf16", 12),  # fp32 logits kept, exp(logits - lse) and the gradient beside them
        ("torchtitan", "false", "bf16", 12),  # eager F.cross_entropy(pred.float())
        ("torchtitan", "[model]", "bf16", 12),  # the model compiled, the loss not
        ("torchtitan-tp", "false", "bf16", 16),  # loss_parallel over vocabulary shards
        ("torchtitan", "true", "bf16", 4),  # compiled loss: the gradient in bf16 is the only new tensor
        ("torchtitan", "[loss]", "fp32", 8),
        ("megatron", "false", "bf16", 6),  # in-place fp32 softmax, then the gradient cast to bf16
        ("megatron", "false", "fp32", 4),
    ],
)
def test_the_loss_term_is_the_engines_cross_entropy(backend, compile, precision, per_logit):
    tp = 2 if backend.endswith("-tp") else 1
    text = LOSS_SPEC.format(backend=backend.removesuffix("-tp"), compile=compile, precision=precision)
    spec = load_spec_text(
        text.replace("tp: 2", f"tp: {tp}").replace("devices: 4", f"devices: {2 * tp}"), "loss.yaml"
    ).spec
    (stage,), bound = _figures(spec)
    logits = 2 * 32 * 1024 // tp  # micro_batch_size * seq_len * vocab / tp
    assert stage.loss == logits * per_logit
    assert bound["logits and loss"] == pytest.approx(stage.loss)


def test_the_reserve_is_a_fraction_of_every_live_byte():
    from mixle_compile.memory_model import ALLOCATOR_RESERVE, MEMORY_KINDS

    spec = load_spec_text((EXAMPLES / "llama3-8b-hsdp-tp.yaml").read_text(), "llama.yaml").spec
    (stage,), bound = _figures(spec)
    live = sum(getattr(stage, k) for k in MEMORY_KINDS if k != "reserve")
    assert 0 < ALLOCATOR_RESERVE < 0.5
    assert stage.reserve == int(live * ALLOCATOR_RESERVE)
    assert bound["allocator reserve"] == pytest.approx(stage.reserve, rel=1e-6)


def test_r001_names_the_terms_that_dominate():
    from mixle_compile.check import check_loaded
    from mixle_compile.verify.rules.memory import dominant_terms

    assert dominant_terms({"a": 1.0, "b": 5.0, "c": 4.0}) == ["b"]
    assert dominant_terms({"a": 3.0, "b": 3.0, "c": 4.0}) == ["c", "a"]
    text = LOSS_SPEC.format(backend="torchtitan", compile="false", precision="bf16").replace("1TiB", "1MiB")
    (d,) = [d for d in check_loaded(load_spec_text(text, "small.yaml")).diagnostics if d.code == "R001"]
    # optimizer state and the logits make up half of it
    assert re.search(r"; mostly optimizer state \(3\d%\) and logits and loss \(2\d%\) \(", d.message), d.message
    assert "the caching allocator usually reserves" in d.message
    torch = LOSS_SPEC.format(backend="torch", compile="false", precision="bf16").replace("1TiB", "1MiB")
    (d,) = [d for d in check_loaded(load_spec_text(torch, "small.yaml")).diagnostics if d.code == "R001"]
    assert "training.compile" not in d.message  # it does not bear on torch's memory


@pytest.mark.parametrize("backend, warned", [("torch", True), ("megatron", True), ("torchtitan", False)])
def test_compile_is_read_by_torchtitan_only(backend, warned):
    from mixle_compile.check import check_loaded

    codes = [
        d.code
        for d in check_loaded(
            load_spec_text(LOSS_SPEC.format(backend=backend, compile="true", precision="bf16"), "c.yaml")
        ).diagnostics
    ]
    assert ("C007" in codes) == warned
    assert "C007" not in [
        d.code
        for d in check_loaded(
            load_spec_text(LOSS_SPEC.format(backend=backend, compile="false", precision="bf16"), "c.yaml")
        ).diagnostics
    ]


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2)])
def test_torchtitan_prices_the_pipelines_receive_buffers(schedule, virtual):
    """torch's PipelineStage holds a receive buffer per micro-batch for activations (all stages but
    the first) and for gradients (all but the last); the in-flight ones double as stored inputs."""
    pp, mb, hidden, seq, b, tp = 4, 8, 32, 32, 2, 2
    text = _transformer(
        vocab=64,
        hidden=hidden,
        layers=8,
        heads=4,
        ffn=64,
        tie="false",
        moe="",
        dr=1,
        ds=1,
        tp=tp,
        pp=pp,
        cp=1,
        ep=1,
        mb=mb,
        gbs=b * mb,
        precision="bf16",
        opt="adamw",
        sp="true",
        ckpt="full",
        dopt="false",
        schedule=schedule,
        world=pp * tp,
        backend="torchtitan",
    ).replace("pipeline_schedule:", f"virtual_pipeline_stages: {virtual}, pipeline_schedule:")
    spec = load_spec_text(text, "pp.yaml").spec
    stages, bound = _figures(spec)
    boundary = b * seq * hidden // tp * 2  # sequence-sharded bf16 hidden states of one micro-batch
    expected = []
    for rank in range(pp):
        model_stages = [rank + k * pp for k in range(virtual)]
        count = sum(mb for s in model_stages if s > 0) + sum(mb for s in model_stages if s < pp * virtual - 1)
        if virtual == 1 and rank > 0:
            count -= mb if schedule == "gpipe" else min(mb, pp - rank)
        expected.append(count * boundary)
    assert [s.buffers for s in stages] == expected
    assert max(expected) <= bound["communication buffers"] <= max(expected) * 1.0001
    torch = load_spec_text(text.replace("backend: torchtitan", "backend: torch"), "pp.yaml").spec
    assert all(s.buffers == 0 for s in _figures(torch)[0])  # per-transfer receives, kept as the first layer's input


def test_fsdp2_reduces_the_largest_layer_through_an_fp32_copy():
    text = _transformer(
        vocab=64,
        hidden=32,
        layers=4,
        heads=4,
        ffn=64,
        tie="false",
        moe="",
        dr=1,
        ds=4,
        tp=1,
        pp=1,
        cp=1,
        ep=1,
        mb=1,
        gbs=8,
        precision="bf16",
        opt="adamw",
        sp="false",
        ckpt="none",
        dopt="false",
        schedule="1f1b",
        world=4,
        backend="torchtitan",
    )
    spec = load_spec_text(text, "fsdp.yaml").spec
    (stage,), bound = _figures(spec)
    layer = [p for p in spec_parameters(spec) if p.layer == 0]
    elements = sum(p.numel for p in layer)
    # its bf16 gradients and their fp32 copy, beyond the loss's buffers (freed by the head's backward, first)
    assert stage.loss > 0 and stage.buffers == elements * 2 + elements * 4 - stage.loss > 0
    assert bound["communication buffers"] == pytest.approx(stage.buffers)
    torch = load_spec_text(text.replace("backend: torchtitan", "backend: torch"), "fsdp.yaml").spec
    assert _figures(torch)[0][0].buffers == 0


def spec_parameters(spec):
    from mixle_compile.parameters import model_parameters

    return model_parameters(spec)


RING_SPEC = """\
model: {{family: transformer, vocab_size: 64, hidden_size: 256, num_layers: 4, num_heads: 8, num_kv_heads: 2,
        ffn_hidden_size: 512}}
mesh: {{dp_shard: 1, tp: {tp}, pp: {pp}, cp: {cp}, microbatches: {mb}}}
training: {{global_batch_size: {mb}, micro_batch_size: 1, seq_len: 1024, precision: bf16, sequence_parallel: {sp},
           activation_checkpointing: full}}
backend: {backend}
resources: {{devices: {world}, memory: 1TiB}}
"""


def ring_spec(*, backend="torchtitan", tp=1, pp=1, cp=2, mb=1):
    text = RING_SPEC.format(backend=backend, tp=tp, pp=pp, cp=cp, mb=mb, sp=str(tp > 1).lower(), world=tp * pp * cp)
    loaded = load_spec_text(text, "ring.yaml")
    assert loaded.ok, [d.text() for d in loaded.diagnostics]
    return loaded.spec


@pytest.mark.parametrize(
    "backend, tp, cp, key_heads",
    [
        ("torchtitan", 1, 2, 2),  # 0.3 by default: GQA, the two key heads exchanged as they are
        ({"name": "torchtitan", "version": "0.2"}, 1, 4, 8),  # repeat_kv: as many key heads as query heads
        ("torchtitan", 4, 2, 1),  # two key heads over tp 4: one whole head per rank
    ],
)
def test_ring_attention_prices_torchs_backward_buffers(backend, tp, cp, key_heads):
    """cp x 2k gathered keys and values and their 2k local copy in bf16, 4 fp32 bytes per query
    element, three 2k fp32 buffers of key/value gradients (k: key elements, q: query elements)."""
    import json

    from mixle_compile.lower.memory import _ring_attention

    spec = ring_spec(backend=json.dumps(backend) if isinstance(backend, dict) else backend, tp=tp, cp=cp)
    tokens = 1024 // cp
    q = tokens * 256 // tp  # 8 query heads of 32
    k = tokens * 32 * key_heads
    assert _ring_attention(spec, spec.mesh) == pytest.approx((2 * cp + 2) * k * 2 + 4 * q + 24 * k)


def test_ring_attention_is_priced_on_the_backward_after_the_loss_is_freed(monkeypatch):
    from mixle_compile.lower import memory as lowered
    from mixle_compile.memory_model import NUMBERS, after_loss_bytes

    # no context parallelism, or an engine with its own ring: nothing
    assert lowered._ring_attention(ring_spec(cp=1), ring_spec(cp=1).mesh) == 0
    assert lowered._ring_attention(ring_spec(backend="megatron"), ring_spec(backend="megatron").mesh) == 0
    assert after_loss_bytes(NUMBERS, 10.0, 4) == 6 and after_loss_bytes(NUMBERS, 10.0, 40) == 0
    # under a pipeline the first stage pays the whole ring; the last one's loss buffers (a large
    # vocabulary) are freed before any layer's backward and cover it
    spec = ring_spec(pp=2, mb=4)
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"vocab_size": 65536})})
    ring = lowered._ring_attention(spec, spec.mesh)
    first, last = lower(spec, schedule=False).memory
    assert ring > 0 and last.loss > 10 * ring
    bound = float(sum(memory_bound(spec).values()))
    monkeypatch.setattr(lowered, "_ring_attention", lambda spec, plan: 0.0)
    first_without, last_without = lower(spec, schedule=False).memory
    assert first.buffers - first_without.buffers == pytest.approx(ring, abs=1)
    assert last.buffers == last_without.buffers
    # R001's bound covers the heaviest stage
    assert max(first.total, last.total) <= bound * 1.01


def test_r002_warns_when_only_the_allocators_reserve_does_not_fit():
    from mixle_compile.check import check_loaded
    from mixle_compile.memory_model import ALLOCATOR_RESERVE

    spec = load_spec_text((EXAMPLES / "llama3-8b-hsdp-tp.yaml").read_text(), "llama.yaml").spec
    (stage,) = lower(spec, schedule=False).memory
    live = stage.total - stage.reserve
    text = (EXAMPLES / "llama3-8b-hsdp-tp.yaml").read_text()
    memory = re.search(r"memory: (\S+)", text).group(1)

    def codes(device_bytes: int) -> dict[str, str]:
        changed = text.replace(f"memory: {memory}", f"memory: {device_bytes}B")
        found = check_loaded(load_spec_text(changed, "llama.yaml")).diagnostics
        return {d.code: d.severity.value for d in found if d.code in ("R001", "R002")}

    assert codes(int(live * (1 + ALLOCATOR_RESERVE)) + 2**20) == {}
    assert codes(int(live * (1 + ALLOCATOR_RESERVE / 2))) == {"R002": "warning"}
    assert codes(int(live * 0.99)) == {"R001": "error"}  # the error alone is reported


MOE_SPEC = """\
model: {{family: transformer, vocab_size: 256, hidden_size: 64, num_layers: 4, num_heads: 4, ffn_hidden_size: 192{moe}}}
mesh: {{dp_shard: 2, tp: {tp}, ep: {ep}, etp: {etp}}}
training: {{global_batch_size: 4, micro_batch_size: 2, seq_len: 128, precision: bf16, sequence_parallel: {sp},
           activation_checkpointing: {ckpt}}}
backend: {backend}
resources: {{devices: {world}, memory: 1TiB}}
"""


def moe_fields(experts, capacity=None):
    if not experts:
        return "" if capacity is None else f", expert_capacity_factor: {capacity}"
    fields = f", num_experts: {experts}, experts_per_token: 2, moe_ffn_hidden_size: 96, moe_layer_frequency: 2"
    return fields + ("" if capacity is None else f", expert_capacity_factor: {capacity}")


def moe_spec(*, backend="megatron", experts=8, tp=1, etp=1, ckpt="none", capacity=None):
    text = MOE_SPEC.format(
        moe=moe_fields(experts, capacity),
        ep=2 if experts else 1,
        tp=tp,
        etp=etp,
        sp=str(tp > 1).lower(),
        ckpt=ckpt,
        backend=backend,
        world=2 * tp,
    )
    loaded = load_spec_text(text, "moe.yaml")
    assert loaded.ok, [d.text() for d in loaded.diagnostics]
    return loaded.spec


def _stage(spec):
    (stage,) = lower(spec, schedule=False).memory
    return stage


@pytest.mark.parametrize(
    "backend, tp, etp, per_routed, per_token",
    [
        # Megatron-Core: fc1's input 2h, its SwiGLU output 4F, the activation's output 2F, a fp32 weight;
        # the router's bf16 logits and fp32 softmax (6 bytes an expert)
        ("megatron", 1, 1, 2 * 64 + 6 * 96 + 4, 6 * 8),
        # etp = 2 gathers the tp ranks' tokens: twice the routed tokens, half of each expert
        ("megatron", 2, 2, 2 * 64 + 6 * 48 + 4, 6 * 8),
        ("megatron", 2, 1, 2 * 64 + 6 * 96 + 4, 6 * 8),
        # torchtitan: the routed input 2h and its fp32 output 4h, 8F around SwiGLU, a fp32 score;
        # the router's fp32 input 4h and fp32 scores before and after the sigmoid (8 an expert)
        ("torchtitan", 1, 1, 6 * 64 + 8 * 96 + 4, 4 * 64 + 8 * 8),
    ],
)
def test_an_moe_layer_keeps_its_blocks_tensors_for_the_tokens_after_dispatch(backend, tp, etp, per_routed, per_token):
    """The MoE layers' activations replace the dense MLP's share (its tensors, counted by width) with
    what the engine's MoE block saves for the tokens the rank holds after dispatch."""
    spec = moe_spec(backend=backend, tp=tp, etp=etp)
    dense = moe_spec(backend=backend, tp=tp, etp=etp, experts=0)
    tokens = 128 * 2 // tp  # sequence parallelism shards the block's tokens over tp
    routed = tokens * 2 * etp  # top-2, the expert-tensor-parallel ranks' tokens gathered
    # the dense MLP's share it replaces: fc1's input 2h, its gated outputs 4F and fc2's input 2F (F = 192)
    extra = routed * per_routed + tokens * per_token - (2 * 64 + 6 * 192) * 128 * 2 // tp
    moe_layers = 2  # layers 0 and 2 of 4
    assert _stage(spec).activations - _stage(dense).activations == pytest.approx(moe_layers * extra, abs=2)
    # R001 prices the same (one formula set): a stage without a pipeline is its heaviest rank
    assert float(memory_bound(spec)["activations"]) == pytest.approx(_stage(spec).activations, abs=2)


def test_a_capacity_factor_scales_the_routed_tokens():
    base = _stage(moe_spec()).activations
    capped = _stage(moe_spec(capacity=1.5)).activations
    routed = 128 * 2 * 2  # tokens x top-2
    assert capped - base == pytest.approx(2 * 0.5 * routed * (2 * 64 + 6 * 96 + 4), abs=2)
    assert float(memory_bound(moe_spec(capacity=1.5))["activations"]) == pytest.approx(capped, abs=2)


@pytest.mark.parametrize("backend, ckpt", [("megatron", "full"), ("torchtitan", "full"), ("torchtitan", "selective")])
def test_checkpointing_that_recomputes_the_moe_block_keeps_none_of_it(backend, ckpt):
    """Full checkpointing keeps the layer's input only; torchtitan's op-level selective policy keeps
    its matmul outputs (which count the routed tokens' widest MLP already). The layer being
    recomputed then holds the MoE block once more."""
    spec, dense = moe_spec(backend=backend, ckpt=ckpt), moe_spec(backend=backend, ckpt=ckpt, experts=0)
    extra = _stage(moe_spec(backend=backend)).activations - _stage(moe_spec(backend=backend, experts=0)).activations
    assert _stage(spec).activations == _stage(dense).activations
    assert _stage(spec).recompute - _stage(dense).recompute == pytest.approx(extra / 2, abs=2)  # one MoE layer
    bound = memory_bound(spec)
    assert float(bound["recompute working set"]) == pytest.approx(_stage(spec).recompute, abs=2)


def test_megatron_keeps_the_moe_block_under_its_selective_checkpointing():
    spec, plain = moe_spec(ckpt="selective"), moe_spec()
    assert _stage(spec).activations == _stage(plain).activations  # flash attention: nothing more to drop
    assert _stage(spec).recompute == 0


def test_only_megatron_takes_a_capacity_factor():
    from mixle_compile.check import check_text

    for backend, refused in (("torchtitan", True), ("torch", True), ("megatron", False)):
        text = MOE_SPEC.format(
            moe=moe_fields(8, 1.25), ep=2, tp=1, etp=1, sp="false", ckpt="none", backend=backend, world=2
        )
        codes = {d.code for d in check_text(text.encode(), "moe.yaml").diagnostics}
        assert ("E011" in codes) == refused, backend
    dense = MOE_SPEC.format(
        moe=moe_fields(0, 1.25), ep=1, tp=1, etp=1, sp="false", ckpt="none", backend="megatron", world=2
    )
    loaded = load_spec_text(dense, "dense.yaml")
    assert not loaded.ok
    assert any("expert_capacity_factor" in d.text() for d in loaded.diagnostics)


@pytest.mark.parametrize(
    "micro_batch,checkpointing,fits",
    [(1, "selective", True), (2, "selective", False), (2, "full", True)],
)
def test_the_memory_rule_draws_torchtitans_published_out_of_memory_line(micro_batch, checkpointing, fits):
    """torchtitan docs/performance.md (64 A100 80GB, FSDP 64, Llama 2 70B at 4,096 tokens): with
    selective op checkpointing micro-batch 2 ran out of memory (its footnote 1), so the table reports
    micro-batch 1; full checkpointing ran at micro-batch 2. R001 refuses exactly the run that failed."""
    from mixle_compile.check import check_loaded

    text = f"""
model: {{family: transformer, vocab_size: 32000, hidden_size: 8192, num_layers: 80, num_heads: 64,
        num_kv_heads: 8, ffn_hidden_size: 28672, tie_embeddings: false}}
mesh: {{dp_shard: 64}}
training: {{global_batch_size: {64 * micro_batch}, micro_batch_size: {micro_batch}, seq_len: 4096,
           precision: bf16, activation_checkpointing: {checkpointing}}}
backend: {{name: torchtitan, version: "0.2"}}
resources: {{devices: 64, kind: a100, memory: 80GiB}}
"""
    result = check_loaded(load_spec_text(text, "llama2-70b.yaml"))
    assert any(d.code == "R001" for d in result.diagnostics) != fits, [d.text() for d in result.diagnostics]


#: One layer's shape and checkpointing (memory_model.activation_bytes_per_layer's arguments)
LAYER = dict(
    seq_len=1024,
    cp=1,
    micro_batch_size=2,
    hidden_size=256,
    num_heads=4,
    tp=2,
    full_recompute=False,
    selective_recompute=True,
    fp32=False,
    eager_attention=False,
    gated=True,
    dense_ffn_width=512,
)

#: An MoE block of Megatron's saved tensors (memory_model.moe_layer_extra_bytes' arguments)
MOE_BLOCK = dict(
    seq_len=1024,
    cp=1,
    micro_batch_size=2,
    hidden_size=256,
    tp=2,
    etp=1,
    experts_per_token=8,
    num_experts=8,
    expert_width=128,
    capacity_factor=1.0,
    saved=MoESaved(2, 6, 4, 0, 6),
    fp32=False,
    dense_ffn_width=512,
    gated=True,
)


@pytest.mark.parametrize("sp", [False, True])
def test_a_shared_expert_keeps_a_dense_mlps_tensors_for_every_token(sp):
    from mixle_compile.memory_model import moe_layer_extra_bytes

    base = dict(MOE_BLOCK, sequence_parallel=sp)
    without = moe_layer_extra_bytes(NUMBERS, **base)
    shared = moe_layer_extra_bytes(NUMBERS, **base, shared_width=384)
    assert without > 0  # the block already outweighs the dense MLP it replaces: the difference is the shared one
    tokens, h = 1024 * 2, 256
    # its first linear's input (a sequence shard under sequence parallelism) and its three widths, over tp
    first_input = 2 * h / 2 if sp else 2 * h
    assert shared - without == pytest.approx(tokens * (first_input + 6 * 384 / 2))


def test_latent_attention_keeps_its_latents_and_heads_at_their_own_widths():
    """DeepSeek-V3's layer: the latents' norms' inputs and the up projections' inputs (h-like, over tp under
    sequence parallelism), and queries, keys, values and attention output at 192, 192, 128 and 128 features a
    head (over tp), in place of grouped-query attention's widths."""
    from mixle_compile.verify.memory import activation_widths
    from tests.test_step_time import DEEPSEEK_V3

    model = TransformerModel.model_validate(DEEPSEEK_V3)
    widths = activation_widths(model)
    assert widths["attention_width"] == 128 * (192 + 192 + 128 + 128)
    assert widths["latent_width"] == (1536 + 512 + 64) + (1536 + 512)
    for sp in (False, True):
        common = dict(
            LAYER,
            seq_len=4096,
            micro_batch_size=1,
            hidden_size=7168,
            num_heads=128,
            tp=4,
            sequence_parallel=sp,
            dense_ffn_width=18432,
            query_width=widths["query_width"],
        )
        latent = activation_bytes_per_layer(
            NUMBERS, **common, attention_width=widths["attention_width"], latent_width=widths["latent_width"]
        )
        plain = activation_bytes_per_layer(NUMBERS, **common, kv_width=widths["kv_width"])
        # grouped-query attention's count with these widths keeps q + 2 kv + q = 4 * 128 * 192 a token
        tokens = 4096
        per_token = 2 * (widths["latent_width"] / (4 if sp else 1) + 128 * (128 + 128 - 2 * 192) / 4)
        assert latent - plain == pytest.approx(tokens * per_token)

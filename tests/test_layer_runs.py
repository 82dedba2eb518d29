"""A transformer's runs of blocks that lower alike are lowered once each (lower/runs.py).

The oracle is the lowering of every block one by one: the plan built from the runs must be the
same bytes, and memory, traffic and the predicted step time the same figures, on the examples, on a
sample of the production corpus and on generated specs covering pipelines (even, engine and listed
splits, virtual stages, every schedule), mixtures of experts every k-th block, tied embeddings,
grouped KV heads, every data axis, the distributed optimizer and accumulation.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from mixle_compile.check import check_loaded
from mixle_compile.layer_split import split_layers
from mixle_compile.lower.lowering import lower
from mixle_compile.lower.runs import transformer_runs
from mixle_compile.parameters import is_moe_layer, same_kind_until
from mixle_compile.plan import build_plan, plan_text
from mixle_compile.spec import load_spec, load_spec_text
from mixle_compile.spec.models import TransformerModel
from mixle_compile.step_time import NoPrediction, predict_lowered

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "corpus" / "production"

# Chosen to cover what the runs depend on: pipelines with virtual stages and torchtitan's uneven split,
# mixtures of experts every block and every other block, context parallelism, tied embeddings.
CORPUS_SAMPLE = (
    "torchtitan/llama3_8b_64gpu_fsdp8_tp2_cp2_pp2_interleaved1f1b_fp8.yaml",
    "torchtitan/llama3_405b_512gpu_fsdp8_tp8_pp8_1f1b.yaml",
    "torchtitan/qwen3_1.7b_8gpu_fsdp8_tied.yaml",
    "megatron_lm/mixtral_8x7b_tp1_pp4_ep8_32gpu.yaml",
    "megatron_lm/sc21_table1_1t.yaml",
    "bridge_nemo/nemo_deepseek_v3_recipe.yaml",
)


def _both(loaded):
    checked = check_loaded(loaded, group=False)
    assert not checked.errors, [d.text() for d in checked.diagnostics]
    diagnostics = list(checked.diagnostics)
    stated = lower(loaded.spec, document=loaded.document)
    each = lower(loaded.spec, document=loaded.document, each_layer=True)
    return stated, each, diagnostics


def _assert_same(loaded) -> None:
    stated, each, diagnostics = _both(loaded)
    spec = loaded.spec
    assert stated.memory == each.memory
    assert stated.traffic == each.traffic
    assert plan_text(build_plan(spec, stated, diagnostics)) == plan_text(build_plan(spec, each, diagnostics))
    try:
        a, b = predict_lowered(spec, stated), predict_lowered(spec, each)
    except NoPrediction:  # a device without a known peak: no step time to compare
        return
    assert a.seconds == pytest.approx(b.seconds, rel=1e-12)
    assert a.exposed_communication == pytest.approx(b.exposed_communication, rel=1e-12)


def _examples():
    out = []
    for path in sorted((ROOT / "examples").rglob("*.yaml")):
        loaded = load_spec(path)
        if loaded.spec is not None and loaded.spec.model.family == "transformer":
            if not check_loaded(loaded, group=False).errors:
                out.append(path)
    return out


@pytest.mark.parametrize("path", _examples(), ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_examples_compile_to_the_same_plan_from_runs(path):
    _assert_same(load_spec(path))


@pytest.mark.parametrize("name", CORPUS_SAMPLE)
def test_production_specs_compile_to_the_same_plan_from_runs(name):
    _assert_same(load_spec(CORPUS / name))


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(CORPUS.rglob("*.yaml")), ids=lambda p: p.stem)
def test_every_production_spec_compiles_to_the_same_plan_from_runs(path):
    loaded = load_spec(path)
    if loaded.spec.model.family != "transformer" or check_loaded(loaded, group=False).errors:
        pytest.skip("not a transformer spec that checks")
    _assert_same(loaded)


SPEC = """\
model: {{family: transformer, vocab_size: {vocab}, hidden_size: 32, num_layers: {layers}, num_heads: 4,
        num_kv_heads: {kv}, ffn_hidden_size: 64, tie_embeddings: {tie}{moe}}}
mesh: {{dp_replicate: {dr}, dp_shard: {ds}, tp: {tp}, pp: {pp}, cp: {cp}, ep: {ep}, microbatches: {mb},
       gradient_accumulation_steps: {gas}}}
training: {{global_batch_size: {gbs}, micro_batch_size: 1, seq_len: 32, precision: bf16, optimizer: adamw,
           sequence_parallel: {sp}, distributed_optimizer: {dopt}, pipeline_schedule: {schedule},
           virtual_pipeline_stages: {virtual}{pipeline_layers}}}
backend: {backend}
resources: {{devices: {world}, memory: 1TiB, kind: h100}}
"""


def _generated(rng: random.Random, large: bool = False):
    """A spec that checks, drawn over the settings the runs depend on; ``large``: on more than 16
    ranks, where the lowering lists alike stages once (lower/runs.py)."""
    for _ in range(200):
        pp = rng.choice([1, 2, 3, 4])
        virtual = rng.choice([1, 2]) if pp > 1 else 1
        schedule = "interleaved_1f1b" if virtual > 1 else rng.choice(["gpipe", "1f1b"] if pp > 1 else ["1f1b"])
        layers = rng.randint(max(1, pp * virtual), 24)
        dr, ds, tp, cp = (rng.choice(c) for c in ([1, 2], [1, 2], [1, 2], [1, 1, 2]))
        if large:
            dr *= 16
        experts = rng.choice([0, 0, 4])
        ep = rng.choice([e for e in (1, 2) if experts and (dr * ds * cp) % e == 0] or [1])
        mb = rng.choice([pp, 2 * pp]) if pp > 1 else 1
        gas = rng.choice([1, 2])
        backend = rng.choice(["torch", "torchtitan", "megatron"])
        listed = ""
        if pp > 1 and rng.random() < 0.3:
            stages = pp * virtual
            cuts = sorted(rng.sample(range(1, layers), stages - 1)) if layers >= stages else []
            if len(cuts) == stages - 1:
                counts = [b - a for a, b in zip([0, *cuts], [*cuts, layers], strict=True)]
                listed = f", pipeline_layers: {counts}"
        text = SPEC.format(
            vocab=rng.choice([64, 128]),
            layers=layers,
            kv=rng.choice([1, 2, 4]),
            tie=str(rng.random() < 0.4).lower(),
            moe=(
                f", num_experts: {experts}, experts_per_token: 1, moe_layer_frequency: {rng.choice([1, 2, 3])}"
                if experts
                else ""
            ),
            dr=dr,
            ds=ds,
            tp=tp,
            pp=pp,
            cp=cp,
            ep=ep,
            mb=mb,
            gas=gas,
            gbs=mb * gas * dr * ds,
            sp=str(tp > 1 and rng.random() < 0.5).lower(),
            dopt=str(rng.random() < 0.3).lower(),
            schedule=schedule,
            virtual=virtual,
            pipeline_layers=listed,
            backend=backend,
            world=dr * ds * tp * pp * cp,
        )
        loaded = load_spec_text(text, "generated.yaml")
        if loaded.spec is not None and not check_loaded(loaded, group=False).errors:
            return loaded
    raise AssertionError("no generated spec checks in 200 draws")


def _sample(count: int, seed: int, large: bool = False):
    rng = random.Random(seed)
    return [_generated(rng, large) for _ in range(count)]


@pytest.mark.parametrize("loaded", _sample(40, 11), ids=lambda loaded: loaded.spec.mesh.model_dump_json()[:60])
def test_generated_specs_compile_to_the_same_plan_from_runs(loaded):
    _assert_same(loaded)


LARGE = _sample(30, 12, large=True)


@pytest.mark.parametrize("loaded", LARGE, ids=lambda loaded: loaded.spec.mesh.model_dump_json()[:60])
def test_generated_large_specs_compile_to_the_same_plan_from_stages_listed_once(loaded):
    _assert_same(loaded)


def test_the_large_sample_lists_stages_once():
    listed = [lower(loaded.spec, schedule=False).layer_runs for loaded in LARGE]
    assert sum(bool(runs.repeats) for runs in listed) >= 8


def test_runs_are_the_blocks_of_one_virtual_stage_and_one_kind():
    model = TransformerModel.model_validate(
        dict(family="transformer", vocab_size=64, hidden_size=32, num_layers=10, num_heads=4, ffn_hidden_size=64)
        | dict(num_experts=4, experts_per_token=1, moe_layer_frequency=3)
    )
    split = split_layers(10, 2, 1, None, "torch")  # 5 and 5 blocks; experts in blocks 0, 3, 6 and 9
    runs = transformer_runs(model, split)
    assert dict(runs.counts) == {0: 1, 1: 2, 3: 1, 4: 1, 5: 1, 6: 1, 7: 2, 9: 1}
    assert not runs.repeats  # a stage of several runs is listed on its own
    dense = model.model_copy(update={"num_experts": 0})
    torchtitan = split_layers(126, 8, 1, None, "torchtitan")  # 15, 16 x 6, 15
    each_stage = transformer_runs(dense, torchtitan, fold_stages=False)
    assert dict(each_stage.counts) == {0: 15, **{15 + 16 * i: 16 for i in range(6)}, 111: 15}
    assert not each_stage.repeats
    # the six stages of 16 blocks are one run repeated; the first and last stages hold 15 each
    folded = transformer_runs(dense, torchtitan)
    assert dict(folded.counts) == {0: 15, 15: 16, 111: 15} and dict(folded.repeats) == {15: 6}
    assert folded.on_stages(15, 1) == range(1, 7) and folded.on_stages(0, 0) == range(0, 1)
    assert folded.on_stages(None, 7) == range(7, 8)


@pytest.mark.parametrize("experts", [0, 4])
@pytest.mark.parametrize("frequency", [1, 2, 3, 5])
def test_a_run_of_one_kind_ends_where_the_layer_by_layer_rule_ends_it(experts, frequency):
    model = TransformerModel.model_validate(
        dict(family="transformer", vocab_size=64, hidden_size=32, num_layers=40, num_heads=4, ffn_hidden_size=64)
        | (dict(num_experts=experts, experts_per_token=1, moe_layer_frequency=frequency) if experts else {})
    )
    for end in range(1, 41):
        for first in range(end):
            last = first + 1
            while last < end and is_moe_layer(model, last) == is_moe_layer(model, first):
                last += 1
            assert same_kind_until(model, first, end) == last, (first, end)


def test_stages_repeat_within_a_chunk_only():
    model = TransformerModel.model_validate(
        dict(family="transformer", vocab_size=64, hidden_size=32, num_layers=16, num_heads=4, ffn_hidden_size=64)
    )
    # virtual stages 0..3 of 4 blocks: chunk 0 on stages 0 and 1, then chunk 1 on stages 0 and 1
    runs = transformer_runs(model, split_layers(16, 2, 2, None, "torch"))
    assert dict(runs.counts) == {0: 4, 8: 4} and dict(runs.repeats) == {0: 2, 8: 2}
    # uneven stages (a listed split) repeat only where they hold as many blocks
    runs = transformer_runs(model, split_layers(16, 4, 1, [4, 4, 5, 3], "torch"))
    assert dict(runs.counts) == {0: 4, 8: 5, 13: 3} and dict(runs.repeats) == {0: 2}


def test_a_compile_lists_one_block_of_each_run():
    loaded = load_spec(ROOT / "examples" / "llama3-8b-hsdp-tp.yaml")
    stated, each, _ = _both(loaded)
    assert {p.parameter.layer for p in stated.parameters} == {None, 0}
    assert {p.parameter.layer for p in each.parameters} == {None, *range(loaded.spec.model.num_layers)}
    assert stated.count(0) == loaded.spec.model.num_layers and stated.count(None) == 1

"""What `check` accepts, `compile` builds: a property over the whole spec space.

Specs are generated over every engine profile (torch, torchtitan 0.2/0.3, Megatron 0.15/0.16 by
either front end), every schedule, virtual stages, micro-batches and accumulation steps, context,
tensor, sequence and expert parallelism, uneven and listed layer splits and tied embeddings. For
each one `check` accepts, `compile` must build a plan: no lowering refusal (L003) and no internal
error. Where `check` refuses, `compile` refuses with the same errors.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mixle_compile.check import check_loaded
from mixle_compile.compile import compile_loaded
from mixle_compile.diagnostics import Severity
from mixle_compile.spec import load_spec_text

BACKENDS = [
    "torch",
    {"name": "torchtitan", "version": "0.2"},
    {"name": "torchtitan", "version": "0.3"},
    "megatron",
    {"name": "megatron", "version": "0.15", "entry": "core"},
]


@st.composite
def specs(draw) -> str:
    pp = draw(st.sampled_from([1, 1, 2, 3, 4]))
    tp = draw(st.sampled_from([1, 2, 4]))
    cp = draw(st.sampled_from([1, 1, 2]))
    dp_shard = draw(st.sampled_from([1, 2]))
    dp_replicate = draw(st.sampled_from([1, 1, 2]))
    virtual = draw(st.sampled_from([1, 1, 2, 3])) if pp > 1 else 1
    layers = draw(st.integers(min_value=1, max_value=12))
    experts = draw(st.sampled_from([0, 0, 4]))
    ep = draw(st.sampled_from([1, 2])) if experts else 1
    microbatches = draw(st.integers(min_value=1, max_value=9))
    accumulation = draw(st.sampled_from([1, 1, 2, 3]))
    micro_batch = draw(st.sampled_from([1, 2]))
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b"]))
    split = draw(st.sampled_from([None, None, "even", "listed"]))
    model = {
        "family": "transformer",
        "vocab_size": 64 * draw(st.sampled_from([1, 3])),
        "hidden_size": 32,
        "num_layers": layers,
        "num_heads": 4,
        "num_kv_heads": draw(st.sampled_from([1, 2, 4])),
        "ffn_hidden_size": 64,
        "tie_embeddings": draw(st.booleans()),
    }
    if experts:
        model.update(num_experts=experts, experts_per_token=2, moe_ffn_hidden_size=32)
    training = {
        "global_batch_size": micro_batch * microbatches * accumulation * dp_replicate * dp_shard,
        "micro_batch_size": micro_batch,
        "seq_len": draw(st.sampled_from([16, 24, 32])),
        "precision": draw(st.sampled_from(["fp32", "bf16"])),
        "optimizer": "adamw",
        "sequence_parallel": draw(st.booleans()),
        "pipeline_schedule": schedule,
        "virtual_pipeline_stages": virtual,
        "activation_checkpointing": draw(st.sampled_from(["none", "selective", "full"])),
        "attention": draw(st.sampled_from([None, "flash", "eager"])),
        "distributed_optimizer": draw(st.booleans()),
    }
    if split == "listed":
        stages = pp * virtual
        cuts = sorted(draw(st.lists(st.integers(0, layers), min_size=stages - 1, max_size=stages - 1)))
        bounds = [0, *cuts, layers]
        training["pipeline_layers"] = [bounds[i + 1] - bounds[i] for i in range(stages)]
    elif split:
        training["pipeline_layers"] = split
    training = {k: v for k, v in training.items() if v is not None}
    mesh = {
        "dp_replicate": dp_replicate,
        "dp_shard": dp_shard,
        "tp": tp,
        "pp": pp,
        "cp": cp,
        "ep": ep,
        "etp": draw(st.sampled_from([1, tp])),
        "microbatches": microbatches,
        "gradient_accumulation_steps": accumulation,
    }
    world = dp_replicate * dp_shard * tp * pp * cp
    spec = {
        "model": model,
        "mesh": mesh,
        "training": training,
        "backend": draw(st.sampled_from(BACKENDS)),
        "resources": {"devices": world, "memory": "4GiB"},
    }
    return json.dumps(spec)


def check_accepts_compiles(text):
    loaded = load_spec_text(text, "generated.json", json_syntax=True)
    checked = check_loaded(loaded)
    result = compile_loaded(loaded)  # never raises: a lowering refusal is a diagnostic
    errors = [d for d in result.check.diagnostics if d.severity is Severity.error]
    event("accepted" if checked.errors == 0 else "refused")
    if checked.errors == 0:
        assert result.plan is not None and not errors, [d.text() for d in errors]
    else:
        assert result.plan is None and {d.code for d in errors} == {
            d.code for d in checked.diagnostics if d.severity is Severity.error
        }


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=specs())
def test_every_spec_check_accepts_compiles(text):
    check_accepts_compiles(text)


@pytest.mark.slow
@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=specs())
def test_every_spec_check_accepts_compiles_sweep(text):
    check_accepts_compiles(text)


RELAXED_INTERLEAVED = """\
model: {family: transformer, vocab_size: 256, hidden_size: 64, num_layers: 8, num_heads: 4, ffn_hidden_size: 128}
mesh: {pp: 4, microbatches: 10}
training: {global_batch_size: 10, seq_len: 32, pipeline_schedule: interleaved_1f1b, virtual_pipeline_stages: 2, \
precision: fp32}
backend: torch
resources: {devices: 4, memory: 1GiB}
"""


def test_torchs_relaxed_interleaved_schedule_compiles():
    # torch runs 2 rounds of 5 micro-batches over 4 stages (not a multiple of pp): check accepted it
    # and compile used to refuse it as an internal error. Its order only runs with sends that do not
    # block their stage, as torch's pipelining runtime issues them.
    loaded = load_spec_text(RELAXED_INTERLEAVED, "interleaved.yaml")
    result = compile_loaded(loaded)
    assert result.plan is not None, [d.text() for d in result.check.diagnostics]
    schedule = result.plan["schedule"]
    assert schedule["check"]["ok"] and schedule["sends"] == "buffered" and schedule["micro_steps"] == 10

"""Plans replayed on real process groups (gloo, CPU): accounting exact, evidence against one process.

Every case runs the plan's ranks as processes, trains a few steps, repeats the run for determinism,
trains the same model in one process on the same global batches, and checks:

- planned == observed: every update's count and bytes on every rank (the report's accounting);
- every planned update executed and carries evidence, bitwise deterministic on the repeat;
- the relative error against the reference is within a bound that a replay error would break (a
  missed or doubled reduction, a wrong divisor or slice is off by 1e-1 or more): SGD in fp32 agrees
  to rounding, AdamW amplifies rounding in near-zero gradients, bf16 rounds every activation;
- receipts: one per step, the all-reduced global counts, and the planned bytes per step.
"""

from __future__ import annotations

import json

import pytest

from mixle_compile.runtime import run_plan
from mixle_compile.runtime.instructions import read_instructions
from tests.conftest import EXAMPLES
from tests.test_runtime_support import compile_text, plan_for, spec_text

BOUND = {"sgd": 1e-5, "adamw": 1e-3, "bf16": 1e-1}

CASES = {
    "ddp-accumulation": dict(dr=2, gas=2),
    "fsdp-microbatches-accumulation": dict(ds=2, mb=2, gas=2, optimizer="adamw", lr=1e-3),
    "hsdp": dict(dr=2, ds=2),
    "tp-layernorm-gelu-learned-untied": dict(tp=2, tie=False, norm="layernorm", activation="gelu", position="learned"),
    "tp-sequence-parallel": dict(tp=2, sp=True, kv_heads=4, activation="relu"),
    "fsdp-tp-sp-accumulation": dict(ds=2, tp=2, sp=True, gas=2, optimizer="adamw", lr=1e-3),
    "distributed-optimizer-tp-sp": dict(dr=2, tp=2, sp=True, dopt=True, optimizer="adamw", lr=1e-3),
    "fsdp-tp-bf16": dict(ds=2, tp=2, precision="bf16", optimizer="adamw", lr=1e-3),
    "fsdp-uneven-shards": dict(ds=3),
    # Fewer KV heads than tp ranks: each KV head is held by tp / num_kv_heads ranks.
    "tp4-shared-kv-heads": dict(tp=4, kv_heads=2),
    "fsdp-tp2-one-kv-head-accumulation": dict(ds=2, tp=2, kv_heads=1, gas=2, optimizer="adamw", lr=1e-3),
    # Context parallelism: K and V gathered over cp, gradients reduced over cp with the data axes.
    "cp2": dict(cp=2),
    "fsdp-cp2-accumulation": dict(ds=2, cp=2, gas=2, optimizer="adamw", lr=1e-3),
    "tp2-cp2-sequence-parallel": dict(tp=2, cp=2, sp=True),
}

SLOW_CASES = {
    "hsdp-tp-sp-8": dict(dr=2, ds=2, tp=2, sp=True, optimizer="adamw", lr=1e-3),
    "fsdp4-tp2-8": dict(ds=4, tp=2, gas=2),
    "ddp4-distributed-optimizer-tp2-8": dict(dr=4, tp=2, dopt=True),
    "fsdp8": dict(ds=8, optimizer="adamw", lr=1e-3),
    "hsdp-uneven-6": dict(dr=2, ds=3, optimizer="adamw", lr=1e-3),
    "distributed-optimizer-uneven-3": dict(dr=3, dopt=True, gas=2),
    "tp4-one-kv-head-sp": dict(tp=4, kv_heads=1, sp=True),
    "hsdp-tp2-one-kv-head-sp-8": dict(dr=2, ds=2, tp=2, kv_heads=1, sp=True, optimizer="adamw", lr=1e-3),
    "distributed-optimizer-tp2-one-kv-head-sp": dict(
        dr=2, tp=2, kv_heads=1, sp=True, dopt=True, optimizer="adamw", lr=1e-3
    ),
    "cp4": dict(cp=4),
    "ddp-tp2-cp2-one-kv-head-8": dict(dr=2, tp=2, cp=2, kv_heads=1),
    "tp2-cp2-layernorm-gelu-learned-untied": dict(
        tp=2, cp=2, tie=False, norm="layernorm", activation="gelu", position="learned"
    ),
    "distributed-optimizer-cp2-bf16": dict(dr=2, cp=2, dopt=True, precision="bf16", optimizer="adamw", lr=1e-3),
}


def replay(tmp_path, steps=3, **kwargs):
    doc = plan_for(**kwargs)
    report = run_plan(doc, steps=steps, out_dir=tmp_path, reference=True, progress=False, timeout_s=90)
    return doc, report


def check_replay(tmp_path, kwargs):
    doc, report = replay(tmp_path, **kwargs)
    assert report.ok, report.errors
    assert report.accounting_ok and report.updates_checked == len(doc.updates) > 0
    assert len(report.collective_calls_per_rank) == read_instructions(doc).plan.world_size
    evidence = {u.node_id: u for u in report.evidence}
    assert set(evidence) == {u.node_id for u in doc.updates}
    for u in evidence.values():
        assert u.numerics_sample_count > 0 and u.determinism_observed is True, u.node_id
        assert u.numerics_evidence_id.endswith(u.node_id)
    bound = BOUND["bf16" if kwargs.get("precision") == "bf16" else kwargs.get("optimizer", "sgd")]
    assert report.max_relative_error <= bound, sorted(evidence.values(), key=lambda u: -u.maximum_relative_error)[:3]
    receipts = [json.loads(line) for line in report.receipts_path.read_text().splitlines()]
    spec = read_instructions(doc)
    planned_bytes = sum(u.payload_bytes * u.occurrences_per_step for u in doc.updates)
    assert [r["step"] for r in receipts] == list(range(report.steps))
    for r in receipts:
        assert r["global_examples_observed"] == spec.global_batch_size
        assert r["global_tokens_observed"] == spec.global_batch_size * spec.seq_len
        assert r["collective_bytes"] == planned_bytes and not r["skipped"]
    return report


@pytest.mark.parametrize("case", list(CASES))
def test_replay_matches_plan_and_reference(tmp_path, case):
    check_replay(tmp_path, CASES[case])


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SLOW_CASES))
def test_replay_matches_plan_and_reference_on_eight_ranks(tmp_path, case):
    check_replay(tmp_path, SLOW_CASES[case])


def test_the_quickstart_compiles_verifies_and_trains(tmp_path):
    report = run_plan(EXAMPLES / "tiny-transformer.yaml", out_dir=tmp_path, progress=False)
    assert report.ok and report.accounting_ok, report.errors
    assert report.steps == 20 and report.world_size == 4
    assert report.losses[-1] < report.losses[0] - 0.3  # the synthetic walk is learnable
    receipts = [json.loads(line) for line in report.receipts_path.read_text().splitlines()]
    assert len(receipts) == 20 and {r["global_tokens_observed"] for r in receipts} == {8 * 32}
    assert json.loads(report.report_path.read_text())["plan"]["factorisation"].startswith(
        "dp_replicate=1 * dp_shard=2 * tp=2"
    )


def test_what_the_runtime_does_not_apply_is_reported(tmp_path):
    text = spec_text(dr=2).replace("steps: 3}", "steps: 3, activation_checkpointing: full}")
    report = run_plan(compile_text(text), steps=1, out_dir=tmp_path, progress=False)
    assert report.ok and any("activation_checkpointing='full' is not applied" in w for w in report.warnings)
    assert "warning: training.activation_checkpointing" in report.summary()


def test_training_on_a_token_file(tmp_path):
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(" ".join(str((7 * i) % 128) for i in range(4000)))
    report = run_plan(plan_for(dr=2), steps=2, out_dir=tmp_path / "run", data_path=tokens, progress=False)
    assert report.ok, report.errors
    assert json.loads(report.report_path.read_text())["run"]["data"] == str(tokens)


@pytest.mark.parametrize(
    "name,content,message",
    [
        ("odd.bin", b"\x01\x00\x02", "odd number"),
        ("big.txt", b"1 2 3 999 " * 100, "outside the model's vocabulary"),
        ("short.txt", b" ".join(b"%d" % (i % 128) for i in range(40)), "fewer than one global batch"),
    ],
)
def test_a_token_file_is_checked_on_the_launcher_before_any_rank_starts(tmp_path, name, content, message):
    from mixle_compile.runtime.errors import RuntimeRefusal

    tokens = tmp_path / name
    tokens.write_bytes(content)
    with pytest.raises(RuntimeRefusal, match=message):
        run_plan(plan_for(dr=2), steps=2, out_dir=tmp_path / "run", data_path=tokens, progress=False)
    assert not (tmp_path / "run" / "logs").exists()  # refused before any rank started


def test_a_short_token_file_repeats_only_when_asked(tmp_path):
    tokens = tmp_path / "short.txt"
    tokens.write_text(" ".join(str(i % 128) for i in range(40)))
    report = run_plan(
        plan_for(dr=2), steps=1, out_dir=tmp_path / "run", data_path=tokens, progress=False, repeat_data=True
    )
    assert report.ok, report.errors


def test_a_kv_head_shared_over_tp_sums_its_gradient_over_the_ranks_sharing_it(tmp_path):
    doc, report = replay(tmp_path, steps=2, tp=2, kv_heads=1)
    assert report.ok and report.accounting_ok, report.errors
    shared = {u.node_id: u for u in report.evidence if u.node_id.endswith(":grad/kv")}
    assert set(shared) == {f"layers.{i}.attn.{w}_proj.weight:grad/kv" for i in range(2) for w in "kv"}
    for u in shared.values():
        assert u.mesh_axes == ("tp_kv_replica2",) and u.numerics_sample_count == 2 * 2  # 2 steps x 2 tp ranks
        assert u.maximum_relative_error < 1e-5, u


def test_a_plan_that_never_sums_a_shared_kv_head_gradient_is_refused():
    from mixle_compile.runtime.errors import RuntimeRefusal

    doc = plan_for(tp=2, kv_heads=1)
    broken = doc.model_copy(update={"updates": [u for u in doc.updates if not u.node_id.endswith(":grad/kv")]})
    with pytest.raises(RuntimeRefusal, match="never sums its gradient over them"):
        read_instructions(broken)
    k = read_instructions(doc).param("layers.0.attn.k_proj.weight")
    assert (k.tp_dim, k.tp_replicas) == (0, 2)

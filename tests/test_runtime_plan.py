"""The runtime's reading of plans, without starting processes: refusals, data, accounting, evidence."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mixle_compile.plan import plan_text
from mixle_compile.runtime import RuntimeRefusal, run_plan
from mixle_compile.runtime.instructions import Collective, read_instructions
from mixle_compile.runtime.report import accounting
from tests.conftest import EXAMPLES, ROOT
from tests.test_runtime_support import compile_text, plan_for, spec_text

# --- refusals, before torch or any process -------------------------------------------------------


def test_refusing_a_plan_imports_no_torch(tmp_path):
    """`run` refuses plans it cannot execute on the lint-fast path: torch is never imported."""
    hmm = (EXAMPLES / "hmm-shared-transitions.yaml").read_text()
    assert "  seq_len: 100\n" in hmm
    (tmp_path / "hmm-no-seq-len.yaml").write_text(hmm.replace("  seq_len: 100\n", ""))
    script = f"""
import sys
import argparse
import mixle_compile.check, mixle_compile.runtime as r
from mixle_compile.runtime import cli, launch
cli.add_run_arguments(argparse.ArgumentParser())
assert cli.DEFAULT_TIMEOUT_S == launch.DEFAULT_TIMEOUT_S
assert "torch" not in sys.modules
for path in ({str(tmp_path / "hmm-no-seq-len.yaml")!r}, "examples/modules-mlp.yaml", "examples/llama3-8b-hsdp-tp.yaml"):
    try:
        r.run_plan(path, out_dir={str(tmp_path / "out")!r})
    except r.RuntimeRefusal as exc:
        print("refused:", exc)
    else:
        raise SystemExit("not refused: " + path)
assert "torch" not in sys.modules, "refusing a plan imported torch"
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("refused:") == 3
    assert "seq_len" in out.stdout and "nn.Module" in out.stdout and "64 ranks" in out.stdout


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(cp=3), "cuts training.seq_len=16 into 2 \\* cp = 6 equal chunks"),
        (dict(tp=8, kv_heads=4), "num_heads=4 is not divisible by tp=8"),
    ],
)
def test_unexecutable_plans_are_refused_with_the_reason(kwargs, message):
    with pytest.raises(RuntimeRefusal, match=message):
        read_instructions(plan_for(**kwargs))


def test_a_plan_whose_verdict_failed_is_refused():
    doc = plan_for(dr=2)
    data = doc.model_dump(mode="json")
    data["verdict"]["ok"] = False
    with pytest.raises(RuntimeRefusal, match="did not verify"):
        read_instructions(type(doc).model_validate(data))


def test_a_modified_plan_file_is_refused(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(
        plan_text(plan_for(dr=2).model_dump(mode="json")).replace('"learning_rate":0.01', '"learning_rate":0.02')
    )
    with pytest.raises(RuntimeRefusal, match="digest mismatch"):
        run_plan(path, out_dir=tmp_path / "out")


def test_a_world_size_mismatch_under_torchrun_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeRefusal, match="WORLD_SIZE=2"):
        run_plan(EXAMPLES / "tiny-transformer.yaml", out_dir=tmp_path)


def test_a_spec_with_errors_is_not_run(tmp_path):
    with pytest.raises(RuntimeRefusal, match="does not check cleanly"):
        run_plan(EXAMPLES / "invalid" / "s003-unknown-key.yaml", out_dir=tmp_path)


def test_modules_plans_point_to_the_library_api(tmp_path):
    spec = tmp_path / "m.yaml"
    spec.write_text(
        "model: {family: modules, parameters: [{name: w, shape: [4, 4]}]}\n"
        "mesh: {dp_replicate: 2}\ntraining: {global_batch_size: 2}\n"
        "backend: torch\nresources: {devices: 2, memory: 1GiB}\n"
    )
    with pytest.raises(RuntimeRefusal, match="library API"):
        run_plan(spec, out_dir=tmp_path / "out")


# --- reading updates as instructions ---------------------------------------------------------------


def test_modes_follow_the_layouts():
    fsdp = read_instructions(plan_for(ds=2, gas=2))
    q = fsdp.param("layers.0.attn.q_proj.weight")
    assert (q.mode, q.shard_axes, q.reduce_every_accumulation) == ("fsdp", ("dp_shard",), True)
    assert set(q.gathers) == {"forward", "backward"}
    ddp = read_instructions(plan_for(dr=2, gas=2)).param("layers.0.attn.q_proj.weight")
    assert (ddp.mode, ddp.reduce_every_accumulation, [c.collective for c in ddp.gradient]) == (
        "replicated",
        False,
        ["all_reduce"],
    )
    zero = read_instructions(plan_for(dr=2, dopt=True)).param("layers.0.attn.q_proj.weight")
    assert (zero.mode, zero.shard_axes) == ("zero", ("dp_replicate",))
    tied = read_instructions(plan_for(dr=2, tie=True)).param("lm_head.weight")
    assert tied.tied_to == "embed.weight"


def test_tensor_parallel_plans_declare_both_halves_of_every_conjugate_pair():
    """The head's input gradient and the sequence-parallel embedding's gradient cross tp too."""
    plain = read_instructions(plan_for(tp=2)).collectives
    assert plain["lm_head:in/grad"].collective == "all_reduce"
    assert plain["embed:out"].collective == "all_reduce" and "embed:out/grad" not in plain
    sp = read_instructions(plan_for(tp=2, sp=True)).collectives
    assert (sp["embed:out"].collective, sp["embed:out/grad"].collective) == ("reduce_scatter", "all_gather")
    assert (sp["lm_head:in"].collective, sp["lm_head:in/grad"].collective) == ("all_gather", "reduce_scatter")
    # One fp32 (log-sum-exp, target logit) pair per token from each of the 2 vocabulary shards.
    loss = sp["lm_head:loss"]
    assert (loss.collective, loss.payload_bytes) == ("all_gather", 2 * 2 * (2 * 16) * 4)


def test_sequence_parallel_tp_reductions_run_as_often_as_the_fsdp_scatter_they_precede():
    ins = read_instructions(plan_for(ds=2, tp=2, sp=True, gas=2))
    norm = ins.param("layers.0.attn_norm.weight")
    assert [(c.collective, c.rule, c.occurrences_per_step) for c in norm.gradient] == [
        ("all_reduce", "tp", 2),
        ("reduce_scatter", "dp_shard", 2),
    ]


# --- data ---------------------------------------------------------------------------------------


def test_data_ranks_read_disjoint_slices_that_make_up_the_global_batch():
    torch = pytest.importorskip("torch")
    from mixle_compile.runtime.data import BatchLayout, SyntheticTokens, local_batch

    source = SyntheticTokens(vocab_size=50, seq_len=8, seed=3)
    layout = BatchLayout(micro_batch_size=2, microbatches=2, accumulation_steps=2, data_parallel_size=3)
    seen = []
    for a in range(2):
        for d in range(3):
            inputs, targets = local_batch(source, layout, 1, a, d)
            assert inputs.shape == targets.shape == (4, 8)
            assert torch.equal(inputs[:, 1:], targets[:, :-1])  # next-token targets
            seen.extend(layout.first_sample(1, a, d) + i for i in range(4))
    per_step = 2 * 2 * 2 * 3
    assert sorted(seen) == list(range(per_step, 2 * per_step))
    again = SyntheticTokens(vocab_size=50, seq_len=8, seed=3)
    assert torch.equal(source.sample(17), again.sample(17))
    assert not torch.equal(source.sample(17), SyntheticTokens(50, 8, seed=4).sample(17))


def test_token_files_are_read_and_checked_against_the_vocabulary(tmp_path):
    pytest.importorskip("torch")
    from mixle_compile.runtime.data import FileTokens

    path = tmp_path / "tokens.txt"
    path.write_text(" ".join(str(i % 7) for i in range(100)))
    source = FileTokens(path, vocab_size=7, seq_len=8)
    assert source.sample(0).tolist() == [i % 7 for i in range(9)]
    assert source.sample(1).tolist() == [i % 7 for i in range(8, 17)]
    with pytest.raises(RuntimeRefusal, match="outside the model's vocabulary"):
        FileTokens(path, vocab_size=5, seq_len=8)


# --- accounting and evidence can fail ----------------------------------------------------------


def test_accounting_reports_a_missing_occurrence_and_an_unplanned_collective():
    ins = read_instructions(plan_for(dr=2, gas=2))
    steps = 3
    good = {
        "updates": {
            c.node_id: [c.occurrences_per_step * steps, c.payload_bytes * c.occurrences_per_step * steps]
            for c in ins.collectives.values()
        },
        "bookkeeping": {},
        "calls": 1,
    }
    assert accounting(ins, [good, good], steps)["ok"]
    short = json.loads(json.dumps(good))
    node = "layers.1.mlp.up_proj.weight:grad/reduce"
    short["updates"][node][0] -= 1
    short["updates"]["made-up:grad"] = [1, 4]
    result = accounting(ins, [good, short], steps)
    assert not result["ok"]
    assert any(e.startswith(node) and "rank 1" in e for e in result["errors"])
    assert any("made-up:grad" in e and "does not declare" in e for e in result["errors"])


def test_the_ledger_refuses_collectives_the_plan_does_not_declare():
    pytest.importorskip("torch")
    from mixle_compile.runtime import PlanMismatch
    from mixle_compile.runtime.collectives import Ledger

    planned = {
        "x:grad/reduce": Collective(
            "x:grad/reduce", "all_reduce", ("dp_replicate",), "dp_replicate", "gradient", 0, "x", 16, 2, 1, 2
        )
    }
    ledger = Ledger(planned)
    ledger.check("all_reduce", "dp_replicate", [("x:grad/reduce", 16)])
    with pytest.raises(PlanMismatch, match="does not declare"):
        ledger.check("all_reduce", "dp_replicate", [("y:grad/reduce", 16)])
    with pytest.raises(PlanMismatch, match="declares all_reduce on group 'dp_replicate'"):
        ledger.check("reduce_scatter", "dp_replicate", [("x:grad/reduce", 16)])


def test_evidence_exposes_a_wrong_divisor():
    """A reduced gradient off by the data-parallel factor is far outside tolerance; the right one is not."""
    pytest.importorskip("torch")
    from mixle_compile.runtime.reference import compare, expected_value, run_reference
    from mixle_compile.runtime.report import EVIDENCE_TOLERANCE
    from mixle_compile.runtime.worker import token_source

    ins = read_instructions(plan_for(dr=2, optimizer="adamw"))
    records = run_reference(ins, token_source(ins, None), 2)
    name = "layers.0.mlp.down_proj.weight"
    key = (f"{name}:grad/reduce", 1, None, None, 0)
    expect = ("grad", name, (0, 1), (0,), 2, ())
    right = expected_value(records, key, expect)
    wrong = right * 2  # summed but never divided
    found = compare(records, [{"first": [(key, expect, right, "d")], "repeat": {key: "d"}}])
    assert found[key[0]].max_rel == 0.0 and found[key[0]].deterministic
    found = compare(records, [{"first": [(key, expect, wrong, "d")], "repeat": {key: "e"}}])
    assert found[key[0]].max_rel >= 50 * EVIDENCE_TOLERANCE["fp32"]
    assert not found[key[0]].deterministic


# --- the session at world size 1 (no processes) ---------------------------------------------------


def test_single_rank_session_skips_receipts_until_the_window_closes():
    pytest.importorskip("torch")
    code = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
for k in ("RANK", "WORLD_SIZE"):
    __import__("os").environ.pop(k, None)
from mixle_compile.contracts import get_training_backend
from mixle_compile.runtime import plan_of
from mixle_compile.runtime.data import BatchLayout, SyntheticTokens, local_batch
from tests.test_runtime_support import compile_text, spec_text
doc = compile_text(spec_text(gas=2, optimizer="adamw"))
session = get_training_backend("torch").prepare(None, plan=plan_of(doc), document=doc)
source = SyntheticTokens(128, 16, 0)
layout = BatchLayout(2, 1, 2, 1)
first = session.train_batch(*local_batch(source, layout, 0, 0, 0))
second = session.train_batch(*local_batch(source, layout, 0, 1, 0))
assert first.skipped and first.loss is None and not second.skipped, (first, second)
assert (second.global_examples, second.global_tokens, second.step, session.step) == (4, 64, 0, 1)
partial = session.train_batch(*local_batch(source, layout, 1, 0, 0))
assert partial.skipped
closed = session.finish_accumulation()
assert closed is not None and closed.accumulation_steps == 1 and closed.local_examples == 2
assert session.finish_accumulation() is None
session.train_batch(*local_batch(source, layout, 2, 0, 0))
session.discard_accumulation()
assert session.step == 2 and session.discarded_windows == 1
session.close()
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_spec_texts_compile_for_every_shape_the_replay_tests_use():
    for kwargs in (dict(dr=2, ds=2, tp=2, sp=True), dict(ds=2, mb=2, gas=2), dict(dr=2, dopt=True, tp=2)):
        doc = compile_text(spec_text(**kwargs))
        assert doc.verdict.ok


def test_a_discarded_window_leaves_the_counts_and_the_measured_exchange():
    from mixle_compile.runtime.collectives import Ledger

    ledger = Ledger(planned={})
    ledger.record([("layers.0.moe:dispatch", 64)])
    ledger.exchanged["layers.0.moe:dispatch"] = [1, 32, 40]
    ledger.begin_window()
    ledger.record([("layers.0.moe:dispatch", 64)])
    ledger.exchanged["layers.0.moe:dispatch"] = [2, 80, 72]
    ledger.exchanged["layers.1.moe:dispatch"] = [1, 16, 16]
    ledger.discard_window()
    assert ledger.updates["layers.0.moe:dispatch"].count == 1 and ledger.discarded["layers.0.moe:dispatch"].count == 1
    assert ledger.exchanged == {"layers.0.moe:dispatch": [1, 32, 40]}

"""Pipeline plans replayed on real process groups (gloo, CPU), against a single-process reference.

Each run starts one process per stage, walks the plan's stage programs (gpipe, 1f1b, interleaved
1f1b) with explicit send/recv of activations and their gradients, and checks:

- planned == observed for every stage-boundary transfer, on the ranks at both of its ends;
- every parameter of every stage received a non-zero gradient and moved, and equals the parameter
  trained in one process on the same batches (the trap: a stage whose received activation lacks
  requires_grad runs without error and leaves the earlier stages without gradients);
- the deliberately broken variant (the received activation detached) is caught.
"""

from __future__ import annotations

import textwrap

import pytest

from mixle_compile.runtime.errors import RuntimeRefusal
from mixle_compile.runtime.instructions import read_instructions
from mixle_compile.runtime.pipeline import pipeline_instructions, run_pipeline_job
from tests.test_runtime_support import compile_text

# fp32 AdamW over 2 steps: a missing or doubled transfer, or a stage without gradients, is off by 1e-2 or more.
BOUND = 1e-4


def pp_spec(*, pp: int = 2, mb: int = 4, schedule: str = "1f1b", virtual: int = 1, layers: int = 4, dr: int = 1, ds: int = 1,
            gas: int = 1, optimizer: str = "adamw") -> str:
    return textwrap.dedent(
        f"""\
        model: {{family: transformer, vocab_size: 128, hidden_size: 32, num_layers: {layers}, num_heads: 4, num_kv_heads: 2,
                ffn_hidden_size: 64, tie_embeddings: false}}
        mesh: {{pp: {pp}, dp_replicate: {dr}, dp_shard: {ds}, microbatches: {mb}, gradient_accumulation_steps: {gas}}}
        training: {{global_batch_size: {2 * mb * dr * ds * gas}, micro_batch_size: 2, seq_len: 16, precision: fp32, optimizer: {optimizer},
                   learning_rate: 1.0e-2, pipeline_schedule: {schedule}, virtual_pipeline_stages: {virtual}, steps: 2}}
        backend: torch
        resources: {{devices: {pp * dr * ds}, memory: 1GiB, kind: cpu}}
        """
    )


def _check(result: dict, doc, bound: float = BOUND) -> None:
    assert result["accounting_errors"] == []
    assert result["stages_without_gradients"] == []
    held = set(result["moved"])
    assert held == {p.logical_id for p in doc.parameters}  # every parameter lives on some stage
    assert all(result["moved"].values())
    assert result["max_relative_error"] < bound, sorted(result["relative_error"].items(), key=lambda kv: -kv[1])[:3]
    assert result["losses"] == pytest.approx(result["reference_losses"], rel=1e-5)
    # every rank took part in transfers both ways
    for updates in result["transfers"].values():
        assert any(k.endswith(":activation") for k in updates) and any(k.endswith(":activation/grad") for k in updates)
    assert 0.0 < result["bubble_fraction"] < 1.0
    assert all(0.0 <= f < 1.0 for f in result["idle_fraction"].values())


@pytest.mark.parametrize(
    "schedule,virtual,mb,gas",
    [("gpipe", 1, 4, 1), ("1f1b", 1, 2, 2), ("interleaved_1f1b", 2, 4, 1)],
)
def test_pipeline_matches_reference(tmp_path, schedule, virtual, mb, gas):
    text = pp_spec(schedule=schedule, virtual=virtual, mb=mb, gas=gas)
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    doc = compile_text(text)
    assert doc.schedule.pipeline == schedule
    _check(run_pipeline_job(path, steps=2), doc)


def test_detached_activation_is_caught(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(pp_spec())
    result = run_pipeline_job(path, steps=2, detach_received=True)
    # The run completes without error, and the checks say what went wrong.
    assert result["stages_without_gradients"] == [0]
    assert result["max_relative_error"] > 1e-2
    assert result["accounting_errors"] == []


@pytest.mark.slow
def test_three_stages_1f1b(tmp_path):
    text = pp_spec(pp=3, mb=6, layers=3)
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    _check(run_pipeline_job(path, steps=2), compile_text(text))


def test_pipeline_with_data_parallelism(tmp_path):
    # pp=2 x dp_replicate=2 on 4 ranks: the gradient all_reduces the stage programs issue, divided by 2.
    # SGD, whose step is proportional to the gradient, so a wrong divisor is off by far more than the bound.
    text = pp_spec(dr=2, optimizer="sgd")
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    doc = compile_text(text)
    result = run_pipeline_job(path, steps=2)
    _check(result, doc, bound=1e-5)
    reductions = [u.node_id for u in doc.updates if u.collective == "all_reduce"]
    assert reductions and all(any(k in updates for updates in result["transfers"].values()) for k in reductions)


def test_interleaved_plan_declares_every_boundary():
    doc = compile_text(pp_spec(schedule="interleaved_1f1b", virtual=2))
    declared = {u.node_id: u.occurrences_per_step for u in doc.updates if u.collective == "p2p"}
    # virtual stages 0 -> 1 -> 2 -> 3 live on stages 0, 1, 0, 1: two boundaries 0 -> 1, one 1 -> 0
    assert declared == {
        "stage.0->1:activation": 8,
        "stage.1->0:activation/grad": 8,
        "stage.1->0:activation": 4,
        "stage.0->1:activation/grad": 4,
    }
    # the stage programs carry exactly these transfers
    sends = {}
    for s, program in enumerate(doc.schedule.stages):
        for op in program:
            if op.kind == "send":
                name = f"stage.{s}->{op.peer}:activation" + ("/grad" if op.tag == "activation_grad" else "")
                sends[name] = sends.get(name, 0) + 1
    assert sends == declared


def test_pipeline_refusals():
    doc = compile_text(pp_spec())
    with pytest.raises(RuntimeRefusal, match="pipeline"):
        read_instructions(doc)  # the ordinary runtime still refuses pp
    assert pipeline_instructions(doc).plan.pp == 2
    with pytest.raises(RuntimeRefusal, match="dp_shard=2"):
        pipeline_instructions(compile_text(pp_spec(ds=2)))

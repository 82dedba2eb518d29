"""Pipelined plans through `run`: stage programs replayed on real process groups (gloo, CPU).

Every case starts one process per rank with the ordinary launcher, walks the plan's stage programs
(gpipe, 1f1b, interleaved 1f1b) with explicit send/recv of activations and their gradients, repeats
the run for determinism, trains the same model in one process, and checks the run report:

- planned == observed for every update on every rank: the ranks of its stage (both ends of a
  transfer) issue it as planned, every other rank never;
- every update carries evidence against the single-process reference (a transfer: the residual
  stream at that stage boundary, or its gradient), within a bound a replay error would break;
- every stage received gradients (the trap: a stage whose received activation lacks requires_grad
  runs without error and leaves every earlier stage without gradients; the broken variant is run
  and must be caught);
- the idle fraction is measured on every rank, next to the plan's bubble model.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest

from mixle_compile.lower.compact import plan_programs, program_dict, program_from
from mixle_compile.runtime import run_plan
from mixle_compile.runtime.errors import RunFailed, RuntimeRefusal
from mixle_compile.runtime.instructions import read_instructions
from mixle_compile.runtime.pipeline_plan import check_pipeline, pipeline_section, read_layout, stage_of_rank
from mixle_compile.runtime.report import accounting
from tests.conftest import ROOT
from tests.test_runtime_support import compile_text

# fp32, 3 steps: SGD agrees to rounding (about 1e-6); AdamW turns rounding in near-zero gradients into
# visible steps (about 1e-4 here, as without a pipeline). A missed transfer, a stage without
# gradients or a wrong divisor is off by 1e-1 or more.
BOUND = {"sgd": 1e-5, "adamw": 1e-3}


def pp_spec(
    *,
    pp: int = 2,
    mb: int = 4,
    schedule: str = "1f1b",
    virtual: int = 1,
    layers: int = 4,
    dr: int = 1,
    ds: int = 1,
    tp: int = 1,
    sp: bool = False,
    gas: int = 1,
    optimizer: str = "sgd",
    dopt: bool = False,
    cp: int = 1,
    tie: bool = False,
    precision: str = "fp32",
    split: str | None = None,
) -> str:
    world = pp * dr * ds * tp * cp
    layer_split = f", pipeline_layers: {split}" if split else ""
    return textwrap.dedent(
        f"""\
        model: {{family: transformer, vocab_size: 128, hidden_size: 32, num_layers: {layers}, num_heads: 4, \
num_kv_heads: 2,
                ffn_hidden_size: 64, tie_embeddings: {str(tie).lower()}}}
        mesh: {{pp: {pp}, dp_replicate: {dr}, dp_shard: {ds}, tp: {tp}, cp: {cp}, microbatches: {mb}, \
gradient_accumulation_steps: {gas}}}
        training: {{global_batch_size: {2 * mb * dr * ds * gas}, micro_batch_size: 2, seq_len: 16, \
precision: {precision},
                   optimizer: {optimizer}, learning_rate: 1.0e-2, pipeline_schedule: {schedule}, \
virtual_pipeline_stages: {virtual},
                   sequence_parallel: {str(sp).lower()}, distributed_optimizer: {str(dopt).lower()}, \
steps: 3{layer_split}}}
        backend: torch
        resources: {{devices: {world}, memory: 1GiB, kind: cpu}}
        """
    )


def run_pp(tmp_path, *, steps: int = 3, reference: bool = True, timeout_s: float = 90, **kwargs):
    doc = compile_text(pp_spec(**kwargs))
    report = run_plan(doc, steps=steps, out_dir=tmp_path, reference=reference, progress=False, timeout_s=timeout_s)
    return doc, report


def check_run(doc, report, optimizer: str = "sgd") -> dict:
    """The report of a correct pipelined run; returns its pipeline section."""
    assert report.ok, report.errors
    assert report.accounting_ok and report.updates_checked == len({u.node_id for u in doc.updates}) > 0
    rows = {row["node_id"]: row for row in report.data["accounting"]["updates"]}
    stages = stage_of_rank(doc)
    # The stages listing each update (the tied embedding's all_reduce: the first and the last).
    listed: dict[str, set[int]] = {}
    for u in doc.updates:
        listed.setdefault(u.node_id, set()).add(u.stage)
    for u in doc.updates:
        row = rows[u.node_id]
        assert row["match"] and row["observed_count"] == u.occurrences_per_step * report.steps, u.node_id
        # executed by the ranks of its stage(s) only (a transfer: of both its stages)
        ends = (
            {int(s) for s in u.node_id[len("stage.") :].split(":")[0].split("->")}
            if u.collective == "p2p"
            else listed[u.node_id]
        )
        assert row["ranks"] == [r for r, s in enumerate(stages) if s in ends], u.node_id
    evidence = {u.node_id: u for u in report.evidence}
    assert set(evidence) == {u.node_id for u in doc.updates}
    for u in evidence.values():
        assert u.numerics_sample_count > 0 and u.determinism_observed is True, u.node_id
    assert report.max_relative_error <= BOUND[optimizer], sorted(
        evidence.values(), key=lambda u: -u.maximum_relative_error
    )[:3]
    pipeline = report.data["pipeline"]
    assert pipeline["stages_without_gradient"] == [] and pipeline["parameters_without_gradient"] == {}
    assert pipeline["stage_of_rank"] == list(stages)
    assert len(pipeline["idle_fraction_per_rank"]) == len(stages)
    assert all(0.0 <= f < 1.0 for f in pipeline["idle_fraction_per_rank"])
    v, m = doc.schedule.virtual_stages, doc.mesh.degrees["microbatches"]
    pp = doc.mesh.degrees["pp"]
    assert pipeline["bubble_model"] == pytest.approx((pp - 1) / (v * m + pp - 1))
    assert "pipeline: " in report.summary() and "measured idle fraction" in report.summary()
    receipts = [json.loads(line) for line in report.receipts_path.read_text().splitlines()]
    assert [r["step"] for r in receipts] == list(range(report.steps))
    assert [r["loss"] for r in receipts] == pytest.approx(list(report.losses))
    assert all(r["global_examples_observed"] == doc.spec["training"]["global_batch_size"] for r in receipts)
    return pipeline


@pytest.mark.parametrize(
    "schedule,virtual,mb,gas",
    [("gpipe", 1, 4, 1), ("1f1b", 1, 2, 2), ("interleaved_1f1b", 2, 4, 1)],
)
def test_schedules_match_the_reference(tmp_path, schedule, virtual, mb, gas):
    doc, report = run_pp(tmp_path, schedule=schedule, virtual=virtual, mb=mb, gas=gas, optimizer="adamw")
    assert doc.schedule.pipeline == schedule
    check_run(doc, report, "adamw")
    assert report.losses[-1] < report.losses[0]


def test_detached_activation_is_caught(tmp_path, monkeypatch):
    # Stage 1 drops the autograd edge of what it receives: the run completes without any error, and
    # stage 0 gets no gradient. The report must say so, and the evidence must disagree.
    monkeypatch.setenv("MIXLE_RUNTIME_FAULT", "detach:1:0")
    doc, report = run_pp(tmp_path, optimizer="adamw")
    assert not report.ok and report.accounting_ok
    assert report.data["pipeline"]["stages_without_gradient"] == [0]
    assert any(e.startswith("stage 0 (rank 0): none of its") for e in report.errors)
    evidence = {u.node_id: u for u in report.evidence}
    assert evidence["stage.1->0:activation/grad"].maximum_relative_error > 0.5  # zeros sent instead of gradients
    assert evidence["stage.0->1:activation"].maximum_relative_error > 1e-2  # stage 0 never trained


def test_pipeline_with_data_parallelism_interleaved(tmp_path):
    # pp=2 x dp_replicate=2, two chunks per stage: gradients all-reduced per stage, divided by 2.
    doc, report = run_pp(tmp_path, dr=2, schedule="interleaved_1f1b", virtual=2)
    check_run(doc, report)


def test_pipeline_with_tensor_and_sequence_parallelism(tmp_path):
    # pp=2 x tp=2 with sequence parallelism: each stage's blocks run through the tensor-parallel ops,
    # and the stage boundary carries the sequence shard [s / tp, b, h].
    doc, report = run_pp(tmp_path, tp=2, sp=True)
    check_run(doc, report)
    transfer = next(u for u in doc.updates if u.node_id == "stage.0->1:activation")
    assert transfer.payload_bytes == (16 // 2) * 2 * 32 * 4
    sites = {u.node_id for u in doc.updates}
    assert {"layers.0.attn:in", "layers.3.mlp:out", "lm_head:loss", "embed:out"} <= sites


def test_pipeline_with_fsdp_and_accumulation(tmp_path):
    # pp=2 x dp_shard=2, two accumulation steps: every stage gathers its shards per micro-batch and
    # reduce-scatters its gradients per accumulation step; AdamW state sharded.
    doc, report = run_pp(tmp_path, ds=2, gas=2, mb=2, optimizer="adamw")
    check_run(doc, report, "adamw")
    assert report.max_relative_error < 1e-5  # no tensor-parallel rounding here: FSDP's sums of two agree closely
    rows = {row["node_id"]: row for row in report.data["accounting"]["updates"]}
    assert rows["layers.3.mlp.down_proj.weight:grad/scatter"]["observed_count"] == 2 * 3
    assert rows["layers.0.attn.q_proj.weight:param/gather-forward"]["ranks"] == [0, 1]


def test_uneven_and_listed_layer_splits_train_like_one_process(tmp_path):
    # 5 layers over 2 stages x 2 virtual stages, listed as [2, 0, 1, 2]: a virtual stage without
    # layers passes its activation on; the plan's stages hold exactly the listed layers.
    doc, report = run_pp(tmp_path, pp=2, mb=4, schedule="interleaved_1f1b", virtual=2, layers=5, split="[2, 0, 1, 2]")
    check_run(doc, report)
    held = {}
    for p in doc.parameters:
        if p.layer is not None:
            held.setdefault((p.stage, p.chunk), set()).add(p.layer)
    assert held == {(0, 0): {0, 1}, (0, 1): {2}, (1, 1): {3, 4}}  # virtual stage 1 (stage 1, chunk 0) has none


def test_torchs_relaxed_interleaved_schedule_trains_like_one_process(tmp_path):
    # 10 micro-batches over pp 4 x 2 virtual stages: torch's two rounds of 5, an order that only
    # runs because a stage's sends never block it (awaited at the end of the step).
    doc, report = run_pp(tmp_path, pp=4, mb=10, schedule="interleaved_1f1b", virtual=2, layers=8)
    check_run(doc, report)


def test_pipeline_with_context_parallelism(tmp_path):
    # pp=2 x cp=2: every cp rank holds two chunks of each sequence, K and V gathered over cp per
    # layer of its stage; the stage boundary carries the rank's own chunks [s / cp, b, h].
    doc, report = run_pp(tmp_path, cp=2)
    check_run(doc, report)
    transfer = next(u for u in doc.updates if u.node_id == "stage.0->1:activation")
    assert transfer.payload_bytes == (16 // 2) * 2 * 32 * 4
    rows = {row["node_id"]: row for row in report.data["accounting"]["updates"]}
    assert rows["layers.3.attn:kv"]["ranks"] == [r for r, s in enumerate(stage_of_rank(doc)) if s == 1]


@pytest.mark.parametrize(
    "fault,message",
    [
        ("kill", "rank 1 died"),
        (
            "stall",
            "rank 1 stalled: rank(s) 0 timed out after 5 s waiting for it in 'stage.1->0:activation/grad' (group pp)",
        ),
    ],
)
def test_a_dead_or_stalled_stage_is_named(tmp_path, monkeypatch, fault, message):
    monkeypatch.setenv("MIXLE_RUNTIME_FAULT", f"{fault}:1:1")
    with pytest.raises(RunFailed) as failed:
        run_pp(tmp_path, reference=False, timeout_s=5)
    assert failed.value.ranks == (1,)
    assert message in str(failed.value)


def test_run_command_prints_the_pipeline(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(pp_spec(schedule="gpipe"))  # compiled and verified by `run` itself
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mixle_compile.runtime",
            str(spec),
            "--steps",
            "2",
            "--quiet",
            "--out",
            str(tmp_path / "out"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "pipeline: gpipe, pp=2, 4 micro-batches per step: measured idle fraction" in out.stdout
    assert "the plan's bubble model 0.20" in out.stdout
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["ok"] and report["pipeline"]["schedule"] == "gpipe"


def _relative(a: dict, b: dict) -> dict:
    return {n: float((a[n] - b[n]).norm() / b[n].norm()) for n in b}


# four resumes; test_tied_checkpoints_reshard_between_pipelined_and_flat_meshes resumes both ways quickly
@pytest.mark.slow
def test_checkpoints_resume_across_pipelined_and_flat_meshes(tmp_path):
    # A pipelined run saves every step; a flat FSDP run and a pipelined FSDP run both resume from its
    # step-1 checkpoint and must end where the uninterrupted pipelined run ends (AdamW: the optimizer
    # state travels too). Every checkpoint holds global tensors, whatever the mesh that wrote it.
    from mixle_compile.runtime import checkpoint as ckpt
    from mixle_compile.runtime import checkpoint_dcp

    steps = 3
    pipelined = compile_text(pp_spec(optimizer="adamw"))
    first = run_plan(pipelined, steps=steps, out_dir=tmp_path / "a", save_every=1, progress=False, timeout_s=90)
    assert first.ok, first.errors
    saved = tmp_path / "a" / "checkpoints"
    assert [s for s, _, complete in ckpt.list_checkpoints(saved) if complete] == [1, 2, 3]
    end = checkpoint_dcp.read_global_state(saved / ckpt.step_dir_name(steps))
    assert set(end) == {p.logical_id for p in pipelined.parameters}
    one_step = max(_relative(checkpoint_dcp.read_global_state(saved / ckpt.step_dir_name(steps - 1)), end).values())
    for name, kwargs in (("flat", dict(pp=1, ds=2, mb=2)), ("pp-fsdp", dict(ds=2, mb=2))):
        doc = compile_text(pp_spec(optimizer="adamw", **kwargs))
        resumed = run_plan(
            doc,
            steps=steps,
            out_dir=tmp_path / name,
            resume=saved / ckpt.step_dir_name(1),
            save_every=steps,
            progress=False,
            timeout_s=90,
        )
        assert resumed.ok, resumed.errors
        assert resumed.data["run"]["first_step"] == 1 and resumed.steps == steps - 1
        assert list(resumed.losses) == pytest.approx(list(first.losses[1:]), rel=1e-5)
        errors = _relative(
            checkpoint_dcp.read_global_state(tmp_path / name / "checkpoints" / ckpt.step_dir_name(steps)), end
        )
        assert max(errors.values()) < 1e-4 < one_step / 100, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.parametrize(
    "kwargs",
    [dict(ds=2, gas=2, mb=2, optimizer="adamw"), dict(tp=2, sp=True, schedule="interleaved_1f1b", virtual=2)],
    ids=["pp2-fsdp2-accumulation-adamw", "pp2-tp2-sp-interleaved"],
)
def test_tied_embeddings_across_stages_stay_one_weight(tmp_path, kwargs):
    # The embedding (first stage) and the head (last stage) are copies of one weight: they start equal,
    # and the plan's all_reduce over the tied group sums both whole gradients before any other
    # reduction (under FSDP before the reduce-scatter, once per step). The reference trains one tensor;
    # every record of either copy, and of the summed gradient, must agree with it.
    doc, report = run_pp(tmp_path, tie=True, **kwargs)
    check_run(doc, report, kwargs.get("optimizer", "sgd"))
    tied = [u for u in doc.updates if u.node_id == "tied_embedding:grad/tied"]
    last = doc.mesh.degrees["pp"] - 1
    assert {(u.tensor, u.stage) for u in tied} == {("embed.weight", 0), ("lm_head.weight", last)}
    for name in ("embed.weight", "lm_head.weight"):
        chain = [u.node_id for u in doc.updates if u.tensor == name and u.payload == "gradient"]
        assert chain[0] == "tied_embedding:grad/tied" and all(
            u.occurrences_per_step == 1 for u in doc.updates if u.node_id in chain
        )
    evidence = {u.node_id: u for u in report.evidence}
    assert evidence["tied_embedding:grad/tied"].numerics_sample_count >= 2 * 3  # both copies, every step
    distinct = len({u.node_id for u in doc.updates})  # the tied all_reduce is listed once per stage
    assert distinct == len(doc.updates) - 1
    summary = report.summary()
    assert f"accounting: {distinct} planned updates" in summary and f"evidence: {distinct} updates" in summary


def test_tied_copies_without_their_sync_are_refused():
    doc = compile_text(pp_spec(tie=True))
    data = doc.model_dump(mode="json")
    data["updates"] = [u for u in data["updates"] if u["node_id"] != "tied_embedding:grad/tied"]
    with pytest.raises(RuntimeRefusal, match="does not start with an all_reduce over the 'tied' group"):
        read_instructions(type(doc).model_validate(data))


def test_tied_checkpoints_reshard_between_pipelined_and_flat_meshes(tmp_path):
    # A tied pipelined run saves the weight once (the first stage's copy); a flat run, where the two
    # are one tensor, resumes from it and ends where the uninterrupted pipelined run ends.
    from mixle_compile.runtime import checkpoint as ckpt
    from mixle_compile.runtime import checkpoint_dcp

    steps = 3
    first = run_plan(
        compile_text(pp_spec(tie=True, optimizer="adamw")),
        steps=steps,
        out_dir=tmp_path / "a",
        save_every=1,
        progress=False,
        timeout_s=90,
    )
    assert first.ok, first.errors
    saved = tmp_path / "a" / "checkpoints"
    manifest = ckpt.read_manifest(saved / ckpt.step_dir_name(1))
    assert manifest["tied"] == {"lm_head.weight": "embed.weight"}
    assert "lm_head.weight" not in {p["name"] for p in manifest["parameters"]}
    end = checkpoint_dcp.read_global_state(saved / ckpt.step_dir_name(steps))
    flat = compile_text(pp_spec(pp=1, ds=2, mb=2, tie=True, optimizer="adamw"))
    resumed = run_plan(
        flat,
        steps=steps,
        out_dir=tmp_path / "flat",
        resume=saved / ckpt.step_dir_name(1),
        save_every=steps,
        progress=False,
        timeout_s=90,
    )
    assert resumed.ok, resumed.errors
    assert list(resumed.losses) == pytest.approx(list(first.losses[1:]), rel=1e-5)
    errors = _relative(
        checkpoint_dcp.read_global_state(tmp_path / "flat" / "checkpoints" / ckpt.step_dir_name(steps)), end
    )
    assert max(errors.values()) < 1e-4, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(pp=3, mb=6, layers=3),
        dict(tp=2, ds=2, sp=True, optimizer="adamw"),
        dict(dr=2, dopt=True, optimizer="adamw"),
        dict(tp=2, schedule="interleaved_1f1b", virtual=2),
        dict(ds=2, dr=2, gas=2, mb=2),
        dict(cp=2, tp=2, sp=True, schedule="interleaved_1f1b", virtual=2),
        dict(cp=2, ds=2, gas=2, mb=2, optimizer="adamw"),
    ],
    ids=[
        "pp3",
        "pp2-fsdp2-tp2-sp-8",
        "pp2-distributed-optimizer",
        "pp2-tp2-interleaved",
        "pp2-hsdp-accumulation-8",
        "pp2-cp2-tp2-sp-interleaved-8",
        "pp2-cp2-fsdp2-accumulation-8",
    ],
)
def test_more_combinations(tmp_path, kwargs):
    doc, report = run_pp(tmp_path, **kwargs)
    check_run(doc, report, kwargs.get("optimizer", "sgd"))


# ---------------------------------------------------------------------------
# without processes: the plan, the accounting, the gradient check, refusals
# ---------------------------------------------------------------------------


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
    sends = {}
    for s, program in enumerate(plan_programs(doc.schedule, doc.updates)):
        for op in program:
            if op.kind == "send":
                name = f"stage.{s}->{op.peer}:activation" + ("/grad" if op.tag == "activation_grad" else "")
                sends[name] = sends.get(name, 0) + 1
    assert sends == declared
    layout = read_layout(doc)
    assert [layout.boundary(v) for v in range(3)] == ["layers.0:boundary", "layers.1:boundary", "layers.2:boundary"]


def test_accounting_is_per_stage():
    doc = compile_text(pp_spec(tp=2))
    instructions = read_instructions(doc)
    stages = stage_of_rank(doc)
    steps = 2

    def ledger(rank):
        updates = {}
        for c in instructions.collectives.values():
            ends = (
                {int(s) for s in c.node_id[len("stage.") :].split(":")[0].split("->")}
                if c.collective == "p2p"
                else {c.stage}
            )
            if stages[rank] in ends:
                updates[c.node_id] = [c.occurrences_per_step * steps, c.payload_bytes * c.occurrences_per_step * steps]
        return {"updates": updates, "bookkeeping": {}, "calls": 1}

    ledgers = [ledger(r) for r in range(len(stages))]
    assert accounting(instructions, ledgers, steps, stages)["ok"]
    # without stages every rank is expected to issue everything
    assert not accounting(instructions, ledgers, steps)["ok"]
    # a rank of stage 1 issuing a stage-0 update, or a transfer missing at one end, is an error
    wrong = [dict(lg, updates=dict(lg["updates"])) for lg in ledgers]
    last_rank = stages.index(1)
    wrong[last_rank]["updates"]["layers.0.attn:out"] = [8, 8 * 4096]
    del wrong[0]["updates"]["stage.0->1:activation"]
    errors = accounting(instructions, wrong, steps, stages)["errors"]
    assert any(e.startswith(f"layers.0.attn:out: planned 0 x all_reduce (0 bytes) on rank {last_rank}") for e in errors)
    assert any(e.startswith("stage.0->1:activation: planned 8 x p2p") and "on rank 0" in e for e in errors)


def test_gradient_check_flags_a_stage_without_gradients():
    doc = compile_text(pp_spec())
    instructions = read_instructions(doc)
    good = {
        "stage": 0,
        "busy_s": [0.1, 0.1],
        "wall_s": [0.2, 0.2],
        "steps_without_gradient": [],
        "parameters_without_gradient": [],
        "parameters": 19,
    }
    broken = dict(good, stage=1, steps_without_gradient=[0, 1], parameters_without_gradient=["lm_head.weight"])
    section, errors = pipeline_section(doc, instructions, [good, broken])
    assert section["stages_without_gradient"] == [1] and section["idle_fraction_per_rank"] == [pytest.approx(0.5)] * 2
    assert errors == [
        "stage 1 (rank 1): none of its 19 parameters received a gradient in step(s) 0, 1; "
        "the backward did not reach this stage"
    ]
    one = dict(good, parameters_without_gradient=["layers.0.mlp.up_proj.weight"])
    assert pipeline_section(doc, instructions, [one, good | {"stage": 1}])[1] == [
        "stage 0 (rank 0): layers.0.mlp.up_proj.weight never received a non-zero gradient"
    ]


def test_pipeline_refusals(tmp_path):
    # the library session, a program that does not cover the step
    doc = compile_text(pp_spec())
    from mixle_compile.runtime.session import open_session

    with pytest.raises(RuntimeRefusal, match="runs its stage programs through `run`"):
        open_session(doc)
    # a program that skips a micro-batch is not replayed
    data = doc.model_dump(mode="json")
    stated = program_from(data["schedule"]["stages"][1])  # the body is what is edited here
    ops = [op for op in stated.run_ops() if not (op.kind == "forward" and op.microbatch == 3)]
    data["schedule"]["stages"][1] = program_dict(dataclasses.replace(stated, body=tuple(ops)))
    broken = type(doc).model_validate(data)
    with pytest.raises(RuntimeRefusal, match="for micro-batches \\[0, 1, 2\\]"):
        check_pipeline(broken, read_instructions(broken))

"""Stage programs stated with their repetition (lower/compact.py) against the explicit programs.

The oracle is the explicit builder the plan used before (every op of the step, copied here as it
was): on a grid of small cases the stated programs expand to exactly its programs, and the check
on the stated form gives the explicit check's verdict, also on programs broken on purpose.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import subprocess
import sys

import pytest

from mixle_compile.contracts import CollectiveKind, ParallelPlan
from mixle_compile.engines import engine_profile
from mixle_compile.lower.compact import (
    Loop,
    StageProgram,
    _without_compute,
    check_compact,
    compress,
    expand_all,
    program_dict,
    within_stage,
)
from mixle_compile.lower.groups import RankGrid, rule_name
from mixle_compile.lower.lowering import lower
from mixle_compile.lower.schedule import (
    Op,
    OpKind,
    check_schedule,
    collective,
    insert_collectives,
    pipeline_schedule,
)
from mixle_compile.lower.step import EXHAUSTIVE_RANKS
from mixle_compile.plan import FORMAT_VERSION, PlanError, content_digest, load_plan_text, plan_text
from mixle_compile.plan.artifact import _update_entry
from mixle_compile.plan.programs import plan_stage_programs
from mixle_compile.plan.rederive import PlanMismatch, rederive
from mixle_compile.spec import load_spec_text
from tests.conftest import ROOT
from tests.test_runtime_support import compile_text

COMPUTE = (OpKind.forward, OpKind.backward)

ANCHOR = {
    "gradient": "after_last_backward",
    "parameter": "end",
    "forward": "before_forward",
    "backward": "after_backward",
}


def explicit_programs(low, pipeline: str, virtual: int, engine):
    """The explicit step programs, built as the plan built them before it stated repetition."""
    plan, updates = low.plan, low.updates
    if plan.pp == 1:
        pipeline, virtual = "gpipe", 1
    per_run = engine.schedule_microbatches(plan.microbatches, plan.gradient_accumulation_steps)
    runs = plan.microbatches * plan.gradient_accumulation_steps // per_run
    one = pipeline_schedule(plan.pp, per_run, pipeline, virtual, family=engine.schedules)
    programs = []
    for program in one:
        body = [op for op in program if op.kind is not OpKind.optimizer]
        batches = 1 + max((op.batch for op in body if op.batch is not None), default=-1)
        ops = [
            dataclasses.replace(
                op,
                microbatch=None if op.microbatch is None else op.microbatch + r * per_run,
                batch=None if op.batch is None else op.batch + r * batches,
            )
            for r in range(runs)
            for op in body
        ]
        programs.append(tuple(ops) + tuple(op for op in program if op.kind is OpKind.optimizer))
    programs = tuple(programs)
    for phase, anchor in ANCHOR.items():
        for stage in range(plan.pp):
            copies = (lambda u: 1) if phase in ("forward", "backward") else (lambda u: u.occurrences_per_step)
            ops = [
                collective(
                    u.update.node_id,
                    rule_name(u.update.mesh_axes),
                    tag=u.update.collective.value,
                    bytes=u.payload_bytes,
                )
                for u in updates
                if u.phase == phase and u.stage == stage and u.update.collective is not CollectiveKind.P2P
                for _ in range(copies(u))
            ]
            if ops:
                programs = insert_collectives(programs, ops, at=anchor, stages=[stage])
    return programs


def spec(
    *, pp=2, mb=4, gas=1, schedule="1f1b", virtual=1, ds=1, tp=1, tie=False, backend="torch", layers=4, dopt=False
):
    world = pp * ds * tp
    text = f"""\
model: {{family: transformer, vocab_size: 128, hidden_size: 32, num_layers: {layers}, num_heads: 4, num_kv_heads: 2,
        ffn_hidden_size: 64, tie_embeddings: {str(tie).lower()}}}
mesh: {{pp: {pp}, dp_shard: {ds}, tp: {tp}, microbatches: {mb}, gradient_accumulation_steps: {gas}}}
training: {{global_batch_size: {2 * mb * ds * gas}, micro_batch_size: 2, seq_len: 16, pipeline_schedule: {schedule},
           virtual_pipeline_stages: {virtual}, sequence_parallel: {str(tp > 1).lower()}, \
distributed_optimizer: {str(dopt).lower()}}}
backend: {backend}
resources: {{devices: {world}, memory: 80GiB}}
"""
    loaded = load_spec_text(text, "spec.yaml")
    assert loaded.spec is not None, [d.text() for d in loaded.diagnostics]
    return loaded.spec


# (engine, accumulation, dp_shard, tied embeddings): torchtitan runs the schedule once per accumulation step
VARIANTS = (("torch", 1, 1, False), ("torchtitan", 3, 1, True), ("megatron", 2, 2, True))
GRID = [
    dict(pp=pp, mb=mb, gas=gas, schedule=schedule, virtual=virtual, backend=backend, ds=ds, tie=tie)
    for pp, mb, schedule, virtual, (backend, gas, ds, tie) in itertools.product(
        (1, 2, 4), (2, 4, 6), ("gpipe", "1f1b", "interleaved_1f1b"), (1, 2), VARIANTS
    )
    if (virtual == 1 or schedule == "interleaved_1f1b")
    and not (virtual > 1 and pp == 1)
    and not (pp == 1 and schedule != "gpipe")
]


def _cases():
    for case in GRID:
        s = spec(**case, layers=8 if case["virtual"] > 1 else 4)
        try:
            low = lower(s)
        except ValueError:
            continue  # numbers the engine's schedule refuses (check refuses the spec first)
        yield case, s, low


def test_stated_programs_expand_to_the_explicit_ones_and_check_the_same():
    compared = 0
    for case, s, low in _cases():
        engine = engine_profile(s.backend)
        old = explicit_programs(low, s.training.pipeline_schedule, s.training.virtual_pipeline_stages, engine)
        assert low.schedule.programs == old, case
        verdict = check_schedule(old, low.grid, exhaustive_limit=EXHAUSTIVE_RANKS, buffered_sends=engine.buffered_sends)
        assert low.schedule.check.ok == verdict.ok, case
        # the stated form round-trips through the plan's JSON: the bodies as written, the collectives
        # placed from the updates as written, by the rule the lowering built them by
        written = {"collectives": "by_phase", "stages": [program_dict(p) for p in low.schedule.stages]}
        updates = [_update_entry(u) for u in low.updates]
        read = plan_stage_programs(json.loads(json.dumps(written)), json.loads(json.dumps(updates)))
        assert read == low.schedule.stages
        compared += 1
    assert compared > 30


def _mutations(stages):
    """Programs broken (or not) on purpose, each a tuple of stage programs."""
    for s, p in enumerate(stages):

        def put(new, s=s):
            return stages[:s] + (new,) + stages[s + 1 :]

        for i, item in enumerate(p.body):
            yield put(dataclasses.replace(p, body=p.body[:i] + p.body[i + 1 :]))
            if isinstance(item, Loop):
                for repeat in (item.repeat - 1, item.repeat + 1):
                    if repeat >= 1:
                        yield put(
                            dataclasses.replace(
                                p, body=p.body[:i] + (dataclasses.replace(item, repeat=repeat),) + p.body[i + 1 :]
                            )
                        )
                if len(item.ops) > 1:
                    ops = item.ops[1:] + item.ops[:1]
                    yield put(
                        dataclasses.replace(
                            p, body=p.body[:i] + (dataclasses.replace(item, ops=ops),) + p.body[i + 1 :]
                        )
                    )
        if len(p.body) > 1:
            yield put(dataclasses.replace(p, body=p.body[1:] + p.body[:1]))
        # A forward or backward between two sends or receives of one batch (which it splits), and one
        # written into another stage's program: what the simulation, which passes over compute ops,
        # still depends on (lower/compact.py _without_compute).
        compute = next((op for op in p.body if not isinstance(op, Loop) and op.kind in COMPUTE), None)
        if compute is not None:
            for i in range(len(p.body) - 1):
                a, b = p.body[i], p.body[i + 1]
                if not isinstance(a, Loop) and not isinstance(b, Loop) and a.batch is not None and a.batch == b.batch:
                    yield put(dataclasses.replace(p, body=p.body[: i + 1] + (compute,) + p.body[i + 1 :]))
                    break
            if len(stages) > 1:
                elsewhere = dataclasses.replace(compute, stage=(s + 1) % len(stages))
                yield put(dataclasses.replace(p, body=tuple(elsewhere if op is compute else op for op in p.body)))
        yield put(dataclasses.replace(p, runs=p.runs + 1))
        if p.after_last_backward:
            (op, k), *rest = p.after_last_backward
            yield put(dataclasses.replace(p, after_last_backward=((op, k + 1), *rest)))
            yield put(dataclasses.replace(p, after_last_backward=tuple(rest)))
            for group in ("no_such_rule", "tied"):
                renamed = ((dataclasses.replace(op, group=group), k), *rest)
                yield put(dataclasses.replace(p, after_last_backward=renamed))
            if len(stages) > 1:  # a reduction written into another stage's program
                moved = ((dataclasses.replace(op, stage=(s + 1) % len(stages)), k), *rest)
                yield put(dataclasses.replace(p, after_last_backward=moved))
        if p.before_forward:
            yield put(dataclasses.replace(p, before_forward=p.before_forward[1:]))
            if len(stages) > 1:
                moved = dataclasses.replace(p.before_forward[0], stage=(s + 1) % len(stages))
                yield put(dataclasses.replace(p, before_forward=(moved, *p.before_forward[1:])))
            yield put(
                dataclasses.replace(
                    p, before_forward=p.before_forward[:1] + (dataclasses.replace(p.before_forward[0], group="tied"),)
                )
            )


@pytest.mark.parametrize(
    "case",
    [
        dict(pp=2, mb=4, schedule="1f1b", tie=True),
        dict(pp=4, mb=4, schedule="interleaved_1f1b", virtual=2, layers=8),
        dict(pp=2, mb=2, gas=3, schedule="gpipe", backend="torchtitan", tie=True),
        dict(pp=2, mb=4, schedule="1f1b", backend="megatron", ds=2, tie=True),
        # long enough that the check shortens the steady loops (lower/periodic.py)
        dict(pp=4, mb=24, schedule="1f1b", tie=True),
        dict(pp=2, mb=16, gas=2, schedule="gpipe", backend="torchtitan", tie=True),
        dict(pp=2, mb=16, schedule="interleaved_1f1b", virtual=2, layers=8, backend="megatron", tie=True),
    ],
)
@pytest.mark.parametrize("limit", [EXHAUSTIVE_RANKS, 1], ids=["every-rank", "one-rank-per-stage"])
def test_the_check_on_the_stated_form_gives_the_explicit_verdict_on_broken_programs(case, limit):
    s = spec(**case)
    low = lower(s)
    buffered = engine_profile(s.backend).buffered_sends
    verdicts = set()
    for mutated in _mutations(low.schedule.stages):
        try:
            explicit = check_schedule(expand_all(mutated), low.grid, exhaustive_limit=limit, buffered_sends=buffered).ok
        except ValueError:
            explicit = False
        try:
            stated = check_compact(mutated, low.grid, exhaustive_limit=limit, buffered_sends=buffered).ok
        except ValueError:
            stated = False
        assert stated == explicit, mutated
        verdicts.add(explicit)
    assert verdicts == {True, False}  # both kinds of mutation occurred


def test_compress_folds_repetition_and_unrolls_exactly():
    (program,) = pipeline_schedule(1, 64, "gpipe")
    body = [op for op in program if op.kind is not OpKind.optimizer]
    folded = compress(body)
    assert len(folded) == 2 and all(isinstance(item, Loop) and item.repeat == 64 for item in folded)
    for stage in pipeline_schedule(4, 32, "1f1b"):
        ops = [op for op in stage if op.kind is not OpKind.optimizer]
        stated = compress(ops)
        assert len(stated) <= 8
        assert [op for item in stated for op in (item.unrolled() if isinstance(item, Loop) else [item])] == ops


def _schedule_bytes(**case) -> tuple[int, int]:
    doc = compile_text(_spec_text(**case)).model_dump(mode="json")
    return len(json.dumps(doc["schedule"])), len(plan_text(doc))


def _spec_text(*, pp, mb, gas):
    return f"""\
model: {{family: transformer, vocab_size: 128, hidden_size: 32, num_layers: 4, num_heads: 4, num_kv_heads: 2, \
ffn_hidden_size: 64}}
mesh: {{pp: {pp}, dp_shard: 2, microbatches: {mb}, gradient_accumulation_steps: {gas}}}
training: {{global_batch_size: {4 * mb * gas}, micro_batch_size: 2, seq_len: 16, pipeline_schedule: 1f1b}}
backend: torch
resources: {{devices: {2 * pp}, memory: 80GiB}}
"""


def test_plan_size_does_not_grow_with_micro_batches_or_accumulation():
    small_schedule, small_plan = _schedule_bytes(pp=2, mb=4, gas=1)
    for case in (dict(pp=2, mb=128, gas=1), dict(pp=2, mb=4, gas=64)):
        schedule, whole = _schedule_bytes(**case)
        # the same programs (a short step unrolls an op or two that a long one loops); only numbers (repeat
        # counts, occurrences) have more digits. Listed op by op, 124 more micro-batches would be ~70 KB.
        assert schedule < small_schedule + 512 and whole < 1.05 * small_plan, case


def _resealed(data: dict):
    data = copy.deepcopy(data)
    data["content_digest"] = content_digest(data)
    return load_plan_text(plan_text(data), "resealed.plan.json")


def _first_loop(data):
    return next(item for stage in data["schedule"]["stages"] for item in stage["body"] if "repeat" in item)


def _moved_reduction(d):
    """The first gradient reduction moved to after the optimizer: where a collective runs is its phase."""
    update = next(u for u in d["updates"] if u["phase"] == "gradient" and u["collective"] != "p2p")
    update["phase"] = "parameter"


@pytest.mark.parametrize(
    ("edit", "where"),
    [
        (lambda d: _first_loop(d).update(repeat=_first_loop(d)["repeat"] + 1), "schedule.stages"),
        (lambda d: d["schedule"]["stages"][0]["body"].pop(0), "schedule.stages"),
        (lambda d: d["schedule"]["stages"][0].update(runs=2), "schedule.stages"),
        (lambda d: d["schedule"].update(collectives="in_body"), "schedule.collectives"),
        (_moved_reduction, r"updates\[\d+ embed\.weight:grad/scatter\]\.phase"),
    ],
)
def test_an_edited_stated_schedule_is_caught(edit, where):
    data = compile_text(_spec_text(pp=2, mb=4, gas=2)).model_dump(mode="json")
    edited = copy.deepcopy(data)
    edit(edited)
    text = plan_text(edited)
    with pytest.raises(PlanError, match="digest mismatch"):
        load_plan_text(text, "edited.plan.json")
    with pytest.raises(PlanMismatch, match=where):
        rederive(_resealed(edited))


def test_an_old_format_plan_is_refused_with_how_to_fix(tmp_path):
    data = compile_text(_spec_text(pp=2, mb=4, gas=1)).model_dump(mode="json")
    data["format_version"] = FORMAT_VERSION - 1
    data["content_digest"] = content_digest(data)
    path = tmp_path / "old.plan.json"
    path.write_text(plan_text(data))
    with pytest.raises(PlanError, match=f"old plan format {FORMAT_VERSION - 1}.*recompile"):
        load_plan_text(path.read_text())
    for verb in ("explain", "run"):
        done = subprocess.run(
            [sys.executable, "-m", "mixle_compile", verb, str(path)], capture_output=True, text=True, cwd=ROOT
        )
        assert done.returncode == 2, (verb, done.stderr)
        assert "recompile" in done.stderr and "Traceback" not in done.stderr


def test_a_rule_is_inside_a_stage_by_the_coordinates_it_spans():
    low = lower(spec(pp=2, ds=2, tp=2, tie=True))
    assert within_stage(low.grid, "dp_shard") and within_stage(low.grid, "tp")
    assert not within_stage(low.grid, "pp")
    assert not within_stage(low.grid, "embedding")  # the tied weights' rule, named for what it joins
    assert not within_stage(low.grid, "no_such_rule")


@pytest.mark.parametrize(
    "path",
    [
        "examples/pipeline/pp2-tp2-sequence-parallel.yaml",
        "examples/mixtral-moe-ep.yaml",  # a distributed optimizer: gathers after the optimizer
        "examples/llama3-8b-hsdp-tp.yaml",  # FSDP under accumulation: reductions issued several times
        "examples/gaussian-mixture.yaml",  # an EM step: its collectives in its body
    ],
)
def test_a_read_plan_runs_every_collective_where_the_lowering_put_it(path):
    """What the runtime executes (the programs read from the plan's text, their collectives placed
    from its updates) is, op for op, the step the lowering built and checked with every block listed."""
    from mixle_compile.compile import compile_file
    from mixle_compile.plan.programs import plan_programs
    from mixle_compile.spec import load_spec

    result = compile_file(ROOT / path)
    doc = load_plan_text(result.text)
    every_block = lower(load_spec(ROOT / path).spec, each_layer=True)
    read = plan_programs(doc.schedule, doc.updates)
    assert read == every_block.schedule.programs
    collectives = [op for program in read for op in program if op.kind is OpKind.collective]
    assert collectives, path
    assert doc.schedule.collectives == ("in_body" if "mixture" in path else "by_phase")
    if doc.schedule.collectives == "by_phase":  # the programs as written name no collective
        assert not any(
            op.kind == "collective"
            for stage in doc.schedule.stages
            for item in stage.body
            for op in (item.ops if hasattr(item, "ops") else [item])
        )


def test_an_update_with_an_unknown_phase_is_refused_before_running():
    from mixle_compile.runtime.errors import RuntimeRefusal
    from mixle_compile.runtime.instructions import read_instructions
    from mixle_compile.runtime.pipeline_plan import check_pipeline

    doc = compile_text(_spec_text(pp=2, mb=4, gas=1))
    data = doc.model_dump(mode="json")
    update = next(u for u in data["updates"] if u["collective"] != "p2p")
    update["phase"] = "sometime"
    broken = type(doc).model_validate(data)
    with pytest.raises(RuntimeRefusal, match="phase 'sometime'.*forward"):
        check_pipeline(broken, read_instructions(broken))


@pytest.mark.parametrize(
    "ds,mb,left_out,shorter",
    [
        (16, 2, True, False),  # one rank per stage: FSDP's reductions inside a stage left out, no long loop
        (16, 16, True, True),  # ... and the steady loops checked on a shorter step
        (2, 16, False, True),  # rank by rank: nothing left out, even on a shorter step
    ],
)
def test_the_check_says_what_it_left_out_and_only_that(ds, mb, left_out, shorter):
    low = lower(spec(pp=2, ds=ds, mb=mb))
    note = low.schedule.check.note
    assert low.schedule.check.ok and low.schedule.check.representatives == (2 * ds > EXHAUSTIVE_RANKS)
    assert ("the step's collectives inside a stage, each with one checked rank, left out" in note) == left_out
    assert ("micro-batches shorter" in note) == shorter


def _stage(stage: int, *ops_or_loops) -> StageProgram:
    return StageProgram(stage=stage, body=tuple(ops_or_loops), optimizer=False)


def _p2p(kind: OpKind, stage: int, peer: int, batch: int, microbatch: int = 0) -> Op:
    tag = "activation" if (kind is OpKind.send) == (peer > stage) else "activation_grad"
    return Op(kind, stage, microbatch=microbatch, peer=peer, batch=batch, tag=tag, name=kind.value)


def test_a_compute_op_between_two_messages_of_one_batch_splits_it_in_the_check():
    """Stage 0 posts its send, computes, then posts its receive: two calls although one batch number,
    so with blocking sends each stage's send waits for a receive the other posts only later. One call
    of both (the compute op left out) would finish: the check must not leave it out here."""
    forward = Op(OpKind.forward, 0, microbatch=0, name="forward")
    split = (
        _stage(0, _p2p(OpKind.send, 0, 1, 0), forward, _p2p(OpKind.recv, 0, 1, 0)),
        _stage(1, _p2p(OpKind.send, 1, 0, 0), _p2p(OpKind.recv, 1, 0, 1)),
    )
    grid = RankGrid.from_plan(ParallelPlan(pp=2))
    explicit = check_schedule(expand_all(split), grid, exhaustive_limit=EXHAUSTIVE_RANKS, buffered_sends=False)
    stated = check_compact(split, grid, exhaustive_limit=EXHAUSTIVE_RANKS, buffered_sends=False)
    assert not explicit.ok and "deadlock" in " ".join(explicit.problems)
    assert stated.problems == explicit.problems
    joined = (_stage(0, _p2p(OpKind.send, 0, 1, 0), _p2p(OpKind.recv, 0, 1, 0), forward), split[1])
    assert check_compact(joined, grid, exhaustive_limit=EXHAUSTIVE_RANKS, buffered_sends=False).ok


def test_a_step_that_fails_without_its_compute_ops_is_reported_with_its_own_positions():
    forward = Op(OpKind.forward, 0, microbatch=0, name="forward")
    backward = Op(OpKind.backward, 1, microbatch=1, name="backward")
    wrong = (  # the receive expects micro-batch 1
        _stage(0, forward, _p2p(OpKind.send, 0, 1, 0)),
        _stage(1, _p2p(OpKind.recv, 1, 0, 0, microbatch=1), backward),
    )
    grid = RankGrid.from_plan(ParallelPlan(pp=2))
    explicit = check_schedule(expand_all(wrong), grid, exhaustive_limit=EXHAUSTIVE_RANKS, buffered_sends=True)
    assert any("rank 0 op 1 " in problem for problem in explicit.problems)  # the send, after the forward
    assert _without_compute(wrong[0]) is not None and _without_compute(wrong[1]) is not None
    assert check_compact(wrong, grid, exhaustive_limit=EXHAUSTIVE_RANKS, buffered_sends=True).problems == (
        explicit.problems
    )


@pytest.mark.parametrize(
    "body,kept",
    [
        # a loop's repetitions joined across the compute op that ends each (batch step 0)
        ((Loop(3, 1, 0, (_p2p(OpKind.send, 0, 1, 0), Op(OpKind.forward, 0, microbatch=0, name="forward"))),), False),
        # ... but a batch step of 1 numbers every repetition's call apart
        ((Loop(3, 1, 1, (_p2p(OpKind.send, 0, 1, 0), Op(OpKind.forward, 0, microbatch=0, name="forward"))),), True),
        # a loop of compute ops only would be left empty
        ((_p2p(OpKind.send, 0, 1, 0), Loop(2, 1, 0, (Op(OpKind.forward, 0, microbatch=0, name="forward"),))), False),
        # a compute op of another stage is checked where it is issued
        ((_p2p(OpKind.send, 0, 1, 0), Op(OpKind.forward, 1, microbatch=0, name="forward")), False),
        # the previous item's last call and the loop's first, one batch apart across a compute op
        (
            (
                _p2p(OpKind.send, 0, 1, 0),
                Loop(2, 1, 1, (Op(OpKind.forward, 0, microbatch=0, name="forward"), _p2p(OpKind.send, 0, 1, 0))),
            ),
            False,
        ),
        # the loop's last repetition's call and the next item's, across a compute op
        (
            (
                Loop(2, 1, 1, (_p2p(OpKind.send, 0, 1, 0), Op(OpKind.forward, 0, microbatch=0, name="forward"))),
                _p2p(OpKind.recv, 0, 1, 1),
            ),
            False,
        ),
        (
            (
                Loop(2, 1, 1, (_p2p(OpKind.send, 0, 1, 0), Op(OpKind.forward, 0, microbatch=0, name="forward"))),
                _p2p(OpKind.recv, 0, 1, 2),
            ),
            True,
        ),
    ],
)
def test_compute_ops_are_left_out_of_the_simulation_only_where_that_decides_the_same(body, kept):
    program = _stage(0, *body)
    lean = _without_compute(program)
    assert (lean is not None) == kept
    if lean is not None:
        ops = [op for item in lean.body for op in (item.ops if isinstance(item, Loop) else (item,))]
        assert not any(op.kind in COMPUTE for op in ops)
        assert [op for op in expand_all((program,))[0] if op.kind not in COMPUTE] == list(expand_all((lean,))[0])


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_a_large_world_simulates_its_messages_without_its_compute_ops(schedule, virtual, monkeypatch):
    """On one rank per stage, every collective of a block and every gradient reduction lies inside a
    stage and is left out, and so are the forwards and backwards: the step simulated is its sends and
    receives only (the check's cost at pp 16 is that step's)."""
    import mixle_compile.lower.compact as compact

    simulated = []

    def watched(programs, *args, **kwargs):
        simulated.append(programs)
        return check_schedule(programs, *args, **kwargs)

    monkeypatch.setattr(compact, "check_schedule", watched)
    low = lower(spec(pp=4, mb=16, ds=8, schedule=schedule, virtual=virtual, layers=8))
    assert low.schedule.check.ok and low.schedule.check.representatives
    assert simulated and all(
        op.kind in (OpKind.send, OpKind.recv, OpKind.optimizer) for programs in simulated for p in programs for op in p
    )

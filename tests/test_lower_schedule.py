"""Pipeline schedules and the deadlock checker: correct schedules pass, broken ones are caught."""

from __future__ import annotations

import dataclasses
from collections import Counter
from fractions import Fraction

import pytest

from mixle_compile.contracts import ParallelPlan
from mixle_compile.lower.groups import RankGrid
from mixle_compile.lower.schedule import (
    ACTIVATION,
    ACTIVATION_GRAD,
    Op,
    OpKind,
    bubble_fraction,
    check_schedule,
    collective,
    insert_collectives,
    pipeline_schedule,
    rank_programs,
    schedule_bubble,
    simulate_schedule,
)

CASES = (
    [("gpipe", pp, m, 1) for pp in (1, 2, 3, 4) for m in (1, 2, 3, 5, 8)]
    + [("1f1b", pp, m, 1) for pp in (1, 2, 3, 4) for m in (4, 5, 8) if m >= pp]
    + [("interleaved_1f1b", pp, m, v) for pp in (2, 3, 4) for m in (pp, 2 * pp, 3 * pp) for v in (2, 3)]
)


def compute_units(program):
    return [(op.kind, op.chunk, op.microbatch) for op in program if op.kind in (OpKind.forward, OpKind.backward)]


# ---------------------------------------------------------------------------
# Correct schedules
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("schedule,pp,m,v", CASES)
def test_correct_schedules_pass_and_do_all_the_work(schedule, pp, m, v):
    programs = pipeline_schedule(pp, m, schedule, v)
    assert len(programs) == pp
    result = check_schedule(programs)
    assert result.problems == ()
    assert result.ok and result.ranks_checked == pp and not result.representatives
    for stage, program in enumerate(programs):
        units = compute_units(program)
        # every chunk's forward and backward of every microbatch, once, forward first
        assert Counter(units) == Counter(
            (kind, c, i) for kind in (OpKind.forward, OpKind.backward) for c in range(v) for i in range(m)
        )
        for c in range(v):
            for i in range(m):
                assert units.index((OpKind.forward, c, i)) < units.index((OpKind.backward, c, i))
        assert all(op.stage == stage for op in program)
        assert program[-1].kind is OpKind.optimizer


@pytest.mark.parametrize("schedule,pp,m,v", CASES)
def test_simulated_bubble_matches_the_formula(schedule, pp, m, v):
    # unit forwards, two-unit backwards; a chunk holds 1/v of the layers
    programs = pipeline_schedule(pp, m, schedule, v)
    bubble = schedule_bubble(programs, forward_cost=Fraction(1, v), backward_cost=Fraction(2, v))
    assert bubble == pytest.approx(bubble_fraction(pp, m, v), abs=1e-12)
    # the formula holds with equal costs too
    assert schedule_bubble(programs, forward_cost=1, backward_cost=1) == pytest.approx(bubble_fraction(pp, m, v))


def test_bubble_formula_values():
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)
    # interleaving shrinks the bubble of the emitted schedule, as the formula says
    plain = schedule_bubble(pipeline_schedule(4, 8, "1f1b"))
    interleaved = schedule_bubble(
        pipeline_schedule(4, 8, "interleaved_1f1b", 2), forward_cost=Fraction(1, 2), backward_cost=1
    )
    assert interleaved < plain


def test_1f1b_steady_state_alternates_and_limits_microbatches_in_flight():
    pp, m = 4, 8
    for stage, program in enumerate(pipeline_schedule(pp, m, "1f1b")):
        units = compute_units(program)
        warmup = pp - stage - 1
        assert [k for k, _, _ in units[:warmup]] == [OpKind.forward] * warmup
        steady = [k for k, _, _ in units[warmup : warmup + 2 * (m - warmup)]]
        assert steady == [OpKind.forward, OpKind.backward] * (m - warmup)
        in_flight = peak = 0
        for kind, _, _ in units:
            in_flight += 1 if kind is OpKind.forward else -1
            peak = max(peak, in_flight)
        assert peak == pp - stage  # versus m under gpipe


def test_sends_and_receives_connect_adjacent_stages_and_wrap_across_chunks():
    programs = pipeline_schedule(2, 2, "interleaved_1f1b", 2)
    last_sends = {(op.tag, op.peer, op.chunk, op.peer_chunk) for op in programs[1] if op.kind is OpKind.send}
    # stage 1 chunk 0 feeds stage 0 chunk 1 (the wrap); chunk 1's gradient goes back to stage 0 chunk 1
    assert (ACTIVATION, 0, 0, 1) in last_sends
    assert (ACTIVATION_GRAD, 0, 1, 1) in last_sends
    first_recvs = {(op.tag, op.peer, op.chunk, op.peer_chunk) for op in programs[0] if op.kind is OpKind.recv}
    assert (ACTIVATION, 1, 1, 0) in first_recvs
    # the model's two ends talk to nobody
    assert not any(op.kind is OpKind.recv and op.tag == ACTIVATION and op.chunk == 0 for op in programs[0])
    assert not any(op.kind is OpKind.send and op.tag == ACTIVATION and op.chunk == 1 for op in programs[1])


def test_activation_bytes_travel_on_every_message():
    programs = pipeline_schedule(3, 3, "1f1b", activation_bytes=4096)
    messages = [op for p in programs for op in p if op.kind in (OpKind.send, OpKind.recv)]
    assert messages and all(op.bytes == 4096 for op in messages)
    assert len(messages) == 2 * 2 * 2 * 3  # 2 boundaries, both directions, send+recv, 3 microbatches


# ---------------------------------------------------------------------------
# Rejected schedules
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,family,message",
    [
        ((4, 3, "1f1b"), "torch", "P003: 3 micro-batches for pp=4 stages"),
        ((4, 9, "interleaved_1f1b", 2), "torch", "P005: 9 micro-batches over pp=4 make 2 rounds"),
        ((4, 6, "interleaved_1f1b", 2), "megatron", "P004: 6 micro-batches do not form whole groups of pp=4"),
        ((1, 4, "interleaved_1f1b", 2), "torch", "pp > 1"),
        ((4, 8, "1f1b", 2), "torch", "needs pipeline_schedule interleaved_1f1b"),
        ((4, 8, "zero_bubble"), "torch", "unknown pipeline schedule"),
        ((4, 8, "gpipe"), "deepspeed", "unknown schedule family"),
        ((0, 8, "gpipe"), "torch", "pp must be an integer >= 1"),
    ],
)
def test_invalid_schedules_are_rejected(args, family, message):
    with pytest.raises(ValueError, match=message):
        pipeline_schedule(*args, family=family)


@pytest.mark.parametrize(
    "args,family",
    [
        ((4, 3, "1f1b"), "megatron"),  # Megatron's 1F1B warms up min(pp - rank - 1, m)
        ((4, 6, "interleaved_1f1b", 2), "torch"),  # one round of 6
        ((4, 10, "interleaved_1f1b", 2), "torch"),  # two rounds of 5
        ((4, 3, "interleaved_1f1b", 2), "torch"),  # fewer micro-batches than stages
        ((4, 8, "interleaved_1f1b", 1), "torch"),  # one stage per rank
        ((4, 3, "interleaved_1f1b", 1), "megatron"),  # no virtual stages: Megatron runs 1F1B
    ],
)
def test_engine_schedules_the_engine_accepts_build_and_cannot_deadlock(args, family):
    programs = pipeline_schedule(*args, family=family)
    assert check_schedule(programs, buffered_sends=family == "torch").ok


def test_gpipe_accepts_fewer_microbatches_than_stages():
    assert check_schedule(pipeline_schedule(4, 2, "gpipe")).ok


# ---------------------------------------------------------------------------
# Broken schedules are caught
# ---------------------------------------------------------------------------


def without(program, predicate):
    """The program without the first op matching ``predicate``."""
    index = next(i for i, op in enumerate(program) if predicate(op))
    return program[:index] + program[index + 1 :]


def replace_first(program, predicate, **changes):
    index = next(i for i, op in enumerate(program) if predicate(op))
    return program[:index] + (dataclasses.replace(program[index], **changes),) + program[index + 1 :]


def test_a_missing_recv_is_caught():
    programs = list(pipeline_schedule(3, 4, "1f1b"))
    programs[2] = without(programs[2], lambda op: op.kind is OpKind.recv and op.microbatch == 1)
    result = check_schedule(programs)
    assert any("rank 1" in p and "no matching recv on rank 2" in p and "mb 1" in p for p in result.problems)


def test_a_send_with_the_wrong_tag_is_caught():
    programs = list(pipeline_schedule(2, 2, "gpipe"))
    programs[0] = replace_first(programs[0], lambda op: op.kind is OpKind.send, tag=ACTIVATION_GRAD)
    result = check_schedule(programs)
    assert any("no matching recv" in p and "'activation_grad'" in p for p in result.problems)
    assert any("no matching send" in p and "'activation'" in p for p in result.problems)


def test_messages_received_out_of_order_are_caught():
    # NCCL pairs messages between two ranks in issue order, whatever their tags
    programs = list(pipeline_schedule(2, 2, "gpipe"))
    sends = [i for i, op in enumerate(programs[0]) if op.kind is OpKind.send]
    p = list(programs[0])
    p[sends[0]], p[sends[1]] = (
        dataclasses.replace(p[sends[1]], batch=p[sends[0]].batch),
        dataclasses.replace(p[sends[0]], batch=p[sends[1]].batch),
    )
    programs[0] = tuple(p)
    result = check_schedule(programs)
    assert any("out of order" in p for p in result.problems)


def test_two_stages_issuing_collectives_in_different_orders_deadlock():
    # The classic: stage 0 reduces the tied embedding then joins a pipeline-wide
    # reduction; the last stage does it the other way round.
    pp = 3
    grid = RankGrid.from_plan(ParallelPlan(pp=pp, dp_shard=2))
    tied, loss = collective("all_reduce", "embedding", "tied"), collective("all_reduce", "pp", "loss")
    programs = pipeline_schedule(pp, 3, "1f1b")
    programs = insert_collectives(programs, [tied, loss], at="after_last_backward", stages=[0])
    programs = insert_collectives(programs, [loss], at="after_last_backward", stages=[1])
    programs = insert_collectives(programs, [loss, tied], at="after_last_backward", stages=[pp - 1])
    result = check_schedule(programs, grid)
    # each group instance sees consistent sequences; only the simulation finds the cycle
    assert not any("same collectives" in p for p in result.problems)
    cycle = next(p for p in result.problems if p.startswith("deadlock: a cycle of waits"))
    assert "rank 0 (stage 0) waits in collective all_reduce on embedding 'tied'" in cycle
    assert "rank 4 (stage 2) waits in collective all_reduce on pp 'loss'" in cycle
    # in the right order the same step finishes
    fixed = insert_collectives(pipeline_schedule(pp, 3, "1f1b"), [loss], at="after_last_backward")
    fixed = insert_collectives(fixed, [tied], at="after_last_backward", stages=[0, pp - 1])
    assert check_schedule(fixed, grid).ok


def test_a_group_member_skipping_a_collective_is_caught():
    grid = RankGrid.from_plan(ParallelPlan(pp=2, dp_shard=2))
    reduce = collective("all_reduce", "dp_replicate+dp_shard+cp", "grads")
    programs = insert_collectives(pipeline_schedule(2, 2, "1f1b"), [reduce], at="after_last_backward")
    per_rank = rank_programs(programs, grid)
    per_rank[3] = without(per_rank[3], lambda op: op.kind is OpKind.collective)
    result = check_schedule(per_rank, grid)
    assert any(
        "group dp_replicate+dp_shard+cp #1 (ranks 2, 3)" in p
        and "all_reduce 'grads' on rank 2 but missing on rank 3" in p
        for p in result.problems
    )
    assert any(
        "rank 2 (stage 1) waits in collective all_reduce" in p and "for rank 3, which has finished" in p
        for p in result.problems
    )


def test_collectives_with_different_tags_are_caught():
    grid = RankGrid.from_plan(ParallelPlan(dp_shard=2))
    per_rank = {
        0: (Op("collective", 0, name="all_reduce", group="dp_shard", tag="w1"),),
        1: (Op("collective", 0, name="all_reduce", group="dp_shard", tag="w2"),),
    }
    result = check_schedule(per_rank, grid)
    assert any("all_reduce 'w1' on rank 0 but all_reduce 'w2' on rank 1" in p for p in result.problems)


def test_a_tied_reduction_before_the_last_gradient_send_deadlocks():
    # Reducing the tied embedding right after the last stage's final backward,
    # before it sends that gradient down, waits for stage 0, which waits for it.
    pp = 3
    tied = collective("all_reduce", "embedding", "tied")
    programs = insert_collectives(pipeline_schedule(pp, 3, "1f1b"), [tied], at="after_last_backward", stages=[0])
    programs = insert_collectives(
        programs, [tied], at="after_backward", stages=[pp - 1], where=lambda op: op.microbatch == 2
    )
    result = check_schedule(programs)
    assert any(p.startswith("deadlock: a cycle of waits") for p in result.problems)
    assert "3 ranks cannot finish" in result.problems[-1]


def test_unbatched_sends_in_both_directions_deadlock_but_a_batched_pair_does_not():
    # the model is rendezvous: a send waits for its receive to be posted
    def pair(first_batch, second_batch):
        return (
            (
                Op("send", 0, 0, 0, tag="x", peer=1, batch=first_batch),
                Op("recv", 0, 0, 0, tag="y", peer=1, batch=first_batch),
            ),
            (
                Op("send", 1, 0, 0, tag="y", peer=0, batch=second_batch),
                Op("recv", 1, 0, 0, tag="x", peer=0, batch=second_batch),
            ),
        )

    blocked = check_schedule(pair(None, None))
    assert any("cycle of waits" in p for p in blocked.problems)
    assert check_schedule(pair(0, 0)).ok


def test_ops_on_the_wrong_stage_or_unknown_groups_are_caught():
    programs = list(pipeline_schedule(2, 2, "gpipe"))
    programs[1] = (Op("forward", 0, 0, 0),) + programs[1]
    programs[0] = programs[0] + (collective("all_reduce", "nonsense_axis"),)
    problems = check_schedule(programs).problems
    assert any("belongs to stage 0, but rank 1 is on stage 1" in p for p in problems)
    assert any("unknown group rule 'nonsense_axis'" in p for p in problems)
    # a receive written with another stage's number, after a receive from the same peer: each op's own
    # stage is checked, not only the first op's towards each peer
    programs = list(pipeline_schedule(2, 2, "gpipe"))
    last = max(i for i, op in enumerate(programs[1]) if op.kind is OpKind.recv)
    programs[1] = programs[1][:last] + (dataclasses.replace(programs[1][last], stage=0),) + programs[1][last + 1 :]
    problems = check_schedule(programs).problems
    assert any(f"op {last} " in p and "belongs to stage 0, but rank 1 is on stage 1" in p for p in problems)
    middle = insert_collectives(
        pipeline_schedule(3, 3, "gpipe"), [collective("all_reduce", "embedding")], at="end", stages=[1]
    )
    assert any("rank 1 is in no group of rule 'embedding'" in p for p in check_schedule(middle).problems)


# ---------------------------------------------------------------------------
# Collectives, concrete ranks, representatives
# ---------------------------------------------------------------------------


def full_step(pp, m, schedule, v=1):
    gather = collective("all_gather", "dp_shard+cp", "params")
    scatter = collective("reduce_scatter", "dp_shard+cp", "grads")
    reduce = collective("all_reduce", "dp_replicate", "grads")
    tied = collective("all_reduce", "embedding", "tied")
    programs = pipeline_schedule(pp, m, schedule, v)
    programs = insert_collectives(programs, [gather], at="before_forward")
    programs = insert_collectives(programs, [tied], at="after_last_backward", stages=sorted({0, pp - 1}))
    programs = insert_collectives(programs, [scatter, reduce], at="after_last_backward")
    return programs


def test_insert_collectives_places_them_where_asked_and_keeps_call_order():
    programs = full_step(3, 3, "1f1b")
    for stage, program in enumerate(programs):
        kinds = [(op.name, op.tag) for op in program if op.kind is OpKind.collective]
        tail = [("reduce_scatter", "grads"), ("all_reduce", "grads")]
        head = [("all_reduce", "tied")] if stage in (0, 2) else []
        assert kinds[-3 if head else -2 :] == head + tail
        # one gather right before each forward, carrying its microbatch
        for i, op in enumerate(program):
            if op.kind is OpKind.forward:
                assert program[i - 1].name == "all_gather" and program[i - 1].microbatch == op.microbatch
        assert program[-1].kind is OpKind.optimizer
        last_backward = max(i for i, op in enumerate(program) if op.kind is OpKind.backward)
        after = [op.kind for op in program[last_backward + 1 :]]
        # only the final gradient send may come between the last backward and the reductions
        assert after[: after.index(OpKind.collective)] in ([], [OpKind.send])
    with pytest.raises(ValueError, match="unknown anchor"):
        insert_collectives(programs, [], at="whenever")
    with pytest.raises(ValueError, match="collectives only"):
        insert_collectives(programs, [Op("forward", 0)], at="end")


@pytest.mark.parametrize("schedule,pp,m,v", [("gpipe", 2, 3, 1), ("1f1b", 4, 4, 1), ("interleaved_1f1b", 2, 4, 2)])
def test_full_steps_on_a_real_grid_pass_exhaustively_and_by_representatives(schedule, pp, m, v):
    grid = RankGrid.from_plan(ParallelPlan(pp=pp, dp_shard=2, dp_replicate=2, cp=2, tp=2))
    programs = full_step(pp, m, schedule, v)
    exact = check_schedule(programs, grid)
    assert exact.ok and exact.ranks_checked == grid.world_size and not exact.representatives
    reps = check_schedule(programs, grid, exhaustive_limit=0)
    assert reps.ok and reps.ranks_checked == pp and reps.representatives
    assert "representative" in reps.note


def test_representatives_find_the_same_deadlock_as_the_exhaustive_check():
    grid = RankGrid.from_plan(ParallelPlan(pp=3, dp_shard=2, tp=2))
    tied, loss = collective("all_reduce", "embedding", "tied"), collective("all_reduce", "tp+pp", "loss")
    programs = pipeline_schedule(3, 3, "1f1b")
    programs = insert_collectives(programs, [tied, loss], at="end", stages=[0])
    programs = insert_collectives(programs, [loss], at="end", stages=[1])
    programs = insert_collectives(programs, [loss, tied], at="end", stages=[2])
    exact = check_schedule(programs, grid)
    reps = check_schedule(programs, grid, exhaustive_limit=0)
    assert any("cycle of waits" in p for p in exact.problems)
    assert any("cycle of waits" in p for p in reps.problems)
    assert reps.representatives and reps.ranks_checked == 3


def test_a_131072_rank_step_is_checked_by_representatives():
    grid = RankGrid.from_plan(ParallelPlan(tp=8, cp=2, dp_shard=64, dp_replicate=8, pp=16, ep=8))
    programs = full_step(16, 32, "interleaved_1f1b", 2)
    result = check_schedule(programs, grid)
    assert result.ok and result.representatives and result.ranks_checked == 16


def test_simulation_reports_the_makespan():
    sim = simulate_schedule(pipeline_schedule(4, 8, "gpipe"), forward_cost=1, backward_cost=2)
    assert sim.finished and sim.makespan == (8 + 3) * 3
    assert all(busy == 8 * 3 for busy in sim.busy.values())


def test_per_rank_programs_must_cover_the_world():
    grid = RankGrid.from_plan(ParallelPlan(pp=2, dp_shard=2))
    per_rank = rank_programs(pipeline_schedule(2, 2, "gpipe"), grid)
    del per_rank[3]
    with pytest.raises(ValueError, match="must cover ranks 0..3"):
        check_schedule(per_rank, grid)

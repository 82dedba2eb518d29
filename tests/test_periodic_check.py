"""The schedule check decided on a shorter step (lower/periodic.py) against the full step's check.

The oracle is :func:`check_schedule` on every op of the full step. Programs are the pipeline
schedules themselves and copies broken on purpose (a loop's body rotated or two of its ops swapped,
a loop one repetition longer or shorter, a loop's micro-batch step changed, a stretch moved), with
rendezvous and buffered sends; the shortened check must give the full check's verdict on each, and
it must really shorten the valid ones.
"""

from __future__ import annotations

import dataclasses

from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from mixle_compile.contracts import ParallelPlan
from mixle_compile.lower.compact import Loop, StageProgram, check_compact, expand_all
from mixle_compile.lower.groups import RankGrid
from mixle_compile.lower.periodic import check_pumped
from mixle_compile.lower.schedule import check_schedule, pipeline_bodies
from mixle_compile.plan.programs import expand


def _programs(pp: int, m: int, schedule: str, v: int) -> tuple[StageProgram, ...]:
    return tuple(
        StageProgram(stage=s, body=body, optimizer=False) for s, body in enumerate(pipeline_bodies(pp, m, schedule, v))
    )


def _verdicts(programs, grid, buffered: bool) -> tuple[bool, bool, int]:
    """(full check ok, shortened check ok, micro-batches the shortened check left out)."""
    full = check_schedule(expand_all(programs), grid, exhaustive_limit=64, buffered_sends=buffered)

    def simulated(stated, observe):
        return check_schedule(
            [expand(p) for p in stated], grid, exhaustive_limit=64, buffered_sends=buffered, observe=observe
        )

    short, left_out = check_pumped(programs, simulated, grid, expand)
    return full.ok, short.ok, left_out


def _mutate(programs, data) -> tuple[StageProgram, ...]:
    stage = data.draw(st.integers(0, len(programs) - 1))
    p = programs[stage]
    loops = [i for i, item in enumerate(p.body) if isinstance(item, Loop)]
    how = data.draw(st.sampled_from(["rotate", "swap", "repeat", "step", "move", "none"]))
    body = list(p.body)
    if how in ("rotate", "swap", "repeat", "step") and loops:
        i = data.draw(st.sampled_from(loops))
        loop = body[i]
        ops = list(loop.ops)
        if how == "rotate" and len(ops) > 1:
            ops = ops[1:] + ops[:1]
        elif how == "swap" and len(ops) > 1:
            j = data.draw(st.integers(0, len(ops) - 2))
            ops[j], ops[j + 1] = ops[j + 1], ops[j]
        elif how == "repeat":
            loop = dataclasses.replace(loop, repeat=max(1, loop.repeat + data.draw(st.sampled_from([-1, 1]))))
        elif how == "step":
            loop = dataclasses.replace(loop, microbatch_step=loop.microbatch_step + 1)
        body[i] = dataclasses.replace(loop, ops=tuple(ops))
    elif how == "move" and len(body) > 2:
        j = data.draw(st.integers(0, len(body) - 2))
        body[j], body[j + 1] = body[j + 1], body[j]
    return programs[:stage] + (dataclasses.replace(p, body=tuple(body)),) + programs[stage + 1 :]


@settings(max_examples=150, deadline=None)
@given(
    pp=st.integers(2, 5),
    m=st.integers(8, 40),
    schedule=st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b"]),
    v=st.sampled_from([2, 3]),
    buffered=st.booleans(),
    data=st.data(),
)
def test_the_shortened_check_gives_the_full_verdict_on_schedules_and_broken_copies(pp, m, schedule, v, buffered, data):
    v = v if schedule == "interleaved_1f1b" else 1
    try:
        programs = _programs(pp, m, schedule, v)
    except ValueError:
        assume(False)  # numbers the engine's schedule refuses
    programs = _mutate(programs, data)
    full, short, left_out = _verdicts(programs, RankGrid.from_plan(ParallelPlan(pp=pp)), buffered)
    event(f"full check {'passes' if full else 'fails'}, {'shortened' if left_out else 'not shortened'}")
    assert short == full


def test_valid_long_steps_are_checked_on_a_short_one():
    grid = RankGrid.from_plan(ParallelPlan(pp=4))
    for schedule, v, m in (("1f1b", 1, 64), ("gpipe", 1, 64), ("interleaved_1f1b", 2, 96)):
        for buffered in (False, True):
            full, short, left_out = _verdicts(_programs(4, m, schedule, v), grid, buffered)
            assert full and short
            assert left_out >= m // 2, (schedule, buffered, left_out)


def test_a_long_step_that_deadlocks_is_reported_at_its_own_positions():
    # Stage 1's steady loop one repetition short: the full step deadlocks, and the report names
    # positions of the full step (the shortened check falls back to it).
    programs = _programs(4, 64, "1f1b", 1)
    p = programs[1]
    i = max((i for i, item in enumerate(p.body) if isinstance(item, Loop)), key=lambda i: p.body[i].repeat)
    body = p.body[:i] + (dataclasses.replace(p.body[i], repeat=p.body[i].repeat - 1),) + p.body[i + 1 :]
    broken = programs[:1] + (dataclasses.replace(p, body=body),) + programs[2:]
    grid = RankGrid.from_plan(ParallelPlan(pp=4))
    full = check_schedule(expand_all(broken), grid)
    stated = check_compact(broken, grid, exhaustive_limit=64)
    assert not full.ok and stated.problems == full.problems


def test_a_loops_place_is_recognised_only_where_it_is_unrolled_op_for_op():
    from mixle_compile.lower.periodic import _repeats
    from mixle_compile.plan.ops import Op, OpKind

    loop = Loop(
        3,
        2,
        1,
        (
            Op(OpKind.forward, 1, microbatch=4, name="forward"),
            Op(OpKind.send, 1, microbatch=4, name="send", peer=2, tag="activation", batch=7),
        ),
    )
    before = [Op(OpKind.recv, 1, microbatch=3, name="recv", peer=0, tag="activation")]
    ops = before + loop.unrolled()
    assert _repeats(ops, 1, loop)
    assert [op.microbatch for op in ops[1:]] == [4, 4, 6, 6, 8, 8] and ops[-1].batch == 9
    assert not _repeats(ops, 0, loop)  # starts one op early
    assert not _repeats(ops[:-1], 1, loop)  # the last repetition cut short
    moved = ops[:4] + [dataclasses.replace(ops[4], microbatch=7)] + ops[5:]  # a micro-batch off the step
    assert not _repeats(moved, 1, loop)
    rebatched = ops[:-1] + [dataclasses.replace(ops[-1], batch=8)]
    assert not _repeats(rebatched, 1, loop)
    inserted = ops[:3] + [Op(OpKind.collective, 1, name="x", group="tp", tag="all_reduce")] + ops[3:-1]
    assert not _repeats(inserted, 1, loop)


def test_a_step_without_messages_is_shortened_without_watching():
    # One stage: its long loops are compute only, and the collectives after them come in the same order
    # at any length, so the check is decided on a short step (nothing to watch: no op waits inside).
    from mixle_compile.plan.ops import Op, OpKind

    grid = RankGrid.from_plan(ParallelPlan(dp_shard=2))
    reduce = Op(OpKind.collective, 0, name="w:grad", group="dp_shard", tag="reduce_scatter")
    body = (
        Op(OpKind.forward, 0, microbatch=0, name="forward"),
        Loop(
            63,
            1,
            0,
            (
                Op(OpKind.backward, 0, microbatch=0, name="backward"),
                Op(OpKind.forward, 0, microbatch=1, name="forward"),
            ),
        ),
        Op(OpKind.backward, 0, microbatch=63, name="backward"),
    )
    program = StageProgram(stage=0, body=body, after_last_backward=((reduce, 1),), end=(reduce,))
    full, short, left_out = _verdicts((program,), grid, False)
    assert full and short and left_out >= 32
    # a stage that sends is watched as before: the same verdict, from a short step it saw repeat
    full, short, left_out = _verdicts(_programs(2, 64, "1f1b", 1), RankGrid.from_plan(ParallelPlan(pp=2)), False)
    assert full and short and left_out >= 32


def test_a_loop_with_an_op_inserted_inside_is_not_shortened():
    # The gradient reduction goes right after the last backward, which is inside the loop's last
    # repetition (a forward follows it): that repetition is no plain copy, so the loop keeps its length.
    from mixle_compile.lower.periodic import _pump_down
    from mixle_compile.plan.ops import Op, OpKind

    reduce = Op(OpKind.collective, 0, name="w:grad", group="dp_shard", tag="reduce_scatter")
    loop = Loop(
        16,
        1,
        0,
        (Op(OpKind.backward, 0, microbatch=0, name="backward"), Op(OpKind.forward, 0, microbatch=1, name="forward")),
    )
    program = StageProgram(
        stage=0, body=(Op(OpKind.forward, 0, microbatch=0, name="forward"), loop), after_last_backward=((reduce, 1),)
    )
    assert _pump_down([program], 4, None, expand) is None
    plain = dataclasses.replace(program, after_last_backward=())
    assert _pump_down([plain], 4, None, expand).deltas == (12,)

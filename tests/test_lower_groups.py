"""Rank groups: every rule against a brute-force oracle, Megatron's layouts, and scale."""

from __future__ import annotations

import itertools
import json
import math
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mixle_compile.contracts import ParallelPlan
from mixle_compile.lower.groups import (
    DEFAULT_RULES,
    EMBEDDING_RULE,
    GroupRule,
    RankGrid,
    enumerate_groups,
    kv_replica_axis,
    kv_replica_size,
    rule_name,
)

TOKENS = ("tp", "cp", "ep", "dp", "pp")
DENSE_RULES = [
    axes
    for axes in DEFAULT_RULES
    if axes == (EMBEDDING_RULE,) or all(a in {"tp", "cp", "dp_shard", "dp_replicate", "pp"} for a in axes)
]
EXPERT_RULES = [axes for axes in DEFAULT_RULES if axes not in DENSE_RULES]


# ---------------------------------------------------------------------------
# The oracle: coordinates by repeated division, groups by comparing coordinates
# ---------------------------------------------------------------------------


def oracle_axes(order: str, plan: ParallelPlan) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(axis, size) innermost first for the dense and the expert numbering."""
    dense, expert = [], []
    edp = plan.world_size // (plan.etp * plan.ep * plan.pp)
    for token in order.split("-"):
        if token == "tp":
            dense.append(("tp", plan.tp))
            expert.append(("etp", plan.etp))
        elif token == "cp":
            dense.append(("cp", plan.cp))
        elif token == "ep":
            expert.append(("ep", plan.ep))
        elif token == "dp":
            dense += [("dp_shard", plan.dp_shard), ("dp_replicate", plan.dp_replicate)]
            expert.append(("edp", edp))
        else:
            dense.append(("pp", plan.pp))
            expert.append(("pp", plan.pp))
    return dense, expert


def oracle_coords(world: int, axes: list[tuple[str, int]]) -> list[dict[str, int]]:
    table = []
    for rank in range(world):
        coords, rest = {}, rank
        for axis, size in axes:
            rest, coords[axis] = divmod(rest, size)
        table.append(coords)
    return table


def oracle_groups(table: list[dict[str, int]], varied: tuple[str, ...], pp: int) -> list[tuple[int, ...]]:
    """Ranks that agree on every coordinate outside ``varied``, grouped; sorted by first rank."""
    embedding = varied == (EMBEDDING_RULE,)
    fixed = [a for a in table[0] if a not in (("pp",) if embedding else varied)]
    buckets: dict[tuple, list[int]] = {}
    for rank, coords in enumerate(table):
        if embedding and coords["pp"] not in (0, pp - 1):
            continue
        buckets.setdefault(tuple(coords[a] for a in fixed), []).append(rank)
    return sorted(tuple(members) for members in buckets.values())


def factorisations(limit: int):
    """Every (dp_replicate, dp_shard, tp, pp, cp) whose product is at most ``limit``."""

    def divisors(n):
        return [d for d in range(1, n + 1) if n % d == 0]

    for world in range(1, limit + 1):
        for a in divisors(world):
            for b in divisors(world // a):
                for c in divisors(world // (a * b)):
                    for d in divisors(world // (a * b * c)):
                        yield a, b, c, d, world // (a * b * c * d)


def assert_rule_matches(rule: GroupRule, expected: list[tuple[int, ...]], sample_every: int = 1) -> None:
    assert list(rule.groups()) == expected
    assert rule.num_groups == len(expected)
    assert all(len(g) == rule.size for g in expected)
    covered = {r for g in expected for r in g}
    for index in range(0, len(expected), sample_every):
        members = expected[index]
        for rank in members[::sample_every] + members[-1:]:
            assert rule.group_of(rank) == members
            assert rule.group_index_of(rank) == index
    for rank in range(0, rule.world_size, sample_every):
        assert rule.covers(rank) == (rank in covered)
        if rank not in covered:
            assert rule.group_of(rank) == ()


def check_grid_against_oracle(plan: ParallelPlan, order: str, rules, sample_every: int = 1) -> None:
    dense_axes, expert_axes = oracle_axes(order, plan)
    world = plan.world_size
    dense = oracle_coords(world, dense_axes)
    expert = oracle_coords(world, expert_axes)
    dense_pp = oracle_groups(dense, ("pp",), plan.pp)
    expert_pp = oracle_groups(expert, ("pp",), plan.pp)
    if dense_pp != expert_pp:
        with pytest.raises(ValueError, match="pipeline groups"):
            RankGrid.from_plan(plan, order)
        return
    grid = RankGrid.from_plan(plan, order)
    for axes in rules:
        rule = grid.rule(axes)
        table = expert if rule.layout.name == "expert" else dense
        assert_rule_matches(rule, oracle_groups(table, tuple(axes), plan.pp), sample_every)
    for rank in range(0, world, max(1, sample_every)):
        coords = grid.coords(rank)
        assert coords == {**dense[rank], **expert[rank]}
        assert grid.rank(dense[rank]) == rank
        assert grid.rank(expert[rank]) == rank


# ---------------------------------------------------------------------------
# Exhaustive and property tests against the oracle
# ---------------------------------------------------------------------------


def test_every_factorisation_up_to_64_ranks_matches_the_oracle():
    # Every dense factorisation; each gets an order drawn from a fixed seed so
    # that all orders are exercised, the default among them.
    draw = random.Random(20240611)
    orders = ["-".join(p) for p in itertools.permutations(TOKENS)]
    count = 0
    for index, (dr, ds, tp, pp, cp) in enumerate(factorisations(64)):
        plan = ParallelPlan(dp_replicate=dr, dp_shard=ds, tp=tp, pp=pp, cp=cp)
        order = "tp-cp-ep-dp-pp" if index % 2 else draw.choice(orders)
        check_grid_against_oracle(plan, order, DENSE_RULES, sample_every=1 if plan.world_size <= 16 else 5)
        count += 1
    assert count == 3652


@st.composite
def plans_and_orders(draw):
    dims = []
    budget = 64
    for _ in range(5):
        options = [d for d in (1, 2, 3, 4, 8) if d <= budget]
        d = draw(st.sampled_from(options))
        dims.append(d)
        budget //= d
    dr, ds, tp, pp, cp = dims
    world = dr * ds * tp * pp * cp
    per_stage = world // pp
    ep = draw(st.sampled_from([d for d in range(1, per_stage + 1) if per_stage % d == 0]))
    etp = draw(st.sampled_from([d for d in range(1, per_stage // ep + 1) if (per_stage // ep) % d == 0]))
    order = "-".join(draw(st.permutations(TOKENS)))
    return ParallelPlan(dp_replicate=dr, dp_shard=ds, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp), order


@settings(max_examples=150, deadline=None)
@given(plans_and_orders())
def test_dense_and_expert_groups_match_the_oracle_for_any_order(case):
    plan, order = case
    check_grid_against_oracle(plan, order, DEFAULT_RULES)


@settings(max_examples=60, deadline=None)
@given(plans_and_orders())
def test_each_axis_group_is_the_ranks_differing_only_in_that_axis(case):
    plan, order = case
    try:
        grid = RankGrid.from_plan(plan, order)
    except ValueError:
        return
    for rule in grid.rules:
        if rule.name == EMBEDDING_RULE or len(rule.axes) != 1:
            continue
        (axis,) = rule.axes
        for rank in range(plan.world_size):
            mine = grid.coords(rank)
            for other in rule.group_of(rank):
                theirs = grid.coords(other)
                layout_axes = rule.layout.axes
                assert all(mine[a] == theirs[a] for a in layout_axes if a != axis)
            assert len(rule.group_of(rank)) == rule.layout.dim(axis).size


# ---------------------------------------------------------------------------
# Megatron's layouts
# ---------------------------------------------------------------------------


def test_default_order_puts_tensor_parallel_ranks_next_to_each_other():
    grid = RankGrid.from_plan(ParallelPlan(tp=2, dp_shard=4))
    assert grid.order == "tp-cp-ep-dp-pp"
    assert list(grid.rule("tp").groups()) == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_megatrons_sixteen_gpu_example():
    # 16 GPUs, tensor parallel 2, pipeline 4, hence data parallel 2.
    grid = RankGrid.from_plan(ParallelPlan(tp=2, pp=4, dp_shard=2))
    assert enumerate_groups(grid.rule("tp")) == [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11), (12, 13), (14, 15)]
    assert enumerate_groups(grid.rule(("dp_replicate", "dp_shard"))) == [
        (0, 2),
        (1, 3),
        (4, 6),
        (5, 7),
        (8, 10),
        (9, 11),
        (12, 14),
        (13, 15),
    ]
    assert enumerate_groups(grid.rule("pp")) == [(0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15)]
    # the tied embedding lives on the first and last stage of each model-parallel position
    assert enumerate_groups(grid.rule(EMBEDDING_RULE)) == [(0, 12), (1, 13), (2, 14), (3, 15)]
    assert grid.rule(EMBEDDING_RULE).group_of(5) == ()


def test_masked_orthogonal_groups_with_pipeline_inside_data():
    # order tp-pp-dp with tp=2, pp=3, dp=4 (24 ranks): a data-parallel group
    # strides over tp * pp = 6 ranks; tp and dp together take 8.
    plan = ParallelPlan(tp=2, pp=3, dp_shard=4, etp=2)
    grid = RankGrid.from_plan(plan, "tp-pp-cp-ep-dp")
    assert enumerate_groups(grid.rule("dp_shard")) == [
        (0, 6, 12, 18),
        (1, 7, 13, 19),
        (2, 8, 14, 20),
        (3, 9, 15, 21),
        (4, 10, 16, 22),
        (5, 11, 17, 23),
    ]
    assert enumerate_groups(grid.rule(("dp_shard", "tp"))) == [
        (0, 1, 6, 7, 12, 13, 18, 19),
        (2, 3, 8, 9, 14, 15, 20, 21),
        (4, 5, 10, 11, 16, 17, 22, 23),
    ]


def test_expert_grid_must_share_the_pipeline_groups():
    # Same order, but experts without tensor parallelism: a stage spans 2
    # dense ranks and 1 expert rank, so the pipeline groups would differ.
    with pytest.raises(ValueError, match="pipeline groups") as error:
        RankGrid.from_plan(ParallelPlan(tp=2, pp=3, dp_shard=4, etp=1), "tp-pp-cp-ep-dp")
    assert "etp" in str(error.value)


def test_expert_grid_needs_etp_ep_pp_to_divide_the_world():
    with pytest.raises(ValueError, match=r"etp \* ep \* pp = 1 \* 3 \* 2 = 6 .* world size 8"):
        RankGrid.from_plan(ParallelPlan(dp_shard=4, pp=2, ep=3))


def test_classic_expert_parallelism_is_carved_out_of_data_parallelism():
    # etp = tp: experts keep the dense tensor split and ep takes neighbouring
    # data-parallel ranks, so each expert group sits inside one data group.
    plan = ParallelPlan(tp=2, dp_shard=4, pp=2, ep=2, etp=2)
    grid = RankGrid.from_plan(plan)
    assert enumerate_groups(grid.rule("ep"), 4) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert enumerate_groups(grid.rule("edp"), 4) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert list(grid.rule("etp").groups()) == list(grid.rule("tp").groups())
    data = grid.rule(("dp_replicate", "dp_shard"))
    for rank in range(plan.world_size):
        dp_group = set(data.group_of(rank))
        assert set(grid.rule("ep").group_of(rank)) <= dp_group
        assert set(grid.rule("edp").group_of(rank)) <= dp_group
        assert len(grid.rule("ep").group_of(rank)) * len(grid.rule("edp").group_of(rank)) == len(dp_group)


def test_expert_parallelism_folds_over_attention_tensor_and_data_ranks():
    # etp = 1 and ep = tp * dp: a stage's every rank holds different experts.
    plan = ParallelPlan(tp=2, dp_shard=4, pp=2, ep=8, etp=1)
    grid = RankGrid.from_plan(plan)
    assert list(grid.rule("ep").groups()) == [tuple(range(8)), tuple(range(8, 16))]
    assert grid.rule("edp").size == 1
    assert list(grid.rule("pp").groups()) == [(r, r + 8) for r in range(8)]


def test_cp_sits_between_tp_and_dp_and_joins_the_gradient_group():
    grid = RankGrid.from_plan(ParallelPlan(tp=2, cp=2, dp_shard=2))
    assert enumerate_groups(grid.rule("cp")) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert enumerate_groups(grid.rule("dp_shard")) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert enumerate_groups(grid.rule(("dp_replicate", "dp_shard", "cp"))) == [(0, 2, 4, 6), (1, 3, 5, 7)]


def test_dp_shard_is_inside_dp_replicate():
    grid = RankGrid.from_plan(ParallelPlan(dp_shard=2, dp_replicate=2))
    assert enumerate_groups(grid.rule("dp_shard")) == [(0, 1), (2, 3)]
    assert enumerate_groups(grid.rule("dp_replicate")) == [(0, 2), (1, 3)]


# ---------------------------------------------------------------------------
# Creation order, names, serialisation, errors
# ---------------------------------------------------------------------------


def test_creation_order_is_one_global_sequence_rules_then_index():
    plan = ParallelPlan(tp=2, pp=2, dp_shard=2, ep=2)
    grid = RankGrid.from_plan(plan)
    sequence = [(rule.name, index, ranks) for rule, index, ranks in grid.creation_order()]
    expected = [(rule.name, i, g) for rule in grid.rules for i, g in enumerate(rule.groups())]
    assert sequence == expected
    assert [name for name, _, _ in sequence][:: grid.rule("tp").num_groups][0] == "tp"
    # built again, independently, it is the same sequence
    again = [(rule.name, index, ranks) for rule, index, ranks in RankGrid.from_plan(plan).creation_order()]
    assert again == sequence
    # every rank sees the groups it belongs to in the same relative order as every other member
    for rank in range(plan.world_size):
        mine = [(name, i) for name, i, ranks in sequence if rank in ranks]
        for name, i in mine:
            members = next(ranks for n, j, ranks in sequence if (n, j) == (name, i))
            for other in members:
                theirs = [(n, j) for n, j, ranks in sequence if other in ranks and rank in ranks]
                shared = [key for key in mine if key in theirs]
                assert shared == theirs


def test_rule_names_are_canonical_and_lookup_works_by_name_or_axes():
    grid = RankGrid.from_plan(ParallelPlan(dp_shard=2, cp=2, dp_replicate=2))
    assert rule_name(("cp", "dp_shard", "dp_replicate")) == "dp_replicate+dp_shard+cp"
    assert grid.rule("dp_replicate+dp_shard+cp") is grid.rule(("cp", "dp_replicate", "dp_shard"))
    assert grid.rule("cp+pp") == grid.rule(("pp", "cp"))  # not a default rule: built on demand
    assert grid.rule(("tied",)).name == EMBEDDING_RULE
    assert len(set(grid.rule_names)) == len(grid.rule_names)
    with pytest.raises(ValueError, match="mixes dense axes"):
        grid.rule(("tp", "ep"))
    with pytest.raises(ValueError, match="unknown axis 'dpp'"):
        grid.rule(("dpp",))


def test_extra_rules_join_the_end_of_the_creation_order():
    grid = RankGrid.from_plan(ParallelPlan(tp=2, cp=2, pp=2), extra_rules=[("cp", "pp")])
    assert grid.rule_names[-1] == "cp+pp"
    assert grid.rules[-1].size == 4


@pytest.mark.parametrize("order", ["tp-cp-dp-pp", "tp-cp-ep-dp-pp-tp", "tp-cp-ep-dp-xx", ""])
def test_bad_orders_are_refused(order):
    with pytest.raises(ValueError, match="exactly once"):
        RankGrid.from_plan(ParallelPlan(), order)


def test_queries_refuse_ranks_outside_the_world():
    grid = RankGrid.from_plan(ParallelPlan(tp=2))
    for bad in (-1, 2, True, 1.0):
        with pytest.raises(ValueError, match="rank must be an integer in 0..1"):
            grid.rule("tp").group_of(bad)
    with pytest.raises(ValueError, match="group index"):
        grid.rule("tp").group(1)
    with pytest.raises(ValueError, match="neither every dense axis"):
        grid.rank({"tp": 1})


def test_as_dict_is_json_and_symbolic():
    grid = RankGrid.from_plan(ParallelPlan(tp=2, pp=4, dp_shard=2))
    data = json.loads(json.dumps(grid.as_dict()))
    assert [r["name"] for r in data["rules"]] == list(grid.rule_names)
    pp_rule = next(r for r in data["rules"] if r["name"] == "pp")
    assert pp_rule == {
        "name": "pp",
        "grid": "dense",
        "axes": ["pp"],
        "size": 4,
        "num_groups": 4,
        "dims": [[4, 4]],
        "base_dims": [[1, 2], [2, 2]],
    }
    # the dims regenerate the groups: base + k * stride
    for index, group in enumerate(grid.rule("pp").groups()):
        base = 0
        rest = index
        for stride, length in pp_rule["base_dims"]:
            rest, digit = divmod(rest, length)
            base += digit * stride
        assert group == tuple(base + k * 4 for k in range(4))


def test_enumerate_groups_respects_the_limit():
    rule = RankGrid.from_plan(ParallelPlan(tp=2, dp_shard=8)).rule("tp")
    assert enumerate_groups(rule, 3) == [(0, 1), (2, 3), (4, 5)]
    assert len(enumerate_groups(rule)) == 8
    assert enumerate_groups(rule, 0) == []
    with pytest.raises(ValueError):
        enumerate_groups(rule, -1)


# ---------------------------------------------------------------------------
# Scale: 131,072 ranks, answered without enumerating
# ---------------------------------------------------------------------------

BIG = ParallelPlan(tp=8, cp=2, dp_shard=64, dp_replicate=8, pp=16, ep=8)


def test_a_131072_rank_plan_answers_group_of_without_enumerating(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("enumerated groups")

    monkeypatch.setattr(GroupRule, "groups", refuse)
    monkeypatch.setattr(GroupRule, "group", refuse)
    started = time.perf_counter()
    grid = RankGrid.from_plan(BIG)
    assert grid.world_size == 131_072
    stage = 131_072 // 16  # ranks per pipeline stage
    for rank in (0, 1, 4097, 77_777, 131_071):
        tp_base = rank - rank % 8
        assert grid.rule("tp").group_of(rank) == tuple(range(tp_base, tp_base + 8))
        assert grid.rule("pp").group_of(rank) == tuple(rank % stage + k * stage for k in range(16))
        # data and context ranks: every 8th rank of the stage, 1024 of them
        data_base = rank % 8 + (rank // stage) * stage
        assert grid.rule(("dp_replicate", "dp_shard", "cp")).group_of(rank) == tuple(
            range(data_base, data_base + stage, 8)
        )
        # dp_shard: stride tp * cp = 16, 64 long
        shard_base = rank - ((rank // 16) % 64) * 16
        assert grid.rule("dp_shard").group_of(rank) == tuple(range(shard_base, shard_base + 64 * 16, 16))
        # experts: etp = 1, so 8 consecutive ranks share the experts' all_to_all
        ep_base = rank - rank % 8
        assert grid.rule("ep").group_of(rank) == tuple(range(ep_base, ep_base + 8))
        first = rank % stage
        expected_tied = (first, first + 15 * stage) if rank // stage in (0, 15) else ()
        assert grid.rule(EMBEDDING_RULE).group_of(rank) == expected_tied
    assert len(json.dumps(grid.as_dict())) < 20_000
    assert time.perf_counter() - started < 2.0


def test_creation_order_is_lazy_at_scale():
    grid = RankGrid.from_plan(BIG)
    first = list(itertools.islice(grid.creation_order(), 3))
    assert [(rule.name, index, ranks) for rule, index, ranks in first] == [
        ("tp", 0, tuple(range(8))),
        ("tp", 1, tuple(range(8, 16))),
        ("tp", 2, tuple(range(16, 24))),
    ]
    assert sum(rule.num_groups for rule in grid.rules) > 100_000
    assert math.prod(d.size for d in grid.expert.dims) == 131_072


# ---------------------------------------------------------------------------
# KV-replica groups: the tp ranks sharing one KV head
# ---------------------------------------------------------------------------


def kv_oracle(table: list[dict[str, int]], replicas: int) -> list[tuple[int, ...]]:
    """Ranks that agree on every dense coordinate but tp, and on their KV head tp // replicas."""
    buckets: dict[tuple, list[int]] = {}
    for rank, coords in enumerate(table):
        key = tuple(v for a, v in sorted(coords.items()) if a != "tp") + (coords["tp"] // replicas,)
        buckets.setdefault(key, []).append(rank)
    return sorted(tuple(members) for members in buckets.values())


@settings(max_examples=80, deadline=None)
@given(plans_and_orders())
def test_kv_replica_groups_match_the_oracle_for_any_order(case):
    plan, order = case
    try:
        RankGrid.from_plan(plan, order)
    except ValueError:
        return
    dense = oracle_coords(plan.world_size, oracle_axes(order, plan)[0])
    for replicas in [r for r in range(1, plan.tp + 1) if plan.tp % r == 0]:
        name = kv_replica_axis(replicas)
        grid = RankGrid.from_plan(plan, order, extra_rules=[(name,)])
        rule = grid.rule(name)
        assert rule.size == replicas and grid.rules[-1] is rule
        assert_rule_matches(rule, kv_oracle(dense, replicas))
        # The symbolic form alone rebuilds the members (what the runtime reads from a plan).
        entry = rule.as_dict()
        for index in range(rule.num_groups):
            base = 0
            rest = index
            for stride, length in entry["base_dims"]:
                rest, digit = divmod(rest, length)
                base += digit * stride
            offsets = [0]
            for stride, length in entry["dims"]:
                offsets = [o + k * stride for k in range(length) for o in offsets]
            assert tuple(sorted(base + o for o in offsets)) == rule.group(index)


def test_kv_replica_axis_names_carry_their_size_and_stand_alone():
    assert kv_replica_axis(2) == "tp_kv_replica2" and kv_replica_size("tp_kv_replica2") == 2
    assert kv_replica_size("tp") is None and kv_replica_size("tp_kv_replica0") is None
    assert rule_name(("tp_kv_replica4",)) == "tp_kv_replica4"
    with pytest.raises(ValueError, match="forms a rule alone"):
        rule_name(("tp_kv_replica2", "dp_shard"))
    with pytest.raises(ValueError, match="must divide tp=4"):
        RankGrid.from_plan(ParallelPlan(tp=4)).rule("tp_kv_replica3")
    with pytest.raises(ValueError):
        kv_replica_axis(0)
    grid = RankGrid.from_plan(ParallelPlan(tp=4, dp_shard=2), extra_rules=[("tp_kv_replica2",)])
    assert enumerate_groups(grid.rule("tp_kv_replica2")) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [rule.name for rule, _, _ in grid.creation_order()][-1] == "tp_kv_replica2"

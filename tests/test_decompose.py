"""Placing a model on devices: when to cut, which axis, and the optimal cut (checked against brute force)."""

from __future__ import annotations

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mixle_compile.decompose import (
    MAX_CUT_UNITS,
    ContiguousCut,
    bottleneck_lower_bound,
    brute_force_contiguous_cut,
    cut_bottleneck,
    decompose_model,
    devices_from_resources,
    exchangeable_cut,
    optimal_contiguous_cut,
)
from mixle_compile.diagnostics import CATALOGUE
from mixle_compile.graph import DecompAxis, ReductionOp, build_model_graph
from mixle_compile.spec import load_spec
from mixle_compile.spec.models import Resources, Spec
from tests.conftest import EXAMPLES

FP32 = 4
GAUSS_FULL_8 = {"type": "gaussian", "dim": 8, "covariance": "full"}  # 72 scalars, work 72


def spec_of(root: dict, devices, shared: dict | None = None) -> Spec:
    resources = {"devices": devices} if isinstance(devices, list) else {"devices": devices, "memory": "1GiB"}
    return Spec.model_validate(
        {
            "model": {"family": "distribution", "root": root, "shared": shared or {}},
            "mesh": {"dp_replicate": 1},
            "training": {"global_batch_size": 64, "precision": "fp32"},
            "backend": "torch",
            "resources": resources,
        }
    )


def decompose(spec: Spec, **kw):
    return decompose_model(build_model_graph(spec), spec.resources, **kw)


def example(name: str, **kw):
    loaded = load_spec(EXAMPLES / name)
    assert loaded.ok
    return loaded.spec, decompose_model(build_model_graph(loaded.spec, loaded.document), loaded.spec.resources, **kw)


def mixture(k: int, component: dict = GAUSS_FULL_8) -> dict:
    return {"type": "mixture", "component": component, "repeat": k}


def group(memory: str | int, count: int = 1, throughput: str | None = None, kind: str = "gpu") -> dict:
    return {"kind": kind, "memory": memory, "count": count, **({"throughput": throughput} if throughput else {})}


# --------------------------------------------------------------------------- the seed's behaviours


def test_nested_heavy_mixture_is_cut_and_the_faster_device_gets_more_work():
    spec, plan = example("composite-nested-mixture.yaml")
    assert plan.ok and plan.is_model_parallel
    assert (plan.axis, plan.reduction, plan.path, plan.num_units) == (
        DecompAxis.COMPONENT,
        ReductionOp.LOGSUMEXP_RESPONSIBILITY,
        "model.root.factors[2]",
        64,
    )
    by_kind = [(c.device.label, c.stop - c.start) for c in plan.cuts]
    assert by_kind == [("cpu-fast#0", 32), ("cpu-slow#1", 16), ("cpu-slow#2", 16)]  # 200 vs 100 GFLOPS
    assert plan.bottleneck == plan.lower_bound == 16 * 1056 / 100e9
    assert "component at model.root.factors[2]" in plan.rationale


def test_a_leaf_gives_axis_none():
    plan = decompose(spec_of(GAUSS_FULL_8, 4))
    assert (plan.axis, plan.cuts, plan.is_model_parallel) == (DecompAxis.NONE, (), False)
    assert "no axis of the model can be cut" in plan.rationale and plan.ok


def test_data_parallel_is_preferred_when_the_model_fits_and_the_data_dominates():
    spec, plan = example("hmm-shared-transitions.yaml")
    assert plan.axis is DecompAxis.NONE and not plan.is_model_parallel and plan.ok
    assert plan.rationale.startswith("data-parallel preferred over model-parallel")
    assert "fits replicated (476 bytes" in plan.rationale and "only 3 units for 2 devices" in plan.rationale
    graph = build_model_graph(spec)
    assert decompose_model(graph, spec.resources, prefer_data_parallel=False).is_model_parallel
    # too little data to keep two data-parallel ranks busy: cut the model instead
    assert decompose_model(graph, spec.resources, n_data=15).is_model_parallel
    assert not decompose_model(graph, spec.resources, n_data=16).is_model_parallel


def test_a_single_device_replicates():
    plan = decompose(spec_of(mixture(8), 1))
    assert plan.axis is DecompAxis.NONE and plan.rationale.startswith("a single device")


def test_allowed_axes_restricts_the_cut():
    root = {"type": "composite", "factors": [mixture(60), mixture(10), {"type": "poisson"}]}
    plan = decompose(spec_of(root, 2), prefer_data_parallel=False)
    assert plan.path == "model.root.factors[0]"
    plan = decompose(spec_of(root, 2), prefer_data_parallel=False, allowed_axes={"factor"})
    assert (plan.path, plan.axis, plan.permutation) == (
        "model.root",
        DecompAxis.FACTOR,
        (0, 1, 2),
    )  # factors keep their order
    plan = decompose(spec_of(root, 2), allowed_axes={"state"})
    assert plan.axis is DecompAxis.NONE and "among the allowed axes" in plan.rationale


def test_the_decomposition_records_enough_to_recompute_its_bottleneck():
    works = [{"type": "gaussian", "dim": d, "covariance": "full"} for d in (9, 2, 7, 3, 3, 8, 1, 5)]
    devices = [group("1GiB", 1, "300GFLOPS"), group("1GiB", 2, "100GFLOPS")]
    plan = decompose(spec_of({"type": "mixture", "components": works}, devices), prefer_data_parallel=False)
    assert sorted(plan.permutation) == list(range(8))
    recomputed = max(sum(plan.unit_works[i] for i in plan.units_of(c)) / c.device.throughput for c in plan.cuts)
    assert recomputed == pytest.approx(plan.bottleneck, rel=1e-12)
    assert max(c.time for c in plan.cuts) == pytest.approx(plan.bottleneck, rel=1e-12)
    for c in plan.cuts:
        assert c.param_bytes == plan.held_whole_bytes + sum(plan.unit_bytes[i] for i in plan.units_of(c))
    assert plan.bottleneck >= plan.lower_bound
    assert [c.device.rank for c in plan.cuts] == sorted({c.device.rank for c in plan.cuts})
    # the same recomputation from the JSON form alone
    data = json.loads(json.dumps(plan.as_dict()))
    again = max(
        sum(data["unit_works"][i] for i in data["permutation"][c["start"] : c["stop"]]) / c["device"]["throughput"]
        for c in data["cuts"]
    )
    assert again == pytest.approx(data["bottleneck"], rel=1e-12)


def test_an_empty_shard_does_not_shift_the_pairing_of_cuts_and_devices():
    # the first, fastest device cannot hold even one unit (32 bytes of weights + 288 > 300):
    # the cuts start on the second device and name it
    devices = [
        group(300, 1, "1000GFLOPS", "tiny"),
        group("1GiB", 1, "100GFLOPS", "a"),
        group("1GiB", 1, "300GFLOPS", "b"),
    ]
    plan = decompose(spec_of(mixture(8), devices), prefer_data_parallel=False)
    assert plan.ok
    assert [(c.device.label, c.stop - c.start) for c in plan.cuts] == [("a#1", 2), ("b#2", 6)]


def test_device_memory_limits_the_faster_device():
    # 16 components of 288 bytes (+64 bytes of mixture weights on every shard); the fast device
    # holds only 3 of them, so it cannot take its throughput share
    devices = [group(64 + 3 * 288, 1, "400GFLOPS"), group("1GiB", 1, "100GFLOPS")]
    plan = decompose(spec_of(mixture(16), devices), prefer_data_parallel=False)
    assert [c.stop - c.start for c in plan.cuts] == [3, 13]
    assert plan.cuts[0].param_bytes == 64 + 3 * 288 == plan.cuts[0].device.memory_bytes


def test_min_components_per_shard_is_enforced():
    devices = [group("1GiB", 1, "800GFLOPS"), group("1GiB", 3, "100GFLOPS")]
    plan = decompose(spec_of(mixture(12), devices), prefer_data_parallel=False)
    assert min(c.stop - c.start for c in plan.cuts) < 4
    plan = decompose(spec_of(mixture(12), devices), prefer_data_parallel=False, min_components_per_shard=4)
    assert plan.ok and all(c.stop - c.start >= 4 for c in plan.cuts)


# --------------------------------------------------------------------------- infeasible placements


def test_a_unit_larger_than_every_device_is_a_diagnostic_with_path_and_numbers():
    big = {"type": "gaussian", "dim": 100, "covariance": "full"}  # 10100 scalars = 40400 bytes
    root = {
        "type": "composite",
        "factors": [{"type": "poisson"}, {"type": "mixture", "components": [GAUSS_FULL_8, big]}],
    }
    plan = decompose(spec_of(root, [group("32KiB", 4)]), prefer_data_parallel=False)
    (d,) = plan.diagnostics
    assert d.code == "G002" and not plan.ok and plan.cuts == ()
    assert "unit 1 of model.root.factors[1] (model.root.factors[1].components[1]) needs 40,400 bytes" in d.message
    assert "largest device (gpu#0) holds 32,768 bytes" in d.message
    assert d.fields == ("model.root.factors[1].components[1]", "resources.devices")


def test_too_few_devices_is_a_diagnostic_with_the_count_needed():
    plan = decompose(spec_of(mixture(100), [group("4KiB", 3)]), prefer_data_parallel=False)
    (d,) = plan.diagnostics
    assert d.code == "G003" and plan.cuts == ()
    # 100 units of 288 bytes; each device keeps the 400 bytes of weights and has 3696 left
    assert "need 28,800 bytes" in d.message and "hold 11,088 bytes" in d.message
    assert "at least 8 devices" in d.message


def test_memory_and_min_components_together_can_make_every_cut_impossible():
    # each device fits 5 units, but a shard must hold at least 6
    plan = decompose(
        spec_of(mixture(10), [group(40 + 5 * 288, 4)]), prefer_data_parallel=False, min_components_per_shard=6
    )
    assert [d.code for d in plan.diagnostics] == ["G003"] and "at least 6 units" in plan.diagnostics[0].message


def test_min_components_above_the_unit_count_is_a_diagnostic():
    plan = decompose(spec_of(mixture(5), 4), prefer_data_parallel=False, min_components_per_shard=6)
    assert [d.code for d in plan.diagnostics] == ["G004"]


def test_a_whole_model_too_large_for_any_device_is_a_diagnostic():
    plan = decompose(spec_of({"type": "gaussian", "dim": 200, "covariance": "full"}, [group("64KiB", 2)]))
    (d,) = plan.diagnostics
    assert d.code == "G002" and "the whole model (model.root, 160,800 bytes)" in d.message


def test_an_axis_beyond_the_exact_cut_is_a_diagnostic_not_a_crash():
    plan = decompose(spec_of(mixture(MAX_CUT_UNITS + 1, {"type": "poisson"}), 4), prefer_data_parallel=False)
    assert [d.code for d in plan.diagnostics] == ["G005"]


def test_a_broken_graph_is_passed_on_not_placed():
    spec = spec_of(
        {"type": "mixture", "components": [{"ref": "a"}, {"type": "poisson"}]},
        2,
        {"a": {"type": "mixture", "components": [{"ref": "a"}]}},
    )
    plan = decompose(spec)
    assert [d.code for d in plan.diagnostics] == ["G001"] and plan.axis is DecompAxis.NONE


def test_every_graph_code_is_documented():
    for code in ("G001", "G002", "G003", "G004", "G005"):
        entry = CATALOGUE[code]
        assert entry.title and entry.summary and len(entry.docs) > 80


# --------------------------------------------------------------------------- devices


def test_devices_without_throughput_are_equal_and_mixed_ones_take_the_slowest_stated():
    equal = devices_from_resources(Resources.model_validate({"devices": 3, "memory": "1GiB"}))
    assert [d.throughput for d in equal] == [1.0] * 3 and [d.rank for d in equal] == [0, 1, 2]
    mixed = devices_from_resources(
        Resources.model_validate(
            {"devices": [group("1GiB", 1, "5TFLOPS"), group("1GiB", 1, "2TFLOPS"), group("1GiB", 1)]}
        )
    )
    assert [d.throughput for d in mixed] == [5e12, 2e12, 2e12]
    assert [d.throughput_stated for d in mixed] == [True, True, False]


# --------------------------------------------------------------------------- the cut is optimal

works_st = st.lists(st.integers(0, 20), min_size=0, max_size=8)


@st.composite
def cut_cases(draw):
    works = draw(works_st)
    n = len(works)
    unit_bytes = draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    num_devices = draw(st.integers(1, 4))
    throughputs = draw(st.lists(st.sampled_from([1.0, 2.0, 3.0, 0.5, 7.0]), min_size=num_devices, max_size=num_devices))
    capacities = draw(st.lists(st.integers(-2, 25), min_size=num_devices, max_size=num_devices))
    min_units = draw(st.integers(1, 3))
    return works, unit_bytes, throughputs, capacities, min_units


def assert_valid(cut: ContiguousCut, works, unit_bytes, throughputs, capacities, min_units):
    position = 0
    last_device = -1
    for shard in cut.shards:
        assert shard.start == position and shard.stop - shard.start >= max(1, min_units)
        assert shard.device > last_device
        assert sum(unit_bytes[i] for i in cut.order[shard.start : shard.stop]) <= capacities[shard.device]
        position, last_device = shard.stop, shard.device
    assert position == len(works) and sorted(cut.order) == list(range(len(works)))
    assert cut_bottleneck(cut, works, throughputs) == cut.bottleneck


@settings(max_examples=300, deadline=None)
@given(cut_cases())
def test_the_contiguous_cut_matches_brute_force(case):
    works, unit_bytes, throughputs, capacities, min_units = case
    fast = optimal_contiguous_cut(*case)
    oracle = brute_force_contiguous_cut(*case)
    assert (fast is None) == (oracle is None)
    if fast is not None:
        assert fast.bottleneck == oracle.bottleneck
        assert fast.order == tuple(range(len(works)))
        assert_valid(fast, *case)


@settings(max_examples=150, deadline=None)
@given(
    works=st.lists(st.floats(0.001, 1e6, allow_subnormal=False), min_size=1, max_size=9),
    throughputs=st.lists(st.floats(0.1, 1e3), min_size=1, max_size=4),
)
def test_the_contiguous_cut_matches_brute_force_on_real_valued_work(works, throughputs):
    none, room = [0] * len(works), [1] * len(throughputs)
    fast = optimal_contiguous_cut(works, none, throughputs, room)
    oracle = brute_force_contiguous_cut(works, none, throughputs, room)
    assert fast.bottleneck == oracle.bottleneck
    assert fast.bottleneck >= bottleneck_lower_bound(works, throughputs) * (1 - 1e-12)


@settings(max_examples=150, deadline=None)
@given(cut_cases())
def test_reordering_exchangeable_units_is_valid_and_never_worse(case):
    works, unit_bytes, throughputs, capacities, min_units = case
    fixed = optimal_contiguous_cut(*case)
    free = exchangeable_cut(*case)
    assume(fixed is not None)
    assert free is not None and free.bottleneck <= fixed.bottleneck
    assert free.bottleneck >= bottleneck_lower_bound(works, throughputs) * (1 - 1e-12) or not works
    assert_valid(free, *case)


def test_reordering_balances_units_the_given_order_cannot():
    # the two heavy units come first: in this order no split of the two equal devices beats 16
    works = [8.0, 8.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    fixed = optimal_contiguous_cut(works, [0] * 10, [1.0, 1.0], [1, 1])
    free = exchangeable_cut(works, [0] * 10, [1.0, 1.0], [1, 1])
    assert fixed.bottleneck == 16.0 and fixed.order == tuple(range(10))
    assert free.bottleneck == bottleneck_lower_bound(works, [1.0, 1.0]) == 12.0
    heavy_on = [next(s.device for s in free.shards if free.order.index(i) in range(s.start, s.stop)) for i in (0, 1)]
    assert heavy_on[0] != heavy_on[1]


def test_empty_and_infeasible_inputs():
    assert optimal_contiguous_cut([], [], [1.0], [0]) == ContiguousCut((), 0.0, ())
    assert optimal_contiguous_cut([1.0, 1.0], [5, 5], [1.0, 1.0], [4, 4]) is None
    assert optimal_contiguous_cut([1.0], [0], [1.0], [0], min_units_per_shard=2) is None
    with pytest.raises(ValueError):
        optimal_contiguous_cut([-1.0], [0], [1.0], [0])


def test_a_decomposition_pickles_and_deep_copies():
    import copy
    import pickle

    _, plan = example("composite-nested-mixture.yaml")
    assert isinstance(plan.extra, dict) and plan.extra
    for clone in (pickle.loads(pickle.dumps(plan)), copy.deepcopy(plan)):
        assert clone == plan and clone.extra == plan.extra and clone.as_dict() == plan.as_dict()
    with pytest.raises(TypeError):
        plan.extra["path"] = "elsewhere"  # type: ignore[index]

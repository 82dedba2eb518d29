"""Lowering distribution models: statistics over data ranks, the model cut over tp."""

from __future__ import annotations

import dataclasses

import pytest

from mixle_compile.graph import build_model_graph
from mixle_compile.lower.distribution import check_statistics_once, lower_distribution
from mixle_compile.lower.groups import RankGrid
from mixle_compile.lower.lowering import lower
from mixle_compile.spec import load_spec, load_spec_text, parallel_plan
from tests.conftest import EXAMPLES

HMMS = (EXAMPLES / "hmm-shared-transitions.yaml").read_text()


def spec_of(text):
    loaded = load_spec_text(text, "t.yaml")
    assert loaded.ok, [d.text() for d in loaded.diagnostics]
    return loaded.spec


def by_node(low):
    return {u.update.node_id: u for u in low.updates}


@pytest.mark.parametrize(
    "name", ["gaussian-mixture.yaml", "hmm-shared-transitions.yaml", "composite-nested-mixture.yaml"]
)
def test_examples_lower_cleanly(name):
    loaded = load_spec(EXAMPLES / name)
    low = lower(loaded.spec, document=loaded.document)
    assert low.reduction_problems == () and low.schedule.check.ok and low.diagnostics == ()
    assert low.decomposition is not None


def test_data_parallel_statistics_are_summed_over_the_data_ranks():
    low = lower(load_spec(EXAMPLES / "gaussian-mixture.yaml").spec)
    assert low.decomposition["axis"] == "none"
    stats = [u for u in low.updates if u.update.payload.value == "sufficient_statistic"]
    assert {u.tensor for u in stats} == {"model.root", "model.root.component"}
    assert all(u.update.mesh_axes == ("dp_replicate",) and u.update.collective.value == "all_reduce" for u in stats)
    assert all(u.update.contract_exact and not u.update.exact for u in stats)


def test_nested_heavy_mixture_is_cut_with_a_logsumexp_boundary_and_faster_device_gets_more():
    low = lower(load_spec(EXAMPLES / "composite-nested-mixture.yaml").spec)
    dec = low.decomposition
    assert (dec["axis"], dec["path"]) == ("component", "model.root.factors[2]")
    sizes = [c["stop"] - c["start"] for c in dec["cuts"]]
    assert sizes == [32, 16, 16]  # the first device is twice as fast
    updates = by_node(low)
    assert [updates[f"model.root.factors[2]:normaliser/{k}"].update.mesh_axes for k in ("max", "sum")] == [
        ("tp",),
        ("tp",),
    ]
    component = next(p for p in low.parameters if p.name == "model.root.factors[2].component")
    # A shard holds the units of the rank that owns the most (32 of 64), not 64 / 3.
    assert component.layout.placements == (("tp", "shard(0)"),) and component.local_shape[0] == 32
    weights = next(p for p in low.parameters if p.name == "model.root.factors[2]")
    assert weights.local_shape == (32,)


def test_shared_transitions_under_a_component_cut_sum_over_tp_and_data():
    low = lower(
        spec_of(HMMS.replace("dp_replicate: 2", "dp_replicate: 2\n  tp: 2").replace("devices: 2", "devices: 4"))
    )
    assert low.decomposition["axis"] == "component"
    updates = by_node(low)
    assert updates["model.shared.weather:statistics"].update.mesh_axes == ("dp_replicate", "tp")
    owned = [p for p in low.parameters if p.owner is not None]
    assert {p.owner for p in owned} == {0, 1}
    assert updates["model.root.components[0].emission:statistics"].update.mesh_axes == ("dp_replicate",)
    assert low.reduction_problems == ()


def test_missing_tp_sum_of_shared_statistics_is_caught():
    spec = spec_of(HMMS.replace("dp_replicate: 2", "tp: 2"))
    plan = parallel_plan(spec)
    graph = build_model_graph(spec)
    low = lower_distribution(spec, plan, graph, RankGrid.from_plan(plan))
    assert check_statistics_once(graph, low, plan) == ()
    broken = dataclasses.replace(low, updates=tuple(u for u in low.updates if u.tensor != "model.shared.weather"))
    problems = check_statistics_once(graph, broken, plan)
    assert [p.message for p in problems] == [
        "model.shared.weather: its statistics are partial over tp but never summed over tp"
    ]
    doubled = dataclasses.replace(
        low, updates=low.updates + tuple(u for u in low.updates if u.tensor == "model.shared.weather")
    )
    assert "summed 2 times over tp" in check_statistics_once(graph, doubled, plan)[0].message


def test_axes_em_cannot_use_and_a_tp_without_a_cut_are_reported():
    text = HMMS.replace("dp_replicate: 2", "dp_replicate: 1\n  pp: 2")
    low = lower(spec_of(text))
    assert [d.code for d in low.diagnostics] == ["L001"] and "mesh.pp=2" in low.diagnostics[0].message
    leaf = """\
model: {family: distribution, root: {type: gaussian, dim: 4}}
mesh: {tp: 2}
training: {global_batch_size: 64, micro_batch_size: 64}
backend: torch
resources: {devices: 2, memory: 1GiB}
"""
    low = lower(spec_of(leaf))
    assert "L002" in [d.code for d in low.diagnostics]


def test_statistics_are_sized_in_float64_with_what_the_maximiser_needs_beyond_the_parameters():
    """An emission's occupancy (+1 per Gaussian state) and the transitions' initial-state counts are
    part of the statistics; they travel in float64 whatever the training precision."""
    for precision in ("fp32", "bf16"):
        low = lower(spec_of(HMMS.replace("precision: fp32", f"precision: {precision}")))
        sizes = {u.tensor: u.payload_bytes for u in low.updates if u.update.payload.value == "sufficient_statistic"}
        assert sizes["model.root.components[0].emission"] == 4 * (1 + 3 + 3) * 8  # 4 states, diag, dim 3
        assert sizes["model.root.components[2].emission"] == 4 * (1 + 3 + 9) * 8  # full covariance
        assert sizes["model.shared.weather"] == (4 + 16) * 8  # initial states + transitions
        assert sizes["model.root"] == 3 * 8  # responsibilities' sums
    leaves = """\
model:
  family: distribution
  root:
    type: composite
    factors: [{type: categorical, num_values: 7}, {type: poisson, dim: 2}, {type: exponential, dim: 3}]
mesh: {dp_shard: 2}
training: {global_batch_size: 64, micro_batch_size: 32}
backend: torch
resources: {devices: 2, memory: 1GiB}
"""
    sizes = {u.tensor: u.payload_bytes for u in lower(spec_of(leaves)).updates if u.tensor != "log_likelihood"}
    assert sizes == {"model.root.factors[0]": 7 * 8, "model.root.factors[1]": 3 * 8, "model.root.factors[2]": 4 * 8}


def test_an_uneven_component_cut_pads_every_shard_to_the_largest_share():
    text = """\
model:
  family: distribution
  root: {type: mixture, component: {type: gaussian, dim: 2, covariance: full}, repeat: 5}
mesh: {dp_replicate: 2, tp: 2}
training: {global_batch_size: 64, micro_batch_size: 32}
backend: torch
resources: {devices: 4, memory: 1GiB}
"""
    low = lower(spec_of(text))
    shares = [c["stop"] - c["start"] for c in low.decomposition["cuts"]]
    assert sorted(shares) == [2, 3]
    updates = by_node(low)
    assert updates["model.root.component:statistics"].payload_bytes == 3 * (1 + 2 + 4) * 8
    assert updates["model.root:statistics"].payload_bytes == 3 * 8

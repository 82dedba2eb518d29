"""The decomposition graph: nodes and edges of every family, sizes, work, axes, shared nodes, cycles."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mixle_compile.diagnostics import CATALOGUE
from mixle_compile.graph import (
    DecompAxis,
    ReductionOp,
    best_parallel_axis,
    build_model_graph,
    compute_cost,
    cost_children,
    distribution_node_cost,
    parallel_benefit,
    shard_children,
    size_model_tree,
    subtree_work,
    tree_axes,
)
from mixle_compile.parameters import model_parameters, unique_parameter_bytes
from mixle_compile.spec import load_spec
from mixle_compile.spec.models import Spec
from mixle_compile.spec.source import parse_source
from tests.conftest import EXAMPLES

FP32 = 4


def spec_of(model: dict, **resources) -> Spec:
    """A valid spec around ``model`` (validated by the schema only, as a caller might build one)."""
    return Spec.model_validate(
        {
            "model": model,
            "mesh": {"dp_replicate": 1},
            "training": {"global_batch_size": 64, "precision": "fp32", "seq_len": 16},
            "backend": "torch",
            "resources": resources or {"devices": 2, "memory": "1GiB"},
        }
    )


def dist(root: dict, shared: dict | None = None) -> Spec:
    return spec_of({"family": "distribution", "root": root, "shared": shared or {}})


def example_graph(name: str):
    loaded = load_spec(EXAMPLES / name)
    assert loaded.ok, [d.text() for d in loaded.diagnostics]
    return loaded.spec, build_model_graph(loaded.spec, loaded.document)


GAUSS_FULL_8 = {"type": "gaussian", "dim": 8, "covariance": "full"}


# --------------------------------------------------------------------------- structure


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_every_example_builds_a_frozen_dag_with_typed_node_attributes(name):
    _, model = example_graph(name)
    g = model.graph
    assert model.ok and model.diagnostics == ()
    assert nx.is_directed_acyclic_graph(g) and nx.is_frozen(g)
    assert set(model.order) == set(g.nodes) and model.order[-1] == model.root
    for n, attrs in g.nodes(data=True):
        assert attrs["path"] == n
        assert isinstance(attrs["axis"], DecompAxis) and isinstance(attrs["reduction"], ReductionOp)
        assert (attrs["axis"] is DecompAxis.NONE) == (attrs["reduction"] is ReductionOp.REPLICATE)
        assert attrs["num_units"] >= 1 and attrs["exact"] is True
        assert attrs["own_param_bytes"] >= 0 and attrs["own_work"] >= 0
    with pytest.raises(nx.NetworkXError):
        g.add_node("later")


def test_a_repeated_mixture_component_is_one_node_held_k_times():
    _, model = example_graph("gaussian-mixture.yaml")
    root = model.node()
    assert (root.path, root.kind, root.axis, root.reduction, root.num_units) == (
        "model.root",
        "mixture",
        DecompAxis.COMPONENT,
        ReductionOp.LOGSUMEXP_RESPONSIBILITY,
        16,
    )
    assert shard_children(model) == (("model.root.component", 16),)
    component = model.node("model.root.component")
    assert component.instances == 16 and component.own_param_bytes == (8 * 8 + 8) * FP32
    # 16 mixture weights plus 16 full-covariance Gaussians in 8 dimensions
    assert compute_cost(model) == (16 + 16 * 72.0, (16 + 16 * 72) * FP32)


# --------------------------------------------------------------------------- the work proxy table


@pytest.mark.parametrize(
    "node, params, work",
    [
        ({"type": "gaussian", "dim": 5, "covariance": "full"}, 30, 30),
        ({"type": "gaussian", "dim": 5}, 10, 10),
        ({"type": "categorical", "num_values": 40}, 40, 1),
        ({"type": "poisson", "dim": 3}, 3, 6),
        ({"type": "exponential"}, 1, 2),
        ({"type": "transitions", "num_states": 3}, 12, 1),
        ({"type": "mixture", "component": {"type": "poisson"}, "repeat": 7}, 7, 7),
        ({"type": "composite", "factors": [{"type": "poisson"}]}, 0, 0),
        ({"type": "hmm", "num_states": 3, "emission": {"type": "poisson"}}, 12, 18),
        (
            {
                "type": "hmm",
                "num_states": 3,
                "emission": {"type": "poisson"},
                "transitions": {"type": "transitions", "num_states": 3},
            },
            0,
            18,
        ),
        ({"type": "sequence", "base": {"type": "poisson"}, "length": {"type": "poisson"}}, 0, 0),
    ],
)
def test_work_proxy_table(node, params, work):
    spec = dist(node)
    cost = distribution_node_cost(spec.model.root)
    assert (cost.param_count, cost.work) == (params, work)
    model = build_model_graph(spec)
    assert model.node().own_param_bytes == params * FP32 and model.node().own_work == work


@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 50), d=st.integers(1, 30), full=st.booleans(), m=st.integers(1, 6))
def test_cost_of_nested_repeated_mixtures_follows_the_formula(k, d, full, m):
    leaf = {"type": "gaussian", "dim": d, "covariance": "full" if full else "diag"}
    per_leaf = d * d + d if full else 2 * d
    spec = dist({"type": "mixture", "repeat": m, "component": {"type": "mixture", "repeat": k, "component": leaf}})
    model = build_model_graph(spec)
    scalars = m + m * (k + k * per_leaf)
    assert compute_cost(model) == (float(scalars), scalars * FP32)
    inner = [c for c in tree_axes(model) if c.path == "model.root.component"]
    if k >= 2:  # unit i of the inner mixture is component i of each of its m copies
        assert inner[0].unit_works == (float(m * per_leaf),) * k
        assert inner[0].held_whole_bytes == (m + m * k) * FP32


# --------------------------------------------------------------------------- shared nodes


def test_shared_transitions_are_one_node_counted_once_and_held_whole():
    _, model = example_graph("hmm-shared-transitions.yaml")
    g = model.graph
    weather = "model.shared.weather"
    assert g.in_degree(weather) == 3 and model.node(weather).shared
    hmm = model.node("model.root.components[0]")
    assert hmm.axis is DecompAxis.STATE and hmm.shared_children == (weather,)
    assert weather in cost_children(model, hmm.path)
    assert weather not in dict(shard_children(model, hmm.path))
    transitions = (4 * 4 + 4) * FP32
    emissions = [4 * 6 * FP32, 4 * 6 * FP32, 4 * (9 + 3) * FP32]
    assert compute_cost(model)[1] == 3 * FP32 + sum(emissions) + transitions
    # each HMM's own subtree holds the matrix too, and the mixture's axis leaves it whole
    assert compute_cost(model, hmm.path)[1] == emissions[0] + transitions
    axis = best_parallel_axis(model)
    assert axis.path == "model.root" and axis.unit_bytes == tuple(emissions)
    assert axis.held_whole_bytes == 3 * FP32 + transitions


def test_inline_transitions_are_counted_per_hmm_and_an_hmm_of_its_own_shows_its_dense_block():
    hmm = {"type": "hmm", "num_states": 4, "emission": {"type": "poisson"}}
    inline = {**hmm, "transitions": {"type": "transitions", "num_states": 4}}
    own = build_model_graph(dist({"type": "mixture", "components": [hmm, hmm]}))
    shared = build_model_graph(
        dist(
            {"type": "mixture", "components": [{**hmm, "transitions": {"ref": "t"}}] * 2},
            {"t": {"type": "transitions", "num_states": 4}},
        )
    )
    separate = build_model_graph(dist({"type": "mixture", "components": [inline, inline]}))
    block = (16 + 4) * FP32
    assert own.node("model.root.components[0]").own_param_bytes == block
    assert compute_cost(separate)[1] == compute_cost(own)[1] == 2 * FP32 + 2 * (block + 4 * FP32)
    assert compute_cost(shared)[1] == compute_cost(own)[1] - block


def test_a_shared_subtree_reached_twice_inside_one_subtree_counts_once():
    shared = {"big": {"type": "mixture", "repeat": 10, "component": GAUSS_FULL_8}}
    spec = dist({"type": "composite", "factors": [{"ref": "big"}, {"ref": "big"}, {"type": "poisson"}]}, shared)
    model = build_model_graph(spec)
    big = (10 + 10 * 72) * FP32
    assert compute_cost(model) == (10 + 720.0 + 2, big + FP32)
    sized = size_model_tree(model)
    assert [c.path for c in sized.children] == ["model.shared.big", "model.root.factors[2]"]
    assert shard_children(model) == (("model.shared.big", 2), ("model.root.factors[2]", 1))
    assert sized.subtree_param_bytes == big + FP32 and sized.children[0].shared


def test_a_shared_node_inside_a_repeated_component_counts_once_not_per_copy():
    shared = {"t": {"type": "transitions", "num_states": 3}}
    hmm = {"type": "hmm", "num_states": 3, "emission": {"type": "poisson"}, "transitions": {"ref": "t"}}
    model = build_model_graph(dist({"type": "mixture", "repeat": 5, "component": hmm}, shared))
    assert model.node("model.root.component").instances == 5
    assert model.node("model.shared.t").instances == 1
    assert compute_cost(model)[1] == (5 + 5 * 3 + 12) * FP32


def test_size_model_tree_matches_compute_cost_everywhere():
    _, model = example_graph("composite-nested-mixture.yaml")
    sized = size_model_tree(model)
    assert (sized.subtree_work, sized.subtree_param_bytes) == compute_cost(model)
    mixture = sized.children[2]
    assert mixture.path == "model.root.factors[2]" and mixture.children[0].copies == 64
    assert size_model_tree(model, mixture.path) == mixture
    assert subtree_work(model, mixture.path) == 64 + 64 * (32 * 32 + 32)


# --------------------------------------------------------------------------- axes


def test_tree_axes_lists_every_shardable_axis_with_unit_work():
    _, model = example_graph("composite-nested-mixture.yaml")
    axes = {c.path: c for c in tree_axes(model)}
    assert set(axes) == {"model.root", "model.root.factors[2]"}
    composite = axes["model.root"]
    assert (composite.axis, composite.reduction, composite.exchangeable) == (DecompAxis.FACTOR, ReductionOp.SUM, False)
    assert composite.unit_works == (1.0, 2.0, 64 + 64 * 1056.0)
    mixture = axes["model.root.factors[2]"]
    assert mixture.exchangeable and mixture.unit_works == (1056.0,) * 64


def test_best_axis_finds_the_heavy_mixture_nested_under_a_thin_composite():
    _, model = example_graph("composite-nested-mixture.yaml")
    axes = {c.path: c for c in tree_axes(model)}
    # the composite's heavy factor bounds its parallel time: cutting it removes almost nothing
    assert parallel_benefit(axes["model.root"], 3) == 3.0
    best = best_parallel_axis(model, max_workers=3)
    assert (best.path, best.axis, best.num_units) == ("model.root.factors[2]", DecompAxis.COMPONENT, 64)
    assert best_parallel_axis(model, 3, allowed_axes={"factor"}).path == "model.root"
    assert best_parallel_axis(model, 3, allowed_axes=[DecompAxis.STATE]) is None


def test_a_leaf_has_no_axis_to_cut():
    model = build_model_graph(dist(GAUSS_FULL_8))
    assert tree_axes(model) == [] and best_parallel_axis(model, 8) is None
    assert shard_children(model) == () and cost_children(model) == ()


def test_sequence_base_is_its_shard_child_and_length_only_a_cost_child():
    spec = dist({"type": "sequence", "base": GAUSS_FULL_8, "length": {"type": "poisson"}})
    model = build_model_graph(spec)
    assert model.node().axis is DecompAxis.SEQUENCE and model.node().num_units == 1
    assert shard_children(model) == (("model.root.base", 1),)
    assert cost_children(model) == ("model.root.base", "model.root.length")
    assert tree_axes(model) == []  # the data axis is sized from the data, never cut here


# --------------------------------------------------------------------------- neural families


def test_transformer_graph_counts_every_parameter_once_and_shares_tied_embeddings():
    spec, model = example_graph("tiny-transformer.yaml")
    params = model_parameters(spec)
    assert compute_cost(model)[1] == unique_parameter_bytes(params)
    tied = "model.tied.tied_embedding"
    assert set(model.graph.predecessors(tied)) == {"model.embed", "model.lm_head"}
    assert model.node("model.layers.0").own_work == 2 * sum(p.numel for p in params if p.layer == 0)
    spec, model = example_graph("llama3-8b-hsdp-tp.yaml")
    assert compute_cost(model)[1] == 2 * 8_030_261_248 and tree_axes(model) == []


def test_experts_are_one_component_axis_spanning_every_moe_layer():
    spec, model = example_graph("mixtral-moe-ep.yaml")
    params = model_parameters(spec)
    experts = [p for p in params if p.role == "expert"]
    (axis,) = tree_axes(model)
    assert (axis.path, axis.axis, axis.reduction, axis.num_units) == (
        "model.experts",
        DecompAxis.COMPONENT,
        ReductionOp.SUM,
        8,
    )
    assert axis.unit_bytes == (sum(p.bytes for p in experts) // 8,) * 8
    assert axis.held_whole_bytes == unique_parameter_bytes(params) - sum(p.bytes for p in experts)
    # top-2 of 8: each expert sees a quarter of the tokens
    assert axis.unit_works[0] == pytest.approx(2 * sum(p.numel for p in experts) / 8 * 2 / 8)


def test_modules_family_groups_by_layer_and_finds_experts():
    spec = spec_of(
        {
            "family": "modules",
            "parameters": [
                {"name": "embed", "shape": [100, 16], "role": "embedding"},
                {"name": "w1", "shape": [16, 16], "role": "column", "layer": 0},
                {"name": "experts.up", "shape": [4, 32, 16], "role": "expert", "layer": 0},
                {"name": "experts.down", "shape": [4, 16, 32], "role": "expert", "layer": 0},
            ],
        }
    )
    model = build_model_graph(spec)
    assert set(model.graph.successors("model")) == {"model.embed", "model.layers.0", "model.experts"}
    assert model.node("model.experts").field_path == ("model", "parameters", 2)
    (axis,) = tree_axes(model)
    assert axis.unit_bytes == (2 * 32 * 16 * FP32,) * 4
    assert compute_cost(model)[1] == (100 * 16 + 16 * 16 + 2 * 4 * 32 * 16) * FP32


# --------------------------------------------------------------------------- cycles and bad refs


CYCLE = """\
model:
  family: distribution
  shared:
    a:
      type: mixture
      components:
        - {type: poisson}
        - {ref: b}
    b:
      type: composite
      factors: [{ref: a}]
  root: {type: composite, factors: [{ref: a}, {type: poisson}]}
mesh: {dp_replicate: 1}
training: {global_batch_size: 8}
backend: torch
resources: {devices: 2, memory: 1GiB}
"""


def test_a_cycle_is_a_diagnostic_printing_its_path_and_the_graph_stays_acyclic():
    # The loader refuses this spec (S008); the graph builder must still catch it on its own.
    doc, _ = parse_source(CYCLE.encode(), "cycle.yaml", json_syntax=False)
    model = build_model_graph(Spec.model_validate(doc.data), doc)
    (d,) = model.diagnostics
    assert d.code == "G001" and not model.ok
    assert d.message == "the model graph has a cycle: model.shared.a -> model.shared.b -> model.shared.a"
    assert (d.file, d.line, d.column) == ("cycle.yaml", 11, 17)
    assert d.fields == ("model.shared.b.factors[0]",)
    assert nx.is_directed_acyclic_graph(model.graph)
    # mixture (2 weights) + its poisson + the root's poisson; the spec trains in bf16 (2 bytes)
    assert compute_cost(model) == (2.0 + 2 + 2, (2 + 1 + 1) * 2)


def test_a_node_containing_itself_is_a_cycle_of_one():
    spec = dist({"ref": "a"}, {"a": {"type": "mixture", "components": [{"ref": "a"}, {"type": "poisson"}]}})
    model = build_model_graph(spec)
    assert [d.message for d in model.diagnostics] == ["the model graph has a cycle: model.shared.a -> model.shared.a"]
    assert model.root == "model.shared.a" and tree_axes(model) == []


def test_a_ref_chain_deeper_than_the_recursion_limit_builds():
    depth = 3 * sys.getrecursionlimit()
    shared = {f"n{i}": {"type": "composite", "factors": [{"ref": f"n{i + 1}"}]} for i in range(depth)}
    shared[f"n{depth}"] = {"type": "poisson"}
    model = build_model_graph(dist({"ref": "n0"}, shared))
    assert model.ok and model.graph.number_of_nodes() == depth + 1
    assert compute_cost(model) == (2.0, FP32)
    assert size_model_tree(model).subtree_param_bytes == FP32


def test_an_unknown_ref_is_reported_not_raised():
    model = build_model_graph(dist({"type": "mixture", "components": [{"ref": "nope"}, {"type": "poisson"}]}))
    assert [d.code for d in model.diagnostics] == ["S007"] and not model.ok
    assert tree_axes(model) == []  # the mixture lost a unit: it cannot be cut
    assert build_model_graph(dist({"ref": "nope"})).diagnostics[0].code == "S007"


def test_graph_codes_are_documented():
    entry = CATALOGUE["G001"]
    assert entry.title == "graph-cycle" and entry.summary and "path" in entry.docs


def test_the_check_path_does_not_import_the_graph():
    code = (
        "import sys, mixle_compile.check, mixle_compile.spec; "
        "sys.exit('networkx' in sys.modules or 'mixle_compile.graph' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", textwrap.dedent(code)]).returncode == 0

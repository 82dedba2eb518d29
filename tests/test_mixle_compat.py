"""mixle-style code runs unchanged against mixle_compile.

Every test body here uses only mixle's documented contract API (the names ``mixle.utils.parallel``
exports and the decomposition vocabulary of ``model_decomposition``), reached through the module
the fixture hands it. The fixture is parametrised over ``mixle_compile`` and, when mixle is
installed, over mixle itself, so the same body is proven against both.
"""

from __future__ import annotations

import copy
import importlib
import itertools
import math
import pickle

import numpy as np
import pytest

_counter = itertools.count()


def _unique(prefix: str) -> str:
    # mixle's registry is one module-level dict: every test registers under a name of its own
    return f"{prefix}_compat_{next(_counter)}"


@pytest.fixture(params=["mixle_compile", "mixle.utils.parallel"])
def mx(request):
    """The module mixle-style code imports its contracts from."""
    if request.param == "mixle_compile":
        return importlib.import_module("mixle_compile")
    return pytest.importorskip(request.param)


@pytest.fixture(params=["mixle_compile.decompose", "mixle.utils.parallel.model_decomposition"])
def md(request):
    """The module the decomposition vocabulary and planner come from."""
    if request.param == "mixle_compile.decompose":
        return importlib.import_module("mixle_compile.decompose")
    return pytest.importorskip(request.param)


# ---------------------------------------------------------------------------
# Enums
# ---------------------------------------------------------------------------

CONTRACT_ENUMS = {
    "ParallelAxis": {
        "DP_REPLICATE": "dp_replicate",
        "DP_SHARD": "dp_shard",
        "TP": "tp",
        "PP": "pp",
        "CP": "cp",
        "EP": "ep",
        "ETP": "etp",
    },
    "PayloadKind": {
        "GRADIENT": "gradient",
        "SUFFICIENT_STATISTIC": "sufficient_statistic",
        "PARAMETER": "parameter",
        "ACTIVATION": "activation",
        "KV_BLOCK": "kv_block",
        "TOKEN": "token",
        "MESSAGE": "message",
    },
    "CollectiveKind": {
        "NONE": "none",
        "ALL_REDUCE": "all_reduce",
        "REDUCE_SCATTER": "reduce_scatter",
        "ALL_GATHER": "all_gather",
        "ALL_TO_ALL": "all_to_all",
        "BROADCAST": "broadcast",
        "P2P": "p2p",
        "CUSTOM": "custom",
    },
    "StateLayout": {
        "REPLICATED": "replicated",
        "SHARDED": "sharded",
        "PIPELINE_LOCAL": "pipeline_local",
        "EXPERT_LOCAL": "expert_local",
        "OFFLOADED": "offloaded",
    },
}


@pytest.mark.parametrize("enum_name", sorted(CONTRACT_ENUMS))
def test_contract_enum_members_and_values(mx, enum_name):
    enum_cls = getattr(mx, enum_name)
    assert {m.name: m.value for m in enum_cls} == CONTRACT_ENUMS[enum_name]
    for name, value in CONTRACT_ENUMS[enum_name].items():
        member = getattr(enum_cls, name)
        assert enum_cls(value) is member
        # StrEnum: a member is its value
        assert isinstance(member, str) and member == value and str(member) == value and f"{member}" == value


def test_enum_order_of_parallel_axis(mx):
    assert [a.value for a in mx.ParallelAxis] == ["dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "etp"]


def test_decomposition_enum_members_and_values(md):
    assert {m.name: m.value for m in md.DecompAxis} == {
        "NONE": "none",
        "COMPONENT": "component",
        "FACTOR": "factor",
        "SEQUENCE": "sequence",
        "TOPIC": "topic",
        "STATE": "state",
    }
    assert {m.name: m.value for m in md.ReductionOp} == {
        "SUM": "sum",
        "LOGSUMEXP_RESPONSIBILITY": "logsumexp",
        "REPLICATE": "replicate",
    }
    assert md.DecompAxis("component") is md.DecompAxis.COMPONENT
    assert md.ReductionOp("logsumexp") is md.ReductionOp.LOGSUMEXP_RESPONSIBILITY


def test_decomposition_module_names(md):
    for name in ("NodeSize", "AxisCandidate", "ModelCut", "ModelDecomposition"):
        assert isinstance(getattr(md, name), type)
    for name in ("size_model_tree", "tree_axes", "best_parallel_axis", "decompose_model"):
        assert callable(getattr(md, name))


def test_node_size_fields_and_defaults(md):
    leaf = md.NodeSize("root/leaf", md.DecompAxis.NONE, 1, 8, 8)
    assert (leaf.subtree_work, leaf.children) == (1.0, ())
    root = md.NodeSize(
        path="root",
        axis=md.DecompAxis.COMPONENT,
        num_units=2,
        own_param_bytes=4,
        subtree_param_bytes=20,
        subtree_work=3.0,
        children=(leaf, leaf),
    )
    assert root.children[0] is leaf and root.axis is md.DecompAxis.COMPONENT
    assert pickle.loads(pickle.dumps(root)) == root


def test_model_decomposition_pickles_and_deep_copies(md):
    dec = md.ModelDecomposition(
        axis=md.DecompAxis.NONE,
        reduction=md.ReductionOp.REPLICATE,
        num_units=1,
        cuts=(),
        rationale="replicated",
        extra={"path": "root"},
    )
    assert not dec.is_model_parallel
    assert isinstance(dec.extra, dict)
    for clone in (pickle.loads(pickle.dumps(dec)), copy.deepcopy(dec)):
        assert clone == dec and clone.extra == {"path": "root"}
        assert clone.axis is md.DecompAxis.NONE


# ---------------------------------------------------------------------------
# The planner on live mixle models (built with mixle's API, so both halves need mixle)
# ---------------------------------------------------------------------------


@pytest.fixture
def stats():
    """mixle's model constructors."""
    return pytest.importorskip("mixle.stats")


@pytest.fixture
def planner():
    """mixle's Resources and DeviceSpec."""
    return pytest.importorskip("mixle.utils.parallel.planner")


def _mixture(stats, k=6, dim=2):
    return stats.MixtureDistribution(
        [stats.DiagonalGaussianDistribution([float(i)] * dim, [1.0] * dim) for i in range(k)], [1.0 / k] * k
    )


def test_size_model_tree_on_a_live_model(md, stats):
    size = md.size_model_tree(_mixture(stats, 3))
    assert isinstance(size, md.NodeSize)
    assert (size.axis, size.num_units, len(size.children)) == (md.DecompAxis.COMPONENT, 3, 3)
    assert all(c.axis is md.DecompAxis.NONE and c.num_units == 1 for c in size.children)
    assert size.subtree_param_bytes == size.own_param_bytes + sum(c.subtree_param_bytes for c in size.children)
    assert size.own_param_bytes > 0 and size.children[0].own_param_bytes > 0
    assert size.subtree_work > sum(c.subtree_work for c in size.children) > 0


def test_tree_axes_finds_a_mixture_nested_in_a_composite(md, stats):
    model = stats.CompositeDistribution([stats.GaussianDistribution(0.0, 1.0), _mixture(stats, 6)])
    axes = {(c.axis, c.num_units): c for c in md.tree_axes(model)}
    assert set(axes) == {(md.DecompAxis.FACTOR, 2), (md.DecompAxis.COMPONENT, 6)}
    for c in axes.values():
        assert isinstance(c, md.AxisCandidate)
        assert len(c.unit_works) == len(c.unit_bytes) == c.num_units
        assert c.total_work == pytest.approx(sum(c.unit_works)) and min(c.unit_works) > 0
    assert axes[(md.DecompAxis.FACTOR, 2)].reduction is md.ReductionOp.SUM
    assert axes[(md.DecompAxis.COMPONENT, 6)].reduction is md.ReductionOp.LOGSUMEXP_RESPONSIBILITY
    # the composite is thin: one factor carries almost all the work, so the mixture inside is chosen
    best = md.best_parallel_axis(model, 4)
    assert (best.axis, best.num_units) == (md.DecompAxis.COMPONENT, 6)
    only_factors = md.best_parallel_axis(model, 4, allowed_axes=frozenset({md.DecompAxis.FACTOR}))
    assert (only_factors.axis, only_factors.num_units) == (md.DecompAxis.FACTOR, 2)
    assert md.best_parallel_axis(model, 4, allowed_axes=frozenset({md.DecompAxis.STATE})) is None
    assert md.best_parallel_axis(stats.GaussianDistribution(0.0, 1.0), 4) is None


def test_decompose_model_on_mixle_resources(md, stats, planner):
    model = _mixture(stats, 6)
    resources = planner.Resources(
        tuple(planner.DeviceSpec(f"gpu{i}", kind="cuda", memory_bytes=2**30) for i in range(3))
    )
    replicated = md.decompose_model(_mixture(stats, 5), resources)  # fits, data dominates, under 2 units per device
    assert isinstance(replicated, md.ModelDecomposition)
    assert (replicated.axis, replicated.cuts, replicated.is_model_parallel) == (md.DecompAxis.NONE, (), False)
    dec = md.decompose_model(model, resources, prefer_data_parallel=False)
    assert dec.axis is md.DecompAxis.COMPONENT and dec.reduction is md.ReductionOp.LOGSUMEXP_RESPONSIBILITY
    assert dec.is_model_parallel and dec.num_units == 6 and isinstance(dec.rationale, str)
    assert [(c.device.name, c.start, c.stop) for c in dec.cuts] == [("gpu0", 0, 2), ("gpu1", 2, 4), ("gpu2", 4, 6)]
    assert all(isinstance(c, md.ModelCut) and c.reduction is dec.reduction for c in dec.cuts)
    assert "path" in dec.extra and dec.extra["total_work"] == pytest.approx(md.best_parallel_axis(model, 3).total_work)
    one = planner.Resources.single_cpu()
    assert md.decompose_model(model, one, prefer_data_parallel=False).axis is md.DecompAxis.NONE
    for clone in (pickle.loads(pickle.dumps(dec)), copy.deepcopy(dec)):
        assert clone == dec


# ---------------------------------------------------------------------------
# ParallelPlan
# ---------------------------------------------------------------------------


def test_plan_accepts_numpy_integers(mx):
    plan = mx.ParallelPlan(dp_shard=np.int64(4), tp=np.int32(2), microbatches=np.uint8(3))
    assert plan.dp_shard == 4 and type(plan.dp_shard) is int
    assert plan.tp == 2 and type(plan.tp) is int
    assert plan.microbatches == 3 and type(plan.microbatches) is int
    assert plan.world_size == 8
    assert plan == mx.ParallelPlan(dp_shard=4, tp=2, microbatches=3)
    plan.validate_world_size(np.int64(8))


@pytest.mark.parametrize("bad", [True, 2.0, "2", None, 0, -1, np.float64(2.0)])
def test_plan_refuses_what_mixle_refuses(mx, bad):
    with pytest.raises(ValueError):
        mx.ParallelPlan(tp=bad)


def test_plan_axis_sizes(mx):
    plan = mx.ParallelPlan(dp_replicate=2, dp_shard=3, tp=4, pp=5, cp=6, ep=2, etp=1)
    sizes = plan.axis_sizes
    assert isinstance(sizes, dict)
    assert list(sizes) == list(mx.ParallelAxis)
    assert sizes == {
        mx.ParallelAxis.DP_REPLICATE: 2,
        mx.ParallelAxis.DP_SHARD: 3,
        mx.ParallelAxis.TP: 4,
        mx.ParallelAxis.PP: 5,
        mx.ParallelAxis.CP: 6,
        mx.ParallelAxis.EP: 2,
        mx.ParallelAxis.ETP: 1,
    }
    for axis, size in sizes.items():
        assert plan.size(axis) == plan.size(axis.value) == size
    assert plan.world_size == 2 * 3 * 4 * 5 * 6
    assert plan.data_parallel_size == 6
    assert plan.active_axes == tuple(a for a in mx.ParallelAxis if sizes[a] > 1)


def test_plan_mesh_holds_dp_replicate_only_when_nothing_is_active(mx):
    assert mx.ParallelPlan().mesh == (("dp_replicate",), (1,))
    names, shape = mx.ParallelPlan(dp_shard=4, tp=2).mesh
    assert (names, shape) == (("dp_shard", "tp"), (4, 2))
    names, shape = mx.ParallelPlan(dp_replicate=2, tp=2, pp=2, cp=2, ep=2).mesh
    assert dict(zip(names, shape, strict=True)) == {
        "dp_replicate": 2,
        "tp": 2,
        "pp": 2,
        "cp": 2,
    }  # ep is no mesh dimension
    assert math.prod(shape) == 16
    assert mx.ParallelPlan(tp=2).mesh == (("tp",), (2,))


def test_plan_as_dict(mx):
    plan = mx.ParallelPlan(dp_replicate=2, dp_shard=2, tp=2, microbatches=4, gradient_accumulation_steps=2)
    assert plan.as_dict() == {
        "dp_replicate": 2,
        "dp_shard": 2,
        "tp": 2,
        "pp": 1,
        "cp": 1,
        "ep": 1,
        "etp": 1,
        "microbatches": 4,
        "gradient_accumulation_steps": 2,
        "world_size": 8,
        "data_parallel_size": 4,
    }


def test_plan_validate_world_size(mx):
    plan = mx.ParallelPlan(tp=2)
    plan.validate_world_size(2)
    with pytest.raises(ValueError):
        plan.validate_world_size(4)
    with pytest.raises(ValueError):
        mx.ParallelPlan().size("bogus")


# ---------------------------------------------------------------------------
# BackendCapabilities
# ---------------------------------------------------------------------------


def test_capabilities_defaults_and_as_dict(mx):
    caps = mx.BackendCapabilities(name="mine", axes=frozenset({mx.ParallelAxis.DP_SHARD, mx.ParallelAxis.TP}))
    assert caps.precisions == frozenset({"bf16", "fp32"})
    assert caps.distributed_optimizer is False
    assert caps.reshardable_checkpoint is False
    assert caps.elastic_restart is False
    assert caps.requirements == ()
    assert caps.incompatible_axis_sets == ()
    assert caps.as_dict() == {
        "name": "mine",
        "axes": ["dp_shard", "tp"],
        "precisions": ["bf16", "fp32"],
        "distributed_optimizer": False,
        "reshardable_checkpoint": False,
        "elastic_restart": False,
        "requirements": [],
        "incompatible_axis_sets": [],
    }


def test_capabilities_positional_order(mx):
    caps = mx.BackendCapabilities(
        "mine",
        frozenset({mx.ParallelAxis.TP, mx.ParallelAxis.PP}),
        frozenset({"fp32"}),
        True,
        False,
        True,
        ("torch>=2",),
        (frozenset({mx.ParallelAxis.TP, mx.ParallelAxis.PP}),),
    )
    assert caps.distributed_optimizer is True and caps.reshardable_checkpoint is False and caps.elastic_restart is True
    assert caps.as_dict()["requirements"] == ["torch>=2"]
    assert caps.as_dict()["incompatible_axis_sets"] == [["pp", "tp"]]


def test_capabilities_validate(mx):
    axes = frozenset({mx.ParallelAxis.DP_SHARD, mx.ParallelAxis.TP, mx.ParallelAxis.PP})
    caps = mx.BackendCapabilities(
        name="mine",
        axes=axes,
        incompatible_axis_sets=(frozenset({mx.ParallelAxis.TP, mx.ParallelAxis.PP}),),
    )
    caps.validate(mx.ParallelPlan(dp_shard=2, tp=2))  # precision defaults to fp32
    caps.validate(mx.ParallelPlan(tp=2), precision="bf16")
    with pytest.raises(NotImplementedError, match="cp"):
        caps.validate(mx.ParallelPlan(cp=2))
    with pytest.raises(ValueError, match="fp8"):
        caps.validate(mx.ParallelPlan(), precision="fp8")
    with pytest.raises(NotImplementedError):
        caps.validate(mx.ParallelPlan(tp=2, pp=2))
    with pytest.raises(TypeError):
        caps.validate(mx.ParallelPlan(), "fp32")  # precision is keyword-only


# ---------------------------------------------------------------------------
# ParameterLayout
# ---------------------------------------------------------------------------


def test_parameter_layout_defaults(mx):
    layout = mx.ParameterLayout("decoder.w", (np.int64(4), 8))
    assert layout.global_shape == (4, 8) and all(type(d) is int for d in layout.global_shape)
    assert layout.placements == ()
    assert layout.shared_group is None
    assert layout.optimizer_state is mx.StateLayout.REPLICATED
    assert layout.as_dict() == {
        "logical_id": "decoder.w",
        "global_shape": [4, 8],
        "placements": {},
        "shared_group": None,
        "optimizer_state": "replicated",
    }


def test_parameter_layout_positional_fields_and_as_dict(mx):
    layout = mx.ParameterLayout(
        "embed",
        (16, 4),
        (("dp_shard", "shard(0)"), ("tp", "replicate")),
        "tied",
        mx.StateLayout.SHARDED,
    )
    assert layout.as_dict() == {
        "logical_id": "embed",
        "global_shape": [16, 4],
        "placements": {"dp_shard": "shard(0)", "tp": "replicate"},
        "shared_group": "tied",
        "optimizer_state": "sharded",
    }
    with pytest.raises(ValueError):
        mx.ParameterLayout("embed", (16, 4), (("tp", "shard(0)"), ("tp", "replicate")))


# ---------------------------------------------------------------------------
# DistributedUpdate
# ---------------------------------------------------------------------------


def _update(mx, **changes):
    fields = dict(
        node_id="grad:w",
        payload=mx.PayloadKind.GRADIENT,
        collective=mx.CollectiveKind.ALL_REDUCE,
        mesh_axes=(mx.ParallelAxis.DP_SHARD,),
        state_layout=mx.StateLayout.SHARDED,
        exact=False,
    )
    fields.update(changes)
    return mx.DistributedUpdate(**fields)


def test_update_notes_are_a_tuple(mx):
    assert _update(mx).notes == ()
    update = _update(mx, notes=("summed in fp32", "reduced once"))
    assert update.notes == ("summed in fp32", "reduced once")
    d = update.as_dict()
    assert d["notes"] == ["summed in fp32", "reduced once"]
    with pytest.raises(TypeError):
        _update(mx, notes="a bare string")


def test_update_as_dict(mx):
    d = _update(mx, contract_exact=True).as_dict()
    assert d == {
        "node_id": "grad:w",
        "payload": "gradient",
        "collective": "all_reduce",
        "mesh_axes": ["dp_shard"],
        "state_layout": "sharded",
        "exact": False,
        "contract_exact": True,
        "determinism_observed": None,
        "maximum_absolute_error": None,
        "maximum_relative_error": None,
        "numerics_evidence_id": None,
        "numerics_sample_count": 0,
        "notes": [],
    }


def test_update_numerics_evidence(mx):
    update = _update(
        mx,
        determinism_observed=True,
        maximum_absolute_error=0.0,
        maximum_relative_error=1e-7,
        numerics_evidence_id="run/grad:w",
        numerics_sample_count=np.int64(3),
    )
    assert update.numerics_sample_count == 3 and type(update.numerics_sample_count) is int
    with pytest.raises(ValueError):
        _update(mx, exact=True)  # a collective cannot claim bitwise exactness
    with pytest.raises(ValueError):
        _update(mx, numerics_evidence_id="run/grad:w")  # evidence without samples
    with pytest.raises(ValueError):
        _update(mx, numerics_evidence_id="run/grad:w", numerics_sample_count=2)  # no observations


# ---------------------------------------------------------------------------
# StepReceipt
# ---------------------------------------------------------------------------


def _receipt(mx, **changes):
    fields = dict(
        step=np.int64(3),
        loss=np.float32(1.5),
        local_examples=4,
        local_tokens=64,
        microbatches=2,
        accumulation_steps=1,
        data_parallel_size=2,
        optimizer="adamw",
        precision="bf16",
        extra={"lr": 0.001, "phase": "warmup"},
    )
    fields.update(changes)
    return mx.StepReceipt(**fields)


MIXLE_RECEIPT_KEYS = {
    "step",
    "loss",
    "local_examples",
    "local_tokens",
    "microbatches",
    "accumulation_steps",
    "data_parallel_size",
    "global_examples",
    "global_tokens",
    "optimizer",
    "precision",
    "collective_bytes",
    "skipped",
    "extra",
}


def test_receipt_as_dict_has_global_counts(mx):
    receipt = _receipt(mx)
    assert receipt.step == 3 and type(receipt.step) is int
    assert receipt.loss == 1.5 and type(receipt.loss) is float
    d = receipt.as_dict()
    assert MIXLE_RECEIPT_KEYS <= set(d)
    assert {key: d[key] for key in MIXLE_RECEIPT_KEYS} == {
        "step": 3,
        "loss": 1.5,
        "local_examples": 4,
        "local_tokens": 64,
        "microbatches": 2,
        "accumulation_steps": 1,
        "data_parallel_size": 2,
        "global_examples": 8,
        "global_tokens": 128,
        "optimizer": "adamw",
        "precision": "bf16",
        "collective_bytes": 0,
        "skipped": False,
        "extra": {"lr": 0.001, "phase": "warmup"},
    }
    observed = _receipt(mx, global_examples_observed=7, global_tokens_observed=np.int64(100))
    assert (observed.global_examples, observed.global_tokens) == (7, 100)
    assert (observed.as_dict()["global_examples"], observed.as_dict()["global_tokens"]) == (7, 100)


def test_receipt_extra_is_a_detached_dict(mx):
    extra = {"lr": 0.001}
    receipt = _receipt(mx, extra=extra)
    extra["lr"] = 1.0
    assert isinstance(receipt.extra, dict)
    assert receipt.extra == {"lr": 0.001}


def test_receipt_pickles_and_deep_copies(mx):
    receipt = _receipt(mx)
    for clone in (pickle.loads(pickle.dumps(receipt)), copy.deepcopy(receipt), copy.copy(receipt)):
        assert clone == receipt
        assert clone.as_dict() == receipt.as_dict()
        assert isinstance(clone.extra, dict)


# ---------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _restore_registries():
    """Leave each module's process-wide registry as the test found it (neither has unregister)."""
    tables = [importlib.import_module("mixle_compile.contracts").DEFAULT_BACKEND_REGISTRY._entries]
    try:
        tables.append(importlib.import_module("mixle.utils.parallel.training_contracts")._TRAINING_BACKENDS)
    except ImportError:
        pass
    saved = [dict(table) for table in tables]
    yield
    for table, before in zip(tables, saved, strict=True):
        table.clear()
        table.update(before)


class _Session:
    def __init__(self, plan, capabilities):
        self.plan, self.capabilities, self.step = plan, capabilities, 0

    def train_batch(self, inputs, targets):  # pragma: no cover - not driven here
        raise NotImplementedError

    def finish_accumulation(self):
        return None

    def discard_accumulation(self):
        return None

    def close(self):
        pass


def _backend_class(mx):
    class NamelessBackend:
        """A mixle-style backend: capabilities and prepare, no ``name`` attribute."""

        capabilities = mx.BackendCapabilities(name="nameless", axes=frozenset(mx.ParallelAxis))

        def prepare(self, module, *, plan, **kwargs):
            self.capabilities.validate(plan, precision=kwargs.get("precision", "fp32"))
            return _Session(plan, self.capabilities)

    return NamelessBackend


def test_registry_takes_a_backend_without_a_name(mx):
    backend = _backend_class(mx)()
    assert not hasattr(backend, "name")
    key = _unique("Nameless-Backend")
    mx.register_training_backend(key, backend)
    normalised = key.lower().replace("-", "_")
    assert normalised in mx.available_training_backends()
    assert mx.get_training_backend(key) is backend
    assert mx.get_training_backend(f"  {key.upper()} ") is backend
    session = mx.get_training_backend(key).prepare(object(), plan=mx.ParallelPlan(tp=2))
    assert session.plan == mx.ParallelPlan(tp=2) and session.step == 0


def test_registry_re_registering_the_same_object_is_idempotent(mx):
    backend = _backend_class(mx)()
    key = _unique("same")
    mx.register_training_backend(key, backend)
    mx.register_training_backend(key, backend)  # the same object again: no error
    assert mx.get_training_backend(key) is backend
    other = _backend_class(mx)()
    with pytest.raises(ValueError):
        mx.register_training_backend(key, other)
    assert mx.get_training_backend(key) is backend
    mx.register_training_backend(key, other, override=True)
    assert mx.get_training_backend(key) is other


def test_registry_lazy_factory_is_called_once(mx):
    calls = []
    cls = _backend_class(mx)

    def factory():
        calls.append(1)
        return cls()

    key = _unique("lazy")
    mx.register_training_backend(key, factory)
    mx.register_training_backend(key, factory)  # idempotent for a factory too
    assert calls == []
    first = mx.get_training_backend(key)
    assert mx.get_training_backend(key) is first
    assert calls == [1]


def test_registry_unknown_name_is_a_value_error(mx):
    with pytest.raises(ValueError, match="no_such_backend_compat"):
        mx.get_training_backend("no_such_backend_compat")


def test_the_example_in_docs_mixle_md_runs():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "mixle.md").read_text(encoding="utf-8")
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "docs/mixle.md", "exec"), namespace)
    plan, caps = namespace["plan"], namespace["caps"]
    assert plan.axis_sizes[namespace["ParallelAxis"].TP] == 2
    assert plan.mesh == (("dp_shard", "tp"), (4, 2))
    assert caps.precisions == frozenset({"bf16", "fp32"})

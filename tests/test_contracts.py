"""Tests for mixle_compile.contracts: definitions, round trips and invariants."""

from __future__ import annotations

import ast
import copy
import json
import math
import pickle
import subprocess
import sys
import types
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mixle_compile import contracts as c
from mixle_compile.contracts import (
    BUILTIN_CAPABILITIES,
    DEEPSPEED_CAPABILITIES,
    MEGATRON_CAPABILITIES,
    MESH_AXIS_ORDER,
    TORCH_CAPABILITIES,
    TORCHTITAN_CAPABILITIES,
    BackendCapabilities,
    BackendRegistry,
    CapabilityError,
    CollectiveKind,
    DistributedTrainingBackend,
    DistributedTrainingSession,
    DistributedUpdate,
    ParallelAxis,
    ParallelPlan,
    ParameterLayout,
    PayloadKind,
    StateLayout,
    StepReceipt,
    UnknownBackendError,
)

FAST = settings(max_examples=60, deadline=None)

PLAN_FIELDS = (
    "dp_replicate",
    "dp_shard",
    "tp",
    "pp",
    "cp",
    "ep",
    "etp",
    "microbatches",
    "gradient_accumulation_steps",
)
PHYSICAL = ("dp_replicate", "dp_shard", "tp", "pp", "cp")
BAD_INTS = [True, False, 2.0, 1.5, "2", None]


def json_round_trip(obj):
    return type(obj).from_dict(json.loads(json.dumps(obj.as_dict())))


# ---------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------

degrees = st.integers(min_value=1, max_value=8)
plans = st.builds(ParallelPlan, **{name: degrees for name in PLAN_FIELDS})
axis_sets = st.frozensets(st.sampled_from(list(ParallelAxis)))
precision_names = st.sampled_from(["fp32", "bf16", "fp16", "fp8", "tf32"])
identifiers = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
texts = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=12)


@st.composite
def capabilities(draw):
    return BackendCapabilities(
        name=draw(texts),
        axes=draw(axis_sets),
        precisions=draw(st.frozensets(precision_names, min_size=1)),
        requirements=tuple(draw(st.lists(texts, max_size=3))),
        incompatible_axis_sets=tuple(
            draw(st.lists(st.frozensets(st.sampled_from(list(ParallelAxis)), min_size=2), max_size=3))
        ),
        distributed_optimizer=draw(st.booleans()),
        reshardable_checkpoint=draw(st.booleans()),
        elastic_restart=draw(st.booleans()),
    )


@st.composite
def layouts(draw):
    shape = tuple(draw(st.lists(st.integers(1, 64), max_size=4)))
    placement_choices = ["replicate"] + [f"shard({d})" for d in range(len(shape))]
    mesh_axes = draw(st.lists(identifiers, unique=True, max_size=4))
    placements = tuple((axis, draw(st.sampled_from(placement_choices))) for axis in mesh_axes)
    return ParameterLayout(
        logical_id=draw(texts),
        global_shape=shape,
        placements=placements,
        shared_group=draw(st.none() | texts),
        optimizer_state=draw(st.sampled_from(list(StateLayout))),
    )


finite_errors = st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False)


@st.composite
def updates(draw):
    collective = draw(st.sampled_from(list(CollectiveKind)))
    if collective is CollectiveKind.NONE:
        mesh_axes = ()
        exact = draw(st.booleans())
    else:
        mesh_axes = tuple(draw(st.lists(identifiers, unique=True, min_size=1, max_size=3)))
        exact = False
    samples = draw(st.integers(0, 1000))
    if samples:
        evidence = dict(
            determinism_observed=draw(st.booleans()),
            maximum_absolute_error=draw(finite_errors),
            maximum_relative_error=draw(finite_errors),
            numerics_evidence_id=draw(texts),
        )
    else:
        evidence = dict(
            determinism_observed=None,
            maximum_absolute_error=None,
            maximum_relative_error=None,
            numerics_evidence_id=None,
        )
    return DistributedUpdate(
        node_id=draw(texts),
        payload=draw(st.sampled_from(list(PayloadKind))),
        collective=collective,
        mesh_axes=mesh_axes,
        state_layout=draw(st.sampled_from(list(StateLayout))),
        exact=exact,
        notes=tuple(draw(st.lists(st.text(max_size=20), max_size=2))),
        contract_exact=draw(st.booleans()),
        numerics_sample_count=samples,
        **evidence,
    )


extra_scalars = st.none() | st.booleans() | st.integers(-100, 100) | st.text(max_size=5) | finite_errors
receipts = st.builds(
    StepReceipt,
    step=st.integers(0, 10**6),
    loss=st.none() | st.floats(allow_nan=False),
    local_examples=st.integers(0, 10**4),
    local_tokens=st.integers(0, 10**6),
    microbatches=st.integers(1, 16),
    accumulation_steps=st.integers(1, 16),
    data_parallel_size=st.integers(1, 64),
    optimizer=st.sampled_from(["adamw", "sgd"]),
    precision=precision_names,
    collective_bytes=st.integers(0, 10**9),
    skipped=st.booleans(),
    extra=st.dictionaries(
        st.text(min_size=1, max_size=5), extra_scalars | st.lists(extra_scalars, max_size=3).map(tuple), max_size=3
    ),
    global_examples_observed=st.none() | st.integers(0, 10**6),
    global_tokens_observed=st.none() | st.integers(0, 10**8),
)


def make_update(**overrides):
    base = dict(
        node_id="grad_sync",
        payload=PayloadKind.GRADIENT,
        collective=CollectiveKind.ALL_REDUCE,
        mesh_axes=("dp_replicate",),
        state_layout=StateLayout.REPLICATED,
    )
    base.update(overrides)
    return DistributedUpdate(**base)


EVIDENCE = dict(
    numerics_evidence_id="run-42",
    numerics_sample_count=8,
    determinism_observed=True,
    maximum_absolute_error=1e-6,
    maximum_relative_error=1e-4,
)


def make_receipt(**overrides):
    base = dict(
        step=3,
        loss=1.25,
        local_examples=4,
        local_tokens=512,
        microbatches=2,
        accumulation_steps=2,
        data_parallel_size=4,
        optimizer="adamw",
        precision="bf16",
    )
    base.update(overrides)
    return StepReceipt(**base)


def make_caps(**overrides):
    base = dict(
        name="toy",
        axes={"dp_replicate", "dp_shard", "tp"},
        precisions={"fp32", "bf16"},
        distributed_optimizer=False,
        reshardable_checkpoint=False,
        elastic_restart=False,
    )
    base.update(overrides)
    return BackendCapabilities(**base)


# ---------------------------------------------------------------------------
# Module hygiene
# ---------------------------------------------------------------------------


def test_contracts_imports_only_the_standard_library():
    tree = ast.parse(Path(c.__file__).read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    assert roots, "expected some imports"
    non_stdlib = sorted(r for r in roots if r not in sys.stdlib_module_names and r != "__future__")
    assert non_stdlib == []


def test_importing_contracts_does_not_import_torch():
    code = "import sys, mixle_compile.contracts; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_enum_members_are_upper_case_names_of_lower_case_values():
    for enum_cls in (ParallelAxis, PayloadKind, CollectiveKind, StateLayout):
        for member in enum_cls:
            assert member.name == member.value.upper()
            assert isinstance(member, str) and str(member) == member.value
    assert [a.value for a in ParallelAxis] == ["dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "etp"]
    assert len(PayloadKind) == 7 and len(CollectiveKind) == 8 and len(StateLayout) == 5


# ---------------------------------------------------------------------------
# ParallelPlan
# ---------------------------------------------------------------------------


@FAST
@given(plans)
def test_plan_derived_quantities_match_definitions(plan):
    product = 1
    for name in PHYSICAL:
        product *= getattr(plan, name)
    assert plan.world_size == product
    assert plan.data_parallel_size == plan.dp_replicate * plan.dp_shard
    assert plan.active_axes == tuple(a for a in ParallelAxis if getattr(plan, a.value) > 1)
    for axis in ParallelAxis:
        assert plan.size(axis) == plan.size(axis.value) == getattr(plan, axis.value)


@FAST
@given(plans)
def test_plan_mesh_matches_definition(plan):
    names, shape = plan.mesh
    expected_names = [a.value for a in MESH_AXIS_ORDER if getattr(plan, a.value) > 1] or ["dp_replicate"]
    assert list(names) == expected_names
    assert "ep" not in names and "etp" not in names
    assert shape == tuple(getattr(plan, n) for n in names)
    assert math.prod(shape) == plan.world_size
    assert isinstance(names, tuple) and isinstance(shape, tuple)


@FAST
@given(plans)
def test_plan_mesh_of_a_compiled_plan_always_has_dp_replicate(plan):
    names, shape = plan.plan_mesh
    expected_names = [a.value for a in MESH_AXIS_ORDER if getattr(plan, a.value) > 1 or a is ParallelAxis.DP_REPLICATE]
    assert list(names) == expected_names
    assert shape == tuple(getattr(plan, n) for n in names)
    assert math.prod(shape) == plan.world_size
    assert tuple(n for n, s in zip(names, shape, strict=True) if s > 1) == tuple(
        n for n, s in zip(*plan.mesh, strict=True) if s > 1
    )


@FAST
@given(plans)
def test_plan_as_dict_matches_definition_and_round_trips(plan):
    d = plan.as_dict()
    assert set(d) == set(PLAN_FIELDS) | {"world_size", "data_parallel_size"}
    for name in PLAN_FIELDS:
        assert d[name] == getattr(plan, name)
    assert d["world_size"] == plan.world_size
    assert d["data_parallel_size"] == plan.data_parallel_size
    assert ParallelPlan.from_dict(d) == plan
    assert json_round_trip(plan) == plan


def test_mesh_order_is_pp_outermost_tp_innermost():
    assert [a.value for a in MESH_AXIS_ORDER] == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]
    plan = ParallelPlan(dp_replicate=2, dp_shard=3, tp=4, pp=5, cp=6, ep=7, etp=8)
    assert plan.mesh == (("pp", "dp_replicate", "dp_shard", "cp", "tp"), (5, 2, 3, 6, 4))


def test_default_plan_mesh_keeps_dp_replicate():
    plan = ParallelPlan()
    assert plan.world_size == 1
    assert plan.active_axes == ()
    assert plan.mesh == plan.plan_mesh == (("dp_replicate",), (1,))
    assert ParallelPlan(tp=2).mesh == (("tp",), (2,))
    assert ParallelPlan(tp=2).plan_mesh == (("dp_replicate", "tp"), (1, 2))


def test_ep_and_etp_do_not_multiply_world_size_and_are_not_checked_here():
    plan = ParallelPlan(dp_shard=2, ep=3, etp=5)  # 3 and 5 do not divide anything
    assert plan.world_size == 2
    assert plan.active_axes == (ParallelAxis.DP_SHARD, ParallelAxis.EP, ParallelAxis.ETP)


@pytest.mark.parametrize("field_name", PLAN_FIELDS)
@pytest.mark.parametrize("bad", BAD_INTS + [0, -1])
def test_plan_rejects_non_positive_or_non_integer_fields(field_name, bad):
    with pytest.raises((TypeError, ValueError)) as info:
        ParallelPlan(**{field_name: bad})
    message = str(info.value)
    assert f"ParallelPlan.{field_name}" in message
    assert repr(bad) in message


def test_plan_bool_message_is_explicit():
    with pytest.raises(TypeError, match=r"ParallelPlan\.tp must be an integer >= 1, got True \(bool\)"):
        ParallelPlan(tp=True)


def test_plan_size_rejects_unknown_axis_listing_valid_names():
    with pytest.raises(ValueError) as info:
        ParallelPlan().size("tensor")
    message = str(info.value)
    assert "'tensor'" in message
    for axis in ParallelAxis:
        assert axis.value in message


def test_validate_world_size():
    plan = ParallelPlan(dp_replicate=2, dp_shard=2, tp=4)
    plan.validate_world_size(16)
    with pytest.raises(ValueError) as info:
        plan.validate_world_size(8)
    message = str(info.value)
    assert "16" in message and "8" in message
    assert "dp_replicate=2 * dp_shard=2 * tp=4 * pp=1 * cp=1" in message
    with pytest.raises(TypeError, match="actual"):
        plan.validate_world_size(16.0)


def test_plan_from_dict_checks_derived_keys():
    plan = ParallelPlan(dp_shard=2, tp=2)
    d = plan.as_dict()
    d["world_size"] = 8
    with pytest.raises(ValueError, match=r"world_size=8 disagrees.*world_size=4"):
        ParallelPlan.from_dict(d)
    d = plan.as_dict()
    d["data_parallel_size"] = 1
    with pytest.raises(ValueError, match=r"data_parallel_size=1 disagrees.*data_parallel_size=2"):
        ParallelPlan.from_dict(d)
    # Derived keys are optional and degrees default to 1.
    assert ParallelPlan.from_dict({"dp_shard": 2, "tp": 2}) == plan


def test_from_dict_rejects_unknown_and_missing_keys():
    with pytest.raises(ValueError, match="unknown keys.*'tensor_parallel'"):
        ParallelPlan.from_dict({"tensor_parallel": 2})
    with pytest.raises(ValueError, match=r"missing required keys \[.*'node_id'"):
        DistributedUpdate.from_dict({})
    with pytest.raises(TypeError, match="expects a mapping"):
        ParallelPlan.from_dict([("tp", 2)])


def test_plan_is_frozen():
    with pytest.raises(AttributeError):
        ParallelPlan().tp = 2


# ---------------------------------------------------------------------------
# BackendCapabilities
# ---------------------------------------------------------------------------


@FAST
@given(capabilities())
def test_capabilities_round_trip(caps):
    d = caps.as_dict()
    assert d["axes"] == sorted(a.value for a in caps.axes)
    assert d["precisions"] == sorted(caps.precisions)
    assert all(s == sorted(s) for s in d["incompatible_axis_sets"])
    assert d["incompatible_axis_sets"] == sorted(d["incompatible_axis_sets"])
    assert BackendCapabilities.from_dict(d) == caps
    assert json_round_trip(caps) == caps


def test_capabilities_normalise_string_axes_and_set_order():
    a = make_caps(incompatible_axis_sets=[["tp", "dp_shard"], {"dp_replicate", "tp"}])
    b = make_caps(
        axes=[ParallelAxis.TP, "dp_shard", "dp_replicate"],
        incompatible_axis_sets=(
            frozenset({ParallelAxis.TP, ParallelAxis.DP_REPLICATE}),
            frozenset({ParallelAxis.DP_SHARD, ParallelAxis.TP}),
        ),
    )
    assert a == b
    assert all(isinstance(x, ParallelAxis) for x in a.axes)
    assert all(isinstance(x, ParallelAxis) for s in a.incompatible_axis_sets for x in s)
    assert a.supports("tp") and not a.supports(ParallelAxis.PP)


def test_capabilities_reject_malformed_fields():
    with pytest.raises(ValueError, match="unknown ParallelAxis 'tensor'"):
        make_caps(axes={"tensor"})
    with pytest.raises(TypeError, match=r"BackendCapabilities\.axes must be a sequence"):
        make_caps(axes="tp")
    with pytest.raises(ValueError, match="at least two axes"):
        make_caps(incompatible_axis_sets=[{"tp"}])
    with pytest.raises(ValueError, match="at least one precision"):
        make_caps(precisions=set())
    with pytest.raises(TypeError, match=r"BackendCapabilities\.elastic_restart must be a bool"):
        make_caps(elastic_restart=1)
    with pytest.raises(TypeError, match=r"BackendCapabilities\.requirements"):
        make_caps(requirements="torch>=2.6")
    with pytest.raises(ValueError, match=r"BackendCapabilities\.name"):
        make_caps(name=" ")


def test_capabilities_validate_accepts_supported_plan():
    caps = make_caps()
    caps.validate(ParallelPlan(dp_replicate=2, dp_shard=2, tp=2, ep=1), precision="bf16")


def test_capabilities_validate_names_unexecuted_axes():
    caps = make_caps()
    with pytest.raises(CapabilityError) as info:
        caps.validate(ParallelPlan(tp=2, pp=4, cp=2), precision="fp32")
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "'toy'" in message
    assert "pp=4" in message and "cp=2" in message
    assert "tp=2" not in message.split("(it executes")[0]


def test_capabilities_validate_names_bad_precision_and_supported_ones():
    with pytest.raises(CapabilityError) as info:
        make_caps().validate(ParallelPlan(), precision="fp8")
    message = str(info.value)
    assert "'fp8'" in message
    assert "bf16, fp32" in message


def test_capabilities_validate_names_incompatible_set():
    caps = make_caps(incompatible_axis_sets=[{"tp", "dp_shard"}])
    caps.validate(ParallelPlan(tp=2), precision="fp32")  # only one of the set active
    caps.validate(ParallelPlan(dp_shard=2), precision="fp32")
    with pytest.raises(CapabilityError, match=r"\{dp_shard, tp\} active together"):
        caps.validate(ParallelPlan(dp_shard=2, tp=2), precision="fp32")


def test_capabilities_validate_reports_every_problem():
    caps = make_caps(incompatible_axis_sets=[{"tp", "dp_shard"}])
    with pytest.raises(CapabilityError) as info:
        caps.validate(ParallelPlan(dp_shard=2, tp=2, ep=2), precision="fp16")
    message = str(info.value)
    assert "ep=2" in message and "'fp16'" in message and "{dp_shard, tp}" in message


def test_capabilities_validate_requires_a_plan():
    with pytest.raises(TypeError, match="expects a ParallelPlan"):
        make_caps().validate({"tp": 2}, precision="fp32")


def test_builtin_capabilities():
    assert BUILTIN_CAPABILITIES == {
        "torch": TORCH_CAPABILITIES,
        "megatron": MEGATRON_CAPABILITIES,
        "torchtitan": TORCHTITAN_CAPABILITIES,
        "deepspeed": DEEPSPEED_CAPABILITIES,
    }
    assert (
        DEEPSPEED_CAPABILITIES.precisions == {"fp32", "bf16", "fp16"} and DEEPSPEED_CAPABILITIES.distributed_optimizer
    )
    assert TORCH_CAPABILITIES.axes == frozenset(ParallelAxis)
    assert TORCH_CAPABILITIES.precisions == {"fp32", "bf16", "fp64"}
    assert TORCH_CAPABILITIES.distributed_optimizer and TORCH_CAPABILITIES.reshardable_checkpoint
    assert not TORCH_CAPABILITIES.elastic_restart
    assert TORCH_CAPABILITIES.requirements == ("torch>=2.6",)
    assert TORCH_CAPABILITIES.incompatible_axis_sets == ()  # every combination of axes runs
    assert MEGATRON_CAPABILITIES.axes == frozenset(ParallelAxis)
    assert MEGATRON_CAPABILITIES.precisions == {"fp32", "bf16", "fp16", "fp8"}
    assert MEGATRON_CAPABILITIES.distributed_optimizer and MEGATRON_CAPABILITIES.reshardable_checkpoint
    assert not MEGATRON_CAPABILITIES.elastic_restart
    assert MEGATRON_CAPABILITIES.requirements == ("megatron-core", "NVIDIA GPUs")
    with pytest.raises(CapabilityError, match="'fp8'"):
        TORCH_CAPABILITIES.validate(ParallelPlan(), precision="fp8")
    MEGATRON_CAPABILITIES.validate(ParallelPlan(tp=2, ep=2), precision="fp8")


# ---------------------------------------------------------------------------
# ParameterLayout
# ---------------------------------------------------------------------------


@FAST
@given(layouts())
def test_layout_round_trip(layout):
    d = layout.as_dict()
    assert d["global_shape"] == list(layout.global_shape)
    assert d["placements"] == dict(layout.placements)
    assert list(d["placements"].items()) == list(layout.placements)
    assert d["optimizer_state"] == layout.optimizer_state.value
    assert ParameterLayout.from_dict(d) == layout
    assert json_round_trip(layout) == layout
    # The written-out as_dict is the generic conversion of every field, placements as a mapping.
    generic = {**c._Contract.as_dict(layout), "placements": dict(layout.placements)}
    assert d == generic and list(d) == list(generic)


def layout(**overrides):
    base = dict(
        logical_id="layers.0.mlp.w1",
        global_shape=(1024, 4096),
        placements=(("dp_shard", "shard(0)"), ("tp", "shard(1)")),
        optimizer_state=StateLayout.SHARDED,
    )
    base.update(overrides)
    return ParameterLayout(**base)


def test_layout_accepts_scalars_and_lists():
    scalar = layout(global_shape=(), placements=[["dp_replicate", "replicate"]], optimizer_state="replicated")
    assert scalar.global_shape == ()
    assert scalar.placements == (("dp_replicate", "replicate"),)
    assert scalar.optimizer_state is StateLayout.REPLICATED
    assert layout().placement_on("tp") == "shard(1)"
    assert layout().placement_on("pp") == "replicate"
    assert layout().sharded_axes == ("dp_shard", "tp")


def test_layout_rejects_empty_logical_id():
    with pytest.raises(ValueError, match=r"ParameterLayout\.logical_id must be a non-empty string"):
        layout(logical_id="")


@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "4", None])
def test_layout_rejects_bad_shape_dims(bad):
    with pytest.raises((TypeError, ValueError), match=r"ParameterLayout\.global_shape\[1\] must be an integer >= 1"):
        layout(global_shape=(8, bad))


@pytest.mark.parametrize(
    "bad", ["shard(x)", "Shard(0)", "shard(-1)", "shard(01)", "shard( 0)", "split", "", "replicated"]
)
def test_layout_rejects_malformed_placements(bad):
    with pytest.raises(ValueError) as info:
        layout(placements=(("tp", bad),))
    assert "placement" in str(info.value)


def test_layout_rejects_shard_dim_beyond_rank():
    with pytest.raises(ValueError, match=r"shards dimension 2.*\(2 dimensions\)"):
        layout(placements=(("tp", "shard(2)"),))
    with pytest.raises(ValueError, match="shards dimension 0"):
        layout(global_shape=(), placements=(("tp", "shard(0)"),))


def test_layout_rejects_duplicate_mesh_axis():
    with pytest.raises(ValueError, match="mesh axis 'tp' more than once"):
        layout(placements=(("tp", "shard(0)"), ("tp", "replicate")))


def test_layout_rejects_malformed_pairs():
    with pytest.raises(ValueError, match=r"placements\[0\] must be a \(mesh_axis, placement\) pair"):
        layout(placements=(("tp", "shard(0)", "extra"),))
    with pytest.raises(ValueError, match="mesh axis name"):
        layout(placements=(("t p", "shard(0)"),))
    with pytest.raises(ValueError, match="unknown StateLayout 'everywhere'"):
        layout(optimizer_state="everywhere")


# ---------------------------------------------------------------------------
# DistributedUpdate
# ---------------------------------------------------------------------------


@FAST
@given(updates())
def test_update_round_trip(update):
    d = update.as_dict()
    assert d["payload"] == update.payload.value
    assert d["collective"] == update.collective.value
    assert d["mesh_axes"] == list(update.mesh_axes)
    assert DistributedUpdate.from_dict(d) == update
    assert json_round_trip(update) == update
    # The written-out as_dict is the generic conversion of every field, in field order.
    generic = c._Contract.as_dict(update)
    assert d == generic and list(d) == list(generic)


def test_update_as_dict_writes_plan_axes_as_their_names():
    update = make_update(mesh_axes=(ParallelAxis.DP_SHARD, ParallelAxis.CP))
    assert update.as_dict() == c._Contract.as_dict(update)
    axes = update.as_dict()["mesh_axes"]
    assert axes == ["dp_shard", "cp"] and all(type(axis) is str for axis in axes)  # plain names, as JSON reads back


def test_update_accepts_enum_strings():
    update = make_update(
        payload="gradient", collective="reduce_scatter", state_layout="sharded", mesh_axes=["dp_shard"]
    )
    assert update.payload is PayloadKind.GRADIENT
    assert update.collective is CollectiveKind.REDUCE_SCATTER
    assert update.state_layout is StateLayout.SHARDED
    assert update.mesh_axes == ("dp_shard",)
    with pytest.raises(ValueError, match="unknown CollectiveKind 'allreduce'.*all_reduce"):
        make_update(collective="allreduce")


@pytest.mark.parametrize("collective", [k for k in CollectiveKind if k is not CollectiveKind.NONE])
def test_only_local_updates_may_claim_bitwise_exactness(collective):
    with pytest.raises(ValueError, match=rf"exact=True.*{collective.value}"):
        make_update(collective=collective, exact=True)
    # exact arithmetic contracts are fine for collectives
    assert make_update(collective=collective, contract_exact=True).contract_exact


def test_local_update_may_claim_exactness():
    update = make_update(collective="none", mesh_axes=(), exact=True)
    assert update.exact


def test_collective_none_has_no_mesh_axes_and_others_need_one():
    with pytest.raises(ValueError, match="collective 'none'.*mesh_axes is \\['tp'\\]"):
        make_update(collective="none", mesh_axes=("tp",))
    with pytest.raises(ValueError, match="'all_gather' needs at least one mesh axis"):
        make_update(collective="all_gather", mesh_axes=())


def test_update_rejects_duplicate_mesh_axes():
    with pytest.raises(ValueError, match="mesh_axes lists tp more than once"):
        make_update(mesh_axes=("tp", "dp_shard", "tp"))


def test_update_with_complete_evidence_is_accepted():
    update = make_update(**EVIDENCE)
    assert update.has_numerics_evidence
    assert not make_update().has_numerics_evidence


def test_evidence_id_without_samples_is_rejected():
    evidence = dict(EVIDENCE, numerics_sample_count=0)
    with pytest.raises(ValueError, match="numerics_evidence_id='run-42' is given but numerics_sample_count is 0"):
        make_update(**evidence)


def test_samples_without_evidence_id_are_rejected():
    evidence = dict(EVIDENCE, numerics_evidence_id=None)
    with pytest.raises(ValueError, match="numerics_sample_count=8 needs a numerics_evidence_id"):
        make_update(**evidence)


@pytest.mark.parametrize("missing", ["determinism_observed", "maximum_absolute_error", "maximum_relative_error"])
def test_samples_require_every_observation(missing):
    evidence = dict(EVIDENCE, **{missing: None})
    with pytest.raises(ValueError, match=rf"requires the observations {missing}"):
        make_update(**evidence)


@pytest.mark.parametrize(
    "claim", [{"determinism_observed": True}, {"maximum_absolute_error": 0.0}, {"maximum_relative_error": 1e-7}]
)
def test_observations_without_samples_are_rejected(claim):
    (name,) = claim
    with pytest.raises(ValueError, match=rf"{name} given without numerics evidence"):
        make_update(**claim)


@pytest.mark.parametrize("name", ["maximum_absolute_error", "maximum_relative_error"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1e-9])
def test_observed_errors_must_be_finite_and_non_negative(name, bad):
    with pytest.raises(ValueError, match=rf"DistributedUpdate\.{name} must be a finite number >= 0"):
        make_update(**dict(EVIDENCE, **{name: bad}))
    with pytest.raises(ValueError, match=rf"DistributedUpdate\.{name}"):
        make_update(**{name: bad})


def test_observed_errors_reject_non_numbers_and_coerce_ints():
    with pytest.raises(TypeError, match=r"DistributedUpdate\.maximum_absolute_error must be a real number"):
        make_update(maximum_absolute_error=True)
    with pytest.raises(TypeError, match=r"DistributedUpdate\.maximum_relative_error must be a real number"):
        make_update(maximum_relative_error="0.1")
    update = make_update(**dict(EVIDENCE, maximum_absolute_error=0))
    assert update.maximum_absolute_error == 0.0 and type(update.maximum_absolute_error) is float


@pytest.mark.parametrize("bad", [True, 1.0, "3", None, -1])
def test_sample_count_must_be_exact_non_negative_int(bad):
    with pytest.raises(
        (TypeError, ValueError), match=r"DistributedUpdate\.numerics_sample_count must be an integer >= 0"
    ):
        make_update(numerics_sample_count=bad)


@pytest.mark.parametrize("name", ["exact", "contract_exact", "determinism_observed"])
@pytest.mark.parametrize("bad", [1, 0, "true"])
def test_update_flags_must_be_real_bools(name, bad):
    with pytest.raises(TypeError, match=rf"DistributedUpdate\.{name} must be a bool"):
        make_update(**{name: bad})


def test_update_rejects_empty_node_id_and_bad_mesh_axis():
    with pytest.raises(ValueError, match=r"DistributedUpdate\.node_id"):
        make_update(node_id="")
    with pytest.raises(TypeError, match=r"DistributedUpdate\.mesh_axes must be a sequence"):
        make_update(mesh_axes="tp")


# ---------------------------------------------------------------------------
# StepReceipt
# ---------------------------------------------------------------------------


@FAST
@given(receipts)
def test_receipt_round_trip_and_global_counts(receipt):
    d = receipt.as_dict()
    assert type(d["extra"]) is dict
    assert StepReceipt.from_dict(d) == receipt
    assert json_round_trip(receipt) == receipt
    if receipt.global_examples_observed is None:
        assert receipt.global_examples == receipt.local_examples * receipt.data_parallel_size
    else:
        assert receipt.global_examples == receipt.global_examples_observed
    if receipt.global_tokens_observed is None:
        assert receipt.global_tokens == receipt.local_tokens * receipt.data_parallel_size
    else:
        assert receipt.global_tokens == receipt.global_tokens_observed


def test_receipt_global_counts_prefer_observed_values():
    receipt = make_receipt()
    assert (receipt.global_examples, receipt.global_tokens) == (16, 2048)
    observed = make_receipt(global_examples_observed=15, global_tokens_observed=2000)
    assert (observed.global_examples, observed.global_tokens) == (15, 2000)
    zero = make_receipt(global_examples_observed=0)
    assert zero.global_examples == 0


def test_receipt_loss_may_diverge_or_be_missing():
    assert math.isnan(make_receipt(loss=float("nan")).loss)
    assert make_receipt(loss=float("inf")).loss == float("inf")
    assert make_receipt(loss=None, skipped=True).loss is None
    assert type(make_receipt(loss=2).loss) is float
    nan_receipt = make_receipt(loss=float("nan"))
    assert StepReceipt.from_dict(nan_receipt.as_dict()) == nan_receipt
    for bad in (True, "1.0"):
        with pytest.raises(TypeError, match=r"StepReceipt\.loss must be a real number"):
            make_receipt(loss=bad)


RECEIPT_INT_MINIMUMS = {
    "step": 0,
    "local_examples": 0,
    "local_tokens": 0,
    "collective_bytes": 0,
    "microbatches": 1,
    "accumulation_steps": 1,
    "data_parallel_size": 1,
    "global_examples_observed": 0,
    "global_tokens_observed": 0,
}


@pytest.mark.parametrize("name", sorted(RECEIPT_INT_MINIMUMS))
@pytest.mark.parametrize("bad", [True, 2.0, "2", "below"])
def test_receipt_integer_fields_are_exact(name, bad):
    minimum = RECEIPT_INT_MINIMUMS[name]
    if bad == "below":
        bad = minimum - 1
    with pytest.raises((TypeError, ValueError), match=rf"StepReceipt\.{name} must be an integer >= {minimum}"):
        make_receipt(**{name: bad})


def test_receipt_required_int_fields_reject_none():
    with pytest.raises(TypeError, match=r"StepReceipt\.step must be an integer"):
        make_receipt(step=None)


def test_receipt_extra_is_read_only_copy():
    source = {"grad_norm": 1.5, "per_rank": [1, 2]}
    receipt = make_receipt(extra=source)
    source["grad_norm"] = 99.0
    assert receipt.extra["grad_norm"] == 1.5
    assert receipt.extra["per_rank"] == (1, 2)
    with pytest.raises(TypeError):
        receipt.extra["new"] = 1  # type: ignore[index]
    assert receipt.as_dict()["extra"] == {"grad_norm": 1.5, "per_rank": [1, 2]}
    hash(receipt)
    with pytest.raises(TypeError, match=r"StepReceipt\.extra\['nested'\]"):
        make_receipt(extra={"nested": {"a": 1}})
    with pytest.raises(TypeError, match="keys must be strings"):
        make_receipt(extra={1: 2})


def test_receipt_strings_and_flags():
    with pytest.raises(ValueError, match=r"StepReceipt\.optimizer"):
        make_receipt(optimizer="")
    with pytest.raises(TypeError, match=r"StepReceipt\.precision"):
        make_receipt(precision=None)
    with pytest.raises(TypeError, match=r"StepReceipt\.skipped must be a bool"):
        make_receipt(skipped=0)


# ---------------------------------------------------------------------------
# Protocols and registry
# ---------------------------------------------------------------------------


class FakeSession:
    def __init__(self, plan):
        self.plan = plan
        self.capabilities = TORCH_CAPABILITIES
        self.step = 0

    def train_batch(self, inputs, targets):
        self.step += 1
        return make_receipt(step=self.step)

    def finish_accumulation(self):
        return None

    def discard_accumulation(self):
        return None

    def close(self):
        return None


class FakeBackend:
    capabilities = make_caps(name="fake")

    def __init__(self, name="fake"):
        self.name = name

    def prepare(self, module, *, plan, **options):
        return FakeSession(plan)


class NotABackend:
    name = "nope"

    def prepare(self, module, *, plan, **options):
        raise AssertionError


def test_protocols_are_runtime_checkable():
    backend = FakeBackend()
    assert isinstance(backend, DistributedTrainingBackend)
    session = backend.prepare(object(), plan=ParallelPlan())
    assert isinstance(session, DistributedTrainingSession)
    assert not isinstance(NotABackend(), DistributedTrainingBackend)
    assert not isinstance(object(), DistributedTrainingSession)


def test_registry_normalises_names():
    registry = BackendRegistry()
    backend = FakeBackend()
    registry.register("  My-Backend ", backend)
    assert registry.available() == ("my_backend",)
    for spelling in ("my_backend", "MY-BACKEND", " my-backend\t"):
        assert registry.get(spelling) is backend
        assert spelling in registry
    with pytest.raises(ValueError, match="already registered"):
        registry.register("my_backend", FakeBackend())


@pytest.mark.parametrize("name", ["", "   "])
def test_registry_refuses_empty_names(name):
    with pytest.raises(ValueError, match="non-empty"):
        BackendRegistry().register(name, FakeBackend())


def test_registry_refuses_non_string_names():
    with pytest.raises(TypeError, match="backend name must be a string"):
        BackendRegistry().register(None, FakeBackend())


def test_registry_calls_factory_once_lazily():
    calls = []

    def factory():
        calls.append(1)
        return FakeBackend("lazy")

    registry = BackendRegistry()
    registry.register("lazy", factory)
    assert calls == []
    assert registry.available() == ("lazy",)
    first = registry.get("lazy")
    second = registry.get("LAZY")
    assert first is second
    assert first.name == "lazy"
    assert calls == [1]


def test_registry_accepts_lambda_factory():
    registry = BackendRegistry()
    registry.register("l", lambda: FakeBackend("l"))
    assert registry.get("l").name == "l"


def test_registry_checks_factory_result_against_protocol():
    registry = BackendRegistry()
    registry.register("bad", lambda: NotABackend())
    with pytest.raises(TypeError, match="does not implement DistributedTrainingBackend.*capabilities"):
        registry.get("bad")
    registry.register("cls", lambda: FakeBackend)
    with pytest.raises(TypeError, match="got the class FakeBackend"):
        registry.get("cls")


def test_registry_refuses_factory_needing_arguments():
    with pytest.raises(TypeError, match="callable with no arguments"):
        BackendRegistry().register("x", lambda name: FakeBackend(name))


def test_registry_refuses_duplicates_unless_override():
    registry = BackendRegistry()
    original = FakeBackend("a")
    registry.register("a", original)
    with pytest.raises(ValueError, match="'a' is already registered; pass override=True"):
        registry.register("A", FakeBackend("b"))
    assert registry.get("a") is original
    replacement = FakeBackend("b")
    registry.register("a", replacement, override=True)
    assert registry.get("a") is replacement
    with pytest.raises(TypeError, match="override must be a bool"):
        registry.register("a", replacement, override=1)


def test_registry_unknown_name_lists_registered():
    registry = BackendRegistry()
    registry.register("alpha", FakeBackend())
    registry.register("beta", FakeBackend())
    with pytest.raises(KeyError) as info:
        registry.get("gamma")
    assert isinstance(info.value, UnknownBackendError)
    assert str(info.value) == "no training backend named 'gamma'; registered backends: alpha, beta"
    assert "(none registered)" in str(pytest.raises(UnknownBackendError, BackendRegistry().get, "x").value)


class ClassLevelBackend:
    name = "class_level"
    capabilities = make_caps(name="class_level")

    def prepare(self, module, *, plan, **options):
        return FakeSession(plan)


def test_registry_refuses_classes():
    with pytest.raises(TypeError, match="got the class FakeBackend, not an instance"):
        BackendRegistry().register("fake", FakeBackend)
    # A class whose attributes satisfy the protocol structurally is still a class.
    assert isinstance(ClassLevelBackend, DistributedTrainingBackend)
    with pytest.raises(TypeError, match="got the class ClassLevelBackend, not an instance"):
        BackendRegistry().register("class_level", ClassLevelBackend)
    registry = BackendRegistry()
    registry.register("class_level", ClassLevelBackend())
    assert registry.get("class_level").name == "class_level"


def test_registry_refuses_non_protocol_objects():
    with pytest.raises(TypeError, match=r"does not implement DistributedTrainingBackend \(missing: capabilities\)"):
        BackendRegistry().register("nope", NotABackend())
    with pytest.raises(TypeError, match="missing: capabilities, prepare"):
        BackendRegistry().register("obj", object())


def test_registry_checks_member_types():
    backend = FakeBackend()
    backend.capabilities = {"axes": []}
    with pytest.raises(TypeError, match="backend.capabilities must be a BackendCapabilities"):
        BackendRegistry().register("x", backend)


def test_default_registry_has_builtins():
    assert {"torch", "megatron"} <= set(c.available_training_backends())
    assert c.available_training_backends() == tuple(sorted(c.available_training_backends()))
    for name, caps in BUILTIN_CAPABILITIES.items():
        backend = c.get_training_backend(name)
        assert isinstance(backend, DistributedTrainingBackend)
        assert backend.name == name
        assert backend.capabilities is caps
        assert c.get_training_backend(name.upper()) is backend
    assert c.register_training_backend.__self__ is c.DEFAULT_BACKEND_REGISTRY


def test_megatron_backend_is_verification_only():
    backend = c.get_training_backend("megatron")
    with pytest.raises(NotImplementedError, match="declared for verification only"):
        backend.prepare(object(), plan=ParallelPlan())


def test_torch_backend_without_runtime(monkeypatch):
    monkeypatch.setitem(sys.modules, "mixle_compile.runtime", None)  # makes the import fail
    backend = c.get_training_backend("torch")
    with pytest.raises(RuntimeError, match="the torch runtime is not installed/available in this version"):
        backend.prepare(object(), plan=ParallelPlan())


def test_torch_backend_checks_capabilities_before_importing(monkeypatch):
    monkeypatch.setitem(sys.modules, "mixle_compile.runtime", None)
    backend = c.get_training_backend("torch")
    with pytest.raises(CapabilityError, match="'fp8'"):
        backend.prepare(object(), plan=ParallelPlan(), precision="fp8")


def test_torch_backend_delegates_to_runtime(monkeypatch):
    runtime = types.ModuleType("mixle_compile.runtime")
    seen = {}

    def prepare(module, *, plan, **options):
        seen.update(module=module, plan=plan, options=options)
        return FakeSession(plan)

    runtime.prepare = prepare
    monkeypatch.setitem(sys.modules, "mixle_compile.runtime", runtime)
    plan = ParallelPlan(tp=2)
    module = object()
    session = c.get_training_backend("torch").prepare(module, plan=plan, precision="bf16")
    assert isinstance(session, DistributedTrainingSession)
    assert seen == {"module": module, "plan": plan, "options": {"precision": "bf16"}}

    runtime.prepare = lambda module, *, plan, **options: object()
    with pytest.raises(TypeError, match="does not implement DistributedTrainingSession"):
        c.get_training_backend("torch").prepare(module, plan=plan)


def test_receipt_extra_refuses_every_mutation_but_is_a_dict():
    receipt = make_receipt(extra={"grad_norm": 1.5})
    assert isinstance(receipt.extra, dict)
    for mutate in (
        lambda e: e.update(a=1),
        lambda e: e.pop("grad_norm"),
        lambda e: e.popitem(),
        lambda e: e.setdefault("a", 1),
        lambda e: e.clear(),
        lambda e: e.__delitem__("grad_norm"),
        lambda e: e.__ior__({"a": 1}),
    ):
        with pytest.raises(TypeError, match="frozen record"):
            mutate(receipt.extra)
    assert receipt.extra == {"grad_norm": 1.5}
    for clone in (pickle.loads(pickle.dumps(receipt)), copy.deepcopy(receipt)):
        assert clone == receipt and type(clone.extra) is type(receipt.extra)
        with pytest.raises(TypeError):
            clone.extra["x"] = 1  # type: ignore[index]


def test_receipt_from_dict_checks_the_stated_global_counts():
    receipt = make_receipt()
    d = receipt.as_dict()
    assert (d["global_examples"], d["global_tokens"]) == (16, 2048)
    assert d["global_examples_observed"] is None
    with pytest.raises(ValueError, match=r"global_examples=17 disagrees .* give global_examples=16"):
        StepReceipt.from_dict({**d, "global_examples": 17})
    assert StepReceipt.from_dict({k: v for k, v in d.items() if not k.startswith("global_")}) == receipt


def test_numpy_integers_are_stored_as_int():
    np = pytest.importorskip("numpy")
    plan = ParallelPlan(tp=np.int64(2), pp=np.uint16(2))
    assert (type(plan.tp), type(plan.pp)) == (int, int)
    assert json.dumps(plan.as_dict())  # plain ints serialise
    with pytest.raises(TypeError, match=r"ParallelPlan\.tp must be an integer"):
        ParallelPlan(tp=np.float64(2.0))
    with pytest.raises(TypeError, match=r"ParallelPlan\.tp must be an integer"):
        ParallelPlan(tp=np.bool_(True))


def test_update_notes_must_be_a_tuple_of_strings():
    assert make_update(notes=["a", "b"]).notes == ("a", "b")
    with pytest.raises(TypeError, match=r"DistributedUpdate\.notes must be a tuple of strings.*pass \('one note',\)"):
        make_update(notes="one note")
    with pytest.raises(TypeError, match=r"DistributedUpdate\.notes\[1\] must be a string"):
        make_update(notes=("a", 2))


def test_registry_re_register_is_idempotent_and_name_is_optional():
    registry = BackendRegistry()

    class Nameless:
        capabilities = TORCH_CAPABILITIES

        def prepare(self, module, *, plan, **options):
            raise NotImplementedError

    backend = Nameless()
    registry.register("mine", backend)
    registry.register("MINE", backend)
    assert registry.get("mine") is backend and registry.available() == ("mine",)
    with pytest.raises(ValueError, match="already registered; pass override=True"):
        registry.register("mine", Nameless())
    with pytest.raises(TypeError):
        registry.register("mine", Nameless(), True)  # override is keyword-only

    class BadName(Nameless):
        name = ""

    with pytest.raises(TypeError, match=r"backend\.name, when given, must be a non-empty string"):
        registry.register("bad", BadName())

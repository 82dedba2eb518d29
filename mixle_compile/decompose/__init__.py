"""Placing a model on devices: the best axis to cut and the optimal contiguous cut of its units.

Entry point: :func:`decompose_model` (a :class:`~mixle_compile.graph.ModelGraph` and the devices
in, a frozen :class:`ModelDecomposition` out). The package also re-exports the sizing queries
and the decomposition vocabulary of :mod:`mixle_compile.graph`, so it holds every name mixle's
``model_decomposition`` module has.
"""

from mixle_compile.decompose.cut import (
    ContiguousCut,
    Shard,
    bottleneck_lower_bound,
    brute_force_contiguous_cut,
    cut_bottleneck,
    exchangeable_cut,
    optimal_contiguous_cut,
)
from mixle_compile.decompose.devices import Device, devices_from_resources
from mixle_compile.decompose.plan import (
    AXIS_TOO_LARGE,
    MAX_CUT_UNITS,
    MIN_COMPONENTS_UNSATISFIABLE,
    TOO_FEW_DEVICES,
    UNIT_EXCEEDS_MEMORY,
    ModelCut,
    ModelDecomposition,
    decompose_model,
)
from mixle_compile.graph import (
    AxisCandidate,
    DecompAxis,
    NodeSize,
    ReductionOp,
    best_parallel_axis,
    size_model_tree,
    tree_axes,
)

__all__ = [
    "AXIS_TOO_LARGE",
    "AxisCandidate",
    "DecompAxis",
    "NodeSize",
    "ReductionOp",
    "best_parallel_axis",
    "size_model_tree",
    "tree_axes",
    "MAX_CUT_UNITS",
    "MIN_COMPONENTS_UNSATISFIABLE",
    "TOO_FEW_DEVICES",
    "UNIT_EXCEEDS_MEMORY",
    "ContiguousCut",
    "Device",
    "ModelCut",
    "ModelDecomposition",
    "Shard",
    "bottleneck_lower_bound",
    "brute_force_contiguous_cut",
    "cut_bottleneck",
    "decompose_model",
    "devices_from_resources",
    "exchangeable_cut",
    "optimal_contiguous_cut",
]

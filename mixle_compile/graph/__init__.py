"""The decomposition graph: a networkx DAG of the model's decomposition nodes, with sizes and work.

Entry point: :func:`build_model_graph` (a :class:`~mixle_compile.spec.Spec` in, a frozen
:class:`ModelGraph` out). The other functions are queries on that graph. Importing this package
imports networkx; the fast ``check`` path must not import it.
"""

from mixle_compile.graph.axes import DecompAxis, ReductionOp
from mixle_compile.graph.build import GRAPH_CYCLE, DecompositionNode, ModelGraph, build_model_graph, spec_diagnostic
from mixle_compile.graph.sizing import (
    AxisCandidate,
    NodeSize,
    UnitRun,
    best_parallel_axis,
    compute_cost,
    cost_children,
    parallel_benefit,
    shard_children,
    size_model_tree,
    subtree_work,
    tree_axes,
)
from mixle_compile.graph.work import NodeCost, distribution_node_cost, parameter_work

__all__ = [
    "GRAPH_CYCLE",
    "AxisCandidate",
    "DecompAxis",
    "DecompositionNode",
    "ModelGraph",
    "NodeCost",
    "NodeSize",
    "ReductionOp",
    "UnitRun",
    "best_parallel_axis",
    "build_model_graph",
    "compute_cost",
    "cost_children",
    "distribution_node_cost",
    "parallel_benefit",
    "parameter_work",
    "shard_children",
    "size_model_tree",
    "spec_diagnostic",
    "subtree_work",
    "tree_axes",
]

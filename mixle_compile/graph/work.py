"""The work proxy and parameter counts of every kind of decomposition node, in one place.

Work is a proxy for FLOPs per observation (a data point for a distribution, a token for a neural
model). It is derived from each node's parameter shapes and only its ratios matter: it balances
shards against each other and against device throughput. ``docs/decomposition.md`` prints this
table; keep the two in step.

========================  ==========================  =========================================
node                      own parameters (scalars)    own work per observation
========================  ==========================  =========================================
gaussian, diag, dim D     2D (mean, variance)         2D
gaussian, full, dim D     D*D + D (covariance, mean)  D*D + D (the quadratic form)
categorical, V values     V                           1 (a lookup)
poisson, dim D            D                           2D
exponential, dim D        D                           2D
transitions, S states     S*S + S                     1 (a lookup when scored on its own)
mixture, K components     K (weights)                 K (responsibilities, a log-sum-exp over K)
composite                 0                           0 (its factors carry the work)
hmm, S states             S*S + S if it holds its     2*S*S (forward and backward recursion,
                          own transitions, else 0     per step, wherever the matrix lives)
sequence                  0                           0 (base and length carry the work)
neural parameter          numel                       2*numel per token
neural embedding          numel                       0 (a row gather, no multiply)
neural expert tensor      numel                       2*numel * k/E (k of E experts see a token)
========================  ==========================  =========================================

Bytes are scalars times the bytes of the training precision (a neural parameter: its own dtype).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mixle_compile.parameters import Parameter
from mixle_compile.spec.models import (
    HMM,
    Categorical,
    Composite,
    Exponential,
    Gaussian,
    Mixture,
    Poisson,
    Sequence,
    Transitions,
)

# Forward and backward each touch the whole S x S matrix once per step.
FORWARD_BACKWARD_PASSES = 2
# A matrix multiply costs a multiply and an add per weight per token.
FLOPS_PER_PARAMETER_PER_TOKEN = 2


@dataclass(frozen=True)
class NodeCost:
    """A node's own parameters (scalars, excluding its children) and its own work per observation."""

    param_count: int
    work: float


def distribution_node_cost(node: Any) -> NodeCost:
    """Own parameter count and own work of one distribution node (see the module's table)."""
    if isinstance(node, Gaussian):
        d = node.dim
        return NodeCost(d * d + d, float(d * d + d)) if node.covariance == "full" else NodeCost(2 * d, float(2 * d))
    if isinstance(node, Categorical):
        return NodeCost(node.num_values, 1.0)
    if isinstance(node, (Poisson, Exponential)):
        return NodeCost(node.dim, float(2 * node.dim))
    if isinstance(node, Transitions):
        s = node.num_states
        return NodeCost(s * s + s, 1.0)
    if isinstance(node, Mixture):
        k = node.num_components
        return NodeCost(k, float(k))
    if isinstance(node, HMM):
        s = node.num_states
        own = s * s + s if node.transitions is None else 0
        return NodeCost(own, float(FORWARD_BACKWARD_PASSES * s * s))
    if isinstance(node, (Composite, Sequence)):
        return NodeCost(0, 0.0)
    raise TypeError(f"no work proxy for a {type(node).__name__} node")


def parameter_work(param: Parameter, active_fraction: float = 1.0) -> float:
    """Work per token of one neural parameter; ``active_fraction`` is k/E for expert tensors."""
    if param.role == "embedding":
        return 0.0
    return float(FLOPS_PER_PARAMETER_PER_TOKEN * param.numel) * active_fraction

"""The vocabulary of decomposition: along which axis a node splits, and how its shards recombine."""

from __future__ import annotations

from enum import Enum


class DecompAxis(str, Enum):
    """The dimension a node of the model splits along for model parallelism."""

    none = "none"  # atomic: held whole (leaves, neural blocks)
    component = "component"  # mixture components, mixture-of-experts experts
    factor = "factor"  # independent coordinates of a composite record
    sequence = "sequence"  # i.i.d. elements of a sequence: the data axis, sized from the data
    topic = "topic"  # shared latent topics (hierarchical models); no spec node declares it yet
    state = "state"  # HMM emission states; the transition matrix stays whole on every shard


class ReductionOp(str, Enum):
    """How per-shard sufficient statistics recombine across shards."""

    sum = "sum"  # additive statistics: one all-reduce of the shard sums, exact
    logsumexp = "logsumexp"  # responsibilities are normalised across shards: a scalar log-sum-exp, then sum
    replicate = "replicate"  # not split: held whole and identical on every shard

"""The vocabulary of decomposition: along which axis a node splits, and how its shards recombine."""

from __future__ import annotations

from enum import StrEnum


class DecompAxis(StrEnum):
    """The dimension a node of the model splits along for model parallelism."""

    NONE = "none"  # atomic: held whole (leaves, neural blocks)
    COMPONENT = "component"  # mixture components, mixture-of-experts experts
    FACTOR = "factor"  # independent coordinates of a composite record
    SEQUENCE = "sequence"  # i.i.d. elements of a sequence: the data axis, sized from the data
    TOPIC = "topic"  # shared latent topics (hierarchical models); no spec node declares it yet
    STATE = "state"  # HMM emission states; the transition matrix stays whole on every shard


class ReductionOp(StrEnum):
    """How per-shard sufficient statistics recombine across shards."""

    SUM = "sum"  # additive statistics: one all-reduce of the shard sums, exact
    LOGSUMEXP_RESPONSIBILITY = (
        "logsumexp"  # responsibilities are normalised across shards: a scalar log-sum-exp, then sum
    )
    REPLICATE = "replicate"  # not split: held whole and identical on every shard

"""Runs of transformer blocks that lower alike, each lowered once.

Block ``i`` of a transformer lowers to the same layouts, updates and per-block collectives as block
``i + 1``, the index in their names aside, when both sit on the same virtual pipeline stage and are
of the same kind (dense or mixture-of-experts): a block's parameters follow from its kind alone
(:func:`mixle_compile.parameters.transformer_parameters`), its layouts from its parameters and its
(stage, chunk) (lower/layouts.py), and its updates from its layouts, its kind and its stage
(lower/updates.py). So the lowering lists the first block of each maximal run of such blocks and
states how many blocks it stands for (:class:`LayerRuns`). The plan writes each run as one folded
group (plan/layers.py: the form a plan always had), and memory, traffic and step time count each
first block as often as its run holds blocks: the compile's cost no longer grows with the layers.

Lowering every block one by one (``lower(spec, each_layer=True)``) gives the same plan byte for byte;
tests/test_layer_runs.py holds the two to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from mixle_compile.layer_split import LayerSplit
from mixle_compile.parameters import is_moe_layer
from mixle_compile.spec.models import TransformerModel


@dataclass(frozen=True)
class LayerRuns:
    """The first block of every run and how many consecutive blocks it stands for."""

    counts: Mapping[int, int]  # first block of a run -> blocks in the run, in model order

    @property
    def first_layers(self) -> tuple[int, ...]:
        return tuple(self.counts)

    def count(self, layer: int | None) -> int:
        """How many blocks an entry of ``layer`` stands for (1 outside the blocks)."""
        return 1 if layer is None else self.counts.get(layer, 1)


#: Every block its own run: a lowering that lists every block.
EACH_BLOCK = LayerRuns(MappingProxyType({}))


def transformer_runs(model: TransformerModel, split: LayerSplit) -> LayerRuns:
    """The maximal runs of consecutive blocks on one virtual stage and of one kind."""
    counts: dict[int, int] = {}
    start = 0
    for blocks in split.counts:  # virtual stages in model order
        end = start + blocks
        first = start
        while first < end:
            kind = is_moe_layer(model, first)
            last = first + 1
            while last < end and is_moe_layer(model, last) == kind:
                last += 1
            counts[first] = last - first
            first = last
        start = end
    return LayerRuns(counts)

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

Stages repeat as well: when consecutive pipeline stages (of one chunk) each hold a single run of as
many blocks of one kind, stage ``s + 1``'s run lowers as stage ``s``'s does, its indices a run
higher and its stage one higher (nothing a block lowers to depends on which stage holds it but the
stage number). The lowering then lists the first of them only and states on how many stages it
repeats (:meth:`LayerRuns.stages`); the plan writes it as one group over those stages
(plan/layers.py), and memory, traffic and step time count it on each of them.

Lowering every block one by one (``lower(spec, each_layer=True)``) gives the same plan byte for byte;
tests/test_layer_runs.py holds the two to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from mixle_compile.layer_split import LayerSplit
from mixle_compile.parameters import is_moe_layer, same_kind_until
from mixle_compile.spec.models import TransformerModel


@dataclass(frozen=True)
class LayerRuns:
    """The first block of every run and how many consecutive blocks it stands for."""

    counts: Mapping[int, int]  # first block of a listed run -> blocks in the run, in model order
    # first block of a listed run -> consecutive pipeline stages the run repeats on (absent: 1)
    repeats: Mapping[int, int] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def first_layers(self) -> tuple[int, ...]:
        return tuple(self.counts)

    def count(self, layer: int | None) -> int:
        """How many blocks of one stage an entry of ``layer`` stands for (1 outside the blocks)."""
        return 1 if layer is None else self.counts.get(layer, 1)

    def stages(self, layer: int | None) -> int:
        """On how many consecutive pipeline stages an entry of ``layer`` repeats, from its own."""
        return 1 if layer is None else self.repeats.get(layer, 1)

    def on_stages(self, layer: int | None, stage: int) -> range:
        """The pipeline stages an entry of ``layer`` listed on ``stage`` stands for."""
        return range(stage, stage + self.stages(layer))


#: Every block its own run: a lowering that lists every block.
EACH_BLOCK = LayerRuns(MappingProxyType({}))


def transformer_runs(model: TransformerModel, split: LayerSplit, *, fold_stages: bool = True) -> LayerRuns:
    """The maximal runs of consecutive blocks on one virtual stage and of one kind, and, with
    ``fold_stages``, the runs that repeat on the next stages of their chunk listed once."""
    per_stage: list[list[tuple[int, int, bool]]] = []  # per virtual stage: (first block, blocks, kind)
    start = 0
    for blocks in split.counts:  # virtual stages in model order
        end = start + blocks
        first = start
        found = []
        while first < end:
            last = same_kind_until(model, first, end)
            found.append((first, last - first, is_moe_layer(model, first)))
            first = last
        per_stage.append(found)
        start = end
    counts: dict[int, int] = {}
    repeats: dict[int, int] = {}
    virtual = 0
    while virtual < len(per_stage):
        runs = per_stage[virtual]
        for first, blocks, _ in runs:
            counts[first] = blocks
        following = virtual + 1
        if fold_stages and len(runs) == 1:
            (first, blocks, kind) = runs[0]
            while (
                following < len(per_stage)
                and following % split.pp != 0  # the same chunk: the next stage of it
                and len(per_stage[following]) == 1
                and per_stage[following][0][1:] == (blocks, kind)
            ):
                following += 1
            if following - virtual > 1:
                repeats[first] = following - virtual
        virtual = following
    if split.mtp:
        # The multi-token prediction blocks, on the last virtual stage after the decoder's layers, are
        # alike (each of the last layer's kind with the same projection and norms): one run of their own.
        counts[model.num_layers] = split.mtp
    return LayerRuns(counts, MappingProxyType(repeats))

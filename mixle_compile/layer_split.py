"""How transformer layers are split over pipeline stages, written once and read twice.

The lowering places every layer (and so the runtime builds every stage) with :func:`split_layers`;
the verifier's rules (P001, P002, P010) and R001's bound read the same split, so `check` prices
the stages the plan builds.

A spec says ``training.pipeline_layers``: ``even`` (every virtual stage the same number of
layers), a list (the layers of each virtual stage in model order, a stage with none allowed), or
nothing, which means the engine's own rule:

* ``torch`` (the in-tree runtime): balanced; the first ``L % S`` virtual stages take one more.
* ``torchtitan``: ``generate_llm_fqn_per_model_part`` (torchtitan/distributed/pipeline_parallel.py,
  0.3.0 and the TOML-era releases): the embedding and the output each count as one layer
  (``pipeline_parallel_first_stage_less_layers`` / ``last_stage_less_layers``, default 1), the
  ``L + 2`` slots are split with the remainder on the first stages, then the first and last stage
  give one slot back: 126 layers over 8 stages are ``[15, 16, 16, 16, 16, 16, 16, 15]``.
* ``megatron``: even; without ``decoder_first_pipeline_num_layers`` / ``_last_`` or a
  ``pipeline_model_parallel_layout`` (which a spec states as a list) ``num_layers`` must divide by
  ``pp * vpp`` (megatron/core/transformer/transformer_config.py, transformer_block.py). Its
  ``account_for_embedding_in_pipeline_split`` / ``account_for_loss_in_pipeline_split`` count the
  embedding and the loss as one layer each: ``num_layers`` plus those must divide by ``pp * vpp``,
  and the first (last) virtual stage builds one layer less (``get_num_layers_to_build`` in
  transformer_block.py, checked in ``TransformerConfig.__post_init__``); a spec states that split
  as the list :func:`megatron_accounted` gives. Its ``decoder_first/last_pipeline_num_layers``
  (:func:`megatron_uneven`) set the first and/or last rank's layers; a search offers the most
  balanced of those (:func:`megatron_uneven_balanced`) where neither an even nor an accounted split
  exists.

Virtual stage ``c * pp + s`` is chunk ``c`` of stage ``s`` (both engines interleave that way).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from dataclasses import dataclass
from typing import Any

ENGINE_RULE = {"torch": "balanced", "torchtitan": "torchtitan", "megatron": "even"}


def engine_rule(engine_name: str) -> str:
    return ENGINE_RULE.get(engine_name, "balanced")


def counts_for(rule: str, num_layers: int, stages: int) -> tuple[int, ...]:
    """Layers of each of ``stages`` virtual stages under a named rule (even splits unevenly
    divisible layers as balanced does: P001 refuses that case)."""
    if rule == "torchtitan":
        q, r = divmod(num_layers + 2, stages)
        counts = [q + 1 if i < r else q for i in range(stages)]
        counts[0] -= 1
        counts[-1] -= 1
        if min(counts) < 0:
            raise ValueError(
                f"torchtitan cannot split {num_layers} layers over {stages} stages: a stage would hold fewer than none"
            )
        return tuple(counts)
    q, r = divmod(num_layers, stages)
    return tuple(q + 1 if i < r else q for i in range(stages))


#: Megatron's accounted splits, (embedding, loss) each counted as a layer or not, the both-counted first.
ACCOUNTED = ((True, True), (True, False), (False, True))


def megatron_accounted(
    num_layers: int, pp: int, virtual_stages: int, embedding: bool, loss: bool
) -> tuple[int, ...] | None:
    """Megatron's split with the embedding and/or the loss counted as a layer: ``num_layers +
    embedding + loss`` slots in equal virtual stages, the first virtual stage giving one back for
    the embedding and the last one for the loss; None where Megatron refuses it (the slots do not
    divide by ``pp * virtual_stages``, a stage would hold fewer than none, or no pipeline)."""
    if not (embedding or loss):
        return None
    return _slots_split(num_layers, pp * virtual_stages, int(embedding), int(loss)) if pp > 1 else None


def _slots_split(num_layers: int, stages: int, first: int, last: int) -> tuple[int, ...] | None:
    """``num_layers + first + last`` slots in ``stages`` equal virtual stages, the first giving
    ``first`` slots back and the last ``last`` (what the embedding, and the loss and what follows the
    layers, are counted as); None where the slots do not divide or a stage would hold fewer than none."""
    slots = num_layers + first + last
    if slots % stages:
        return None
    counts = [slots // stages] * stages
    counts[0] -= first
    counts[-1] -= last
    return tuple(counts) if min(counts) >= 0 else None


def megatron_mtp_counted(num_layers: int, pp: int, virtual_stages: int, depths: int) -> tuple[int, ...] | None:
    """A Megatron pipeline layout (``--pipeline-model-parallel-layout``, Megatron-LM 0.13 and later)
    that counts the embedding, the loss and each multi-token prediction depth as one layer: ``num_layers
    + 2 + depths`` slots in equal virtual stages, the first giving one back for the embedding and the
    last ``1 + depths`` for the loss and the depths, which Megatron builds on the last stage. Megatron-
    Bridge's DeepSeek-V3 layout ``Et|(tt|)*30mL`` is this split: 61 layers and one depth are 64 slots
    over 32 virtual stages. None without a pipeline or depths, or where the slots do not divide or a
    stage would hold fewer than none."""
    if pp < 2 or depths < 1:
        return None
    return _slots_split(num_layers, pp * virtual_stages, 1, 1 + depths)


def megatron_accounting(counts, num_layers: int, pp: int, virtual_stages: int) -> tuple[bool, bool] | None:
    """Which of Megatron's accounted splits a listed split is, as (embedding, loss), or None."""
    listed = tuple(int(c) for c in counts)
    return next(
        (flags for flags in ACCOUNTED if megatron_accounted(num_layers, pp, virtual_stages, *flags) == listed),
        None,
    )


def megatron_uneven(
    num_layers: int, pp: int, virtual_stages: int, first: int | None, last: int | None
) -> tuple[int, ...] | None:
    """Megatron's uneven split (``num_layers_in_first/last_pipeline_stage``, Megatron-LM's
    ``--decoder-first/last-pipeline-num-layers``): the first (last) pipeline rank holds ``first``
    (``last``) layers over all its virtual stages, the middle ranks the rest evenly, and each rank's
    layers split evenly over its virtual stages (``get_num_layers_to_build``); None where
    ``TransformerConfig.__post_init__`` refuses it (a count not above 0 or not divisible by the
    virtual stages, middle layers without middle ranks or the reverse, middle layers that do not
    divide) or the layers run out."""
    if pp < 2 or (first is None and last is None):
        return None
    rest, middle = num_layers, pp
    for n in (first, last):
        if n is not None:
            if n <= 0 or n % virtual_stages:
                return None
            rest, middle = rest - n, middle - 1
    if rest < 0 or bool(rest) != bool(middle) or (middle and (rest % middle or (rest // middle) % virtual_stages)):
        return None
    per_rank = [rest // middle if middle else 0] * pp
    if first is not None:
        per_rank[0] = first
    if last is not None:
        per_rank[-1] = last
    return tuple(per_rank[s] // virtual_stages for _ in range(virtual_stages) for s in range(pp))


@functools.lru_cache(maxsize=1024)
def megatron_uneven_balanced(num_layers: int, pp: int, virtual_stages: int) -> tuple[tuple[int, ...], ...]:
    """Megatron's uneven splits (:func:`megatron_uneven`: the first and/or the last pipeline rank's
    layers set, the middle ranks even) that leave the busiest pipeline rank the fewest layers, in
    model order: what a search offers where the layers split neither evenly nor as an accounted split."""
    best: int | None = None
    out: list[tuple[int, ...]] = []
    values = [None, *range(virtual_stages, num_layers + 1, virtual_stages)]
    for first in values:
        for last in values:
            counts = megatron_uneven(num_layers, pp, virtual_stages, first, last)
            if counts is None:
                continue
            busiest = max(sum(counts[c * pp + s] for c in range(virtual_stages)) for s in range(pp))
            if best is None or busiest < best:
                best, out = busiest, [counts]
            elif busiest == best and counts not in out:
                out.append(counts)
    return tuple(out)


def megatron_uneven_of(counts, num_layers: int, pp: int, virtual_stages: int) -> tuple[int, int] | None:
    """The (first, last) pipeline ranks' layers of a listed split that is Megatron's uneven split, or None."""
    listed = tuple(int(c) for c in counts)
    if len(listed) != pp * virtual_stages or pp < 2:
        return None
    first = sum(listed[c * pp] for c in range(virtual_stages))
    last = sum(listed[c * pp + pp - 1] for c in range(virtual_stages))
    return (first, last) if megatron_uneven(num_layers, pp, virtual_stages, first, last) == listed else None


#: Megatron-Core's layout characters (pipeline_parallel_layer_layout.py, parse_str_to_list, core_v0.16.1).
LAYOUT_CHARS = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}


#: The longest layout string read once its repeats are unrolled (a layer per character, the stages' bars).
MAX_LAYOUT_CHARS = 1 << 20


class LayoutError(ValueError):
    """A ``pipeline_model_parallel_layout`` Megatron refuses: the message says why, as Megatron does."""


@dataclass(frozen=True)
class MegatronLayout:
    """What a ``pipeline_model_parallel_layout`` string builds: the decoder layers of every virtual
    stage in model order, the virtual stages per pipeline rank, and the pipeline rank whose last
    virtual stage holds the multi-token prediction layers (None without them)."""

    counts: tuple[int, ...]
    virtual_stages: int
    mtp_rank: int | None


def megatron_layout_stages(text: str) -> list[str]:
    """The virtual stages of a layout string in model order, each as its layer characters, read as
    ``PipelineParallelLayerLayout.parse_str_to_list`` reads it (Megatron-Core
    megatron/core/transformer/pipeline_parallel_layer_layout.py): commas are cosmetic and dropped;
    ``(...)*n`` is unrolled first (one level, the parentheses holding no parenthesis), then ``x*n``
    for a single character; stages are separated by ``|``; every character left must be one of
    E (embedding), L (loss), t (decoder layer), m (multi-token prediction layer)."""
    flat = text.replace(",", "")

    def unrolled(pattern: str, flat: str) -> str:
        """``re.sub`` of the repeats, refused before it would build a layout longer than any model has."""
        size = len(flat) + sum(len(g.group(1)) * (int(g.group(2)) - 1) for g in re.finditer(pattern, flat))
        if size > MAX_LAYOUT_CHARS:
            raise LayoutError(f"the layout unrolls to {size:,} characters, more than any model's layers")
        return re.sub(pattern, lambda g: g.group(1) * int(g.group(2)), flat)

    flat = unrolled(r"\(([^)]+)\)\*(\d+)", flat)
    flat = unrolled(r"(.)\*(\d+)", flat)
    stages = flat.split("|")
    for stage in stages:
        for char in stage:
            if char not in LAYOUT_CHARS:
                raise LayoutError(
                    f"{char!r} is not a layer character (stage {stage!r}); the characters are "
                    "E (embedding), L (loss), t (decoder layer) and m (multi-token prediction layer), "
                    "stages separated by |, repeats written (...)*n or x*n"
                )
    return stages


def megatron_layout(text: str, pp: int, num_layers: int, mtp_layers: int = 0) -> MegatronLayout:
    """Read ``--pipeline-model-parallel-layout`` as Megatron-Core 0.16 does, refusing what it refuses
    (LayoutError): megatron/training/arguments.py (validate_args) takes the virtual stages per rank
    from the stage count, which ``pp`` must divide; ``PipelineParallelLayerLayout.__init__`` maps the
    ``i``-th stage to virtual stage ``i // pp`` of pipeline rank ``i % pp``, and
    ``validate_layer_layout`` asserts that the layout starts with the embedding and ends with the
    loss, holds each exactly once, holds ``num_layers`` decoder layers and ``mtp_num_layers``
    multi-token prediction layers, puts no decoder layer after one of those, and puts all of them in
    one virtual stage, the last of its pipeline rank."""
    stages = megatron_layout_stages(text)
    if pp < 1 or len(stages) % pp:
        raise LayoutError(
            f"the layout has {len(stages)} stages, which the pipeline size {pp} does not divide "
            "(Megatron takes the virtual stages per pipeline rank as stages / pp)"
        )
    virtual = len(stages) // pp
    flat = "".join(stages)
    if not flat or flat[0] != "E" or flat[-1] != "L":
        raise LayoutError("the layout must start with the embedding (E) and end with the loss (L)")
    if flat.count("E") != 1 or flat.count("L") != 1:
        raise LayoutError("the layout must hold the embedding (E) and the loss (L) exactly once each")
    decoders, mtps = flat.count("t"), flat.count("m")
    if decoders != num_layers:
        raise LayoutError(f"the layout holds {decoders} decoder layers (t) but the model has {num_layers}")
    if mtps != mtp_layers:
        raise LayoutError(
            f"the layout holds {mtps} multi-token prediction layers (m) but the model has {mtp_layers}"
            + ("" if mtp_layers else " (no --mtp-num-layers)")
        )
    mtp_rank = None
    if mtps:
        if "t" in flat[flat.index("m") :]:
            raise LayoutError("a decoder layer (t) follows a multi-token prediction layer (m): place m after every t")
        holding = [i for i, stage in enumerate(stages) if "m" in stage]
        if len(holding) > 1 or stages[holding[0]].count("m") != mtps:
            raise LayoutError("all multi-token prediction layers (m) must be in one stage")
        if holding[0] // pp != virtual - 1:
            raise LayoutError(
                "the multi-token prediction layers (m) must be in the last virtual stage of their pipeline "
                f"rank (stage {holding[0]} is virtual stage {holding[0] // pp} of rank {holding[0] % pp}, of {virtual})"
            )
        mtp_rank = holding[0] % pp
    return MegatronLayout(tuple(stage.count("t") for stage in stages), virtual, mtp_rank)


def megatron_layout_text(counts, pp: int, mtp_layers: int = 0) -> str:
    """The layout string of a listed split (decoder layers per virtual stage in model order), the
    embedding on the first stage, the multi-token prediction layers and the loss on the last; runs
    of alike middle stages written ``(...|)*n`` (:func:`megatron_layout` reads it back)."""

    def layers(n: int) -> str:
        return "" if n == 0 else "t" if n == 1 else f"t*{n}"

    counts = [int(c) for c in counts]
    if len(counts) == 1:
        return "E" + layers(counts[0]) + "m" * mtp_layers + "L"
    out = ["E" + layers(counts[0]) + "|"]
    for n, run in itertools.groupby(counts[1:-1]):
        repeats = len(list(run))
        out.append(f"({layers(n)}|)*{repeats}" if repeats > 1 else layers(n) + "|")
    out.append(layers(counts[-1]) + "m" * mtp_layers + "L")
    return "".join(out)


@dataclass(frozen=True)
class LayerSplit:
    pp: int
    virtual_stages: int
    counts: tuple[int, ...]  # per virtual stage, model order
    rule: str  # even, balanced, torchtitan, or listed
    # multi-token prediction blocks after the decoder's layers, all on the last virtual stage (Megatron-Core's
    # mtp_on_this_rank without a custom layout: "all of MTP layers on the last pipeline stage")
    mtp: int = 0

    def location(self, layer: int) -> tuple[int, int]:
        """(stage, chunk) holding ``layer`` (a multi-token prediction block: the last virtual stage)."""
        end = 0
        for virtual, count in enumerate(self.counts):
            end += count
            if layer < end:
                return virtual % self.pp, virtual // self.pp
        if layer < end + self.mtp:
            return self.pp - 1, self.virtual_stages - 1
        raise ValueError(f"layer {layer} is beyond the {sum(self.counts) + self.mtp} blocks of the split")

    def mtp_on_stage(self, stage: int) -> int:
        """The multi-token prediction blocks ``stage`` holds (all of them on the last)."""
        return self.mtp if stage == self.pp - 1 else 0

    def layers_on_stage(self, stage: int) -> int:
        return sum(self.counts[c * self.pp + stage] for c in range(self.virtual_stages))

    def ranges_on_stage(self, stage: int) -> tuple[tuple[int, int], ...]:
        """The layers of each of ``stage``'s chunks, as ``(first, end)`` ranges in chunk order."""
        starts = self.starts()
        return tuple((starts[w], starts[w + 1]) for w in range(stage, len(self.counts), self.pp))

    def starts(self) -> tuple[int, ...]:
        """The first layer of every virtual stage in model order, and the layer count at the end."""
        return tuple(itertools.accumulate(self.counts, initial=0))


def split_layers(
    num_layers: int, pp: int, virtual_stages: int, pipeline_layers: Any, engine_name: str, mtp: int = 0
) -> LayerSplit:
    """The split a spec asks for: a list as given, ``even``, or the engine's rule. Without a
    pipeline, one stage holds every layer. ``mtp`` multi-token prediction blocks follow on the last
    virtual stage."""
    split = _split_layers(num_layers, pp, virtual_stages, pipeline_layers, engine_name)
    return dataclasses.replace(split, mtp=mtp) if mtp else split


def _split_layers(num_layers: int, pp: int, virtual_stages: int, pipeline_layers: Any, engine_name: str) -> LayerSplit:
    virtual_stages = virtual_stages if pp > 1 else 1
    stages = pp * virtual_stages
    if isinstance(pipeline_layers, (list, tuple)) and pp > 1:
        counts = tuple(int(c) for c in pipeline_layers)
        if len(counts) != stages or sum(counts) != num_layers:
            raise ValueError(
                f"pipeline_layers lists {len(counts)} stages holding {sum(counts)} layers; the plan has "
                f"pp*virtual_pipeline_stages = {stages} stages and {num_layers} layers"
            )
        return LayerSplit(pp, virtual_stages, counts, "listed")
    rule = pipeline_layers if isinstance(pipeline_layers, str) else engine_rule(engine_name)
    if pp == 1:
        rule = "balanced"
    return LayerSplit(pp, virtual_stages, counts_for(rule, num_layers, stages), rule)

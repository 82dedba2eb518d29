"""Repeated layers stated once: the plan's per-layer entries folded over consecutive layers.

A transformer's layers give the same entries over and over: layer ``n + 1``'s parameter layouts,
updates and per-layer collectives are layer ``n``'s with the index in their names (``layers.7.``)
one higher, and its ``layer`` field too. The plan writes such a run as one group,
``{"layers": count, "entries": [...]}``: the entries of the run's first layer, which stand for
``count`` layers from it. Only runs that really repeat are folded (same stage, chunk, shapes, bytes,
everything but the index), so unfolding gives every entry back exactly; the folded form is what
the plan's digest covers, and loading unfolds it (:func:`unfold`), so readers see every entry.

Pipeline stages repeat too: stage ``s + 1``'s run of ``count`` layers is often stage ``s``'s with
every index ``count`` higher and the ``stage`` field one higher (every stage holds as many blocks of
one kind). Such stages are one group, ``{"entries": [...], "layers": count, "stages": k}``: the run
repeated on ``k`` consecutive stages (:func:`fold_stages`), repetition ``j`` shifted by ``j * count``
layers and ``j`` stages.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

#: The fields that carry a layer's index in a name.
NAMED = ("node_id", "tensor", "logical_id", "name", "shared_group")
_INDEX = re.compile(r"(?<![\w.])layers\.(\d+)\.")
GROUP_KEYS = frozenset({"layers", "entries"})
STAGED_KEYS = frozenset({"layers", "entries", "stages"})


def is_group(item: Any) -> bool:
    """Whether a list item is a folded group (over layers, or over layers and stages)."""
    return isinstance(item, dict) and set(item) in (GROUP_KEYS, STAGED_KEYS)


def layer_of(entry: dict) -> int | None:
    """The one layer an entry names (in its names and its ``layer`` field), or None."""
    found = {
        int(m.group(1))
        for key in NAMED
        if isinstance(entry.get(key), str) and "layers." in entry[key]
        for m in _INDEX.finditer(entry[key])
    }
    if isinstance(entry.get("layer"), int) and not isinstance(entry.get("layer"), bool):
        found.add(entry["layer"])
    return found.pop() if len(found) == 1 else None


def shifted(entry: dict, layer: int, by: int, stages: int = 0) -> dict:
    """``entry`` of layer ``layer`` as the same entry of layer ``layer + by``, ``stages`` pipeline
    stages on (its ``stage`` field that much higher)."""
    if not by and not stages:
        return entry
    out = dict(entry)
    if by:
        old, new = f"layers.{layer}.", f"layers.{layer + by}."
        pattern = re.compile(r"(?<![\w.])" + re.escape(old))
        for key in NAMED:
            if isinstance(out.get(key), str):
                out[key] = pattern.sub(new, out[key])
        if out.get("layer") == layer and not isinstance(out.get("layer"), bool):
            out["layer"] = layer + by
    if stages:
        stage = out.get("stage")
        if isinstance(stage, bool) or not isinstance(stage, int):
            raise ValueError("an entry repeated over stages needs its `stage`")
        out["stage"] = stage + stages
    return out


def fold(entries: list[dict]) -> list[dict]:
    """``entries`` with every run of consecutive layers that repeat written as one group: each
    entry's layer read from its names, every layer compared with the next (and every stage's run
    with the next stage's, :func:`fold_stages`)."""
    return fold_stated(entries, [(layer_of(entry), None) for entry in entries], _one)


def _one(layer: int) -> int:
    return 1


def fold_stated(
    entries: list[dict],
    keys: list[tuple[int | None, object]],
    count: Callable[[int], int],
    stages: Callable[[int], int] = _one,
) -> list[dict]:
    """Entries with their runs of layers folded. A lowering that lists one block of each run of
    blocks that lower alike (lower/runs.py) states a run as its first block with ``count(layer)``
    blocks from it; listing every block, each counts 1 (:func:`fold`). Runs next to each other whose
    entries in this list are the same but for the index (an expert block's activation collectives
    without expert parallelism) fold into one group, as their blocks would.

    ``keys``: per entry, the block it belongs to (None outside the blocks: what :func:`layer_of`
    reads from its names) and the pass of the lowering that listed it. A list can be made of passes
    one after the other (a stage's per-forward list holds the FSDP gathers of all its blocks, then
    their activation collectives): with every block listed, the first block's entries of two passes
    are never next to each other, and they fold apart.

    ``stages(layer)``: on how many consecutive pipeline stages the run from ``layer`` repeats (the
    lowering lists it on the first only, lower/runs.py). Stages that repeat are then folded by
    comparison as well (:func:`fold_stages`), so a lowering that lists every block and one that
    states its repetitions give the same groups."""
    segments: list[tuple[int | None, object, list[dict]]] = []
    for entry, (layer, origin) in zip(entries, keys, strict=True):
        if layer is not None and segments and segments[-1][0] == layer and segments[-1][1] == origin:
            segments[-1][2].append(entry)
        else:
            segments.append((layer, origin, [entry]))
    out: list[dict] = []
    i = 0
    while i < len(segments):
        layer, origin, first = segments[i]
        i += 1
        if layer is None:
            out.extend(first)
            continue
        blocks = count(layer)
        repeated = stages(layer)
        if repeated > 1:  # whole stages: nothing follows the run on its first stage
            out.append({"entries": first, "layers": blocks, "stages": repeated})
            continue
        while i < len(segments):
            nxt_layer, nxt_origin, nxt = segments[i]
            if nxt_layer != layer + blocks or nxt_origin != origin or len(nxt) != len(first):
                break
            if any(shifted(a, layer, blocks) != b for a, b in zip(first, nxt, strict=True)):
                break
            blocks += count(nxt_layer)
            i += 1
        if blocks > 1:
            out.append({"entries": first, "layers": blocks})  # canonical (sorted) key order
        else:
            out.extend(first)
    return fold_stages(out)


def _run_at(items: list, i: int) -> tuple[list[dict], int, int, int, int] | None:
    """The run of layers at ``items[i]``: ``(entries of its first layer, that layer, layers, stages,
    index after it)``; a group, or the entries in a row that name one layer; None outside the layers."""
    item = items[i]
    if is_group(item):
        return item["entries"], layer_of(item["entries"][0]), item["layers"], item.get("stages", 1), i + 1
    layer = layer_of(item)
    if layer is None:
        return None
    end = i + 1
    while end < len(items) and not is_group(items[end]):
        if layer_of(items[end]) != layer:
            break
        end += 1
    return items[i:end], layer, 1, 1, end


def _repeated(entries: list[dict], other: list[dict], layer: int, by: int, stages: int) -> bool:
    """Whether ``other`` is ``entries`` shifted ``by`` layers and ``stages`` stages on."""
    try:
        return all(shifted(a, layer, by, stages) == b for a, b in zip(entries, other, strict=True))
    except ValueError:  # an entry without a stage does not repeat over stages
        return False


def fold_stages(items: list) -> list:
    """A list folded by layers (:func:`fold_stated`) with runs of consecutive stages that repeat
    written as one group: the run on the next stage is this one's with every layer index ``layers``
    higher and ``stage`` one higher (compared entry by entry), and holds as many layers."""
    out: list = []
    i = 0
    while i < len(items):
        run = _run_at(items, i)
        if run is None:
            out.append(items[i])
            i += 1
            continue
        entries, layer, blocks, repeated, end = run
        j = end
        while j < len(items):
            nxt = _run_at(items, j)
            if nxt is None:
                break
            other, other_layer, other_blocks, other_stages, after = nxt
            if other_blocks != blocks or other_layer != layer + repeated * blocks or len(other) != len(entries):
                break
            if not _repeated(entries, other, layer, repeated * blocks, repeated):
                break
            repeated += other_stages
            j = after
        if j == end:
            out.extend(items[i:end])
        else:
            out.append({"entries": entries, "layers": blocks, "stages": repeated})
        i = j
    return out


def unfold(items: list[Any]) -> list[Any]:
    """Every entry of a folded list (entries already unfolded pass through)."""
    out: list[Any] = []
    for item in items:
        if is_group(item):
            count, entries, stages = item["layers"], item["entries"], item.get("stages", 1)
            if (
                any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in (count, stages))
                or not isinstance(entries, list)
                or not entries
            ):
                raise ValueError("a folded group needs `layers` >= 1, `stages` >= 1 and at least one entry")
            if not all(isinstance(e, dict) for e in entries):
                raise ValueError("a folded group's entries are objects")
            layers = {layer_of(e) for e in entries}
            if len(layers) != 1 or None in layers:
                raise ValueError("the entries of a folded group must all name the same one layer")
            (layer,) = layers
            out.extend(
                shifted(e, layer, j * count + k, j) for j in range(stages) for k in range(count) for e in entries
            )
        else:
            out.append(item)
    return out

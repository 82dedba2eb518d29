"""Deciding how a model is placed on the devices: replicate it, or cut one axis across them.

Entry point: :func:`decompose_model`. It picks the axis whose cut removes the most serial work
(:func:`~mixle_compile.graph.best_parallel_axis`), keeps the model replicated when data
parallelism clearly wins, and otherwise returns the provably optimal contiguous cut of that
axis's units (:mod:`mixle_compile.decompose.cut`). It never raises for an impossible placement:
the reason comes back as a diagnostic with the node's path and the numbers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mixle_compile.contracts import ReadOnlyDict
from mixle_compile.decompose.cut import (
    ContiguousCut,
    bottleneck_lower_bound,
    exchangeable_cut,
    optimal_contiguous_cut,
)
from mixle_compile.decompose.devices import Device
from mixle_compile.diagnostics import Code, Diagnostic, Severity, register_code
from mixle_compile.graph import AxisCandidate, DecompAxis, ModelGraph, ReductionOp, best_parallel_axis, compute_cost
from mixle_compile.spec.models import Resources

UNIT_EXCEEDS_MEMORY = register_code(
    Code(
        "G002",
        "unit-exceeds-device-memory",
        "A unit of the model does not fit the memory of any device.",
        "A cut never splits a unit (one mixture component, one factor, one expert), and every shard "
        "also holds whole what is not cut: shared nodes such as an HMM's transitions, the cut node's "
        "own parameters and the rest of the model. When one unit plus that part is larger than the "
        "largest device, or when nothing can be cut and the whole model is larger, no placement "
        "exists. The message names the unit's node and the byte counts; use devices with more memory, "
        "a lower precision, or split the unit into smaller ones.",
    )
)
TOO_FEW_DEVICES = register_code(
    Code(
        "G003",
        "too-few-devices",
        "The devices together cannot hold the model's units.",
        "Each unit goes to one device and each device holds the part kept whole on every shard, so "
        "the units must fit the memory the devices have left after that part. The message gives the "
        "bytes needed, the bytes available and how many devices of the largest kind would be needed "
        "at least; add devices or memory, or lower `min_components_per_shard` if it keeps shards from "
        "using the memory there is.",
    )
)
MIN_COMPONENTS_UNSATISFIABLE = register_code(
    Code(
        "G004",
        "min-components-unsatisfiable",
        "`min_components_per_shard` is larger than the number of units of the cut axis.",
        "A non-empty shard holds at least `min_components_per_shard` units, so an axis with fewer "
        "units cannot be cut at all. Lower the minimum or cut a larger axis (`allowed_axes`).",
    )
)
AXIS_TOO_LARGE = register_code(
    Code(
        "G005",
        "axis-too-large-to-cut",
        "The chosen axis has more units than the exact cut handles.",
        "The exact cut keeps a few arrays per unit; beyond 2**20 units it would need too much time "
        "and memory. Group the units (a mixture of mixtures has fewer, larger units) or restrict "
        "`allowed_axes` to a smaller axis.",
    )
)

MAX_CUT_UNITS = 1 << 20
# The seed's rule for preferring data parallelism: a model-parallel cut pays a cross-shard
# reduction every step, worth it only with at least two units per device, and data parallelism
# needs enough observations to keep every device busy.
UNITS_PER_DEVICE_FOR_MODEL_PARALLEL = 2
OBSERVATIONS_PER_DEVICE_FOR_DATA_PARALLEL = 8


@dataclass(frozen=True)
class ModelCut:
    """One shard: placement positions ``start..stop-1`` of the cut axis on ``device``.

    ``work`` is the shard's work per observation and ``param_bytes`` what the device holds (its
    units plus the part held whole on every shard).
    """

    device: Device
    start: int
    stop: int
    reduction: ReductionOp
    work: float = 0.0
    param_bytes: int = 0

    @property
    def time(self) -> float:
        """Work over throughput: seconds per observation (relative units when no throughput is stated)."""
        return self.work / self.device.throughput


@dataclass(frozen=True)
class ModelDecomposition:
    """How the model is placed: replicated (``axis`` none) or cut along one axis across devices.

    ``permutation[k]`` is the unit at placement position ``k``: the units of a cut are
    ``permutation[cut.start:cut.stop]``. With ``unit_works`` and the cuts' devices anyone can
    recompute ``bottleneck`` (the largest ``cut.time``).
    """

    axis: DecompAxis
    reduction: ReductionOp
    num_units: int
    cuts: tuple[ModelCut, ...]
    rationale: str
    extra: Mapping[str, Any] = field(default_factory=ReadOnlyDict, compare=False)
    path: str = ""
    unit_works: tuple[float, ...] = ()
    unit_bytes: tuple[int, ...] = ()
    permutation: tuple[int, ...] = ()
    held_whole_bytes: int = 0
    bottleneck: float | None = None
    lower_bound: float | None = None
    diagnostics: tuple[Diagnostic, ...] = ()

    @property
    def is_model_parallel(self) -> bool:
        """Whether the model is cut into more than one shard."""
        return self.axis is not DecompAxis.NONE and len(self.cuts) > 1

    @property
    def ok(self) -> bool:
        """Whether a placement exists (no error diagnostics)."""
        return not any(d.severity is Severity.error for d in self.diagnostics)

    def units_of(self, cut: ModelCut) -> tuple[int, ...]:
        """The unit indices (in the axis's own order) that ``cut`` holds."""
        return self.permutation[cut.start : cut.stop]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: enough for anyone to recompute the bottleneck from units, order and devices."""
        return {
            "axis": self.axis.value,
            "reduction": self.reduction.value,
            "num_units": self.num_units,
            "path": self.path,
            "cuts": [
                {
                    "device": {
                        "rank": c.device.rank,
                        "kind": c.device.kind,
                        "memory_bytes": c.device.memory_bytes,
                        "throughput": c.device.throughput,
                        "throughput_stated": c.device.throughput_stated,
                    },
                    "start": c.start,
                    "stop": c.stop,
                    "reduction": c.reduction.value,
                    "work": c.work,
                    "param_bytes": c.param_bytes,
                }
                for c in self.cuts
            ],
            "unit_works": list(self.unit_works),
            "unit_bytes": list(self.unit_bytes),
            "permutation": list(self.permutation),
            "held_whole_bytes": self.held_whole_bytes,
            "bottleneck": self.bottleneck,
            "lower_bound": self.lower_bound,
            "rationale": self.rationale,
            "diagnostics": [d.as_dict() for d in self.diagnostics],
        }


def decompose_model(
    model: ModelGraph | Any,
    resources: Resources | Sequence[Device] | Any,
    *,
    n_data: int | None = None,
    min_components_per_shard: int = 1,
    prefer_data_parallel: bool = True,
    allowed_axes: Iterable[DecompAxis | str] | None = None,
) -> ModelDecomposition:
    """Place ``model`` on the devices of ``resources``.

    Replicates the model (``axis`` none, the reason in ``rationale``) when nothing in it can be
    cut, when there is a single device, or, with ``prefer_data_parallel``, when it fits every
    device, the data dominates (``n_data`` unknown or at least 8 observations per device) and the
    best axis has fewer than two units per device. Otherwise the best axis
    (:func:`~mixle_compile.graph.best_parallel_axis`, restricted to ``allowed_axes``) is cut: the
    contiguous partition of its units with the least bottleneck ``max(shard work / device
    throughput)`` such that every shard fits its device and holds at least
    ``min_components_per_shard`` units; exchangeable units (mixture components, experts) may be
    reordered first. An impossible placement returns cuts ``()`` and diagnostics.

    ``model`` may also be a spec, a distribution model or a live mixle model, and ``resources``
    mixle's ``Resources`` or a sequence of its ``DeviceSpec`` (:mod:`mixle_compile.mixle_models`).
    """
    if min_components_per_shard < 1:
        raise ValueError(f"min_components_per_shard must be >= 1, got {min_components_per_shard}")
    from mixle_compile.mixle_models import as_devices, as_model_graph

    model = as_model_graph(model)
    devices = as_devices(resources)
    if not devices:
        raise ValueError("decompose_model needs at least one device")
    root = model.node()
    if not model.ok:
        return _replicated(
            model, "the model graph has errors (see the diagnostics); nothing is placed", model.diagnostics
        )
    total_work, total_bytes = compute_cost(model)
    best = best_parallel_axis(model, len(devices), allowed_axes)
    smallest = min(d.memory_bytes for d in devices)
    largest = max(devices, key=lambda d: d.memory_bytes)

    if best is None or len(devices) < 2:
        if best is None:
            reason = "no axis of the model can be cut" + ("" if allowed_axes is None else " among the allowed axes")
        else:
            reason = "a single device"
        diagnostics: tuple[Diagnostic, ...] = ()
        if total_bytes > largest.memory_bytes:
            diagnostics = (
                model.diagnostic(
                    UNIT_EXCEEDS_MEMORY.code,
                    f"the whole model ({root.path}, {total_bytes:,} bytes) must be held by one device, "
                    f"and the largest ({largest.label}) holds {largest.memory_bytes:,} bytes",
                    root.field_path,
                    hint="use devices with more memory or a lower precision, or give the model an axis to cut "
                    "(a mixture)",
                    extra_fields=(("resources", "devices"),),
                ),
            )
        return _replicated(model, f"{reason}: replicate the model, data-parallel", diagnostics)

    fits_replicated = total_bytes <= smallest
    few_units = best.num_units < UNITS_PER_DEVICE_FOR_MODEL_PARALLEL * len(devices)
    data_dominates = n_data is None or n_data >= OBSERVATIONS_PER_DEVICE_FOR_DATA_PARALLEL * len(devices)
    if prefer_data_parallel and fits_replicated and few_units and data_dominates:
        data = "the number of observations is not given" if n_data is None else f"n_data={n_data:,} observations"
        return _replicated(
            model,
            f"data-parallel preferred over model-parallel: the model fits replicated ({total_bytes:,} bytes "
            f"<= {smallest:,} on the smallest device), the data dominates ({data}, at least "
            f"{OBSERVATIONS_PER_DEVICE_FOR_DATA_PARALLEL} per device assumed), and the best axis "
            f"({best.axis.value} at {best.path}) has only {best.num_units} units for {len(devices)} devices, "
            f"so cutting it would add a cross-shard {best.reduction.value} every step for little gain",
            (),
            num_units=best.num_units,
        )
    return _cut(model, best, devices, min_components_per_shard, total_work)


def _replicated(
    model: ModelGraph, rationale: str, diagnostics: tuple[Diagnostic, ...], num_units: int = 1
) -> ModelDecomposition:
    return ModelDecomposition(
        DecompAxis.NONE,
        ReductionOp.REPLICATE,
        num_units,
        (),
        rationale,
        ReadOnlyDict({"path": model.root}),
        path=model.root,
        diagnostics=diagnostics,
    )


def _cut(
    model: ModelGraph, best: AxisCandidate, devices: tuple[Device, ...], min_units: int, total_work: float
) -> ModelDecomposition:
    def refuse(diagnostic: Diagnostic, why: str) -> ModelDecomposition:
        return ModelDecomposition(
            best.axis,
            best.reduction,
            best.num_units,
            (),
            f"cannot cut {best.axis.value} at {best.path}: {why}",
            ReadOnlyDict({"path": best.path, "total_work": best.total_work}),
            path=best.path,
            held_whole_bytes=best.held_whole_bytes,
            diagnostics=(diagnostic,),
        )

    where = model.node(best.path).field_path
    devices_field = (("resources", "devices"),)
    if best.num_units > MAX_CUT_UNITS:
        return refuse(
            model.diagnostic(
                AXIS_TOO_LARGE.code,
                f"{best.path} has {best.num_units:,} units; the exact cut handles at most {MAX_CUT_UNITS:,}",
                where,
                hint="group the units (a mixture of mixtures) or restrict allowed_axes",
            ),
            "too many units",
        )
    if min_units > best.num_units:
        return refuse(
            model.diagnostic(
                MIN_COMPONENTS_UNSATISFIABLE.code,
                f"min_components_per_shard={min_units} but {best.path} has only {best.num_units} units",
                where,
                hint=f"use min_components_per_shard <= {best.num_units}",
            ),
            "min_components_per_shard exceeds its units",
        )

    works, unit_bytes, nodes = best.unit_works, best.unit_bytes, best.unit_nodes
    held = best.held_whole_bytes
    capacities = [d.memory_bytes - held for d in devices]
    largest = max(devices, key=lambda d: d.memory_bytes)
    room = largest.memory_bytes - held
    heaviest = max(range(len(unit_bytes)), key=unit_bytes.__getitem__)
    if unit_bytes[heaviest] > room:
        return refuse(
            model.diagnostic(
                UNIT_EXCEEDS_MEMORY.code,
                f"unit {heaviest} of {best.path} ({nodes[heaviest]}) needs {unit_bytes[heaviest]:,} bytes plus "
                f"{held:,} bytes held whole on every shard = {unit_bytes[heaviest] + held:,} bytes, and the "
                f"largest device ({largest.label}) holds {largest.memory_bytes:,} bytes",
                model.node(nodes[heaviest]).field_path,
                hint="use devices with more memory or a lower precision, or split the unit into smaller ones",
                extra_fields=devices_field,
            ),
            "a unit does not fit any device",
        )
    needed = best.total_unit_bytes
    available = sum(max(0, c) for c in capacities)
    if needed > available:
        at_least = -(-needed // room)
        return refuse(
            model.diagnostic(
                TOO_FEW_DEVICES.code,
                f"the {best.num_units} units of {best.path} need {needed:,} bytes, but the {len(devices)} devices "
                f"hold {available:,} bytes besides the {held:,} bytes each keeps whole; at least {at_least} "
                f"devices like {largest.label} are needed",
                where,
                hint=f"use at least {at_least} devices, or devices with more memory",
                extra_fields=devices_field,
            ),
            "the devices are too few",
        )

    throughputs = [d.throughput for d in devices]
    solve = exchangeable_cut if best.exchangeable else optimal_contiguous_cut
    found: ContiguousCut | None = solve(works, unit_bytes, throughputs, capacities, min_units)
    if found is None:
        return refuse(
            model.diagnostic(
                TOO_FEW_DEVICES.code,
                f"no cut of the {best.num_units} units of {best.path} into shards of at least {min_units} "
                f"units fits the devices' memory ({len(devices)} devices, {held:,} bytes held whole on each)",
                where,
                hint="add devices or memory, or lower min_components_per_shard",
                extra_fields=devices_field,
            ),
            "no cut fits the devices",
        )

    order = found.order
    cuts = tuple(
        ModelCut(
            device=devices[s.device],
            start=s.start,
            stop=s.stop,
            reduction=best.reduction,
            work=float(sum(works[i] for i in order[s.start : s.stop])),
            param_bytes=held + sum(unit_bytes[i] for i in order[s.start : s.stop]),
        )
        for s in found.shards
    )
    lower = bottleneck_lower_bound(works, throughputs)
    reordered = order != tuple(range(len(order)))
    notes = [
        f"model-parallel along {best.axis.value} at {best.path}: {best.num_units} units over "
        f"{len(cuts)} of {len(devices)} devices",
        f"bottleneck {found.bottleneck:.6g} (lower bound {lower:.6g})",
        "the optimal contiguous cut" + (", units reordered" if reordered else ""),
    ]
    if not any(d.throughput_stated for d in devices):
        notes.append("no device states a throughput, so all count as equal and the bottleneck is in units of work")
    elif not all(d.throughput_stated for d in devices):
        notes.append("devices without a stated throughput count as the slowest stated one")
    return ModelDecomposition(
        axis=best.axis,
        reduction=best.reduction,
        num_units=best.num_units,
        cuts=cuts,
        rationale="; ".join(notes),
        extra=ReadOnlyDict(
            {
                "path": best.path,
                "total_work": best.total_work,
                "model_work": total_work,
                "reordered": reordered,
                "devices_used": len(cuts),
            }
        ),
        path=best.path,
        unit_works=works,
        unit_bytes=unit_bytes,
        permutation=order,
        held_whole_bytes=held,
        bottleneck=found.bottleneck,
        lower_bound=lower,
    )

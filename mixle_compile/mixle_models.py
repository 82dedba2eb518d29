"""mixle's models and devices in, this package's planner out.

* :func:`from_mixle` turns a live mixle model into the spec's distribution model, through the
  model's own ``to_dict()`` and the reader of :mod:`mixle_compile.importers.mixle` (the same one
  ``model: {from: mixle, path: model.json}`` uses), so a live model and its saved JSON read alike.
* :func:`as_model_graph` is what the planner's entry points (``size_model_tree``, ``tree_axes``,
  ``best_parallel_axis``, ``decompose_model``) call first: a :class:`~mixle_compile.graph.ModelGraph`
  passes through, a spec, a distribution model or a live mixle model is built into one (a model
  without its spec sized in fp64, as mixle holds it).
* :func:`as_devices` reads the devices: the spec's ``Resources``, a sequence of
  :class:`~mixle_compile.decompose.Device`, or mixle's ``Resources`` / ``DeviceSpec``
  (``mixle/utils/parallel/planner.py``) by their attributes, so mixle need not be imported.

mixle is never imported here; a live model is recognised by its class's module (``mixle.``) and
its ``to_dict`` method.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mixle_compile.spec.models import DistributionModel, Spec

# mixle's DeviceSpec.memory_bytes may be None ("not known"); its planner then never refuses a
# placement for memory (model_decomposition.decompose_model: `mem == 0 or ...`). Such a device is
# given a memory no model reaches, so a cut is never limited by it either.
UNBOUNDED_MEMORY = 1 << 62


class MixleModelError(ValueError):
    """A mixle model that the distribution spec cannot express; the message names class and place."""

    def __init__(self, problems: list[tuple[str, str, tuple]]):
        from mixle_compile.importers.mixle import json_path_text

        self.problems = problems
        lines = [f"{message} (at {json_path_text(path)} of its to_dict() JSON); {hint}" for message, hint, path in problems]
        super().__init__("; ".join(lines) if lines else "the mixle model cannot be read")


def is_mixle_model(obj: Any) -> bool:
    """Whether ``obj`` is a live mixle model (an instance of a class from the ``mixle`` package with ``to_dict``)."""
    module = type(obj).__module__ or ""
    return (module == "mixle" or module.startswith("mixle.")) and callable(getattr(obj, "to_dict", None))


def from_mixle(model: Any, *, warnings: list | None = None) -> DistributionModel:
    """The spec's distribution model of a live mixle model, parameter values kept.

    Raises :class:`MixleModelError` naming the class and its place in ``model.to_dict()`` when
    the model holds something the spec cannot express. ``warnings``, when given, receives the
    ``(message, hint, json_path)`` of what was read but not kept (a prior, a categorical's labels).
    """
    if not is_mixle_model(model):
        raise TypeError(f"from_mixle takes a mixle model (a mixle.stats distribution), got {type(model).__module__}.{type(model).__qualname__}")
    from mixle_compile.importers.mixle import mixle_model

    read = mixle_model(model.to_dict())
    if read.problems:
        raise MixleModelError(read.problems)
    if warnings is not None:
        warnings.extend(read.warnings + read.ignored)
    return DistributionModel.model_validate(read.model)


def as_model_graph(model: Any, *, precision: str = "fp64"):
    """A :class:`~mixle_compile.graph.ModelGraph` of ``model`` (see the module docstring)."""
    from mixle_compile.graph import ModelGraph, build_model_graph

    if isinstance(model, ModelGraph):
        return model
    if isinstance(model, Spec):
        return build_model_graph(model)
    if isinstance(model, DistributionModel):
        return build_model_graph(model, precision=precision)
    if is_mixle_model(model):
        return build_model_graph(from_mixle(model), precision=precision)
    raise TypeError(
        "the planner takes a ModelGraph (mixle_compile.graph.build_model_graph), a Spec, a distribution model "
        f"or a live mixle model, got {type(model).__module__}.{type(model).__qualname__}"
    )


def as_devices(resources: Any) -> tuple:
    """The devices of ``resources`` in rank order, as :class:`~mixle_compile.decompose.Device`."""
    from mixle_compile.decompose.devices import Device, devices_from_resources
    from mixle_compile.spec.models import Resources

    if isinstance(resources, Resources):
        return devices_from_resources(resources)
    items = getattr(resources, "devices", resources)  # mixle's Resources holds a tuple of DeviceSpec
    if not isinstance(items, Sequence) or isinstance(items, (str, bytes)):
        raise TypeError(f"devices must be the spec's Resources, mixle's Resources or a sequence of devices, got {type(resources).__qualname__}")
    out = []
    for rank, d in enumerate(items):
        if isinstance(d, Device):
            out.append(d)
            continue
        if not hasattr(d, "throughput") or not hasattr(d, "memory_bytes"):
            raise TypeError(f"device {rank} ({type(d).__qualname__}) has no `throughput` and `memory_bytes`; give a mixle DeviceSpec or a Device")
        memory = d.memory_bytes
        out.append(Device(rank=rank, kind=str(getattr(d, "kind", "gpu")), memory_bytes=UNBOUNDED_MEMORY if memory is None else int(memory),
                          throughput=float(d.throughput), throughput_stated=True, name=getattr(d, "name", None)))
    return tuple(out)

"""Seed contracts shared by the compiler, the verifier and the runtimes.

Everything here is a frozen value object (or a ``typing.Protocol``) with a
JSON-ready ``as_dict()`` and a ``from_dict()`` that round-trips it exactly::

    X.from_dict(x.as_dict()) == x

The module depends on the standard library only: it sits on the lint path,
which must start quickly and must not pull in torch or any other heavy
dependency.

Conventions
-----------
* Fields that hold exact integers accept any ``numbers.Integral`` (``int``,
  numpy integers) and store it as ``int``.  ``bool`` (although an ``int``
  subclass), ``float``, ``str`` and ``None`` are refused with a message naming
  the field as ``ClassName.field``.  All such checks go through
  :func:`_require_int`.
* Enum-valued fields accept the enum member or its string value.
* Sequence-valued fields accept lists (as produced by JSON) and are stored as
  tuples; set-valued fields are stored as frozensets and serialised as sorted
  lists.
* Validation failures raise :class:`ContractError` (a ``ValueError``); a value
  of the wrong type raises :class:`ContractTypeError`, which is both a
  ``TypeError`` and a ``ValueError`` so callers may catch either.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import numbers
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from types import MappingProxyType
from typing import Any, ClassVar, Protocol, runtime_checkable

__all__ = [
    # errors
    "ContractError",
    "ContractTypeError",
    "CapabilityError",
    "UnknownBackendError",
    "BackendUnavailableError",
    "BackendNotExecutableError",
    # enums
    "ParallelAxis",
    "PayloadKind",
    "CollectiveKind",
    "StateLayout",
    # value objects
    "ParallelPlan",
    "BackendCapabilities",
    "ParameterLayout",
    "DistributedUpdate",
    "StepReceipt",
    "MESH_AXIS_ORDER",
    "ReadOnlyDict",
    # protocols
    "DistributedTrainingBackend",
    "DistributedTrainingSession",
    # registry (defined in mixle_compile.backends)
    "BackendRegistry",  # noqa: F822  (module __getattr__)
    "DEFAULT_BACKEND_REGISTRY",  # noqa: F822  (module __getattr__)
    "register_training_backend",  # noqa: F822  (module __getattr__)
    "get_training_backend",  # noqa: F822  (module __getattr__)
    "available_training_backends",  # noqa: F822  (module __getattr__)
    "normalize_backend_name",  # noqa: F822  (module __getattr__)
    # built-ins
    "TORCH_CAPABILITIES",  # noqa: F822  (module __getattr__)
    "MEGATRON_CAPABILITIES",  # noqa: F822  (module __getattr__)
    "BUILTIN_CAPABILITIES",  # noqa: F822  (module __getattr__)
    "DEEPSPEED_CAPABILITIES",  # noqa: F822  (module __getattr__)
    "TORCHTITAN_CAPABILITIES",  # noqa: F822  (module __getattr__)
]


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


class ContractError(ValueError):
    """A value violates one of the contracts defined in this module."""


class ContractTypeError(ContractError, TypeError):
    """A value has the wrong type (also catchable as ``TypeError``)."""


class CapabilityError(ContractError, NotImplementedError):
    """A plan asks a backend for something the backend does not execute.

    Both a ``ValueError`` and a ``NotImplementedError``: mixle raises the
    first for an unsupported precision and the second for an axis it does not
    execute, so code catching either catches this.
    """


class UnknownBackendError(KeyError, ValueError):
    """No training backend is registered under the requested name.

    A ``KeyError`` (a lookup that failed) and a ``ValueError`` (what mixle
    raises for an unknown backend name).
    """

    def __init__(self, name: str, available: tuple[str, ...]) -> None:
        super().__init__(name)
        self.name = name
        self.available = available

    def __str__(self) -> str:
        known = ", ".join(self.available) if self.available else "(none registered)"
        return f"no training backend named {self.name!r}; registered backends: {known}"


class BackendUnavailableError(RuntimeError):
    """A registered backend cannot run in this installation."""


class BackendNotExecutableError(NotImplementedError):
    """A backend is declared for plan verification only and cannot execute."""


# ---------------------------------------------------------------------------
# Validation helpers (one place for each kind of check)
# ---------------------------------------------------------------------------


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _require_int(owner: str, name: str, value: Any, minimum: int = 0) -> int:
    """Return ``value`` as an ``int`` if it is an exact integer ``>= minimum``.

    Any ``numbers.Integral`` counts (numpy integers too).  ``bool`` is refused
    even though it subclasses ``int``; so are floats (including integral ones
    such as ``2.0``), strings and ``None``.
    """
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise ContractTypeError(f"{owner}.{name} must be an integer >= {minimum}, got {_describe(value)}")
    if value < minimum:
        raise ContractError(f"{owner}.{name} must be an integer >= {minimum}, got {_describe(value)}")
    return int(value)


def _require_optional_int(owner: str, name: str, value: Any, minimum: int = 0) -> int | None:
    if value is None:
        return None
    return _require_int(owner, name, value, minimum)


def _require_bool(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ContractTypeError(f"{owner}.{name} must be a bool, got {_describe(value)}")
    return value


def _require_optional_bool(owner: str, name: str, value: Any) -> bool | None:
    if value is None:
        return None
    return _require_bool(owner, name, value)


def _require_str(owner: str, name: str, value: Any, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise ContractTypeError(f"{owner}.{name} must be a string, got {_describe(value)}")
    if not allow_empty and not value.strip():
        raise ContractError(f"{owner}.{name} must be a non-empty string, got {value!r}")
    return value


def _require_optional_str(owner: str, name: str, value: Any) -> str | None:
    if value is None:
        return None
    return _require_str(owner, name, value)


def _require_real(owner: str, name: str, value: Any) -> float:
    """A real number (``int``, ``float``, numpy scalars; not ``bool``), returned as ``float``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ContractTypeError(f"{owner}.{name} must be a real number, got {_describe(value)}")
    return value if type(value) is float else float(value)


def _require_error_bound(owner: str, name: str, value: Any) -> float | None:
    if value is None:
        return None
    number = _require_real(owner, name, value)
    if not math.isfinite(number) or number < 0:
        raise ContractError(f"{owner}.{name} must be a finite number >= 0 when given, got {number!r}")
    return number


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


_AXIS_NAMES_SEEN: set[str] = set()  # names already found identifier-like (a plan names a handful, many times)


def _require_axis_name(owner: str, name: str, value: Any) -> str:
    if isinstance(value, str) and value in _AXIS_NAMES_SEEN:
        return value
    text = _require_str(owner, name, value)
    if not _IDENTIFIER.fullmatch(text):
        raise ContractError(f"{owner}.{name} must be an identifier-like mesh axis name, got {text!r}")
    if type(text) is str and len(_AXIS_NAMES_SEEN) < 4096:
        _AXIS_NAMES_SEEN.add(text)
    return text


def _coerce_enum(owner: str, name: str, enum_cls: type[Enum], value: Any) -> Any:
    if isinstance(value, enum_cls):
        return value
    valid = ", ".join(member.value for member in enum_cls)
    if not isinstance(value, str):
        raise ContractTypeError(
            f"{owner}.{name} must be a {enum_cls.__name__} or one of its values ({valid}), got {_describe(value)}"
        )
    try:
        return enum_cls(value)
    except ValueError:
        raise ContractError(f"{owner}.{name}: unknown {enum_cls.__name__} {value!r}; valid values: {valid}") from None


def _require_sequence(owner: str, name: str, value: Any) -> tuple[Any, ...]:
    """A list or tuple (or other non-string iterable), returned as a tuple.

    A bare string is refused: iterating it would silently split it into
    characters.
    """
    if type(value) is tuple:  # the common case, and the answer
        return value
    if isinstance(value, (str, bytes)) or isinstance(value, Mapping):
        raise ContractTypeError(f"{owner}.{name} must be a sequence, got {_describe(value)}")
    if not isinstance(value, Iterable):
        raise ContractTypeError(f"{owner}.{name} must be a sequence, got {_describe(value)}")
    return tuple(value)


def _set(obj: Any, name: str, value: Any) -> None:
    """Assign inside ``__post_init__`` of a frozen dataclass (a value already in place is kept)."""
    if getattr(obj, name) is not value:
        object.__setattr__(obj, name, value)


def _to_json(value: Any) -> Any:
    """Convert a field value into plain JSON-ready Python data."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (frozenset, set)):
        return sorted((_to_json(item) for item in value), key=_sort_key)
    if isinstance(value, (tuple, list)):
        return [_to_json(item) for item in value]
    if isinstance(value, Mapping):
        return {str(key): _to_json(item) for key, item in value.items()}
    if isinstance(value, _Contract):
        return value.as_dict()
    return value


def _sort_key(item: Any) -> str:
    return item if isinstance(item, str) else repr(item)


class _Contract:
    """Shared ``as_dict``/``from_dict`` behaviour for the frozen dataclasses."""

    #: keys that ``as_dict`` emits but that are derived, not constructor fields; ``from_dict``
    #: accepts them when they agree with what the fields give (an integer of at least the minimum)
    _DERIVED_KEYS: ClassVar[tuple[str, ...]] = ()
    _DERIVED_MINIMUM: ClassVar[int] = 0

    def _derived_from(self, key: str, derived: int) -> str:
        """What a derived key is computed from, for the message when a stated value disagrees."""
        return f"the fields, which give {key}={derived}"

    def _check_derived(self, d: Mapping[str, Any]) -> None:
        owner = f"{type(self).__name__}.from_dict"
        for key in self._DERIVED_KEYS:
            if key in d:
                stated = _require_int(owner, key, d[key], minimum=self._DERIVED_MINIMUM)
                derived = getattr(self, key)
                if stated != derived:
                    raise ContractError(f"{owner}: {key}={stated} disagrees with {self._derived_from(key, derived)}")

    def as_dict(self) -> dict[str, Any]:
        return {f.name: _to_json(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        if not isinstance(d, Mapping):
            raise ContractTypeError(f"{cls.__name__}.from_dict expects a mapping, got {_describe(d)}")
        fields_ = dataclasses.fields(cls)
        names = {f.name for f in fields_}
        unknown = sorted(set(d) - names - set(cls._DERIVED_KEYS), key=str)
        if unknown:
            raise ContractError(
                f"{cls.__name__}.from_dict: unknown keys {unknown}; "
                f"expected keys: {sorted(names | set(cls._DERIVED_KEYS))}"
            )
        required = {
            f.name for f in fields_ if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        missing = sorted(required - set(d))
        if missing:
            raise ContractError(f"{cls.__name__}.from_dict: missing required keys {missing}")
        obj = cls(**{key: value for key, value in d.items() if key in names})
        obj._check_derived(d)
        return obj


# ---------------------------------------------------------------------------
# Enums
# ---------------------------------------------------------------------------


class ParallelAxis(StrEnum):
    """A parallelism dimension a plan may use."""

    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    TP = "tp"
    PP = "pp"
    CP = "cp"
    EP = "ep"
    ETP = "etp"


class PayloadKind(StrEnum):
    """What a distributed update moves between ranks."""

    GRADIENT = "gradient"
    SUFFICIENT_STATISTIC = "sufficient_statistic"
    PARAMETER = "parameter"
    ACTIVATION = "activation"
    KV_BLOCK = "kv_block"
    TOKEN = "token"
    MESSAGE = "message"


class CollectiveKind(StrEnum):
    """The communication pattern of a distributed update."""

    NONE = "none"
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    P2P = "p2p"
    CUSTOM = "custom"


class StateLayout(StrEnum):
    """Where a piece of (optimizer or model) state lives."""

    REPLICATED = "replicated"
    SHARDED = "sharded"
    PIPELINE_LOCAL = "pipeline_local"
    EXPERT_LOCAL = "expert_local"
    OFFLOADED = "offloaded"


# ---------------------------------------------------------------------------
# ParallelPlan
# ---------------------------------------------------------------------------

#: Physical device-mesh axes, outermost first.  ``tp`` is innermost so that
#: tensor-parallel ranks are adjacent (typically on one node); ``pp`` is
#: outermost because pipeline stages exchange the least data.  EP and ETP are
#: not listed: they are process groups cut from the data/model domains, not
#: extra mesh dimensions.
MESH_AXIS_ORDER: tuple[ParallelAxis, ...] = (
    ParallelAxis.PP,
    ParallelAxis.DP_REPLICATE,
    ParallelAxis.DP_SHARD,
    ParallelAxis.CP,
    ParallelAxis.TP,
)

_PLAN_AXIS_FIELDS: tuple[str, ...] = tuple(axis.value for axis in ParallelAxis)


@dataclass(frozen=True)
class ParallelPlan(_Contract):
    """Degrees of every parallelism axis plus the micro-batching schedule.

    ``world_size`` is the product of the physical axes
    (dp_replicate * dp_shard * tp * pp * cp).  ``ep`` and ``etp`` are carved
    out of those ranks and therefore do not multiply the world size; their
    divisibility rules are checked elsewhere, not here.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    microbatches: int = 1
    gradient_accumulation_steps: int = 1

    _DERIVED_KEYS: ClassVar[tuple[str, ...]] = ("world_size", "data_parallel_size")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _set(self, f.name, _require_int("ParallelPlan", f.name, getattr(self, f.name), minimum=1))

    # -- derived quantities -------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def data_parallel_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def axis_sizes(self) -> dict[ParallelAxis, int]:
        """A new dict of every axis to its degree, in ``ParallelAxis`` order."""
        return {axis: getattr(self, axis.value) for axis in ParallelAxis}

    @property
    def degrees(self) -> Mapping[ParallelAxis, int]:
        """Read-only mapping of every axis to its degree, in enum order."""
        return MappingProxyType({axis: getattr(self, axis.value) for axis in ParallelAxis})

    @property
    def active_axes(self) -> tuple[ParallelAxis, ...]:
        """Axes whose degree is greater than one, in ``ParallelAxis`` order."""
        return tuple(axis for axis in ParallelAxis if getattr(self, axis.value) > 1)

    @property
    def mesh(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """``(names, shape)`` of the physical device mesh.

        Only active physical axes appear, in :data:`MESH_AXIS_ORDER`; when no
        physical axis is active the mesh is the single dimension
        ``dp_replicate`` of size 1, so it is never empty.
        ``prod(shape) == world_size``.
        """
        names, shape = self.plan_mesh
        kept = [(n, s) for n, s in zip(names, shape, strict=True) if s > 1]
        if not kept:
            return (ParallelAxis.DP_REPLICATE.value,), (1,)
        return tuple(n for n, _ in kept), tuple(s for _, s in kept)

    @property
    def plan_mesh(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """``(names, shape)`` of the mesh a compiled plan records and its runtime builds.

        Like :attr:`mesh`, except that ``dp_replicate`` is always present (with
        size 1 when inactive), so replicate/shard style code always finds that
        dimension.  ``prod(shape) == world_size``.
        """
        names: list[str] = []
        shape: list[int] = []
        for axis in MESH_AXIS_ORDER:
            degree = getattr(self, axis.value)
            if degree > 1 or axis is ParallelAxis.DP_REPLICATE:
                names.append(axis.value)
                shape.append(degree)
        return tuple(names), tuple(shape)

    def size(self, axis: ParallelAxis | str) -> int:
        """Degree of ``axis`` (a :class:`ParallelAxis` or its string name)."""
        if isinstance(axis, ParallelAxis):
            return getattr(self, axis.value)
        if isinstance(axis, str) and axis in _PLAN_AXIS_FIELDS:
            return getattr(self, axis)
        raise ContractError(f"unknown parallel axis {axis!r}; valid axes: {', '.join(_PLAN_AXIS_FIELDS)}")

    def factorisation(self) -> str:
        """Human-readable product that defines ``world_size``."""
        return " * ".join(
            f"{axis.value}={getattr(self, axis.value)}"
            for axis in (
                ParallelAxis.DP_REPLICATE,
                ParallelAxis.DP_SHARD,
                ParallelAxis.TP,
                ParallelAxis.PP,
                ParallelAxis.CP,
            )
        )

    def validate_world_size(self, actual: int) -> None:
        """Raise ``ValueError`` unless ``actual`` equals :attr:`world_size`."""
        actual = _require_int("ParallelPlan.validate_world_size", "actual", actual, minimum=1)
        if actual != self.world_size:
            raise ContractError(
                f"plan world size {self.world_size} ({self.factorisation()}) "
                f"does not match the actual world size {actual}"
            )

    # -- serialisation ------------------------------------------------------

    def as_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["world_size"] = self.world_size
        data["data_parallel_size"] = self.data_parallel_size
        return data

    _DERIVED_MINIMUM: ClassVar[int] = 1

    def _derived_from(self, key: str, derived: int) -> str:
        return f"the degrees, which give {key}={derived} ({self.factorisation()})"


# ---------------------------------------------------------------------------
# BackendCapabilities
# ---------------------------------------------------------------------------


def _axis_set(owner: str, name: str, value: Any) -> frozenset[ParallelAxis]:
    items = _require_sequence(owner, name, value)
    return frozenset(_coerce_enum(owner, f"{name}[{index}]", ParallelAxis, item) for index, item in enumerate(items))


def _axes_text(axes: Iterable[ParallelAxis]) -> str:
    return "{" + ", ".join(sorted(axis.value for axis in axes)) + "}"


@dataclass(frozen=True)
class BackendCapabilities(_Contract):
    """What a backend can execute: axes, precisions and optional features.

    ``incompatible_axis_sets`` lists groups of axes that the backend cannot run
    together even though it runs each of them on its own.  The sets are kept
    in a canonical order so that equality does not depend on how they were
    listed.
    """

    name: str
    axes: frozenset[ParallelAxis]
    precisions: frozenset[str] = frozenset({"fp32", "bf16"})
    distributed_optimizer: bool = False
    reshardable_checkpoint: bool = False
    elastic_restart: bool = False
    requirements: tuple[str, ...] = ()
    incompatible_axis_sets: tuple[frozenset[ParallelAxis], ...] = ()

    def __post_init__(self) -> None:
        owner = "BackendCapabilities"
        _require_str(owner, "name", self.name)
        _set(self, "axes", _axis_set(owner, "axes", self.axes))

        precisions = _require_sequence(owner, "precisions", self.precisions)
        if not precisions:
            raise ContractError(f"{owner}.precisions must name at least one precision")
        for index, precision in enumerate(precisions):
            _require_str(owner, f"precisions[{index}]", precision)
        _set(self, "precisions", frozenset(precisions))

        requirements = _require_sequence(owner, "requirements", self.requirements)
        for index, requirement in enumerate(requirements):
            _require_str(owner, f"requirements[{index}]", requirement)
        _set(self, "requirements", requirements)

        raw_sets = _require_sequence(owner, "incompatible_axis_sets", self.incompatible_axis_sets)
        sets: set[frozenset[ParallelAxis]] = set()
        for index, raw in enumerate(raw_sets):
            axes = _axis_set(owner, f"incompatible_axis_sets[{index}]", raw)
            if len(axes) < 2:
                raise ContractError(
                    f"{owner}.incompatible_axis_sets[{index}] must contain at least two "
                    f"axes, got {_axes_text(axes)}; to refuse a single axis leave it out "
                    f"of {owner}.axes"
                )
            sets.add(axes)
        _set(
            self,
            "incompatible_axis_sets",
            tuple(sorted(sets, key=lambda s: sorted(axis.value for axis in s))),
        )

        for flag in ("distributed_optimizer", "reshardable_checkpoint", "elastic_restart"):
            _require_bool(owner, flag, getattr(self, flag))

    def supports(self, axis: ParallelAxis | str) -> bool:
        return _coerce_enum("BackendCapabilities.supports", "axis", ParallelAxis, axis) in self.axes

    def validate(self, plan: ParallelPlan, *, precision: str = "fp32") -> None:
        """Raise :class:`CapabilityError` if this backend cannot run ``plan``.

        Every problem found is reported in one message: active axes the
        backend does not execute, an unsupported precision, and each
        incompatible axis set whose axes are all active.
        """
        if not isinstance(plan, ParallelPlan):
            raise ContractTypeError(f"BackendCapabilities.validate expects a ParallelPlan, got {_describe(plan)}")
        _require_str("BackendCapabilities.validate", "precision", precision)
        problems: list[str] = []
        active = set(plan.active_axes)

        unexecuted = [axis for axis in plan.active_axes if axis not in self.axes]
        if unexecuted:
            listed = ", ".join(f"{axis.value}={plan.size(axis)}" for axis in unexecuted)
            problems.append(f"it does not execute the active axes {listed} (it executes {_axes_text(self.axes)})")

        if precision not in self.precisions:
            problems.append(
                f"it does not support precision {precision!r} (supported: {', '.join(sorted(self.precisions))})"
            )

        for axes in self.incompatible_axis_sets:
            if axes <= active:
                problems.append(f"it cannot run the axes {_axes_text(axes)} active together")

        if problems:
            raise CapabilityError(f"backend {self.name!r} cannot run this plan: " + "; ".join(problems))


# ---------------------------------------------------------------------------
# ParameterLayout
# ---------------------------------------------------------------------------

_SHARD = re.compile(r"shard\((0|[1-9][0-9]*)\)")


def placement_dim(placement: str) -> int | None:
    """``None`` for ``"replicate"``, the dimension for ``"shard(<dim>)"``: the one grammar of a
    placement (this module stays standard-library only, so the plan vocabulary's typed
    ``Placement`` reads placements through it).

    Raises ``ValueError`` for anything else.
    """
    if placement == "replicate":
        return None
    match = _SHARD.fullmatch(placement)
    if match is None:
        raise ValueError(placement)
    return int(match.group(1))


@dataclass(frozen=True)
class ParameterLayout(_Contract):
    """How one logical parameter is laid out over the device mesh.

    ``placements`` pairs a mesh axis name with ``"replicate"`` or
    ``"shard(<dim>)"``; mesh axes not listed hold the parameter replicated.
    ``shared_group`` names a tying group (parameters that are one tensor,
    e.g. tied embeddings).
    """

    logical_id: str
    global_shape: tuple[int, ...]
    placements: tuple[tuple[str, str], ...] = ()
    shared_group: str | None = None
    optimizer_state: StateLayout = StateLayout.REPLICATED

    def __post_init__(self) -> None:
        owner = "ParameterLayout"
        _require_str(owner, "logical_id", self.logical_id)

        shape = _require_sequence(owner, "global_shape", self.global_shape)
        shape = tuple(_require_int(owner, f"global_shape[{index}]", dim, minimum=1) for index, dim in enumerate(shape))
        _set(self, "global_shape", shape)

        raw = self.placements
        if isinstance(raw, Mapping):
            raw = tuple(raw.items())
        entries = _require_sequence(owner, "placements", raw)
        placements: list[tuple[str, str]] = []
        seen: set[str] = set()
        for index, entry in enumerate(entries):
            label = f"placements[{index}]"
            pair = _require_sequence(owner, label, entry)
            if len(pair) != 2:
                raise ContractError(f"{owner}.{label} must be a (mesh_axis, placement) pair, got {entry!r}")
            axis = _require_axis_name(owner, f"{label} mesh axis", pair[0])
            placement = _require_str(owner, f"{label} placement", pair[1])
            try:
                dim = placement_dim(placement)
            except ValueError:
                raise ContractError(
                    f"{owner}.{label}: malformed placement {placement!r} for mesh axis "
                    f"{axis!r}; expected 'replicate' or 'shard(<dim>)'"
                ) from None
            if dim is not None and dim >= len(shape):
                raise ContractError(
                    f"{owner}.{label}: placement {placement!r} on mesh axis {axis!r} "
                    f"shards dimension {dim}, but {self.logical_id!r} has shape {shape} "
                    f"({len(shape)} dimensions)"
                )
            if axis in seen:
                raise ContractError(f"{owner}.placements lists mesh axis {axis!r} more than once")
            seen.add(axis)
            placements.append((axis, placement))
        _set(self, "placements", tuple(placements))

        _require_optional_str(owner, "shared_group", self.shared_group)
        _set(
            self,
            "optimizer_state",
            _coerce_enum(owner, "optimizer_state", StateLayout, self.optimizer_state),
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready; ``placements`` is a ``{mesh_axis: placement}`` mapping in listed order (every
        field written out: a plan holds one per parameter)."""
        return {
            "logical_id": self.logical_id,
            "global_shape": list(self.global_shape),
            "placements": {str(axis): str(placement) for axis, placement in self.placements},
            "shared_group": self.shared_group,
            "optimizer_state": self.optimizer_state.value,
        }

    def placement_on(self, mesh_axis: str) -> str:
        """The placement on ``mesh_axis`` (``"replicate"`` when not listed)."""
        for axis, placement in self.placements:
            if axis == mesh_axis:
                return placement
        return "replicate"

    @property
    def sharded_axes(self) -> tuple[str, ...]:
        """Mesh axes over which the parameter is sharded."""
        return tuple(axis for axis, placement in self.placements if placement != "replicate")


# ---------------------------------------------------------------------------
# DistributedUpdate
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DistributedUpdate(_Contract):
    """One communication step of a compiled plan and its numerical evidence.

    ``contract_exact`` states that the update is exact in exact arithmetic
    (e.g. a sum of gradients); ``exact`` claims bitwise equality in floating
    point, which only a node without any collective can promise.

    The ``numerics_*`` fields record what was observed when the update was
    compared against a reference: ``numerics_sample_count`` samples, stored
    under ``numerics_evidence_id``, with the largest absolute and relative
    errors seen and whether repeated runs were bitwise deterministic.
    """

    node_id: str
    payload: PayloadKind
    collective: CollectiveKind
    mesh_axes: tuple[str, ...]
    state_layout: StateLayout
    exact: bool = False
    notes: tuple[str, ...] = ()
    contract_exact: bool = False
    determinism_observed: bool | None = None
    maximum_absolute_error: float | None = None
    maximum_relative_error: float | None = None
    numerics_evidence_id: str | None = None
    numerics_sample_count: int = 0

    def __post_init__(self) -> None:
        owner = "DistributedUpdate"
        _require_str(owner, "node_id", self.node_id)
        _set(self, "payload", _coerce_enum(owner, "payload", PayloadKind, self.payload))
        collective = _coerce_enum(owner, "collective", CollectiveKind, self.collective)
        _set(self, "collective", collective)
        _set(
            self,
            "state_layout",
            _coerce_enum(owner, "state_layout", StateLayout, self.state_layout),
        )

        axes = _require_sequence(owner, "mesh_axes", self.mesh_axes)
        for index, axis in enumerate(axes):
            _require_axis_name(owner, f"mesh_axes[{index}]", axis)
        if len(set(axes)) != len(axes):
            duplicates = sorted({axis for axis in axes if axes.count(axis) > 1})
            raise ContractError(f"{owner} {self.node_id!r}: mesh_axes lists {', '.join(duplicates)} more than once")
        _set(self, "mesh_axes", axes)

        exact = _require_bool(owner, "exact", self.exact)
        if isinstance(self.notes, str):
            raise ContractTypeError(
                f"{owner}.notes must be a tuple of strings, got {_describe(self.notes)}; "
                f"pass ({self.notes!r},) for a single note"
            )
        notes = _require_sequence(owner, "notes", self.notes)
        for index, note in enumerate(notes):
            _require_str(owner, f"notes[{index}]", note, allow_empty=True)
        _set(self, "notes", notes)
        _require_bool(owner, "contract_exact", self.contract_exact)
        _require_optional_bool(owner, "determinism_observed", self.determinism_observed)
        for name in ("maximum_absolute_error", "maximum_relative_error"):
            _set(self, name, _require_error_bound(owner, name, getattr(self, name)))
        evidence = _require_optional_str(owner, "numerics_evidence_id", self.numerics_evidence_id)
        samples = _require_int(owner, "numerics_sample_count", self.numerics_sample_count, minimum=0)
        _set(self, "numerics_sample_count", samples)

        if collective is CollectiveKind.NONE and axes:
            raise ContractError(
                f"{owner} {self.node_id!r}: collective 'none' communicates over no mesh "
                f"axes, but mesh_axes is {list(axes)}"
            )
        if collective is not CollectiveKind.NONE and not axes:
            raise ContractError(
                f"{owner} {self.node_id!r}: collective {collective.value!r} needs at least "
                f"one mesh axis, but mesh_axes is empty"
            )
        if exact and collective is not CollectiveKind.NONE:
            raise ContractError(
                f"{owner} {self.node_id!r}: exact=True claims bitwise exactness, which no "
                f"distributed collective guarantees; only collective 'none' may claim it "
                f"(got {collective.value!r}; use contract_exact for exact-arithmetic "
                f"contracts)"
            )
        if (evidence is None) != (samples == 0):
            if evidence is None:
                raise ContractError(
                    f"{owner} {self.node_id!r}: numerics_sample_count={samples} needs a "
                    f"numerics_evidence_id naming where the samples are recorded"
                )
            raise ContractError(
                f"{owner} {self.node_id!r}: numerics_evidence_id={evidence!r} is given "
                f"but numerics_sample_count is 0; evidence requires samples"
            )
        if samples > 0:
            missing = [
                name
                for name in (
                    "determinism_observed",
                    "maximum_absolute_error",
                    "maximum_relative_error",
                )
                if getattr(self, name) is None
            ]
            if missing:
                raise ContractError(
                    f"{owner} {self.node_id!r}: numerics_sample_count={samples} requires "
                    f"the observations {', '.join(missing)}"
                )
        else:
            claimed = [
                name
                for name in ("determinism_observed", "maximum_absolute_error", "maximum_relative_error")
                if getattr(self, name) is not None
            ]
            if claimed:
                raise ContractError(
                    f"{owner} {self.node_id!r}: {', '.join(claimed)} given without numerics evidence "
                    f"(numerics_sample_count is 0); an observation needs the samples it came from"
                )

    @property
    def has_numerics_evidence(self) -> bool:
        return self.numerics_sample_count > 0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, every field in order (what the generic conversion gives, written out: a plan
        holds one per collective)."""
        return {
            "node_id": self.node_id,
            "payload": self.payload.value,
            "collective": self.collective.value,
            "mesh_axes": [str(axis) for axis in self.mesh_axes],  # names, or the plan vocabulary's axes
            "state_layout": self.state_layout.value,
            "exact": self.exact,
            "notes": list(self.notes),
            "contract_exact": self.contract_exact,
            "determinism_observed": self.determinism_observed,
            "maximum_absolute_error": self.maximum_absolute_error,
            "maximum_relative_error": self.maximum_relative_error,
            "numerics_evidence_id": self.numerics_evidence_id,
            "numerics_sample_count": self.numerics_sample_count,
        }


# ---------------------------------------------------------------------------
# StepReceipt
# ---------------------------------------------------------------------------

_EXTRA_SCALARS = (str, int, float, bool, type(None))


class ReadOnlyDict(dict):
    """A ``dict`` that refuses changes: it passes ``isinstance(x, dict)``, pickles and deep-copies.

    Used where a frozen record holds a mapping (a receipt's ``extra``, a decomposition's
    ``extra``): a ``MappingProxyType`` would be read-only too, but it can be neither pickled nor
    deep-copied, and it is not a ``dict``.
    """

    __slots__ = ()

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "this mapping is part of a frozen record and cannot be changed; build a new record "
            "(dataclasses.replace) with the mapping you want"
        )

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (dict(self),))

    def __copy__(self) -> ReadOnlyDict:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> ReadOnlyDict:
        import copy

        return type(self)({key: copy.deepcopy(item, memo) for key, item in self.items()})

    def __repr__(self) -> str:
        return f"ReadOnlyDict({dict.__repr__(self)})"


def _freeze_extra(owner: str, value: Any) -> Mapping[str, Any]:
    """Validate ``extra`` and return a read-only copy (a :class:`ReadOnlyDict`).

    Keys are strings; values are JSON scalars or flat sequences of them
    (stored as tuples, emitted as lists by ``as_dict``).
    """
    if not isinstance(value, Mapping):
        raise ContractTypeError(f"{owner}.extra must be a mapping, got {_describe(value)}")
    frozen: dict[str, Any] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise ContractTypeError(f"{owner}.extra keys must be strings, got {_describe(key)}")
        if isinstance(item, _EXTRA_SCALARS):
            frozen[key] = item
        elif isinstance(item, (list, tuple)) and all(isinstance(x, _EXTRA_SCALARS) for x in item):
            frozen[key] = tuple(item)
        else:
            raise ContractTypeError(
                f"{owner}.extra[{key!r}] must be a JSON scalar or a flat list of them, got {_describe(item)}"
            )
    return ReadOnlyDict(frozen)


@dataclass(frozen=True)
class StepReceipt(_Contract):
    """What one optimizer step (or accumulation boundary) did.

    ``local_*`` counts are this rank's; ``global_*_observed`` are set when the
    runtime measured the global count (e.g. with an all-reduce), otherwise
    the global count is inferred as local * data_parallel_size.  ``loss`` may
    be NaN or infinite (a diverged step is a legitimate observation) or None
    (e.g. for a skipped step).
    """

    step: int
    loss: float | None
    local_examples: int
    local_tokens: int
    microbatches: int
    accumulation_steps: int
    data_parallel_size: int
    optimizer: str
    precision: str
    collective_bytes: int = 0
    skipped: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False)
    global_examples_observed: int | None = None
    global_tokens_observed: int | None = None

    _DERIVED_KEYS: ClassVar[tuple[str, ...]] = ("global_examples", "global_tokens")

    def __post_init__(self) -> None:
        owner = "StepReceipt"
        _set(self, "step", _require_int(owner, "step", self.step, minimum=0))
        if self.loss is not None:
            _set(self, "loss", _require_real(owner, "loss", self.loss))
        for name in ("local_examples", "local_tokens", "collective_bytes"):
            _set(self, name, _require_int(owner, name, getattr(self, name), minimum=0))
        for name in ("microbatches", "accumulation_steps", "data_parallel_size"):
            _set(self, name, _require_int(owner, name, getattr(self, name), minimum=1))
        _require_str(owner, "optimizer", self.optimizer)
        _require_str(owner, "precision", self.precision)
        _require_bool(owner, "skipped", self.skipped)
        _set(self, "extra", _freeze_extra(owner, self.extra))
        for name in ("global_examples_observed", "global_tokens_observed"):
            _set(self, name, _require_optional_int(owner, name, getattr(self, name), minimum=0))

    def as_dict(self) -> dict[str, Any]:
        """Every field, plus the derived ``global_examples`` and ``global_tokens``."""
        data = super().as_dict()
        data["global_examples"] = self.global_examples
        data["global_tokens"] = self.global_tokens
        return data

    def _derived_from(self, key: str, derived: int) -> str:
        return f"the receipt's counts, which give {key}={derived}; drop {key} or state {key}_observed"

    @property
    def global_examples(self) -> int:
        if self.global_examples_observed is not None:
            return self.global_examples_observed
        return self.local_examples * self.data_parallel_size

    @property
    def global_tokens(self) -> int:
        if self.global_tokens_observed is not None:
            return self.global_tokens_observed
        return self.local_tokens * self.data_parallel_size


# ---------------------------------------------------------------------------
# Protocols
# ---------------------------------------------------------------------------


@runtime_checkable
class DistributedTrainingSession(Protocol):
    """A prepared model being trained under one plan."""

    plan: ParallelPlan
    capabilities: BackendCapabilities
    step: int

    def train_batch(self, inputs: Any, targets: Any) -> StepReceipt: ...

    def finish_accumulation(self) -> StepReceipt | None: ...

    def discard_accumulation(self) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class DistributedTrainingBackend(Protocol):
    """Something that can prepare a module for training under a plan.

    A backend may also have a ``name`` (a non-empty string); the registry does not need one, it
    knows each backend by the name it was registered under.
    """

    capabilities: BackendCapabilities

    def prepare(self, module: Any, *, plan: ParallelPlan, **options: Any) -> DistributedTrainingSession: ...


# ---------------------------------------------------------------------------
# The backend registry and the built-in backends (mixle_compile.backends)
# ---------------------------------------------------------------------------


def _backends() -> Any:
    # mixle_compile.backends imports this module, so this one reads it on first use rather than
    # importing it at the top (it needs the standard library only).
    return importlib.import_module("mixle_compile.backends")


def __getattr__(name: str) -> Any:
    """The registry's names (:data:`mixle_compile.backends.__all__`), read from there on first use."""
    if not name.startswith("_") and name in _backends().__all__:
        return getattr(_backends(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_backends().__all__})

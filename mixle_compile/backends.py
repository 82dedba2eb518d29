"""Training backends: the registry that names them and the backends built in.

:mod:`mixle_compile.contracts` states what a backend is (:class:`~mixle_compile.contracts.BackendCapabilities`,
the :class:`~mixle_compile.contracts.DistributedTrainingBackend` protocol) and re-exports every name
defined here, so ``from mixle_compile.contracts import get_training_backend`` keeps working.

A backend is registered as an instance, as a zero-argument factory, or as an entry string
``"module:attribute"`` naming either, imported on the first :meth:`BackendRegistry.get`. The
in-tree ``torch`` backend is data too: its declared capabilities and the entry string of the
runtime's ``prepare`` (``mixle_compile.runtime:prepare``), imported when a plan is prepared, so
that verifying a plan never imports torch. Like contracts, this module needs the standard
library only.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mixle_compile.contracts import (
    BackendCapabilities,
    BackendNotExecutableError,
    BackendUnavailableError,
    ContractError,
    ContractTypeError,
    DistributedTrainingBackend,
    DistributedTrainingSession,
    ParallelAxis,
    ParallelPlan,
    UnknownBackendError,
    _describe,
    _require_bool,
)

__all__ = [
    "BackendRegistry",
    "DEFAULT_BACKEND_REGISTRY",
    "register_training_backend",
    "get_training_backend",
    "available_training_backends",
    "normalize_backend_name",
    "load_entry",
    "RuntimeBackend",
    "TORCH_CAPABILITIES",
    "MEGATRON_CAPABILITIES",
    "TORCHTITAN_CAPABILITIES",
    "DEEPSPEED_CAPABILITIES",
    "BUILTIN_CAPABILITIES",
]

_BACKEND_MEMBERS = ("capabilities", "prepare")
#: ``"package.module:attribute"`` (the attribute may be dotted), as entry points are written.
_ENTRY = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")


def load_entry(entry: str) -> tuple[str, Any]:
    """The object an entry string ``"module:attribute"`` names, importing its module: (module, object).

    Raises ``ImportError`` when the module cannot be imported and ``AttributeError`` when it has
    no such attribute; the callers say what the entry was for."""
    module_name, _, attribute = entry.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    return module_name, target


def is_entry(value: Any) -> bool:
    return isinstance(value, str) and _ENTRY.fullmatch(value) is not None


def _check_backend(obj: Any, context: str) -> None:
    """Raise ``TypeError`` unless ``obj`` is a backend *instance*."""
    if isinstance(obj, type):
        raise ContractTypeError(
            f"{context}: got the class {obj.__qualname__}, not an instance; register an "
            f"instance or a zero-argument factory function that returns one"
        )
    missing = [member for member in _BACKEND_MEMBERS if not hasattr(obj, member)]
    if missing:
        raise ContractTypeError(
            f"{context}: {_describe(obj)} does not implement DistributedTrainingBackend (missing: {', '.join(missing)})"
        )
    name = getattr(obj, "name", None)
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ContractTypeError(
            f"{context}: backend.name, when given, must be a non-empty string, got {_describe(name)}"
        )
    if not isinstance(obj.capabilities, BackendCapabilities):
        raise ContractTypeError(
            f"{context}: backend.capabilities must be a BackendCapabilities, got {_describe(obj.capabilities)}"
        )
    if not callable(obj.prepare):
        raise ContractTypeError(f"{context}: backend.prepare must be callable")


def _is_factory(obj: Any) -> bool:
    """Plain functions, lambdas, bound methods and ``functools.partial``."""
    return inspect.isfunction(obj) or inspect.ismethod(obj) or isinstance(obj, functools.partial)


# ---------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------


def normalize_backend_name(name: Any) -> str:
    if not isinstance(name, str):
        raise ContractTypeError(f"backend name must be a string, got {_describe(name)}")
    normalised = name.strip().lower().replace("-", "_")
    if not normalised:
        raise ContractError(f"backend name must be non-empty, got {name!r}")
    return normalised


@dataclass
class _Entry:
    instance: Any = None
    factory: Callable[[], Any] | None = None
    source: Any = None  # what was registered (the instance, the factory or the entry string), for idempotence


def _entry_factory(key: str, entry: str) -> Callable[[], Any]:
    """What :meth:`BackendRegistry.get` calls for a backend registered by an entry string."""

    def load() -> Any:
        try:
            _, target = load_entry(entry)
        except ImportError as exc:
            raise BackendUnavailableError(
                f"training backend {key!r} is registered as {entry!r}, but importing it failed: {exc}"
            ) from exc
        except AttributeError as exc:
            raise BackendUnavailableError(
                f"training backend {key!r} is registered as {entry!r}, which does not exist: {exc}"
            ) from exc
        return target() if _is_factory(target) else target

    return load


class BackendRegistry:
    """Name -> training backend, with lazily constructed entries.

    Names are normalised (stripped, lower-cased, ``-`` replaced by ``_``).
    A backend is registered either as an instance, as a zero-argument
    factory function, which is called once, on the first :meth:`get`, and
    whose result is cached, or as an entry string ``"module:attribute"``
    naming an instance or a factory, imported on the first :meth:`get`.
    """

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.RLock()

    def register(self, name: str, backend: Any, *, override: bool = False) -> None:
        """Register ``backend`` (an instance, a zero-argument factory or an entry string) under ``name``.

        Registering the very object already registered under ``name`` again does nothing (an
        entry string: the same string); replacing a different one needs ``override=True``.
        """
        key = normalize_backend_name(name)
        _require_bool("BackendRegistry.register", "override", override)
        context = f"cannot register training backend {key!r}"
        if is_entry(backend):
            entry = _Entry(factory=_entry_factory(key, backend), source=backend)
        elif isinstance(backend, DistributedTrainingBackend):  # classes are refused here too
            _check_backend(backend, context)
            entry = _Entry(instance=backend, source=backend)
        elif _is_factory(backend):
            try:
                inspect.signature(backend).bind()
            except TypeError:
                raise ContractTypeError(
                    f"{context}: the factory {backend!r} must be callable with no arguments"
                ) from None
            except ValueError:  # signature unavailable; trust the caller
                pass
            entry = _Entry(factory=backend, source=backend)
        else:
            _check_backend(backend, context)  # raises with the missing members
            raise AssertionError("unreachable")  # pragma: no cover
        with self._lock:
            current = self._entries.get(key)
            if current is not None and (current.source is backend or (is_entry(backend) and current.source == backend)):
                return  # the same object (or entry) again: nothing to do
            if current is not None and not override:
                raise ContractError(f"training backend {key!r} is already registered; pass override=True to replace it")
            self._entries[key] = entry

    def get(self, name: str) -> DistributedTrainingBackend:
        key = normalize_backend_name(name)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                raise UnknownBackendError(key, tuple(sorted(self._entries)))
            if entry.instance is None:
                assert entry.factory is not None
                instance = entry.factory()
                _check_backend(instance, f"the factory for training backend {key!r} returned an invalid backend")
                entry.instance = instance
                entry.factory = None
            return entry.instance

    def available(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        try:
            key = normalize_backend_name(name)
        except ValueError:
            return False
        with self._lock:
            return key in self._entries


# ---------------------------------------------------------------------------
# Built-in backends
# ---------------------------------------------------------------------------

_ALL_AXES = frozenset(ParallelAxis)

#: The in-tree torch runtime, stating only what it actually executes: every axis, in every
#: combination (what it cannot run on some model is a torch-only verifier rule).
TORCH_CAPABILITIES = BackendCapabilities(
    name="torch",
    axes=_ALL_AXES,
    # fp64: distribution models, fitted by EM in float64 (rule C008 keeps neural models off it).
    precisions=frozenset({"fp32", "bf16", "fp64"}),
    requirements=("torch>=2.6",),
    incompatible_axis_sets=(),
    distributed_optimizer=True,
    reshardable_checkpoint=True,
    elastic_restart=False,
)

#: Declared from Megatron-Core's documented parallelism; used to verify plans
#: only (Megatron is never imported here).
MEGATRON_CAPABILITIES = BackendCapabilities(
    name="megatron",
    axes=_ALL_AXES,
    precisions=frozenset({"fp32", "bf16", "fp16", "fp8"}),
    requirements=("megatron-core", "NVIDIA GPUs"),
    incompatible_axis_sets=(),
    distributed_optimizer=True,
    reshardable_checkpoint=True,  # via dist_checkpointing
    elastic_restart=False,
)

#: torchtitan: every axis (0.3 has no expert tensor parallelism: rule E010; experts
#: shard over the `efsdp` axis, torchtitan/distributed/parallel_dims.py); Float8 linears.
TORCHTITAN_CAPABILITIES = BackendCapabilities(
    name="torchtitan",
    axes=_ALL_AXES,
    precisions=frozenset({"fp32", "bf16", "fp8"}),
    requirements=("torchtitan", "NVIDIA or AMD GPUs"),
    incompatible_axis_sets=(),
    distributed_optimizer=False,  # FSDP2 shards the optimizer state; there is no separate ZeRO-1 optimizer
    reshardable_checkpoint=True,  # torch.distributed.checkpoint
    elastic_restart=False,
)
#: DeepSpeed, for configs read from a ds_config.json: verification with the common rules only.
#: ZeRO 1/2 partition the optimizer state of replicated parameters (a distributed optimizer), ZeRO 3
#: the parameters too (dp_shard); fp16 and bf16 (deepspeed/runtime/config.py).
DEEPSPEED_CAPABILITIES = BackendCapabilities(
    name="deepspeed",
    axes=_ALL_AXES,
    precisions=frozenset({"fp32", "bf16", "fp16"}),
    requirements=("deepspeed", "GPUs"),
    incompatible_axis_sets=(),
    distributed_optimizer=True,
    reshardable_checkpoint=True,  # universal checkpoints (deepspeed/checkpoint/ds_to_universal.py)
    elastic_restart=False,
)

BUILTIN_CAPABILITIES: dict[str, BackendCapabilities] = {
    "torch": TORCH_CAPABILITIES,
    "megatron": MEGATRON_CAPABILITIES,
    "torchtitan": TORCHTITAN_CAPABILITIES,
    "deepspeed": DEEPSPEED_CAPABILITIES,
}


class RuntimeBackend:
    """A backend that executes plans through the ``prepare`` function its entry string names
    (``"module:function"``), imported when a plan is prepared: its capabilities are declared, so
    plans are checked against them without importing the runtime."""

    def __init__(self, name: str, capabilities: BackendCapabilities, entry: str):
        if not is_entry(entry):
            raise ContractError(f"RuntimeBackend.entry must be 'module:function', got {entry!r}")
        self.name = name
        self.capabilities = capabilities
        self.entry = entry

    def prepare(self, module: Any, *, plan: ParallelPlan, **options: Any) -> DistributedTrainingSession:
        self.capabilities.validate(plan, precision=options.get("precision", "fp32"))
        module_name, _, function = self.entry.partition(":")
        unavailable = f"the {self.name} runtime is not installed/available in this version"
        try:
            _, prepare = load_entry(self.entry)
        except ImportError as exc:
            raise BackendUnavailableError(f"{unavailable} (importing {module_name} failed: {exc})") from exc
        except AttributeError:
            prepare = None
        if not callable(prepare):
            raise BackendUnavailableError(f"{unavailable} ({module_name} has no {function} function)")
        session = prepare(module, plan=plan, **options)
        if not isinstance(session, DistributedTrainingSession):
            raise ContractTypeError(
                f"{module_name}.{function} returned {_describe(session)}, which does "
                f"not implement DistributedTrainingSession"
            )
        return session

    def __repr__(self) -> str:
        return f"<{self.name} training backend>"


class _VerificationBackend:
    """An engine whose rules and declared capabilities check plans, but which this package cannot
    run: training happens in the engine itself."""

    def __init__(self, name: str, capabilities: BackendCapabilities):
        self.name = name
        self.capabilities = capabilities

    def prepare(self, module: Any, *, plan: ParallelPlan, **options: Any) -> DistributedTrainingSession:
        raise BackendNotExecutableError(
            f"the {self.name!r} backend is declared for verification only: its capabilities "
            f"are used to check plans, but it cannot execute training in this version"
        )

    def __repr__(self) -> str:
        return f"<{self.name} training backend (verification only)>"


#: The in-tree runtime's library entry (mixle_compile/runtime/__init__.py ``prepare``).
TORCH_RUNTIME_ENTRY = "mixle_compile.runtime:prepare"

DEFAULT_BACKEND_REGISTRY = BackendRegistry()
DEFAULT_BACKEND_REGISTRY.register("torch", RuntimeBackend("torch", TORCH_CAPABILITIES, TORCH_RUNTIME_ENTRY))
for _name, _capabilities in BUILTIN_CAPABILITIES.items():
    if _name != "torch":
        DEFAULT_BACKEND_REGISTRY.register(_name, functools.partial(_VerificationBackend, _name, _capabilities))

register_training_backend = DEFAULT_BACKEND_REGISTRY.register
get_training_backend = DEFAULT_BACKEND_REGISTRY.get
available_training_backends = DEFAULT_BACKEND_REGISTRY.available

"""The backend registry lives in mixle_compile.backends; contracts re-exports it. A backend may be
registered by an entry string "module:attribute", imported on the first get, and the built-in
torch backend reaches the runtime through its entry string only when a plan is prepared."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

import mixle_compile.backends as b
import mixle_compile.contracts as c
from mixle_compile.contracts import ParallelPlan


class _Session:
    def __init__(self, plan):
        self.plan, self.capabilities, self.step = plan, b.TORCH_CAPABILITIES, 0

    def train_batch(self, inputs, targets):  # pragma: no cover - not driven here
        raise NotImplementedError

    def finish_accumulation(self):  # pragma: no cover
        return None

    def discard_accumulation(self):  # pragma: no cover
        pass

    def close(self):  # pragma: no cover
        pass


class _Backend:
    name = "plugin"
    capabilities = b.TORCH_CAPABILITIES

    def prepare(self, module, *, plan, **options):
        return _Session(plan)


def test_contracts_re_exports_every_registry_name_as_the_same_object():
    for name in b.__all__:
        assert getattr(c, name) is getattr(b, name), name
    for name in c.__all__:
        assert hasattr(c, name), name
    from mixle_compile.contracts import DEFAULT_BACKEND_REGISTRY, get_training_backend  # noqa: F401

    assert get_training_backend.__self__ is b.DEFAULT_BACKEND_REGISTRY
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        c.no_such_name  # noqa: B018


def test_an_entry_string_is_imported_on_the_first_get(monkeypatch):
    plugin = types.ModuleType("mixle_plugin_for_tests")
    calls = []

    def factory():
        calls.append(1)
        return _Backend()

    plugin.make = factory
    registry = b.BackendRegistry()
    registry.register("plugin", "mixle_plugin_for_tests:make")
    registry.register("plugin", "mixle_plugin_for_tests:make")  # the same entry again: nothing to do
    assert registry.available() == ("plugin",) and calls == []  # not imported at registration
    monkeypatch.setitem(sys.modules, "mixle_plugin_for_tests", plugin)
    backend = registry.get("plugin")
    assert isinstance(backend, _Backend) and calls == [1]
    assert registry.get("plugin") is backend and calls == [1]
    with pytest.raises(ValueError, match="already registered"):
        registry.register("plugin", "mixle_plugin_for_tests:other")


def test_an_entry_string_naming_an_instance_or_nothing():
    plugin = types.ModuleType("mixle_plugin_instance")
    plugin.backend = _Backend()
    sys.modules["mixle_plugin_instance"] = plugin
    try:
        registry = b.BackendRegistry()
        registry.register("one", "mixle_plugin_instance:backend")
        assert registry.get("one") is plugin.backend
        registry.register("two", "mixle_plugin_instance:missing")
        with pytest.raises(RuntimeError, match="registered as 'mixle_plugin_instance:missing', which does not exist"):
            registry.get("two")
    finally:
        del sys.modules["mixle_plugin_instance"]
    registry.register("three", "no_such_module_anywhere:backend")
    with pytest.raises(RuntimeError, match="importing it failed"):
        registry.get("three")


def test_a_string_that_is_no_entry_is_refused_as_before():
    with pytest.raises(TypeError, match="does not implement DistributedTrainingBackend"):
        b.BackendRegistry().register("x", "not an entry")


def test_the_torch_backend_names_the_runtime_by_its_entry():
    torch_backend = b.get_training_backend("torch")
    assert isinstance(torch_backend, b.RuntimeBackend)
    assert torch_backend.entry == b.TORCH_RUNTIME_ENTRY == "mixle_compile.runtime:prepare"
    module, prepare = b.load_entry(torch_backend.entry)
    assert module == "mixle_compile.runtime" and callable(prepare)
    with pytest.raises(ValueError, match="'module:function'"):
        b.RuntimeBackend("x", b.TORCH_CAPABILITIES, "no colon")


def test_a_runtime_backend_reads_its_entry_when_preparing(monkeypatch):
    runtime = types.ModuleType("mixle_runtime_for_tests")
    runtime.start = lambda module, *, plan, **options: _Session(plan)
    monkeypatch.setitem(sys.modules, "mixle_runtime_for_tests", runtime)
    backend = b.RuntimeBackend("mine", b.TORCH_CAPABILITIES, "mixle_runtime_for_tests:start")
    assert backend.prepare(object(), plan=ParallelPlan()).plan == ParallelPlan()
    del runtime.start
    with pytest.raises(RuntimeError, match=r"the mine runtime is not installed/available .*has no start function"):
        backend.prepare(object(), plan=ParallelPlan())


def test_importing_the_registry_first_works_and_imports_no_torch():
    code = (
        "import sys, mixle_compile.backends as b, mixle_compile.contracts as c; "
        "assert c.get_training_backend('megatron').name == 'megatron'; print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"

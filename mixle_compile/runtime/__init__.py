"""The torch runtime: replay a compiled plan on real process groups (see docs/runtime.md).

Entry points:

- ``run_plan(plan, *, steps=None, out_dir=None, reference=False, data_path=None, timeout_s=60.0,
  progress=True) -> RunReport`` starts the ranks (or joins torchrun's), trains, and reports;
- ``prepare(module, *, plan, document=..., **options)`` is the `torch` training backend's library
  API: it returns a session whose ``train_batch(inputs, targets)`` returns a StepReceipt;
- ``main(argv)`` is ``python -m mixle_compile.runtime PLAN [options]`` (the `run` command).

This package is the only part of mixle-compile that imports torch, and only when it trains:
importing it, building the `run` command's arguments and refusing a plan load no torch.
"""

from __future__ import annotations

from importlib import import_module

from mixle_compile.runtime.errors import CollectiveFailed, PlanMismatch, RunFailed, RuntimeRefusal

__all__ = [
    "CollectiveFailed",
    "DEFAULT_TIMEOUT_S",
    "PlanMismatch",
    "RunFailed",
    "RunReport",
    "RuntimeRefusal",
    "load_plan_or_spec",
    "main",
    "plan_of",
    "prepare",
    "run_plan",
]

# Imported on first use, so that `import mixle_compile.runtime` stays cheap.
_LAZY = {
    "DEFAULT_TIMEOUT_S": "mixle_compile.runtime.launch",
    "load_plan_or_spec": "mixle_compile.runtime.launch",
    "run_plan": "mixle_compile.runtime.launch",
    "RunReport": "mixle_compile.runtime.report",
    "plan_of": "mixle_compile.runtime.instructions",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mixle_compile.runtime' has no attribute {name!r}")


def prepare(module, *, plan, **options):
    """Prepare ``module`` for training under ``plan``; see :func:`mixle_compile.runtime.session.prepare`."""
    try:
        from mixle_compile.runtime.session import prepare as _prepare
    except ImportError as exc:
        from mixle_compile.contracts import BackendUnavailableError

        raise BackendUnavailableError(
            f"the torch runtime needs torch: pip install 'mixle-compile[runtime]' ({exc})"
        ) from exc
    return _prepare(module, plan=plan, **options)


def main(argv: list[str] | None = None) -> int:
    """``run PLAN|SPEC [--steps N] [--reference] [--out DIR] [--data FILE] [--timeout S] [--quiet]``."""
    from mixle_compile.runtime.cli import main as _main

    return _main(argv)

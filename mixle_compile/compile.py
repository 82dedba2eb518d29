"""The `compile` pass: load, verify, lower, and build the plan artifact.

A plan is only built from a spec without errors; the lowering's own checks (every gradient reduced
exactly once, a deadlock-free schedule) must hold too, or the compiler has a bug and says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mixle_compile.check import CheckResult, check_loaded
from mixle_compile.diagnostics import Code, Severity, register_code, sort_key
from mixle_compile.heap import full_collections_paused
from mixle_compile.spec import load_spec

LOWERING_REFUSED = register_code(
    Code(
        "L003",
        "lowering-refused",
        "The lowering cannot build a plan for a spec that `check` accepted.",
        "The lowering refuses numbers its own builders cannot realise (a schedule, a layout) with the "
        "reason; it is reported at the spec's `mesh` instead of as an internal error. Every such case is "
        "a verifier rule that should have refused the spec first: please report it.",
    )
)


class CompilerBug(RuntimeError):
    """The lowering's self-checks failed: a wrong plan must never be written."""


@dataclass(frozen=True)
class CompileResult:
    check: CheckResult
    plan: dict | None  # the JSON-ready plan; None when the spec has errors
    text: str | None = None  # the plan as written (plan_text(plan)), encoded with its digest


def compile_file(path: str | Path, *, options=None, progress=None) -> CompileResult:
    with full_collections_paused():
        return compile_loaded(load_spec(path, options=options), progress=progress)


def compile_loaded(loaded, progress=None) -> CompileResult:
    """Verify and lower a loaded spec (see :func:`compile_file`). ``progress``
    (:class:`mixle_compile.progress.Progress`) hears of each of the three phases as it begins."""
    from mixle_compile.progress import Silent

    progress = progress or Silent()
    progress.step("verifying the spec")
    checked = check_loaded(loaded, group=False)  # the plan lists every finding; `check` groups them
    if checked.errors or checked.unreadable or loaded.spec is None:
        return CompileResult(checked, None)
    from mixle_compile.lower.lowering import lower
    from mixle_compile.plan.artifact import build_plan_text

    progress.step("lowering: layouts, updates, stage programs, the schedule check")
    try:
        lowered = lower(loaded.spec, document=loaded.document)
    except ValueError as exc:
        refused = loaded.document.diagnostic(LOWERING_REFUSED.code, f"the plan cannot be built: {exc}", ("mesh",))
        diagnostics = tuple(sorted((*checked.diagnostics, refused), key=sort_key))
        return CompileResult(CheckResult(checked.file, diagnostics, checked.unreadable, checked.notes), None)
    if lowered.diagnostics:
        diagnostics = tuple(sorted((*checked.diagnostics, *lowered.diagnostics), key=sort_key))
        checked = CheckResult(checked.file, diagnostics, checked.unreadable, checked.notes)
        if any(d.severity is Severity.error for d in lowered.diagnostics):
            return CompileResult(checked, None)
    if lowered.reduction_problems:
        raise CompilerBug(f"the lowered plan reduces a value incorrectly: {lowered.reduction_problems[0].message}")
    if lowered.schedule is not None and not lowered.schedule.check.ok:
        raise CompilerBug(f"the lowered schedule fails its check: {lowered.schedule.check.problems[0]}")
    progress.step("building the plan")
    return CompileResult(checked, *build_plan_text(loaded.spec, lowered, list(checked.diagnostics)))

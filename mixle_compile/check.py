"""The `check` pass: load each spec file, verify its plan, collect the diagnostics.

This is the lint path used in pre-commit and CI; it must not import torch. The verifier (and with
it z3) is imported only once a file has loaded cleanly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mixle_compile.diagnostics import Diagnostic, Severity, sort_key
from mixle_compile.heap import full_collections_paused
from mixle_compile.spec import LoadedSpec, load_spec

if TYPE_CHECKING:
    from mixle_compile.spec.source import SourceDocument
    from mixle_compile.verify import Verification
    from mixle_compile.verify.suggest import Suggestion


@dataclass(frozen=True)
class CheckResult:
    file: str
    diagnostics: tuple[Diagnostic, ...] = field(default_factory=tuple)
    unreadable: bool = False
    notes: tuple[str, ...] = ()  # what was proved (elastic ranges), for the text report
    suggestion: "Suggestion | None" = None
    suggestion_sought: bool = False  # --suggest was given and the file had errors

    @property
    def errors(self) -> int:
        return sum(d.severity is Severity.error for d in self.diagnostics)


def check_file(path: str | Path, *, suggest: bool = False, options=None) -> CheckResult:
    """``options``: an :class:`~mixle_compile.importers.ImportOptions` for an engine config."""
    with full_collections_paused():
        return check_loaded(load_spec(path, options=options), suggest=suggest)


def check_loaded(loaded: LoadedSpec, *, suggest: bool = False) -> CheckResult:
    """Verify a loaded spec (the verifier runs only on a spec that loaded cleanly)."""
    diagnostics = list(loaded.diagnostics)
    notes: tuple[str, ...] = ()
    suggestion = None
    sought = False
    if loaded.ok:
        from mixle_compile.verify import suggest_fix, verify_plan

        verification = verify_plan(loaded.spec)
        diagnostics += verification_diagnostics(verification, loaded.document)
        notes = _proof_notes(verification)
        if suggest and any(d.severity is Severity.error for d in diagnostics):
            sought = True
            suggestion = suggest_fix(loaded.spec)
    return CheckResult(
        loaded.file,
        tuple(sorted(diagnostics, key=sort_key)),
        loaded.unreadable,
        notes,
        suggestion,
        sought,
    )


def verification_diagnostics(verification: "Verification", document: "SourceDocument") -> list[Diagnostic]:
    """Findings as diagnostics, each at its first field's file:line:col."""
    out = []
    for finding in verification.findings:
        paths = finding.paths
        first, rest = (paths[0], paths[1:]) if paths else ((), ())
        out.append(
            document.diagnostic(
                finding.code,
                finding.message,
                first,
                hint=finding.hint,
                severity=finding.severity,
                extra_fields=rest,
            )
        )
    proof = verification.elastic
    if proof is not None and not proof.proved:
        out.append(_elastic_diagnostic(proof, document))
    return out


def _range_text(proof) -> str:
    r = proof.world_sizes
    step = f", multiples of {r.multiple_of}" if r.multiple_of > 1 else ""
    return f"{r.min_world_size}..{r.max_world_size}{step}"


def _elastic_diagnostic(proof, document: "SourceDocument") -> Diagnostic:
    if proof.smallest_failure is None:
        return document.diagnostic(
            "D003",
            f"the elastic range {_range_text(proof)} could not be proved valid within the solver's resource limit",
            ("elastic",),
            hint="narrow the range or check the largest and smallest sizes by hand",
            prefer_key=True,
            severity=Severity.warning,
        )
    reasons = "; ".join(f"{b.code} ({b.rule.name}): {b.message}" for b in proof.broken)
    exact = "the smallest failing world size" if proof.decided else "a failing world size"
    w = proof.smallest_failure
    hint = (
        f"keep {w} out of the range: raise min_world_size above it, lower max_world_size below it, "
        "or choose a multiple_of that skips it"
    )
    fields = tuple(f.path for b in proof.broken for f in b.fields)
    return document.diagnostic(
        "D003",
        f"the elastic range {_range_text(proof)} is not valid throughout: {proof.smallest_failure} is {exact}, "
        f"where {reasons}",
        ("elastic",),
        hint=hint,
        prefer_key=True,
        extra_fields=tuple(dict.fromkeys(fields)),
    )


def _proof_notes(verification: "Verification") -> tuple[str, ...]:
    proof = verification.elastic
    if proof is None or not proof.proved:
        return ()
    sizes = "its one world size" if proof.sizes == 1 else f"every one of its {proof.sizes} world sizes"
    return (f"elastic range {_range_text(proof)}: proved valid at {sizes}",)


def exit_status(results: list[CheckResult]) -> int:
    """0 clean, 1 violations, 2 unreadable input (which wins: the check could not run)."""
    if any(r.unreadable for r in results):
        return 2
    return 1 if any(r.errors for r in results) else 0

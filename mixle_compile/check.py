"""The `check` pass: load each spec file, verify its plan, collect the diagnostics.

This is the lint path used in pre-commit and CI; it must not import torch. The verifier (and with
it z3) is imported only once a file has loaded cleanly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mixle_compile.diagnostics import Diagnostic, Severity, sort_key
from mixle_compile.spec import LoadedSpec, load_spec

if TYPE_CHECKING:
    from mixle_compile.spec.source import SourceDocument
    from mixle_compile.verify import Verification
    from mixle_compile.importers.suggest import EnginePatch
    from mixle_compile.verify.suggest import Suggestion


@dataclass(frozen=True)
class CheckResult:
    file: str
    diagnostics: tuple[Diagnostic, ...] = field(default_factory=tuple)
    unreadable: bool = False
    notes: tuple[str, ...] = ()  # what was proved (elastic ranges), for the text report
    suggestion: "Suggestion | None" = None
    suggestion_sought: bool = False  # --suggest was given and the file had errors
    # For an engine config: the suggestion as edits of the engine's keys, or why it cannot be said so.
    engine_patch: "EnginePatch | None" = None
    engine_patch_refused: str | None = None

    @property
    def errors(self) -> int:
        return sum(d.severity is Severity.error for d in self.diagnostics)


def check_file(path: str | Path, *, suggest: bool = False, options=None) -> CheckResult:
    """``options``: an :class:`~mixle_compile.importers.ImportOptions` for an engine config."""
    return check_loaded(load_spec(path, options=options), suggest=suggest)


def check_loaded(loaded: LoadedSpec, *, suggest: bool = False) -> CheckResult:
    """Verify a loaded spec (the verifier runs only on a spec that loaded cleanly)."""
    diagnostics = list(loaded.diagnostics)
    notes: tuple[str, ...] = ()
    suggestion = None
    sought = False
    patch, refused = None, None
    if loaded.ok:
        from mixle_compile.verify import suggest_fix, verify_plan

        verification = verify_plan(loaded.spec)
        diagnostics += verification_diagnostics(verification, loaded.document)
        notes = _proof_notes(verification)
        if suggest and any(d.severity is Severity.error for d in diagnostics):
            sought = True
            suggestion = suggest_fix(loaded.spec)
            patch, refused = _engine_patch(loaded, suggestion)
    return CheckResult(
        loaded.file,
        tuple(sorted(diagnostics, key=sort_key)),
        loaded.unreadable,
        notes,
        suggestion,
        sought,
        patch,
        refused,
    )


def _engine_patch(loaded: LoadedSpec, suggestion) -> tuple["EnginePatch | None", str | None]:
    """An engine config's fix in its own keys (none for a spec file, or when nothing is to be changed)."""
    from mixle_compile.importers.suggest import ENGINE_FORMATS, NotExpressible, engine_patch

    doc = loaded.document
    if suggestion is None or not suggestion.changes or doc is None or doc.source_format not in ENGINE_FORMATS:
        return None, None
    try:
        return engine_patch(loaded.spec, suggestion, doc), None
    except NotExpressible as exc:
        return None, str(exc)


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
                hint=finding.hint + _engine_keys_note(paths, document),
                severity=finding.severity,
                extra_fields=rest,
            )
        )
    proof = verification.elastic
    if proof is not None and not proof.proved:
        out.append(_elastic_diagnostic(proof, document))
    return out


def _engine_keys_note(paths, document: "SourceDocument") -> str:
    """For an engine config: which of its keys give the spec fields a finding names (its hint speaks of spec fields)."""
    if document.source_format is None or not document.origins:
        return ""
    named = [f"{'.'.join(str(p) for p in path)} <- {document.origins[tuple(path)]}" for path in paths
             if tuple(path) in document.origins and tuple(path)[0] in ("mesh", "training")]
    return f" (in this file: {'; '.join(named)})" if named else ""


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

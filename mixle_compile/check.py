"""The `check` pass: load each spec file, verify its plan, collect the diagnostics.

This is the lint path used in pre-commit and CI; it must not import torch. The verifier (and with
it z3) is imported only once a file has loaded cleanly.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from mixle_compile.diagnostics import Diagnostic, Severity, group_by_field, sort_key
from mixle_compile.heap import full_collections_paused
from mixle_compile.spec import LoadedSpec, load_spec
from mixle_compile.spec.codes import AUTO_UNRESOLVABLE
from mixle_compile.spec.models import auto_divisor

if TYPE_CHECKING:
    from mixle_compile.config import LintConfig
    from mixle_compile.importers.suggest import EnginePatch
    from mixle_compile.spec.source import SourceDocument
    from mixle_compile.verify import Verification
    from mixle_compile.verify.suggest import Suggestion


@dataclass(frozen=True)
class CheckResult:
    file: str
    diagnostics: tuple[Diagnostic, ...] = field(default_factory=tuple)
    unreadable: bool = False
    notes: tuple[str, ...] = ()  # what was proved (elastic ranges), for the text report
    suggestion: Suggestion | None = None
    suggestion_sought: bool = False  # --suggest was given and the file had errors
    source_format: str | None = None  # the engine a config was imported from; None for a spec
    # For an engine config: the suggestion as edits of the engine's keys, or why it cannot be said so.
    engine_patch: EnginePatch | None = None
    engine_patch_refused: str | None = None

    @property
    def errors(self) -> int:
        return sum(d.severity is Severity.error for d in self.diagnostics)


def check_file(
    path: str | Path, *, suggest: bool = False, options=None, config: LintConfig | None = None
) -> CheckResult:
    """``options``: an :class:`~mixle_compile.importers.ImportOptions` for an engine config;
    ``config``: the rule selection (default: every code, as the file's own comments suppress)."""
    backend = config.backend if config is not None else None
    with full_collections_paused():
        loaded = load_spec(path, options=options, default_backend=backend)
        return check_loaded_file(loaded, path, suggest=suggest, config=config)


def check_loaded_file(
    loaded: LoadedSpec, path: str | Path, *, suggest: bool = False, config: LintConfig | None = None
) -> CheckResult:
    """:func:`check_file` on a spec already loaded from ``path`` (its comments may suppress findings)."""
    return check_loaded(
        loaded, suggest=suggest, config=config, source_text=_comment_text(Path(path)) if loaded.ok else None
    )


def check_text(raw: bytes, name: str, *, suggest: bool = False, config: LintConfig | None = None) -> CheckResult:
    """Check a spec given as bytes (standard input), reported under ``name``."""
    from mixle_compile.spec.load import load_spec_text

    backend = config.backend if config is not None else None
    json_syntax = name.lower().endswith(".json")
    loaded = load_spec_text(raw, name, json_syntax=json_syntax, base=Path(name).parent, default_backend=backend)
    text = None if json_syntax else raw.decode("utf-8", errors="replace")
    return check_loaded(loaded, suggest=suggest, config=config, source_text=text)


def _comment_text(path: Path) -> str | None:
    """The text of a file that can hold `#` comments (and so suppressions); None for JSON."""
    if path.suffix.lower() == ".json":
        return None
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def check_loaded(
    loaded: LoadedSpec,
    *,
    suggest: bool = False,
    config: LintConfig | None = None,
    source_text: str | None = None,
    group: bool = True,
    verifier=None,
) -> CheckResult:
    """Verify a loaded spec (the verifier runs only on a spec that loaded cleanly).

    For a spec that loaded, the file's suppression comments and then the configuration's selection
    apply; a file that did not load reports its load errors as they are (nothing after them was
    checked, so silencing them would pass a file that was never verified). Findings at one field
    are grouped into one. ``verifier``: a :class:`~mixle_compile.verify.engine.PlanVerifier` to
    reuse across many specs of one shape.
    """
    from mixle_compile.config import LintConfig, apply_suppressions, select

    config = config or LintConfig()
    diagnostics = list(loaded.diagnostics)
    notes: tuple[str, ...] = ()
    suggestion = None
    sought = False
    patch, refused = None, None
    if loaded.ok:
        from mixle_compile.verify import verify_plan

        verification = verify_plan(loaded.spec, verifier)
        diagnostics += verification_diagnostics(verification, loaded.document)
        notes = _proof_notes(verification)
        diagnostics = apply_suppressions(diagnostics, source_text, loaded.file, report_unused=True)
        diagnostics = select(diagnostics, config, loaded.file)
    if loaded.unresolved is not None:
        diagnostics = [
            replace(d, hint=_auto_hint(loaded.unresolved)) if d.code == AUTO_UNRESOLVABLE.code else d
            for d in diagnostics
        ]
    searchable = loaded.spec or loaded.unresolved
    if suggest and searchable is not None and any(d.severity is Severity.error for d in diagnostics):
        from mixle_compile.verify import suggest_fix

        sought = True
        suggestion = with_progress(
            f"{loaded.file}: searching for the nearest valid plan", lambda: suggest_fix(searchable)
        )
        if loaded.spec is not None and suggestion is not None:
            patch, refused = _engine_patch(loaded, suggestion)
    return CheckResult(
        loaded.file,
        tuple((group_by_field if group else list)(sorted(diagnostics, key=sort_key))),
        loaded.unreadable,
        notes,
        suggestion,
        sought,
        loaded.document.source_format if loaded.document is not None else None,
        patch,
        refused,
    )


PROGRESS_AFTER = 1.0  # seconds: a search that takes longer says so on standard error


def with_progress(label: str, work):
    """Run ``work``; when it takes longer than PROGRESS_AFTER, say so on standard error (and when it ends)."""
    import sys
    import threading
    import time

    started = time.monotonic()
    shown = threading.Event()

    def announce() -> None:
        print(f"{label}...", file=sys.stderr, flush=True)
        shown.set()

    timer = threading.Timer(PROGRESS_AFTER, announce)
    timer.daemon = True
    timer.start()
    try:
        return work()
    finally:
        timer.cancel()
        if shown.is_set():
            print(f"{label}: done in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)


def _engine_patch(loaded: LoadedSpec, suggestion) -> tuple[EnginePatch | None, str | None]:
    """An engine config's fix in its own keys (none for a spec file, or when nothing is to be changed)."""
    from mixle_compile.importers.suggest import ENGINE_FORMATS, NotExpressible, engine_patch

    doc = loaded.document
    if suggestion is None or not suggestion.changes or doc is None or doc.source_format not in ENGINE_FORMATS:
        return None, None
    try:
        return engine_patch(loaded.spec, suggestion, doc), None
    except NotExpressible as exc:
        return None, str(exc)


def verification_diagnostics(verification: Verification, document: SourceDocument) -> list[Diagnostic]:
    """Findings as diagnostics, each at its first field's file:line:col.

    An error's hint is stated in its first field (the one the finding points at) and offers only
    values that break no error rule, the other fields as they are, so that the hints of several
    findings at one field agree (each rule alone would offer what another refuses)."""
    out = []
    agreed: dict[str, str | None] = {}
    for finding in verification.findings:
        paths = finding.paths
        first, rest = (paths[0], paths[1:]) if paths else ((), ())
        hint = finding.hint
        if finding.severity is Severity.error and finding.fields:
            symbol = finding.fields[0].symbol
            if symbol not in agreed:
                agreed[symbol] = _agreed_hint(verification.facts, finding.fields[0])
            hint = agreed[symbol] or hint
        out.append(
            document.diagnostic(
                finding.code,
                finding.message,
                first,
                hint=hint + _engine_keys_note(paths, document),
                severity=finding.severity,
                extra_fields=rest,
            )
        )
    proof = verification.elastic
    if proof is not None and not proof.proved:
        out.append(_elastic_diagnostic(proof, document))
    return out


MAX_OFFERED = 6


def _auto_hint(spec) -> str:
    """S012's hint for a spec whose only error it is: the single changes (a degree, or the device
    count) that resolve `dp_shard: auto` and break no error rule, the other fields as they are."""
    from mixle_compile.verify import plan_facts
    from mixle_compile.verify.suggest import passing_values

    facts = plan_facts(spec)
    options = []
    for symbol in ("tp", "pp", "cp", "dp_replicate"):
        values = passing_values(facts, symbol)
        if values:
            options.append(f"mesh.{symbol}: {_either(_nearest(values, facts.value(symbol)))}")
    devices = facts.value("devices")
    mesh = spec.mesh
    product = auto_divisor(dp_replicate=mesh.dp_replicate, tp=mesh.tp, pp=mesh.pp, cp=mesh.cp)
    near = sorted({max(product, devices // product * product), (devices // product + 1) * product})
    counts = passing_values(facts, "devices", near) if isinstance(spec.resources.devices, int) else None
    if counts:
        options.append(f"{_either(counts)} devices")
    if not options:
        return (
            "no single change of tp, pp, cp, dp_replicate or the device count resolves it and passes every rule: "
            "`mixle-compile check --suggest` searches changes of several settings"
        )
    return "what passes every rule, the other fields as they are: " + "; ".join(options)


def _nearest(values: list[str], current: int) -> list[str]:
    if len(values) <= MAX_OFFERED:
        return values
    return sorted(sorted(values, key=lambda v: (abs(int(v) - current), int(v)))[:MAX_OFFERED], key=int)


def _either(values: list[str]) -> str:
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + f" or {values[-1]}"


def _agreed_hint(facts, field) -> str | None:
    """The values of ``field`` that pass every error rule, as a hint; None where a fix may not
    change the field (the model, the devices: the rule's own hint stands)."""
    from mixle_compile.verify.suggest import passing_values

    values = passing_values(facts, field.symbol)
    if values is None:
        return None
    name = field.dotted
    if not values:
        return (
            f"no other value of {name} alone passes every rule (the other fields as they are): change it together "
            "with another; `mixle-compile check --suggest` finds the nearest valid plan"
        )
    if field.kind == "int" and len(values) > MAX_OFFERED:
        nearest = sorted(values, key=lambda v: (abs(int(v) - int(field.value)), int(v)))[:MAX_OFFERED]
        values = sorted(nearest, key=int)
    if len(values) == 1:
        return f"set {name} to {values[0]}: the one value that passes every rule with the other fields as they are"
    shown = ", ".join(values[:-1]) + f" or {values[-1]}"
    return f"set {name} to {shown}: each passes every rule with the other fields as they are"


def _engine_keys_note(paths, document: SourceDocument) -> str:
    """For an engine config: which of its keys give the spec fields a finding names (its hint speaks of spec fields)."""
    if document.source_format is None or not document.origins:
        return ""
    named = [
        f"{'.'.join(str(p) for p in path)} <- {document.origins[tuple(path)]}"
        for path in paths
        if tuple(path) in document.origins and tuple(path)[0] in ("mesh", "training")
    ]
    return f" (in this file: {'; '.join(named)})" if named else ""


def _range_text(proof) -> str:
    r = proof.world_sizes
    step = f", multiples of {r.multiple_of}" if r.multiple_of > 1 else ""
    return f"{r.min_world_size}..{r.max_world_size}{step}"


def _elastic_diagnostic(proof, document: SourceDocument) -> Diagnostic:
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


def _proof_notes(verification: Verification) -> tuple[str, ...]:
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

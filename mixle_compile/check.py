"""The `check` pass: load each spec file and collect its diagnostics.

This is the lint path used in pre-commit and CI; it must not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mixle_compile.diagnostics import Diagnostic, Severity, sort_key
from mixle_compile.spec import LoadedSpec, load_spec


@dataclass(frozen=True)
class CheckResult:
    file: str
    diagnostics: tuple[Diagnostic, ...] = field(default_factory=tuple)
    unreadable: bool = False

    @property
    def errors(self) -> int:
        return sum(d.severity is Severity.error for d in self.diagnostics)


def check_file(path: str | Path) -> CheckResult:
    loaded: LoadedSpec = load_spec(path)
    return CheckResult(loaded.file, tuple(sorted(loaded.diagnostics, key=sort_key)), loaded.unreadable)


def exit_status(results: list[CheckResult]) -> int:
    """0 clean, 1 violations, 2 unreadable input (which wins: the check could not run)."""
    if any(r.unreadable for r in results):
        return 2
    return 1 if any(r.errors for r in results) else 0

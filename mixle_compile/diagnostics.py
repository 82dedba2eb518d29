"""Diagnostics: what is wrong, where (file:line:col and field paths), and how to fix it.

Every code that any pass can report is documented in :data:`CATALOGUE` next to where it is
checked; ``Code`` entries are registered by the module that owns them. Codes are stable: once
published, a code keeps its meaning forever.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Severity(str, Enum):
    error = "error"
    warning = "warning"


@dataclass(frozen=True)
class Diagnostic:
    code: str
    severity: Severity
    message: str
    hint: str
    file: str
    line: int
    column: int
    fields: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return {
            "code": self.code,
            "severity": self.severity.value,
            "message": self.message,
            "hint": self.hint,
            "file": self.file,
            "line": self.line,
            "column": self.column,
            "fields": list(self.fields),
        }

    def text(self) -> str:
        """ruff/mypy style: ``file:line:col: CODE message`` and an indented fix hint."""
        head = f"{self.file}:{self.line}:{self.column}: {self.code} "
        if self.severity is Severity.warning:
            head += "(warning) "
        out = head + self.message
        if self.hint:
            out += f"\n  hint: {self.hint}"
        return out


@dataclass(frozen=True)
class Code:
    """Documentation of one diagnostic code."""

    code: str
    title: str
    summary: str
    docs: str
    severity: Severity = Severity.error
    engine_reference: str = ""  # the engine documentation or issue that motivates the rule


CATALOGUE: dict[str, Code] = {}


def register_code(entry: Code) -> Code:
    existing = CATALOGUE.get(entry.code)
    if existing is not None and existing != entry:
        raise ValueError(f"diagnostic code {entry.code} is registered twice with different meanings")
    CATALOGUE[entry.code] = entry
    return entry


def sort_key(d: Diagnostic) -> tuple:
    return (d.file, d.line, d.column, d.code, d.message)

"""Diagnostics: what is wrong, where (file:line:col and field paths), and how to fix it.

Every code that any pass can report is documented in :data:`CATALOGUE` next to where it is
checked; ``Code`` entries are registered by the module that owns them. Codes are stable: once
published, a code keeps its meaning forever.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum


class Severity(str, Enum):  # noqa: UP042  (StrEnum would change str() of a member from "Severity.error" to "error")
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
    # Findings caused by the same field at the same place, reported under this one (see
    # :func:`group_by_field`): one mistake, one finding.
    related: tuple[Diagnostic, ...] = ()

    def as_dict(self) -> dict:
        out = {
            "code": self.code,
            "severity": self.severity.value,
            "message": self.message,
            "hint": self.hint,
            "file": self.file,
            "line": self.line,
            "column": self.column,
            "fields": list(self.fields),
        }
        out["related"] = [r.as_dict() for r in self.related]
        return out

    def text(self) -> str:
        """ruff/mypy style: ``file:line:col: CODE message`` and an indented fix hint."""
        head = f"{self.file}:{self.line}:{self.column}: {self.code} "
        if self.severity is Severity.warning:
            head += "(warning) "
        out = head + self.message
        for r in self.related:
            out += f"\n  also: {r.code} {r.message}"
            if r.hint and r.hint != self.hint:  # a hint of its own (hints stated in one field agree)
                out += f"\n    hint: {r.hint}"
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


def group_by_field(diagnostics: list[Diagnostic]) -> list[Diagnostic]:
    """One finding per mistake: diagnostics at the same place whose first field is the same (``tp: 3``
    breaking the device count and four shape rules) become one, the first error in code order,
    with the others as its related notes. Diagnostics without a field stay as they are."""
    groups: dict[tuple, list[Diagnostic]] = {}
    order: list[tuple | Diagnostic] = []
    for d in diagnostics:
        if not d.fields:
            order.append(d)
            continue
        key = (d.file, d.line, d.column, d.fields[0])
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(d)
    result = []
    for entry in order:
        if isinstance(entry, Diagnostic):
            result.append(entry)
            continue
        members = sorted(groups[entry], key=lambda m: (m.severity is not Severity.error, m.code, m.message))
        primary, rest = members[0], tuple(members[1:])
        result.append(replace(primary, related=primary.related + rest) if rest else primary)
    return result

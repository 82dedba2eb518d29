"""SARIF 2.1.0 output for `check --format sarif`, so CI shows findings as inline annotations.

Rule ids are the stable diagnostic codes; every code that can appear is described in
tool.driver.rules from the catalogue, with a helpUri to its entry in docs/rules.md; each result
carries a physical location (the spec file, relative to the working directory as `%SRCROOT%` when
it lies inside it, percent-encoded; the region from the finding's line and column to the end of
the value there), the findings grouped under it as related locations, and, where `--suggest`
found an edit the file can take, that edit as a SARIF fix. tests/test_sarif.py validates the log
against the official schema (OASIS SARIF 2.1.0, errata 01).
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from urllib.parse import quote

from mixle_compile import __version__
from mixle_compile.diagnostics import CATALOGUE, Diagnostic, Severity

SARIF_SCHEMA = "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"
INFORMATION_URI = "https://github.com/mixle-compile/mixle-compile"
RULES_DOC = f"{INFORMATION_URI}/blob/main/docs/rules.md"
SRCROOT = "%SRCROOT%"


def _location(file: str) -> dict:
    path = Path(file)
    try:
        relative = path.resolve().relative_to(Path.cwd().resolve())
    except (ValueError, OSError):
        return {"uri": path.resolve().as_uri()}  # as_uri percent-encodes
    return {"uri": quote(relative.as_posix()), "uriBaseId": SRCROOT}


def help_uri(code: str) -> str:
    """The rule's section in docs/rules.md (GitHub's anchor of `### CODE title`)."""
    entry = CATALOGUE.get(code)
    anchor = code.lower() + (f"-{entry.title}" if entry else "")
    return f"{RULES_DOC}#{anchor}"


_PLAIN = r"(?:[^,}\]\s#:]|:(?!\s|$))+"  # a plain scalar's characters (a key ends at `: `)
_VALUE_END = re.compile(rf"""("(?:[^"\\]|\\.)*"|'(?:[^']|'')*'|{_PLAIN}(?:[ \t]+{_PLAIN})*)""")


def _end_column(lines: list[str] | None, line: int, column: int) -> int:
    """One past the last character of the token at (line, column): a key, a scalar or a quoted string."""
    if not lines or not 1 <= line <= len(lines):
        return column + 1
    text = lines[line - 1]
    match = _VALUE_END.match(text, column - 1)
    if not match or match.end() <= column - 1:
        return column + 1
    return match.end() + 1


def _region(d: Diagnostic, sources: dict[str, list[str] | None]) -> dict:
    if d.file not in sources:
        try:
            sources[d.file] = Path(d.file).read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            sources[d.file] = None
    return {
        "startLine": d.line,
        "startColumn": d.column,
        "endLine": d.line,
        "endColumn": _end_column(sources[d.file], d.line, d.column),
    }


def _replacements(before: str, after: str) -> list[dict]:
    """The edit from ``before`` to ``after`` as SARIF replacements, by character offset."""
    a, b = before.splitlines(keepends=True), after.splitlines(keepends=True)
    starts = [0]
    for line in a:
        starts.append(starts[-1] + len(line))
    out = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        out.append(
            {
                "deletedRegion": {"charOffset": starts[i1], "charLength": starts[i2] - starts[i1]},
                "insertedContent": {"text": "".join(b[j1:j2])},
            }
        )
    return out


def sarif_log(diagnostics: list[Diagnostic], fixes: dict[str, tuple] | None = None) -> dict:
    """``fixes``: per file, (text before, text after, ...) of the edit `--fix` would make."""
    fixes = fixes or {}
    used = sorted({d.code for d in diagnostics} | {r.code for d in diagnostics for r in d.related} | set(CATALOGUE))
    index = {code: i for i, code in enumerate(used)}
    rules = []
    for code in used:
        entry = CATALOGUE.get(code)
        rules.append(
            {
                "id": code,
                "name": entry.title if entry else code,
                "shortDescription": {"text": entry.summary if entry else code},
                "fullDescription": {"text": entry.docs if entry else code},
                "help": {"text": entry.docs if entry else code},
                "helpUri": help_uri(code),
                "defaultConfiguration": {
                    "level": "warning" if entry and entry.severity is Severity.warning else "error"
                },
            }
        )
    sources: dict[str, list[str] | None] = {}
    results = []
    for d in diagnostics:
        message = d.message + (f" (hint: {d.hint})" if d.hint else "")
        if d.related:
            message += " Also: " + "; ".join(f"{r.code} {r.message}" for r in d.related)
        artifact = _location(d.file)
        result = {
            "ruleId": d.code,
            "ruleIndex": index[d.code],
            "level": "warning" if d.severity is Severity.warning else "error",
            "message": {"text": message},
            "locations": [
                {
                    "physicalLocation": {"artifactLocation": artifact, "region": _region(d, sources)},
                    "logicalLocations": [{"fullyQualifiedName": f, "kind": "member"} for f in d.fields],
                }
            ],
        }
        if d.related:
            result["relatedLocations"] = [
                {
                    "id": i,
                    "message": {"text": f"{r.code} {r.message}"},
                    "physicalLocation": {"artifactLocation": _location(r.file), "region": _region(r, sources)},
                }
                for i, r in enumerate(d.related)
            ]
        if d.file in fixes and d.severity is Severity.error:
            before, after = fixes[d.file][0], fixes[d.file][1]
            result["fixes"] = [
                {
                    "description": {"text": "the nearest valid plan on the same devices (mixle-compile check --fix)"},
                    "artifactChanges": [{"artifactLocation": artifact, "replacements": _replacements(before, after)}],
                }
            ]
        results.append(result)
    return {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "mixle-compile",
                        "version": __version__,
                        "informationUri": INFORMATION_URI,
                        "rules": rules,
                    }
                },
                "originalUriBaseIds": {SRCROOT: {"uri": Path.cwd().resolve().as_uri() + "/"}},
                "results": results,
            }
        ],
    }

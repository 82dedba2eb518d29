"""SARIF 2.1.0 output for `check --format sarif`, so CI shows findings as inline annotations.

Rule ids are the stable diagnostic codes; every code that can appear is described in
tool.driver.rules from the catalogue; each result carries a physical location (the spec file,
line and column, relative to the working directory when it lies inside it).
"""

from __future__ import annotations

from pathlib import Path

from mixle_compile import __version__
from mixle_compile.diagnostics import CATALOGUE, Diagnostic, Severity

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
INFORMATION_URI = "https://github.com/mixle-compile/mixle-compile"


def _uri(file: str) -> str:
    path = Path(file)
    try:
        path = path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return path.resolve().as_uri()
    return path.as_posix()


def sarif_log(diagnostics: list[Diagnostic]) -> dict:
    used = sorted({d.code for d in diagnostics} | set(CATALOGUE))
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
                "defaultConfiguration": {"level": "warning" if entry and entry.severity is Severity.warning else "error"},
            }
        )
    results = []
    for d in diagnostics:
        message = d.message + (f" (hint: {d.hint})" if d.hint else "")
        results.append(
            {
                "ruleId": d.code,
                "ruleIndex": index[d.code],
                "level": "warning" if d.severity is Severity.warning else "error",
                "message": {"text": message},
                "locations": [
                    {
                        "physicalLocation": {
                            "artifactLocation": {"uri": _uri(d.file)},
                            "region": {"startLine": d.line, "startColumn": d.column},
                        },
                        "logicalLocations": [{"fullyQualifiedName": f, "kind": "member"} for f in d.fields],
                    }
                ],
            }
        )
    return {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {"driver": {"name": "mixle-compile", "version": __version__, "informationUri": INFORMATION_URI, "rules": rules}},
                "results": results,
            }
        ],
    }

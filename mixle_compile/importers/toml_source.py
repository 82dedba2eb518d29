"""TOML with the position of every key: values from the standard library's ``tomllib`` (a complete,
maintained TOML 1.0 parser), positions from a scan of the same text for table headers and
``key = value`` lines. A syntax error is reported at tomllib's line and column."""

from __future__ import annotations

import re
import tomllib

from mixle_compile.diagnostics import Diagnostic, Severity
from mixle_compile.spec.source import Path_, Position, SourceDocument, SourceError

_HEADER = re.compile(r"^(\s*)\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY = re.compile(r"^(\s*)((?:[A-Za-z0-9_\-]+|\"[^\"]*\"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_\-]+|\"[^\"]*\"|'[^']*'))*)\s*=\s*")
_ERROR_AT = re.compile(r"\(at line (\d+), column (\d+)\)")


def _parts(dotted: str) -> tuple[str, ...]:
    return tuple(p.strip().strip("\"'") for p in re.findall(r"\"[^\"]*\"|'[^']*'|[^.]+", dotted))


def read_toml(text: str, name: str) -> SourceDocument:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        m = _ERROR_AT.search(str(exc))
        line, col = (int(m.group(1)), int(m.group(2))) if m else (1, 1)
        message = _ERROR_AT.sub("", str(exc)).strip()
        raise SourceError([Diagnostic("S001", Severity.error, f"invalid TOML: {message}", "fix the TOML syntax at this position",
                                      name, line, col, ())], unreadable=True)
    doc = SourceDocument(file=name, data=data)
    table: Path_ = ()
    in_multiline = None
    for number, line in enumerate(text.splitlines(), start=1):
        if in_multiline:
            if in_multiline in line:
                in_multiline = None
            continue
        h = _HEADER.match(line)
        if h and not _KEY.match(line):
            table = _parts(h.group(2))
            doc.keys.setdefault(table, Position(number, len(h.group(1)) + 1))
            continue
        k = _KEY.match(line)
        if k:
            path = (*table, *_parts(k.group(2)))
            doc.keys[path] = Position(number, len(k.group(1)) + 1)
            doc.values[path] = Position(number, k.end() + 1)
            rest = line[k.end():]
            for quote in ('"""', "'''"):
                if rest.startswith(quote) and rest.count(quote) == 1:
                    in_multiline = quote
    return doc

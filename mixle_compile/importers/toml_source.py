"""TOML with the position of every key: values from the standard library's ``tomllib`` (a complete,
maintained TOML 1.0 parser), positions from a scan of the same text for table headers and
``key = value`` lines. A syntax error is reported at tomllib's line and column.

No maintained Python TOML parser gives the positions of parsed keys: tomllib and rtoml return plain
values, and tomlkit keeps comments and layout for round-tripping but not line numbers (the request for them,
python-poetry/tomlkit#55, "Get the line and column numbers of parsed elements", is open). The scan
only has to find where each key tomllib read is written: it follows multi-line arrays and inline
tables by their brackets and multi-line strings by their delimiters, skipping strings and comments,
so that an array on its own line inside an array, or ``[table]`` and ``key = value`` inside a string,
are not taken for headers or keys.
"""

from __future__ import annotations

import re
import tomllib

from mixle_compile.diagnostics import Diagnostic, Severity
from mixle_compile.spec.source import Path_, Position, SourceDocument, SourceError

_HEADER = re.compile(r"^(\s*)\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY = re.compile(
    r"^(\s*)((?:[A-Za-z0-9_\-]+|\"[^\"]*\"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_\-]+|\"[^\"]*\"|'[^']*'))*)\s*=\s*"
)
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
        raise SourceError(
            [
                Diagnostic(
                    "S001",
                    Severity.error,
                    f"invalid TOML: {message}",
                    "fix the TOML syntax at this position",
                    name,
                    line,
                    col,
                    (),
                )
            ],
            unreadable=True,
        ) from exc
    doc = SourceDocument(file=name, data=data)
    table: Path_ = ()
    state = _ValueState()
    for number, line in enumerate(text.splitlines(), start=1):
        if state.open:  # inside a multi-line array or string: no header or key starts on this line
            state.scan(line)
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
            state.scan(line[k.end() :])
    return doc


_ML_BASIC, _ML_LITERAL = '"' * 3, "'" * 3


class _ValueState:
    """Where a value's text stands at the end of a line: inside a multi-line string (its delimiter) and how
    many arrays or inline tables are open. Strings and comments are skipped, so a bracket or an ``=`` in
    them counts for nothing."""

    def __init__(self) -> None:
        self.string: str | None = None  # the delimiter while a multi-line string is open
        self.depth = 0

    @property
    def open(self) -> bool:
        return self.string is not None or self.depth > 0

    def scan(self, text: str) -> None:
        i, n = 0, len(text)
        while i < n:
            if self.string is not None:
                end = text.find(self.string, i)
                while end != -1 and self.string == _ML_BASIC and _escaped(text, end):
                    end = text.find(self.string, end + 1)
                if end == -1:
                    return
                i = end + 3
                while i < n and text[i] == self.string[0]:  # up to two quotes of the content may precede the end
                    i += 1
                self.string = None
                continue
            ch = text[i]
            if ch == "#":
                return
            if text.startswith(_ML_BASIC, i) or text.startswith(_ML_LITERAL, i):
                self.string = text[i : i + 3]
                i += 3
                continue
            if ch in "\"'":
                j = i + 1
                while j < n and text[j] != ch:
                    j += 2 if ch == '"' and text[j] == "\\" else 1
                i = j + 1
                continue
            if ch in "[{":
                self.depth += 1
            elif ch in "]}":
                self.depth = max(0, self.depth - 1)
            i += 1


def _escaped(text: str, at: int) -> bool:
    backslashes = 0
    while at - backslashes - 1 >= 0 and text[at - backslashes - 1] == "\\":
        backslashes += 1
    return backslashes % 2 == 1

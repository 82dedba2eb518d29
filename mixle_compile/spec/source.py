"""Reading spec files into plain data while keeping where every value came from.

Both readers (YAML and JSON) return a :class:`SourceDocument`: the parsed data (dicts, lists
and scalars only) and a map from each value's path to its line and column, so that every later
diagnostic can point at ``file:line:col``.  They refuse what a config file should never contain:
duplicate keys (a silent override is a classic config bug), non-string keys, runaway alias
expansion, excessive nesting and oversized input.
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixle_compile.diagnostics import Diagnostic, Severity

Path_ = tuple[str | int, ...]

# Limits that keep a hostile or broken file from exhausting time or memory. A `modules` spec of
# 100,000 tensors is about 10 MiB of YAML or indented JSON and 800,000 values, so both limits
# leave room above that; an alias bomb (anchors referencing anchors, growing exponentially) is
# measured on the composed node graph before anything is built, so it is refused in the time it
# takes to read its few lines.
MAX_INPUT_BYTES = 64 * 1024 * 1024
MAX_DEPTH = 64
MAX_NODES = 4_000_000  # values after alias expansion


@dataclass(frozen=True, slots=True)  # one per value and key of a spec: 56 bytes each with slots, ~350 without
class Position:
    line: int  # 1-based
    column: int  # 1-based
    file: str | None = None  # another file than the document's (a shell file the script sources)


@dataclass
class SourceDocument:
    """Parsed data plus the source position of every value and mapping key."""

    file: str
    data: Any = None
    values: dict[Path_, Position] = field(default_factory=dict)
    keys: dict[Path_, Position] = field(default_factory=dict)
    # For a file read by an importer: its format, and which engine key gave each spec field.
    source_format: str | None = None
    origins: dict[Path_, str] = field(default_factory=dict)
    # ... and where each engine key it read sits (``parallelism.tensor_parallel_degree``, ``--seq-length``).
    engine_keys: dict[str, Position] = field(default_factory=dict)

    def position(self, path: Path_, *, prefer_key: bool = False) -> Position:
        """The closest known position for ``path`` (walking up to a parent when unknown)."""
        path = tuple(path)
        while True:
            if prefer_key and path in self.keys:
                return self.keys[path]
            if path in self.values:
                return self.values[path]
            if path in self.keys:
                return self.keys[path]
            if not path:
                return Position(1, 1)
            path = path[:-1]

    def diagnostic(
        self,
        code: str,
        message: str,
        path: Path_ = (),
        *,
        hint: str = "",
        prefer_key: bool = False,
        severity: Severity = Severity.error,
        extra_fields: tuple[Path_, ...] = (),
    ) -> Diagnostic:
        pos = self.position(path, prefer_key=prefer_key)
        fields = tuple(dotted(p) for p in (path, *extra_fields) if p)
        return Diagnostic(
            code=code,
            severity=severity,
            message=message,
            hint=hint,
            file=pos.file or self.file,
            line=pos.line,
            column=pos.column,
            fields=fields,
        )


def dotted(path: Path_) -> str:
    """``("model", "parameters", 3, "shape")`` -> ``model.parameters[3].shape``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


class SourceError(Exception):
    """A file that could not be turned into data; carries its diagnostics."""

    def __init__(self, diagnostics: list[Diagnostic], *, unreadable: bool = False):
        super().__init__("; ".join(d.message for d in diagnostics))
        self.diagnostics = diagnostics
        self.unreadable = unreadable  # True: exit code 2 (could not read), else 1


def read_source(path: str | Path, *, display_name: str | None = None) -> tuple[SourceDocument, list[Diagnostic]]:
    """Read a spec file. Raises SourceError when nothing usable comes out of it.

    Returns the document and non-fatal diagnostics (duplicate keys: reported, last one kept so
    that validation can still go on and report everything in one pass).
    """
    name = display_name or str(path)
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise SourceError(
            [_file_diag(name, "S011", f"file not found: {name}", "check the path")], unreadable=True
        ) from None
    except IsADirectoryError:
        raise SourceError(
            [_file_diag(name, "S011", f"{name} is a directory, not a spec file", "pass a .yaml, .yml or .json file")],
            unreadable=True,
        ) from None
    except OSError as exc:
        raise SourceError(
            [_file_diag(name, "S011", f"cannot read {name}: {exc.strerror}", "check the file's permissions")],
            unreadable=True,
        ) from exc
    return parse_source(raw, name, json_syntax=p.suffix.lower() == ".json")


def parse_source(raw: bytes, name: str, *, json_syntax: bool) -> tuple[SourceDocument, list[Diagnostic]]:
    if len(raw) > MAX_INPUT_BYTES:
        raise SourceError(
            [
                _file_diag(
                    name,
                    "S010",
                    f"{name} is {len(raw):,} bytes; spec files are limited to {MAX_INPUT_BYTES:,} bytes",
                    "a spec describes a model and a mesh; move bulk data into a data file",
                )
            ],
            unreadable=True,
        )
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise SourceError(
            [
                Diagnostic(
                    code="S011",
                    severity=Severity.error,
                    message=f"{name} is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})",
                    hint="save the file as UTF-8",
                    file=name,
                    line=line,
                    column=col,
                    fields=(),
                )
            ],
            unreadable=True,
        ) from exc
    doc = SourceDocument(file=name)
    reader = _JsonReader(text, doc) if json_syntax else _YamlReader(text, doc)
    doc.data = reader.read()
    return doc, reader.diagnostics


def _file_diag(name: str, code: str, message: str, hint: str) -> Diagnostic:
    return Diagnostic(
        code=code, severity=Severity.error, message=message, hint=hint, file=name, line=1, column=1, fields=()
    )


class _Reader:
    """Shared bookkeeping of both readers: positions, limits, duplicate keys."""

    syntax = ""

    def __init__(self, text: str, doc: SourceDocument):
        self.text = text
        self.doc = doc
        self.diagnostics: list[Diagnostic] = []
        self.nodes = 0

    def fail(self, code: str, message: str, line: int, column: int, hint: str, path: Path_ = ()) -> SourceError:
        return SourceError(
            [
                Diagnostic(
                    code=code,
                    severity=Severity.error,
                    message=message,
                    hint=hint,
                    file=self.doc.file,
                    line=line,
                    column=column,
                    fields=(dotted(path),) if path else (),
                )
            ]
        )

    def enter(self, path: Path_, pos: Position) -> None:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise self.fail(
                "S010",
                f"the document expands to more than {MAX_NODES:,} values (an alias bomb or a runaway file)",
                pos.line,
                pos.column,
                "remove the repeated aliases; a spec needs far fewer values",
                path,
            )
        if len(path) > MAX_DEPTH:
            raise self.fail(
                "S010",
                f"nesting deeper than {MAX_DEPTH} levels at {dotted(path)}",
                pos.line,
                pos.column,
                "flatten the structure; use `shared:` and `ref:` for repeated subtrees",
                path,
            )
        self.doc.values.setdefault(path, pos)

    def add_key(self, mapping: dict, key: Any, path: Path_, pos: Position, first_seen: dict) -> None:
        if not isinstance(key, str):
            shown = "true/false" if isinstance(key, bool) else repr(key)
            hint = "quote the key"
            if isinstance(key, bool):
                hint = "YAML reads unquoted yes/no/on/off/true/false keys as booleans; quote the key"
            raise self.fail(
                "S004",
                f"mapping keys must be strings, got {shown} at {dotted(path) or 'top level'}",
                pos.line,
                pos.column,
                hint,
                path,
            )
        child = (*path, key)
        if key in first_seen:
            first = first_seen[key]
            self.diagnostics.append(
                Diagnostic(
                    code="S002",
                    severity=Severity.error,
                    message=f"duplicate key `{dotted(child)}` (first defined at line {first.line}); the later "
                    "value would silently win",
                    hint="keep one definition of the key",
                    file=self.doc.file,
                    line=pos.line,
                    column=pos.column,
                    fields=(dotted(child),),
                )
            )
            # The later value is the one kept; forget positions of the earlier subtree (a scalar
            # has only its own: no walk over every position for each duplicate of one).
            if isinstance(mapping.get(key), (dict, list)):
                for known in [k for k in self.doc.values if k[: len(child)] == child]:
                    del self.doc.values[known]
            else:
                self.doc.values.pop(child, None)
        first_seen[key] = pos
        self.doc.keys[child] = pos


def compose_yaml(text: str, file: str, *, unreadable: bool = False) -> Any:
    """The YAML node graph of ``text`` (None for an empty document), or SourceError: S001 where the
    syntax breaks, S010 where it nests too deeply (``unreadable``: exit 2, as for an engine config).
    Aliases are not expanded here (the node graph shares them)."""
    import yaml

    def fail(code: str, message: str, line: int, column: int, hint: str) -> SourceError:
        diagnostic = Diagnostic(code, Severity.error, message, hint, file, line, column, ())
        return SourceError([diagnostic], unreadable=unreadable)

    # libyaml's composer is several times faster and refuses runaway nesting itself.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        return yaml.compose(text, Loader=loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        problem = exc.problem or exc.context or "invalid YAML"
        raise fail("S001", f"invalid YAML: {problem}", line, col, "fix the YAML syntax at this position") from exc
    except yaml.YAMLError as exc:
        raise fail("S001", f"invalid YAML: {exc}", 1, 1, "fix the YAML syntax") from exc
    except RecursionError:
        raise fail("S010", "the document nests too deeply to read", 1, 1, "flatten the structure") from None


class _YamlReader(_Reader):
    def read(self) -> Any:
        import yaml

        node = compose_yaml(self.text, self.doc.file)
        if node is None:
            return None
        self._refuse_alias_expansion(node, yaml)
        self._constructor = yaml.SafeLoader("")
        self._yaml = yaml
        return self._build(node, ())

    def _refuse_alias_expansion(self, root: Any, yaml: Any) -> None:
        """Count the values the document expands to before building it, and refuse past ``MAX_NODES``.

        An alias is the anchored node object itself, reused: the composed graph stays as small as
        the text while its expansion can grow exponentially. Each distinct node's expanded size is
        computed once (children first), so this costs the size of the graph, not of its expansion.
        The error names the anchor whose repeated expansion contributes the most values.
        """
        if "&" not in self.text:
            return  # no anchor, so no alias: the expansion is the text itself
        size: dict[int, int] = {}
        uses: dict[int, int] = {}
        nodes: dict[int, Any] = {}
        mapping, sequence = yaml.MappingNode, yaml.SequenceNode
        pending = -1  # the size of a node whose children are being counted

        def count(node: Any, depth: int) -> int:
            key = id(node)
            uses[key] = uses.get(key, 0) + 1
            known = size.get(key)
            if known is not None:
                if known == pending:
                    mark = node.start_mark
                    raise self.fail(
                        "S010",
                        "a YAML alias refers to an anchor that contains it (the document would be infinite)",
                        mark.line + 1,
                        mark.column + 1,
                        "remove the alias from inside its own anchor",
                    )
                return known
            if depth > MAX_DEPTH:
                return 1  # the build refuses the nesting, with its path
            nodes[key] = node
            size[key] = pending
            total = 1
            if isinstance(node, mapping):
                for _, child in node.value:
                    total += count(child, depth + 1)
            elif isinstance(node, sequence):
                for child in node.value:
                    total += count(child, depth + 1)
            size[key] = total
            return total

        count(root, 0)
        total = size[id(root)]
        if total <= MAX_NODES:
            return
        shared = [k for k, n in uses.items() if n > 1]
        worst = max(shared, key=lambda k: (uses[k] - 1) * size[k], default=id(root))
        mark = nodes[worst].start_mark
        where = (
            f"; the anchor at line {mark.line + 1}, column {mark.column + 1} is used {uses[worst]:,} times "
            f"and expands to {size[worst]:,} values each"
            if worst in shared
            else ""
        )
        raise self.fail(
            "S010",
            f"the document expands to {total:,} values through its aliases, more than the limit of "
            f"{MAX_NODES:,}{where}",
            mark.line + 1,
            mark.column + 1,
            "repeat fewer aliases (an alias bomb?); a spec needs far fewer values",
        )

    def _build(self, node: Any, path: Path_) -> Any:
        yaml = self._yaml
        pos = Position(node.start_mark.line + 1, node.start_mark.column + 1)
        self.enter(path, pos)
        if isinstance(node, yaml.MappingNode):
            out: dict = {}
            first_seen: dict = {}
            merged: list = []
            for knode, vnode in node.value:
                if knode.tag == "tag:yaml.org,2002:merge":
                    merged.append(vnode)
                    continue
                key = self._scalar(knode, path)
                kpos = Position(knode.start_mark.line + 1, knode.start_mark.column + 1)
                self.add_key(out, key, path, kpos, first_seen)
                out[key] = self._build(vnode, (*path, key))
            for vnode in merged:  # `<<: *base` merges keys not given explicitly
                sources = vnode.value if isinstance(vnode, yaml.SequenceNode) else [vnode]
                for src in sources:
                    if not isinstance(src, yaml.MappingNode):
                        raise self.fail(
                            "S001",
                            "a `<<` merge needs a mapping or a list of mappings",
                            pos.line,
                            pos.column,
                            "merge a mapping anchor",
                            path,
                        )
                    value = self._build(src, path)
                    for k, v in value.items():
                        out.setdefault(k, v)
            return out
        if isinstance(node, yaml.SequenceNode):
            return [self._build(item, (*path, i)) for i, item in enumerate(node.value)]
        return self._scalar(node, path)

    def _scalar(self, node: Any, path: Path_) -> Any:
        if not isinstance(node, self._yaml.ScalarNode):
            line, col = node.start_mark.line + 1, node.start_mark.column + 1
            raise self.fail(
                "S004", "mapping keys must be plain strings, not mappings or lists", line, col, "use a string key", path
            )
        try:
            value = self._constructor.construct_object(node, deep=True)
        except self._yaml.YAMLError as exc:
            line, col = node.start_mark.line + 1, node.start_mark.column + 1
            raise self.fail(
                "S001",
                f"invalid YAML value: {getattr(exc, 'problem', None) or exc}",
                line,
                col,
                "quote the value or fix its syntax",
                path,
            ) from exc
        if isinstance(value, (bytes, bytearray)) or type(value).__module__ == "datetime":
            # Keep unusual scalars as their source text: the schema then reports them clearly.
            return node.value
        return value


_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(\.\d+)?([eE][-+]?\d+)?")
_WS = re.compile(r"[ \t\n\r]*")


class _JsonReader(_Reader):
    """A small recursive-descent JSON reader that records positions (strict RFC 8259)."""

    def read(self) -> Any:
        self.i = _WS.match(self.text, 0).end()
        if self.i == len(self.text):
            return None
        value = self._value(())
        self.i = _WS.match(self.text, self.i).end()
        if self.i != len(self.text):
            raise self._err("unexpected text after the JSON document")
        return value

    def _pos(self, i: int | None = None) -> Position:
        """Line and column of offset ``i``: a bisection of the line starts, found once per text (a
        count of newlines per value made reading quadratic in the file's size)."""
        i = self.i if i is None else i
        starts = self.__dict__.get("_line_starts")
        if starts is None:
            starts = self._line_starts = [0, *(m.end() for m in re.finditer("\n", self.text))]
        line = bisect.bisect_right(starts, i)
        return Position(line, i - starts[line - 1] + 1)

    def _err(self, message: str, path: Path_ = ()) -> SourceError:
        pos = self._pos()
        return self.fail(
            "S001", f"invalid JSON: {message}", pos.line, pos.column, "fix the JSON syntax at this position", path
        )

    def _skip(self) -> None:
        self.i = _WS.match(self.text, self.i).end()

    def _value(self, path: Path_) -> Any:
        self._skip()
        if self.i >= len(self.text):
            raise self._err("unexpected end of input")
        self.enter(path, self._pos())
        ch = self.text[self.i]
        if ch == "{":
            return self._object(path)
        if ch == "[":
            return self._array(path)
        if ch == '"':
            return self._string()
        for literal, value in (("true", True), ("false", False), ("null", None)):
            if self.text.startswith(literal, self.i):
                self.i += len(literal)
                return value
        m = _NUMBER.match(self.text, self.i)
        if m and m.end() > self.i:
            self.i = m.end()
            return float(m.group()) if (m.group(1) or m.group(2)) else int(m.group())
        raise self._err(f"unexpected character {ch!r}")

    def _string(self) -> str:
        try:
            value, end = json.decoder.scanstring(self.text, self.i + 1, True)
        except json.JSONDecodeError as exc:
            self.i = exc.pos
            raise self._err(exc.msg) from exc
        self.i = end
        return value

    def _object(self, path: Path_) -> dict:
        self.i += 1
        out: dict = {}
        first_seen: dict = {}
        self._skip()
        if self.text.startswith("}", self.i):
            self.i += 1
            return out
        while True:
            self._skip()
            if not self.text.startswith('"', self.i):
                raise self._err("expected a string key", path)
            kpos = self._pos()
            key = self._string()
            self.add_key(out, key, path, kpos, first_seen)
            self._skip()
            if not self.text.startswith(":", self.i):
                raise self._err("expected ':' after a key", path)
            self.i += 1
            out[key] = self._value((*path, key))
            self._skip()
            if self.text.startswith(",", self.i):
                self.i += 1
                continue
            if self.text.startswith("}", self.i):
                self.i += 1
                return out
            raise self._err("expected ',' or '}' in an object", path)

    def _array(self, path: Path_) -> list:
        self.i += 1
        out: list = []
        self._skip()
        if self.text.startswith("]", self.i):
            self.i += 1
            return out
        while True:
            out.append(self._value((*path, len(out))))
            self._skip()
            if self.text.startswith(",", self.i):
                self.i += 1
                continue
            if self.text.startswith("]", self.i):
                self.i += 1
                return out
            raise self._err("expected ',' or ']' in an array", path)

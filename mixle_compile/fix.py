"""`check --fix` and `--diff`: write a suggestion into the spec file, keeping its comments and layout.

The file is read with ruamel.yaml's round-trip loader, which keeps comments, key order, flow or
block style and quoting; only the values a suggestion changes are set (a key the file does not
write yet is added at the end of its section). Engine configs and JSON specs are not edited:
their patch is printed for a person to apply.
"""

from __future__ import annotations

import difflib
import io
from pathlib import Path

from mixle_compile.verify.facts import ENUMS


class FixRefused(Exception):
    """A file `--fix` will not edit; the message says why and what to do instead."""


def fixable(path: Path, source_format: str | None) -> None:
    if source_format is not None:
        raise FixRefused(
            f"{path} is a {source_format} config: --fix edits YAML specs; apply the patch to the engine's keys by hand"
        )
    if path.suffix.lower() not in (".yaml", ".yml"):
        raise FixRefused(f"{path} is not a YAML spec: --fix edits .yaml and .yml files; apply the patch by hand")


def _value(change):
    kind = change.field.kind
    if kind == "bool":
        return bool(change.value)
    if kind in ENUMS:
        return ENUMS[kind][int(change.value)]
    return int(change.value)


def fixed_text(text: str, suggestion) -> str:
    """``text`` with the suggestion's changes written in."""
    from ruamel.yaml import YAML
    from ruamel.yaml.comments import CommentedMap

    round_trip = YAML(typ="rt")  # round-trip: plain mappings, lists and scalars, never Python objects
    round_trip.preserve_quotes = True
    round_trip.width = 4096  # never re-wrap a long line
    _keep_indentation(round_trip, text)
    data = round_trip.load(text)
    for change in suggestion.changes:
        node = data
        *parents, last = change.field.path
        for key in parents:
            if key not in node:
                node[key] = CommentedMap()
            node = node[key]
        node[last] = _value(change)
    out = io.StringIO()
    round_trip.dump(data, out)
    result = out.getvalue()
    if text.startswith("---") and not result.startswith("---"):
        result = "---\n" + result
    return result


def _keep_indentation(yaml, text: str) -> None:
    """Dump with the file's own indentation: the step of its first nested key, and whether list
    items are indented under their key."""
    step = None
    dash_offset = None
    previous = ""
    for line in text.splitlines():
        stripped = line.lstrip(" ")
        if not stripped or stripped.startswith("#"):
            continue
        indent = len(line) - len(stripped)
        if step is None and indent > 0 and not stripped.startswith("- "):
            step = indent
        if dash_offset is None and stripped.startswith("- ") and previous.rstrip().endswith(":"):
            prev_indent = len(previous) - len(previous.lstrip(" "))
            dash_offset = indent - prev_indent
        previous = line
    step = step or 2
    offset = dash_offset if dash_offset is not None else step
    yaml.indent(mapping=step, sequence=offset + 2, offset=offset)


def unified_diff(path: str, before: str, after: str) -> str:
    """git's spelling: a/PATH and b/PATH for a relative path, the path itself for an absolute one."""
    old, new = (path, path) if Path(path).is_absolute() else (f"a/{path}", f"b/{path}")
    return "".join(
        difflib.unified_diff(
            before.splitlines(keepends=True), after.splitlines(keepends=True), fromfile=old, tofile=new
        )
    )

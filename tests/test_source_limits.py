"""Input limits of the spec readers: large specs are read, alias bombs are refused before anything is built."""

from __future__ import annotations

import json

import pytest

from mixle_compile.spec import source
from mixle_compile.spec.source import SourceError, parse_source


def bomb(levels: int = 9, fan: int = 9) -> bytes:
    lines = ["a: &a [" + ", ".join(["x"] * fan) + "]"]
    names = "abcdefghijklmnop"
    for prev, cur in zip(names[: levels - 1], names[1:levels], strict=True):
        lines.append(f"{cur}: &{cur} [" + ", ".join([f"*{prev}"] * fan) + "]")
    return "\n".join(lines).encode()


def refusal(raw: bytes, name: str = "spec.yaml"):
    with pytest.raises(SourceError) as info:
        parse_source(raw, name, json_syntax=name.endswith(".json"))
    (diagnostic,) = info.value.diagnostics
    return diagnostic


def test_an_alias_bomb_is_refused_before_anything_is_built(monkeypatch):
    built = []  # a failure must not print the composed bomb: record the call, return nothing
    monkeypatch.setattr(source._YamlReader, "_build", lambda *args: built.append(1))
    d = refusal(bomb())
    assert built == []
    assert d.code == "S010" and f"{source.MAX_NODES:,}" in d.message
    # 1 + 9 + 9*10 + ... : every level counted once per use, the values of the whole expansion
    assert "490,329,055 values" in d.message
    assert (d.line, d.column) == (8, 4) and "used 10 times" in d.message  # the anchor on line 8 (`&h`)


def test_the_expansion_is_counted_exactly_and_the_limit_is_named(monkeypatch):
    monkeypatch.setattr(source, "MAX_NODES", 12)
    text = b"a: &x [1, 2, 3]\nb: *x\nc: *x\n"
    d = refusal(text)
    # the top mapping, then three lists of four values each (the list and its items)
    assert "expands to 13 values" in d.message and "limit of 12" in d.message
    assert (d.line, d.column) == (1, 4) and "used 3 times and expands to 4 values each" in d.message
    monkeypatch.setattr(source, "MAX_NODES", 13)
    doc, _ = parse_source(text, "spec.yaml", json_syntax=False)
    assert doc.data == {"a": [1, 2, 3], "b": [1, 2, 3], "c": [1, 2, 3]}


def test_an_alias_inside_its_own_anchor_is_refused():
    d = refusal(b"a: &a [1, *a]\n")
    assert d.code == "S010" and "contains it" in d.message and d.line == 1


def test_merge_keys_count_what_they_merge(monkeypatch):
    text = b"base: &b {role: row, layer: 0}\nt1: {<<: *b, name: a}\nt2: {<<: *b, name: b}\n"
    monkeypatch.setattr(source, "MAX_NODES", 10)  # 1 + 3 + 2 * (1 + 1 + 3)
    assert "expands to 14 values" in refusal(text).message
    monkeypatch.setattr(source, "MAX_NODES", 14)
    doc, _ = parse_source(text, "spec.yaml", json_syntax=False)
    assert doc.data["t2"] == {"name": "b", "role": "row", "layer": 0}


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_documents_past_the_old_value_cap_are_read(suffix):
    # 300,000 values: above the cap that once made any spec of more than ~40,000 tensors unreadable
    data = {"values": [i % 7 for i in range(300_000)]}
    raw = (
        json.dumps(data).encode()
        if suffix == ".json"
        else ("values: [" + ", ".join(map(str, data["values"])) + "]").encode()
    )
    doc, diagnostics = parse_source(raw, "spec" + suffix, json_syntax=suffix == ".json")
    assert doc.data == data and diagnostics == []
    assert doc.position(("values", 299_999)).line == 1


def test_an_oversized_file_is_refused_by_its_size_alone():
    d = refusal(b"#" * (source.MAX_INPUT_BYTES + 1))
    assert d.code == "S010" and f"{source.MAX_INPUT_BYTES:,} bytes" in d.message


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_a_duplicate_key_keeps_the_later_value_and_only_its_positions(suffix):
    text = (
        "a: 1\nb: {x: 1, y: 2}\na: 2\nb: 3\n"
        if suffix == ".yaml"
        else '{"a": 1,\n"b": {"x": 1, "y": 2},\n"a": 2,\n"b": 3}'
    )
    doc, diagnostics = parse_source(text.encode(), "spec" + suffix, json_syntax=suffix == ".json")
    assert doc.data == {"a": 2, "b": 3} and [d.code for d in diagnostics] == ["S002", "S002"]
    assert doc.values[("a",)].line == 3 and doc.values[("b",)].line == 4
    assert ("b", "x") not in doc.values and ("b", "y") not in doc.values

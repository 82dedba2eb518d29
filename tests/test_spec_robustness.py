"""Bad input never crashes the loader: random data and random bytes always give diagnostics."""

from __future__ import annotations

import json

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from mixle_compile.spec import load_spec_text
from tests.conftest import TINY

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=False),
    st.text(max_size=12),
)
keys = st.sampled_from(
    [
        "model",
        "mesh",
        "training",
        "backend",
        "resources",
        "elastic",
        "family",
        "tp",
        "dp_shard",
        "type",
        "ref",
        "shared",
        "root",
        "devices",
        "memory",
        "x",
    ]
)
documents = st.recursive(
    scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(keys, kids, max_size=5), max_leaves=30
)


def assert_clean(result):
    """Either a spec and no errors, or no spec and at least one located error; never an exception."""
    errors = [d for d in result.diagnostics if d.severity.value == "error"]
    assert (result.spec is None) == bool(errors)
    for d in result.diagnostics:
        assert d.code and d.message and d.line >= 1 and d.column >= 1


@settings(max_examples=150, deadline=None)
@given(documents)
def test_random_yaml_documents_give_diagnostics(doc):
    assert_clean(load_spec_text(yaml.safe_dump(doc), "fuzz.yaml"))


@settings(max_examples=150, deadline=None)
@given(documents)
def test_random_json_documents_give_diagnostics(doc):
    assert_clean(load_spec_text(json.dumps(doc), "fuzz.json", json_syntax=True))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_give_diagnostics(raw):
    assert_clean(load_spec_text(raw, "fuzz.yaml"))
    assert_clean(load_spec_text(raw, "fuzz.json", json_syntax=True))


@settings(max_examples=200, deadline=None)
@given(
    st.integers(min_value=0, max_value=len(TINY) - 1),
    st.sampled_from(["", "{", "]", ":", "\t", "&a", "*a", "- ", "!!python/object:os.system ", "0.5", "'"]),
)
def test_mutated_valid_spec_gives_diagnostics(at, insert):
    result = load_spec_text(TINY[:at] + insert + TINY[at:], "mutant.yaml")
    assert_clean(result)

"""The committed JSON Schema is generated from the spec models and validates the examples."""

from __future__ import annotations

import json

import pytest
import yaml

from mixle_compile.schema import spec_schema_text
from tests.conftest import EXAMPLES, ROOT

SCHEMA = ROOT / "schemas" / "spec.schema.json"


def test_committed_schema_matches_the_models():
    assert SCHEMA.read_text() == spec_schema_text(), (
        "schemas/spec.schema.json is stale: run `python -m mixle_compile schema -o schemas/spec.schema.json`"
    )


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_validate_against_the_schema(path):
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(yaml.safe_load(path.read_text()), json.loads(SCHEMA.read_text()))


def test_schema_rejects_unknown_keys():
    jsonschema = pytest.importorskip("jsonschema")
    spec = yaml.safe_load((EXAMPLES / "tiny-transformer.yaml").read_text())
    spec["mesh"]["dp_shards"] = 2
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(spec, json.loads(SCHEMA.read_text()))

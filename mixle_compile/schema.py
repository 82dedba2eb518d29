"""JSON Schema generated from the spec models (committed as schemas/spec.schema.json)."""

from __future__ import annotations

import json

SPEC_SCHEMA_ID = "https://mixle-compile.dev/schemas/spec.schema.json"


def spec_schema() -> dict:
    from mixle_compile.spec.models import ModelFile, Spec

    schema = Spec.model_json_schema()
    # The loader reads `model: {from: hf, path: ...}` into a transformer before validating the spec,
    # so the file reference is a model only as far as an editor is concerned.
    schema["$defs"]["ModelFile"] = ModelFile.model_json_schema(by_alias=True)
    schema["properties"]["model"]["oneOf"].append({"$ref": "#/$defs/ModelFile"})
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SPEC_SCHEMA_ID,
        "title": "mixle-compile spec",
        **{k: v for k, v in schema.items() if k != "title"},
    }


def spec_schema_text() -> str:
    return json.dumps(spec_schema(), indent=2, sort_keys=True) + "\n"

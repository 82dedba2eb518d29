"""The plan artifact: deterministic bytes, integrity on load, a generated schema."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from mixle_compile.lower.lowering import lower
from mixle_compile.plan import FORMAT_VERSION, PlanError, build_plan, load_plan_text, plan_schema_text, plan_text
from mixle_compile.spec import load_spec
from tests.conftest import EXAMPLES, ROOT


def compiled(name="tiny-transformer.yaml") -> str:
    loaded = load_spec(EXAMPLES / name)
    return plan_text(build_plan(loaded.spec, lower(loaded.spec), loaded.diagnostics))


@pytest.fixture(scope="module")
def tiny_plan() -> str:
    return compiled()


def test_plan_round_trips_and_holds_every_section(tiny_plan):
    doc = load_plan_text(tiny_plan)
    assert doc.format_version == FORMAT_VERSION
    assert doc.mesh.degrees["world_size"] == 4
    assert {p.logical_id for p in doc.parameters} >= {"embed.weight", "lm_head.weight"}
    assert doc.updates and doc.memory and doc.traffic and doc.schedule.stages
    assert doc.verdict.ok and doc.verdict.reductions_exactly_once and doc.schedule.check.ok
    assert doc.content_digest.startswith("sha256:") and doc.spec_digest.startswith("sha256:")


def test_same_input_gives_the_same_bytes_in_another_process(tiny_plan):
    code = (
        "import sys; sys.path.insert(0, 'tests/..');from tests.test_plan import compiled; sys.stdout.write(compiled())"
    )
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
    ).stdout
    assert other == tiny_plan


def test_a_plan_holds_no_machine_path(tiny_plan):
    assert str(ROOT) not in tiny_plan and str(EXAMPLES) not in tiny_plan


@pytest.mark.parametrize("seed", range(3))
def test_any_flipped_byte_is_detected(tiny_plan, seed):
    raw = tiny_plan.encode()
    rng = random.Random(seed)
    for position in rng.sample(range(len(raw)), 60):
        for flip in (0x01, 0x20):
            mutant = bytearray(raw)
            mutant[position] ^= flip
            with pytest.raises(PlanError):
                load_plan_text(bytes(mutant))


def test_an_equivalent_but_reformatted_plan_is_refused(tiny_plan):
    pretty = json.dumps(json.loads(tiny_plan), indent=1, sort_keys=True)
    with pytest.raises(PlanError, match="canonical form"):
        load_plan_text(pretty)


def test_newer_format_and_unknown_fields_are_refused(tiny_plan):
    data = json.loads(tiny_plan)
    with pytest.raises(PlanError, match=f"newer than this compiler reads \\(format {FORMAT_VERSION}"):
        load_plan_text(json.dumps({**data, "format_version": FORMAT_VERSION + 1}))
    with pytest.raises(PlanError, match="unknown field `mesh.colour`"):
        load_plan_text(json.dumps({**data, "mesh": {**data["mesh"], "colour": "blue"}}))
    with pytest.raises(PlanError, match="not a mixle-compile plan"):
        load_plan_text("[1, 2]")
    with pytest.raises(PlanError, match="not valid JSON"):
        load_plan_text(tiny_plan[:-10])


def test_a_tampered_value_with_a_stale_digest_is_refused(tiny_plan):
    data = json.loads(tiny_plan)
    data["memory"][0]["activations"] += 1
    with pytest.raises(PlanError, match="content digest mismatch"):
        load_plan_text(plan_text(data))


def test_committed_plan_schema_matches_the_code():
    assert (ROOT / "schemas" / "plan.schema.json").read_text() == plan_schema_text(), (
        "schemas/plan.schema.json is stale: run `mixle-compile schema --plan -o schemas/plan.schema.json`"
    )


def test_plan_validates_against_the_committed_schema(tiny_plan):
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(json.loads(tiny_plan), json.loads((ROOT / "schemas" / "plan.schema.json").read_text()))


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.yaml")))
def test_a_built_plan_is_already_in_the_schemas_form(example):
    # build_plan writes the schema's JSON form directly (encoded once, not validated again), so the
    # schema's own dump of it must give the same bytes: what is written is exactly what loading reads.
    from mixle_compile.compile import compile_file
    from mixle_compile.plan import canonical_json
    from mixle_compile.plan.artifact import expanded
    from mixle_compile.plan.document import PlanDocument

    plan = compile_file(ROOT / "examples" / example).plan
    assert canonical_json(PlanDocument.model_validate(plan).model_dump(mode="json")) == canonical_json(expanded(plan))

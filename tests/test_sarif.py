"""`check --format sarif` against the official SARIF 2.1.0 schema.

tests/sarif-schema-2.1.0.json is the OASIS schema, SARIF 2.1.0 errata 01
(https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json), as
published in the OASIS TC's repository: github.com/oasis-tcs/sarif-spec, Schemata/sarif-schema-2.1.0.json
(commit ffa72eb, "Update the github copies of the schemata to match the Approved Errata").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mixle_compile import cli
from tests.conftest import EXAMPLES

jsonschema = pytest.importorskip("jsonschema")
SCHEMA = json.loads((Path(__file__).parent / "sarif-schema-2.1.0.json").read_text(encoding="utf-8"))
TP3 = (EXAMPLES / "tiny-transformer.yaml").read_text().replace("  tp: 2\n", "  tp: 3\n")


def sarif(capsys, *argv) -> tuple[int, dict]:
    status = cli.main(["check", "--format", "sarif", *map(str, argv)])
    return status, json.loads(capsys.readouterr().out)


def validate(log: dict) -> None:
    jsonschema.Draft4Validator(SCHEMA, format_checker=jsonschema.FormatChecker()).validate(log)


def test_the_shipped_schema_is_the_official_one():
    assert SCHEMA["id"] == "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"
    jsonschema.Draft4Validator.check_schema(SCHEMA)


def test_a_log_with_grouped_findings_and_a_fix_is_valid(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "my specs" / "tp 3.yaml"  # spaces: the URI must be percent-encoded
    spec.parent.mkdir()
    spec.write_text(TP3)
    status, log = sarif(capsys, "--suggest", spec)
    assert status == 1
    validate(log)
    run = log["runs"][0]
    (result,) = run["results"]  # D001, T001, T002, T004 and T005 at `tp` are one finding
    assert result["ruleId"] == "D001"
    assert [r["message"]["text"].split()[0] for r in result["relatedLocations"]] == ["T001", "T002", "T004", "T005"]
    location = result["locations"][0]["physicalLocation"]
    assert location["artifactLocation"] == {"uri": "my%20specs/tp%203.yaml", "uriBaseId": "%SRCROOT%"}
    line = TP3.splitlines().index("  tp: 3") + 1
    assert location["region"] == {"startLine": line, "startColumn": 7, "endLine": line, "endColumn": 8}
    assert run["originalUriBaseIds"]["%SRCROOT%"]["uri"] == tmp_path.resolve().as_uri() + "/"
    rules = {r["id"]: r for r in run["tool"]["driver"]["rules"]}
    assert rules["D001"]["helpUri"].endswith("docs/rules.md#d001-world-size")
    assert rules["M001"]["helpUri"].endswith("docs/rules.md#m001-unused-suppression")
    (fix,) = result["fixes"]
    (change,) = fix["artifactChanges"]
    (replacement,) = change["replacements"]
    offset = TP3.index("  tp: 3\n")
    assert replacement == {
        "deletedRegion": {"charOffset": offset, "charLength": len("  tp: 3\n")},
        "insertedContent": {"text": "  tp: 2\n"},
    }
    fixed = TP3[:offset] + replacement["insertedContent"]["text"] + TP3[offset + len("  tp: 3\n") :]
    spec.write_text(fixed)
    status, log = sarif(capsys, spec)
    assert status == 0 and log["runs"][0]["results"] == []
    validate(log)


def test_every_invalid_example_gives_a_valid_log(capsys, monkeypatch):
    monkeypatch.chdir(EXAMPLES.parent)
    status, log = sarif(capsys, *sorted(Path("examples/invalid").glob("*.yaml")))
    assert status == 1
    validate(log)
    assert len(log["runs"][0]["results"]) >= 40
    broken = json.loads(json.dumps(log))  # the validator is live: a region at line 0 is refused
    broken["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["region"]["startLine"] = 0
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)


def test_a_file_outside_the_working_directory_has_an_absolute_file_uri(capsys, tmp_path, monkeypatch):
    inside = tmp_path / "work"
    inside.mkdir()
    monkeypatch.chdir(inside)
    spec = tmp_path / "out side.yaml"
    spec.write_text(TP3)
    _, log = sarif(capsys, spec)
    validate(log)
    uri = log["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["artifactLocation"]
    assert uri == {"uri": spec.resolve().as_uri()} and "%20" in uri["uri"]

"""compile, explain, diff, graph, schema --plan and check --format sarif from the command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mixle_compile import cli
from mixle_compile.plan import load_plan_text, plan_schema_text
from tests.conftest import EXAMPLES, ROOT

EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))


def run_cli(capsys, *argv):
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("spec", EXAMPLE_FILES, ids=lambda p: p.name)
def test_compiling_every_example_twice_gives_identical_bytes(capsys, tmp_path, spec):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    assert run_cli(capsys, "compile", spec, "-o", first)[0] == 0
    assert run_cli(capsys, "compile", spec, "-o", second)[0] == 0
    assert first.read_bytes() == second.read_bytes()
    assert load_plan_text(first.read_bytes()).verdict.ok


def test_compile_in_another_process_gives_the_same_bytes(capsys, tmp_path):
    here = tmp_path / "here.json"
    run_cli(capsys, "compile", EXAMPLES / "mixtral-moe-ep.yaml", "-o", here)
    other = subprocess.run(
        [sys.executable, "-m", "mixle_compile", "compile", str(EXAMPLES / "mixtral-moe-ep.yaml")],
        capture_output=True,
        cwd=ROOT,
        env={"PYTHONHASHSEED": "99", "PATH": ""},
        check=True,
    ).stdout
    assert other == here.read_bytes()


def test_compile_refuses_a_bad_spec_and_writes_nothing(capsys, tmp_path):
    out = tmp_path / "plan.json"
    status, stdout, err = run_cli(capsys, "compile", EXAMPLES / "invalid" / "t001-heads-split-by-tp.yaml", "-o", out)
    assert status == 1 and not out.exists() and stdout == ""
    assert "T001" in err and "no plan written: 1 error" in err
    status, _, err = run_cli(capsys, "compile", tmp_path / "missing.yaml")
    assert status == 2 and "S011" in err


def test_explain_reads_specs_and_plans_alike(capsys, tmp_path):
    plan = tmp_path / "plan.json"
    run_cli(capsys, "compile", EXAMPLES / "mixtral-moe-ep.yaml", "-o", plan)
    status, from_plan, _ = run_cli(capsys, "explain", plan)
    assert status == 0
    status, from_spec, _ = run_cli(capsys, "explain", EXAMPLES / "mixtral-moe-ep.yaml")
    assert status == 0 and from_plan == from_spec
    assert "bubble fraction 27.3%" in from_plan
    status, out, _ = run_cli(capsys, "explain", plan, "--format", "json")
    data = json.loads(out)
    assert status == 0 and len(data["memory_per_rank"]) == 4 and data["pipeline"]["schedule"] == "1f1b"


def test_explain_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "m.png"
    status, _, err = run_cli(capsys, "explain", EXAMPLES / "tiny-transformer.yaml", "--plot", png)
    assert status == 0 and png.read_bytes()[:4] == b"\x89PNG" and "wrote" in err


def test_explain_refuses_a_tampered_plan(capsys, tmp_path):
    plan = tmp_path / "plan.json"
    run_cli(capsys, "compile", EXAMPLES / "tiny-transformer.yaml", "-o", plan)
    raw = bytearray(plan.read_bytes())
    raw[200] ^= 0x01
    plan.write_bytes(bytes(raw))
    status, out, err = run_cli(capsys, "explain", plan)
    assert status == 2 and out == "" and "error:" in err and "Traceback" not in err


def test_diff_of_plans_and_specs(capsys, tmp_path):
    changed = tmp_path / "tp4.yaml"
    # tp 8 -> 4 doubles dp_shard (auto); halve accumulation to keep the global batch
    changed.write_text(
        (EXAMPLES / "llama3-8b-hsdp-tp.yaml")
        .read_text()
        .replace("tp: 8", "tp: 4")
        .replace("gradient_accumulation_steps: 8", "gradient_accumulation_steps: 4")
    )
    status, out, _ = run_cli(capsys, "diff", EXAMPLES / "llama3-8b-hsdp-tp.yaml", changed)
    assert status == 0 and "tp: 8 -> 4" in out and "memory per rank:" in out  # a difference is not a failure
    status, out, _ = run_cli(
        capsys, "diff", "--exit-code", EXAMPLES / "llama3-8b-hsdp-tp.yaml", changed, "--format", "json"
    )
    assert status == 1 and json.loads(out)["mesh"]["tp"] == {"from": 8, "to": 4}  # unless asked, like git diff
    status, out, _ = run_cli(
        capsys, "diff", "--exit-code", EXAMPLES / "tiny-transformer.yaml", EXAMPLES / "tiny-transformer.yaml"
    )
    assert status == 0 and "same plan" in out
    status, _, err = run_cli(
        capsys, "diff", EXAMPLES / "tiny-transformer.yaml", EXAMPLES / "invalid" / "t001-heads-split-by-tp.yaml"
    )
    assert (
        status == 1 and "T001" in err
    )  # a spec that does not compile cannot be compared: its findings, exit 1 as in every verb


@pytest.mark.parametrize("fmt, head", [("dot", "digraph decomposition {"), ("mermaid", "flowchart TD")])
def test_graph_formats(capsys, fmt, head):
    status, out, _ = run_cli(capsys, "graph", EXAMPLES / "hmm-shared-transitions.yaml", "--format", fmt)
    assert status == 0 and out.startswith(head) and out.count("shared.weather") == 1


def test_schema_plan_matches_the_committed_file(capsys):
    status, out, _ = run_cli(capsys, "schema", "--plan")
    assert status == 0 and out == plan_schema_text() == (ROOT / "schemas" / "plan.schema.json").read_text()


def test_check_sarif_lists_every_rule_and_locates_findings(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    status, out, _ = run_cli(capsys, "check", "--format", "sarif", "examples/invalid/t001-heads-split-by-tp.yaml")
    assert status == 1
    run = json.loads(out)["runs"][0]
    ids = {r["id"] for r in run["tool"]["driver"]["rules"]}
    assert {"S003", "T001", "B001", "G001", "L001"} <= ids
    (result,) = run["results"]
    assert result["ruleId"] == "T001" and result["level"] == "error"
    location = result["locations"][0]["physicalLocation"]
    assert location["artifactLocation"]["uri"] == "examples/invalid/t001-heads-split-by-tp.yaml"
    assert location["region"] == {"startLine": 4, "startColumn": 12, "endLine": 4, "endColumn": 13}


def test_explain_ranks_lists_concrete_groups_only_on_request(capsys, tmp_path):
    status, out, _ = run_cli(capsys, "explain", EXAMPLES / "tiny-transformer.yaml", "--ranks", "4")
    assert status == 0
    assert "  tp (size 2, 2 groups): {0,1} {2,3}" in out and "  dp_shard (size 2, 2 groups): {0,2} {1,3}" in out
    status, plain, _ = run_cli(capsys, "explain", EXAMPLES / "tiny-transformer.yaml")
    assert "rank groups" not in plain


def test_explain_ranks_on_a_131072_rank_plan_lists_only_what_is_asked(capsys, tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text(
        "model: {family: transformer, vocab_size: 128256, hidden_size: 4096, num_layers: 32, num_heads: 32, "
        "num_kv_heads: 8, ffn_hidden_size: 14336}\n"
        "mesh: {dp_shard: 4096, tp: 8, pp: 4, microbatches: 8}\n"
        "training: {global_batch_size: 32768, micro_batch_size: 1, seq_len: 4096, sequence_parallel: true}\n"
        "backend: torch\nresources: {devices: 131072, memory: 80GiB}\n"
    )
    status, out, _ = run_cli(capsys, "explain", big, "--ranks", "2", "--format", "json")
    assert status == 0
    groups = {g["rule"]: g for g in json.loads(out)["rank_groups"]}
    assert groups["tp"]["num_groups"] == 16384 and groups["tp"]["groups"] == [list(range(8)), list(range(8, 16))]
    assert groups["dp_shard"]["size"] == 4096 and len(groups["dp_shard"]["groups"]) == 2

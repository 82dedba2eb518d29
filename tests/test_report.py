"""explain, diff, graph export and SARIF on the examples."""

from __future__ import annotations

import json

import pytest

from mixle_compile.graph import build_model_graph
from mixle_compile.graph.export import to_dot, to_mermaid
from mixle_compile.lower.lowering import lower
from mixle_compile.memory_model import MEMORY_KINDS
from mixle_compile.plan import build_plan, load_plan_text, plan_text
from mixle_compile.report import diff_data, diff_text, explain_data, explain_text, human_bytes
from mixle_compile.sarif import sarif_log
from mixle_compile.spec import load_spec, load_spec_text
from tests.conftest import EXAMPLES

EXAMPLE_NAMES = sorted(p.name for p in EXAMPLES.glob("*.yaml"))


def plan_of(loaded):
    assert loaded.ok, [d.text() for d in loaded.diagnostics]
    return load_plan_text(
        plan_text(build_plan(loaded.spec, lower(loaded.spec, document=loaded.document), loaded.diagnostics))
    )


@pytest.fixture(scope="module")
def plans():
    return {name: plan_of(load_spec(EXAMPLES / name)) for name in EXAMPLE_NAMES}


def test_human_bytes():
    assert [human_bytes(n) for n in (0, 1023, 1024, 3 * 2**30, -(2**20))] == [
        "0 B",
        "1023 B",
        "1.00 KiB",
        "3.00 GiB",
        "-1.00 MiB",
    ]


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_explain_every_example(plans, name):
    doc = plans[name]
    data = explain_data(doc)
    assert data["verdict"]["ok"]
    assert [m["stage"] for m in data["memory_per_rank"]] == list(range(doc.mesh.degrees["pp"]))
    for m in data["memory_per_rank"]:
        assert m["total"] == sum(m[k] for k in MEMORY_KINDS)
    text = explain_text(doc)
    assert "memory per rank" in text and "traffic per rank per step" in text
    json.dumps(data)  # JSON-ready


def test_explain_shows_the_pipeline_bubble_and_the_model_cut(plans):
    text = explain_text(plans["mixtral-moe-ep.yaml"])
    assert "pipeline: 1f1b, 4 stage(s)" in text and "bubble fraction 27.3%" in text  # (4-1)/(8+4-1)
    cut = explain_text(plans["composite-nested-mixture.yaml"])
    assert "model cut: axis component at model.root.factors[2] (64 units)" in cut
    assert "cpu-fast#0      0..31" in cut


def test_diff_names_mesh_layout_memory_and_traffic_changes(plans):
    a = plans["llama3-8b-hsdp-tp.yaml"]
    b = plan_of(load_spec_text((EXAMPLES / "llama3-8b-hsdp-tp.yaml").read_text().replace("tp: 8", "tp: 4"), "b.yaml"))
    d = diff_data(a, b)
    assert not d["same"] and d["spec_changed"]
    assert d["mesh"]["tp"] == {"from": 8, "to": 4} and d["mesh"]["dp_shard"] == {"from": 4, "to": 8}
    q = next(e for e in d["layouts"] if e["parameter"] == "layers.0.attn.o_proj.weight")
    assert q["fields"]["local_shape"] == {"from": [1024, 512], "to": [512, 1024]}
    assert d["memory"][0]["total"]["delta"] == b.memory[0].total - a.memory[0].total
    assert any(t["axes"] == ["dp_shard"] and t["delta"] > 0 for t in d["traffic"])
    text = diff_text(a, b, "a.json", "b.json")
    assert "tp: 8 -> 4" in text and "memory per rank:" in text
    assert diff_text(a, a).endswith("are the same plan (" + a.content_digest[:19] + ")\n")


def test_graph_exports_hold_every_node_and_the_shared_node_once():
    loaded = load_spec(EXAMPLES / "hmm-shared-transitions.yaml")
    graph = build_model_graph(loaded.spec)
    dot = to_dot(graph)
    assert dot.startswith("digraph decomposition {") and dot.rstrip().endswith("}")
    assert dot.count("shared.weather") == 1 and dot.count("-> ") == 9
    mermaid = to_mermaid(graph)
    assert mermaid.startswith("flowchart TD") and mermaid.count("shared.weather") == 1
    assert len([line for line in mermaid.splitlines() if "-->" in line]) == 9


def test_sarif_has_rules_results_and_locations(tmp_path, monkeypatch):
    monkeypatch.chdir(EXAMPLES.parent)
    loaded = load_spec("examples/invalid/s003-unknown-key.yaml")
    log = sarif_log(loaded.diagnostics)
    assert log["version"] == "2.1.0"
    run = log["runs"][0]
    ids = [r["id"] for r in run["tool"]["driver"]["rules"]]
    assert "S003" in ids and ids == sorted(ids)
    (result,) = run["results"]
    assert result["ruleId"] == "S003" and ids[result["ruleIndex"]] == "S003"
    location = result["locations"][0]["physicalLocation"]
    assert location["artifactLocation"]["uri"] == "examples/invalid/s003-unknown-key.yaml"
    assert location["region"] == {"startLine": 5, "startColumn": 3, "endLine": 5, "endColumn": 12}


def test_plot_draws_memory_and_traffic(plans, tmp_path):
    pytest.importorskip("matplotlib")
    from mixle_compile.plot import plot_plan

    out = tmp_path / "plan.png"
    plot_plan(plans["mixtral-moe-ep.yaml"], str(out))
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_the_memory_table_names_every_term_of_the_memory_model_over_its_column(plans):
    import re

    from mixle_compile.report import MEMORY_COLUMNS

    assert list(MEMORY_COLUMNS) == list(MEMORY_KINDS)
    doc = plans["tiny-transformer.yaml"]
    lines = explain_text(doc).splitlines()
    at = lines.index("memory per rank (by pipeline stage)")
    header, first = (re.split(r"\s{2,}", lines[at + k].strip()) for k in (1, 3))
    assert header == ["stage", *MEMORY_COLUMNS.values(), "total", "of device"]
    assert len(first) == len(header)  # a cell under every column, the device's share last
    m = explain_data(doc)["memory_per_rank"][0]
    assert first[header.index("buffers")] == human_bytes(m["buffers"]) and first[-2] == human_bytes(m["total"])
    assert first[-1].endswith("%")

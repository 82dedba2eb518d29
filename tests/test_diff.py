"""diff shows every spec change (dotted paths) and every consequence in the plan, in text and JSON."""

from __future__ import annotations

import json

import pytest

from mixle_compile import cli
from mixle_compile.compile import compile_loaded
from mixle_compile.plan import load_plan_text, plan_text
from mixle_compile.report import diff_data, diff_text, spec_changes
from mixle_compile.spec import load_spec_text
from tests.conftest import EXAMPLES

PIPELINED = """\
model: {family: transformer, vocab_size: 256, hidden_size: 64, num_layers: 8, num_heads: 4, num_kv_heads: 2, \
ffn_hidden_size: 128}
mesh: {pp: 4, microbatches: 4}
training:
  global_batch_size: 8
  micro_batch_size: 2
  seq_len: 32
  precision: fp32
  optimizer: adamw
  learning_rate: 1.0e-3
  pipeline_schedule: 1f1b
  steps: 20
  seed: 0
backend: torch
resources: {devices: 4, kind: cpu, memory: 2GiB}
"""
# Everything outside the mesh: optimizer, learning rate, steps, seed, schedule and virtual stages.
CHANGED = (
    PIPELINED.replace("optimizer: adamw", "optimizer: sgd")
    .replace("1.0e-3", "3.0e-4")
    .replace("steps: 20", "steps: 40")
    .replace("seed: 0", "seed: 1")
    .replace("pipeline_schedule: 1f1b", "pipeline_schedule: interleaved_1f1b\n  virtual_pipeline_stages: 2")
)


def plan(text: str, name: str = "spec.yaml"):
    result = compile_loaded(load_spec_text(text, name))  # verified: the plan carries the verifier's warnings
    assert result.plan is not None, [d.text() for d in result.check.diagnostics]
    return load_plan_text(plan_text(result.plan))


@pytest.fixture(scope="module")
def pair():
    return plan(PIPELINED, "a.yaml"), plan(CHANGED, "b.yaml")


def test_spec_changes_are_dotted_paths_through_dicts_and_lists():
    a = {"training": {"lr": 1, "steps": 2}, "resources": {"devices": [{"memory": 1}, {"memory": 2}]}, "gone": 0}
    b = {
        "training": {"lr": 3, "steps": 2},
        "resources": {"devices": [{"memory": 1}, {"memory": 5}, {"memory": 6}]},
        "new": None,
    }
    assert spec_changes(a, b) == [
        {"path": "gone", "change": "removed", "from": 0},
        {"path": "new", "change": "added", "to": None},
        {"path": "resources.devices[1].memory", "change": "changed", "from": 2, "to": 5},
        {"path": "resources.devices[2]", "change": "added", "to": {"memory": 6}},
        {"path": "training.lr", "change": "changed", "from": 1, "to": 3},
    ]
    assert spec_changes({"x": 1}, {"x": True}) == [
        {"path": "x", "change": "changed", "from": 1, "to": True}
    ]  # 1 == True in Python
    assert spec_changes(a, a) == []


def test_every_spec_field_outside_the_mesh_is_shown(pair):
    a, b = pair
    d = diff_data(a, b)
    changes = {e["path"]: (e["from"], e["to"]) for e in d["spec"]}
    assert changes == {
        "training.optimizer": ("adamw", "sgd"),
        "training.learning_rate": (1e-3, 3e-4),
        "training.steps": (20, 40),
        "training.seed": (0, 1),
        "training.pipeline_schedule": ("1f1b", "interleaved_1f1b"),
        "training.virtual_pipeline_stages": (1, 2),
    }
    text = diff_text(a, b)
    for line in (
        "training.optimizer: adamw -> sgd",
        "training.learning_rate: 0.001 -> 0.0003",
        "training.steps: 20 -> 40",
        "training.seed: 0 -> 1",
        "training.pipeline_schedule: 1f1b -> interleaved_1f1b",
        "training.virtual_pipeline_stages: 1 -> 2",
    ):
        assert line in text


def test_the_pipeline_consequences_are_shown(pair):
    a, b = pair
    d = diff_data(a, b)
    p = d["pipeline"]
    assert p["schedule"] == {"from": "1f1b", "to": "interleaved_1f1b"} and p["virtual_stages"] == {"from": 1, "to": 2}
    assert p["bubble_fraction"] == {"from": a.schedule.bubble_fraction, "to": b.schedule.bubble_fraction}
    from mixle_compile.lower.compact import plan_programs

    assert p["ops_per_stage"]["to"] == [len(ops) for ops in plan_programs(b.schedule, b.updates)]
    text = diff_text(a, b)
    assert (
        f"bubble fraction: {a.schedule.bubble_fraction:.1%} -> {b.schedule.bubble_fraction:.1%}" in text
    )  # 42.9% -> 27.3%
    # P008 reports the bubble in its message: the finding stays, its figure moves, and diff says so
    (moved,) = d["verdict"]["changed_findings"]
    assert moved["code"] == "P008" and "43%" in moved["from"] and "27%" in moved["to"]
    assert "now P008" in text


def test_updates_collectives_memory_and_traffic_per_axis(pair):
    a, b = pair
    d = diff_data(a, b)
    assert d["updates"]["count"] == {"from": len(a.updates), "to": len(b.updates)}
    changed = {e["update"]: e["fields"] for e in d["updates"]["changed"]}
    assert changed["stage.0->1:activation (forward, stage 0)"]["occurrences_per_step"] == {
        "from": 4,
        "to": 8,
    }  # 2 chunks
    assert d["traffic_per_axis"] == [{"axes": "pp", "from": 128 * 1024, "to": 256 * 1024, "delta": 128 * 1024}]
    assert d["peak_memory"] == {"from": max(m.total for m in a.memory), "to": max(m.total for m in b.memory)}
    # sgd keeps no moments: the optimizer state falls on every stage
    assert all(row["optimizer_state"]["delta"] < 0 for row in d["memory"])
    assert {e["parameter"] for e in d["layouts"] if "chunk" in e.get("fields", {})}  # layers move to the second chunk
    text = diff_text(a, b)
    assert "traffic per axis (per rank per step, busiest stage):\n  pp: 128.00 KiB -> 256.00 KiB (+128.00 KiB)" in text
    assert "updates: 6 -> 8 (2 added, 0 removed, 6 changed: occurrences_per_step in 6)" in text
    assert "memory per rank: peak" in text and "optimizer_state -" in text


def test_every_changed_section_of_the_plan_is_reported(pair):
    a, b = pair
    d = diff_data(a, b)
    key = {
        "spec": "spec",
        "mesh": "mesh",
        "groups": "groups",
        "parameters": "layouts",
        "schedule": "pipeline",
        "decomposition": "model_cut",
        "memory": "memory",
        "traffic": "traffic",
    }
    assert d["changed_sections"]
    for section in d["changed_sections"]:
        if section == "updates":
            assert d["updates"]["changed"] or d["updates"]["added"] or d["updates"]["removed"]
        elif section == "verdict":
            v = d["verdict"]
            assert (
                v["changed_findings"]
                or v["new_findings"]
                or v["resolved_findings"]
                or any(v[k]["from"] != v[k]["to"] for k in ("ok", "errors", "warnings", "reductions_exactly_once"))
            )
        else:
            assert d[key[section]], section


def test_mesh_groups_and_step_time(capsys):
    base = (EXAMPLES / "llama3-8b-hsdp-tp.yaml").read_text()
    a = plan(base)
    b = plan(base.replace("tp: 8", "tp: 4").replace("gradient_accumulation_steps: 8", "gradient_accumulation_steps: 4"))
    d = diff_data(a, b)
    assert d["mesh"]["shape"] == {"from": [2, 4, 8], "to": [2, 8, 4]}
    tp = next(r for r in d["groups"]["rules"] if r["rule"] == "tp")
    assert tp["fields"]["size"] == {"from": 8, "to": 4}
    assert d["pipeline"]["micro_steps"] == {"from": 8, "to": 4}
    step = d["step_time"]
    assert step["seconds"]["to"] < step["seconds"]["from"] and "mfu" in step
    text = diff_text(a, b)
    assert "predicted step time:" in text and "tokens/s:" in text and "rank groups:\n  tp: size 8 -> 4" in text
    assert "  micro steps: 8 -> 4" in text


def test_the_command_prints_the_same_changes_as_json(capsys, tmp_path):
    (tmp_path / "a.yaml").write_text(PIPELINED)
    (tmp_path / "b.yaml").write_text(CHANGED)
    status = cli.main(["diff", str(tmp_path / "a.yaml"), str(tmp_path / "b.yaml"), "--format", "json"])
    out = capsys.readouterr().out
    assert status == 0
    data = json.loads(out)
    assert {e["path"] for e in data["spec"]} >= {
        "training.optimizer",
        "training.seed",
        "training.virtual_pipeline_stages",
    }
    assert data["pipeline"]["bubble_fraction"]["to"] < data["pipeline"]["bubble_fraction"]["from"]
    status = cli.main(["diff", str(tmp_path / "a.yaml"), str(tmp_path / "b.yaml")])
    out = capsys.readouterr().out
    assert status == 0 and "spec: 6 field(s) changed" in out and "pipeline:" in out

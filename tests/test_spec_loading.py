"""Loading specs: schema, positions, and the spec's own consistency checks."""

from __future__ import annotations

import textwrap

import pytest

from mixle_compile.spec import load_spec, load_spec_text, parallel_plan
from mixle_compile.spec.models import parse_memory, parse_throughput
from tests.conftest import EXAMPLES, TINY


def load(text: str, **kw):
    return load_spec_text(textwrap.dedent(text), "spec.yaml", **kw)


def only(result, code: str):
    codes = [d.code for d in result.diagnostics]
    assert code in codes, [d.text() for d in result.diagnostics]
    return next(d for d in result.diagnostics if d.code == code)


def test_tiny_spec_loads_into_models():
    r = load(TINY)
    assert r.ok and r.diagnostics == []
    assert r.spec.model.num_heads == 4
    assert r.spec.resources.memory == 2 * 2**30
    plan = parallel_plan(r.spec)
    assert (plan.dp_shard, plan.tp, plan.world_size) == (2, 2, 4)


def test_auto_dp_shard_takes_the_ranks_left_over():
    r = load_spec(EXAMPLES / "llama3-8b-hsdp-tp.yaml")
    assert r.ok, [d.text() for d in r.diagnostics]
    assert r.spec.mesh.dp_shard == "auto"
    plan = parallel_plan(r.spec)
    assert (plan.dp_replicate, plan.dp_shard, plan.tp, plan.world_size) == (2, 4, 8, 64)


def test_auto_dp_shard_that_does_not_divide_is_reported_with_fits():
    d = only(
        load(TINY.replace("dp_shard: 2, tp: 2", "dp_shard: auto, tp: 4").replace("devices: 4", "devices: 6")), "S012"
    )
    assert "6 devices" in d.message and "= 4" in d.message
    assert "4 or 8 devices" in d.hint
    assert d.fields == ("mesh.dp_shard", "resources.devices")
    assert d.line == 2


def test_unknown_key_points_at_the_key_and_names_the_closest():
    r = load(TINY.replace("mesh: {dp_shard: 2, tp: 2}", "mesh:\n  tp: 2\n  dp_shards: 2"))
    d = only(r, "S003")
    assert (d.line, d.column) == (4, 3)
    assert d.fields == ("mesh.dp_shards",)
    assert "did you mean `dp_shard`?" in d.hint
    assert r.spec is None


def test_unknown_key_in_a_distribution_node_names_its_fields():
    text = """\
    model:
      family: distribution
      root:
        type: mixture
        component: {type: gaussian, dimm: 3}
        repeat: 4
    mesh: {dp_replicate: 2}
    training: {global_batch_size: 8}
    backend: torch
    resources: {devices: 2, memory: 1GiB}
    """
    d = only(load(text), "S003")
    assert d.fields == ("model.root.component.dimm",)
    assert "did you mean `dim`?" in d.hint
    assert (d.line, d.column) == (5, 33)


@pytest.mark.parametrize(
    "value, hint",
    [("2.0", "write 2"), ("'2'", "remove the quotes"), ("true", "not true/false")],
)
def test_integers_are_strict(value, hint):
    d = only(load(TINY.replace("tp: 2}", f"tp: {value}}}")), "S004")
    assert d.fields == ("mesh.tp",)
    assert "must be an integer" in d.message
    assert hint in d.hint


def test_out_of_range_and_zero():
    d = only(load(TINY.replace("tp: 2}", "tp: 0}")), "S005")
    assert "`mesh.tp` must be >= 1, got 0" in d.message
    d = only(load(TINY.replace("tp: 2}", "tp: 1000000000000000000000000000000}")), "S005")
    assert "must be <=" in d.message
    # dp_shard takes `auto` too; its message names the same range
    d = only(load(TINY.replace("tp: 2}", "tp: 2, dp_shard: 2000000}")), "S005")
    assert "must be an integer from 1 to 1048576 or 'auto', got 2000000" in d.message


def test_choice_names_the_closest():
    d = only(load(TINY.replace("seq_len: 32}", "seq_len: 32, precision: bf61}")), "S005")
    assert "training.precision" in d.message and "did you mean 'bf16'?" in d.hint


def test_missing_section_and_field():
    r = load(TINY.replace("training: {global_batch_size: 8, micro_batch_size: 4, seq_len: 32}\n", ""))
    d = only(r, "S006")
    assert "missing required section `training`" in d.message
    d = only(load(TINY.replace("num_layers: 2, ", "")), "S006")
    assert d.fields == ("model", "model.num_layers") and d.line == 1


def test_family_missing_and_misspelt():
    d = only(load(TINY.replace("family: transformer", "family: transfomer")), "S005")
    assert "model.family" in d.message and "did you mean 'transformer'?" in d.hint
    d = only(load(TINY.replace("family: transformer, ", "")), "S006")
    assert "needs `family:`" in d.message


def test_transformer_needs_seq_len():
    d = only(load(TINY.replace(", seq_len: 32", "")), "S006")
    assert "training.seq_len" in d.message


def test_duplicate_keys_in_yaml():
    r = load(TINY.replace("mesh: {dp_shard: 2, tp: 2}", "mesh:\n  tp: 2\n  dp_shard: 2\n  tp: 4"))
    d = only(r, "S002")
    assert (d.line, d.column) == (5, 3)
    assert "first defined at line 3" in d.message
    assert r.spec is None


def test_duplicate_keys_in_json():
    text = '{"model": {"family": "modules",\n "family": "modules"}}'
    d = only(load_spec_text(text, "spec.json", json_syntax=True), "S002")
    assert (d.line, d.column) == (2, 2)


def test_json_positions_and_strictness():
    good = '{"mesh": {"tp": 2.5}}'
    r = load_spec_text(good, "s.json", json_syntax=True)
    d = only(r, "S004")
    assert (d.line, d.column) == (1, 17)
    for bad in ('{"a": 1,}', '{"a": NaN}', "[1, 2", '{"a" 1}', '{"a": 1} x', '{"a": "\\q"}'):
        r = load_spec_text(bad, "s.json", json_syntax=True)
        assert [d.code for d in r.diagnostics] == ["S001"], bad


def test_json_positions_deep_in_a_long_file():
    # Positions come from one table of line starts: a value on line 2001 is reported there.
    lines = ['{"model": {"family": "modules", "parameters": [']
    lines += [f'  {{"name": "p{i}", "shape": [4]}},' for i in range(1999)]
    lines += ['  {"name": "last", "shape": [4.5]}', "]}}"]
    d = only(load_spec_text("\n".join(lines), "long.json", json_syntax=True), "S004")
    assert (d.line, d.column) == (2001, 30)


def test_full_json_spec_matches_yaml(tmp_path):
    import json

    import yaml

    data = yaml.safe_load(TINY)
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(data, indent=2))
    r = load_spec(path)
    assert r.ok
    assert r.spec == load(TINY).spec


def test_yaml_syntax_error_position():
    d = only(load("model: {family: x\nmesh: 1\n"), "S001")
    assert d.line == 2


def test_non_utf8_is_unreadable():
    r = load_spec_text(b"model: \xff\n", "bad.yaml")
    d = only(r, "S011")
    assert r.unreadable and (d.line, d.column) == (1, 8)


def test_missing_file_is_unreadable(tmp_path):
    r = load_spec(tmp_path / "nope.yaml")
    assert r.unreadable and r.diagnostics[0].code == "S011"


def test_empty_file_and_non_mapping():
    assert only(load(""), "S006").message == "the spec is empty"
    assert "must be a mapping" in only(load("- 1\n- 2\n"), "S004").message


def test_boolean_keys_are_refused_with_the_yaml_pitfall_named():
    d = only(load("mesh:\n  on: 2\n"), "S004")
    assert "yes/no/on/off" in d.hint and d.line == 2


def test_alias_bomb_is_stopped():
    levels = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for prev, cur in zip("abcdefgh", "bcdefghi", strict=True):
        levels.append(f"{cur}: &{cur} [" + ", ".join([f"*{prev}"] * 9) + "]")
    only(load("\n".join(levels)), "S010")


def test_deep_nesting_is_stopped():
    only(load("a: " + "[" * 200 + "]" * 200), "S010")
    only(load_spec_text('{"a": ' + "[" * 5000 + "]" * 5000 + "}", "d.json", json_syntax=True), "S010")


def test_yaml_merge_keys_are_supported():
    text = TINY.replace(
        "resources: {devices: 4, memory: 2GiB}", "base: &b {devices: 4}\nresources: {<<: *b, memory: 2GiB}"
    )
    r = load(text)
    # The anchor's holder is an unknown top-level key, but the merged resources are read.
    assert [d.code for d in r.diagnostics] == ["S003"]


def test_memory_and_throughput_units():
    assert parse_memory("80GiB") == 80 * 2**30
    assert parse_memory("80GB") == 80 * 10**9
    assert parse_memory("1.5 KiB") == 1536
    assert parse_memory(1024) == 1024
    assert parse_throughput("989TFLOPS") == pytest.approx(989e12)
    assert parse_throughput("2 GFLOP/s") == pytest.approx(2e9)
    for bad in ("80 gigs", "GiB", True, -3, 0, "0GiB"):
        with pytest.raises(ValueError):
            parse_memory(bad)
    d = only(load(TINY.replace("memory: 2GiB", "memory: 2 gigs")), "S005")
    assert "resources.memory" in d.message and "GiB" in d.message


def test_device_list_and_count_forms():
    r = load(
        TINY.replace(
            "resources: {devices: 4, memory: 2GiB}",
            "resources:\n  devices:\n    - {kind: a, memory: 1GiB, count: 3}\n    - {kind: b, memory: 2GiB}",
        )
    )
    assert r.ok, [d.text() for d in r.diagnostics]
    assert r.spec.resources.device_count == 4
    assert [g.kind for g in r.spec.resources.device_list()] == ["a", "a", "a", "b"]
    d = only(load(TINY.replace("devices: 4, memory: 2GiB", "devices: 4")), "S005")
    assert "memory" in d.message
    d = only(load(TINY.replace("devices: 4", "devices: four")), "S004")
    assert "device count" in d.message


def test_transformer_consistency():
    d = only(load(TINY.replace("num_heads: 4,", "num_heads: 4, num_kv_heads: 3,")), "S013")
    assert d.fields == ("model.num_kv_heads", "model.num_heads")
    d = only(load(TINY.replace("num_heads: 4,", "num_heads: 5,")), "S013")
    assert "head size" in d.message
    d = only(load(TINY.replace("num_heads: 4,", "num_heads: 4, num_experts: 4,")), "S006")
    assert "experts_per_token" in d.message
    d = only(load(TINY.replace("num_heads: 4,", "num_heads: 4, num_experts: 2, experts_per_token: 3,")), "S013")
    assert "exceeds" in d.message


def test_rotary_features_turn_in_pairs():
    """An odd head size (or MLA's rotary part) cannot carry rotary positions in any engine; learned positions can."""
    d = only(load(TINY.replace("num_heads: 4,", "num_heads: 4, head_dim: 15,")), "S013")
    assert d.fields[0] == "model.head_dim" and "odd" in d.message
    d = only(load(TINY.replace("hidden_size: 64", "hidden_size: 36")), "S013")
    assert d.fields[0] == "model.num_heads" and "hidden_size / num_heads is 9" in d.message
    assert load(
        TINY.replace("hidden_size: 64", "hidden_size: 36").replace(
            "ffn_hidden_size: 128", "ffn_hidden_size: 128, position_embedding: learned"
        )
    ).ok
    latent = "num_heads: 4, kv_lora_rank: 8, qk_nope_head_dim: 8, qk_rope_head_dim: 3, v_head_dim: 8,"
    d = only(load(TINY.replace("num_heads: 4,", latent)), "S013")
    assert d.fields[0] == "model.qk_rope_head_dim"


def test_latent_attention_fields_come_together():
    latent = "kv_lora_rank: 8, qk_nope_head_dim: 8, qk_rope_head_dim: 4, v_head_dim: 8,"
    assert load(TINY.replace("num_heads: 4,", "num_heads: 4, " + latent)).ok
    d = only(load(TINY.replace("num_heads: 4,", "num_heads: 4, q_lora_rank: 8,")), "S013")
    assert d.fields == ("model.q_lora_rank",) and "kv_lora_rank" in d.message
    d = only(
        load(TINY.replace("num_heads: 4,", "num_heads: 4, kv_lora_rank: 8, qk_rope_head_dim: 4, v_head_dim: 8,")),
        "S006",
    )
    assert "qk_nope_head_dim" in d.message
    d = only(load(TINY.replace("num_heads: 4,", "num_heads: 4, num_kv_heads: 2, " + latent)), "S013")
    assert d.fields[0] == "model.num_kv_heads"
    d = only(load(TINY.replace("num_heads: 4,", "num_heads: 4, head_dim: 16, " + latent)), "S013")
    assert d.fields[0] == "model.head_dim"
    # learned positions beside MLA's rotary part: Megatron's default embedding with its MLA (both held)
    both = load(TINY.replace("num_heads: 4,", "num_heads: 4, position_embedding: learned, " + latent))
    assert both.ok, [d.text() for d in both.diagnostics]


MODULES = """\
model:
  family: modules
  parameters:
    - {name: embed, shape: [256, 64], role: embedding, shared_group: tied}
    - {name: head, shape: [256, 64], role: head, shared_group: tied}
    - {name: w1, shape: [4, 64, 128], role: expert, layer: 0}
    - {name: w2, shape: [4, 128, 64], role: expert, layer: 0}
mesh: {dp_shard: 2}
training: {global_batch_size: 8, micro_batch_size: 4}
backend: torch
resources: {devices: 2, memory: 1GiB}
"""


def test_modules_family():
    r = load(MODULES)
    assert r.ok, [d.text() for d in r.diagnostics]
    assert [p.name for p in r.spec.model.parameters] == ["embed", "head", "w1", "w2"]
    d = only(load(MODULES.replace("name: head", "name: embed")), "S002")
    assert d.fields == ("model.parameters[1].name",) and d.line == 5
    d = only(load(MODULES.replace("shape: [256, 64], role: head", "shape: [64, 256], role: head")), "S013")
    assert "shared_group 'tied'" in d.message
    d = only(load(MODULES.replace("[4, 128, 64]", "[8, 128, 64]")), "S013")
    assert "number of experts" in d.message


HMM = """\
model:
  family: distribution
  shared:
    t: {type: transitions, num_states: 3}
  root:
    type: mixture
    components:
      - {type: hmm, num_states: 3, transitions: {ref: t}, emission: {type: gaussian, dim: 2}}
      - {type: hmm, num_states: 3, transitions: {ref: t}, emissions: [{type: poisson}, {type: poisson}, \
{type: poisson}]}
mesh: {dp_replicate: 2}
training: {global_batch_size: 8, micro_batch_size: 4}
backend: torch
resources: {devices: 2, memory: 1GiB}
"""


def test_distribution_tree_with_shared_transitions():
    r = load(HMM)
    assert r.ok, [d.text() for d in r.diagnostics]
    root = r.spec.model.root
    assert root.num_components == 2
    assert root.components[0].transitions.ref == "t"


def test_distribution_errors():
    d = only(load(HMM.replace("{ref: t}, emission", "{ref: tt}, emission")), "S007")
    assert "did you mean 't'?" in d.hint and d.fields == ("model.root.components[0].transitions.ref",)
    d = only(load(HMM.replace("num_states: 3}", "num_states: 4}")), "S013")
    assert "num_states=3" in d.message and "num_states=4" in d.message
    d = only(load(HMM.replace("[{type: poisson}, {type: poisson}, {type: poisson}]", "[{type: poisson}]")), "S005")
    assert "needs 3 emissions" in d.message
    d = only(load(HMM.replace("type: mixture", "type: mixtrue")), "S005")
    assert "did you mean 'mixture'?" in d.hint
    d = only(load(HMM.replace("components:", "repeat: 2\n    components:")), "S005")
    assert "not both" in d.message


def test_ref_cycles_print_the_cycle():
    text = """\
    model:
      family: distribution
      shared:
        a: {type: mixture, components: [{ref: b}]}
        b: {type: composite, factors: [{ref: c}]}
        c: {type: sequence, base: {ref: a}, length: {type: poisson}}
      root: {ref: a}
    mesh: {dp_replicate: 2}
    training: {global_batch_size: 8}
    backend: torch
    resources: {devices: 2, memory: 1GiB}
    """
    r = load(text)
    cycles = [d for d in r.diagnostics if d.code == "S008"]
    assert len(cycles) == 1
    assert "a -> b -> c -> a" in cycles[0].message
    assert cycles[0].line == 4


def test_unknown_backend_names_the_registered():
    d = only(load(TINY.replace("backend: torch", "backend: Megatorn")), "S009")
    assert "did you mean 'megatron'?" in d.hint and "torch" in d.hint
    assert load(TINY.replace("backend: torch", "backend: TORCH")).ok


def test_mesh_order_must_be_a_permutation():
    d = only(load(TINY.replace("tp: 2}", "tp: 2, order: tp-cp-dp-pp}")), "S005")
    assert "mesh.order" in d.message and "exactly once" in d.message
    assert load(TINY.replace("tp: 2}", "tp: 2, order: tp-cp-ep-dp-pp}")).ok


def test_elastic_range():
    d = only(load(TINY + "elastic: {min_world_size: 8, max_world_size: 4}\n"), "S005")
    assert "min_world_size (8) is larger" in d.message
    assert load(TINY + "elastic: {min_world_size: 4, max_world_size: 16, multiple_of: 4}\n").ok


def test_a_flood_of_problems_is_capped_and_counted():
    r = load("\n".join(f"k{j}: {j}" for j in range(500)))
    assert len(r.diagnostics) == 101
    assert r.diagnostics[-1].code == "S010" and "more schema problems not shown" in r.diagnostics[-1].message


@pytest.mark.parametrize(
    "field, value, meant",
    [
        ("precision", "BF16", "bf16"),
        ("precision", "bfloat16", "bf16"),
        ("precision", "float32", "fp32"),
        ("optimizer", "AdamW", "adamw"),
        ("optimizer", "ADAM", "adam"),
        ("precision", "bf61", "bf16"),
    ],
)
def test_did_you_mean_matches_case_and_engine_spellings_first(field, value, meant):
    text = f"""\
model: {{family: transformer, vocab_size: 256, hidden_size: 64, num_layers: 4, num_heads: 4, ffn_hidden_size: 128}}
mesh: {{dp_shard: 2}}
training: {{global_batch_size: 2, seq_len: 32, {field}: {value}}}
backend: torch
resources: {{devices: 2, memory: 2GiB}}
"""
    (d,) = load_spec_text(text, "case.yaml").diagnostics
    assert d.code == "S005" and d.hint == f"did you mean {meant!r}?"

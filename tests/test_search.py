"""`mixle-compile plan`: the search returns plans `check` accepts and the lowering builds, fastest
first, on the spec's devices and global batch; the verifier's rules read with values agree with
the solver; bad input exits 2, no valid plan exits 1 with the rules that refused."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
from pathlib import Path

import pytest
import yaml

from mixle_compile import cli
from mixle_compile.check import check_loaded
from mixle_compile.compile import compile_loaded
from mixle_compile.lower.lowering import lower
from mixle_compile.search import (
    MESH_FIELDS,
    MESH_KEY,
    TOLERANCE,
    VARYING,
    RuleSets,
    SearchInputError,
    _Pricer,
    _symbol_values,
    enumerate_meshes,
    read_request,
    search,
)
from mixle_compile.spec import load_spec, load_spec_text
from mixle_compile.step_time import predict_lowered
from mixle_compile.verify import plan_facts
from mixle_compile.verify.engine import PlanVerifier, Values
from mixle_compile.verify.facts import ENUMS
from mixle_compile.verify.logic import concrete
from mixle_compile.verify.rule import rules_for
from mixle_compile.verify.rules.memory import DEVICE_MEMORY, per_rank_bytes
from mixle_compile.verify.symbols import Symbols, broken_rules, broken_rules_reading, with_values
from tests.conftest import EXAMPLES, ROOT

DENSE = {
    "family": "transformer",
    "vocab_size": 1024,
    "hidden_size": 256,
    "num_layers": 8,
    "num_heads": 8,
    "num_kv_heads": 4,
    "ffn_hidden_size": 768,
}
MOE = {**DENSE, "num_experts": 8, "experts_per_token": 2, "moe_ffn_hidden_size": 256, "moe_layer_frequency": 2}
# dense layers first, then MoE layers with a gated shared expert (DeepSeek's and Qwen2-MoE's shapes)
MOE_SHARED = {
    **MOE,
    "moe_layer_frequency": 1,
    "moe_first_layer": 2,
    "moe_shared_expert_hidden_size": 384,
    "moe_shared_expert_gate": True,
}
MODELS = {"dense": DENSE, "moe": MOE, "moe-shared": MOE_SHARED}
BACKENDS = ({"name": "torch"}, {"name": "torchtitan", "version": "0.2"}, {"name": "megatron", "version": "0.16"})


def spec_text(
    model: dict,
    devices: int,
    backend: dict,
    *,
    memory: str = "8GiB",
    global_batch: int = 32,
    seq: int = 512,
    mesh: dict | None = None,
    **training,
) -> str:
    data = {
        "model": model,
        "training": {"global_batch_size": global_batch, "seq_len": seq, **training},
        "backend": backend,
        "resources": {"devices": devices, "kind": "h100", "memory": memory},
    }
    if mesh is not None:
        data["mesh"] = mesh
    return yaml.safe_dump(data, sort_keys=False)


def searched(tmp_path: Path, text: str, top: int = 3, devices: int | None = None):
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return search(read_request(path, devices=devices), top=top)


def run_cli(capsys, *argv):
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


CASES = [
    (model, devices, backend)
    for model in ("dense", "moe", "moe-shared")
    for devices in (4, 16)
    for backend in BACKENDS
    if not (model != "dense" and backend["name"] == "torch" and devices == 4)
    and not (model == "moe-shared" and devices == 4)
]


@pytest.mark.parametrize("model,devices,backend", CASES, ids=lambda x: x["name"] if isinstance(x, dict) else str(x))
def test_every_returned_plan_checks_compiles_keeps_the_batch_and_is_ranked_by_its_step_time(
    tmp_path, model, devices, backend
):
    outcome = searched(tmp_path, spec_text(MODELS[model], devices, backend))
    assert outcome.plans, outcome.reason
    assert outcome.refused_by_check == 0
    seconds = [p.step.seconds for p in outcome.plans]
    assert seconds == sorted(seconds)
    for plan in outcome.plans:
        loaded = load_spec_text(yaml.safe_dump(plan.spec_data), "plan.yaml")
        result = compile_loaded(loaded)
        assert result.plan is not None, [d.text() for d in result.check.diagnostics]
        assert not result.check.errors
        v = plan.values
        assert loaded.spec.training.global_batch_size == 32
        assert (
            v["dp_replicate"]
            * v["dp_shard"]
            * v["micro_batch_size"]
            * v["microbatches"]
            * v["gradient_accumulation_steps"]
            == 32
        )
        assert v["dp_replicate"] * v["dp_shard"] * v["tp"] * v["pp"] * v["cp"] == devices
        # The search's step time is the lowered plan's, which `explain` shows.
        exact = predict_lowered(loaded.spec, lower(loaded.spec, schedule=False)).seconds
        assert plan.step.seconds == pytest.approx(exact, rel=0.02)


@pytest.mark.parametrize("backend", BACKENDS[1:], ids=lambda b: b["name"])
def test_the_best_first_search_finds_the_best_of_an_exhaustive_screen(tmp_path, backend):
    text = spec_text(DENSE, 32, backend, memory="1GiB", global_batch=64, seq=2048)
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    req = read_request(path)
    outcome = search(req, top=3, variants=True)
    per_mesh = search(req, top=10)
    rule_sets = RuleSets(req, tight=True)  # errors only, per layer split
    pricer = _Pricer(req)
    valid, best_of_mesh = [], {}
    parts = 0
    for mesh in enumerate_meshes(req):
        bound = pricer.bound(mesh)
        # the search prices a mesh's schedules apart, each under the bound of the mesh cut to it
        part_bounds = [(sc, pricer.bound(dataclasses.replace(mesh, schedules=[sc]))) for sc in mesh.schedules]
        parts += len(part_bounds) > 1
        for values in mesh.candidates():
            seconds = pricer.price(values).seconds
            assert bound <= seconds * (1 + 1e-9), (mesh.degrees, values)  # the bound is one
            ((_, part),) = [(sc, b) for sc, b in part_bounds if all(values.get(k) == sc[k] for k in sc)]
            assert bound <= part <= seconds * (1 + 1e-9), (mesh.degrees, values)
            facts, cheap, memory = rule_sets(values)
            if not broken_rules(facts, cheap + memory, _symbol_values(values, ENUMS)):
                valid.append(seconds)
                key = tuple(values[k] for k in MESH_KEY)
                best_of_mesh[key] = min(seconds, best_of_mesh.get(key, math.inf))
    valid.sort()
    assert parts > 5
    assert len(valid) > 10
    assert len(outcome.plans) == 3
    for plan, best in zip(outcome.plans, valid, strict=False):
        assert plan.step.seconds <= best * (1 + TOLERANCE) ** 2
    # One plan per mesh: the meshes differ and each is as fast as the best meshes of the screen.
    assert len(best_of_mesh) > 10 and len(per_mesh.plans) == 10
    assert len({tuple(p.values[k] for k in MESH_KEY) for p in per_mesh.plans}) == 10
    for plan, best in zip(per_mesh.plans, sorted(best_of_mesh.values()), strict=False):
        assert plan.step.seconds <= best * (1 + TOLERANCE) ** 2
    assert outcome.screened < outcome.enumerated / 4  # the point of the bounds: few candidates are screened


def test_fixed_fields_stay_and_auto_fields_are_searched(tmp_path):
    text = spec_text(
        DENSE, 16, BACKENDS[1], mesh={"tp": 2, "dp_shard": "auto", "pp": "auto"}, activation_checkpointing="full"
    )
    outcome = searched(tmp_path, text, top=4)
    assert outcome.plans
    for plan in outcome.plans:
        assert plan.values["tp"] == 2 and plan.values["cp"] == 1 and plan.values["dp_replicate"] == 1
        assert plan.values["activation_checkpointing"] == "full"
    assert {"mesh.pp", "mesh.dp_shard"} <= outcome.request.searched
    assert "mesh.cp" not in outcome.request.searched
    # micro-batching splits the batch: chosen with the micro-batch size unless the spec states it
    assert {
        "mesh.microbatches",
        "mesh.gradient_accumulation_steps",
        "training.micro_batch_size",
    } <= outcome.request.searched


def test_devices_flag_searches_the_mesh_fields_left_out(tmp_path):
    outcome = searched(tmp_path, spec_text(DENSE, 4, BACKENDS[0], mesh={"tp": 1}), devices=8)
    assert outcome.plans and outcome.request.devices == 8
    assert all(p.values["tp"] == 1 for p in outcome.plans)
    assert len({(p.values["dp_shard"], p.values["pp"], p.values["cp"]) for p in outcome.plans}) > 1


def test_concrete_rules_agree_with_the_solver_on_random_plans():
    rng = random.Random(7)
    verifier = PlanVerifier()
    files = sorted((ROOT / "tests" / "corpus" / "production" / "torchtitan").glob("*.yaml"))[:6]
    files += sorted((ROOT / "examples").glob("*.yaml"))
    compared = 0
    for path in files:
        loaded = load_spec(path)
        if not loaded.ok or loaded.spec.model.family == "distribution":
            continue
        facts = plan_facts(loaded.spec)
        if facts.dp_shard_auto or facts.pipeline_layers:
            continue
        rules = rules_for(facts)
        for _ in range(12):
            values = {
                s: rng.choice([1, 1, 2, 3, 4, 8])
                for s in (*MESH_FIELDS, "micro_batch_size", "virtual_pipeline_stages")
                if facts.has(s)
            }
            values.update(
                activation_checkpointing=rng.randrange(3),
                pipeline_schedule=rng.randrange(3),
                distributed_optimizer=rng.random() < 0.5,
                sequence_parallel=rng.random() < 0.5,
            )
            fields = tuple(dataclasses.replace(f, value=values.get(f.symbol, f.value)) for f in facts.fields)
            pinned = dataclasses.replace(facts, fields=fields)
            solved = {r.code for r in verifier.violated(pinned)}
            assert {r.code for r in broken_rules(facts, rules, values)} == solved, (path.name, values)
            # The memory rule's bound itself, not only its verdict, is the same number both ways.
            if facts.footprint is not None:
                encoding = verifier.encoding(pinned, (DEVICE_MEMORY,))
                exact = Values(encoding.symbols, encoding.model(pinned), pinned)
                with concrete():
                    read = per_rank_bytes(Symbols(with_values(facts, values), values={}))
                for kind, term in per_rank_bytes(encoding.symbols).items():
                    assert float(read[kind]) == pytest.approx(float(exact.eval(term)), rel=1e-9), (
                        path.name,
                        kind,
                        values,
                    )
            compared += 1
    assert compared >= 50


def test_a_rule_refusing_without_reading_a_setting_refuses_whatever_that_setting_is():
    loaded = load_spec(ROOT / "tests" / "corpus" / "production" / "torchtitan" / "llama3_8b_8gpu_fsdp8.yaml")
    facts = plan_facts(loaded.spec.model_copy(update={"backend": "megatron"}))
    rules = rules_for(facts)
    rng = random.Random(3)
    checked = 0
    for _ in range(150):
        values = {
            "pp": rng.choice([1, 2, 3, 5, 6]),
            "virtual_pipeline_stages": rng.choice([1, 2, 3]),
            "microbatches": rng.choice([1, 2, 4, 8]),
            "micro_batch_size": rng.choice([1, 2, 4]),
            "activation_checkpointing": rng.randrange(3),
            "pipeline_schedule": rng.randrange(3),
            "tp": rng.choice([1, 2, 3]),
        }
        for rule, read in broken_rules_reading(facts, rules, values):
            if "*" in read:
                continue
            # the settings that vary within one mesh and schedule (search.VARYING)
            for name, options in (
                ("micro_batch_size", [1, 2, 4, 8]),
                ("microbatches", [1, 3, 16]),
                ("gradient_accumulation_steps", [1, 2]),
                ("activation_checkpointing", [0, 1, 2]),
                ("distributed_optimizer", [False, True]),
            ):
                assert name in VARYING
                if name in read:
                    continue
                for option in options:
                    again = {r.code for r in broken_rules(facts, rules, {**values, name: option})}
                    assert rule.code in again, (rule.code, read, values, name, option)
                    checked += 1
    assert checked > 100


def test_what_a_refusing_rule_read_is_recorded():
    loaded = load_spec(ROOT / "tests" / "corpus" / "production" / "torchtitan" / "llama3_8b_8gpu_fsdp8.yaml")
    facts = plan_facts(loaded.spec.model_copy(update={"backend": "megatron"}))
    reads = dict(
        (r.code, read)
        for r, read in broken_rules_reading(
            facts, rules_for(facts), {"pp": 3, "dp_shard": 1, "virtual_pipeline_stages": 2, "pipeline_schedule": 1}
        )
    )
    assert {"pp", "virtual_pipeline_stages", "layers"} <= reads["P001"]  # 32 layers over 3 * 2 stages
    assert "pipeline_schedule" in reads["P007"]  # virtual stages need the interleaved schedule, read through is_
    assert "R001" not in reads or "*" in reads["R001"]  # the memory rule reads the footprint beyond attributes


def test_plan_cli_writes_a_spec_that_checks_clean(capsys, tmp_path):
    spec = tmp_path / "auto.yaml"
    spec.write_text(spec_text(DENSE, 8, BACKENDS[1], mesh={"dp_shard": "auto", "tp": "auto", "pp": "auto"}))
    out_spec = tmp_path / "chosen.yaml"
    status, out, err = run_cli(capsys, "plan", spec, "--top", "2", "--write", out_spec)
    assert status == 0, err
    assert "#1 " in out and "#2 " in out and "loses to #1" in out
    assert run_cli(capsys, "check", out_spec)[0] == 0
    written = yaml.safe_load(out_spec.read_text())
    assert written["resources"]["memory"] == "8GiB"  # the spec's own spelling is kept
    status, out, _ = run_cli(capsys, "plan", spec, "--format", "json", "--top", "3")
    data = json.loads(out)
    assert status == 0 and data["found"] and len(data["plans"]) == 3
    assert [p["rank"] for p in data["plans"]] == [1, 2, 3]


@pytest.mark.parametrize(
    "text,needle",
    [
        ("model: {family: transformer}\n", "global_batch_size"),
        ("- a list\n", "mapping"),
        (
            spec_text(DENSE, 8, BACKENDS[0]).replace("global_batch_size: 32", "global_batch_size: auto"),
            "global_batch_size",
        ),
        (spec_text(DENSE, 8, BACKENDS[0], mesh={"tp": "sideways"}), "tp"),
        (spec_text(DENSE, 8, BACKENDS[0], mesh={"tp": 3, "dp_shard": "auto"}), "divide"),
        (spec_text(DENSE, 8, BACKENDS[0]) + "elastic: {min_world_size: 4, max_world_size: 8}\n", "elastic"),
        (spec_text(DENSE, 8, {"name": "torch"}, pipeline_layers=[4, 4]), "pipeline_layers"),
        # models and devices the step-time model cannot price: said as such, not as an internal error
        ((EXAMPLES / "gaussian-mixture.yaml").read_text(), "this model is a distribution model"),
        (spec_text(DENSE, 8, BACKENDS[0]).replace("kind: h100", "kind: tpu-x"), "resources.throughput"),
    ],
)
def test_bad_input_exits_2_with_a_message(capsys, tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    status, out, err = run_cli(capsys, "plan", path)
    assert status == 2
    assert needle in err and "Traceback" not in err and "internal error" not in err and "{" not in err


def test_missing_file_and_bad_flags_exit_2(capsys, tmp_path):
    assert run_cli(capsys, "plan", tmp_path / "nope.yaml")[0] == 2
    path = tmp_path / "s.yaml"
    path.write_text(spec_text(DENSE, 8, BACKENDS[0]))
    assert run_cli(capsys, "plan", path, "--top", "0")[0] == 2
    # a device budget beyond what a spec takes is refused as the flag's, not as mesh fields'
    status, _, err = run_cli(capsys, "plan", path, "--devices", "100000000")
    assert status == 2 and "--devices: must be at most 1,048,576" in err and "dp_shard" not in err
    with pytest.raises(SearchInputError):
        read_request(tmp_path / "nope.yaml")


def test_no_valid_plan_exits_1_naming_the_rule_that_refused(capsys, tmp_path):
    path = tmp_path / "huge.yaml"
    big = {**DENSE, "hidden_size": 8192, "num_layers": 32, "num_heads": 64, "num_kv_heads": 8, "ffn_hidden_size": 28672}
    path.write_text(spec_text(big, 2, BACKENDS[1], memory="1GiB"))
    status, out, err = run_cli(capsys, "plan", path)
    assert status == 1
    assert "R001" in err and "device-memory" in err
    assert "no valid plan" in out
    # the counts are of one unit: no rule refuses more candidates than were enumerated
    import re

    enumerated = int(re.search(r"every one of the ([\d,]+) candidates", err).group(1).replace(",", ""))
    counts = [int(n.replace(",", "")) for n in re.findall(r"\(([\d,]+) candidates?\)", err)]
    assert counts and max(counts) <= enumerated


def test_no_factorisation_exits_1_saying_why(capsys, tmp_path):
    path = tmp_path / "odd.yaml"
    path.write_text(spec_text(DENSE, 8, BACKENDS[0], global_batch=3, mesh={"tp": 1, "pp": 1, "cp": 1}))
    status, _, err = run_cli(capsys, "plan", path)
    assert status == 1 and "divides the global batch 3" in err


@pytest.mark.slow
@pytest.mark.parametrize("devices", [32, 64, 128, 256])
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b["name"])
def test_sweep_every_plan_checks_and_compiles(tmp_path, devices, backend):
    for model in (
        DENSE,
        MOE,
        MOE_SHARED,
        {**DENSE, "num_layers": 24, "hidden_size": 512, "num_heads": 16, "num_kv_heads": 8},
    ):
        outcome = searched(
            tmp_path, spec_text(model, devices, backend, global_batch=256, seq=1024, memory="2GiB"), top=5
        )
        assert outcome.refused_by_check == 0
        for plan in outcome.plans:
            result = compile_loaded(load_spec_text(yaml.safe_dump(plan.spec_data), "plan.yaml"))
            assert result.plan is not None and not result.check.errors


def test_plan_cli_lists_one_plan_per_mesh_unless_asked_for_variants(capsys, tmp_path):
    spec = tmp_path / "auto.yaml"
    spec.write_text(spec_text(DENSE, 32, BACKENDS[1], memory="1GiB", global_batch=64, seq=2048))

    def meshes(*flags):
        status, out, err = run_cli(capsys, "plan", spec, "--format", "json", "--top", "10", *flags)
        assert status == 0, err
        return [tuple(p["settings"][k] for k in MESH_KEY) for p in json.loads(out)["plans"]]

    distinct, variants = meshes(), meshes("--variants")
    assert len(distinct) == len(set(distinct)) == 10
    assert len(set(variants)) < len(variants) == 10  # settings variants of one mesh fill the list
    assert distinct[0] == variants[0]


def test_plans_keep_the_allocator_reserve_unless_tight(tmp_path):
    # Device memory between the fastest plan's live tensors and its live tensors plus the allocator's
    # reserve: check accepts that plan with the R002 warning; the search keeps to plans without it.
    first = searched(tmp_path, spec_text(DENSE, 8, BACKENDS[1], memory="1GiB", global_batch=64, seq=2048), top=1)
    fastest = first.plans[0]
    device = int(fastest.memory_bytes * 0.95)  # memory_bytes counts the reserve; the live bytes are 1/1.125 of it
    text = spec_text(DENSE, 8, BACKENDS[1], memory=f"{device}B", global_batch=64, seq=2048)

    def warned(plan) -> bool:
        checked = check_loaded(load_spec_text(yaml.safe_dump(plan.spec_data), "plan.yaml"))
        assert not checked.errors
        return any(d.code == "R002" for d in checked.diagnostics)

    path = tmp_path / "spec.yaml"
    path.write_text(text)
    kept = search(read_request(path), top=3)
    tight = search(read_request(path), top=3, tight=True)
    assert kept.plans and tight.plans
    assert not any(warned(p) for p in kept.plans)
    assert all(p.memory_bytes <= device for p in kept.plans)
    assert any(warned(p) for p in tight.plans)  # the fastest, or one that ties with it
    assert tight.plans[0].step.seconds <= kept.plans[0].step.seconds
    assert kept.rejections["R002"] > 0


@pytest.mark.parametrize("checkpointing", ["selective", "full"])
def test_under_async_tensor_parallelism_the_search_prices_each_collective_as_the_plan_does(tmp_path, checkpointing):
    # Each tp collective hides inside the matmuls it is fused with, the recomputed ones included: the
    # search's summed pricing is the lowered plan's, which `explain` shows.
    text = spec_text(
        DENSE,
        16,
        {"name": "torchtitan", "version": "0.2"},
        async_tensor_parallel=True,
        sequence_parallel=True,
        compile=True,
        activation_checkpointing=checkpointing,
        mesh={"tp": 4, **dict.fromkeys(("dp_replicate", "dp_shard", "pp", "microbatches"), "auto")},
    )
    outcome = searched(tmp_path, text, top=20)
    with_tp = [p for p in outcome.plans if p.values["tp"] > 1]
    assert with_tp, [p.mesh_text() for p in outcome.plans]
    for plan in with_tp:
        loaded = load_spec_text(yaml.safe_dump(plan.spec_data), "plan.yaml")
        exact = predict_lowered(loaded.spec, lower(loaded.spec, schedule=False))
        assert plan.step.seconds == pytest.approx(exact.seconds, rel=0.02)
        assert plan.step.exposed_communication.get("tp", 0) == pytest.approx(
            exact.exposed_communication.get("tp", 0), rel=0.02, abs=1e-6
        )


def test_megatron_balanced_uneven_splits_are_the_valid_ones_with_the_lightest_busiest_rank():
    """layer_split.megatron_uneven_balanced against every first/last setting Megatron accepts."""
    from mixle_compile.layer_split import megatron_uneven, megatron_uneven_balanced

    for layers, pp, v in itertools.product(range(1, 40), (2, 3, 4, 8), (1, 2, 3)):
        values = [None, *range(1, layers + 1)]
        valid = {
            counts
            for first, last in itertools.product(values, values)
            if (counts := megatron_uneven(layers, pp, v, first, last)) is not None
        }

        def busiest(counts, pp=pp, v=v):
            return max(sum(counts[c * pp + s] for c in range(v)) for s in range(pp))

        got = megatron_uneven_balanced(layers, pp, v)
        assert len(set(got)) == len(got) and set(got) <= valid
        if not valid:
            assert got == ()
            continue
        least = min(busiest(c) for c in valid)
        assert {c for c in valid if busiest(c) == least} == set(got), (layers, pp, v)


def test_megatron_layers_that_split_neither_evenly_nor_accounted_are_searched_with_first_and_last_set(tmp_path):
    """9 layers split over 4 stages neither evenly nor with the embedding or loss counted (10 and 11
    slots); Megatron's first/last-stage settings do ([3, 2, 2, 2], [1, 3, 3, 2], ...): the search offers
    the most balanced, and each plan it returns checks, compiles and exports with those flags."""
    from mixle_compile.export import export_spec
    from mixle_compile.layer_split import megatron_uneven_of

    mesh = {"dp_replicate": "auto", "dp_shard": 1, "tp": "auto", "pp": 4, "cp": "auto"}
    text = spec_text({**DENSE, "num_layers": 9}, 16, {"name": "megatron", "version": "0.16"}, mesh=mesh)
    outcome = searched(tmp_path, text, top=3)
    assert outcome.plans, outcome.reason
    for plan in outcome.plans:
        split = plan.spec_data["training"]["pipeline_layers"]
        assert megatron_uneven_of(split, 9, 4, plan.values["virtual_pipeline_stages"]) is not None, split
        assert max(split) == 3  # the busiest rank holds ceil(9 / 4) layers
        loaded = load_spec_text(yaml.safe_dump(plan.spec_data), "plan.yaml")
        result = compile_loaded(loaded)
        assert result.plan is not None and not result.check.errors
    args = export_spec(load_spec_text(yaml.safe_dump(outcome.plans[0].spec_data), "p.yaml").spec, "megatron")
    script = args.files[args.main]
    assert "--decoder-first-pipeline-num-layers" in script and "--decoder-last-pipeline-num-layers" in script


def test_megatron_multi_token_prediction_layouts_are_searched_and_export_as_layouts(tmp_path):
    """13 layers and one MTP depth over 4 pipeline ranks of 2 virtual stages: no even, accounted or
    first/last split holds [1, 2, 2, 2, 2, 2, 2, 0], the layout that counts the embedding, the loss and
    the depth as a layer each (16 slots; the rule of Megatron-Bridge's DeepSeek-V3 "Et|(tt|)*30mL"). The
    search offers it, and a plan returned with it checks, compiles, exports as
    --pipeline-model-parallel-layout and reads back the same split."""
    from mixle_compile.export import export_spec
    from mixle_compile.importers import ImportOptions, read_any
    from mixle_compile.layer_split import megatron_mtp_counted
    from mixle_compile.search import _schedule_choices

    def choices(name, values):
        return values

    counted = (1, 2, 2, 2, 2, 2, 2, 0)
    offered = {"pipeline_schedule": "interleaved_1f1b", "virtual_pipeline_stages": 2, "pipeline_layers": counted}
    assert offered in _schedule_choices(choices, 4, 13, True, 1)
    assert offered not in _schedule_choices(choices, 4, 13, True, 0)
    assert megatron_mtp_counted(61, 8, 4, 1) == (1,) + (2,) * 30 + (0,)
    mesh = {"dp_replicate": "auto", "dp_shard": 1, "tp": 1, "pp": 4, "cp": 1}
    model = {**DENSE, "num_layers": 13, "mtp_num_layers": 1}
    text = spec_text(model, 8, {"name": "megatron", "version": "0.16"}, mesh=mesh, pipeline_schedule="interleaved_1f1b")
    path = tmp_path / "s.yaml"
    path.write_text(text)
    outcome = search(read_request(path), top=40, variants=True)
    plans = [p for p in outcome.plans if p.spec_data["training"].get("pipeline_layers") == list(counted)]
    assert plans, [p.spec_data["training"].get("pipeline_layers") for p in outcome.plans]
    loaded = load_spec_text(yaml.safe_dump(plans[0].spec_data), "plan.yaml")
    result = compile_loaded(loaded)
    assert result.plan is not None and not result.check.errors
    exported = export_spec(loaded.spec, "megatron")
    script = exported.files[exported.main]
    assert "--pipeline-model-parallel-layout 'Et|(t*2|)*6mL'" in script, script
    (tmp_path / exported.main).write_text(script)
    doc, _ = read_any(tmp_path / exported.main, exported.main, ImportOptions(device_memory="8GiB"))
    assert doc.data["training"]["pipeline_layers"] == list(counted)


def test_megatron_layers_that_do_not_split_evenly_are_searched_with_the_embedding_and_loss_counted(tmp_path):
    """6 layers do not split evenly over 4 stages; Megatron's account_for_embedding/loss splits do
    ([1, 2, 2, 1], and over 8 virtual stages [0, 1, 1, 1, 1, 1, 1, 0]): the search offers them, and
    each plan it returns checks, compiles, exports with those flags and reads back the same."""
    from mixle_compile.export import export_spec
    from mixle_compile.layer_split import megatron_accounting

    mesh = {"dp_replicate": "auto", "dp_shard": 1, "tp": "auto", "pp": 4, "cp": "auto"}
    text = spec_text({**DENSE, "num_layers": 6}, 16, {"name": "megatron", "version": "0.16"}, mesh=mesh)
    outcome = searched(tmp_path, text, top=4)
    assert outcome.plans, outcome.reason
    splits = set()
    for plan in outcome.plans:
        split = plan.spec_data["training"]["pipeline_layers"]
        virtual = plan.values["virtual_pipeline_stages"]
        assert megatron_accounting(split, 6, 4, virtual) is not None, split
        splits.add(tuple(split))
        loaded = load_spec_text(yaml.safe_dump(plan.spec_data), "plan.yaml")
        result = compile_loaded(loaded)
        assert result.plan is not None and not result.check.errors
        exact = predict_lowered(loaded.spec, lower(loaded.spec, schedule=False)).seconds
        assert plan.step.seconds == pytest.approx(exact, rel=0.02)
        assert "pipeline_layers [" in plan.training_text()
    assert (1, 2, 2, 1) in splits or (0, 1, 1, 1, 1, 1, 1, 0) in splits
    # Written out as Megatron-LM's flags; the torch runtime's and torchtitan's own splits are not searched.
    args = export_spec(load_spec_text(yaml.safe_dump(outcome.plans[0].spec_data), "p.yaml").spec, "megatron")
    script = args.files[args.main]
    assert "--account-for-embedding-in-pipeline-split" in script and "--account-for-loss-in-pipeline-split" in script
    for backend in BACKENDS[:2]:
        other = searched(tmp_path, spec_text({**DENSE, "num_layers": 6}, 16, backend, mesh=mesh), top=2)
        assert all("pipeline_layers" not in p.values for p in other.plans)


@pytest.mark.parametrize("dispatcher", ["all_to_all", "flex"])
def test_the_search_prices_an_expert_exchange_over_nodes_as_the_lowered_plan_does(tmp_path, dispatcher):
    """Expert parallelism over two nodes: the search's summed pricing of the token exchange (an
    all_to_all's local and remote shares; a flex dispatcher's copies per rank and node) is the lowered
    plan's, and the search keeps the dispatcher."""
    model = {**MOE, "num_experts": 32, "experts_per_token": 4, "moe_layer_frequency": 1}
    text = spec_text(
        model,
        32,
        {"name": "megatron", "version": "0.16"},
        memory="80GiB",
        global_batch=64,
        expert_dispatcher=dispatcher,
        mesh={"ep": 16, **dict.fromkeys(("dp_replicate", "dp_shard", "tp", "pp", "microbatches"), "auto")},
    )
    outcome = searched(tmp_path, text, top=10)
    spanning = [p for p in outcome.plans if p.values["ep"] == 16]
    assert spanning, [p.mesh_text() for p in outcome.plans]
    for plan in spanning:
        loaded = load_spec_text(yaml.safe_dump(plan.spec_data), "plan.yaml")
        assert loaded.spec.training.expert_dispatcher == dispatcher
        exact = predict_lowered(loaded.spec, lower(loaded.spec, schedule=False))
        assert exact.exposed_communication["ep"] > 0
        assert plan.step.exposed_communication["ep"] == pytest.approx(exact.exposed_communication["ep"], rel=0.02)
        assert plan.step.seconds == pytest.approx(exact.seconds, rel=0.02)
    if dispatcher == "flex":  # torch's in-tree runtime has no flex dispatcher (E012)
        from mixle_compile.check import check_loaded

        torch_spec = yaml.safe_load(yaml.safe_dump(spanning[0].spec_data))
        torch_spec["backend"] = "torch"
        result = check_loaded(load_spec_text(yaml.safe_dump(torch_spec), "torch.yaml"))
        assert "E012" in {d.code for d in result.diagnostics}


@pytest.mark.parametrize("entry,asked", [("arguments", None), ("core", None), ("core", True), ("arguments", False)])
def test_the_search_prices_megatrons_pipeline_overlap_as_the_lowered_plan_does(tmp_path, entry, asked):
    # Interleaved pipelines whose stages sit on different nodes: Megatron overlaps their transfers by
    # default from its arguments, and where the spec asks; the search's pricing is the lowered plan's.
    training = {} if asked is None else {"overlap_pipeline_transfers": asked}
    mesh = {"dp_replicate": "auto", "dp_shard": 1, "tp": 1, "pp": 4, "cp": 1}
    text = spec_text(
        {**DENSE, "num_layers": 8},
        8,
        {"name": "megatron", "version": "0.16", "entry": entry},
        mesh=mesh,
        global_batch=64,
        **training,
    ).replace("kind: h100", "kind: h100\n  topology: {devices_per_node: 1}")
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    outcome = search(read_request(path), top=20, variants=True)  # every plan of the one mesh
    interleaved = [p for p in outcome.plans if p.values["virtual_pipeline_stages"] > 1]
    assert interleaved, [p.training_text() for p in outcome.plans]
    expected = (entry == "arguments") if asked is None else asked
    for plan in interleaved:
        loaded = load_spec_text(yaml.safe_dump(plan.spec_data), "plan.yaml")
        exact = predict_lowered(loaded.spec, lower(loaded.spec, schedule=False))
        assert plan.step.seconds == pytest.approx(exact.seconds, rel=0.02)
        assert ("pp" in exact.hidden_communication) == expected
        assert ("pp" in plan.step.hidden_communication) == expected


def test_a_tie_is_named_for_what_orders_it():
    from types import SimpleNamespace

    from mixle_compile.search import _tie_reason

    def plan(seconds, gib):
        return SimpleNamespace(step=SimpleNamespace(seconds=seconds), memory_bytes=gib * 2**30)

    assert _tie_reason(plan(2.0, 30), plan(2.0, 20)) == "the same predicted step time, 10.0GiB more memory per rank"
    assert _tie_reason(plan(2.0, 20), plan(2.0, 20)).endswith(
        "the same memory per rank (ranked by its order in the search)"
    )
    # slower by a hair but lighter: the order is the step time's, and the text says so
    text = _tie_reason(plan(2.0004, 10), plan(2.0, 20))
    assert text == "+0.02% step time, a difference the model does not resolve; 10.0GiB less memory per rank"


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
@pytest.mark.parametrize("first", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS[1:], ids=lambda b: b["name"])
def test_the_search_counts_each_stages_moe_layers_as_the_lowered_plan_does(tmp_path, first, backend, schedule):
    """Dense layers first put the MoE layers unevenly over the pipeline stages: the search prices the
    busiest stage with the MoE layers it holds, as the lowered plan does."""
    model = {**MOE_SHARED, "moe_first_layer": first}
    data = yaml.safe_load(spec_text(model, 16, backend))
    data["mesh"] = {"pp": 2, "ep": 2, "dp_shard": "auto"}
    data["training"]["pipeline_schedule"] = schedule
    if schedule == "interleaved_1f1b":  # two chunks a stage: stage 0 holds layers 0-1 and 4-5
        data["training"]["virtual_pipeline_stages"] = 2
    outcome = searched(tmp_path, yaml.safe_dump(data), top=5)
    assert outcome.plans, outcome.reason
    for plan in outcome.plans:
        loaded = load_spec_text(yaml.safe_dump(plan.spec_data), "plan.yaml")
        exact = predict_lowered(loaded.spec, lower(loaded.spec, schedule=False)).seconds
        assert plan.step.seconds == pytest.approx(exact, rel=0.02)


def test_the_published_deepseek_v3_layout_is_chosen_when_the_split_is_left_open(tmp_path):
    """Megatron-Bridge's DeepSeek-V3 H100 recipe (the corpus file) with its mesh kept and the schedule,
    virtual stages and layer split left to the search: the first plan is the recipe's own layout,
    "Et|(tt|)*30mL" over pp 8 x 4 virtual stages."""
    data = yaml.safe_load(
        (ROOT / "tests/corpus/production/bridge_nemo/bridge_deepseek_v3_h100_bf16_v1.yaml").read_text()
    )
    for key in ("pipeline_layers", "virtual_pipeline_stages", "pipeline_schedule"):
        data["training"].pop(key, None)
    for key in ("microbatches", "gradient_accumulation_steps"):
        data["mesh"].pop(key, None)
    outcome = searched(tmp_path, yaml.safe_dump(data), top=1)
    (best,) = outcome.plans
    assert best.spec_data["training"]["pipeline_layers"] == [1] + [2] * 30 + [0]
    assert best.values["virtual_pipeline_stages"] == 4

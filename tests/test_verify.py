"""The static verifier as a user meets it: rules, conflicts, messages, suggestions, elastic proofs."""

from __future__ import annotations

import dataclasses
import json
import re
import string
import subprocess
import sys

import pytest
import yaml

from mixle_compile import cli
from mixle_compile.diagnostics import CATALOGUE
from mixle_compile.spec import load_spec, load_spec_text
from mixle_compile.verify import RULES, plan_facts, rules_for, verify_plan
from mixle_compile.verify.docs import load_catalogue, rules_markdown
from mixle_compile.verify.engine import PlanVerifier
from tests.conftest import EXAMPLES, ROOT

INVALID = EXAMPLES / "invalid"
LLAMA = (EXAMPLES / "llama3-8b-hsdp-tp.yaml").read_text()
# Rules no example can show: C001/C003/C004 never fire on torch or megatron (both execute every axis
# in every combination and have a distributed optimizer), and P008 is a warning (exit status 0).
WITHOUT_EXAMPLE = {"C001", "C003", "C004", "C007", "P008", "Q004", "R002"}


def run_cli(capsys, *argv):
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def loaded(text: str, name: str = "spec.yaml"):
    result = load_spec_text(text, name)
    assert result.ok, [d.text() for d in result.diagnostics]
    return result


def verify(text: str):
    return verify_plan(loaded(text).spec)


def codes(text: str) -> set[str]:
    return {f.code for f in verify(text).findings}


def path_of(dotted: str) -> tuple:
    """``model.parameters[0].shape`` -> ("model", "parameters", 0, "shape")."""
    out: list = []
    for part in dotted.split("."):
        name, *indices = re.split(r"\[(\d+)\]", part)
        out.append(name)
        out += [int(i) for i in indices if i]
    return tuple(p for p in out if p != "")


# --------------------------------------------------------------------------- the catalogue


def test_every_rule_is_one_documented_unit_with_a_stable_code():
    assert len(RULES) >= 30
    for code, rule in RULES.items():
        assert re.fullmatch(r"[DETPBQCR]\d{3}", code), code
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", rule.name), rule.name
        assert rule.title and rule.docs and rule.engine_reference, code
        assert CATALOGUE[code].title == rule.name  # explain finds it
        assert rule.constraint is not None or code == "D003"  # D003 is the elastic proof


def test_every_rule_has_an_invalid_example_named_after_it():
    examples = {p.name for p in INVALID.glob("*.yaml")}
    for code, rule in RULES.items():
        name = f"{code.lower()}-{rule.name}.yaml"
        assert (name in examples) == (code not in WITHOUT_EXAMPLE), name


def test_torch_and_megatron_name_different_rule_sets():
    torch_set = {r.code for r in RULES.values() if r.in_rule_set("torch")}
    megatron_set = {r.code for r in RULES.values() if r.in_rule_set("megatron")}
    titan_set = {r.code for r in RULES.values() if r.in_rule_set("torchtitan")}
    common = {r.code for r in RULES.values() if r.in_rule_set("common")}
    assert {"E001", "E002", "T005", "P003", "P005"} <= torch_set - megatron_set
    assert {"E003", "E006", "T003", "P004", "Q004"} <= megatron_set - torch_set
    assert {"T003", "P003", "P005"} <= titan_set and not {"T002", "P004", "Q002"} & titan_set
    assert common == torch_set & megatron_set & titan_set


def test_a_plugin_backend_is_checked_with_the_common_rules():
    facts = dataclasses.replace(plan_facts(loaded(LLAMA).spec), backend="acme")
    chosen = {r.code for r in rules_for(facts)}
    assert "T001" in chosen and not chosen & {"T002", "T003", "E001", "E003"}


# --------------------------------------------------------------------------- messages and conflicts


RULE_EXAMPLES = sorted(
    p for p in INVALID.glob("*.yaml") if p.name[0].upper() in "DETPBQCR" and not p.name.startswith("d003")
)


@pytest.mark.parametrize("path", RULE_EXAMPLES, ids=lambda p: p.name)
def test_each_rule_example_points_at_its_first_conflicting_field(capsys, path):
    expected = re.search(r"#\s*expect:\s*(\S+)", path.read_text()).group(1)
    status, out, _ = run_cli(capsys, "check", "--format", "json", path)
    flat = [x for d in json.loads(out) for x in (d, *d["related"])]  # grouped findings are related notes
    (found,) = [d for d in flat if d["code"] == expected]
    assert status == 1 and found["message"] and found["hint"] and found["fields"]
    position = load_spec(path).document.position(path_of(found["fields"][0]))
    assert (found["line"], found["column"]) == (position.line, position.column)


def test_kv_heads_conflict_reads_as_the_two_fields_and_the_arithmetic(capsys, write):
    text = (
        LLAMA.replace("num_heads: 32", "num_heads: 48")
        .replace("num_kv_heads: 8", "num_kv_heads: 6")
        .replace("hidden_size: 4096", "hidden_size: 6144")
    )
    path = write(text)
    status, out, _ = run_cli(capsys, "check", "--format", "json", path)
    (d,) = json.loads(out)
    assert status == 1
    assert d["code"] == "T002"
    assert d["message"] == "mesh.tp=8 and model.num_kv_heads=6 conflict: 6 % 8 != 0 and 8 % 6 != 0"
    assert d["fields"] == ["mesh.tp", "model.num_kv_heads"]
    tp_line = next(i for i, line in enumerate(text.splitlines(), 1) if line.strip().startswith("tp:"))
    assert (d["line"], d["column"]) == (tp_line, 7)


def test_conflicts_name_only_the_fields_that_conflict():
    def fields(text, code):
        finding = next(f for f in verify(text).findings if f.code == code)
        return {f.dotted for f in finding.fields}

    # 100 samples cannot come in 8 accumulation steps at all: two fields suffice, whatever the mesh.
    assert fields(LLAMA.replace("global_batch_size: 128", "global_batch_size: 100"), "B001") == {
        "training.global_batch_size",
        "mesh.gradient_accumulation_steps",
    }
    # 96 = 2 * 1 * 8 * 6 needs a data-parallel size of 6: now the mesh (through dp_shard: auto) is part of it.
    batch = fields(LLAMA.replace("global_batch_size: 128", "global_batch_size: 96"), "B001")
    assert {"training.global_batch_size", "mesh.dp_shard", "resources.devices", "mesh.tp"} <= batch
    assert "model.vocab_size" not in batch and "training.seq_len" not in batch
    world = fields(LLAMA.replace("dp_shard: auto", "dp_shard: 2"), "D001")
    assert world == {"mesh.dp_replicate", "mesh.dp_shard", "mesh.tp", "mesh.pp", "mesh.cp", "resources.devices"}
    memory = fields(LLAMA.replace("memory: 80GiB", "memory: 8GiB"), "R001")
    assert {"resources.memory", "mesh.tp", "training.micro_batch_size", "training.seq_len"} <= memory
    assert not memory & {"model.vocab_size", "training.optimizer", "mesh.gradient_accumulation_steps"}


def test_a_conflict_is_minimal_every_field_is_needed():
    """Dropping any one named field (every unnamed field already free) lets the rule hold."""
    verifier = PlanVerifier()
    for text, code in [
        (LLAMA.replace("global_batch_size: 128", "global_batch_size: 96"), "B001"),
        (LLAMA.replace("dp_shard: auto", "dp_shard: 2"), "D001"),
        ((INVALID / "e002-expert-parallel-domain.yaml").read_text(), "E002"),
    ]:
        facts = plan_facts(loaded(text).spec)
        rule = RULES[code]
        conflict = verifier.conflict(facts, rule)
        _, refuter = verifier.encoding(facts).core_solvers(rule)
        assert verifier._refuted(refuter, verifier.encoding(facts).symbols, list(conflict))
        for f in conflict:
            rest = [g for g in conflict if g is not f]
            assert not verifier._refuted(refuter, verifier.encoding(facts).symbols, rest), (code, f.symbol)


def test_memory_message_gives_the_breakdown_and_the_device():
    (finding,) = verify(LLAMA.replace("memory: 80GiB", "memory: 8GiB")).findings
    assert finding.code == "R001"
    for part in ("weights", "gradients", "optimizer state", "activations", "8GiB of a device"):
        assert part in finding.message
    assert "activation_checkpointing: full" in finding.hint


def test_the_smallest_device_of_a_list_bounds_memory():
    text = LLAMA.replace(
        "  devices: 64\n  kind: h100\n  memory: 80GiB\n  throughput: 989TFLOPS\n",
        "  devices:\n    - {kind: h100, memory: 80GiB, count: 63}\n    - {kind: small, memory: 4GiB, count: 1}\n",
    )
    (finding,) = verify(text).findings
    assert finding.code == "R001" and finding.fields[0].dotted == "resources.devices[1].memory"


def test_batch_hint_names_each_single_change_that_fits():
    (finding,) = verify(LLAMA.replace("global_batch_size: 128", "global_batch_size: 64")).findings
    assert finding.code == "B001"
    assert "training.global_batch_size: 128" in finding.hint and "mesh.gradient_accumulation_steps: 4" in finding.hint
    assert "tp, cp and pp ranks" in finding.message


# --------------------------------------------------------------------------- engines differ


MOE = string.Template("""\
model: {family: transformer, vocab_size: $vocab, hidden_size: 64, num_layers: 2, num_heads: 8, num_kv_heads: $kv,
        ffn_hidden_size: 384, num_experts: 8, experts_per_token: 2, tie_embeddings: $tie}
mesh: {dp_shard: auto, tp: $tp, pp: $pp, ep: $ep, etp: $etp, microbatches: $mb}
training: {global_batch_size: $batch, micro_batch_size: 1, seq_len: 32, sequence_parallel: $sp}
backend: $backend
resources: {devices: 8, memory: 8GiB}
""")


def moe(backend, *, tp=8, pp=1, ep=8, etp=1, kv=8, vocab=256, tie="false", sp="true", mb=1):
    batch = mb * 8 // (tp * pp)  # one sample per micro-batch on each data-parallel rank
    return codes(
        MOE.substitute(
            backend=backend, tp=tp, pp=pp, ep=ep, etp=etp, kv=kv, vocab=vocab, tie=tie, sp=sp, mb=mb, batch=batch
        )
    )


def test_tp_8_with_ep_8_is_valid_on_both_engines():
    # A data-parallel-size check (dp % ep) would refuse this: dp is 1.
    assert moe("torch") == set() and moe("megatron") == set()


def test_engine_specific_rules():
    # etp=3 is no torch layout (E001); etp = tp with ep is one.
    assert moe("torch", etp=3) == {"E001"} and "E003" in moe("megatron", etp=3)
    assert moe("torch", tp=2, ep=4, etp=2) == set() == moe("megatron", tp=2, ep=4, etp=2)
    # Megatron-Core 0.16 replicates KV heads over tp (T002); 0.15 splits them (T003).
    assert moe("torch", tp=4, ep=2, kv=2) == set() == moe("megatron", tp=4, ep=2, kv=2)
    assert moe('{name: megatron, version: "0.15"}', tp=4, ep=2, kv=2) == {"T003"}
    assert moe("torch", tp=2, ep=4, vocab=255) == {"T005"} and moe("megatron", tp=2, ep=4, vocab=255) == set()
    tied = dict(tp=2, pp=2, ep=2, tie="true", mb=8)
    assert moe("torch", **tied) == set() == moe("megatron", **tied)  # both sum the tied copies' gradients
    assert moe("megatron", tp=2, ep=4, sp="false") == {"E006"} and moe("torch", tp=2, ep=4, sp="false") == {"E007"}
    # Megatron-Core's MoE layer refuses tp > 1 without sequence parallelism whatever ep is.
    assert moe("megatron", tp=2, ep=1, sp="false") == {"E006"} and moe("torch", tp=2, ep=1, sp="false") == {"E007"}


# --------------------------------------------------------------------------- the command line


def test_warnings_do_not_change_the_exit_status(capsys):
    status, out, _ = run_cli(capsys, "check", EXAMPLES / "mixtral-moe-ep.yaml")
    assert status == 0
    assert "P008 (warning)" in out and out.rstrip().endswith("All checks passed: 1 file (1 warning).")


def test_suggest_prints_a_patch_that_makes_the_spec_valid(capsys, write):
    for name in (
        "t002-kv-heads-split-or-replicated.yaml",
        "p003-too-few-microbatches.yaml",
        "p002-stages-exceed-layers.yaml",
        "c002-backend-precision.yaml",
    ):
        source = (INVALID / name).read_text()
        status, out, _ = run_cli(capsys, "check", "--suggest", INVALID / name)
        assert status == 1
        patch_text = out[out.index("# " + str(INVALID / name)) :]
        patch_text = patch_text[: patch_text.index("Found ")]
        assert "nearest valid plan on the same" in patch_text
        patch = yaml.safe_load(patch_text)
        spec = yaml.safe_load(source)
        for section, values in patch.items():
            assert section in ("mesh", "training")
            assert not set(values) & {"global_batch_size", "seq_len"}
            spec[section].update(values)
        fixed = write(yaml.safe_dump(spec), name)
        status, out, _ = run_cli(capsys, "check", fixed)
        assert status == 0, out


def test_suggest_in_json(capsys):
    status, out, _ = run_cli(capsys, "check", "--format", "json", "--suggest", INVALID / "b001-global-batch-size.yaml")
    document = json.loads(out)  # the same list of findings as without --suggest, each with its `fix`
    assert status == 1 and [d["code"] for d in document] == ["B001"]
    suggestion = document[0]["fix"]
    assert suggestion["found"] and suggestion["nearest"] and suggestion["changes"]
    assert set(suggestion) == {"file", "found", "nearest", "changes", "patch", "new_warnings"}


def test_suggest_says_when_no_setting_can_fix_the_plan(capsys, write):
    # No mesh or training setting makes a model fit in 1KiB; only the model or the devices could change.
    hopeless = write((INVALID / "r001-device-memory.yaml").read_text().replace("memory: 256KiB", "memory: 1KiB"))
    status, out, _ = run_cli(capsys, "check", "--suggest", hopeless)
    assert status == 1 and "no valid plan on the same devices changes at most" in out


def test_suggest_leaves_the_elastic_section_to_its_hints(capsys):
    status, out, _ = run_cli(capsys, "check", "--suggest", INVALID / "d002-elastic-axis.yaml")
    assert status == 1 and "the plan is valid on its own devices" in out and "dp_shard: auto" in out


def test_elastic_proof_is_reported(capsys, write):
    proved = (
        LLAMA.replace("backend: torch", "backend: megatron")
        + "elastic: {min_world_size: 32, max_world_size: 64, multiple_of: 32}\n"
    )
    status, out, _ = run_cli(capsys, "check", write(proved))
    assert "elastic range 32..64, multiples of 32: proved valid at every one of its 2 world sizes" in out
    assert "C005" in out and status == 1  # megatron declares no elastic restart
    status, out, _ = run_cli(capsys, "check", INVALID / "d003-elastic-range.yaml")
    assert "D003" in out and "6 is the smallest failing world size, where B001" in out


def test_explain_prints_a_code_and_refuses_anything_else(capsys, tmp_path):
    status, out, _ = run_cli(capsys, "explain", "t002")
    assert status == 0 and out.startswith("T002 kv-heads-split-or-replicated") and "Source:" in out
    status, out, _ = run_cli(capsys, "explain", "S003")
    assert status == 0 and "unknown-key" in out
    status, out, _ = run_cli(capsys, "explain", "G002")
    assert status == 0 and "unit-exceeds-device-memory" in out
    status, _, err = run_cli(capsys, "explain", "Z999")
    assert status == 2 and "no diagnostic code Z999" in err
    status, _, err = run_cli(capsys, "explain", str(tmp_path / "neither-a-code-nor-a-file"))
    assert status == 2 and "cannot read" in err


def test_rules_lists_a_backend_rule_set(capsys):
    status, out, _ = run_cli(capsys, "rules", "--backend", "megatron")
    listed = {line.split()[0] for line in out.splitlines()}
    assert status == 0 and {"S001", "T003", "E003", "R001"} <= listed and not {"E001", "P005"} & listed
    status, out, _ = run_cli(capsys, "rules", "--format", "json")
    assert set(RULES) <= {entry["code"] for entry in json.loads(out)}
    status, _, _ = run_cli(capsys, "rules", "--format", "markdown", "--backend", "torch")
    assert status == 2


def test_docs_rules_md_is_generated_from_the_catalogue():
    docs = (ROOT / "docs" / "rules.md").read_text()
    assert docs == rules_markdown(), "run `mixle-compile rules --format markdown > docs/rules.md`"
    load_catalogue()
    for code in CATALOGUE:
        assert re.search(rf"^#+ {code} ", docs, re.M), code


def test_explain_and_rules_do_not_import_torch_and_explain_not_z3():
    code = (
        "import sys; from mixle_compile.cli import main; main(['explain', 'T002']); "
        "print('Z3' if 'z3' in sys.modules else 'NO-Z3', 'TORCH' if 'torch' in sys.modules else 'NO-TORCH')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.splitlines()[-1] == "NO-Z3 NO-TORCH"


# --------------------------------------------------------------------------- frozen data


def test_verification_is_frozen_data():
    verification = verify(LLAMA.replace("global_batch_size: 128", "global_batch_size: 100"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        verification.findings = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        verification.findings[0].message = ""
    with pytest.raises(dataclasses.FrozenInstanceError):
        verification.facts.family = "modules"


def test_a_modules_spec_without_layer_indices_verifies(capsys):
    """Regression: a `modules` model naming no layers is one block, not zero layers."""
    from tests.conftest import EXAMPLES

    status, out, _ = run_cli(capsys, "check", str(EXAMPLES / "modules-mlp.yaml"))
    assert status == 0 and "All checks passed" in out


def test_findings_of_errors_alone_are_the_errors_of_all_findings():
    # The exporter asks for the errors alone: the same findings, with the same conflicts, without
    # looking for the warnings' conflicts.
    text = (ROOT / "tests/corpus/production/megatron_lm/llama3_8b_h100_fp8_tp1_sp_8gpu.yaml").read_text()
    spec = load_spec_text(text.replace("memory: 80GiB", "memory: 40GiB"), "s.yaml").spec
    facts = plan_facts(spec)
    every = PlanVerifier().findings(facts)
    errors = PlanVerifier().findings(facts, errors_only=True)
    assert {f.severity.value for f in every} == {"error", "warning"}
    assert [(f.code, f.message) for f in errors] == [(f.code, f.message) for f in every if f.severity.value == "error"]

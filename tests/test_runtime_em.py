"""EM runtime for distribution models: data-parallel fits against the single-process reference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mixle_compile.plan import load_plan_text
from mixle_compile.plan.artifact import plan_text
from mixle_compile.runtime import RuntimeRefusal, run_plan
from mixle_compile.runtime.em import (
    EM_TOLERANCE,
    em_accounting,
    evidence,
    fit_error,
    initial_params,
    load_data,
    m_step,
    e_step,
    monotone_violations,
    reference_fit,
    sample_data,
    shard_rows,
)
from mixle_compile.runtime.em_plan import read_em_instructions
from mixle_compile.runtime.launch import compile_spec_file

ROOT = Path(__file__).resolve().parent.parent


def spec_text(component: str, *, mesh: str, rows: int, micro: int, steps: int = 5, seed: int = 3, root: str | None = None) -> str:
    root = root or f"""
    type: mixture
    name: m
    component: {component}
    repeat: 3"""
    devices = 1
    for part in mesh.split(","):
        if part.strip() and part.split(":")[0].strip() not in ("microbatches", "gradient_accumulation_steps"):
            devices *= int(part.split(":")[1])
    return f"""
model:
  family: distribution
  root:{root}
mesh: {{{mesh}}}
training:
  global_batch_size: {rows}
  micro_batch_size: {micro}
  precision: fp32
  steps: {steps}
  seed: {seed}
backend: torch
resources:
  devices: {devices}
  kind: cpu
  memory: 4GiB
"""


def compiled(tmp_path: Path, text: str, name: str = "spec.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return compile_spec_file(path)


DIAG = "{type: gaussian, dim: 3, covariance: diag}"
FULL = "{type: gaussian, dim: 3, covariance: full}"
CATEGORICAL = "{type: categorical, num_values: 6}"


# --- the numerics, in one process --------------------------------------------------------------


@pytest.mark.parametrize("component", [DIAG, FULL, CATEGORICAL])
def test_reference_em_never_decreases_the_log_likelihood(tmp_path, component):
    em = read_em_instructions(compiled(tmp_path, spec_text(component, mesh="dp_replicate: 2", rows=400, micro=200)))
    data = sample_data(em)
    _, lls, _ = reference_fit(em, data, 15)
    assert not monotone_violations(lls)
    assert lls[-1] > lls[0]


def test_a_decrease_is_reported():
    assert monotone_violations([-10.0, -9.0, -9.5]) and not monotone_violations([-10.0, -9.0, -9.0])


def test_sharded_statistics_sum_to_the_whole_and_a_shard_alone_does_not(tmp_path):
    """The all_reduce is what makes the fit equal the reference: one shard's statistics do not."""
    em = read_em_instructions(compiled(tmp_path, spec_text(FULL, mesh="dp_replicate: 2", rows=400, micro=200)))
    data = sample_data(em)
    p = initial_params(em, data)
    whole, ll = e_step(em, p, data)
    parts = [e_step(em, p, shard_rows(data, r, 3)) for r in range(3)]
    summed = {k: sum(s[k] for s, _ in parts) for k in whole}
    for k in whole:
        np.testing.assert_allclose(summed[k], whole[k], rtol=1e-12)
    assert abs(sum(x for _, x in parts) - ll) <= 1e-12 * abs(ll)
    alone = m_step(em, p, parts[0][0], len(data))
    assert fit_error(alone, m_step(em, p, whole, len(data))) > 1e-3


def test_accounting_and_evidence_catch_a_missing_or_wrong_reduction(tmp_path):
    doc = compiled(tmp_path, spec_text(DIAG, mesh="dp_replicate: 2", rows=400, micro=200))
    em = read_em_instructions(doc)
    data = sample_data(em)
    ref = reference_fit(em, data, 3)
    good = {"updates": {n: [3, em.expected_bytes(c) * 3] for n, c in em.collectives.items()}, "bookkeeping": {}, "calls": 9}
    assert em_accounting(em, [good, good], 3)["ok"]
    missing = json.loads(json.dumps(good))
    missing["updates"]["model.root:statistics"] = [2, em.expected_bytes(em.collectives["model.root:statistics"]) * 2]
    account = em_accounting(em, [good, missing], 3)
    assert not account["ok"] and "rank 1" in account["errors"][0]
    # Evidence: the reference against itself is exact; statistics of one shard only are not.
    record = {"owned": list(range(em.num_components)), "data_rank": 0, "data_size": 1, "params": ref[0], "lls": ref[1], "history": ref[2]}
    _, errors = evidence(doc, em, [record], [record], ref, 3)
    assert not errors
    wrong = dict(record, history=[{k: v / 2 if k != "model.root" else v for k, v in h.items()} for h in ref[2]])
    updates, errors = evidence(doc, em, [wrong], [wrong], ref, 3)
    assert any("model.root.component:statistics" in e for e in errors)
    assert all(u["numerics_sample_count"] > 0 for u in updates)


def test_data_files_are_read_and_checked(tmp_path):
    em = read_em_instructions(compiled(tmp_path, spec_text(DIAG, mesh="dp_replicate: 2", rows=400, micro=200)))
    x = np.arange(30.0).reshape(10, 3)
    np.save(tmp_path / "x.npy", x)
    np.savetxt(tmp_path / "x.csv", x, delimiter=",")
    np.testing.assert_array_equal(load_data(em, str(tmp_path / "x.npy")), x)
    np.testing.assert_array_equal(load_data(em, str(tmp_path / "x.csv")), x)
    np.save(tmp_path / "bad.npy", np.zeros((10, 2)))
    with pytest.raises(ValueError, match="rows of 3 values"):
        load_data(em, str(tmp_path / "bad.npy"))
    assert [len(shard_rows(x, r, 3)) for r in range(3)] == [4, 3, 3]


# --- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("example", "message"),
    [
        ("examples/composite-nested-mixture.yaml", "root is a 'composite' node"),
        ("examples/hmm-shared-transitions.yaml", "components are hmm"),
    ],
)
def test_what_em_does_not_execute_is_refused_without_torch(example, message):
    script = f"""
import sys
from mixle_compile.runtime import run_plan, RuntimeRefusal
try:
    run_plan({example!r})
except RuntimeRefusal as exc:
    print("refused:", exc)
assert "torch" not in sys.modules
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "refused:" in out.stdout and message in out.stdout


def test_a_mixture_of_mixed_kinds_is_refused(tmp_path):
    root = f"""
    type: mixture
    components: [{DIAG}, {CATEGORICAL}]"""
    with pytest.raises(RuntimeRefusal, match="gaussian"):
        read_em_instructions(compiled(tmp_path, spec_text("", mesh="dp_replicate: 2", rows=400, micro=200, root=root)))


# --- distributed fits --------------------------------------------------------------------------


def check_fit(report, steps: int, rows: int):
    assert report.ok, report.errors
    data = report.data
    assert report.accounting_ok and all(u["match"] for u in data["accounting"]["updates"])
    assert data["log_likelihood_monotone"] and len(data["log_likelihoods"]) == steps
    assert data["evidence"]["fit_max_relative_error"] <= EM_TOLERANCE
    assert report.max_relative_error <= EM_TOLERANCE
    assert all(u.has_numerics_evidence and u.determinism_observed for u in report.evidence)
    np.testing.assert_allclose(data["log_likelihoods"], data["evidence"]["reference_log_likelihoods"], rtol=EM_TOLERANCE)
    receipts = [json.loads(line) for line in report.receipts_path.read_text().splitlines()]
    assert [r["iteration"] for r in receipts] == list(range(steps))
    assert all(r["examples"] == rows for r in receipts)
    per_iteration = sum(u["expected_bytes_float64"] for u in data["accounting"]["updates"]) // steps
    assert all(r["collective_bytes"] == per_iteration > 0 for r in receipts)


def test_full_covariance_mixture_on_four_data_ranks(tmp_path):
    report = run_plan(ROOT / "examples/gaussian-mixture.yaml", steps=4, reference=True, out_dir=tmp_path / "out", progress=False)
    check_fit(report, 4, 4096)
    assert report.world_size == 4


def test_diagonal_mixture_from_a_npy_file_over_dp_shard(tmp_path):
    doc = compiled(tmp_path, spec_text(DIAG, mesh="dp_shard: 2", rows=400, micro=200))
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(-3, 1, (150, 3)), rng.normal(2, 0.5, (150, 3)), rng.normal(6, 1, (101, 3))])
    np.save(tmp_path / "x.npy", x)
    report = run_plan(doc, steps=5, reference=True, data_path=tmp_path / "x.npy", out_dir=tmp_path / "out", progress=False)
    check_fit(report, 5, 401)
    assert {u["group"] for u in report.data["accounting"]["updates"]} == {"dp_shard"}


def test_categorical_mixture_from_a_csv_file(tmp_path):
    root = f"""
    type: mixture
    components: [{CATEGORICAL}, {CATEGORICAL}]"""
    doc = compiled(tmp_path, spec_text("", mesh="dp_replicate: 2", rows=400, micro=200, root=root))
    values = np.random.default_rng(1).integers(0, 6, size=300)
    np.savetxt(tmp_path / "v.csv", values, delimiter=",", fmt="%d")
    report = run_plan(doc, steps=4, reference=True, data_path=tmp_path / "v.csv", out_dir=tmp_path / "out", progress=False)
    check_fit(report, 4, 300)
    # One statistics update per listed component, each counted on its own.
    names = {u["node_id"] for u in report.data["accounting"]["updates"]}
    assert {"model.root.components[0]:statistics", "model.root.components[1]:statistics", "model.root:statistics", "log_likelihood"} == names


def test_a_plan_file_round_trips_into_the_em_worker(tmp_path):
    doc = compiled(tmp_path, spec_text(CATEGORICAL, mesh="dp_replicate: 2", rows=200, micro=100, steps=3))
    path = tmp_path / "plan.json"
    path.write_text(plan_text(doc.model_dump(mode="json")))
    assert load_plan_text(path.read_bytes(), str(path)).content_digest == doc.content_digest
    report = run_plan(path, out_dir=tmp_path / "out", progress=False)
    assert report.ok and report.steps == 3 and report.evidence is None
    assert not monotone_violations(report.data["log_likelihoods"])


# --- component cuts over tp --------------------------------------------------------------------


def test_the_component_owners_follow_the_decomposition(tmp_path):
    doc = compiled(tmp_path, spec_text("{type: gaussian, dim: 2, covariance: full}", mesh="tp: 2", rows=300, micro=300).replace("repeat: 3", "repeat: 5"))
    em = read_em_instructions(doc)
    dec = doc.decomposition
    expected = [None] * 5
    for cut in dec["cuts"]:
        for position in range(cut["start"], cut["stop"]):
            expected[(dec["permutation"] or list(range(5)))[position]] = cut["device"]["rank"]
    assert list(em.owners) == expected and sorted(em.owned(0) + em.owned(1)) == list(range(5))
    assert em.local_units == 3 and set(em.collectives) == {"model.root:normaliser/max", "model.root:normaliser/sum"}


def test_a_listed_mixture_under_a_component_cut_is_refused(tmp_path):
    root = f"""
    type: mixture
    components: [{DIAG}, {DIAG}, {DIAG}]"""
    with pytest.raises(RuntimeRefusal, match="list of `components:`"):
        read_em_instructions(compiled(tmp_path, spec_text("", mesh="tp: 2", rows=200, micro=200, root=root)))


def test_full_covariance_mixture_cut_over_two_tp_ranks(tmp_path):
    doc = compiled(tmp_path, spec_text(FULL, mesh="tp: 2", rows=300, micro=300).replace("repeat: 3", "repeat: 5"))
    report = run_plan(doc, steps=5, reference=True, out_dir=tmp_path / "out", progress=False)
    check_fit(report, 5, 300)
    rows = {u["node_id"]: u for u in report.data["accounting"]["updates"]}
    # The normaliser: max then sum over tp, once per micro-batch, one float64 per row.
    assert rows["model.root:normaliser/max"]["observed_count"] == [5] and rows["model.root:normaliser/max"]["group"] == "tp"
    assert rows["model.root:normaliser/sum"]["observed_bytes"] == [5 * 300 * 8]


def test_data_parallel_times_component_cut_on_four_ranks(tmp_path):
    doc = compiled(tmp_path, spec_text(DIAG, mesh="dp_replicate: 2, tp: 2, microbatches: 2", rows=400, micro=100).replace("repeat: 3", "repeat: 5"))
    report = run_plan(doc, steps=5, reference=True, out_dir=tmp_path / "out", progress=False)
    check_fit(report, 5, 400)
    rows = {u["node_id"]: u for u in report.data["accounting"]["updates"]}
    assert rows["model.root:normaliser/max"]["observed_count"] == [10]  # 2 micro-batches x 5 iterations
    assert rows["model.root.component:statistics"]["group"] == "dp_replicate"

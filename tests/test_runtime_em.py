"""EM runtime for distribution models: distributed fits against the single-process reference."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mixle_compile.plan import load_plan_text
from mixle_compile.plan.artifact import plan_text
from mixle_compile.runtime import RuntimeRefusal, run_plan
from mixle_compile.runtime.em.fit import (
    EM_TOLERANCE,
    em_accounting,
    evidence,
    fit_error,
    load_data,
    monotone_violations,
    reference_fit,
    sample_data,
    shard_rows,
)
from mixle_compile.runtime.em.model import Scoring, build_tree, initial_params, m_step, score, zero_statistics
from mixle_compile.runtime.em.plan import read_em_instructions
from mixle_compile.runtime.launch import compile_spec_file
from mixle_compile.spec import load_spec_text

ROOT = Path(__file__).resolve().parent.parent

DIAG = "{type: gaussian, dim: 3, covariance: diag}"
FULL = "{type: gaussian, dim: 3, covariance: full}"
CATEGORICAL = "{type: categorical, num_values: 6}"
HMM_MIXTURE = """
    type: mixture
    components:
      - {type: hmm, num_states: 3, transitions: {ref: weather}, emission: {type: gaussian, dim: 2, covariance: diag}}
      - {type: hmm, num_states: 3, transitions: {ref: weather}, emission: {type: gaussian, dim: 2, covariance: diag}}
      - {type: hmm, num_states: 3, transitions: {ref: weather}, emission: {type: gaussian, dim: 2, covariance: full}}"""
HMM_SHARED = "  shared:\n    weather: {type: transitions, num_states: 3}\n"
COMPOSITE = """
    type: composite
    factors:
      - {type: categorical, num_values: 5}
      - {type: poisson}
      - {type: mixture, component: {type: gaussian, dim: 3, covariance: full}, repeat: 6}"""


def spec_text(
    component: str,
    *,
    mesh: str,
    rows: int,
    micro: int,
    steps: int = 5,
    seed: int = 3,
    root: str | None = None,
    shared: str = "",
    seq_len: int | None = None,
) -> str:
    root = (
        root
        or f"""
    type: mixture
    name: m
    component: {component}
    repeat: 3"""
    )
    devices = 1
    for part in mesh.split(","):
        if part.strip() and part.split(":")[0].strip() not in ("microbatches", "gradient_accumulation_steps"):
            devices *= int(part.split(":")[1])
    seq = f"\n  seq_len: {seq_len}" if seq_len else ""
    return f"""
model:
  family: distribution
{shared}  root:{root}
mesh: {{{mesh}}}
training:
  global_batch_size: {rows}
  micro_batch_size: {micro}{seq}
  precision: fp32
  steps: {steps}
  seed: {seed}
backend: torch
resources:
  devices: {devices}
  kind: cpu
  memory: 4GiB
"""


def per_data_rank(mesh: str, rows: int) -> int:
    return rows // (2 if "dp_" in mesh else 1)


def hmm_spec(mesh: str, *, rows: int = 48, steps: int = 4) -> str:
    return spec_text(
        "",
        mesh=mesh,
        rows=rows,
        micro=per_data_rank(mesh, rows),
        steps=steps,
        root=HMM_MIXTURE,
        shared=HMM_SHARED,
        seq_len=12,
    )


def composite_spec(mesh: str, *, rows: int = 240, steps: int = 4) -> str:
    return spec_text("", mesh=mesh, rows=rows, micro=per_data_rank(mesh, rows), steps=steps, root=COMPOSITE)


def compiled(tmp_path: Path, text: str, name: str = "spec.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return compile_spec_file(path)


def statistics_of(tree, params, x):
    sc = Scoring(params, zero_statistics(tree))
    lp, acc = score(tree, tree.root, 0, x, sc)
    acc(np.ones(len(x)))
    return sc.stats, float(lp.sum())


# --- the numerics, in one process --------------------------------------------------------------


MODELS = {
    "diag": lambda: spec_text(DIAG, mesh="dp_replicate: 2", rows=400, micro=200),
    "full": lambda: spec_text(FULL, mesh="dp_replicate: 2", rows=400, micro=200),
    "categorical": lambda: spec_text(CATEGORICAL, mesh="dp_replicate: 2", rows=400, micro=200),
    "hmm": lambda: hmm_spec("dp_replicate: 2"),
    "composite": lambda: composite_spec("dp_replicate: 2"),
}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_reference_em_never_decreases_the_log_likelihood(tmp_path, model):
    em = read_em_instructions(compiled(tmp_path, MODELS[model]()))
    data = sample_data(em)
    _, lls, _ = reference_fit(em, data, 12)
    assert not monotone_violations(lls)
    assert lls[-1] > lls[0]


def test_a_decrease_is_reported():
    assert monotone_violations([-10.0, -9.0, -9.5]) and not monotone_violations([-10.0, -9.0, -9.0])


@pytest.mark.parametrize("model", ["full", "hmm", "composite"])
def test_sharded_statistics_sum_to_the_whole_and_a_shard_alone_does_not(tmp_path, model):
    """The all_reduce is what makes the fit equal the reference: one shard's statistics do not."""
    em = read_em_instructions(compiled(tmp_path, MODELS[model]()))
    data = sample_data(em)
    p = initial_params(em.tree, data, em.seed + 1)
    whole, ll = statistics_of(em.tree, p, data)
    parts = [statistics_of(em.tree, p, shard_rows(data, r, 3)) for r in range(3)]
    for k in whole:
        np.testing.assert_allclose(sum(s[k] for s, _ in parts), whole[k], rtol=1e-11, atol=1e-9)
    assert abs(sum(x for _, x in parts) - ll) <= 1e-11 * abs(ll)
    alone = m_step(em.tree, p, parts[0][0])
    assert fit_error(alone, m_step(em.tree, p, whole)) > 1e-3


def test_forward_backward_equals_enumerating_every_state_path():
    """An independent oracle: log p(x) and the expected counts summed over all S^T state paths."""
    text = """
model:
  family: distribution
  root: {type: hmm, num_states: 2, emission: {type: categorical, num_values: 3}}
mesh: {dp_replicate: 1}
training: {global_batch_size: 4, seq_len: 4}
backend: torch
resources: {devices: 1, memory: 1GiB}
"""
    spec = load_spec_text(text, "t.yaml").spec
    tree = build_tree(spec.model, 4)
    x = np.array([[0, 2, 1, 1], [2, 2, 0, 1], [1, 0, 0, 2]], dtype=np.float64)
    p = initial_params(tree, x, 11)
    stats, ll = statistics_of(tree, p, x)
    pi, a = p["model.root"]["initial"][0], p["model.root"]["transition"][0]
    b = p["model.root.emission"]["probs"]
    want_ll, init, trans, emit = 0.0, np.zeros(2), np.zeros((2, 2)), np.zeros((2, 3))
    for seq in x.astype(int):
        paths = list(itertools.product(range(2), repeat=4))
        joint = np.array(
            [
                pi[z[0]]
                * np.prod([a[z[t - 1], z[t]] for t in range(1, 4)])
                * np.prod([b[z[t], seq[t]] for t in range(4)])
                for z in paths
            ]
        )
        want_ll += np.log(joint.sum())
        post = joint / joint.sum()
        for z, w in zip(paths, post, strict=True):
            init[z[0]] += w
            for t in range(4):
                emit[z[t], seq[t]] += w
                if t:
                    trans[z[t - 1], z[t]] += w
    assert ll == pytest.approx(want_ll, rel=1e-12)
    np.testing.assert_allclose(stats["model.root"][0], np.concatenate([init, trans.ravel()]), rtol=1e-10)
    np.testing.assert_allclose(stats["model.root.emission"], emit, rtol=1e-10)


def test_the_mixture_fit_equals_textbook_em_written_out_independently(tmp_path):
    """Three iterations of a full-covariance Gaussian mixture against EM written from the formulas
    (densities evaluated directly, responsibilities normalised, weighted moments)."""
    em = read_em_instructions(compiled(tmp_path, MODELS["full"]()))
    data = sample_data(em)
    start = initial_params(em.tree, data, em.seed + 1)
    w = start["model.root"]["weights"][0].copy()
    mu = start["model.root.component"]["means"].copy()
    cov = start["model.root.component"]["covs"].copy()
    lls = []
    for _ in range(3):
        dens = (
            np.stack(
                [
                    np.exp(-0.5 * np.einsum("ni,ij,nj->n", data - mu[k], np.linalg.inv(cov[k]), data - mu[k]))
                    / np.sqrt(np.linalg.det(2 * np.pi * cov[k]))
                    for k in range(3)
                ],
                axis=1,
            )
            * w
        )
        lls.append(np.log(dens.sum(axis=1)).sum())
        r = dens / dens.sum(axis=1, keepdims=True)
        nk = r.sum(axis=0)
        w = nk / len(data)
        mu = (r.T @ data) / nk[:, None]
        cov = np.stack([((data - mu[k]) * r[:, k, None]).T @ (data - mu[k]) / nk[k] for k in range(3)])
    params, got_lls, _ = reference_fit(em, data, 3)
    np.testing.assert_allclose(got_lls, lls, rtol=1e-10)
    np.testing.assert_allclose(params["model.root"]["weights"][0], w, rtol=1e-9)
    np.testing.assert_allclose(params["model.root.component"]["means"], mu, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(params["model.root.component"]["covs"], cov, rtol=1e-8, atol=1e-12)


def test_accounting_and_evidence_catch_a_missing_or_wrong_reduction(tmp_path):
    doc = compiled(tmp_path, spec_text(DIAG, mesh="dp_replicate: 2", rows=400, micro=200))
    em = read_em_instructions(doc)
    data = sample_data(em)
    ref = reference_fit(em, data, 3)
    good = {
        "updates": {n: [3, em.expected_bytes(c) * 3] for n, c in em.collectives.items()},
        "bookkeeping": {},
        "calls": 9,
    }
    assert em_accounting(em, [good, good], 3)["ok"]
    missing = json.loads(json.dumps(good))
    missing["updates"]["model.root:statistics"] = [2, em.expected_bytes(em.collectives["model.root:statistics"]) * 2]
    account = em_accounting(em, [good, missing], 3)
    assert not account["ok"] and "rank 1" in account["errors"][0]
    # Evidence: the reference against itself is exact; statistics of one shard only are not.
    history = [
        {"statistics": {f"{n}:statistics": h[n].ravel() for n in ("model.root", "model.root.component")}}
        for h in ref[2]
    ]
    record = {"tp": 0, "owned": [], "data_rank": 0, "data_size": 1, "params": ref[0], "lls": ref[1], "history": history}
    _, errors = evidence(doc, em, [record], [record], ref, 3)
    assert not errors
    halved = [
        {"statistics": {k: v / 2 if "component" in k else v for k, v in h["statistics"].items()}} for h in history
    ]
    updates, errors = evidence(doc, em, [dict(record, history=halved)], [dict(record, history=halved)], ref, 3)
    assert any("model.root.component:statistics" in e for e in errors)
    assert all(u["numerics_sample_count"] > 0 for u in updates)


def test_the_plan_sizes_statistics_as_the_runtime_reduces_them_and_a_mismatch_is_refused(tmp_path):
    """The lowering's bytes include what the maximiser needs beyond the parameters: a Gaussian
    emission's occupancy, the transitions' expected initial states."""
    doc = compiled(tmp_path, hmm_spec("dp_replicate: 2"))
    em = read_em_instructions(doc)
    sizes = {su.node: su.elements for su in em.statistics}
    assert sizes["model.shared.weather"] == 3 + 9
    assert sizes["model.root.components[0].emission"] == 3 * (1 + 2 + 2)
    assert sizes["model.root.components[2].emission"] == 3 * (1 + 2 + 4)
    assert {u.node_id: u.payload_bytes for u in doc.updates}["model.shared.weather:statistics"] == 12 * 8
    tampered = doc.model_copy(
        update={
            "updates": [
                u.model_copy(update={"payload_bytes": u.payload_bytes - 8}) if u.node_id.endswith(":statistics") else u
                for u in doc.updates
            ]
        }
    )
    with pytest.raises(RuntimeRefusal, match="recompile"):
        read_em_instructions(tampered)


SHAPES = {
    "hmm with its own transitions and listed emissions": (
        """
    type: hmm
    num_states: 2
    emissions: [{type: poisson, dim: 2}, {type: poisson, dim: 2}]""",
        6,
    ),
    "mixture of composites": (
        """
    type: mixture
    component: {type: composite, factors: [{type: exponential, dim: 2}, {type: categorical, num_values: 4}]}
    repeat: 5""",
        None,
    ),
    "composite of a mixture of hmms": (
        """
    type: composite
    factors:
      - {type: gaussian, dim: 2}
      - type: mixture
        component: {type: hmm, num_states: 2, emission: {type: gaussian, dim: 2, covariance: full}}
        repeat: 4""",
        5,
    ),
    "mixture of a sequence and an hmm with lengths": (
        """
    type: mixture
    components:
      - {type: sequence, base: {type: categorical, num_values: 4}, length: {type: poisson}}
      - {type: hmm, num_states: 2, emission: {type: categorical, num_values: 4}, length: {type: categorical, \
num_values: 9}}""",
        8,
    ),
}


@pytest.mark.parametrize(
    ("shape", "mesh"),
    [
        (shape, mesh)
        for shape in sorted(SHAPES)
        for mesh in ("dp_replicate: 2", "dp_replicate: 2, tp: 2")
        if not (shape.startswith("hmm") and "tp" in mesh)
    ],  # an HMM's states are never cut
)
def test_every_planned_statistics_update_has_the_size_a_rank_reduces(tmp_path, shape, mesh):
    """Reading the plan checks each update's bytes against the runtime's statistics; here every
    rank's rows are counted too, and the reference fit runs and never decreases."""
    root, seq_len = SHAPES[shape]
    try:
        doc = compiled(tmp_path, spec_text("", mesh=mesh, rows=64, micro=32, root=root, seq_len=seq_len))
    except RuntimeRefusal as exc:
        pytest.fail(str(exc))
    em = read_em_instructions(doc)
    stats = {n.id: np.zeros((n.instances, n.stat_width())) for n in em.tree.with_statistics()}
    from mixle_compile.runtime.em.fit import local_statistics

    for su in em.statistics:
        lengths = [len(local_statistics(em, su, stats[su.node], tp)) for tp in range(em.plan.tp) if su.executes(tp)]
        assert max(lengths) == su.elements == em.collectives[su.update].payload_bytes // 8
    assert {su.node for su in em.statistics} == set(stats)
    _, lls, _ = reference_fit(em, sample_data(em), 6)
    assert not monotone_violations(lls) and lls[-1] > lls[0]


def test_data_files_are_read_and_checked(tmp_path):
    em = read_em_instructions(compiled(tmp_path, spec_text(DIAG, mesh="dp_replicate: 2", rows=400, micro=200)))
    x = np.arange(30.0).reshape(10, 3)
    np.save(tmp_path / "x.npy", x)
    np.savetxt(tmp_path / "x.csv", x, delimiter=",")
    np.testing.assert_array_equal(load_data(em, str(tmp_path / "x.npy")), x)
    np.testing.assert_array_equal(load_data(em, str(tmp_path / "x.csv")), x)
    np.save(tmp_path / "bad.npy", np.zeros((10, 2)))
    with pytest.raises(ValueError, match="records of 3 values"):
        load_data(em, str(tmp_path / "bad.npy"))
    assert [len(shard_rows(x, r, 3)) for r in range(3)] == [4, 3, 3]
    hmm = read_em_instructions(compiled(tmp_path, hmm_spec("dp_replicate: 2"), "h.yaml"))
    seqs = np.random.default_rng(0).normal(size=(5, 12, 2))
    np.save(tmp_path / "s.npy", seqs)
    np.testing.assert_array_equal(load_data(hmm, str(tmp_path / "s.npy")), seqs.reshape(5, 24))
    cut = read_em_instructions(compiled(tmp_path, spec_text(DIAG, mesh="tp: 2", rows=20, micro=20), "t.yaml"))
    np.save(tmp_path / "many.npy", np.zeros((21, 3)))
    with pytest.raises(ValueError, match="raise micro_batch_size"):
        load_data(cut, str(tmp_path / "many.npy"))
    comp = read_em_instructions(compiled(tmp_path, composite_spec("dp_replicate: 2"), "c.yaml"))
    rows = np.hstack([np.full((4, 1), 7.0), np.ones((4, 1)), np.zeros((4, 3))])
    np.save(tmp_path / "c.npy", rows)
    with pytest.raises(ValueError, match=r"integers in \[0, 5\)"):
        load_data(comp, str(tmp_path / "c.npy"))


# --- refusals ----------------------------------------------------------------------------------


def test_what_em_does_not_execute_is_refused_without_torch(tmp_path):
    path = tmp_path / "h.yaml"
    path.write_text(hmm_spec("dp_replicate: 2").replace("\n  seq_len: 12", ""))
    script = f"""
import sys
from mixle_compile.runtime import run_plan, RuntimeRefusal
try:
    run_plan({str(path)!r})
except RuntimeRefusal as exc:
    print("refused:", exc)
assert "torch" not in sys.modules
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "refused:" in out.stdout and "set training.seq_len" in out.stdout


def test_a_mixture_of_components_reading_different_records_is_refused(tmp_path):
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
    assert all(
        u["observed_count"] == [u["planned_count"]] and u["observed_bytes"] == [u["planned_bytes"]]
        for u in data["accounting"]["updates"]
    )
    assert data["log_likelihood_monotone"] and len(data["log_likelihoods"]) == steps
    assert data["evidence"]["fit_max_relative_error"] <= EM_TOLERANCE
    assert report.max_relative_error <= EM_TOLERANCE
    assert all(u.has_numerics_evidence and u.determinism_observed for u in report.evidence)
    np.testing.assert_allclose(
        data["log_likelihoods"], data["evidence"]["reference_log_likelihoods"], rtol=EM_TOLERANCE
    )
    receipts = [json.loads(line) for line in report.receipts_path.read_text().splitlines()]
    assert [r["iteration"] for r in receipts] == list(range(steps))
    assert all(r["examples"] == rows for r in receipts)
    assert all(
        r["collective_bytes"] == r["planned_collective_bytes"] == receipts[0]["collective_bytes"] > 0 for r in receipts
    )
    return {u["node_id"]: u for u in data["accounting"]["updates"]}


def test_full_covariance_mixture_on_four_data_ranks(tmp_path):
    report = run_plan(
        ROOT / "examples/gaussian-mixture.yaml", steps=4, reference=True, out_dir=tmp_path / "out", progress=False
    )
    rows = check_fit(report, 4, 4096)
    assert report.world_size == 4
    receipt = json.loads(report.receipts_path.read_text().splitlines()[0])
    assert receipt["collective_bytes"] == sum(u["planned_bytes"] for u in rows.values()) // 4


def test_diagonal_mixture_from_a_npy_file_over_dp_shard(tmp_path):
    doc = compiled(tmp_path, spec_text(DIAG, mesh="dp_shard: 2", rows=400, micro=200))
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(-3, 1, (150, 3)), rng.normal(2, 0.5, (150, 3)), rng.normal(6, 1, (101, 3))])
    np.save(tmp_path / "x.npy", x)
    report = run_plan(
        doc, steps=5, reference=True, data_path=tmp_path / "x.npy", out_dir=tmp_path / "out", progress=False
    )
    check_fit(report, 5, 401)
    assert {u["group"] for u in report.data["accounting"]["updates"]} == {"dp_shard"}


def test_categorical_mixture_from_a_csv_file(tmp_path):
    root = f"""
    type: mixture
    components: [{CATEGORICAL}, {CATEGORICAL}]"""
    doc = compiled(tmp_path, spec_text("", mesh="dp_replicate: 2", rows=400, micro=200, root=root))
    values = np.random.default_rng(1).integers(0, 6, size=300)
    np.savetxt(tmp_path / "v.csv", values, delimiter=",", fmt="%d")
    report = run_plan(
        doc, steps=4, reference=True, data_path=tmp_path / "v.csv", out_dir=tmp_path / "out", progress=False
    )
    rows = check_fit(report, 4, 300)
    assert {
        "model.root.components[0]:statistics",
        "model.root.components[1]:statistics",
        "model.root:statistics",
        "log_likelihood",
    } == set(rows)


@pytest.mark.slow
def test_a_plan_file_round_trips_into_the_em_worker(tmp_path):
    doc = compiled(tmp_path, spec_text(CATEGORICAL, mesh="dp_replicate: 2", rows=200, micro=100, steps=3))
    path = tmp_path / "plan.json"
    path.write_text(plan_text(doc.model_dump(mode="json")))
    assert load_plan_text(path.read_bytes(), str(path)).content_digest == doc.content_digest
    report = run_plan(path, out_dir=tmp_path / "out", progress=False)
    assert report.ok and report.steps == 3 and report.evidence is None
    assert not monotone_violations(report.data["log_likelihoods"])


# --- component and factor cuts over tp ---------------------------------------------------------


def test_the_component_owners_follow_the_decomposition(tmp_path):
    doc = compiled(
        tmp_path,
        spec_text("{type: gaussian, dim: 2, covariance: full}", mesh="tp: 2", rows=300, micro=300).replace(
            "repeat: 3", "repeat: 5"
        ),
    )
    em = read_em_instructions(doc)
    dec = doc.decomposition
    expected = [None] * 5
    for cut in dec["cuts"]:
        for position in range(cut["start"], cut["stop"]):
            expected[(dec["permutation"] or list(range(5)))[position]] = cut["device"]["rank"]
    assert list(em.cut.owners) == expected and sorted(em.owned(0) + em.owned(1)) == list(range(5))
    assert em.cut.largest_share == 3 and set(em.collectives) == {
        "model.root:normaliser/max",
        "model.root:normaliser/sum",
    }


def test_full_covariance_mixture_cut_over_two_tp_ranks(tmp_path):
    doc = compiled(tmp_path, spec_text(FULL, mesh="tp: 2", rows=300, micro=300).replace("repeat: 3", "repeat: 5"))
    report = run_plan(doc, steps=5, reference=True, out_dir=tmp_path / "out", progress=False)
    rows = check_fit(report, 5, 300)
    # The normaliser: max then sum over tp, once per micro-batch, one float64 per row.
    assert (
        rows["model.root:normaliser/max"]["observed_count"] == [5]
        and rows["model.root:normaliser/max"]["group"] == "tp"
    )
    assert rows["model.root:normaliser/sum"]["observed_bytes"] == [5 * 300 * 8]


def test_data_parallel_times_component_cut_on_four_ranks(tmp_path):
    doc = compiled(
        tmp_path,
        spec_text(DIAG, mesh="dp_replicate: 2, tp: 2, microbatches: 2", rows=400, micro=100).replace(
            "repeat: 3", "repeat: 5"
        ),
    )
    report = run_plan(doc, steps=5, reference=True, out_dir=tmp_path / "out", progress=False)
    rows = check_fit(report, 5, 400)
    assert rows["model.root:normaliser/max"]["observed_count"] == [10]  # 2 micro-batches x 5 iterations
    assert rows["model.root.component:statistics"]["group"] == "dp_replicate"


def test_a_listed_categorical_mixture_cut_over_tp_reduces_each_component_on_its_owner(tmp_path):
    root = f"""
    type: mixture
    components: [{CATEGORICAL}, {CATEGORICAL}, {CATEGORICAL}]"""
    doc = compiled(tmp_path, spec_text("", mesh="dp_replicate: 2, tp: 2", rows=300, micro=150, root=root))
    report = run_plan(doc, steps=4, reference=True, out_dir=tmp_path / "out", progress=False)
    rows = check_fit(report, 4, 300)
    # Each listed component's statistics are reduced by the two ranks of its owner only.
    assert all(rows[f"model.root.components[{k}]:statistics"]["ranks_executing"] == 2 for k in range(3))
    assert rows["model.root:statistics"]["ranks_executing"] == 4


# --- sequences and their lengths ----------------------------------------------------------------


LENGTHS = SHAPES["mixture of a sequence and an hmm with lengths"][0]


def test_lengths_fit_over_data_ranks_and_a_component_cut(tmp_path):
    """A mixture of a sequence and an hmm, each with a length distribution: variable-length
    records (the length first, padding after it) fitted on dp x tp ranks equal the single-process
    fit; each component's length node is reduced only by the tp rank that owns the component."""
    doc = compiled(tmp_path, spec_text("", mesh="dp_replicate: 2, tp: 2", rows=120, micro=60, root=LENGTHS, seq_len=8))
    em = read_em_instructions(doc)
    data = sample_data(em)
    assert data.shape == (120, 9) and 0 <= data[:, 0].min() < data[:, 0].max() <= 8
    padded = np.arange(8)[None, :] >= data[:, :1]
    data[:, 1:][padded] = 99.0  # padding is never read: any value
    np.save(tmp_path / "seqs.npy", data)
    report = run_plan(
        doc, steps=4, reference=True, data_path=tmp_path / "seqs.npy", out_dir=tmp_path / "out", progress=False
    )
    rows = check_fit(report, 4, 120)
    for k in range(2):
        assert rows[f"model.root.components[{k}].length:statistics"]["ranks_executing"] == 2
    bad = data.copy()
    bad[0, 0] = 9
    np.save(tmp_path / "bad.npy", bad)
    with pytest.raises(
        ValueError, match=r"model.root.components\[0\] is each sequence's number of steps: integers in \[0, 8\]"
    ):
        load_data(em, str(tmp_path / "bad.npy"))
    np.save(tmp_path / "short.npy", data[:, 1:])
    with pytest.raises(
        ValueError,
        match=r"records of 9 values \(sequences of training.seq_len=8 steps, flattened step-major; "
        r"model.root.components\[0\], model.root.components\[1\]: the number of steps first",
    ):
        load_data(em, str(tmp_path / "short.npy"))


def test_a_length_must_read_one_column(tmp_path):
    root = """
    type: sequence
    base: {type: poisson}
    length: {type: poisson, dim: 2}"""
    path = tmp_path / "s.yaml"
    path.write_text(spec_text("", mesh="dp_replicate: 2", rows=20, micro=10, root=root, seq_len=4))
    with pytest.raises(RuntimeRefusal, match=r"model.root.length: a length distribution reads one column"):
        read_em_instructions(compile_spec_file(path))


# --- HMMs with shared transitions --------------------------------------------------------------


@pytest.mark.parametrize(("mesh", "world"), [("dp_replicate: 2", 2), ("tp: 2", 2), ("dp_replicate: 2, tp: 2", 4)])
def test_hmm_mixture_with_shared_transitions(tmp_path, mesh, world):
    doc = compiled(tmp_path, hmm_spec(mesh))
    report = run_plan(doc, steps=4, reference=True, out_dir=tmp_path / "out", progress=False)
    rows = check_fit(report, 4, 48)
    assert report.world_size == world
    weather = rows["model.shared.weather:statistics"]
    # The transition matrix is held whole: its statistics are summed over the data ranks and,
    # when HMMs on different tp ranks use it, over tp as well.
    assert (
        weather["group"]
        == {"dp_replicate: 2": "dp_replicate", "tp: 2": "tp", "dp_replicate: 2, tp: 2": "dp_replicate+tp"}[mesh]
    )
    assert weather["planned_bytes"] == 4 * (3 + 9) * 8 and weather["ranks_executing"] == world
    if "tp" in mesh:
        assert rows["model.root:normaliser/sum"]["observed_count"] == [4]
    if "tp" in mesh and "dp" in mesh:
        assert {rows[f"model.root.components[{k}].emission:statistics"]["ranks_executing"] for k in range(3)} == {
            world // 2
        }


def test_hmm_example_fits_on_its_plan(tmp_path):
    data = np.random.default_rng(2).normal(size=(16, 100, 3))
    np.save(tmp_path / "seq.npy", data)
    report = run_plan(
        ROOT / "examples/hmm-shared-transitions.yaml",
        steps=3,
        reference=True,
        data_path=tmp_path / "seq.npy",
        out_dir=tmp_path / "out",
        progress=False,
    )
    check_fit(report, 3, 16)


# --- a composite with a nested mixture ---------------------------------------------------------


@pytest.mark.parametrize("mesh", ["dp_replicate: 2", "tp: 2", "dp_replicate: 2, tp: 2"])
def test_composite_with_a_nested_mixture(tmp_path, mesh):
    doc = compiled(tmp_path, composite_spec(mesh))
    report = run_plan(doc, steps=4, reference=True, out_dir=tmp_path / "out", progress=False)
    rows = check_fit(report, 4, 240)
    if "tp" in mesh:
        assert report.data["run"]["cut"]["path"] == "model.root.factors[2]"
        assert rows["model.root.factors[2]:normaliser/max"]["group"] == "tp"
    if "dp" in mesh:
        # Each factor carries its own statistics; the Poisson's include its weight.
        assert rows["model.root.factors[1]:statistics"]["planned_bytes"] == 4 * 2 * 8


def test_composite_factors_cut_across_ranks(tmp_path):
    root = """
    type: composite
    factors:
      - {type: gaussian, dim: 4, covariance: full}
      - {type: mixture, component: {type: gaussian, dim: 2, covariance: diag}, repeat: 2}
      - {type: gaussian, dim: 4, covariance: full}
      - {type: exponential, dim: 2}"""
    doc = compiled(tmp_path, spec_text("", mesh="dp_replicate: 2, tp: 2", rows=200, micro=100, root=root))
    assert doc.decomposition["axis"] == "factor"
    report = run_plan(doc, steps=4, reference=True, out_dir=tmp_path / "out", progress=False)
    rows = check_fit(report, 4, 200)
    assert "model.root:normaliser/max" not in rows and rows["model.root:normaliser/sum"]["group"] == "tp"
    assert all(rows[f"model.root.factors[{j}]:statistics"]["ranks_executing"] == 2 for j in range(4))


@pytest.mark.slow
def test_composite_example_fits_on_its_three_uneven_tp_ranks(tmp_path):
    report = run_plan(
        ROOT / "examples/composite-nested-mixture.yaml",
        steps=3,
        reference=True,
        out_dir=tmp_path / "out",
        progress=False,
    )
    check_fit(report, 3, 1024)
    assert report.data["run"]["cut"]["owners"].count(0) == 32


def test_a_cut_of_a_nested_mixture_of_hmms_shards_their_transitions_and_emissions(tmp_path):
    """Combined plan, cut below the root: each tp rank holds the rows of its own HMMs (their own
    transitions, two emission states each), padded to the larger share."""
    root, seq_len = SHAPES["composite of a mixture of hmms"]
    doc = compiled(
        tmp_path, spec_text("", mesh="dp_replicate: 2, tp: 2", rows=64, micro=32, root=root, seq_len=seq_len)
    )
    assert (doc.decomposition["axis"], doc.decomposition["path"]) == ("component", "model.root.factors[1]")
    report = run_plan(doc, steps=4, reference=True, out_dir=tmp_path / "out", progress=False)
    rows = check_fit(report, 4, 64)
    share = max(report.data["run"]["cut"]["owners"].count(r) for r in (0, 1))
    assert rows["model.root.factors[1].component:statistics"]["planned_bytes"] == 4 * share * (2 + 4) * 8
    assert (
        rows["model.root.factors[1].component.emission:statistics"]["planned_bytes"] == 4 * share * 2 * (1 + 2 + 4) * 8
    )

"""EM checkpoints: the whole model in global coordinates, resumed on another mesh, and refusals.

Two uninterrupted fits save a checkpoint after every iteration: a full-covariance mixture whose
components are cut over tp (dp_replicate=2 x tp=2, 4 ranks, synthetic records), and a diagonal
mixture on 4 data ranks (dp_replicate=2 x dp_shard=2) read from a .npy file. Each is resumed after
iteration 2 on another mesh (no cut on 2 ranks; 2 data ranks) and must end with the same
parameters to EM_TOLERANCE (relative, float64) and continue the same log-likelihood history. One
iteration moves the parameters by far more than that (asserted), so a skipped or repeated
iteration, or parameters taken from a rank that does not own them, fail these tests.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mixle_compile.runtime import RuntimeRefusal, run_plan
from mixle_compile.runtime import checkpoint as ckpt
from mixle_compile.runtime.em.fit import (
    EM_TOLERANCE,
    data_source,
    load_data,
    monotone_violations,
    reference_fit,
    relative_error,
    sample_data,
)
from mixle_compile.runtime.em.model import initial_params, param_shapes
from mixle_compile.runtime.em.plan import read_em_instructions
from tests.test_runtime_em import DIAG, FULL, MODELS, compiled, spec_text
from tests.test_runtime_support import explain_without_torch

ROOT = Path(__file__).resolve().parent.parent
STEPS = 5
RESUME_AT = 2


def cut_spec(mesh: str, micro: int, repeat: int = 5, component: str = FULL, seed: int = 3) -> str:
    return spec_text(component, mesh=mesh, rows=400, micro=micro, seed=seed).replace("repeat: 3", f"repeat: {repeat}")


def file_spec(mesh: str, micro: int) -> str:
    return spec_text(DIAG, mesh=mesh, rows=400, micro=micro)


def records(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.normal(-3, 1, (150, 3)), rng.normal(2, 0.5, (150, 3)), rng.normal(6, 1, (101, 3))])


def step_dir(root: Path, step: int) -> Path:
    return root / ckpt.step_dir_name(step)


def arrays_at(root: Path, step: int) -> dict[str, np.ndarray]:
    return ckpt.read_array_checkpoint(step_dir(root, step))[1]


def worst_error(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(relative_error(a[k], b[k])[0] for k in b)


@pytest.fixture(scope="module")
def cut_run(tmp_path_factory):
    """A component cut over tp=2 times dp_replicate=2 (4 ranks), synthetic records, saved every iteration."""
    tmp = tmp_path_factory.mktemp("em-cut")
    doc = compiled(tmp, cut_spec("dp_replicate: 2, tp: 2, microbatches: 2", micro=100))
    report = run_plan(doc, steps=STEPS, out_dir=tmp / "out", progress=False, save_every=1)
    assert report.ok, report.errors
    return doc, report, tmp / "out" / "checkpoints"


@pytest.fixture(scope="module")
def file_run(tmp_path_factory):
    """4 data ranks (dp_replicate=2 x dp_shard=2), records from a .npy file, saved every iteration."""
    tmp = tmp_path_factory.mktemp("em-file")
    np.save(tmp / "x.npy", records())
    doc = compiled(tmp, file_spec("dp_replicate: 2, dp_shard: 2", micro=100))
    report = run_plan(doc, steps=STEPS, out_dir=tmp / "out", progress=False, save_every=1, data_path=tmp / "x.npy")
    assert report.ok, report.errors
    return doc, report, tmp / "out" / "checkpoints", tmp / "x.npy"


# ---------------------------------------------------------------------------- what is saved


def test_a_checkpoint_holds_the_whole_model_in_global_coordinates(cut_run):
    doc, report, root = cut_run
    em = read_em_instructions(doc)
    assert [s for s, _, ok in ckpt.list_checkpoints(root) if ok] == list(range(1, STEPS + 1))
    # Under the cut each tp rank updates only its own components; the saved model is all of them,
    # each from its owner, so it equals the single-process fit after the same iterations.
    data = sample_data(em)
    for step in (1, RESUME_AT, STEPS):
        manifest, arrays = ckpt.read_array_checkpoint(step_dir(root, step))
        ref = reference_fit(em, data, step)[0]
        expected = {f"{n}/{k}": a for n, p in ref.items() for k, a in p.items()}
        assert worst_error(arrays, expected) <= EM_TOLERANCE
        assert manifest["fit"]["iteration"] == step and manifest["step"] == step
        np.testing.assert_array_equal(manifest["fit"]["log_likelihoods"], report.data["log_likelihood_history"][:step])
    assert manifest["plan"]["content_digest"] == doc.content_digest
    assert (manifest["mesh"]["tp"], manifest["mesh"]["dp_replicate"], manifest["mesh"]["world_size"]) == (2, 2, 4)
    assert manifest["data"]["source"] == {"kind": "synthetic", "seed": 3, "rows": 400}
    assert manifest["fit"]["cut"]["path"] == "model.root" and sorted(manifest["fit"]["cut"]["owners"]) == [
        0,
        0,
        0,
        1,
        1,
    ]
    # One iteration moves the parameters by far more than the tolerance: a skipped or repeated
    # iteration would not pass for a resumed fit.
    assert worst_error(arrays_at(root, STEPS - 1), arrays_at(root, STEPS)) > 1e4 * EM_TOLERANCE


def test_the_saved_shapes_are_those_the_fit_creates(tmp_path):
    for name, text in MODELS.items():
        em = read_em_instructions(compiled(tmp_path, text(), f"{name}.yaml"))
        params = initial_params(em.tree, sample_data(em), 0)
        assert {n: {k: a.shape for k, a in p.items()} for n, p in params.items()} == param_shapes(em.tree), name


# ---------------------------------------------------------------------------- resume on another mesh


def check_resumed(resumed, uninterrupted, root: Path, resumed_root: Path) -> float:
    assert resumed.ok, resumed.errors
    run = resumed.data["run"]
    assert (run["first_step"], run["last_step"], run["steps"], resumed.steps) == (
        RESUME_AT,
        STEPS,
        STEPS - RESUME_AT,
        STEPS - RESUME_AT,
    )
    assert run["resumed_from"]["step"] == RESUME_AT and run["resumed_from"]["path"] == str(
        step_dir(root, RESUME_AT).resolve()
    )
    # The history continues: the saved iterations exactly, the new ones as the uninterrupted fit's.
    full = uninterrupted.data["log_likelihood_history"]
    history = resumed.data["log_likelihood_history"]
    assert len(history) == STEPS and history[:RESUME_AT] == full[:RESUME_AT]
    assert resumed.data["log_likelihoods"] == history[RESUME_AT:]
    np.testing.assert_allclose(history, full, rtol=EM_TOLERANCE, atol=0)
    assert resumed.data["log_likelihood_monotone"] and not monotone_violations(history) and history[-1] > history[0]
    receipts = [json.loads(line) for line in resumed.receipts_path.read_text().splitlines()]
    assert [r["iteration"] for r in receipts] == list(range(RESUME_AT, STEPS))
    # Planned == observed over the iterations this run made.
    assert resumed.accounting_ok and all(
        u["observed_count"] == [u["planned_count"]] for u in resumed.data["accounting"]["updates"]
    )
    assert all(u["planned_count"] % (STEPS - RESUME_AT) == 0 for u in resumed.data["accounting"]["updates"])
    worst = worst_error(arrays_at(resumed_root, STEPS), arrays_at(root, STEPS))
    assert worst <= EM_TOLERANCE
    return worst


def test_resume_a_component_cut_on_a_mesh_without_a_cut(tmp_path, cut_run):
    """dp_replicate=2 x tp=2 (4 ranks, components cut) -> dp_replicate=2 (2 ranks, every rank holds all)."""
    _, uninterrupted, root = cut_run
    doc = compiled(tmp_path, cut_spec("dp_replicate: 2", micro=200))
    resumed = run_plan(
        doc, steps=STEPS, out_dir=tmp_path / "out", progress=False, save_every=1, resume=step_dir(root, RESUME_AT)
    )
    assert resumed.world_size == 2 and resumed.data["run"]["cut"] is None
    assert resumed.data["run"]["resumed_from"]["mesh"]["tp"] == 2
    check_resumed(resumed, uninterrupted, root, tmp_path / "out" / "checkpoints")
    assert [s for s, _, _ in ckpt.list_checkpoints(tmp_path / "out" / "checkpoints")] == [3, 4, 5]


def test_resume_four_data_ranks_on_two_from_the_same_file(tmp_path, file_run):
    """dp_replicate=2 x dp_shard=2 (4 data ranks) -> dp_shard=2 (2 data ranks), records from a .npy file,
    keeping the 2 newest checkpoints; the file may be a copy elsewhere (its records are what counts)."""
    _, uninterrupted, root, data = file_run
    doc = compiled(tmp_path, file_spec("dp_shard: 2", micro=200))
    copy = tmp_path / "copy.npy"
    shutil.copy(data, copy)
    resumed = run_plan(
        doc,
        steps=STEPS,
        out_dir=tmp_path / "out",
        progress=False,
        save_every=1,
        keep_checkpoints=2,
        data_path=copy,
        resume=step_dir(root, RESUME_AT),
    )
    assert resumed.world_size == 2 and resumed.data["run"]["resumed_from"]["mesh"]["data_parallel_size"] == 4
    check_resumed(resumed, uninterrupted, root, tmp_path / "out" / "checkpoints")
    assert [s for s, _, _ in ckpt.list_checkpoints(tmp_path / "out" / "checkpoints")] == [4, 5]
    source = ckpt.read_manifest(step_dir(tmp_path / "out" / "checkpoints", STEPS))["data"]["source"]
    assert source["kind"] == "file" and source["rows"] == 401 and source["records_sha256"].startswith("sha256:")


# ---------------------------------------------------------------------------- refusals


def test_a_different_model_is_refused_naming_the_node_and_both_shapes(tmp_path, cut_run):
    _, _, root = cut_run
    resume = step_dir(root, RESUME_AT)
    fewer = compiled(tmp_path, cut_spec("dp_replicate: 2", micro=200, repeat=4), "fewer.yaml")
    with pytest.raises(
        ckpt.CheckpointError,
        match=r"node 'model.root.component' has means of shape \[5, 3\] in the checkpoint but \[4, 3\] in this plan",
    ):
        run_plan(fewer, steps=STEPS, out_dir=tmp_path / "a", progress=False, resume=resume)
    diag = compiled(tmp_path, cut_spec("dp_replicate: 2", micro=200, component=DIAG), "diag.yaml")
    with pytest.raises(
        RuntimeRefusal, match=r"has covs of shape \[5, 3, 3\] in the checkpoint but \[5, 3\] in this plan"
    ):
        run_plan(diag, steps=STEPS, out_dir=tmp_path / "b", progress=False, resume=resume)
    poisson = compiled(tmp_path, cut_spec("dp_replicate: 2", micro=200, component="{type: poisson, dim: 3}"), "p.yaml")
    with pytest.raises(
        RuntimeRefusal, match=r"node 'model.root.component' is a gaussian in the checkpoint but a poisson in this plan"
    ):
        run_plan(poisson, steps=STEPS, out_dir=tmp_path / "c", progress=False, resume=resume)
    assert not (tmp_path / "a").exists()  # refused before anything starts


def test_different_data_is_refused(tmp_path, cut_run, file_run):
    _, _, root = cut_run
    other_seed = compiled(tmp_path, cut_spec("dp_replicate: 2", micro=200, seed=4), "seed.yaml")
    with pytest.raises(
        RuntimeRefusal,
        match=r"fitted on 400 synthetic records with seed 3, this run reads 400 synthetic records with seed 4",
    ):
        run_plan(other_seed, steps=STEPS, out_dir=tmp_path / "a", progress=False, resume=step_dir(root, RESUME_AT))
    _, _, file_root, data = file_run
    doc = compiled(tmp_path, file_spec("dp_shard: 2", micro=200), "f.yaml")
    changed = records()
    changed[7, 1] += 1e-6
    np.save(tmp_path / "changed.npy", changed)
    with pytest.raises(
        RuntimeRefusal,
        match=r"fitted on 401 records of .*x\.npy \(sha256:.*"
        r"this run reads 401 records of .*changed\.npy.*pass the same --data",
    ):
        run_plan(
            doc,
            steps=STEPS,
            out_dir=tmp_path / "b",
            progress=False,
            data_path=tmp_path / "changed.npy",
            resume=step_dir(file_root, RESUME_AT),
        )
    with pytest.raises(RuntimeRefusal, match=r"this run reads 400 synthetic records with seed 3"):
        run_plan(doc, steps=STEPS, out_dir=tmp_path / "c", progress=False, resume=step_dir(file_root, RESUME_AT))
    # The records are what counts: the same values written as CSV name the same data.
    np.savetxt(tmp_path / "same.csv", records(), delimiter=",")
    em = read_em_instructions(doc)
    saved = ckpt.read_manifest(step_dir(file_root, RESUME_AT))["data"]["source"]
    assert (
        data_source(em, load_data(em, tmp_path / "same.csv"), tmp_path / "same.csv")["records_sha256"]
        == saved["records_sha256"]
    )
    assert data_source(em, changed, tmp_path / "changed.npy")["records_sha256"] != saved["records_sha256"]


def test_a_checkpoint_without_its_marker_is_never_loaded(tmp_path, cut_run):
    _, _, root = cut_run
    copy = step_dir(tmp_path / "ckpts", RESUME_AT)
    shutil.copytree(step_dir(root, RESUME_AT), copy)
    (copy / ckpt.COMPLETE_MARKER).unlink()
    doc = compiled(tmp_path, cut_spec("dp_replicate: 2", micro=200))
    with pytest.raises(RuntimeRefusal, match=r"no completion marker COMPLETE"):
        run_plan(doc, steps=STEPS, out_dir=tmp_path / "out", progress=False, resume=copy)
    with pytest.raises(
        RuntimeRefusal, match=r"holds no complete checkpoint: step-00000002 lack\(s\) the completion marker"
    ):
        run_plan(doc, steps=STEPS, out_dir=tmp_path / "out", progress=False, resume=copy.parent)
    assert not (tmp_path / "out").exists()


def test_other_refusals_come_before_anything_starts(tmp_path, cut_run):
    _, _, root = cut_run
    doc = compiled(tmp_path, cut_spec("dp_replicate: 2", micro=200))
    resume = step_dir(root, RESUME_AT)
    with pytest.raises(RuntimeRefusal, match=r"is at iteration 2; --steps 2 leaves nothing to run"):
        run_plan(doc, steps=2, out_dir=tmp_path / "out", progress=False, resume=resume)
    with pytest.raises(RuntimeRefusal, match=r"drop --reference or --resume"):
        run_plan(doc, steps=STEPS, out_dir=tmp_path / "out", progress=False, resume=resume, reference=True)
    with pytest.raises(RuntimeRefusal, match=r"add --save-every N"):
        run_plan(doc, steps=STEPS, out_dir=tmp_path / "out", progress=False, checkpoint_dir=tmp_path / "c")
    np.save(tmp_path / "bad.npy", np.zeros((10, 2)))
    with pytest.raises(RuntimeRefusal, match=r"bad\.npy: expected records of 3 values"):
        run_plan(doc, steps=STEPS, out_dir=tmp_path / "out", progress=False, data_path=tmp_path / "bad.npy")
    # A checkpoint of another runtime (here a transformer's manifest) is not an EM fit.
    pending = ckpt.begin_checkpoint(tmp_path / "torch", 3)
    ckpt.commit_checkpoint(pending, {"plan": {"content_digest": "sha256:0"}}, kind=ckpt.TORCH_KIND)
    with pytest.raises(RuntimeRefusal, match=r"holds 'torch-dcp' state, not an EM fit"):
        run_plan(doc, steps=STEPS, out_dir=tmp_path / "out", progress=False, resume=tmp_path / "torch")
    assert not (tmp_path / "out").exists()


def test_refusals_through_the_cli_are_one_line_with_exit_2(tmp_path, cut_run):
    _, _, root = cut_run
    spec = tmp_path / "spec.yaml"
    spec.write_text(cut_spec("dp_replicate: 2", micro=200, repeat=4), encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "mixle_compile", "run", str(spec), "--resume", str(root), "--quiet"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert (
        "step-00000005 is of a different model" in done.stderr and "[5, 3]" in done.stderr and "[4, 3]" in done.stderr
    )


def test_explain_shows_an_em_checkpoint_without_importing_torch(cut_run):
    doc, _, root = cut_run
    done = explain_without_torch(root)
    assert done.stdout.strip().splitlines()[-1] == "NO-TORCH 0", done.stderr
    text = done.stdout
    assert f"step {STEPS}" in text and doc.content_digest in text and "distribution" in text
    assert (
        "dp_replicate=2" in text and "tp=2" in text and "world 4" in text and f"{400 * STEPS} samples consumed" in text
    )
    assert "model.root.component/covs" in text and "5x3x3" in text
    assert (
        "fitted by EM" in text
        and f"fit: iteration {STEPS}, log-likelihood" in text
        and "lr ?" not in text
        and "seq_len" not in text
    )
    done = subprocess.run(
        [sys.executable, "-m", "mixle_compile", "explain", str(step_dir(root, RESUME_AT)), "--format", "json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    view = json.loads(done.stdout)
    assert (
        view["step"] == RESUME_AT
        and view["plan"]["content_digest"] == doc.content_digest
        and view["mesh"]["world_size"] == 4
    )
    assert view["arrays"]["model.root.component/means"]["shape"] == [5, 3]


# ---------------------------------------------------------------------------- a rank killed


def test_a_rank_killed_mid_fit_fails_the_job_and_resume_continues_the_same_fit(tmp_path):
    steps = 60
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        cut_spec("dp_replicate: 2", micro=200).replace(f"steps: {STEPS}", f"steps: {steps}"), encoding="utf-8"
    )
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "mixle_compile",
        "run",
        str(spec),
        "--save-every",
        "1",
        "--keep-checkpoints",
        "3",
        "--out",
        str(out),
        "--quiet",
        "--timeout",
        "10",
    ]
    job = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not step_dir(out / "checkpoints", 3).is_dir() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        victim = rank_process(job.pid, 1)
        assert victim is not None and job.poll() is None, "the fit ended before a rank could be killed"
        os.kill(victim, signal.SIGKILL)
        _, stderr = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 1 and "rank 1 died (killed by signal SIGKILL)" in stderr, stderr
    latest = ckpt.find_latest_checkpoint(out / "checkpoints")
    done = ckpt.read_manifest(latest)["step"]
    assert 3 <= done < steps
    # Resumed from the root (its latest complete checkpoint), saving only after the last iteration.
    resumed = run_plan(spec, out_dir=out, progress=False, resume=out / "checkpoints", save_every=steps)
    assert resumed.ok, resumed.errors
    assert resumed.data["run"]["first_step"] == done and len(resumed.data["log_likelihood_history"]) == steps
    em = read_em_instructions(compiled(tmp_path, spec.read_text(), "again.yaml"))
    ref_params, ref_lls, _ = reference_fit(em, sample_data(em), steps)
    np.testing.assert_allclose(resumed.data["log_likelihood_history"], ref_lls, rtol=EM_TOLERANCE, atol=0)
    expected = {f"{n}/{k}": a for n, p in ref_params.items() for k, a in p.items()}
    assert worst_error(arrays_at(out / "checkpoints", steps), expected) <= EM_TOLERANCE
    assert not monotone_violations(resumed.data["log_likelihood_history"])


def rank_process(launcher: int, rank: int) -> int | None:
    """The pid of the worker process of ``rank`` started by ``launcher`` (read from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if parent == launcher and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None

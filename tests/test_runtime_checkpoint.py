"""Checkpoints: atomic save, resume on another mesh, refusals, and a rank killed mid-step.

One uninterrupted run (dp_shard=2 x tp=2, AdamW, 2 accumulation steps, a checkpoint after every
step) is the yardstick: every resumed run, whatever its mesh, must end with the same parameters
(norm-wise relative error below RESUME_TOLERANCE) and the same per-step losses. One step of AdamW
moves the parameters by far more than that tolerance (asserted), so a skipped or repeated step, a
wrong data position or a mis-sliced shard fails these tests.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mixle_compile.runtime import RunFailed, RuntimeRefusal, checkpoint_dcp, run_plan
from mixle_compile.runtime import checkpoint as ckpt
from mixle_compile.runtime.data import BatchLayout
from mixle_compile.runtime.faults import FAULT_ENV
from tests.conftest import ROOT
from tests.test_runtime_support import compile_text, explain_without_torch, spec_text

torch = pytest.importorskip("torch")

RESUME_TOLERANCE = 1e-4  # measured: about 1e-6 (fp32 sums in another order on another mesh)
STEPS = 3
BASE = dict(optimizer="adamw", gas=2)  # global batch 2 * microbatches * gas * data-parallel size = 8


def plan(**kw):
    return compile_text(spec_text(**{**BASE, **kw}))


def relative_errors(a: dict, b: dict) -> dict[str, float]:
    assert sorted(a) == sorted(b)
    return {k: float((a[k] - b[k]).norm() / b[k].norm()) for k in b}


def losses_by_step(report) -> dict[int, float]:
    first = report.data["run"]["first_step"]
    return {first + i: loss for i, loss in enumerate(report.losses)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """dp_shard=2 x tp=2 on 4 ranks, 3 steps, a checkpoint after every step."""
    out = tmp_path_factory.mktemp("uninterrupted")
    report = run_plan(plan(ds=2, tp=2), steps=STEPS, out_dir=out, progress=False, save_every=1)
    assert report.ok, report.errors
    return report, out / "checkpoints"


def final_state(root: Path, step: int = STEPS) -> dict:
    return checkpoint_dcp.read_global_state(root / ckpt.step_dir_name(step))


def assert_continues(resumed, resumed_root: Path, uninterrupted, step: int = STEPS) -> float:
    report, root = uninterrupted
    errors = relative_errors(final_state(resumed_root, step), final_state(root, step))
    worst = max(errors.values())
    assert worst < RESUME_TOLERANCE, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    one_step = max(relative_errors(final_state(root, step - 1), final_state(root, step)).values())
    assert one_step > 100 * RESUME_TOLERANCE  # the tolerance would catch a step skipped or repeated
    expected = losses_by_step(report)
    for s, loss in losses_by_step(resumed).items():
        assert loss == pytest.approx(expected[s], rel=1e-5), f"step {s}"
    return worst


# ---------------------------------------------------------------------------- resharding


@pytest.fixture(scope="module")
def resumed_ds4(tmp_path_factory, uninterrupted):
    """From step 1 of dp_shard=2 x tp=2 onto dp_shard=4 without accumulation (4 ranks), saving step 2."""
    out = tmp_path_factory.mktemp("ds4")
    report = run_plan(
        plan(ds=4, gas=1),
        steps=2,
        out_dir=out,
        progress=False,
        save_every=1,
        resume=uninterrupted[1] / ckpt.step_dir_name(1),
    )
    assert report.ok, report.errors
    return report, out / "checkpoints"


def test_resume_tp2_to_tp1_and_dp_shard2_to_4(uninterrupted, resumed_ds4):
    report, root = resumed_ds4
    resumed = report.data["run"]["resumed_from"]
    assert resumed["step"] == 1 and resumed["mesh"]["tp"] == 2 and resumed["mesh"]["dp_shard"] == 2
    assert report.steps == 1 and sorted(losses_by_step(report)) == [1]
    assert report.accounting_ok  # the resumed job's collectives are the plan's, for the steps it ran
    assert [s for s, _, ok in ckpt.list_checkpoints(root) if ok] == [2]
    assert_continues(report, root, uninterrupted, step=2)


def test_resume_dp_shard4_to_2_and_world4_to_2(tmp_path, uninterrupted, resumed_ds4):
    """dp_shard=4 (4 ranks, no accumulation) -> dp_shard=2 with 2 micro-batches (2 ranks)."""
    report = run_plan(
        plan(ds=2, mb=2, gas=1), steps=STEPS, out_dir=tmp_path, progress=False, save_every=5, resume=resumed_ds4[1]
    )  # the root: its latest complete checkpoint
    assert report.ok, report.errors
    assert report.data["run"]["resumed_from"]["mesh"]["dp_shard"] == 4 and report.world_size == 2
    assert [s for s, _, ok in ckpt.list_checkpoints(tmp_path / "checkpoints") if ok] == [STEPS]  # saved at the end
    assert_continues(report, tmp_path / "checkpoints", uninterrupted)


@pytest.fixture(scope="module")
def resumed_tp1(tmp_path_factory, uninterrupted):
    """From step 1 of dp_shard=2 x tp=2 (4 ranks) onto dp_shard=2 (2 ranks), saving step 2."""
    out = tmp_path_factory.mktemp("tp1")
    report = run_plan(
        plan(ds=2), steps=2, out_dir=out, progress=False, save_every=1, resume=uninterrupted[1] / ckpt.step_dir_name(1)
    )
    assert report.ok, report.errors
    return report, out / "checkpoints"


@pytest.mark.slow
def test_resume_tp2_to_tp1_with_the_same_dp_shard(uninterrupted, resumed_tp1):
    report, root = resumed_tp1
    assert report.data["run"]["resumed_from"]["mesh"]["tp"] == 2 and report.world_size == 2
    assert_continues(report, root, uninterrupted, step=2)


@pytest.mark.slow
def test_resume_world2_to_4_onto_a_distributed_optimizer_with_tp(tmp_path, uninterrupted, resumed_tp1):
    """dp_shard=2 (2 ranks) -> dp_replicate=2 x tp=2 with a distributed optimizer (4 ranks): optimizer
    state goes from FSDP row shards to dp_replicate shards of tp slices."""
    report = run_plan(
        plan(dr=2, tp=2, dopt=True), steps=STEPS, out_dir=tmp_path, progress=False, save_every=1, resume=resumed_tp1[1]
    )
    assert report.ok, report.errors
    assert report.data["run"]["resumed_from"]["mesh"]["world_size"] == 2 and report.world_size == 4
    assert_continues(report, tmp_path / "checkpoints", uninterrupted)


# ---------------------------------------------------------------------------- refusals


def copy_step(uninterrupted, tmp_path: Path, step: int = 2) -> Path:
    target = tmp_path / "ckpts" / ckpt.step_dir_name(step)
    shutil.copytree(uninterrupted[1] / ckpt.step_dir_name(step), target)
    return target


def test_a_checkpoint_without_its_marker_is_never_loaded(tmp_path, uninterrupted):
    step_dir = copy_step(uninterrupted, tmp_path)
    (step_dir / ckpt.COMPLETE_MARKER).unlink()
    with pytest.raises(RuntimeRefusal, match=r"no completion marker COMPLETE"):
        run_plan(plan(ds=2), steps=STEPS, out_dir=tmp_path / "out", progress=False, resume=step_dir)
    with pytest.raises(
        RuntimeRefusal, match=r"holds no complete checkpoint: step-00000002 lack\(s\) the completion marker COMPLETE"
    ):
        run_plan(plan(ds=2), steps=STEPS, out_dir=tmp_path / "out", progress=False, resume=step_dir.parent)
    assert ckpt.find_latest_checkpoint(step_dir.parent) is None


def test_the_latest_complete_checkpoint_is_taken_and_partial_ones_skipped(tmp_path, uninterrupted):
    root = tmp_path / "ckpts"
    for step in (1, 2, 3):
        copy_step(uninterrupted, tmp_path, step)
    (root / ckpt.step_dir_name(3) / ckpt.COMPLETE_MARKER).unlink()
    (root / ".partial-step-00000004").mkdir()
    assert ckpt.resolve_checkpoint(root) == root / ckpt.step_dir_name(2)


def test_a_different_model_is_refused_naming_the_parameter(tmp_path, uninterrupted):
    other = spec_text(**BASE, ds=2).replace("ffn_hidden_size: 64", "ffn_hidden_size: 96")
    with pytest.raises(RuntimeRefusal) as caught:
        run_plan(compile_text(other), steps=STEPS, out_dir=tmp_path, progress=False, resume=uninterrupted[1])
    text = str(caught.value)
    assert "different model" in text
    assert "'layers.0.mlp.gate_proj.weight' has shape [64, 32] in the checkpoint but [96, 32] in this plan" in text


def test_another_global_batch_or_optimizer_is_refused(tmp_path, uninterrupted):
    with pytest.raises(RuntimeRefusal, match=r"global_batch_size 8, this plan has 16"):
        run_plan(
            plan(ds=2, gas=4), steps=STEPS, out_dir=tmp_path, progress=False, resume=uninterrupted[1] / "step-00000002"
        )
    with pytest.raises(RuntimeRefusal, match=r"optimizer 'adamw', this plan uses 'sgd'"):
        run_plan(
            plan(ds=2, optimizer="sgd"),
            steps=STEPS,
            out_dir=tmp_path,
            progress=False,
            resume=uninterrupted[1] / "step-00000002",
        )
    with pytest.raises(RuntimeRefusal, match=r"is at step 2; --steps 2 leaves nothing to run"):
        run_plan(plan(ds=2), steps=2, out_dir=tmp_path, progress=False, resume=uninterrupted[1] / "step-00000002")
    with pytest.raises(RuntimeRefusal, match=r"--reference .* cannot check a resumed run"):
        run_plan(plan(ds=2), steps=STEPS, out_dir=tmp_path, progress=False, reference=True, resume=uninterrupted[1])


def test_a_corrupted_missing_or_newer_manifest_is_refused(tmp_path, uninterrupted):
    step_dir = copy_step(uninterrupted, tmp_path)
    manifest = step_dir / ckpt.MANIFEST_FILE
    original = manifest.read_bytes()
    manifest.write_bytes(original.replace(b'"step": 2', b'"step": 3'))
    with pytest.raises(ckpt.CheckpointError, match=r"does not match the SHA-256 its completion marker records"):
        ckpt.read_manifest(step_dir)
    manifest.unlink()
    with pytest.raises(ckpt.CheckpointError, match=r"cannot read its manifest"):
        ckpt.read_manifest(step_dir)
    newer = json.loads(original)
    newer["format_version"] = ckpt.FORMAT_VERSION + 1
    data = ckpt.manifest_bytes(newer)
    manifest.write_bytes(data)
    marker = json.loads((step_dir / ckpt.COMPLETE_MARKER).read_text())
    (step_dir / ckpt.COMPLETE_MARKER).write_text(
        json.dumps({**marker, "manifest_sha256": hashlib.sha256(data).hexdigest()})
    )
    with pytest.raises(
        ckpt.CheckpointError,
        match=rf"format version 3, newer than this mixle-compile reads \({ckpt.FORMAT_VERSION}\); upgrade",
    ):
        ckpt.read_manifest(step_dir)


def test_refusals_through_the_cli_are_one_line_with_exit_2(tmp_path, uninterrupted):
    step_dir = copy_step(uninterrupted, tmp_path)
    (step_dir / ckpt.COMPLETE_MARKER).unlink()
    spec = tmp_path / "spec.yaml"
    spec.write_text(spec_text(**BASE, ds=2), encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "mixle_compile", "run", str(spec), "--resume", str(step_dir), "--quiet"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert "no completion marker COMPLETE" in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "mixle_compile", "run", str(spec), "--checkpoint-dir", str(tmp_path / "c"), "--quiet"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 2 and "add --save-every N" in done.stderr


def shards(step_dir: Path) -> list[Path]:
    return sorted((step_dir / ckpt.STATE_DIR).glob("*.distcp"))


@pytest.mark.parametrize("damage", ["truncated", "overwritten", "swapped"])
def test_a_damaged_shard_is_refused_before_any_rank_starts_naming_the_file(tmp_path, uninterrupted, damage):
    step_dir = copy_step(uninterrupted, tmp_path)
    shard = shards(step_dir)[0]
    data = shard.read_bytes()
    if damage == "truncated":
        shard.write_bytes(data[: len(data) // 2])
        words = f"{shard} has {len(data) // 2} bytes, the manifest seals {len(data)}"
    elif damage == "overwritten":
        shard.write_bytes(data[:100] + bytes([data[100] ^ 0x10]) + data[101:])  # one bit
        words = f"{shard} does not match the SHA-256 its manifest seals"
    else:  # the same shard of another step: same name and size, other values
        other = uninterrupted[1] / ckpt.step_dir_name(1) / ckpt.STATE_DIR / shard.name
        shutil.copy(other, shard)
        words = f"{shard} does not match the SHA-256 its manifest seals"
    spec = tmp_path / "spec.yaml"
    spec.write_text(spec_text(**BASE, ds=2), encoding="utf-8")
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mixle_compile",
            "run",
            str(spec),
            "--resume",
            str(step_dir),
            "--out",
            str(out),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert words in done.stderr and "Traceback" not in done.stderr
    assert not (out / "logs").exists()  # refused on the launcher: no rank started


def test_a_dcp_checkpoint_is_sealed_and_explain_verifies_it(uninterrupted):
    step_dir = uninterrupted[1] / ckpt.step_dir_name(2)
    manifest = ckpt.verify_checkpoint(step_dir)
    assert set(manifest["files"]) == {f"state/{p.name}" for p in shards(step_dir)} | {f"state/{ckpt.DCP_METADATA_FILE}"}
    assert (
        manifest["run_id"] == ckpt.verify_checkpoint(uninterrupted[1] / ckpt.step_dir_name(1))["run_id"]
    )  # one run, one id
    done = explain_without_torch(step_dir)
    assert done.stdout.strip().splitlines()[-1] == "NO-TORCH 0", done.stderr
    assert f"sealed: {len(manifest['files'])} file(s)" in done.stdout and manifest["run_id"] in done.stdout


# ---------------------------------------------------------------------------- faults


def test_a_rank_killed_mid_step_fails_the_job_and_resume_loses_only_the_steps_since(tmp_path, uninterrupted):
    spec = tmp_path / "spec.yaml"
    spec.write_text(spec_text(**BASE, ds=2, tp=2, steps=STEPS), encoding="utf-8")
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "mixle_compile.runtime",
        str(spec),
        "--save-every",
        "1",
        "--out",
        str(out),
        "--quiet",
        "--timeout",
        "10",
    ]
    started = time.monotonic()
    killed = subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, timeout=180, env={**os.environ, FAULT_ENV: "sigkill:1:1"}
    )
    elapsed = time.monotonic() - started
    assert killed.returncode == 1, killed.stderr
    assert "rank 1 died (killed by signal SIGKILL)" in killed.stderr
    assert elapsed < 60  # bounded: the dead peer breaks the others' collectives, the launcher stops them
    root = out / "checkpoints"
    assert [s for s, _, ok in ckpt.list_checkpoints(root) if ok] == [1]  # the second step never finished
    resumed = subprocess.run(
        [*command[:-2], "--resume", str(root)], capture_output=True, text=True, cwd=ROOT, timeout=180
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "(step 1," in resumed.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["run"]["first_step"] == 1 and len(report["losses"]) == 2
    errors = relative_errors(final_state(root), final_state(uninterrupted[1]))
    assert max(errors.values()) < RESUME_TOLERANCE


def test_a_save_interrupted_before_its_commit_leaves_no_checkpoint(tmp_path, monkeypatch, uninterrupted):
    monkeypatch.setenv(FAULT_ENV, "savekill:0:2")  # rank 0 dies after writing step 2's tensors, before the manifest
    with pytest.raises(RunFailed) as caught:
        run_plan(plan(ds=2), steps=2, out_dir=tmp_path, progress=False, save_every=1, timeout_s=10)
    assert caught.value.ranks == (0,)
    root = tmp_path / "checkpoints"
    assert (root / ".partial-step-00000002" / "state").is_dir()
    assert not (root / "step-00000002").exists()
    assert ckpt.resolve_checkpoint(root) == root / "step-00000001"


# ---------------------------------------------------------------------------- in-process API


@pytest.fixture
def single_rank():
    """A one-rank AdamW session with 2 accumulation steps, in this process."""
    from mixle_compile.runtime.session import open_session

    doc = plan()
    sessions = []

    def make():
        s = open_session(doc)
        sessions.append(s)
        return s

    yield doc, make
    for s in reversed(sessions):
        s.close()


def one_step(session, step: int):
    from mixle_compile.runtime.data import local_batch
    from mixle_compile.runtime.worker import batch_layout, token_source

    layout, source = batch_layout(session.instructions), token_source(session.instructions, None)
    for a in range(layout.accumulation_steps):
        receipt = session.train_batch(*local_batch(source, layout, step, a, 0))
    return receipt


def test_saving_with_gradients_pending_is_refused_and_a_save_round_trips(tmp_path, single_rank):
    from mixle_compile.runtime.data import local_batch
    from mixle_compile.runtime.worker import batch_layout, token_source

    doc, make = single_rank
    session = make()
    one_step(session, 0)
    layout, source = batch_layout(session.instructions), token_source(session.instructions, None)
    session.train_batch(*local_batch(source, layout, 1, 0, 0))  # half of step 1's window
    with pytest.raises(ckpt.CheckpointError, match=r"1 of 2 accumulation steps have gradients pending"):
        checkpoint_dcp.save_session(session, tmp_path)
    session.train_batch(*local_batch(source, layout, 1, 1, 0))
    rng_at_save = torch.get_rng_state()
    path = checkpoint_dcp.save_session(session, tmp_path, data_source=ckpt.source_description(None, 0))
    assert path == tmp_path / "step-00000002" and not list(tmp_path.glob(".partial-*"))
    assert not list(path.rglob("*.metadata")) and (path / "state" / ckpt.DCP_METADATA_FILE).is_file()
    before = {n: p.master.detach().clone() for n, p in session.store.params.items()}
    state_before = {
        n: {k: v.clone() for k, v in session.optimizer.state[p.master].items()} for n, p in session.store.params.items()
    }
    expected = one_step(session, 2).loss
    fresh = make()
    torch.manual_seed(1234)
    assert fresh.load_checkpoint(tmp_path)["step"] == 2  # the library API; the root: its latest
    assert torch.equal(torch.get_rng_state(), rng_at_save)
    assert fresh.step == 2
    for n, p in fresh.store.params.items():
        assert torch.equal(p.master.detach(), before[n])
        for k, v in state_before[n].items():
            assert torch.equal(fresh.optimizer.state[p.master][k], v), (n, k)
    assert one_step(fresh, 2).loss == expected  # bitwise: same mesh, same state, same batch


def test_non_finite_values_are_refused_on_load_naming_the_tensor(tmp_path, single_rank):
    doc, make = single_rank
    session = make()
    one_step(session, 0)
    name = sorted(session.store.params)[0]
    with torch.no_grad():
        session.store.params[name].master.view(-1)[0] = float("nan")
    checkpoint_dcp.save_session(session, tmp_path)
    fresh = make()
    with pytest.raises(ckpt.CheckpointError, match=rf"'model/{name}' holds NaN or infinite values"):
        fresh.load_checkpoint(tmp_path)


def test_data_position_is_the_same_global_samples_on_any_layout():
    layouts = [
        BatchLayout(2, 1, 2, 2),
        BatchLayout(2, 1, 1, 4),
        BatchLayout(2, 2, 1, 2),
        BatchLayout(2, 4, 1, 1),
        BatchLayout(4, 1, 2, 1),
    ]
    assert {layout.global_batch for layout in layouts} == {8}
    for layout in layouts:
        for step in range(3):
            samples = sorted(
                layout.first_sample(step, a, d) + i
                for a in range(layout.accumulation_steps)
                for d in range(layout.data_parallel_size)
                for i in range(layout.per_rank)
            )
            assert samples == list(range(layout.samples_before(step), layout.samples_before(step + 1)))
        assert layout.step_at(layout.samples_before(3)) == 3
    with pytest.raises(RuntimeRefusal, match="falls inside a global batch of 8"):
        BatchLayout(2, 1, 2, 2).step_at(12)


# ---------------------------------------------------------------------------- directory layer, explain


def test_numpy_arrays_checkpoint_atomically_for_other_runtimes(tmp_path):
    means = np.arange(6, dtype=np.float64).reshape(3, 2)
    for step in (1, 2, 3):
        ckpt.write_array_checkpoint(
            tmp_path, step, {"means": means * step, "weights": np.full(3, 1 / 3)}, {"model": "mixture"}
        )
    manifest, arrays = ckpt.read_array_checkpoint(tmp_path)
    assert manifest["step"] == 3 and manifest["model"] == "mixture" and manifest["kind"] == ckpt.ARRAYS_KIND
    np.testing.assert_array_equal(arrays["means"], means * 3)
    assert ckpt.prune_checkpoints(tmp_path, keep=2) == [tmp_path / "step-00000001"]
    assert [s for s, _, _ in ckpt.list_checkpoints(tmp_path)] == [2, 3]
    with pytest.raises(ckpt.CheckpointError, match="holds 'numpy-arrays' state, not 'torch-dcp'"):
        ckpt.read_manifest(tmp_path / "step-00000003", kind=ckpt.TORCH_KIND)
    with pytest.raises(ckpt.CheckpointError, match="Python objects"):
        ckpt.write_array_checkpoint(tmp_path, 4, {"x": np.array([object()])}, {})
    assert ckpt.find_latest_checkpoint(tmp_path) == tmp_path / "step-00000003"


def test_explain_shows_a_checkpoint_without_importing_torch(uninterrupted):
    report, root = uninterrupted
    done = explain_without_torch(root)
    assert done.stdout.strip().splitlines()[-1] == "NO-TORCH 0", done.stderr
    text = done.stdout
    assert f"step {STEPS}" in text and report.data["plan"]["content_digest"] in text
    assert "dp_shard=2" in text and "tp=2" in text and "world 4" in text and f"{8 * STEPS} samples consumed" in text
    assert "layers.0.attn.q_proj.weight" in text
    done = subprocess.run(
        [sys.executable, "-m", "mixle_compile", "explain", str(root / "step-00000002"), "--format", "json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    view = json.loads(done.stdout)
    assert view["step"] == 2 and view["mesh"]["dp_shard"] == 2 and view["mesh"]["tp"] == 2
    assert view["plan"]["content_digest"] == report.data["plan"]["content_digest"]
    assert view["data"]["samples_consumed"] == 16
    shapes = {p["name"]: p["shape"] for p in view["parameters"]}
    assert shapes["embed.weight"] == [128, 32]

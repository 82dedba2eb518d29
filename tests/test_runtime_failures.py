"""A dead, failing or stalled rank ends the job with an error that names it; nothing hangs.

Faults are injected with MIXLE_RUNTIME_FAULT (``kind:rank:step``) just before a step. The test's
own subprocess limit is only a guard against a hang; what is asserted is the behaviour: RunFailed,
the culprit rank in the message, and no worker left running.
"""

from __future__ import annotations

import subprocess

import pytest

from mixle_compile.runtime import RunFailed, run_plan
from mixle_compile.runtime.faults import FAULT_ENV
from tests.test_runtime_support import plan_for


def no_workers_left(out_dir) -> bool:
    listing = subprocess.run(
        ["ps", "-ww", "-eo", "args"], capture_output=True, text=True
    ).stdout  # -ww: never truncated
    return str(out_dir) not in listing


@pytest.mark.parametrize(
    ("fault", "mesh", "culprit", "words"),
    [
        ("kill:1:1", dict(ds=2, tp=2), 1, ["rank 1 died"]),
        ("raise:1:1", dict(dr=2), 1, ["rank 1 failed: RuntimeError: injected fault on rank 1 at step 1"]),
        ("stall:3:1", dict(ds=2, tp=2), 3, ["rank 3 stalled", "timed out after 4 s"]),
    ],
)
def test_a_failing_rank_is_named_and_the_job_stops(tmp_path, monkeypatch, fault, mesh, culprit, words):
    monkeypatch.setenv(FAULT_ENV, fault)
    with pytest.raises(RunFailed) as caught:
        run_plan(plan_for(**mesh), steps=3, out_dir=tmp_path, progress=False, timeout_s=4)
    for text in words:
        assert text in str(caught.value)
    assert caught.value.ranks == (culprit,)
    assert no_workers_left(tmp_path)


@pytest.mark.parametrize(
    "option,value",
    [
        ("timeout_s", float("nan")),
        ("timeout_s", -5),
        ("timeout_s", float("inf")),
        ("steps", 0),
        ("save_every", -1),
        ("keep_checkpoints", 0),
    ],
)
def test_options_no_run_can_use_are_refused_before_any_rank_starts(tmp_path, option, value):
    from mixle_compile.runtime.errors import RuntimeRefusal

    with pytest.raises(RuntimeRefusal, match=option.removesuffix("_s")):
        run_plan(plan_for(), out_dir=tmp_path, progress=False, **{option: value})
    assert not (tmp_path / "logs").exists()  # nothing was started


@pytest.mark.parametrize("argument", ["--timeout=nan", "--timeout=-5", "--steps=0", "--keep-checkpoints=0"])
def test_the_run_command_refuses_them_with_exit_2(capsys, argument):
    from mixle_compile.cli import main

    assert main(["run", "examples/tiny-transformer.yaml", argument]) == 2
    assert argument.split("=")[0] in capsys.readouterr().err


def test_a_diverged_loss_fails_the_run_naming_its_step(tmp_path):
    # A learning rate of 1e6 makes the loss NaN within a few steps; the run used to report success.
    with pytest.raises(RunFailed, match=r"training diverged: the loss of step \d+ is (nan|inf)") as failed:
        run_plan(plan_for(ds=2, optimizer="adamw", lr=1e6, steps=6), out_dir=tmp_path, progress=False)
    assert set(failed.value.ranks) == {0, 1}  # every rank stops at the same step
    receipts = (tmp_path / "receipts.jsonl").read_text().splitlines()
    assert receipts and len(receipts) < 6  # the diverged step is recorded, no later one


def _launch_and_wait_for_ranks(tmp_path):
    """A long run started as its own process; returns it once every rank has begun to train."""
    import sys
    import time

    from tests.test_runtime_support import spec_text

    spec = tmp_path / "long.yaml"
    spec.write_text(spec_text(ds=2, steps=100000))
    out = tmp_path / "out"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "mixle_compile.cli", "run", str(spec), "--out", str(out), "--quiet"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        receipts = out / "receipts.jsonl"
        if receipts.is_file() and receipts.read_text().count("\n") >= 2:
            return launcher, out
        time.sleep(0.2)
    launcher.kill()
    pytest.fail("the ranks never started training")


def _workers_gone(out, seconds: float) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if no_workers_left(out):
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_ranks_die_with_their_launcher(tmp_path, sig):
    import signal

    launcher, out = _launch_and_wait_for_ranks(tmp_path)
    launcher.send_signal(getattr(signal, sig))
    launcher.wait(timeout=30)
    assert _workers_gone(out, 10), f"ranks kept training after the launcher got {sig}"

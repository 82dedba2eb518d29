"""Progress on standard error for long work: compiles of large plans, `run --reference`; steps numbered from 1."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import time

import pytest

from mixle_compile import cli, progress
from mixle_compile.progress import Progress
from mixle_compile.runtime.report import RunReport
from tests.conftest import EXAMPLES, ROOT


def test_phases_are_numbered_and_quiet_work_prints_nothing():
    out = io.StringIO()
    p = Progress("compile", 3, after=0, stream=out)
    for what in ("a", "b", "c"):
        p.step(what)
    p.close()
    assert [re.sub(r" \(.*", "", line) for line in out.getvalue().splitlines()] == [
        "mixle-compile compile [1/3] a",
        "mixle-compile compile [2/3] b",
        "mixle-compile compile [3/3] c",
    ]
    quiet = io.StringIO()
    p = Progress("compile", 2, after=30, stream=quiet)
    p.step("a"), p.step("b"), p.close()
    assert quiet.getvalue() == ""


def test_a_long_phase_announces_itself_while_it_runs():
    out = io.StringIO()
    p = Progress("compile", 2, after=0.05, stream=out)
    p.step("quick")  # ends before 0.05 s: never announced
    p.step("slow")
    time.sleep(0.3)
    assert "[2/2] slow" in out.getvalue()  # printed during the phase, by its timer
    p.close()
    assert "quick" not in out.getvalue()


@pytest.mark.parametrize("verb", ["compile", "explain"])
def test_the_verbs_report_each_phase_of_a_compile(capsys, monkeypatch, tmp_path, verb):
    monkeypatch.setattr(progress, "QUIET_FOR_S", 0.0)  # announce every phase at once
    spec = EXAMPLES / "tiny-transformer.yaml"
    argv = ["compile", str(spec), "-o", str(tmp_path / "p.json")] if verb == "compile" else ["explain", str(spec)]
    assert cli.main(argv) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mixle-compile ")]
    numbers = [re.search(r"\[(\d)/4\]", line).group(1) for line in lines]
    assert numbers == ["1", "2", "3", "4"], lines
    assert "verifying the spec" in lines[0] and "lowering" in lines[1] and "building the plan" in lines[2]


def test_a_resumed_run_names_its_steps_from_one(tmp_path):
    data = {
        "ok": True,
        "errors": [],
        "plan": {"world_size": 4},
        "losses": [4.77, 4.67],
        "run": {
            "steps": 2,
            "wall_s": 7.0,
            "first_step": 1,
            "last_step": 3,
            "resumed_from": {
                "path": "ckpt/step-00000001",
                "step": 1,
                "mesh": {"world_size": 4},
                "plan_digest": "sha256:0",
            },
            "checkpoints": {"root": "ckpt", "saved": [{"step": 2, "save_s": 0.1}, {"step": 3, "save_s": 0.1}]},
        },
        "accounting": {"ok": True, "updates_checked": 73, "collective_calls_per_rank": [80, 80]},
    }
    summary = RunReport.from_dict(data, tmp_path).summary()
    # resumed after step 1 of 3: it ran steps 2 and 3, the last checkpoint is step 3 (step-00000003)
    assert "ran 2 step(s) (steps 2..3)" in summary and "latest step 3" in summary


@pytest.mark.slow
def test_run_reference_shows_each_phase(tmp_path):
    pytest.importorskip("torch")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mixle_compile",
            "run",
            str(EXAMPLES / "tiny-transformer.yaml"),
            "--steps",
            "2",
            "--reference",
            "--out",
            str(tmp_path / "out"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    order = ["step 2/2", "reference 1/3", "repeat step 2/2", "reference 2/3", "reference step 2/2", "reference 3/3"]
    positions = [next(i for i, line in enumerate(lines) if line.startswith(what)) for what in order]
    assert positions == sorted(positions), lines

"""`run` under torchrun: the ranks join torchrun's group instead of being started by the runtime."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import EXAMPLES, ROOT


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "mixle_compile.runtime",
        *args,
    ]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)


def test_run_joins_a_torchrun_group(tmp_path):
    out = torchrun(4, str(EXAMPLES / "tiny-transformer.yaml"), "--steps", "2", "--out", str(tmp_path), "--quiet")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] and report["accounting"]["ok"]
    assert report["accounting"]["ranks_checked"] == 4 and report["run"]["steps"] == 2
    assert out.stdout.count("planned == observed on every rank: yes") == 1  # rank 0 prints the summary
    assert len((tmp_path / "receipts.jsonl").read_text().splitlines()) == 2


def test_torchrun_with_the_wrong_number_of_ranks_is_refused(tmp_path):
    out = torchrun(2, str(EXAMPLES / "tiny-transformer.yaml"), "--steps", "1", "--out", str(tmp_path), "--quiet")
    assert out.returncode != 0
    assert "WORLD_SIZE=2" in out.stderr and "world size is 4" in out.stderr
    assert not (tmp_path / "report.json").exists()


def test_checkpoints_under_torchrun_are_sealed_by_one_run(tmp_path):
    from mixle_compile.runtime import checkpoint as ckpt

    out = torchrun(
        4,
        str(EXAMPLES / "tiny-transformer.yaml"),
        "--steps",
        "2",
        "--save-every",
        "1",
        "--out",
        str(tmp_path),
        "--quiet",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    root = tmp_path / "checkpoints"
    run_ids = {ckpt.verify_checkpoint(root / ckpt.step_dir_name(s))["run_id"] for s in (1, 2)}
    assert len(run_ids) == 1  # rank 0's run id, on every checkpoint it committed
    assert json.loads((root / ckpt.LOCK_FILE).read_text())["run_id"] in run_ids  # rank 0 held the root's lock

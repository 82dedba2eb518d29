"""What `run` refuses or bounds around its processes and files: torchrun's variables, a peer that
never joins, the rendezvous store's address, links planted in the output directory, token data
identified by content, a diverged EM fit."""

from __future__ import annotations

import datetime
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from mixle_compile.runtime import RunFailed, RuntimeRefusal, run_plan
from mixle_compile.runtime import checkpoint as ckpt
from mixle_compile.runtime.faults import FAULT_ENV
from mixle_compile.runtime.launch import RENDEZVOUS_ENV
from tests.test_runtime_failures import no_workers_left
from tests.test_runtime_support import plan_for

torch = pytest.importorskip("torch")

TORCHRUN = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
)


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK=4 is outside WORLD_SIZE=4"),
        ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK='x' is not an integer"),
        ({"RANK": "1", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 is out of range"),
        (
            {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
            "LOCAL_RANK=2 is outside LOCAL_WORLD_SIZE=2",
        ),
        (
            {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"},
            "LOCAL_WORLD_SIZE=8 is above WORLD_SIZE=4",
        ),
        ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}, "LOCAL_RANK=3 is above RANK=1"),
        ({"RANK": "0", "WORLD_SIZE": "4", "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is out of range"),
        ({"RANK": "0", "WORLD_SIZE": "4", "MASTER_PORT": "http"}, "MASTER_PORT='http' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": " "}, "MASTER_ADDR is empty"),
        (
            {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1"},
            "MASTER_PORT is not set, but RANK and WORLD_SIZE are",
        ),
    ],
)
def test_inconsistent_torchrun_variables_are_refused_naming_the_variable(tmp_path, monkeypatch, capsys, env, words):
    from mixle_compile.runtime.cli import main

    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeRefusal, match=words.replace("(", r"\(").replace(")", r"\)")):
        run_plan(plan_for(ds=2, tp=2), steps=1, out_dir=tmp_path, progress=False)
    spec = tmp_path / "spec.yaml"
    from tests.test_runtime_support import spec_text

    spec.write_text(spec_text(ds=2, tp=2))
    assert main([str(spec), "--out", str(tmp_path / "cli"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
    assert not (tmp_path / "cli").exists()  # refused before anything was written


def test_a_peer_that_never_joins_fails_the_run_within_the_rendezvous_limit(tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "nojoin:1:0")  # rank 1 hangs before joining the process group
    monkeypatch.setenv(RENDEZVOUS_ENV, "5")
    started = time.monotonic()
    with pytest.raises(RunFailed) as caught:
        run_plan(plan_for(ds=2), steps=1, out_dir=tmp_path, progress=False, timeout_s=4)
    elapsed = time.monotonic() - started
    assert elapsed < 60, elapsed  # it used to wait 300 s for the missing rank
    assert "rank 1 never joined the process group" in str(caught.value) and "after 5 s" in str(caught.value)
    assert caught.value.ranks == (1,)
    assert no_workers_left(tmp_path)


def test_a_bad_rendezvous_limit_is_refused_before_any_rank_starts(tmp_path, monkeypatch):
    monkeypatch.setenv(RENDEZVOUS_ENV, "-1")
    with pytest.raises(RuntimeRefusal, match=rf"{RENDEZVOUS_ENV}='-1' must be a positive"):
        run_plan(plan_for(ds=2), steps=1, out_dir=tmp_path, progress=False)
    assert not (tmp_path / "logs").exists()


def listening_addresses(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) of sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, state = fields[1], fields[3]
            if state == "0A" and int(address.rsplit(":", 1)[1], 16) == port:
                found.append(address.rsplit(":", 1)[0])
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net/tcp")
def test_the_rendezvous_store_of_a_local_launch_listens_on_loopback_only():
    from mixle_compile.runtime.session import is_local_address, rendezvous_store

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = rendezvous_store("127.0.0.1", port, 0, 1, datetime.timedelta(seconds=5))
    store.set("k", "v")
    assert listening_addresses(port) == ["0100007F"]  # 127.0.0.1, not every interface
    assert is_local_address("localhost") and is_local_address("127.0.0.1") and not is_local_address("192.0.2.7")


def test_links_planted_in_the_output_directory_are_never_written_through(tmp_path):
    precious, kept = tmp_path / "precious.txt", tmp_path / "kept"
    precious.write_text("precious")
    kept.mkdir()
    (kept / "rank0.log").write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    for name in ("report.json", "receipts.jsonl", "plan.json"):
        (out / name).symlink_to(precious)
    (out / "logs").symlink_to(kept, target_is_directory=True)
    report = run_plan(plan_for(), steps=1, out_dir=out, progress=False)
    assert report.ok, report.errors
    assert precious.read_text() == "precious" and (kept / "rank0.log").read_text() == "precious"
    for name in ("report.json", "receipts.jsonl", "plan.json", "logs"):
        assert not (out / name).is_symlink()
    (out / "checkpoints").symlink_to(kept, target_is_directory=True)
    with pytest.raises(RuntimeRefusal, match=r"checkpoints is a symbolic link .* never written through a link"):
        run_plan(plan_for(), steps=1, out_dir=out, progress=False, save_every=1)
    assert sorted(p.name for p in kept.iterdir()) == ["rank0.log"]


def test_resume_on_another_token_file_of_the_same_name_and_size_is_refused(tmp_path):
    tokens = tmp_path / "data" / "tokens.npy"
    tokens.parent.mkdir()
    rng = np.random.default_rng(0)
    np.save(tokens, rng.integers(0, 128, 4000).astype(np.int64), allow_pickle=False)
    first = run_plan(plan_for(), steps=1, out_dir=tmp_path / "a", progress=False, save_every=1, data_path=tokens)
    assert first.ok, first.errors
    size = tokens.stat().st_size
    np.save(tokens, rng.integers(0, 128, 4000).astype(np.int64), allow_pickle=False)  # other tokens, same name and size
    assert tokens.stat().st_size == size
    with pytest.raises(
        RuntimeRefusal, match=r"was trained on data token file tokens.npy .* this run reads token file tokens.npy"
    ):
        run_plan(
            plan_for(),
            steps=2,
            out_dir=tmp_path / "b",
            progress=False,
            data_path=tokens,
            resume=tmp_path / "a" / "checkpoints",
        )
    assert not (tmp_path / "b").exists()


def test_a_second_run_on_a_checkpoint_dir_in_use_is_refused(tmp_path, capsys):
    from mixle_compile.runtime.cli import main
    from tests.test_runtime_support import spec_text

    held = ckpt.lock_root(tmp_path / "ckpts", "the-first-run")  # as a first run holds it while it trains
    try:
        spec = tmp_path / "spec.yaml"
        spec.write_text(spec_text())
        assert (
            main(
                [
                    str(spec),
                    "--out",
                    str(tmp_path / "out"),
                    "--save-every",
                    "1",
                    "--checkpoint-dir",
                    str(tmp_path / "ckpts"),
                    "--quiet",
                ]
            )
            == 2
        )
        err = capsys.readouterr().err
        assert "is in use by another run" in err and "the-first-run" in err and "--checkpoint-dir" in err
        assert not (tmp_path / "out" / "logs").exists()  # no rank was started
    finally:
        ckpt.unlock_root(held)


def test_a_non_finite_log_likelihood_ends_an_em_fit_naming_the_iteration(tmp_path):
    from tests.test_runtime_em import DIAG, compiled, spec_text

    doc = compiled(tmp_path, spec_text(DIAG, mesh="dp_replicate: 2", rows=400, micro=200))
    data = np.random.default_rng(0).normal(0, 1, (400, 3))
    data[:5] = 1e200  # finite records whose squares overflow: the log-likelihood is NaN
    np.save(tmp_path / "huge.npy", data)
    with pytest.raises(RunFailed, match=r"the fit diverged: the log-likelihood of iteration 1 is nan") as caught:
        run_plan(
            doc,
            steps=5,
            out_dir=tmp_path / "out",
            progress=False,
            data_path=tmp_path / "huge.npy",
            save_every=1,
            timeout_s=10,
        )
    assert set(caught.value.ranks) == {0, 1}
    assert not ckpt.list_checkpoints(tmp_path / "out" / "checkpoints")  # nothing diverged was saved


def test_retention_keeps_another_runs_and_stale_steps_and_this_runs_newest(tmp_path):
    root = tmp_path / "ckpts"
    ckpt.write_array_checkpoint(root, 7, {"x": np.zeros(2)}, {"model": "another run's"}, run_id="another-run")
    (root / ckpt.step_dir_name(9)).mkdir()  # a stale step directory, never completed
    report = run_plan(
        plan_for(),
        steps=3,
        out_dir=tmp_path / "out",
        progress=False,
        save_every=1,
        keep_checkpoints=1,
        checkpoint_dir=root,
    )
    assert report.ok, report.errors
    assert [s for s, _, _ in ckpt.list_checkpoints(root)] == [3, 7, 9]
    assert ckpt.verify_checkpoint(root / ckpt.step_dir_name(7))["run_id"] == "another-run"
    assert ckpt.verify_checkpoint(root / ckpt.step_dir_name(3))["run_id"] != "another-run"


def test_a_run_resumes_and_saves_in_a_root_whose_recommit_was_interrupted(tmp_path):
    root = tmp_path / "ckpts"
    first = run_plan(plan_for(), steps=2, out_dir=tmp_path / "a", progress=False, save_every=1, checkpoint_dir=root)
    assert first.ok, first.errors
    # A re-commit of step 2 killed between its renames: step 2 moved aside, the new one still partial.
    (root / ckpt.step_dir_name(2)).rename(root / f"{ckpt.REPLACED_PREFIX}{ckpt.step_dir_name(2)}")
    (root / f"{ckpt.PARTIAL_PREFIX}{ckpt.step_dir_name(2)}").mkdir()
    assert ckpt.resolve_checkpoint(root).name == f"{ckpt.REPLACED_PREFIX}{ckpt.step_dir_name(2)}"  # read as step 2
    resumed = run_plan(
        plan_for(), steps=3, out_dir=tmp_path / "b", progress=False, save_every=1, checkpoint_dir=root, resume=root
    )
    assert resumed.ok, resumed.errors
    assert resumed.data["run"]["first_step"] == 2
    assert [s for s, _, _ in ckpt.list_checkpoints(root)] == [1, 2, 3] and not list(
        root.glob(ckpt.REPLACED_PREFIX + "*")
    )
    assert (
        ckpt.verify_checkpoint(root / ckpt.step_dir_name(2))["run_id"]
        == ckpt.verify_checkpoint(root / ckpt.step_dir_name(1))["run_id"]
    )


def test_a_run_never_replaces_committed_checkpoints_unless_asked(tmp_path):
    root = tmp_path / "ckpts"
    first = run_plan(plan_for(), steps=2, out_dir=tmp_path / "a", progress=False, save_every=1, checkpoint_dir=root)
    assert first.ok, first.errors
    sealed = ckpt.verify_checkpoint(root / ckpt.step_dir_name(2))["run_id"]
    with pytest.raises(
        RuntimeRefusal, match=r"already holds committed checkpoints at step\(s\) 1, 2.*--overwrite-checkpoints"
    ):
        run_plan(plan_for(), steps=2, out_dir=tmp_path / "b", progress=False, save_every=1, checkpoint_dir=root)
    assert ckpt.verify_checkpoint(root / ckpt.step_dir_name(2))["run_id"] == sealed  # nothing replaced
    resumed = run_plan(
        plan_for(), steps=3, out_dir=tmp_path / "c", progress=False, save_every=1, checkpoint_dir=root, resume=root
    )
    assert resumed.ok, resumed.errors  # resuming from the newest saves only later steps
    again = run_plan(
        plan_for(),
        steps=2,
        out_dir=tmp_path / "d",
        progress=False,
        save_every=1,
        checkpoint_dir=root,
        overwrite_checkpoints=True,
    )
    assert again.ok and ckpt.verify_checkpoint(root / ckpt.step_dir_name(2))["run_id"] != sealed


def test_a_rendezvous_port_in_use_is_refused_at_once_naming_it(tmp_path):
    import os
    import subprocess
    import sys

    spec = tmp_path / "one.yaml"
    spec.write_text(
        "model: {family: transformer, vocab_size: 64, hidden_size: 32, num_layers: 2, num_heads: 4, "
        "ffn_hidden_size: 64}\n"
        "mesh: {dp_shard: 1}\ntraining: {global_batch_size: 2, micro_batch_size: 2, seq_len: 16, steps: 1}\n"
        "backend: torch\nresources: {devices: 1, kind: cpu, memory: 1GiB}\n"
    )
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k not in TORCHRUN}
        env.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "mixle_compile", "run", str(spec), "--out", str(tmp_path / "out")],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2, done.stderr
    assert f"MASTER_PORT={port}" in done.stderr and "already in use" in done.stderr and "Traceback" not in done.stderr
    assert time.monotonic() - started < 60

"""The checkpoint directory layer's seal, confinement, identity, lock, retention and commit protocol.

Torch-free: array checkpoints (the layer EM uses) and hand-built directories stand in for a DCP
checkpoint; the same ``verify_checkpoint`` guards both (tests/test_runtime_checkpoint.py runs it on
real DCP shards end to end).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mixle_compile.runtime import checkpoint as ckpt
from mixle_compile.runtime import faults
from tests.conftest import ROOT


def write_steps(root: Path, steps=(1, 2, 3), run_id: str | None = None) -> None:
    for step in steps:
        ckpt.write_array_checkpoint(
            root,
            step,
            {"means": np.arange(6.0).reshape(3, 2) * step, "weights": np.full(3, step / 3)},
            {"model": "mixture"},
            run_id=run_id,
        )


def step(root: Path, n: int) -> Path:
    return root / ckpt.step_dir_name(n)


def reseal(step_dir: Path, change) -> None:
    """Edit a manifest and write a marker that matches it (what a forger or a buggy tool could do)."""
    manifest = json.loads((step_dir / ckpt.MANIFEST_FILE).read_text())
    change(manifest)
    data = ckpt.manifest_bytes(manifest)
    (step_dir / ckpt.MANIFEST_FILE).write_bytes(data)
    marker = json.loads((step_dir / ckpt.COMPLETE_MARKER).read_text())
    marker["manifest_sha256"] = hashlib.sha256(data).hexdigest()
    (step_dir / ckpt.COMPLETE_MARKER).write_text(json.dumps(marker))


def first_state_file(step_dir: Path) -> Path:
    return sorted((step_dir / ckpt.STATE_DIR).iterdir())[0]


# ---------------------------------------------------------------------------- the seal


def test_the_directory_layer_writes_verifies_and_chooses_checkpoints_with_torch_unimportable(tmp_path):
    """runtime/checkpoint.py is the torch-free layer: with torch blocked it writes, verifies, lists and
    resolves a checkpoint and validates the options; the DCP layer (checkpoint_dcp.py) is the one that needs torch."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np\n"
        "from mixle_compile.runtime import checkpoint as ckpt\n"
        "root = sys.argv[1]\n"
        "ckpt.write_array_checkpoint(root, 2, {'means': np.zeros(3)}, {'model': 'm'})\n"
        "path = ckpt.resolve_checkpoint(root)\n"
        "ckpt.verify_checkpoint(path)\n"
        "options = ckpt.CheckpointOptions.checked(save_every=2, checkpoint_dir=root, keep=None)\n"
        "print(ckpt.step_of_dir(path), [s for s, _, ok in ckpt.list_checkpoints(root) if ok], "
        "options.worker_arguments()[2:4])\n"
        "try:\n"
        "    from mixle_compile.runtime import checkpoint_dcp\n"
        "except ImportError:\n"
        "    print('no DCP layer without torch')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["2 [2] ['--save-every', '2']", "no DCP layer without torch"]


def test_every_file_is_sealed_and_a_clean_checkpoint_verifies(tmp_path):
    write_steps(tmp_path)
    manifest = ckpt.verify_checkpoint(step(tmp_path, 2))
    assert manifest["format_version"] == ckpt.FORMAT_VERSION == 2 and manifest["run_id"] == ckpt.PROCESS_RUN_ID
    assert sorted(manifest["files"]) == ["state/array-0000.npy", "state/array-0001.npy"]
    for rel, seal in manifest["files"].items():
        assert (
            seal["sha256"] == ckpt.file_sha256(step(tmp_path, 2) / rel)
            and seal["bytes"] == (step(tmp_path, 2) / rel).stat().st_size
        )
    marker = json.loads((step(tmp_path, 2) / ckpt.COMPLETE_MARKER).read_text())
    assert marker["step"] == 2 and marker["run_id"] == manifest["run_id"]
    assert (
        marker["manifest_sha256"] == hashlib.sha256((step(tmp_path, 2) / ckpt.MANIFEST_FILE).read_bytes()).hexdigest()
    )


def test_a_flipped_bit_in_a_payload_is_refused_naming_the_file(tmp_path):
    write_steps(tmp_path)
    target = first_state_file(step(tmp_path, 3))
    data = bytearray(target.read_bytes())
    data[-3] ^= 0x01  # one bit of one value
    target.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=rf"{target}.* does not match the SHA-256 its manifest seals"):
        ckpt.read_array_checkpoint(tmp_path)
    with pytest.raises(ckpt.CheckpointError, match=str(target)):
        ckpt.verify_checkpoint(step(tmp_path, 3))


def test_a_nan_written_into_a_payload_is_refused(tmp_path):
    write_steps(tmp_path)
    target = step(tmp_path, 3) / ckpt.STATE_DIR / "array-0000.npy"
    values = np.load(target, allow_pickle=False)
    values[0, 0] = np.nan
    with open(target, "wb") as f:
        np.save(f, values, allow_pickle=False)
    with pytest.raises(ckpt.CheckpointError, match=rf"{target}.* does not match the SHA-256"):
        ckpt.read_array_checkpoint(step(tmp_path, 3))


def test_non_finite_values_are_refused_on_save_and_on_load(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match=r"array 'means' holds NaN or infinite values"):
        ckpt.write_array_checkpoint(tmp_path, 1, {"means": np.array([1.0, np.inf])}, {})
    assert not list(tmp_path.iterdir())  # nothing was begun
    # A sealed checkpoint whose payload holds a NaN (saved by another writer): refused on load.
    pending = ckpt.begin_checkpoint(tmp_path, 1)
    with open(pending.state_dir / "array-0000.npy", "wb") as f:
        np.save(f, np.array([1.0, np.nan]), allow_pickle=False)
    ckpt.commit_checkpoint(
        pending, {"arrays": {"means": {"file": "array-0000.npy", "shape": [2], "dtype": "<f8"}}}, kind=ckpt.ARRAYS_KIND
    )
    assert ckpt.verify_checkpoint(step(tmp_path, 1))  # the seal holds: the values are what was saved
    with pytest.raises(ckpt.CheckpointError, match=r"array 'means' in .*array-0000.npy holds NaN or infinite values"):
        ckpt.read_array_checkpoint(tmp_path)


def test_manifests_and_markers_swapped_between_steps_are_refused(tmp_path):
    write_steps(tmp_path)
    for name in (ckpt.MANIFEST_FILE, ckpt.COMPLETE_MARKER):
        a, b = step(tmp_path, 2) / name, step(tmp_path, 3) / name
        tmp = tmp_path / "swap"
        os.replace(a, tmp)
        os.replace(b, a)
        os.replace(tmp, b)
    with pytest.raises(
        ckpt.CheckpointError,
        match=r"step-00000002: the directory is named for step 2 but its manifest .* are of step 3",
    ):
        ckpt.verify_checkpoint(step(tmp_path, 2))
    with pytest.raises(ckpt.CheckpointError, match=r"named for step 3 but its manifest"):
        ckpt.read_array_checkpoint(tmp_path)


def test_a_manifest_swapped_without_its_marker_is_refused(tmp_path):
    write_steps(tmp_path)
    shutil.copy(step(tmp_path, 2) / ckpt.MANIFEST_FILE, step(tmp_path, 3) / ckpt.MANIFEST_FILE)
    with pytest.raises(
        ckpt.CheckpointError, match=r"does not match the SHA-256 its completion marker records \(COMPLETE;"
    ):
        ckpt.verify_checkpoint(step(tmp_path, 3))


def test_state_directories_swapped_between_steps_are_refused_naming_a_file(tmp_path):
    write_steps(tmp_path)
    a, b = step(tmp_path, 2) / ckpt.STATE_DIR, step(tmp_path, 3) / ckpt.STATE_DIR
    os.replace(a, tmp_path / "swap")
    os.replace(b, a)
    os.replace(tmp_path / "swap", b)
    with pytest.raises(
        ckpt.CheckpointError, match=r"step-00000003: .*step-00000003/state/array-0000.npy does not match the SHA-256"
    ):
        ckpt.read_array_checkpoint(tmp_path)


def test_truncated_missing_and_added_files_are_refused_naming_them(tmp_path):
    write_steps(tmp_path)
    d = step(tmp_path, 3)
    target = first_state_file(d)
    size = target.stat().st_size
    with open(target, "r+b") as f:
        f.truncate(size - 8)
    with pytest.raises(
        ckpt.CheckpointError,
        match=rf"{target} has {size - 8} bytes, the manifest seals {size} \(truncated or overwritten\)",
    ):
        ckpt.verify_checkpoint(d, hashes=False)  # the size alone catches it, without reading the file
    target.unlink()
    with pytest.raises(ckpt.CheckpointError, match=rf"the file {target} is missing"):
        ckpt.verify_checkpoint(d)
    d = step(tmp_path, 2)
    (d / ckpt.STATE_DIR / "extra.npy").write_bytes(b"x")
    with pytest.raises(ckpt.CheckpointError, match=r"state/extra.npy is not sealed by the manifest"):
        ckpt.verify_checkpoint(d)
    (d / ckpt.STATE_DIR / "extra.npy").unlink()
    (d / "notes.txt").write_text("x")
    with pytest.raises(ckpt.CheckpointError, match=r"notes.txt is not part of a checkpoint"):
        ckpt.verify_checkpoint(d)


def test_a_format_1_checkpoint_is_refused_as_unverifiable(tmp_path):
    write_steps(tmp_path, steps=(1,))
    reseal(step(tmp_path, 1), lambda m: m.update(format_version=1))
    with pytest.raises(
        ckpt.CheckpointError, match=r"format version 1, which records no checksums of its files.* cannot verify it"
    ):
        ckpt.read_array_checkpoint(tmp_path)


# ---------------------------------------------------------------------------- confinement


def test_symbolic_links_inside_a_checkpoint_are_refused(tmp_path):
    write_steps(tmp_path / "root")
    outside = tmp_path / "outside.npy"
    np.save(outside, np.zeros(3), allow_pickle=False)
    target = step(tmp_path / "root", 3) / ckpt.STATE_DIR / "array-0001.npy"
    target.unlink()
    target.symlink_to(outside)
    with pytest.raises(
        ckpt.CheckpointError, match=rf"{target} is a symbolic link; a checkpoint holds regular files only"
    ):
        ckpt.read_array_checkpoint(tmp_path / "root")
    manifest = step(tmp_path / "root", 2) / ckpt.MANIFEST_FILE
    manifest.rename(tmp_path / "real-manifest.json")
    manifest.symlink_to(tmp_path / "real-manifest.json")
    with pytest.raises(ckpt.CheckpointError, match=r"its manifest .*manifest.json is a symbolic link"):
        ckpt.verify_checkpoint(step(tmp_path / "root", 2))


def test_a_step_directory_that_is_a_symbolic_link_is_refused(tmp_path):
    write_steps(tmp_path / "elsewhere", steps=(9,))
    write_steps(tmp_path / "root", steps=(1,))
    link = step(tmp_path / "root", 9)
    link.symlink_to(step(tmp_path / "elsewhere", 9), target_is_directory=True)
    with pytest.raises(
        ckpt.CheckpointError, match=r"holds step-00000009, a symbolic link .* never read through a link"
    ):
        ckpt.resolve_checkpoint(tmp_path / "root")
    with pytest.raises(ckpt.CheckpointError, match=r"step-00000009 is a symbolic link"):
        ckpt.resolve_checkpoint(link)
    assert [s for s, _, _ in ckpt.list_checkpoints(tmp_path / "root")] == [1]  # never listed, so never pruned through
    with pytest.raises(
        ckpt.CheckpointError, match=r"holds step-00000009, a symbolic link .* never written through a link"
    ):
        ckpt.lock_root(tmp_path / "root", "run")  # a run refuses to save into that root before it starts


def test_paths_out_of_the_checkpoint_are_refused_even_when_resealed(tmp_path):
    write_steps(tmp_path / "root", steps=(1, 2))
    np.save(tmp_path / "outside.npy", np.zeros((3, 2)), allow_pickle=False)
    d = step(tmp_path / "root", 1)
    reseal(d, lambda m: m["arrays"]["means"].update(file="../../../outside.npy"))
    with pytest.raises(
        ckpt.CheckpointError, match=r"array 'means' names the file '../../../outside.npy', not a sealed file"
    ):
        ckpt.read_array_checkpoint(d)
    d = step(tmp_path / "root", 2)
    reseal(d, lambda m: m["files"].update({"state/../../../outside.npy": {"bytes": 1, "sha256": "sha256:0"}}))
    with pytest.raises(ckpt.CheckpointError, match=r"lists the file 'state/../../../outside.npy', a path outside"):
        ckpt.verify_checkpoint(d)


def test_a_tensor_index_pointing_out_of_the_checkpoint_is_refused(tmp_path):
    """DCP's storage paths (state/dcp-metadata.json) must name sealed files of state/ (checked torch-free)."""
    (tmp_path / "secret").write_bytes(b"\0" * 64)
    for name, file in (
        ("escape", "../../secret"),
        ("absolute", str(tmp_path / "secret")),
        ("unsealed", "__9_0.distcp"),
    ):
        pending = ckpt.begin_checkpoint(tmp_path / name, 1)
        (pending.state_dir / "__0_0.distcp").write_bytes(b"\0" * 64)
        index = {
            "dcp_version": "1",
            "tensors": {},
            "storage": [
                {"fqn": "model/w", "offset": [0], "index": None, "file": file, "at": 0, "length": 64, "transforms": []}
            ],
        }
        (pending.state_dir / ckpt.DCP_METADATA_FILE).write_text(json.dumps(index))
        ckpt.commit_checkpoint(pending, {}, kind=ckpt.TORCH_KIND)
        with pytest.raises(ckpt.CheckpointError, match=rf"the tensor index .* points at {file!r}, not a sealed file"):
            ckpt.verify_checkpoint(step(tmp_path / name, 1))


def test_explain_refuses_a_tampered_checkpoint_naming_the_file(tmp_path, capsys):
    from mixle_compile.cli import main

    write_steps(tmp_path)
    assert main(["explain", str(tmp_path)]) == 0
    assert "verified" in capsys.readouterr().out
    target = first_state_file(step(tmp_path, 3))
    target.write_bytes(target.read_bytes()[:-1] + b"\1")
    assert main(["explain", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(target) in err and "SHA-256" in err and "Traceback" not in err


# ---------------------------------------------------------------------------- identity, lock, retention


def test_token_data_is_identified_by_its_content_not_its_name_and_size(tmp_path):
    a, b = tmp_path / "a" / "tokens.bin", tmp_path / "b" / "tokens.bin"
    a.parent.mkdir()
    b.parent.mkdir()
    a.write_bytes(bytes(range(200)))
    b.write_bytes(bytes(reversed(range(200))))  # same name, same size, other tokens
    described = ckpt.source_description(a, 0)
    assert described["sha256"] == ckpt.file_sha256(a) and described["bytes"] == 200
    assert not ckpt.same_source(described, ckpt.source_description(b, 0))
    shutil.copy(a, tmp_path / "copy.bin")
    assert ckpt.same_source(described, ckpt.source_description(tmp_path / "copy.bin", 0))  # a copy elsewhere resumes
    assert not ckpt.same_source({"kind": "file", "name": "tokens.bin", "bytes": 200}, described)  # unchecked: refused


def test_a_second_run_cannot_lock_a_checkpoint_root_in_use(tmp_path):
    held = ckpt.lock_root(tmp_path, "run-a")
    try:
        with pytest.raises(
            ckpt.CheckpointError, match=rf"{tmp_path} is in use by another run \(pid {os.getpid()}, run run-a\)"
        ):
            ckpt.lock_root(tmp_path, "run-b")
    finally:
        ckpt.unlock_root(held)
    ckpt.unlock_root(ckpt.lock_root(tmp_path, "run-b"))  # free again once released


def test_the_lock_file_is_never_a_symbolic_link(tmp_path):
    (tmp_path / "precious").write_text("keep")
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / ckpt.LOCK_FILE).symlink_to(tmp_path / "precious")
    with pytest.raises(ckpt.CheckpointError, match=r"cannot lock the checkpoint directory"):
        ckpt.lock_root(tmp_path / "root", "run")
    assert (tmp_path / "precious").read_text() == "keep"


def test_retention_deletes_only_this_runs_own_older_steps(tmp_path):
    write_steps(tmp_path, steps=(1, 2), run_id="earlier-run")
    (tmp_path / ckpt.step_dir_name(3)).mkdir()  # a stale step directory, never completed
    write_steps(tmp_path, steps=(4, 5, 6), run_id="this-run")
    assert ckpt.prune_checkpoints(tmp_path, keep=1, run_id="this-run") == [step(tmp_path, 4), step(tmp_path, 5)]
    assert [s for s, _, _ in ckpt.list_checkpoints(tmp_path)] == [1, 2, 3, 6]
    assert ckpt.prune_checkpoints(tmp_path, keep=1, run_id="another-run") == []
    assert ckpt.prune_checkpoints(tmp_path, keep=1, run_id="this-run") == []  # its newest stays
    ckpt.verify_checkpoint(step(tmp_path, 1))


# ---------------------------------------------------------------------------- the commit protocol

WRITER = """
import sys
import numpy as np
from mixle_compile.runtime import checkpoint as ckpt
root, step, value = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
ckpt.write_array_checkpoint(root, step, {"means": np.full(4, value), "weights": np.full(2, value)}, {"model": "m"})
"""


def commit_killed_at(root: Path, step_: int, value: float, k: int) -> int:
    env = {**os.environ, faults.COMMIT_FAULT_ENV: f"{step_}:{k}", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", WRITER, str(root), str(step_), str(value)], cwd=ROOT, env=env, timeout=60
    ).returncode


def loads(root: Path) -> tuple[int, float]:
    manifest, arrays = ckpt.read_array_checkpoint(root)  # verified against its seal
    return manifest["step"], float(arrays["means"].flat[0])


@pytest.mark.parametrize("again", [False, True], ids=["new-step", "same-step-again"])
def test_a_crash_at_every_rename_of_a_commit_leaves_the_newest_committed_step_loadable(tmp_path, again):
    """Kill the writer just before its k-th rename, for every k; a commit of a new step (3 renames)
    and a re-commit of the newest step (4 renames: it moves the committed one aside first)."""
    k = 0
    while True:
        k += 1
        root = tmp_path / f"k{k}"
        write_steps(root, steps=(1, 2))
        committed = loads(root)
        target = 2 if again else 3
        code = commit_killed_at(root, target, 7.0, k)
        if code == 0:
            assert loads(root) == (target, 7.0)
            break
        assert code == 75, code
        found = loads(root)
        assert found in (committed, (target, 7.0)), (k, found)
        if again:
            assert found[0] == 2  # the committed step 2 is never lost, whichever version it is
        ckpt.unlock_root(ckpt.lock_root(root, "next-run"))  # the next writer finishes what was interrupted
        assert loads(root) == found
        assert not list(root.glob(ckpt.REPLACED_PREFIX + "*"))
        assert ckpt.verify_checkpoint(step(root, found[0]))
        write_steps(root, steps=(4,))  # and the root takes new checkpoints
        assert loads(root)[0] == 4
    assert k - 1 == (4 if again else 3)  # every rename was interrupted once


def test_the_marker_records_the_identity_the_manifest_states(tmp_path):
    pending = ckpt.begin_checkpoint(tmp_path, 5)
    ckpt.commit_checkpoint(pending, {"plan": {"content_digest": "sha256:abc"}}, kind="k", run_id="run-1")
    marker = json.loads((step(tmp_path, 5) / ckpt.COMPLETE_MARKER).read_text())
    assert (marker["step"], marker["run_id"], marker["plan_digest"]) == (5, "run-1", "sha256:abc")
    reseal(
        step(tmp_path, 5), lambda m: m["plan"].update(content_digest="sha256:other")
    )  # the digest matches, the identity does not
    with pytest.raises(
        ckpt.CheckpointError, match=r"the manifest's step, run and plan .*sha256:other.* differ from its marker's"
    ):
        ckpt.verify_checkpoint(step(tmp_path, 5))

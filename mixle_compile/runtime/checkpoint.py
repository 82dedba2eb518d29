"""Checkpoints: sealed, atomic step directories with a JSON manifest (tensor state: checkpoint_dcp.py).

Two layers, so that a runtime without torch state (EM fits plain numpy arrays) reuses the first:

**Directory layer** (torch-free; ``explain`` and the launcher use it without importing torch).
A checkpoint root holds one directory per saved step::

    ROOT/.lock                the lock of the run writing into ROOT (fcntl; pid and run id inside)
    ROOT/step-00000004/
        state/                the payload (torch DCP files, or the caller's own files)
        manifest.json         what was saved: format, step, run id, plan digest, mesh, parameters,
                              data position and identity, and the size and SHA-256 of every file in state/
        COMPLETE              the completion marker: the step, the run id, the plan digest and the SHA-256
                              of manifest.json

A checkpoint is written into ``ROOT/.partial-step-00000004``; then the manifest is written, then
the marker, each file fsynced, and only then is the directory renamed to its final name. A
directory without the marker (a crash between those writes, a copy cut short) is never loaded.
``verify_checkpoint`` checks a step directory against its seal before anything reads it: the
marker's digest of the manifest, the manifest's step against the directory's name, every file
under ``state/`` against the manifest's size and SHA-256 (none missing, none added), regular files
and real directories only (no symbolic links, no path outside the step directory, DCP's storage
paths included). ``begin_checkpoint`` / ``commit_checkpoint`` are the two halves,
``write_array_checkpoint`` / ``read_array_checkpoint`` the whole for named numpy arrays
(``np.save`` with ``allow_pickle=False``). ``lock_root`` keeps a second run off a root in use.

**Torch state layer** (runtime/checkpoint_dcp.py: ``save_session`` / ``load_session``): model
parameters and optimizer state written into ``state/`` with ``torch.distributed.checkpoint`` and
read back on any mesh of the same model. This module never imports torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from mixle_compile.plan.vocabulary import DEGREE_AXES
from mixle_compile.runtime import faults
from mixle_compile.runtime.errors import RuntimeRefusal

CHECKPOINT_FORMAT = "mixle-checkpoint"
# 2: every file sealed in the manifest, a run id. A manifest with a higher version is refused (this
# code cannot know its meaning), one of version 1 too (it seals nothing, so it cannot be verified).
FORMAT_VERSION = 2
MANIFEST_FILE = "manifest.json"
COMPLETE_MARKER = "COMPLETE"
STATE_DIR = "state"
DCP_METADATA_FILE = "dcp-metadata.json"
LOCK_FILE = ".lock"
STEP_PREFIX = "step-"
PARTIAL_PREFIX = ".partial-"
REPLACED_PREFIX = ".replaced-"  # a committed step moved aside while the same step is committed again
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_REPLACED_DIR = re.compile(r"^\.replaced-step-(\d{8,})$")
TORCH_KIND = "torch-dcp"
ARRAYS_KIND = "numpy-arrays"
_HASH_CHUNK = 1 << 20
# The run id of checkpoints this process writes without being given one (a single-process caller).
PROCESS_RUN_ID = uuid.uuid4().hex


class CheckpointError(RuntimeRefusal):
    """A checkpoint cannot be written, found, read or resumed; the message says which and how to fix it."""


def new_run_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class CheckpointOptions:
    """What a run saves and where it starts, the same for the launcher, the worker and EM.

    ``root`` gets a checkpoint every ``every`` steps (and after the last one); the ``keep`` newest
    of this run's own are kept (None: all); ``resume`` is a step directory to start from;
    ``run_id`` names this run in the checkpoints it writes (default: the process's)."""

    root: Path | None = None
    every: int | None = None
    keep: int | None = None
    resume: Path | None = None
    run_id: str | None = None

    @classmethod
    def checked(cls, *, save_every, checkpoint_dir, keep) -> CheckpointOptions:
        """The options a run was given, refused (RuntimeRefusal) when no run can use them."""
        for name, value in (("--save-every", save_every), ("--keep-checkpoints", keep)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise RuntimeRefusal(f"{name} must be a positive integer, got {value!r}")
        if checkpoint_dir is not None and save_every is None:
            raise RuntimeRefusal(
                "--checkpoint-dir says where checkpoints go, but nothing saves them: add --save-every N"
            )
        if keep is not None and save_every is None:
            raise RuntimeRefusal("--keep-checkpoints needs --save-every N")
        return cls(root=Path(checkpoint_dir) if checkpoint_dir is not None else None, every=save_every, keep=keep)

    @property
    def saves(self) -> bool:
        """Whether the run saves checkpoints (every N steps, into a root)."""
        return self.every is not None and self.root is not None

    def worker_arguments(self) -> list[str]:
        """The options as the worker's command line (``python -m mixle_compile.runtime.worker``) reads them."""
        args = []
        for value, flag in (
            (self.root, "--checkpoint-dir"),
            (self.every, "--save-every"),
            (self.keep, "--keep-checkpoints"),
            (self.resume, "--resume"),
            (self.run_id, "--run-id"),
        ):
            if value is not None:
                args += [flag, str(Path(value).resolve()) if isinstance(value, Path) else str(value)]
        return args

    @classmethod
    def from_worker_arguments(cls, args) -> CheckpointOptions:
        """The options from the worker's parsed command line (``worker_arguments``' flags)."""
        return cls(
            root=Path(args.checkpoint_dir) if args.checkpoint_dir else None,
            every=args.save_every,
            keep=args.keep_checkpoints,
            resume=Path(args.resume) if args.resume else None,
            run_id=args.run_id,
        )


# ---------------------------------------------------------------------------
# directory layer (torch-free)
# ---------------------------------------------------------------------------


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def step_of_dir(path: str | Path) -> int | None:
    """The step a directory's name gives (``step-N``, or ``.replaced-step-N`` while it is replaced)."""
    name = Path(path).name
    m = _STEP_DIR.match(name) or _REPLACED_DIR.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class PendingCheckpoint:
    """A checkpoint being written: ``path`` is the temporary directory to write the payload into."""

    root: Path
    step: int
    path: Path

    @property
    def state_dir(self) -> Path:
        return self.path / STATE_DIR

    @property
    def final_path(self) -> Path:
        return self.root / step_dir_name(self.step)


def pending_checkpoint(root: str | Path, step: int) -> PendingCheckpoint:
    """Where step ``step``'s checkpoint is written before it is committed (the same on every rank)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"a checkpoint's step must be an integer >= 0, got {step!r}")
    root = Path(root)
    return PendingCheckpoint(root, step, root / f"{PARTIAL_PREFIX}{step_dir_name(step)}")


def _remove(path: Path) -> None:
    """Remove ``path``: a link itself (never what it points to), a file, or a directory tree."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def begin_checkpoint(root: str | Path, step: int) -> PendingCheckpoint:
    """Create an empty temporary directory for step ``step`` (a leftover of a crashed save is removed).

    In a job of several processes exactly one calls this, and the others wait for it."""
    pending = pending_checkpoint(root, step)
    try:
        pending.root.mkdir(parents=True, exist_ok=True)
        _remove(pending.path)
        pending.state_dir.mkdir(parents=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create the checkpoint directory {pending.path}: {exc.strerror or exc}") from None
    return pending


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes, rename: Callable[[Path, Path], None] = os.replace) -> None:
    """Write ``data`` to ``path`` through a fsynced temporary file renamed into place (never through a link)."""
    tmp = path.with_name(path.name + ".tmp")
    if tmp.is_symlink():
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    rename(tmp, path)


def manifest_bytes(manifest: Mapping[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode("utf-8")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def _walk_state(step_dir: Path) -> dict[str, Path]:
    """Every file under ``step_dir/state`` by its path relative to ``step_dir`` (POSIX). Refused: a
    symbolic link, or anything but regular files and directories."""
    found: dict[str, Path] = {}
    state = step_dir / STATE_DIR
    pending = [state]
    while pending:
        directory = pending.pop()
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError as exc:
            raise CheckpointError(f"checkpoint {step_dir}: cannot list {directory}: {exc.strerror or exc}") from None
        for entry in entries:
            path = Path(entry.path)
            mode = entry.stat(follow_symlinks=False).st_mode
            if stat.S_ISLNK(mode):
                raise CheckpointError(
                    f"checkpoint {step_dir}: {path} is a symbolic link; a checkpoint holds regular files only, "
                    "so nothing outside it is ever read"
                )
            if stat.S_ISDIR(mode):
                pending.append(path)
            elif stat.S_ISREG(mode):
                found[path.relative_to(step_dir).as_posix()] = path
            else:
                raise CheckpointError(
                    f"checkpoint {step_dir}: {path} is not a regular file; a checkpoint holds regular files only"
                )
    return found


def seal_files(step_dir: Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {"bytes", "sha256"}}`` of every file under ``step_dir/state``."""
    return {
        rel: {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
        for rel, path in sorted(_walk_state(step_dir).items())
    }


def safe_relative(text: Any) -> bool:
    """A path that stays inside the directory it is relative to: relative, no ``..``, no empty part."""
    if not isinstance(text, str) or not text or "\\" in text or "\0" in text:
        return False
    p = PurePosixPath(text)
    return not p.is_absolute() and all(part not in ("", ".", "..") for part in text.split("/"))


def _recover(root: Path, step: int) -> None:
    """Finish a re-commit of ``step`` that was interrupted between its renames: the committed
    checkpoint moved aside goes back if nothing took its place, else it is removed."""
    final, aside = root / step_dir_name(step), root / f"{REPLACED_PREFIX}{step_dir_name(step)}"
    if not aside.is_dir() or aside.is_symlink():
        return
    if final.is_symlink() or final.exists():
        if (final / COMPLETE_MARKER).is_file():
            shutil.rmtree(aside, ignore_errors=True)
        return
    os.replace(aside, final)
    _fsync_dir(root)


def recover_root(root: str | Path) -> None:
    """``_recover`` every step left moved aside under ``root`` (the lock holder calls it)."""
    try:
        entries = list(Path(root).iterdir())
    except OSError:
        return
    for entry in entries:
        m = _REPLACED_DIR.match(entry.name)
        if m:
            _recover(Path(root), int(m.group(1)))


def _plan_digest(manifest: Mapping[str, Any]) -> str | None:
    plan = manifest.get("plan")
    return plan.get("content_digest") if isinstance(plan, dict) else None


def commit_checkpoint(
    pending: PendingCheckpoint, manifest: Mapping[str, Any], *, kind: str, run_id: str | None = None
) -> Path:
    """Seal the payload, write the manifest, then the completion marker, then move the directory to its final name.

    ``manifest`` is the caller's JSON-ready description; ``format``, ``format_version``, ``kind``,
    ``step``, ``run_id``, ``saved_unix`` and ``files`` (size and SHA-256 of every file in state/)
    are added. Returns the final directory ``ROOT/step-NNNNNNNN``.

    Renames, in order: the manifest's temporary file, the marker's; then, when the step is already
    committed (saved again into the same root), the committed directory to ``.replaced-step-N``;
    then the new directory to ``step-N``. Interrupted after any of them, the newest committed
    checkpoint stays loadable: a step moved aside is read in its place (``list_checkpoints``) and
    moved back by the next writer (``recover_root``)."""
    run_id = run_id or PROCESS_RUN_ID
    final = pending.final_path
    rename = faults.CommitRenames(pending.step)  # the commit-protocol tests may end the process before a rename
    try:
        files = seal_files(pending.path)
        body = dict(manifest)
        body.update(
            format=CHECKPOINT_FORMAT,
            format_version=FORMAT_VERSION,
            kind=kind,
            step=pending.step,
            saved_unix=time.time(),
            run_id=run_id,
            files=files,
        )
        data = manifest_bytes(body)
        write_synced(pending.path / MANIFEST_FILE, data, rename)
        marker = {
            "format_version": FORMAT_VERSION,
            "step": pending.step,
            "run_id": run_id,
            "plan_digest": _plan_digest(body),
            "manifest_sha256": hashlib.sha256(data).hexdigest(),
        }
        write_synced(
            pending.path / COMPLETE_MARKER, (json.dumps(marker, sort_keys=True) + "\n").encode("utf-8"), rename
        )
        _fsync_dir(pending.path)
        _recover(pending.root, pending.step)
        if final.is_symlink():
            raise CheckpointError(
                f"cannot commit the checkpoint {final}: it is a symbolic link, which a checkpoint never writes "
                "through; remove it"
            )
        if final.exists():  # the same step saved again (a rerun into the same root): replace it
            aside = pending.root / f"{REPLACED_PREFIX}{final.name}"
            _remove(aside)
            rename(final, aside)
            rename(pending.path, final)
            _fsync_dir(pending.root)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            rename(pending.path, final)
        _fsync_dir(pending.root)
    except OSError as exc:
        raise CheckpointError(f"cannot commit the checkpoint {final}: {exc.strerror or exc}") from None
    return final


def list_checkpoints(root: str | Path) -> list[tuple[int, Path, bool]]:
    """``(step, directory, complete)`` of every step directory under ``root``, by step (real
    directories only: a symbolic link is not listed). A step moved aside by an interrupted
    re-commit (``.replaced-step-N``) stands for its step while ``step-N`` is missing."""
    root = Path(root)
    found: dict[int, Path] = {}
    aside: dict[int, Path] = {}
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    for entry in entries:
        if entry.is_symlink() or not entry.is_dir():
            continue
        m = _STEP_DIR.match(entry.name)
        if m:
            found[int(m.group(1))] = entry
        m = _REPLACED_DIR.match(entry.name)
        if m:
            aside[int(m.group(1))] = entry
    for step, path in aside.items():
        found.setdefault(step, path)
    return sorted((step, path, (path / COMPLETE_MARKER).is_file()) for step, path in found.items())


def find_latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint of the highest step under ``root`` (None when there is none)."""
    complete = [path for _, path, ok in list_checkpoints(root) if ok]
    return complete[-1] if complete else None


def is_checkpoint_dir(path: str | Path) -> bool:
    path = Path(path)
    return step_of_dir(path) is not None or (path / MANIFEST_FILE).exists() or (path / COMPLETE_MARKER).exists()


def names_only_in_one(what: str, in_plan: list[str], in_checkpoint: list[str]) -> list[str]:
    """Why a checkpoint and a plan are of different models, as far as the names they hold go: what
    only one of them has (the first five of each, in the order given)."""

    def listed(names: list[str]) -> str:
        return ", ".join(map(repr, names[:5])) + (" ..." if len(names) > 5 else "")

    missing = [n for n in in_plan if n not in set(in_checkpoint)]
    extra = [n for n in in_checkpoint if n not in set(in_plan)]
    out = []
    if missing:
        out.append(f"this plan has {what}(s) {listed(missing)} that the checkpoint does not")
    if extra:
        out.append(f"the checkpoint has {what}(s) {listed(extra)} that this plan does not")
    return out


def _linked_steps(root: Path) -> list[Path]:
    try:
        return sorted(
            e for e in root.iterdir() if e.is_symlink() and (_STEP_DIR.match(e.name) or _REPLACED_DIR.match(e.name))
        )
    except OSError:
        return []


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from ``path``: a step directory itself, or a root (its latest complete step).

    Refused: a step directory that is a symbolic link, passed itself or found in the root."""
    path = Path(path)
    if path.is_symlink() and is_checkpoint_dir(path):
        raise CheckpointError(
            f"checkpoint {path} is a symbolic link (to {os.readlink(path)}); a checkpoint's step directory is never "
            "read through a link: pass the directory it points to"
        )
    if not path.exists():
        raise CheckpointError(
            f"checkpoint {path} does not exist; pass a checkpoint root (the --checkpoint-dir of a run) or one "
            "of its step-NNNNNNNN directories"
        )
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint {path} is not a directory; pass a checkpoint root or one of its step-NNNNNNNN directories"
        )
    if is_checkpoint_dir(path):
        return path
    linked = _linked_steps(path)
    if linked:
        raise CheckpointError(
            f"{path} holds {linked[0].name}, a symbolic link (to {os.readlink(linked[0])}); a checkpoint's "
            "step directory "
            "is never read through a link: remove it, or pass the step directory to resume from"
        )
    entries = list_checkpoints(path)
    latest = find_latest_checkpoint(path)
    if latest is not None:
        return latest
    if entries:
        shown = ", ".join(p.name for _, p, _ in entries[-3:])
        raise CheckpointError(
            f"{path} holds no complete checkpoint: {shown} lack(s) the completion marker {COMPLETE_MARKER} "
            "(the save was interrupted); resume from an earlier complete checkpoint or start afresh"
        )
    raise CheckpointError(
        f"{path} holds no checkpoint (no step-NNNNNNNN directory); pass the --checkpoint-dir of a run that saved one"
    )


def _read_regular(path: Path, what: str, where: str) -> bytes:
    if path.is_symlink():
        raise CheckpointError(f"{where}: {what} {path} is a symbolic link; a checkpoint holds regular files only")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{where}: cannot read {what} {path}: {exc.strerror or exc}") from None


def read_manifest(path: str | Path, *, kind: str | None = None) -> dict[str, Any]:
    """The manifest of the checkpoint directory ``path``, checked against its marker (not its files:
    ``verify_checkpoint`` does that too).

    Refused (CheckpointError): no completion marker; an unreadable, corrupted or modified manifest
    (its SHA-256 differs from the marker's); another format, another format version, or another
    ``kind`` than asked for; a manifest of another step than the directory's name says."""
    path = Path(path)
    where = f"checkpoint {path}"
    marker_path = path / COMPLETE_MARKER
    if not marker_path.is_file():
        raise CheckpointError(
            f"checkpoint {path} has no completion marker {marker_path.name} ({marker_path}): it was not "
            "completely written "
            "and is never loaded; resume from an earlier complete checkpoint (pass the checkpoint root to take "
            "the latest complete one)"
        )
    try:
        marker = json.loads(_read_regular(marker_path, "the completion marker", where))
        expected = marker["manifest_sha256"]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(
            f"{where}: the completion marker {marker_path} is unreadable; the checkpoint cannot be trusted"
        ) from None
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file() and not manifest_path.is_symlink():
        raise CheckpointError(f"{where}: cannot read its manifest {manifest_path}: it is missing")
    data = _read_regular(manifest_path, "its manifest", where)
    if hashlib.sha256(data).hexdigest() != expected:
        raise CheckpointError(
            f"{where}: the manifest {manifest_path} does not match the SHA-256 its completion marker records "
            f"({marker_path.name}; corrupted, edited, or the manifest or marker of another checkpoint); it is "
            "not loaded"
        )
    try:
        manifest = json.loads(data)
    except ValueError as exc:
        raise CheckpointError(f"{where}: the manifest {manifest_path} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{where}: {manifest_path} is not a {CHECKPOINT_FORMAT} manifest")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise CheckpointError(f"{where}: the manifest's format_version {version!r} is invalid")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {version}, newer than this mixle-compile reads ({FORMAT_VERSION}); "
            "upgrade mixle-compile to load it"
        )
    if version < FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {version}, which records no checksums of its files, so this "
            "mixle-compile "
            f"(format {FORMAT_VERSION}) cannot verify it and does not load it; resume it with the "
            "mixle-compile that wrote it, or start afresh"
        )
    identity = (manifest.get("step"), manifest.get("run_id"), _plan_digest(manifest))
    if not isinstance(manifest.get("step"), int) or identity != (
        marker.get("step"),
        marker.get("run_id"),
        marker.get("plan_digest"),
    ):
        raise CheckpointError(
            f"{where}: the manifest's step, run and plan {identity} differ from its marker's "
            f"{(marker.get('step'), marker.get('run_id'), marker.get('plan_digest'))}; the checkpoint cannot be trusted"
        )
    named = step_of_dir(path)
    if named is not None and named != manifest["step"]:
        raise CheckpointError(
            f"{where}: the directory is named for step {named} but its manifest {manifest_path} and marker are "
            f"of step {manifest['step']} "
            "(moved or swapped from another checkpoint); it is not loaded"
        )
    if kind is not None and manifest.get("kind") != kind:
        raise CheckpointError(
            f"{where} holds {manifest.get('kind')!r} state, not {kind!r}; it was written by another runtime"
        )
    return manifest


def verify_checkpoint(path: str | Path, *, kind: str | None = None, hashes: bool = True) -> dict[str, Any]:
    """``read_manifest``, then every file against the seal; returns the manifest.

    Refused, naming the file: a step directory that is a symbolic link; anything in it but
    ``manifest.json``, ``COMPLETE`` and ``state/``; a symbolic link or special file anywhere in it;
    a file in state/ the manifest does not list, or one it lists that is missing; a size or (with
    ``hashes``) a SHA-256 other than the manifest's (truncated, corrupted, overwritten, or swapped
    with another checkpoint's); a sealed path or a DCP storage path that leaves the directory."""
    path = Path(path)
    where = f"checkpoint {path}"
    if path.is_symlink():
        raise CheckpointError(f"{where} is a symbolic link; a checkpoint's step directory is never read through a link")
    manifest = read_manifest(path, kind=kind)
    sealed = manifest.get("files")
    if not isinstance(sealed, dict):
        raise CheckpointError(f"{where}: its manifest lists no files; the checkpoint cannot be verified")
    for name in sorted(os.listdir(path)):
        entry = path / name
        if name in (MANIFEST_FILE, COMPLETE_MARKER):
            continue
        if name == STATE_DIR and entry.is_dir() and not entry.is_symlink():
            continue
        raise CheckpointError(
            f"{where}: {entry} is not part of a checkpoint (only {MANIFEST_FILE}, {COMPLETE_MARKER} and "
            f"{STATE_DIR}/ are); "
            "it was added after saving: remove it"
        )
    for rel in sealed:
        if not safe_relative(rel) or not rel.startswith(STATE_DIR + "/"):
            raise CheckpointError(
                f"{where}: its manifest lists the file {rel!r}, a path outside {path / STATE_DIR}; it is not loaded"
            )
    present = _walk_state(path) if (path / STATE_DIR).is_dir() else {}
    for rel in sorted(present):
        if rel not in sealed:
            raise CheckpointError(
                f"{where}: {present[rel]} is not sealed by the manifest (added or renamed after saving); it is "
                "not loaded"
            )
    for rel, seal in sorted(sealed.items()):
        file = path / rel
        if rel not in present:
            raise CheckpointError(
                f"{where}: the file {file} is missing (the manifest seals it); the checkpoint is incomplete"
            )
        try:
            size, digest = int(seal["bytes"]), str(seal["sha256"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{where}: the manifest's seal of {rel} is malformed") from None
        actual = present[rel].stat().st_size
        if actual != size:
            raise CheckpointError(
                f"{where}: {file} has {actual} bytes, the manifest seals {size} (truncated or overwritten); it "
                "is not loaded"
            )
        if hashes and file_sha256(present[rel]) != digest:
            raise CheckpointError(
                f"{where}: {file} does not match the SHA-256 its manifest seals (corrupted, overwritten, or "
                "from another "
                "checkpoint); it is not loaded"
            )
    if manifest.get("kind") == TORCH_KIND:
        _check_dcp_index(path, sealed)
    return manifest


def _check_dcp_index(path: Path, sealed: Mapping[str, Any]) -> None:
    """Every storage path of DCP's index is a sealed file of this checkpoint's state/ (torch-free)."""
    index = path / STATE_DIR / DCP_METADATA_FILE
    if f"{STATE_DIR}/{DCP_METADATA_FILE}" not in sealed:
        raise CheckpointError(
            f"checkpoint {path} has no tensor index {index}; its tensor state is missing, so it cannot be resumed"
        )
    try:
        body = json.loads(index.read_bytes())
        files = [s["file"] for s in body["storage"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {path}: the tensor index {index} is unreadable ({exc})") from None
    for file in files:
        if not safe_relative(file) or f"{STATE_DIR}/{file}" not in sealed:
            raise CheckpointError(
                f"checkpoint {path}: the tensor index {index} points at {file!r}, not a sealed file of "
                f"{path / STATE_DIR}; "
                "it is not loaded"
            )


def lock_root(root: str | Path, run_id: str) -> int:
    """Take the lock of checkpoint root ``root`` for run ``run_id`` for as long as this process
    holds the returned file descriptor (``unlock_root``; the kernel drops it when the process
    dies). Refused while another run holds it; an interrupted re-commit is finished first."""
    import fcntl

    root = Path(root)
    lock = root / LOCK_FILE
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as exc:
        raise CheckpointError(f"cannot lock the checkpoint directory {root} ({lock}): {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        try:
            holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except (OSError, ValueError):
            holder = {}
        os.close(fd)
        raise CheckpointError(
            f"checkpoint directory {root} is in use by another run (pid {holder.get('pid', '?')}, run "
            f"{holder.get('run_id', '?')}); two runs "
            "saving into one directory would interleave their steps: wait for that run to end, or pass another "
            "--checkpoint-dir"
        ) from None
    linked = _linked_steps(root)
    if linked:
        os.close(fd)
        raise CheckpointError(
            f"the checkpoint directory {root} holds {linked[0].name}, a symbolic link (to {os.readlink(linked[0])}); "
            "a checkpoint is never written through a link: remove it, or pass another --checkpoint-dir"
        )
    os.ftruncate(fd, 0)
    os.pwrite(
        fd, (json.dumps({"pid": os.getpid(), "run_id": run_id, "since_unix": time.time()}) + "\n").encode("utf-8"), 0
    )
    recover_root(root)
    return fd


def unlock_root(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def prune_checkpoints(root: str | Path, keep: int, *, run_id: str | None = None) -> list[Path]:
    """Delete run ``run_id``'s complete checkpoints in ``root`` but its ``keep`` newest.

    Only that run's own step directories are deleted (by the run id their manifest and marker
    record): never another run's, one that cannot be read, an incomplete one, or this run's newest."""
    if keep < 1:
        return []
    run_id = run_id or PROCESS_RUN_ID
    own = []
    for _, path, ok in list_checkpoints(root):
        if not ok or not _STEP_DIR.match(path.name):
            continue
        try:
            if read_manifest(path).get("run_id") == run_id:
                own.append(path)
        except CheckpointError:
            continue
    removed = []
    for path in own[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def write_array_checkpoint(
    root: str | Path, step: int, arrays: Mapping[str, Any], manifest: Mapping[str, Any], *, run_id: str | None = None
) -> Path:
    """Save named numpy arrays and a JSON manifest atomically (single-process callers, such as EM).
    Refused: an array of Python objects, or one holding NaN or infinite values."""
    import numpy as np

    checked = {}
    for name, array in sorted(arrays.items()):
        a = np.asarray(array)
        if a.dtype.hasobject:
            raise CheckpointError(f"array {name!r} holds Python objects; a checkpoint stores numbers only")
        if a.dtype.kind in "fc" and not np.isfinite(a).all():
            raise CheckpointError(
                f"array {name!r} holds NaN or infinite values; a checkpoint of step {step} would not be resumable"
            )
        checked[name] = a
    pending = begin_checkpoint(root, step)
    entries = {}
    for i, (name, a) in enumerate(checked.items()):
        file = f"array-{i:04d}.npy"
        with open(pending.state_dir / file, "wb") as f:
            np.save(f, a, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        entries[name] = {"file": file, "shape": list(a.shape), "dtype": a.dtype.str}
    return commit_checkpoint(pending, {**manifest, "arrays": entries}, kind=ARRAYS_KIND, run_id=run_id)


def read_array_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(manifest, arrays)`` of a checkpoint written by ``write_array_checkpoint`` (path: step dir
    or root), verified against its seal. Refused: an array file outside state/, an array of another
    shape or dtype than the manifest says, NaN or infinite values."""
    import numpy as np

    path = resolve_checkpoint(path)
    manifest = verify_checkpoint(path, kind=ARRAYS_KIND)
    arrays = {}
    entries = manifest.get("arrays", {})
    if not isinstance(entries, dict):
        raise CheckpointError(f"checkpoint {path}: its manifest's arrays are malformed")
    for name, entry in entries.items():
        rel = entry.get("file") if isinstance(entry, dict) else None
        if not safe_relative(rel) or "/" in rel or f"{STATE_DIR}/{rel}" not in manifest["files"]:
            raise CheckpointError(
                f"checkpoint {path}: array {name!r} names the file {rel!r}, not a sealed file of {path / STATE_DIR}; "
                "it is not loaded"
            )
        file = path / STATE_DIR / rel
        try:
            a = np.load(file, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {path}: cannot read array {name!r} from {file}: {exc}") from None
        if list(a.shape) != entry["shape"] or a.dtype.str != entry["dtype"]:
            raise CheckpointError(
                f"checkpoint {path}: array {name!r} is {a.dtype.str}{list(a.shape)}, the manifest says "
                f"{entry['dtype']}{entry['shape']}"
            )
        if a.dtype.kind in "fc" and not np.isfinite(a).all():
            raise CheckpointError(
                f"checkpoint {path}: array {name!r} in {file} holds NaN or infinite values; it is not loaded"
            )
        arrays[name] = a
    return manifest, arrays


# ---------------------------------------------------------------------------
# what a torch checkpoint records, and whether a plan may resume from it (torch-free)
# ---------------------------------------------------------------------------

MESH_AXES = DEGREE_AXES


def plan_summary(instructions) -> dict[str, Any]:
    """The plan-side part of a manifest (from runtime Instructions)."""
    plan = instructions.plan
    degrees = plan.as_dict()
    return {
        "content_digest": instructions.content_digest,
        "family": instructions.family,
        "precision": instructions.precision,
        "optimizer": instructions.optimizer,
        "learning_rate": instructions.learning_rate,
        "global_batch_size": instructions.global_batch_size,
        "micro_batch_size": instructions.micro_batch_size,
        "seq_len": instructions.seq_len,
        "seed": instructions.seed,
        "factorisation": plan.factorisation(),
        "degrees": degrees,
    }


def mesh_summary(instructions) -> dict[str, Any]:
    plan = instructions.plan
    degrees = plan.as_dict()
    mesh = {axis: degrees[axis] for axis in MESH_AXES if axis in degrees}
    mesh.update(
        world_size=plan.world_size,
        data_parallel_size=plan.data_parallel_size,
        microbatches=plan.microbatches,
        gradient_accumulation_steps=plan.gradient_accumulation_steps,
    )
    return mesh


def parameter_summary(instructions) -> list[dict[str, Any]]:
    out = []
    for p in instructions.params:
        entry = {
            "name": p.name,
            "shape": list(p.global_shape),
            "dtype": p.dtype,
            "layout": p.mode,
            "shard_axes": list(p.shard_axes),
            "tp_dim": p.tp_dim,
        }
        if p.canonical != p.name:  # tied on one stage, or a copy on another: one logical tensor
            entry["tied_to"] = p.canonical
        out.append(entry)
    return out


def tied_names(instructions) -> dict[str, str]:
    """Every tied parameter -> the one logical tensor it is (the same whether or not a pipeline puts
    the two on different stages, so that checkpoints reshard between such plans)."""
    return {p.name: p.canonical for p in instructions.params if p.canonical != p.name}


def check_resume(
    manifest: Mapping[str, Any], instructions, *, data: Mapping[str, Any] | None, steps: int, path: str | Path
) -> int:
    """Refuse a plan that cannot continue ``manifest``'s training; return the step to continue from.

    Allowed: any other mesh (degrees, world size, micro-batches, accumulation), precision or
    learning rate. Refused: another model (a parameter added, removed, or of another shape), another
    optimizer, another global batch size or sequence length (the data position is a count of global
    samples, consumed one global batch per step), other data, or ``steps`` not beyond the checkpoint."""
    where = f"checkpoint {path}"
    if manifest.get("kind") != TORCH_KIND:
        raise CheckpointError(
            f"{where} holds {manifest.get('kind')!r} state; `run` resumes a transformer from {TORCH_KIND!r} "
            "checkpoints only"
        )
    saved = {p["name"]: p for p in manifest.get("parameters", [])}
    new = {p.name: p for p in instructions.params if p.canonical == p.name}
    problems = []
    saved_ties = dict(manifest.get("tied", {}))
    new_ties = tied_names(instructions)
    if saved_ties != new_ties:
        problems.append(f"tied weights differ (checkpoint {saved_ties or 'none'}, this plan {new_ties or 'none'})")
    for name in sorted(set(saved) & set(new)):
        old_shape, new_shape = list(saved[name]["shape"]), list(new[name].global_shape)
        if old_shape != new_shape:
            problems.append(f"parameter {name!r} has shape {old_shape} in the checkpoint but {new_shape} in this plan")
    problems += names_only_in_one("parameter", sorted(new), sorted(saved))
    if problems:
        raise CheckpointError(
            f"{where} is of a different model: " + "; ".join(problems) + ". Resume with the spec it was trained with"
        )
    plan = manifest.get("plan", {})
    if plan.get("optimizer") != instructions.optimizer:
        raise CheckpointError(
            f"{where} was trained with optimizer {plan.get('optimizer')!r}, this plan uses {instructions.optimizer!r}; "
            f"its optimizer state does not carry over: set training.optimizer: {plan.get('optimizer')}"
        )
    position = manifest.get("data", {})
    if position.get("global_batch_size") != instructions.global_batch_size:
        raise CheckpointError(
            f"{where} was trained with global_batch_size {position.get('global_batch_size')}, this plan has "
            f"{instructions.global_batch_size}; the data position counts whole global batches, so the run "
            "would change its "
            f"optimisation: set training.global_batch_size: {position.get('global_batch_size')} (any mesh that "
            "divides it resumes)"
        )
    if position.get("seq_len") != instructions.seq_len:
        raise CheckpointError(
            f"{where} was trained on sequences of {position.get('seq_len')} tokens, this plan on "
            f"{instructions.seq_len}: set training.seq_len: {position.get('seq_len')}"
        )
    if data is not None and position.get("source") is not None and not same_source(position["source"], data):
        raise CheckpointError(
            f"{where} was trained on data {_describe_source(position['source'])}, this run reads "
            f"{_describe_source(data)}; "
            "resuming on other data would not continue the same sample stream: pass the same --data (or seed)"
        )
    step = int(manifest["step"])
    samples = position.get("samples_consumed")
    if samples != step * instructions.global_batch_size:
        raise CheckpointError(
            f"{where}: the data position ({samples} samples) is not {step} whole global batches; the manifest "
            "is inconsistent"
        )
    if steps <= step:
        raise CheckpointError(
            f"{where} is at step {step}; --steps {steps} leaves nothing to run: pass --steps greater than "
            f"{step} (the total, counting the steps already done)"
        )
    return step


def same_source(saved: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether a run reads the data a checkpoint was trained on: the same synthetic seed, or a token
    file of the same content (its SHA-256 and size; the name may differ, a copy resumes)."""
    if saved.get("kind") != new.get("kind"):
        return False
    if new.get("kind") == "synthetic":
        return saved.get("seed") == new.get("seed")
    return (
        saved.get("sha256") is not None
        and saved.get("sha256") == new.get("sha256")
        and saved.get("bytes") == new.get("bytes")
    )


def _describe_source(source: Mapping[str, Any]) -> str:
    if source.get("kind") == "synthetic":
        return f"synthetic tokens with seed {source.get('seed')}"
    digest = str(source.get("sha256") or "no checksum")
    return f"token file {source.get('name')} ({source.get('bytes')} bytes, {digest[:19]})"


def checkpoint_view(path: str | Path) -> dict[str, Any]:
    """What ``explain CHECKPOINT`` shows: the manifest's step, mesh, plan digest, parameters and data position."""
    path = resolve_checkpoint(path)
    manifest = verify_checkpoint(path)
    root = path.parent
    files = manifest.get("files", {})
    return {
        "checkpoint": str(path),
        "complete": True,
        "verified": {
            "files": len(files),
            "bytes": sum(int(f.get("bytes", 0)) for f in files.values()),
            "run_id": manifest.get("run_id"),
        },
        "kind": manifest.get("kind"),
        "format_version": manifest.get("format_version"),
        "step": manifest.get("step"),
        "saved_unix": manifest.get("saved_unix"),
        "plan": manifest.get("plan", {}),
        "mesh": manifest.get("mesh", {}),
        "data": manifest.get("data", {}),
        "optimizer": manifest.get("optimizer", {}),
        "rng": manifest.get("rng", {}),
        "parameters": manifest.get("parameters", []),
        "arrays": manifest.get("arrays"),
        "runtime": manifest.get("runtime"),
        "fit": manifest.get("fit"),
        "others_in_root": [
            {"step": s, "path": str(p), "complete": ok} for s, p, ok in list_checkpoints(root) if p != path
        ],
    }


def source_description(data_path: str | Path | None, seed: int) -> dict[str, Any]:
    """How the manifest names the training data (compared on resume by ``same_source``): the seed,
    or the token file's name, size and SHA-256 of its content."""
    if data_path:
        path = Path(data_path)
        try:
            size, digest = path.stat().st_size, file_sha256(path)
        except OSError:
            size = digest = None
        return {"kind": "file", "name": path.name, "bytes": size, "sha256": digest}
    return {"kind": "synthetic", "seed": seed}

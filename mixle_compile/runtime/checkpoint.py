"""Checkpoints: atomic step directories with a JSON manifest, tensor state saved with torch DCP.

Two layers, so that a runtime without torch state (EM fits plain numpy arrays) reuses the first:

**Directory layer** (torch-free; ``explain`` and the launcher use it without importing torch).
A checkpoint root holds one directory per saved step::

    ROOT/step-00000004/
        state/            the payload (torch DCP files, or the caller's own files)
        manifest.json     what was saved: format, step, plan digest, mesh, parameters, data position
        COMPLETE          the completion marker: the step and the SHA-256 of manifest.json

A checkpoint is written into ``ROOT/.partial-step-00000004``; then the manifest is written, then
the marker, each file fsynced, and only then is the directory renamed to its final name. A
directory without the marker (a crash between those writes, a copy cut short) is never loaded:
``read_manifest`` refuses it naming the missing marker, and ``find_latest_checkpoint`` skips it.
``begin_checkpoint`` / ``commit_checkpoint`` are the two halves, ``write_array_checkpoint`` /
``read_array_checkpoint`` the whole for named numpy arrays (``np.save`` with ``allow_pickle=False``).

**Torch state layer** (``save_session`` / ``load_session``): model parameters and optimizer state
(AdamW's ``exp_avg``, ``exp_avg_sq`` and ``step``) with ``torch.distributed.checkpoint``. Every
rank writes the rectangle of each global tensor it holds (its tensor-parallel slice, then its FSDP
row shard, padding left out), stated in global coordinates; DCP keeps one copy of what several ranks
hold. Loading asks for the rectangle the *new* plan gives the rank, so a checkpoint written on
``dp_shard=4, tp=2`` loads on ``dp_shard=2, tp=1``. DCP's own metadata is written as JSON
(``state/dcp-metadata.json``), not pickled, and tensors are read with ``weights_only=True``:
loading a checkpoint never unpickles an object.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mixle_compile.runtime.errors import RuntimeRefusal

CHECKPOINT_FORMAT = "mixle-checkpoint"
FORMAT_VERSION = 1  # a manifest with a higher version is refused: this code cannot know its meaning
MANIFEST_FILE = "manifest.json"
COMPLETE_MARKER = "COMPLETE"
STATE_DIR = "state"
DCP_METADATA_FILE = "dcp-metadata.json"
STEP_PREFIX = "step-"
PARTIAL_PREFIX = ".partial-"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
TORCH_KIND = "torch-dcp"
ARRAYS_KIND = "numpy-arrays"


class CheckpointError(RuntimeRefusal):
    """A checkpoint cannot be written, found, read or resumed; the message says which and how to fix it."""


# ---------------------------------------------------------------------------
# directory layer (torch-free)
# ---------------------------------------------------------------------------


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


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


def begin_checkpoint(root: str | Path, step: int) -> PendingCheckpoint:
    """Create an empty temporary directory for step ``step`` (a leftover of a crashed save is removed).

    In a job of several processes exactly one calls this, and the others wait for it."""
    pending = pending_checkpoint(root, step)
    try:
        pending.root.mkdir(parents=True, exist_ok=True)
        if pending.path.exists():
            shutil.rmtree(pending.path)
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


def _write_synced(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def manifest_bytes(manifest: Mapping[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode("utf-8")


def commit_checkpoint(pending: PendingCheckpoint, manifest: Mapping[str, Any], *, kind: str) -> Path:
    """Write the manifest, then the completion marker, then move the directory to its final name.

    ``manifest`` is the caller's JSON-ready description; ``format``, ``format_version``, ``kind``,
    ``step`` and ``saved_unix`` are added. Returns the final directory ``ROOT/step-NNNNNNNN``."""
    body = dict(manifest)
    body.update(format=CHECKPOINT_FORMAT, format_version=FORMAT_VERSION, kind=kind, step=pending.step, saved_unix=time.time())
    data = manifest_bytes(body)
    final = pending.final_path
    try:
        _write_synced(pending.path / MANIFEST_FILE, data)
        marker = {"step": pending.step, "manifest_sha256": hashlib.sha256(data).hexdigest()}
        _write_synced(pending.path / COMPLETE_MARKER, (json.dumps(marker, sort_keys=True) + "\n").encode("utf-8"))
        _fsync_dir(pending.path)
        if final.exists():  # the same step saved again (a rerun into the same root): replace it
            stale = pending.root / f"{PARTIAL_PREFIX}replaced-{final.name}"
            if stale.exists():
                shutil.rmtree(stale)
            os.replace(final, stale)
            os.replace(pending.path, final)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.replace(pending.path, final)
        _fsync_dir(pending.root)
    except OSError as exc:
        raise CheckpointError(f"cannot commit the checkpoint {final}: {exc.strerror or exc}") from None
    return final


def list_checkpoints(root: str | Path) -> list[tuple[int, Path, bool]]:
    """``(step, directory, complete)`` of every step directory under ``root``, by step."""
    root = Path(root)
    found = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    for entry in entries:
        m = _STEP_DIR.match(entry.name)
        if m and entry.is_dir():
            found.append((int(m.group(1)), entry, (entry / COMPLETE_MARKER).is_file()))
    return sorted(found)


def find_latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint of the highest step under ``root`` (None when there is none)."""
    complete = [path for _, path, ok in list_checkpoints(root) if ok]
    return complete[-1] if complete else None


def is_checkpoint_dir(path: str | Path) -> bool:
    path = Path(path)
    return bool(_STEP_DIR.match(path.name)) or (path / MANIFEST_FILE).exists() or (path / COMPLETE_MARKER).exists()


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


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from ``path``: a step directory itself, or a root (its latest complete step)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist; pass a checkpoint root (the --checkpoint-dir of a run) or one of its step-NNNNNNNN directories")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a directory; pass a checkpoint root or one of its step-NNNNNNNN directories")
    if is_checkpoint_dir(path):
        return path
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
    raise CheckpointError(f"{path} holds no checkpoint (no step-NNNNNNNN directory); pass the --checkpoint-dir of a run that saved one")


def read_manifest(path: str | Path, *, kind: str | None = None) -> dict[str, Any]:
    """The validated manifest of the checkpoint directory ``path`` (see ``resolve_checkpoint``).

    Refused (CheckpointError): no completion marker; an unreadable, corrupted or modified manifest
    (its SHA-256 differs from the marker's); another format, a newer format version, or another
    ``kind`` than asked for."""
    path = Path(path)
    marker_path = path / COMPLETE_MARKER
    if not marker_path.is_file():
        raise CheckpointError(
            f"checkpoint {path} has no completion marker {marker_path.name} ({marker_path}): it was not completely written "
            "and is never loaded; resume from an earlier complete checkpoint (pass the checkpoint root to take the latest complete one)"
        )
    try:
        marker = json.loads(marker_path.read_text(encoding="utf-8"))
        expected = marker["manifest_sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(f"checkpoint {path}: the completion marker {marker_path} is unreadable; the checkpoint cannot be trusted") from None
    manifest_path = path / MANIFEST_FILE
    try:
        data = manifest_path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path}: cannot read its manifest {manifest_path}: {exc.strerror or exc}") from None
    if hashlib.sha256(data).hexdigest() != expected:
        raise CheckpointError(
            f"checkpoint {path}: the manifest {manifest_path} does not match the SHA-256 its completion marker records "
            "(corrupted or edited after saving); it is not loaded"
        )
    try:
        manifest = json.loads(data)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {path}: the manifest {manifest_path} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"checkpoint {path}: {manifest_path} is not a {CHECKPOINT_FORMAT} manifest")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise CheckpointError(f"checkpoint {path}: the manifest's format_version {version!r} is invalid")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {version}, newer than this mixle-compile reads ({FORMAT_VERSION}); "
            "upgrade mixle-compile to load it"
        )
    if not isinstance(manifest.get("step"), int) or manifest["step"] != marker.get("step"):
        raise CheckpointError(f"checkpoint {path}: the manifest's step {manifest.get('step')!r} differs from the marker's {marker.get('step')!r}")
    if kind is not None and manifest.get("kind") != kind:
        raise CheckpointError(f"checkpoint {path} holds {manifest.get('kind')!r} state, not {kind!r}; it was written by another runtime")
    return manifest


def prune_checkpoints(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints (and incomplete ones older than those)."""
    if keep < 1:
        return []
    entries = list_checkpoints(root)
    complete = [p for _, p, ok in entries if ok]
    if len(complete) <= keep:
        return []
    oldest_kept = complete[-keep]
    removed = []
    for step, path, _ in entries:
        if path in complete[-keep:] or step >= int(_STEP_DIR.match(oldest_kept.name).group(1)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def write_array_checkpoint(root: str | Path, step: int, arrays: Mapping[str, Any], manifest: Mapping[str, Any]) -> Path:
    """Save named numpy arrays and a JSON manifest atomically (single-process callers, such as EM)."""
    import numpy as np

    pending = begin_checkpoint(root, step)
    entries = {}
    for i, (name, array) in enumerate(sorted(arrays.items())):
        a = np.asarray(array)
        if a.dtype.hasobject:
            raise CheckpointError(f"array {name!r} holds Python objects; a checkpoint stores numbers only")
        file = f"array-{i:04d}.npy"
        with open(pending.state_dir / file, "wb") as f:
            np.save(f, a, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        entries[name] = {"file": file, "shape": list(a.shape), "dtype": a.dtype.str}
    return commit_checkpoint(pending, {**manifest, "arrays": entries}, kind=ARRAYS_KIND)


def read_array_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(manifest, arrays)`` of a checkpoint written by ``write_array_checkpoint`` (path: step dir or root)."""
    import numpy as np

    path = resolve_checkpoint(path)
    manifest = read_manifest(path, kind=ARRAYS_KIND)
    arrays = {}
    for name, entry in manifest.get("arrays", {}).items():
        file = path / STATE_DIR / entry["file"]
        try:
            a = np.load(file, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {path}: cannot read array {name!r} from {file}: {exc}") from None
        if list(a.shape) != entry["shape"] or a.dtype.str != entry["dtype"]:
            raise CheckpointError(f"checkpoint {path}: array {name!r} is {a.dtype.str}{list(a.shape)}, the manifest says {entry['dtype']}{entry['shape']}")
        arrays[name] = a
    return manifest, arrays


# ---------------------------------------------------------------------------
# what a torch checkpoint records, and whether a plan may resume from it (torch-free)
# ---------------------------------------------------------------------------

MESH_AXES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")


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
        entry = {"name": p.name, "shape": list(p.global_shape), "dtype": p.dtype, "layout": p.mode,
                 "shard_axes": list(p.shard_axes), "tp_dim": p.tp_dim}
        if p.canonical != p.name:  # tied on one stage, or a copy on another: one logical tensor
            entry["tied_to"] = p.canonical
        out.append(entry)
    return out


def tied_names(instructions) -> dict[str, str]:
    """Every tied parameter -> the one logical tensor it is (the same whether or not a pipeline puts
    the two on different stages, so that checkpoints reshard between such plans)."""
    return {p.name: p.canonical for p in instructions.params if p.canonical != p.name}


def check_resume(manifest: Mapping[str, Any], instructions, *, data: Mapping[str, Any] | None, steps: int, path: str | Path) -> int:
    """Refuse a plan that cannot continue ``manifest``'s training; return the step to continue from.

    Allowed: any other mesh (degrees, world size, micro-batches, accumulation), precision or
    learning rate. Refused: another model (a parameter added, removed, or of another shape), another
    optimizer, another global batch size or sequence length (the data position is a count of global
    samples, consumed one global batch per step), other data, or ``steps`` not beyond the checkpoint."""
    where = f"checkpoint {path}"
    if manifest.get("kind") != TORCH_KIND:
        raise CheckpointError(f"{where} holds {manifest.get('kind')!r} state; `run` resumes a transformer from {TORCH_KIND!r} checkpoints only")
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
        raise CheckpointError(f"{where} is of a different model: " + "; ".join(problems) + ". Resume with the spec it was trained with")
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
            f"{instructions.global_batch_size}; the data position counts whole global batches, so the run would change its "
            f"optimisation: set training.global_batch_size: {position.get('global_batch_size')} (any mesh that divides it resumes)"
        )
    if position.get("seq_len") != instructions.seq_len:
        raise CheckpointError(f"{where} was trained on sequences of {position.get('seq_len')} tokens, this plan on {instructions.seq_len}: set training.seq_len: {position.get('seq_len')}")
    if data is not None and position.get("source") is not None and dict(position["source"]) != dict(data):
        raise CheckpointError(
            f"{where} was trained on data {_describe_source(position['source'])}, this run reads {_describe_source(data)}; "
            "resuming on other data would not continue the same sample stream: pass the same --data (or seed)"
        )
    index = Path(path) / STATE_DIR / DCP_METADATA_FILE
    if not index.is_file():
        raise CheckpointError(f"{where} has no tensor index {index}; its tensor state is missing, so it cannot be resumed")
    step = int(manifest["step"])
    samples = position.get("samples_consumed")
    if samples != step * instructions.global_batch_size:
        raise CheckpointError(f"{where}: the data position ({samples} samples) is not {step} whole global batches; the manifest is inconsistent")
    if steps <= step:
        raise CheckpointError(f"{where} is at step {step}; --steps {steps} leaves nothing to run: pass --steps greater than {step} (the total, counting the steps already done)")
    return step


def _describe_source(source: Mapping[str, Any]) -> str:
    if source.get("kind") == "synthetic":
        return f"synthetic tokens with seed {source.get('seed')}"
    return f"token file {source.get('name')} ({source.get('bytes')} bytes)"


def checkpoint_view(path: str | Path) -> dict[str, Any]:
    """What ``explain CHECKPOINT`` shows: the manifest's step, mesh, plan digest, parameters and data position."""
    path = resolve_checkpoint(path)
    manifest = read_manifest(path)
    root = path.parent
    return {
        "checkpoint": str(path),
        "complete": True,
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
        "others_in_root": [{"step": s, "path": str(p), "complete": ok} for s, p, ok in list_checkpoints(root) if p != path],
    }


# ---------------------------------------------------------------------------
# torch state layer (imports torch when called)
# ---------------------------------------------------------------------------


@dataclass
class GlobalChunk:
    """A rectangle of a global tensor: ``tensor`` holds elements ``offsets .. offsets + tensor.shape``."""

    tensor: Any
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]


def _parameter_region(local, *, shard: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) in global coordinates of what a rank holds of ``local`` (shard: its row shard)."""
    shape = tuple(local.instr.global_shape)
    offsets = [0] * len(shape)
    sizes = list(shape)
    for dim, start, stop in local.tp_slices:
        offsets[dim] += start
        sizes[dim] = stop - start
    if shard and local.sharded and shape:
        offsets[0] += local.shard_index * local.shard_rows
        sizes[0] = local.valid_shard_rows
    return tuple(offsets), tuple(sizes)


def _rng_key() -> str:
    return "rng/torch_cpu"


def _state_chunks(session) -> dict[str, GlobalChunk]:
    """This rank's model, optimizer and RNG state as rectangles of global tensors (copies on the CPU)."""
    import torch

    chunks: dict[str, GlobalChunk] = {}
    optimizer_state = session.optimizer.state
    for name, local in session.store.params.items():
        if local.instr.copy_of is not None:
            continue  # a tied weight's copy on a later stage: the first stage's copy is saved
        offsets, sizes = _parameter_region(local, shard=True)
        rows = sizes[0] if sizes else 1
        if rows == 0:
            continue  # a shard of padding only
        master = local.master.detach()
        part = master[:rows] if local.sharded else master
        chunks[f"model/{name}"] = GlobalChunk(part.to("cpu", copy=True).contiguous(), offsets, tuple(local.instr.global_shape))
        for key, value in optimizer_state.get(local.master, {}).items():
            if not torch.is_tensor(value):
                continue
            if value.dim() == 0:
                chunks[f"optim/{name}/{key}"] = GlobalChunk(value.detach().to("cpu", copy=True).reshape(()), (), ())
            elif tuple(value.shape) == tuple(master.shape):
                v = value.detach()[:rows] if local.sharded else value.detach()
                chunks[f"optim/{name}/{key}"] = GlobalChunk(v.to("cpu", copy=True).contiguous(), offsets, tuple(local.instr.global_shape))
            else:
                raise CheckpointError(f"optimizer state {key!r} of {name!r} has shape {tuple(value.shape)}, neither a scalar nor the parameter's; it cannot be checkpointed")
    state = torch.get_rng_state().reshape(1, -1)
    chunks[_rng_key()] = GlobalChunk(state.clone(), (session.mesh.rank, 0), (session.mesh.world_size, state.shape[1]))
    return chunks


def _dcp():
    """The DCP pieces, with a writer and a reader that keep DCP's metadata as JSON (no pickle)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    dtypes = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.bool)}

    class ChunkSavePlanner(DefaultSavePlanner):
        """Write each GlobalChunk as a shard of its global tensor (DCP drops duplicates across ranks)."""

        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
            self.state_dict = state_dict
            self.is_coordinator = is_coordinator

        def create_local_plan(self):
            items = []
            for fqn, c in self.state_dict.items():
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, c.offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.tensor.shape)),
                            properties=TensorProperties.create_from_tensor(c.tensor),
                            size=torch.Size(c.global_shape),
                        ),
                    )
                )
            self.plan = SavePlan(items)
            return self.plan

        def lookup_object(self, index):
            return self.state_dict[index.fqn].tensor

    class ChunkLoadPlanner(DefaultLoadPlanner):
        """Read into each GlobalChunk the parts of the saved chunks that overlap it."""

        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
            self.state_dict = self.original_state_dict = state_dict
            self.metadata = metadata
            self.is_coordinator = is_coordinator

        def create_local_plan(self):
            requests = []
            for fqn, c in self.state_dict.items():
                md = self.metadata.state_dict_metadata.get(fqn)
                if md is None or not isinstance(md, TensorStorageMetadata):
                    raise CheckpointError(f"the checkpoint's tensor state has no {fqn!r}")
                if tuple(md.size) != tuple(c.global_shape):
                    raise CheckpointError(f"{fqn!r} has shape {list(md.size)} in the checkpoint, {list(c.global_shape)} here")
                local = ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.tensor.shape))
                reads = create_read_items_for_chunk_list(fqn, md, [local])
                covered = sum(math.prod(r.lengths) for r in reads)
                if covered != math.prod(c.tensor.shape):
                    raise CheckpointError(
                        f"the checkpoint's chunks of {fqn!r} cover {covered} of the {math.prod(c.tensor.shape)} values this rank needs "
                        f"at offsets {list(c.offsets)}; the tensor state is incomplete"
                    )
                requests += reads
            return LoadPlan(requests)

        def lookup_tensor(self, index):
            return self.state_dict[index.fqn].tensor

    class JsonWriter(FileSystemWriter):
        def finish(self, metadata, results) -> None:
            storage = []
            for result_list in results:
                for r in result_list:
                    info = r.storage_data
                    storage.append({
                        "fqn": r.index.fqn, "offset": list(r.index.offset or ()), "index": r.index.index,
                        "file": info.relative_path, "at": info.offset, "length": info.length,
                        "transforms": list(info.transform_descriptors or []),
                    })
            tensors = {}
            for fqn, md in metadata.state_dict_metadata.items():
                if not isinstance(md, TensorStorageMetadata):
                    raise CheckpointError(f"{fqn!r} is not a tensor; checkpoints hold tensors only")
                tensors[fqn] = {
                    "dtype": str(md.properties.dtype).removeprefix("torch."),
                    "size": list(md.size),
                    "chunks": [{"offsets": list(ch.offsets), "sizes": list(ch.sizes)} for ch in md.chunks],
                }
            body = {"dcp_version": metadata.version, "tensors": tensors, "storage": storage}
            _write_synced(Path(self.path) / DCP_METADATA_FILE, json.dumps(body, sort_keys=True).encode("utf-8"))

    class JsonReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            path = Path(self.path) / DCP_METADATA_FILE
            try:
                body = json.loads(path.read_text(encoding="utf-8"))
                state = {}
                for fqn, t in body["tensors"].items():
                    if t["dtype"] not in dtypes:
                        raise ValueError(f"dtype {t['dtype']!r} of {fqn!r}")
                    state[fqn] = TensorStorageMetadata(
                        properties=TensorProperties(dtype=dtypes[t["dtype"]]),
                        size=torch.Size(t["size"]),
                        chunks=[ChunkStorageMetadata(offsets=torch.Size(c["offsets"]), sizes=torch.Size(c["sizes"])) for c in t["chunks"]],
                    )
                storage = {
                    MetadataIndex(s["fqn"], s["offset"], s["index"]): _StorageInfo(s["file"], int(s["at"]), int(s["length"]), s["transforms"] or None)
                    for s in body["storage"]
                }
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"the tensor metadata {path} is missing or unreadable ({exc})") from None
            return Metadata(state_dict_metadata=state, storage_data=storage, storage_meta=StorageMeta(load_id=self.load_id), version=body.get("dcp_version"))

    return dcp, ChunkSavePlanner, ChunkLoadPlanner, JsonWriter, JsonReader


def _dcp_group(session):
    group = session.mesh.group("world")
    return group, group.handle


def _run_guarded(session, name: str, call) -> None:
    """Run a DCP call as a bookkeeping collective over the world (a dead peer fails it, naming it)."""
    group, handle = _dcp_group(session)
    session.ledger.record_bookkeeping(name, 0)
    if handle is None:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's "assuming the intent is to save in a single process": it is
            call()
    else:
        session.comm._guard(name, group, call)


def save_session(
    session,
    root: str | Path,
    *,
    data_source: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    on_written: Callable[[], None] | None = None,
) -> Path:
    """Checkpoint ``session`` at its current step into ``root/step-NNNNNNNN`` (collective: every rank calls it).

    Refused while an accumulation window has gradients pending. Rank 0 creates the temporary
    directory, every rank writes its chunks with DCP, rank 0 writes the manifest and the marker and
    renames the directory, and no rank returns before that is done. ``on_written`` runs on every rank
    after the tensor state is written and before the commit (used to test interrupted saves)."""
    if session._accumulated:
        raise CheckpointError(
            f"cannot save a checkpoint at step {session.step}: {session._accumulated} of {session.plan.gradient_accumulation_steps} "
            "accumulation steps have gradients pending; save after the optimizer step closes the window"
        )
    dcp, ChunkSavePlanner, _, JsonWriter, _ = _dcp()
    rank = session.mesh.rank
    step = session.step
    started = time.perf_counter()
    pending = begin_checkpoint(root, step) if rank == 0 else pending_checkpoint(root, step)
    session.comm.barrier("checkpoint:begin")
    chunks = _state_chunks(session)
    _, handle = _dcp_group(session)
    writer = JsonWriter(pending.state_dir, thread_count=1, sync_files=True, overwrite=True)
    _run_guarded(
        session,
        "checkpoint:save",
        lambda: dcp.save(chunks, storage_writer=writer, planner=ChunkSavePlanner(), process_group=handle, no_dist=handle is None),
    )
    if on_written is not None:
        on_written()
    final = pending.final_path
    if rank == 0:
        instructions = session.instructions
        optimizer_keys = sorted({k.split("/", 2)[2] for k in chunks if k.startswith("optim/")})
        manifest = {
            "plan": plan_summary(instructions),
            "mesh": mesh_summary(instructions),
            "parameters": [p for p in parameter_summary(instructions) if "tied_to" not in p],
            "tied": tied_names(instructions),
            "optimizer": {"name": instructions.optimizer, "learning_rate": instructions.learning_rate, "state": optimizer_keys},
            "data": {
                "samples_consumed": _samples_before(session, step),
                "global_batch_size": instructions.global_batch_size,
                "seq_len": instructions.seq_len,
                "source": dict(data_source) if data_source is not None else None,
            },
            "rng": {"torch_cpu": _rng_key(), "ranks": session.mesh.world_size, "note": "rank r resumes with the state of saved rank r mod ranks"},
            "state": {"directory": STATE_DIR, "engine": "torch.distributed.checkpoint", "metadata": f"{STATE_DIR}/{DCP_METADATA_FILE}"},
            **(dict(extra) if extra else {}),
        }
        import torch

        manifest["state"]["torch"] = torch.__version__
        manifest["save_s"] = time.perf_counter() - started
        final = commit_checkpoint(pending, manifest, kind=TORCH_KIND)
    session.comm.barrier("checkpoint:committed")
    return final


def _samples_before(session, step: int) -> int:
    from mixle_compile.runtime.data import BatchLayout

    plan = session.plan
    layout = BatchLayout(session.instructions.micro_batch_size, plan.microbatches, plan.gradient_accumulation_steps, plan.data_parallel_size)
    return layout.samples_before(step)


def load_session(session, path: str | Path, *, manifest: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Load a checkpoint into ``session`` in the session's own layout (collective: every rank calls it).

    ``path`` is a step directory or a root (its latest complete checkpoint). Parameters and
    optimizer state are read in global coordinates, so the checkpoint may come from another mesh.
    The session's step becomes the checkpoint's; returns the manifest."""
    import torch

    path = resolve_checkpoint(path)
    manifest = dict(manifest) if manifest is not None else read_manifest(path, kind=TORCH_KIND)
    saved = {p["name"]: p for p in manifest.get("parameters", [])}
    # A copy of a tied weight on another stage reads the weight it copies (saved under that name).
    source = {name: local.instr.canonical for name, local in session.store.params.items()}
    for name, local in session.store.params.items():
        if source[name] not in saved:
            raise CheckpointError(f"checkpoint {path} has no parameter {source[name]!r}")
        if list(saved[source[name]]["shape"]) != list(local.instr.global_shape):
            raise CheckpointError(f"checkpoint {path}: parameter {name!r} has shape {saved[source[name]]['shape']} there but {list(local.instr.global_shape)} in this plan")
    dcp, _, ChunkLoadPlanner, _, JsonReader = _dcp()
    state_keys = set(manifest.get("optimizer", {}).get("state", []))
    targets: dict[str, GlobalChunk] = {}
    for name, local in session.store.params.items():
        shape = tuple(local.instr.global_shape)
        whole_offsets, whole_sizes = _parameter_region(local, shard=local.mode != "zero")
        targets[f"model/{source[name]}"] = GlobalChunk(torch.empty(whole_sizes, dtype=torch.float32), whole_offsets, shape)
        offsets, sizes = _parameter_region(local, shard=True)
        for key in sorted(state_keys):
            if key == "step":
                targets[f"optim/{source[name]}/step"] = GlobalChunk(torch.zeros((), dtype=torch.float32), (), ())
            else:
                targets[f"optim/{source[name]}/{key}"] = GlobalChunk(torch.zeros(sizes, dtype=torch.float32), offsets, shape)
    targets = {k: v for k, v in targets.items() if all(v.tensor.shape) or v.tensor.dim() == 0}
    saved_ranks = int(manifest.get("rng", {}).get("ranks", 1))
    rng_len = torch.get_rng_state().numel()
    targets[_rng_key()] = GlobalChunk(torch.empty((1, rng_len), dtype=torch.uint8), (session.mesh.rank % saved_ranks, 0), (saved_ranks, rng_len))
    _, handle = _dcp_group(session)
    reader = JsonReader(path / STATE_DIR)
    _run_guarded(session, "checkpoint:load", lambda: dcp.load(targets, storage_reader=reader, planner=ChunkLoadPlanner(), process_group=handle, no_dist=handle is None))
    with torch.no_grad():
        for name, local in session.store.params.items():
            master = local.master
            model = targets.get(f"model/{source[name]}")
            if local.mode == "zero":
                whole = model.tensor
                local.compute.copy_(whole.to(device=local.compute.device, dtype=local.compute.dtype))
                rows = local.valid_shard_rows
                start = local.shard_index * local.shard_rows
                master.zero_()
                master[:rows].copy_(whole[start : start + rows])
            elif local.sharded:
                master.zero_()
                if model is not None:
                    master[: model.tensor.shape[0]].copy_(model.tensor)
            else:
                master.copy_(model.tensor)
            if state_keys:
                state = {}
                for key in sorted(state_keys):
                    chunk = targets.get(f"optim/{source[name]}/{key}")
                    if key == "step":
                        state["step"] = chunk.tensor.clone()
                        continue
                    value = torch.zeros_like(master)
                    if chunk is not None:
                        value[: chunk.tensor.shape[0]].copy_(chunk.tensor)
                    state[key] = value
                session.optimizer.state[master] = state
    torch.set_rng_state(targets[_rng_key()].tensor.reshape(-1).clone())
    session.step = int(manifest["step"])
    return manifest


def source_description(data_path: str | Path | None, seed: int) -> dict[str, Any]:
    """How the manifest names the training data (compared on resume): the seed, or the file's name and size."""
    if data_path:
        path = Path(data_path)
        try:
            size = path.stat().st_size
        except OSError:
            size = None
        return {"kind": "file", "name": path.name, "bytes": size}
    return {"kind": "synthetic", "seed": seed}


def read_global_state(path: str | Path, *, optimizer: bool = False) -> dict[str, Any]:
    """Whole tensors of a checkpoint in this process (no process group): ``{name: tensor}`` for every
    parameter, plus ``{"optim/<name>/<key>": tensor}`` with ``optimizer=True``. For inspection,
    export, and tests that compare two checkpoints."""
    import torch

    path = resolve_checkpoint(path)
    manifest = read_manifest(path, kind=TORCH_KIND)
    dcp, _, ChunkLoadPlanner, _, JsonReader = _dcp()
    reader = JsonReader(path / STATE_DIR)
    metadata = reader.read_metadata()
    wanted = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if fqn.startswith("model/") or (optimizer and fqn.startswith("optim/")):
            shape = tuple(md.size)
            wanted[fqn] = GlobalChunk(torch.empty(shape, dtype=md.properties.dtype), (0,) * len(shape), shape)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... loading in a single process": intended
        dcp.load(wanted, storage_reader=JsonReader(path / STATE_DIR), planner=ChunkLoadPlanner(), no_dist=True)
    out = {fqn.removeprefix("model/"): c.tensor for fqn, c in wanted.items()}
    for tied, canonical in manifest.get("tied", {}).items():
        if canonical in out:
            out[tied] = out[canonical]
    return out

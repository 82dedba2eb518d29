"""Checkpoints, torch state layer: model parameters and optimizer state saved and loaded with
``torch.distributed.checkpoint`` (DCP) into the step directories of runtime/checkpoint.py.

The state is AdamW's ``exp_avg``, ``exp_avg_sq`` and ``step`` besides the parameters. Every rank
writes the rectangle of each global tensor it holds (its tensor-parallel slice, then its FSDP row
shard, padding left out), stated in global coordinates; DCP keeps one copy of what several ranks
hold. Loading asks for the rectangle the *new* plan gives the rank, so a checkpoint written on
``dp_shard=4, tp=2`` loads on ``dp_shard=2, tp=1``. DCP's own metadata is written as JSON
(``state/dcp-metadata.json``), not pickled, and tensors are read with ``weights_only=True``:
loading a checkpoint never unpickles an object. The directory, its manifest and its seal are the
torch-free layer's (runtime/checkpoint.py); this module only fills ``state/`` and reads it back.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

from mixle_compile.runtime.checkpoint import (
    DCP_METADATA_FILE,
    STATE_DIR,
    TORCH_KIND,
    CheckpointError,
    begin_checkpoint,
    commit_checkpoint,
    mesh_summary,
    parameter_summary,
    pending_checkpoint,
    plan_summary,
    resolve_checkpoint,
    safe_relative,
    tied_names,
    verify_checkpoint,
    write_synced,
)


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
        chunks[f"model/{name}"] = GlobalChunk(
            part.to("cpu", copy=True).contiguous(), offsets, tuple(local.instr.global_shape)
        )
        for key, value in optimizer_state.get(local.master, {}).items():
            if not torch.is_tensor(value):
                continue
            if value.dim() == 0:
                chunks[f"optim/{name}/{key}"] = GlobalChunk(value.detach().to("cpu", copy=True).reshape(()), (), ())
            elif tuple(value.shape) == tuple(master.shape):
                v = value.detach()[:rows] if local.sharded else value.detach()
                chunks[f"optim/{name}/{key}"] = GlobalChunk(
                    v.to("cpu", copy=True).contiguous(), offsets, tuple(local.instr.global_shape)
                )
            else:
                raise CheckpointError(
                    f"optimizer state {key!r} of {name!r} has shape {tuple(value.shape)}, neither a scalar nor "
                    "the parameter's; it cannot be checkpointed"
                )
    state = torch.get_rng_state().reshape(1, -1)
    chunks[_rng_key()] = GlobalChunk(state.clone(), (session.mesh.rank, 0), (session.mesh.world_size, state.shape[1]))
    return chunks


# The dtypes the JSON metadata may name.
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.uint8,
        torch.bool,
    )
}


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
                raise CheckpointError(
                    f"{fqn!r} has shape {list(md.size)} in the checkpoint, {list(c.global_shape)} here"
                )
            local = ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.tensor.shape))
            reads = create_read_items_for_chunk_list(fqn, md, [local])
            covered = sum(math.prod(r.lengths) for r in reads)
            if covered != math.prod(c.tensor.shape):
                raise CheckpointError(
                    f"the checkpoint's chunks of {fqn!r} cover {covered} of the {math.prod(c.tensor.shape)} "
                    "values this rank needs "
                    f"at offsets {list(c.offsets)}; the tensor state is incomplete"
                )
            requests += reads
        return LoadPlan(requests)

    def lookup_tensor(self, index):
        return self.state_dict[index.fqn].tensor


class JsonWriter(FileSystemWriter):
    """DCP's filesystem writer, its metadata written as JSON."""

    def finish(self, metadata, results) -> None:
        storage = []
        for result_list in results:
            for r in result_list:
                info = r.storage_data
                storage.append(
                    {
                        "fqn": r.index.fqn,
                        "offset": list(r.index.offset or ()),
                        "index": r.index.index,
                        "file": info.relative_path,
                        "at": info.offset,
                        "length": info.length,
                        "transforms": list(info.transform_descriptors or []),
                    }
                )
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
        write_synced(Path(self.path) / DCP_METADATA_FILE, json.dumps(body, sort_keys=True).encode("utf-8"))


class JsonReader(FileSystemReader):
    """DCP's filesystem reader, its metadata read from the JSON the writer wrote (every storage path
    confined to the step)."""

    def read_metadata(self, *args, **kwargs):
        path = Path(self.path) / DCP_METADATA_FILE
        try:
            body = json.loads(path.read_text(encoding="utf-8"))
            state = {}
            for fqn, t in body["tensors"].items():
                if t["dtype"] not in _DTYPES:
                    raise ValueError(f"dtype {t['dtype']!r} of {fqn!r}")
                state[fqn] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=_DTYPES[t["dtype"]]),
                    size=torch.Size(t["size"]),
                    chunks=[
                        ChunkStorageMetadata(offsets=torch.Size(c["offsets"]), sizes=torch.Size(c["sizes"]))
                        for c in t["chunks"]
                    ],
                )
            storage = {}
            for s in body["storage"]:
                if not safe_relative(s["file"]):
                    raise ValueError(f"storage path {s['file']!r} leaves {self.path}")
                if not (Path(self.path) / s["file"]).is_file() or (Path(self.path) / s["file"]).is_symlink():
                    raise ValueError(f"storage file {s['file']!r} is not a regular file of {self.path}")
                storage[MetadataIndex(s["fqn"], s["offset"], s["index"])] = _StorageInfo(
                    s["file"], int(s["at"]), int(s["length"]), s["transforms"] or None
                )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"the tensor metadata {path} is missing or unreadable ({exc})") from None
        return Metadata(
            state_dict_metadata=state,
            storage_data=storage,
            storage_meta=StorageMeta(load_id=self.load_id),
            version=body.get("dcp_version"),
        )


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
        session.comm.guard(name, group, call)


def save_session(
    session,
    root: str | Path,
    *,
    data_source: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    on_written: Callable[[], None] | None = None,
    run_id: str | None = None,
) -> Path:
    """Checkpoint ``session`` at its current step into ``root/step-NNNNNNNN`` (collective: every rank calls it).

    Refused while an accumulation window has gradients pending. Rank 0 creates the temporary
    directory, every rank writes its chunks with DCP, rank 0 writes the manifest and the marker and
    renames the directory, and no rank returns before that is done. ``on_written`` runs on every rank
    after the tensor state is written and before the commit (used to test interrupted saves);
    ``run_id`` is recorded in the manifest and marker (default: this process's)."""
    if session._accumulated:
        raise CheckpointError(
            f"cannot save a checkpoint at step {session.step}: {session._accumulated} of "
            f"{session.plan.gradient_accumulation_steps} "
            "accumulation steps have gradients pending; save after the optimizer step closes the window"
        )
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
        lambda: dcp.save(
            chunks, storage_writer=writer, planner=ChunkSavePlanner(), process_group=handle, no_dist=handle is None
        ),
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
            "optimizer": {
                "name": instructions.optimizer,
                "learning_rate": instructions.learning_rate,
                "state": optimizer_keys,
            },
            "data": {
                "samples_consumed": _samples_before(session, step),
                "global_batch_size": instructions.global_batch_size,
                "seq_len": instructions.seq_len,
                "source": dict(data_source) if data_source is not None else None,
            },
            "rng": {
                "torch_cpu": _rng_key(),
                "ranks": session.mesh.world_size,
                "note": "rank r resumes with the state of saved rank r mod ranks",
            },
            "state": {
                "directory": STATE_DIR,
                "engine": "torch.distributed.checkpoint",
                "metadata": f"{STATE_DIR}/{DCP_METADATA_FILE}",
            },
            **(dict(extra) if extra else {}),
        }

        manifest["state"]["torch"] = torch.__version__
        manifest["save_s"] = time.perf_counter() - started
        final = commit_checkpoint(pending, manifest, kind=TORCH_KIND, run_id=run_id)
    session.comm.barrier("checkpoint:committed")
    return final


def _samples_before(session, step: int) -> int:
    from mixle_compile.runtime.data import BatchLayout

    plan = session.plan
    layout = BatchLayout(
        session.instructions.micro_batch_size,
        plan.microbatches,
        plan.gradient_accumulation_steps,
        plan.data_parallel_size,
    )
    return layout.samples_before(step)


def load_session(
    session, path: str | Path, *, manifest: Mapping[str, Any] | None = None, hashes: bool = True
) -> dict[str, Any]:
    """Load a checkpoint into ``session`` in the session's own layout (collective: every rank calls it).

    ``path`` is a step directory or a root (its latest complete checkpoint). Parameters and
    optimizer state are read in global coordinates, so the checkpoint may come from another mesh.
    The session's step becomes the checkpoint's; returns the manifest. The checkpoint is verified
    against its seal first (``hashes=False``: all but the files' SHA-256, for ranks whose launcher
    has just verified them), and NaN or infinite values are refused naming the tensor."""

    path = resolve_checkpoint(path)
    verified = verify_checkpoint(path, kind=TORCH_KIND, hashes=hashes)
    manifest = dict(manifest) if manifest is not None else verified
    saved = {p["name"]: p for p in manifest.get("parameters", [])}
    # A copy of a tied weight on another stage reads the weight it copies (saved under that name).
    source = {name: local.instr.canonical for name, local in session.store.params.items()}
    for name, local in session.store.params.items():
        if source[name] not in saved:
            raise CheckpointError(f"checkpoint {path} has no parameter {source[name]!r}")
        if list(saved[source[name]]["shape"]) != list(local.instr.global_shape):
            raise CheckpointError(
                f"checkpoint {path}: parameter {name!r} has shape {saved[source[name]]['shape']} there but "
                f"{list(local.instr.global_shape)} in this plan"
            )
    state_keys = set(manifest.get("optimizer", {}).get("state", []))
    targets: dict[str, GlobalChunk] = {}
    for name, local in session.store.params.items():
        shape = tuple(local.instr.global_shape)
        whole_offsets, whole_sizes = _parameter_region(local, shard=local.mode != "zero")
        targets[f"model/{source[name]}"] = GlobalChunk(
            torch.empty(whole_sizes, dtype=torch.float32), whole_offsets, shape
        )
        offsets, sizes = _parameter_region(local, shard=True)
        for key in sorted(state_keys):
            if key == "step":
                targets[f"optim/{source[name]}/step"] = GlobalChunk(torch.zeros((), dtype=torch.float32), (), ())
            else:
                targets[f"optim/{source[name]}/{key}"] = GlobalChunk(
                    torch.zeros(sizes, dtype=torch.float32), offsets, shape
                )
    targets = {k: v for k, v in targets.items() if all(v.tensor.shape) or v.tensor.dim() == 0}
    saved_ranks = int(manifest.get("rng", {}).get("ranks", 1))
    rng_len = torch.get_rng_state().numel()
    targets[_rng_key()] = GlobalChunk(
        torch.empty((1, rng_len), dtype=torch.uint8), (session.mesh.rank % saved_ranks, 0), (saved_ranks, rng_len)
    )
    _, handle = _dcp_group(session)
    reader = JsonReader(path / STATE_DIR)
    _run_guarded(
        session,
        "checkpoint:load",
        lambda: dcp.load(
            targets, storage_reader=reader, planner=ChunkLoadPlanner(), process_group=handle, no_dist=handle is None
        ),
    )
    _refuse_non_finite(path, {k: c.tensor for k, c in targets.items()})
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


def _refuse_non_finite(path: Path, tensors: Mapping[str, Any]) -> None:

    for key, t in sorted(tensors.items()):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(
                f"checkpoint {path}: {key!r} holds NaN or infinite values (in {path / STATE_DIR}); it is not loaded: "
                "resume from an earlier checkpoint"
            )


def read_global_state(path: str | Path, *, optimizer: bool = False) -> dict[str, Any]:
    """Whole tensors of a checkpoint in this process (no process group): ``{name: tensor}`` for every
    parameter, plus ``{"optim/<name>/<key>": tensor}`` with ``optimizer=True``. For inspection,
    export, and tests that compare two checkpoints."""

    path = resolve_checkpoint(path)
    manifest = verify_checkpoint(path, kind=TORCH_KIND)
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
    _refuse_non_finite(path, {k: c.tensor for k, c in wanted.items()})
    out = {fqn.removeprefix("model/"): c.tensor for fqn, c in wanted.items()}
    for tied, canonical in manifest.get("tied", {}).items():
        if canonical in out:
            out[tied] = out[canonical]
    return out

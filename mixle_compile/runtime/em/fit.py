"""EM for distribution models: one rank's fit, and the single-process reference it must equal.

Each data rank holds a contiguous block of the rows (an HMM's rows are whole sequences). Per
iteration it scores its rows under the current parameters (E-step, ``em_model.score``), sums its
sufficient statistics, all_reduces them exactly as the plan's updates say (through the counting
layer), and applies the M-step to the summed statistics, so the parameters stay identical on every
data rank. Under a tp cut each tp rank holds, scores and updates only the units it owns; the
posterior normaliser is a logsumexp across the tp group (all_reduce max, then sum), or for a
factor cut the factors' log-likelihoods add up across it (all_reduce sum). The single-process
reference runs the same model code on all rows with no collectives; the two differ only by the
order of floating-point sums.

All arithmetic is float64 (numpy); torch only carries the collectives.

Checkpoints (docs/checkpoints.md): every node's parameter arrays in global coordinates (node id,
instance row; the cut node by unit), assembled on rank 0 from the ranks that own them, with the
iteration, the log-likelihood history and the data's identity, written atomically by
``checkpoint.write_array_checkpoint``. A resume loads them on any plan of the same model.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from mixle_compile.runtime.em import model as em_model
from mixle_compile.runtime.em.model import (
    ModelError,
    Scoring,
    chunks_of,
    initial_params,
    m_step,
    score,
    zero_statistics,
)
from mixle_compile.runtime.em.plan import LOG_LIKELIHOOD, EMInstructions, StatisticsUpdate
from mixle_compile.runtime.errors import RuntimeRefusal

# The log-likelihood of an EM iteration may not fall below the previous one by more than this
# (relative): EM never decreases it in exact arithmetic, and float64 sums wobble near 1e-15.
MONOTONE_TOLERANCE = 1e-10
# The distributed fit must equal the single-process fit to this (relative, float64).
EM_TOLERANCE = 1e-9


# -- data -----------------------------------------------------------------------------------


def sample_data(em: EMInstructions) -> np.ndarray:
    """``global_batch_size`` records drawn from a random model of the spec's shape (seeded)."""
    tree = em.tree
    return em_model.sample(tree, em_model.true_params(tree, em.seed), em.global_batch_size, em.seed)


def load_data(em: EMInstructions, path: str | Path | None) -> np.ndarray:
    """The records to fit: sampled, or read from a ``.npy`` or ``.csv`` file (one record per row;
    an HMM's sequences as ``(sequences, seq_len, columns)`` or flattened step-major). Raises
    ValueError saying what is wrong with a file."""
    if path is None:
        return sample_data(em)
    p = Path(path)
    try:
        data = np.load(p, allow_pickle=False) if p.suffix == ".npy" else np.loadtxt(p, delimiter=",", ndmin=2)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read the data ({exc})") from None
    data = np.asarray(data)
    if not np.issubdtype(data.dtype, np.number):
        raise ValueError(f"{path}: expected numbers, got an array of {data.dtype}")
    width = em.tree.width
    if data.ndim == 1 and width == 1:
        data = data[:, None]
    elif data.ndim == 3:
        data = data.reshape(len(data), -1)
    if data.ndim != 2 or data.shape[1] != width:
        raise ValueError(
            f"{path}: expected records of {width} values ({_columns(em)}), got an array of shape {data.shape}"
        )
    data = data.astype(np.float64)
    try:
        em_model.check_records(em.tree, data, str(path))
    except ModelError as exc:
        raise ValueError(str(exc)) from None
    if len(data) < em.plan.data_parallel_size:
        raise ValueError(f"{path}: {len(data)} records for {em.plan.data_parallel_size} data ranks")
    per_rank = -(-len(data) // em.plan.data_parallel_size)
    if em.cut is not None and per_rank > em.micro_steps * em.micro_batch_size:
        raise ValueError(
            f"{path}: {per_rank} records per data rank do not fit {em.micro_steps} micro-batch(es) of "
            f"micro_batch_size={em.micro_batch_size}, the normaliser's planned size under the tp cut; raise "
            "micro_batch_size"
        )
    return data


def _columns(em: EMInstructions) -> str:
    return em_model.describe_columns(em.tree)


def shard_rows(data: np.ndarray, data_rank: int, data_size: int) -> np.ndarray:
    """The contiguous block of rows of one data rank (sizes differ by at most one row)."""
    return np.array_split(data, data_size)[data_rank]


def reference_fit(em: EMInstructions, data: np.ndarray, steps: int):
    """Single-process EM on all rows: (parameters, log-likelihoods, per iteration the statistics
    and, under a cut, every row's normaliser at the cut node)."""
    return em_model.reference_fit(
        em.tree,
        data,
        steps,
        seed=em.seed + 1,
        micro_batch_size=em.micro_batch_size,
        record=em.cut.path if em.cut else None,
    )


def relative_error(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(max |a - b| / max |b|, max |a - b|) over the finite entries."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return float("inf"), float("inf")
    finite = np.isfinite(b)
    if not np.array_equal(finite, np.isfinite(a)):
        return float("inf"), float("inf")
    diff = np.abs(a[finite] - b[finite])
    absolute = float(diff.max()) if diff.size else 0.0
    scale = float(np.abs(b[finite]).max()) if diff.size else 0.0
    return (absolute / scale if scale > 0 else absolute), absolute


def monotone_violations(lls: list[float]) -> list[str]:
    out = []
    for i in range(1, len(lls)):
        if lls[i] < lls[i - 1] - MONOTONE_TOLERANCE * max(1.0, abs(lls[i - 1])):
            out.append(f"the log-likelihood decreased at iteration {i}: {lls[i - 1]:.12g} -> {lls[i]:.12g}")
    return out


# -- one rank -------------------------------------------------------------------------------


class FitDiverged(RuntimeError):
    """The log-likelihood became NaN or infinite: the fit stops at that iteration and fails."""


def local_statistics(em: EMInstructions, su: StatisticsUpdate, stats: np.ndarray, tp_coord: int) -> np.ndarray:
    """The rows of a node's statistics this rank sends for ``su``, flattened (unpadded)."""
    rows = su.rows(tp_coord, em.cut, stats.shape[0])
    if su.role == "cut":
        return stats[0, rows].copy()
    return stats[rows].ravel().copy()


def _store(em: EMInstructions, su: StatisticsUpdate, stats: np.ndarray, tp_coord: int, values: np.ndarray) -> None:
    rows = su.rows(tp_coord, em.cut, stats.shape[0])
    if su.role == "cut":
        stats[0, rows] = values
    else:
        stats[rows] = values.reshape(len(rows), -1)


def not_owned(em: EMInstructions, tp_coord: int):
    """``keep`` for the M-step: per node, the entries another tp rank owns (None: all are ours)."""
    if em.cut is None:
        return lambda node_id: None
    owned = set(em.owned(tp_coord))
    units = len(em.cut.owners)
    masks: dict[str, np.ndarray] = {}
    for node_id, (role, owner) in em.roles.items():
        node = em.tree.nodes[node_id]
        if role == "cut":
            masks[node_id] = np.array([[u not in owned for u in range(units)]])
        elif role == "sharded":
            per = node.instances // units
            masks[node_id] = np.array([(i // per) not in owned for i in range(node.instances)])
        elif role == "owned":
            masks[node_id] = np.full(node.instances, owner != tp_coord)
    return masks.get


def combine_over_cut(em: EMInstructions, comm, rule: dict[str, str]):
    """``Scoring.combine`` under a tp cut, over every tp rank's units: for a mixture cut, from this
    rank's log-joints ``a`` (rows x its units), each row's max and sum of exponentials across the
    group (all_reduce max, then sum); for a factor cut, from the rows' sum of this rank's factors,
    (0, the sum over every rank's factors) (all_reduce sum). Rows are padded to micro_batch_size,
    the planned size of the normaliser's collectives."""
    import torch
    import torch.distributed as dist

    cut, width = em.cut, em.micro_batch_size

    def padded(values: np.ndarray) -> torch.Tensor:
        t = torch.zeros(width, dtype=torch.float64)
        t[: len(values)] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64))
        return t

    def combine(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = len(a)
        if cut.axis == "factor":
            total = padded(a)
            comm.all_reduce(total, rule=rule[cut.normaliser_sum], parts=cut.normaliser_sum)
            return np.zeros(n), total[:n].numpy().copy()
        top = padded(a.max(axis=1) if a.shape[1] else np.full(n, -np.inf))
        # all_reduce MAX through the counting layer (checked against the plan, then counted).
        comm.issue_planned(
            "all_reduce",
            rule[cut.normaliser_max],
            comm.planned_parts(cut.normaliser_max, top.numel() * 8),
            lambda g, async_op: dist.all_reduce(top, op=dist.ReduceOp.MAX, group=g, async_op=async_op),
        )
        m = top[:n].numpy().copy()
        with np.errstate(invalid="ignore"):
            total = padded(np.exp(a - m[:, None]).sum(axis=1))
        comm.all_reduce(total, rule=rule[cut.normaliser_sum], parts=cut.normaliser_sum)
        return m, total[:n].numpy().copy()

    return combine


def fit_rank(
    em: EMInstructions,
    comm,
    mesh,
    data: np.ndarray,
    steps: int,
    *,
    receipts=None,
    progress: bool = False,
    start: tuple[int, dict] | None = None,
    after_iteration=None,
) -> dict:
    """EM on this rank's rows and units, iterations ``first .. steps - 1``. Returns this rank's
    record: its tp coordinate and units, its parameters, the log-likelihoods, and per iteration the
    reduced statistics of every update it issued and (under a cut) each row's normaliser.

    ``start``: ``(iteration, parameters)`` of a checkpoint to continue from (default: iteration 0
    from the seeded initial parameters). ``after_iteration(done, params, lls)`` runs on every rank
    after each M-step (``done`` iterations are complete); checkpoints are saved there."""
    import torch

    data_size, data_rank = mesh.data_parallel_size, mesh.data_rank
    local = shard_rows(data, data_rank, data_size)
    rows = len(data)
    cut = em.cut
    tp = mesh.coord("tp") if cut else 0
    owned = em.owned(tp)
    if start is None:
        first, params = 0, initial_params(em.tree, data, em.seed + 1)
    else:
        first, params = start[0], {n: {k: v.copy() for k, v in arrays.items()} for n, arrays in start[1].items()}
    rule = {c.node_id: c.rule for c in em.collectives.values()}
    keep = not_owned(em, tp)
    statistics = {su.update: su for su in em.statistics}
    if cut is not None:
        chunks = np.array_split(local, em.micro_steps)
        combine = combine_over_cut(em, comm, rule)
    else:
        chunks = chunks_of(local, em.micro_batch_size)
        combine = None  # one process holds every unit: the normaliser is local

    planned_bytes = sum(
        c.payload_bytes * c.occurrences_per_step for n, c in em.collectives.items() if em.executes(n, tp)
    )
    lls, history = [], []
    started = time.perf_counter()
    for it in range(first, steps):
        before = comm.ledger.snapshot()
        sc = Scoring(
            params,
            zero_statistics(em.tree),
            cut=cut.path if cut else None,
            owned=owned,
            combine=combine,
            record=cut.path if cut else None,
        )
        ll = 0.0
        for xb in chunks:
            lp, acc = score(em.tree, em.tree.root, 0, xb, sc)
            acc(np.ones(len(xb)))
            ll += float(lp.sum())
        reduced = {}
        for node_id in em.collectives:
            su = statistics.get(node_id)
            if su is not None and su.executes(tp):
                values = local_statistics(em, su, sc.stats[su.node], tp)
                if len(values) > su.elements:
                    raise ValueError(
                        f"{node_id}: this rank holds {len(values)} statistics, more than the plan's {su.elements}"
                    )
                t = torch.zeros(su.elements, dtype=torch.float64)
                t[: len(values)] = torch.from_numpy(values)
                comm.all_reduce(t, rule=rule[node_id], parts=node_id)
                values = t[: len(values)].numpy().copy()
                _store(em, su, sc.stats[su.node], tp, values)
                reduced[node_id] = values
        if LOG_LIKELIHOOD in rule:
            t = torch.tensor([ll], dtype=torch.float64)
            comm.all_reduce(t, rule=rule[LOG_LIKELIHOOD], parts=LOG_LIKELIHOOD)
            ll = float(t.item())
        if not math.isfinite(ll):
            # Reduced over every data rank (or the same rows everywhere): every rank stops at this iteration.
            raise FitDiverged(
                f"the fit diverged: the log-likelihood of iteration {it + 1} is {ll} (every later iteration "
                "would fit on it); "
                "check the records for extreme values, or the model for a component that lost all its rows"
            )
        entry = {"statistics": reduced}
        if cut is not None:
            entry["max"], entry["sum"] = np.concatenate(sc.maxes), np.concatenate(sc.sums)
        history.append(entry)
        lls.append(ll)
        params = m_step(em.tree, params, sc.stats, keep=keep, totals={cut.path: rows} if cut is not None else None)
        after = comm.ledger.snapshot()
        observed = sum(after[k][1] - before.get(k, (0, 0))[1] for k in after)
        if receipts is not None:
            receipts.write(
                json.dumps(
                    {
                        "iteration": it,
                        "log_likelihood": ll,
                        "examples": rows,
                        "local_examples": len(local),
                        "collective_bytes": observed,
                        "planned_collective_bytes": planned_bytes,
                        "wall_s": time.perf_counter() - started,
                    },
                    sort_keys=True,
                )
                + "\n"
            )
            receipts.flush()
        if progress:
            print(
                f"iteration {it + 1}/{steps}  log-likelihood {ll:.6f}  {time.perf_counter() - started:.1f} s",
                file=sys.stderr,
                flush=True,
            )
        if after_iteration is not None:
            after_iteration(it + 1, params, lls)
    return {
        "tp": tp,
        "owned": list(owned),
        "data_rank": data_rank,
        "data_size": data_size,
        "params": params,
        "lls": lls,
        "history": history,
        "first": first,
        "wall_s": time.perf_counter() - started,
    }


def assemble(em: EMInstructions, records: list[dict]):
    """The whole model from every rank's own units."""
    whole = {n: {k: v.copy() for k, v in arrays.items()} for n, arrays in records[0]["params"].items()}
    for rec in records:
        keep = not_owned(em, rec["tp"])
        for node_id, arrays in rec["params"].items():
            mask = keep(node_id)
            if mask is None:
                continue
            for name, a in arrays.items():
                whole[node_id][name][~mask] = a[~mask]
    return whole


def flat_params(params) -> dict[str, np.ndarray]:
    return {f"{node}/{name}": a for node, arrays in params.items() for name, a in arrays.items()}


def fit_error(params, ref_params) -> float:
    """Max relative error of the fitted parameters against the single-process fit."""
    ref = flat_params(ref_params)
    return max((relative_error(a, ref[name])[0] for name, a in flat_params(params).items()), default=0.0)


def em_accounting(em: EMInstructions, ledgers, steps: int, tp_coords: list[int] | None = None) -> dict:
    """Planned == observed, count and bytes, per update on every rank (zero where a rank does
    not own the update's unit)."""
    tp_coords = tp_coords or [0] * len(ledgers)
    rows, errors = [], []
    for node_id, c in em.collectives.items():
        planned_count = c.occurrences_per_step * steps
        expected = em.expected_bytes(c) * planned_count
        observed = [tuple(lg["updates"].get(node_id, (0, 0))) for lg in ledgers]
        wanted = [(planned_count, expected) if em.executes(node_id, tp) else (0, 0) for tp in tp_coords]
        bad = [r for r, (o, w) in enumerate(zip(observed, wanted, strict=True)) if o != w]
        if bad:
            r = bad[0]
            errors.append(
                f"{node_id}: planned {wanted[r][0]} x {c.collective} ({wanted[r][1]} bytes) on rank {r} over {steps} "
                f"iteration(s), observed {observed[r][0]} ({observed[r][1]} bytes)"
            )
        rows.append(
            {
                "node_id": node_id,
                "collective": c.collective,
                "group": c.rule,
                "phase": c.phase,
                "planned_count": planned_count,
                "planned_bytes": expected,
                "ranks_executing": sum(1 for w in wanted if w[0]),
                "observed_count": sorted({o[0] for o, w in zip(observed, wanted, strict=True) if w[0]}),
                "observed_bytes": sorted({o[1] for o, w in zip(observed, wanted, strict=True) if w[0]}),
                "match": not bad,
            }
        )
    for r, lg in enumerate(ledgers):
        for node_id in sorted(set(lg["updates"]) - set(em.collectives)):
            errors.append(f"{node_id}: rank {r} issued a collective the plan does not declare")
    return {
        "ok": not errors,
        "errors": errors,
        "updates": rows,
        "updates_checked": len(rows),
        "ranks_checked": len(ledgers),
        "collective_calls_per_rank": [lg["calls"] for lg in ledgers],
        "bytes_note": "EM statistics, normalisers and log-likelihoods travel in float64, as the plan sizes them",
    }


def evidence(
    doc, em: EMInstructions, records: list[dict], repeat: list[dict], ref, steps: int
) -> tuple[list[dict], list[str]]:
    """Each update's numerical evidence: what every rank reduced, every iteration, against the
    single-process values (``records``, ``repeat``: every rank's record of the fit and its repeat)."""
    from mixle_compile.contracts import DistributedUpdate

    ref_params, ref_lls, ref_history = ref
    run_id = f"em-{em.content_digest.removeprefix('sha256:')[:12]}-{steps}"
    statistics = {su.update: su for su in em.statistics}
    cut = em.cut

    def pair(node_id: str, rec: dict, it: int) -> tuple[np.ndarray, np.ndarray] | None:
        h, r = rec["history"][it], ref_history[it]
        if node_id == LOG_LIKELIHOOD:
            return np.array([rec["lls"][it]]), np.array([ref_lls[it]])
        if cut is not None and node_id in (cut.normaliser_max, cut.normaliser_sum):
            key = "max" if node_id == cut.normaliser_max else "sum"
            return h[key], shard_rows(r[key], rec["data_rank"], rec["data_size"])
        su = statistics[node_id]
        if node_id not in h["statistics"]:
            return None
        return h["statistics"][node_id], local_statistics(em, su, r[su.node], rec["tp"])

    out, errors = [], []
    for u in doc.updates:
        fields = DistributedUpdate.from_dict(u.update_fields()).as_dict()
        rel = ab = 0.0
        samples = 0
        same = True
        for rec, again in zip(records, repeat, strict=True):
            for it in range(steps):
                got = pair(u.node_id, rec, it)
                if got is None:
                    continue
                mine, theirs = got
                r, x = relative_error(mine, theirs)
                rel, ab, samples = max(rel, r), max(ab, x), samples + int(np.size(mine))
                same = same and np.array_equal(mine, pair(u.node_id, again, it)[0])
        fields.update(
            maximum_relative_error=rel,
            maximum_absolute_error=ab,
            numerics_sample_count=samples,
            numerics_evidence_id=f"{run_id}/{u.node_id}",
            determinism_observed=same,
        )
        out.append(DistributedUpdate.from_dict(fields).as_dict())
    fitted = flat_params(assemble(em, records))
    reference = flat_params(ref_params)
    for name, a in fitted.items():
        r, _ = relative_error(a, reference[name])
        if r > EM_TOLERANCE:
            errors.append(
                f"fitted {name}: relative error {r:.2e} against the single-process fit exceeds {EM_TOLERANCE:.0e}"
            )
    for d in out:
        if d["maximum_relative_error"] > EM_TOLERANCE:
            errors.append(
                f"{d['node_id']}: relative error {d['maximum_relative_error']:.2e} exceeds {EM_TOLERANCE:.0e}"
            )
        if d["numerics_sample_count"] == 0:
            errors.append(f"{d['node_id']}: no rank recorded a value to compare")
    return out, errors


# -- checkpoints ----------------------------------------------------------------------------

EM_RUNTIME = "em"  # manifest["runtime"] of an EM checkpoint


def records_digest(data: np.ndarray) -> str:
    """SHA-256 of the records as fitted (their shape, then float64 little-endian, row-major)."""
    a = np.ascontiguousarray(data, dtype="<f8")
    h = hashlib.sha256(json.dumps(list(a.shape)).encode("ascii"))
    h.update(a.tobytes())
    return "sha256:" + h.hexdigest()


def data_source(em: EMInstructions, data: np.ndarray, data_path: str | Path | None) -> dict:
    """How a checkpoint names the records it was fitted on (compared on resume): the synthetic seed
    and row count, or the file's path, size and the digest of its records."""
    if data_path is None:
        return {"kind": "synthetic", "seed": em.seed, "rows": int(len(data))}
    path = Path(data_path)
    try:
        size = path.stat().st_size
    except OSError:
        size = None
    return {
        "kind": "file",
        "name": path.name,
        "path": str(data_path),
        "bytes": size,
        "rows": int(len(data)),
        "records_sha256": records_digest(data),
    }


def _describe_data(source: dict) -> str:
    if source.get("kind") == "synthetic":
        return f"{source.get('rows')} synthetic records with seed {source.get('seed')}"
    digest = str(source.get("records_sha256", "?"))
    return f"{source.get('rows')} records of {source.get('path') or source.get('name')} ({digest[:19]})"


def _same_data(saved: dict, new: dict) -> bool:
    if saved.get("kind") != new.get("kind") or saved.get("rows") != new.get("rows"):
        return False
    if new.get("kind") == "synthetic":
        return saved.get("seed") == new.get("seed")
    return saved.get("records_sha256") == new.get("records_sha256")


def model_summary(em: EMInstructions) -> dict:
    """The model as a checkpoint records it: every node's kind, instances and parameter shapes."""
    shapes = em_model.param_shapes(em.tree)
    return {
        "seq_len": em.tree.seq_len,
        "nodes": [
            {
                "id": n.id,
                "kind": n.kind,
                "instances": n.instances,
                "parameters": {k: list(v) for k, v in shapes.get(n.id, {}).items()},
            }
            for n in em.tree.nodes.values()
        ],
    }


def plan_summary(em: EMInstructions) -> dict:
    plan = em.plan
    return {
        "content_digest": em.content_digest,
        "family": "distribution",
        "optimizer": "em",
        "precision": "float64",
        "global_batch_size": em.global_batch_size,
        "micro_batch_size": em.micro_batch_size,
        "seq_len": em.tree.seq_len,
        "seed": em.seed,
        "factorisation": plan.factorisation(),
        "degrees": plan.as_dict(),
    }


def write_em_checkpoint(
    root: str | Path,
    iteration: int,
    em: EMInstructions,
    params,
    lls: list[float],
    source: dict,
    *,
    run_id: str | None = None,
) -> Path:
    """Save the whole model after ``iteration`` iterations (``params`` in global coordinates, as
    ``assemble`` returns them; ``lls`` every iteration's log-likelihood so far). Single process."""
    from mixle_compile.runtime import checkpoint as ckpt

    if len(lls) != iteration:
        raise ckpt.CheckpointError(
            f"an EM checkpoint after {iteration} iteration(s) needs {iteration} log-likelihoods, got {len(lls)}"
        )
    rows = int(source["rows"])
    manifest = {
        "runtime": EM_RUNTIME,
        "plan": plan_summary(em),
        "mesh": ckpt.mesh_summary(em),
        "model": model_summary(em),
        "fit": {
            "iteration": iteration,
            "log_likelihoods": [float(x) for x in lls],
            "cut": None
            if em.cut is None
            else {"path": em.cut.path, "axis": em.cut.axis, "owners": list(em.cut.owners)},
        },
        # Every iteration fits all records: the data position is the iteration count.
        "data": {
            "samples_consumed": iteration * rows,
            "global_batch_size": rows,
            "seq_len": em.tree.seq_len,
            "source": dict(source),
        },
    }
    return ckpt.write_array_checkpoint(root, iteration, flat_params(params), manifest, run_id=run_id)


def check_em_resume(manifest: dict, em: EMInstructions, *, source: dict, steps: int, path: str | Path) -> int:
    """Refuse a plan that cannot continue ``manifest``'s fit; return the iteration to continue from.

    Any mesh of the same model resumes (other data ranks, another cut or none, another world size,
    micro-batches). Refused: another runtime's checkpoint, another model (a node added, removed, of
    another kind, or a parameter of another shape: the message names the node and both shapes),
    other records, ``steps`` not beyond the checkpoint, or a manifest that does not hold its arrays."""
    from mixle_compile.runtime.checkpoint import CheckpointError

    try:
        return _check_em_resume(manifest, em, source=source, steps=steps, path=path)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(
            f"checkpoint {path}: its manifest is malformed ({type(exc).__name__}: {exc}); it cannot be resumed"
        ) from None


def _check_em_resume(manifest: dict, em: EMInstructions, *, source: dict, steps: int, path: str | Path) -> int:
    from mixle_compile.runtime.checkpoint import ARRAYS_KIND, CheckpointError, names_only_in_one

    where = f"checkpoint {path}"
    if manifest.get("kind") != ARRAYS_KIND or manifest.get("runtime") != EM_RUNTIME:
        raise CheckpointError(
            f"{where} holds {manifest.get('runtime') or manifest.get('kind')!r} state, not an EM fit; "
            "a distribution model resumes from the checkpoints of an EM run only"
        )
    saved_model = manifest["model"]
    saved = {n["id"]: n for n in saved_model["nodes"]}
    fit = manifest["fit"]
    iteration, lls = int(fit["iteration"]), list(fit["log_likelihoods"])
    arrays = manifest["arrays"]
    saved_source = dict(manifest["data"]["source"])
    new_model = model_summary(em)
    new = {n["id"]: n for n in new_model["nodes"]}
    problems = []
    if saved_model.get("seq_len") != new_model["seq_len"]:
        problems.append(
            f"training.seq_len is {saved_model.get('seq_len')} in the checkpoint but {new_model['seq_len']} in "
            "this plan"
        )
    for node_id in [n for n in new if n in saved]:
        a, b = saved[node_id], new[node_id]
        if a.get("kind") != b["kind"]:
            problems.append(f"node {node_id!r} is a {a.get('kind')} in the checkpoint but a {b['kind']} in this plan")
            continue
        for name in sorted(set(a.get("parameters", {})) | set(b["parameters"])):
            old_shape, new_shape = a.get("parameters", {}).get(name), b["parameters"].get(name)
            if old_shape != new_shape:
                problems.append(
                    f"node {node_id!r} has {name} of shape {old_shape} in the checkpoint but {new_shape} in this plan"
                )
    problems += names_only_in_one("node", list(new), list(saved))
    if problems:
        raise CheckpointError(
            f"{where} is of a different model: " + "; ".join(problems) + ". Resume with the spec it was fitted with"
        )
    for node_id, node in new.items():
        for name, shape in node["parameters"].items():
            entry = arrays.get(f"{node_id}/{name}") if isinstance(arrays, dict) else None
            if entry is None or list(entry.get("shape", ())) != shape:
                raise CheckpointError(
                    f"{where}: the manifest lists no array {node_id}/{name} of shape {shape}; the checkpoint "
                    "is incomplete"
                )
    if not _same_data(saved_source, source):
        raise CheckpointError(
            f"{where} was fitted on {_describe_data(saved_source)}, this run reads {_describe_data(source)}; "
            "resuming on other "
            "records would not continue the same fit: pass the same --data (or training.seed and global_batch_size)"
        )
    if len(lls) != iteration or iteration < 1:
        raise CheckpointError(
            f"{where}: {len(lls)} log-likelihoods recorded for {iteration} iteration(s); the manifest is inconsistent"
        )
    if steps <= iteration:
        raise CheckpointError(
            f"{where} is at iteration {iteration}; --steps {steps} leaves nothing to run: pass --steps greater than "
            f"{iteration} (the total, counting the iterations already done)"
        )
    return iteration


def load_em_checkpoint(
    path: str | Path, em: EMInstructions, *, source: dict, steps: int
) -> tuple[dict, int, dict, Path]:
    """``(manifest, iteration, parameters, step directory)`` of a checkpoint this plan may resume
    (``path``: a step directory, or a root for its latest complete one); refused as ``check_em_resume`` says."""
    from mixle_compile.runtime import checkpoint as ckpt

    path = ckpt.resolve_checkpoint(path)
    iteration = check_em_resume(ckpt.read_manifest(path), em, source=source, steps=steps, path=path)
    manifest, arrays = ckpt.read_array_checkpoint(path)  # every file against its seal
    params = {
        node_id: {name: np.array(arrays[f"{node_id}/{name}"], dtype=np.float64) for name in names}
        for node_id, names in em_model.param_shapes(em.tree).items()
    }
    return manifest, iteration, params, path


def run_options(
    em: EMInstructions,
    *,
    steps: int,
    reference: bool = False,
    data_path: str | Path | None = None,
    save_every: int | None = None,
    checkpoint_dir: str | Path | None = None,
    keep: int | None = None,
    resume: str | Path | None = None,
):
    """Check an EM run before any process starts (torch-free): the ``--data`` file's records and
    the checkpoint options, a resume against this plan. Returns the ``checkpoint.CheckpointOptions``
    (``resume``: the step directory); raises RuntimeRefusal saying what is wrong."""
    import dataclasses

    from mixle_compile.runtime import checkpoint as ckpt

    options = ckpt.CheckpointOptions.checked(save_every=save_every, checkpoint_dir=checkpoint_dir, keep=keep)
    if data_path is None and resume is None:
        return options
    try:
        data = load_data(em, data_path)
    except ValueError as exc:
        raise RuntimeRefusal(str(exc)) from None
    if resume is not None:
        if reference:
            raise RuntimeRefusal(
                "--reference fits the single-process reference from the initial parameters, so it cannot check "
                "a resumed "
                "fit; drop --reference or --resume"
            )
        path = ckpt.resolve_checkpoint(resume)
        check_em_resume(ckpt.read_manifest(path), em, source=data_source(em, data, data_path), steps=steps, path=path)
        ckpt.verify_checkpoint(path)  # every file against its seal, before any rank starts
        options = dataclasses.replace(options, resume=path.resolve())
    return options


class EMRank:
    """One rank of an EM fit, the steps ``rank.run_job`` calls (see ``worker.run_rank``).

    ``checkpoints`` (a ``checkpoint.CheckpointOptions``): save the whole model every ``every``
    iterations and after the last one into ``root``, keeping the ``keep`` newest; start from the
    checkpoint ``resume``. ``steps`` is the total: a fit resumed after iteration k runs iterations
    k .. steps - 1."""

    def __init__(
        self, doc, *, steps: int, out_dir: Path, reference: bool, data_path: str | None, progress: bool, checkpoints
    ) -> None:
        self.doc, self.steps, self.out_dir, self.reference, self.data_path = doc, steps, out_dir, reference, data_path
        self.progress, self.checkpoints = progress, checkpoints
        self.every = checkpoints.every if checkpoints.saves else None
        self.comm = None
        self.start = self.resumed = None
        self.before: list[float] = []  # the log-likelihoods of the iterations before a resume
        self.saved: list[dict] = []
        self.repeat_ledgers = self.repeat = None

    def prepare(self) -> int:
        from mixle_compile.runtime.em.plan import read_em_instructions

        em = self.em = read_em_instructions(self.doc)
        self.data = load_data(em, self.data_path)
        self.source = data_source(em, self.data, self.data_path)
        if self.checkpoints.resume is not None:
            if self.reference:
                raise RuntimeRefusal(
                    "--reference fits the single-process reference from the initial parameters; it cannot "
                    "check a resumed fit"
                )
            t0 = time.perf_counter()
            manifest, first, params0, path = load_em_checkpoint(
                self.checkpoints.resume, em, source=self.source, steps=self.steps
            )
            self.start, self.before = (first, params0), list(manifest["fit"]["log_likelihoods"])
            self.resumed = {
                "path": str(path),
                "step": first,
                "plan_digest": manifest["plan"]["content_digest"],
                "mesh": manifest["mesh"],
                "load_s": time.perf_counter() - t0,
            }
        return em.plan.world_size

    def open(self, mesh) -> None:
        from mixle_compile.runtime.collectives import Collectives, Ledger

        self.mesh, self.rank = mesh, mesh.rank
        self.comm = Collectives(mesh, Ledger(planned=self.em.collectives))
        self.tp_coord = mesh.coord("tp") if self.em.cut else 0

    def save(self, done: int, params, lls: list[float]) -> None:
        """After each iteration (every rank): the checkpoint, when one is due."""
        em, comm, checkpoints = self.em, self.comm, self.checkpoints
        if not self.every or (done % self.every and done != self.steps):
            return
        from mixle_compile.runtime.checkpoint import prune_checkpoints

        t0 = time.perf_counter()
        # Under a cut each rank holds its own units: rank 0 assembles them in global coordinates.
        parts = comm.bookkeeping_gather_object(
            {"tp": self.tp_coord, "params": params} if em.cut else None, name="checkpoint:gather"
        )
        if self.rank == 0:
            whole = assemble(em, parts) if em.cut else params
            path = write_em_checkpoint(
                checkpoints.root, done, em, whole, self.before + lls, self.source, run_id=checkpoints.run_id
            )
            self.saved.append({"step": done, "path": str(path), "save_s": time.perf_counter() - t0})
            if checkpoints.keep:
                prune_checkpoints(checkpoints.root, checkpoints.keep, run_id=checkpoints.run_id)
        comm.barrier("checkpoint:committed")

    def train(self, receipts) -> None:
        self.record = fit_rank(
            self.em,
            self.comm,
            self.mesh,
            self.data,
            self.steps,
            receipts=receipts,
            progress=self.progress and self.rank == 0,
            start=self.start,
            after_iteration=self.save,
        )

    def gather(self, ledgers: list | None) -> None:
        from mixle_compile.runtime.collectives import Collectives, Ledger

        self.ledgers = ledgers
        self.records = self.comm.bookkeeping_gather_object(self.record, name="report:fit")
        if self.reference:
            # The repeat: the same fit from the same start, for determinism.
            comm2 = Collectives(self.mesh, Ledger(planned=self.em.collectives))
            again = fit_rank(self.em, comm2, self.mesh, self.data, self.steps)
            self.repeat_ledgers = comm2.bookkeeping_gather_object(comm2.ledger.as_dict(), name="report:ledgers")
            self.repeat = comm2.bookkeeping_gather_object(again, name="report:fit")

    def close(self) -> None:
        self.comm = None

    def report(self, train_s: float) -> dict:
        import torch

        from mixle_compile.runtime.report import RECEIPTS_FILE

        em, data, steps, records, ledgers = self.em, self.data, self.steps, self.records, self.ledgers
        lls = self.record["lls"]
        first = self.record["first"]
        ran = steps - first
        history = self.before + lls
        account = em_accounting(em, ledgers, ran, [rec["tp"] for rec in records])
        errors = list(account["errors"]) + monotone_violations(history)
        if any(rec["lls"] != lls for rec in records):
            errors.append("the ranks disagree on the log-likelihood")
        if self.repeat_ledgers is not None and [lg["updates"] for lg in self.repeat_ledgers] != [
            lg["updates"] for lg in ledgers
        ]:
            errors.append("the repeated fit issued different collectives from the first")
        root = self.checkpoints.root
        report = {
            "ok": False,
            "errors": errors,
            "warnings": []
            if em.precision in ("fp32", "fp64")
            else [f"training.precision={em.precision!r}: EM runs in float64 regardless"],
            "plan": {
                "content_digest": em.content_digest,
                "world_size": em.plan.world_size,
                "factorisation": em.plan.factorisation(),
                "degrees": em.plan.as_dict(),
                "family": "distribution",
                "precision": "float64",
                "optimizer": "em",
            },
            "run": {
                "steps": ran,
                "first_step": first,
                "last_step": steps,
                "resumed_from": self.resumed,
                "checkpoints": {
                    "root": str(root) if root is not None else None,
                    "every": self.every,
                    "saved": self.saved,
                },
                "train_s": train_s,
                "wall_s": train_s,
                "fit_s": max(rec["wall_s"] for rec in records),
                "data": str(self.data_path) if self.data_path else "synthetic",
                "torch": torch.__version__,
                "rows": int(len(data)),
                "model": em.describe(),
                "cut": None
                if em.cut is None
                else {"path": em.cut.path, "axis": em.cut.axis, "owners": list(em.cut.owners)},
            },
            # `losses` keeps the neural report's shape: the negative mean log-likelihood per row.
            "losses": [-ll / len(data) for ll in lls],
            "log_likelihoods": lls,
            # Every iteration's log-likelihood from the first, those before a resume included.
            "log_likelihood_history": history,
            "log_likelihood_monotone": not monotone_violations(history),
            "accounting": account,
            "evidence": None,
            "receipts": RECEIPTS_FILE,
        }
        if self.reference:
            ref = reference_fit(em, data, steps)
            updates, ev_errors = evidence(self.doc, em, records, self.repeat, ref, steps)
            report["errors"] += ev_errors
            if any(u["determinism_observed"] is False for u in updates):
                report["errors"].append("the repeated fit reduced different values from the first")
            report["evidence"] = {
                "tolerance": EM_TOLERANCE,
                "run_id": f"em-{em.content_digest.removeprefix('sha256:')[:12]}-{steps}",
                "updates": updates,
                "fit_max_relative_error": fit_error(assemble(em, records), ref[0]),
                "reference_log_likelihoods": ref[1],
            }
        report["ok"] = not report["errors"]
        return report

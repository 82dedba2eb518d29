"""EM for distribution models: one rank's fit, and the single-process reference it must equal.

Each data rank holds a contiguous block of the rows. Per iteration it scores its rows under the
current parameters (E-step), sums its sufficient statistics, all_reduces them over the data axes
exactly as the plan's updates say (through the counting layer), and every rank applies the same
M-step to the same summed statistics, so the parameters stay identical on every data rank. Under a
component cut each tp rank holds, scores and updates only the components it owns, and the
posterior normaliser is a logsumexp across the tp group (all_reduce max, then sum). The
single-process reference runs the same code on all rows with no collectives; the two differ only
by the order of floating-point sums.

All arithmetic is float64 (numpy); torch only carries the collectives.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mixle_compile.runtime.em_plan import LOG_LIKELIHOOD, NORMALISER_MAX, NORMALISER_SUM, ROOT, EMInstructions

LOG_2PI = float(np.log(2.0 * np.pi))
# The log-likelihood of an EM iteration may not fall below the previous one by more than this
# (relative): EM never decreases it in exact arithmetic, and float64 sums wobble near 1e-15.
MONOTONE_TOLERANCE = 1e-10
# The distributed fit must equal the single-process fit to this (relative, float64).
EM_TOLERANCE = 1e-9


# -- data -----------------------------------------------------------------------------------


def sample_data(em: EMInstructions) -> np.ndarray:
    """``global_batch_size`` rows drawn from a random mixture of the spec's shape (seeded)."""
    rng = np.random.default_rng(em.seed)
    n, k = em.global_batch_size, em.num_components
    weights = rng.dirichlet(np.full(k, 2.0))
    labels = rng.choice(k, size=n, p=weights)
    if em.kind == "categorical":
        probs = rng.dirichlet(np.full(em.num_values, 0.5), size=k)
        u = rng.random(n)
        cdf = np.cumsum(probs[labels], axis=1)
        return np.minimum((u[:, None] > cdf).sum(axis=1), em.num_values - 1).astype(np.int64)
    d = em.dim
    means = rng.normal(0.0, 4.0, size=(k, d))
    scales = rng.uniform(0.5, 1.5, size=(k, d))
    x = rng.normal(size=(n, d)) * scales[labels]
    if em.covariance == "full":
        mixing = np.eye(d) + 0.3 * rng.normal(size=(k, d, d))
        x = np.einsum("nij,nj->ni", mixing[labels], x)
    return x + means[labels]


def load_data(em: EMInstructions, path: str | None) -> np.ndarray:
    if path is None:
        return sample_data(em)
    p = Path(path)
    data = np.load(p, allow_pickle=False) if p.suffix == ".npy" else np.loadtxt(p, delimiter=",", ndmin=2)
    if em.kind == "categorical":
        data = np.asarray(data).reshape(-1)
        if not np.all(np.equal(np.mod(data, 1), 0)) or data.min() < 0 or data.max() >= em.num_values:
            raise ValueError(f"{path}: categorical data must be integers in [0, {em.num_values})")
        return data.astype(np.int64)
    data = np.asarray(data, dtype=np.float64)
    if data.ndim == 1 and em.dim == 1:
        data = data[:, None]
    if data.ndim != 2 or data.shape[1] != em.dim:
        raise ValueError(f"{path}: expected rows of {em.dim} values, got an array of shape {data.shape}")
    return data


def shard_rows(data: np.ndarray, data_rank: int, data_size: int) -> np.ndarray:
    """The contiguous block of rows of one data rank (sizes differ by at most one row)."""
    return np.array_split(data, data_size)[data_rank]


# -- the model ------------------------------------------------------------------------------


@dataclass
class Params:
    weights: np.ndarray  # (K,)
    means: np.ndarray | None = None  # (K, d)
    covs: np.ndarray | None = None  # (K, d, d) full, (K, d) diag
    probs: np.ndarray | None = None  # (K, V) categorical

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    def subset(self, components: list[int]) -> Params:
        return Params(**{k: v[components].copy() for k, v in self.arrays().items()})


def initial_params(em: EMInstructions, data: np.ndarray) -> Params:
    """The same start on every rank: seeded, from the whole data set."""
    rng = np.random.default_rng(em.seed + 1)
    k = em.num_components
    weights = np.full(k, 1.0 / k)
    if em.kind == "categorical":
        return Params(weights, probs=rng.dirichlet(np.full(em.num_values, 5.0), size=k))
    picks = rng.choice(len(data), size=k, replace=len(data) < k)
    var = data.var(axis=0) + 1e-6
    covs = np.tile(np.diag(var), (k, 1, 1)) if em.covariance == "full" else np.tile(var, (k, 1))
    return Params(weights, means=data[picks].astype(np.float64).copy(), covs=covs)


def component_log_density(em: EMInstructions, p: Params, x: np.ndarray) -> np.ndarray:
    """log p(x_n | component k), shape (n, K)."""
    if em.kind == "categorical":
        with np.errstate(divide="ignore"):
            return np.log(p.probs[:, x].T)
    d = em.dim
    if em.covariance == "diag":
        diff = x[:, None, :] - p.means[None]
        return -0.5 * (d * LOG_2PI + np.log(p.covs).sum(axis=1)[None] + (diff * diff / p.covs[None]).sum(axis=2))
    out = np.empty((len(x), len(p.weights)))
    for k in range(len(p.weights)):
        chol = np.linalg.cholesky(p.covs[k])
        z = np.linalg.solve(chol, (x - p.means[k]).T)
        out[:, k] = -0.5 * (d * LOG_2PI + 2.0 * np.log(np.diag(chol)).sum() + (z * z).sum(axis=0))
    return out


def e_step(em: EMInstructions, p: Params, x: np.ndarray, *, chunks: list[np.ndarray] | None = None, normalise=None,
           record: bool = False) -> tuple[dict[str, np.ndarray], float]:
    """Statistics of the components in ``p`` over the rows ``x``, and the log-likelihood.

    ``normalise(a)`` returns (max, sum of exponentials) per row over every component, given this
    rank's log-joints ``a``; default: over ``p``'s components. ``chunks``: the micro-batches
    (default: ``micro_batch_size`` rows each). ``record`` keeps each row's max and sum.
    """
    k = len(p.weights)
    counts = np.zeros(k)
    if em.kind == "categorical":
        comp = np.zeros((k, em.num_values))
    elif em.covariance == "full":
        comp = np.zeros((k, em.dim + em.dim * em.dim))
    else:
        comp = np.zeros((k, 2 * em.dim))
    ll = 0.0
    if chunks is None:
        step = max(1, em.micro_batch_size)
        chunks = [x[start : start + step] for start in range(0, len(x), step)]
    with np.errstate(divide="ignore"):
        log_w = np.log(p.weights)
    maxes, sums = [], []
    for xb in chunks:
        a = component_log_density(em, p, xb) + log_w[None]
        if normalise is None:
            m = a.max(axis=1)
            total = np.exp(a - m[:, None]).sum(axis=1)
        else:
            m, total = normalise(a)
        if record:
            maxes.append(m)
            sums.append(total)
        lse = m + np.log(total)
        r = np.exp(a - lse[:, None])
        ll += float(lse.sum())
        counts += r.sum(axis=0)
        if em.kind == "categorical":
            np.add.at(comp.T, xb, r)
        elif em.covariance == "full":
            comp[:, : em.dim] += r.T @ xb
            comp[:, em.dim :] += np.einsum("nk,ni,nj->kij", r, xb, xb).reshape(k, -1)
        else:
            comp[:, : em.dim] += r.T @ xb
            comp[:, em.dim :] += r.T @ (xb * xb)
    out = {ROOT: counts, "components": comp}
    if record:
        out["max"] = np.concatenate(maxes) if maxes else np.zeros(0)
        out["sum"] = np.concatenate(sums) if sums else np.zeros(0)
    return out, ll


def m_step(em: EMInstructions, old: Params, stats: dict[str, np.ndarray], rows: int) -> Params:
    """The maximiser for the components in ``old`` given their summed statistics over ``rows`` rows."""
    counts, comp = stats[ROOT], stats["components"]
    weights = counts / rows
    alive = counts > 1e-12 * rows
    if em.kind == "categorical":
        probs = old.probs.copy()
        probs[alive] = comp[alive] / counts[alive, None]
        return Params(weights, probs=probs)
    d = em.dim
    means, covs = old.means.copy(), old.covs.copy()
    means[alive] = comp[alive, :d] / counts[alive, None]
    second = comp[:, d:] / np.maximum(counts, 1e-300)[:, None]
    if em.covariance == "full":
        second = second.reshape(-1, d, d)
        new = second - np.einsum("ki,kj->kij", means, means)
        covs[alive] = 0.5 * (new[alive] + np.transpose(new[alive], (0, 2, 1)))
    else:
        covs[alive] = (second - means * means)[alive]
    return Params(weights, means=means, covs=covs)


def reference_fit(em: EMInstructions, data: np.ndarray, steps: int) -> tuple[Params, list[float], list[dict[str, np.ndarray]]]:
    """Single-process EM on all rows: parameters, log-likelihoods, and each iteration's statistics
    (with every row's normaliser: max and sum of exponentials)."""
    p = initial_params(em, data)
    lls, history = [], []
    for _ in range(steps):
        stats, ll = e_step(em, p, data, record=True)
        history.append(stats)
        lls.append(ll)
        p = m_step(em, p, stats, len(data))
    return p, lls, history


def relative_error(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(max |a - b| / max |b|, max |a - b|) over the finite entries."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
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


def statistics_parts(em: EMInstructions) -> list[tuple[str, list[int]]]:
    """The plan's component statistics updates, in plan order, with the components each carries."""
    out = []
    for node_id in em.collectives:
        node = node_id.removesuffix(":statistics")
        if node == node_id or node == ROOT:
            continue
        out.append((node_id, [k for k, n in enumerate(em.component_nodes) if n == node]))
    return out


def _padded(a: np.ndarray, rows: int) -> np.ndarray:
    out = np.zeros((rows,) + a.shape[1:])
    out[: len(a)] = a
    return out


def fit_rank(em: EMInstructions, comm, mesh, data: np.ndarray, steps: int, *, receipts=None, progress: bool = False) -> dict:
    """EM on this rank's rows and components. Returns this rank's record: the components it owns,
    its parameters for them, the log-likelihoods, and per iteration the reduced statistics and
    (under a component cut) each row's normaliser."""
    import torch
    import torch.distributed as dist

    data_size, data_rank = mesh.data_parallel_size, mesh.data_rank
    local = shard_rows(data, data_rank, data_size)
    rows = len(data)
    cut = em.plan.tp > 1
    owned = em.owned(mesh.coord("tp")) if cut else list(range(em.num_components))
    p = initial_params(em, data).subset(owned)
    rule = {c.node_id: c.rule for c in em.collectives.values()}
    chunks = None
    normalise = None
    if cut:
        chunks = np.array_split(local, em.micro_steps)
        if max(len(c) for c in chunks) > em.micro_batch_size:
            raise ValueError(f"{len(local)} rows on data rank {data_rank} do not fit {em.micro_steps} micro-batch(es) of {em.micro_batch_size}")

        def normalise(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            n = len(a)
            top = torch.zeros(em.micro_batch_size, dtype=torch.float64)
            top[:n] = torch.from_numpy(a.max(axis=1) if a.shape[1] else np.full(n, -np.inf))
            # all_reduce MAX through the counting layer (checked against the plan, then counted).
            comm._run("all_reduce", rule[NORMALISER_MAX], comm._parts(NORMALISER_MAX, top.numel() * 8),
                      lambda g, async_op: dist.all_reduce(top, op=dist.ReduceOp.MAX, group=g, async_op=async_op))
            m = top[:n].numpy().copy()
            total = torch.zeros(em.micro_batch_size, dtype=torch.float64)
            total[:n] = torch.from_numpy(np.exp(a - m[:, None]).sum(axis=1))
            comm.all_reduce(total, rule=rule[NORMALISER_SUM], parts=NORMALISER_SUM)
            return m, total[:n].numpy().copy()

    lls, history = [], []
    started = time.perf_counter()
    for it in range(steps):
        before = comm.ledger.snapshot()
        stats, ll = e_step(em, p, local, chunks=chunks, normalise=normalise, record=cut)
        if f"{ROOT}:statistics" in rule:
            if cut:
                for key, node_id in (("components", f"{ROOT}.component:statistics"), (ROOT, f"{ROOT}:statistics")):
                    t = torch.from_numpy(_padded(stats[key], em.local_units))
                    comm.all_reduce(t, rule=rule[node_id], parts=node_id)
                    stats[key] = t.numpy()[: len(owned)].copy()
            else:
                for node_id, comps in statistics_parts(em):
                    t = torch.from_numpy(np.ascontiguousarray(stats["components"][comps]))
                    comm.all_reduce(t, rule=rule[node_id], parts=node_id)
                    stats["components"][comps] = t.numpy()
                t = torch.from_numpy(stats[ROOT].copy())
                comm.all_reduce(t, rule=rule[f"{ROOT}:statistics"], parts=f"{ROOT}:statistics")
                stats[ROOT] = t.numpy()
        if LOG_LIKELIHOOD in rule:
            t = torch.tensor([ll], dtype=torch.float64)
            comm.all_reduce(t, rule=rule[LOG_LIKELIHOOD], parts=LOG_LIKELIHOOD)
            ll = float(t.item())
        history.append(stats)
        lls.append(ll)
        p = m_step(em, p, stats, rows)
        after = comm.ledger.snapshot()
        observed = sum(after[k][1] - before.get(k, (0, 0))[1] for k in after)
        if receipts is not None:
            receipts.write(json.dumps({"iteration": it, "log_likelihood": ll, "examples": rows,
                                       "local_examples": len(local), "collective_bytes": observed,
                                       "wall_s": time.perf_counter() - started}, sort_keys=True) + "\n")
            receipts.flush()
        if progress:
            print(f"iteration {it + 1}/{steps}  log-likelihood {ll:.6f}  {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    return {"owned": owned, "data_rank": data_rank, "data_size": data_size, "params": p, "lls": lls, "history": history}


def assemble(em: EMInstructions, records: list[dict]) -> Params:
    """The whole model from every rank's owned components."""
    first = records[0]["params"].arrays()
    whole = {name: np.zeros((em.num_components,) + a.shape[1:]) for name, a in first.items()}
    for rec in records:
        for name, a in rec["params"].arrays().items():
            whole[name][rec["owned"]] = a
    return Params(**whole)


def em_accounting(em: EMInstructions, ledgers, steps: int) -> dict:
    rows, errors = [], []
    for node_id, c in em.collectives.items():
        planned_count = c.occurrences_per_step * steps
        expected = em.expected_bytes(c) * planned_count
        observed = [tuple(lg["updates"].get(node_id, (0, 0))) for lg in ledgers]
        match = all(o == (planned_count, expected) for o in observed)
        if not match:
            bad = next(r for r, o in enumerate(observed) if o != (planned_count, expected))
            errors.append(f"{node_id}: planned {planned_count} x {c.collective} ({expected} bytes in float64) per rank over {steps} "
                          f"iteration(s), observed {observed[bad][0]} ({observed[bad][1]} bytes) on rank {bad}")
        rows.append({"node_id": node_id, "collective": c.collective, "group": c.rule, "phase": c.phase,
                     "planned_count": planned_count, "planned_bytes": c.payload_bytes * planned_count,
                     "expected_bytes_float64": expected, "observed_count": sorted({o[0] for o in observed}),
                     "observed_bytes": sorted({o[1] for o in observed}), "match": match})
    for r, lg in enumerate(ledgers):
        for node_id in sorted(set(lg["updates"]) - set(em.collectives)):
            errors.append(f"{node_id}: rank {r} issued a collective the plan does not declare")
    return {"ok": not errors, "errors": errors, "updates": rows, "updates_checked": len(rows), "ranks_checked": len(ledgers),
            "collective_calls_per_rank": [lg["calls"] for lg in ledgers], "bytes_note":
            "statistics travel in float64; the plan sizes them in its precision, so expected bytes = payload_bytes * 8 / bytes per element"}


def evidence(doc, em: EMInstructions, records: list[dict], repeat: list[dict], ref, steps: int) -> tuple[list[dict], list[str]]:
    """Each update's numerical evidence: what every rank reduced, every iteration, against the
    single-process values (``records``, ``repeat``: every rank's record of the fit and its repeat)."""
    from mixle_compile.contracts import DistributedUpdate

    ref_params, ref_lls, ref_history = ref
    run_id = f"em-{em.content_digest.removeprefix('sha256:')[:12]}-{steps}"
    parts = dict(statistics_parts(em))

    def pair(node_id: str, rec: dict, it: int) -> tuple[np.ndarray, np.ndarray]:
        owned, h, r = rec["owned"], rec["history"][it], ref_history[it]
        if node_id == f"{ROOT}:statistics":
            return h[ROOT], r[ROOT][owned]
        if node_id == LOG_LIKELIHOOD:
            return np.array([rec["lls"][it]]), np.array([ref_lls[it]])
        if node_id in (NORMALISER_MAX, NORMALISER_SUM):
            key = "max" if node_id == NORMALISER_MAX else "sum"
            return h[key], shard_rows(r[key], rec["data_rank"], rec["data_size"])
        comps = [k for k in parts[node_id] if k in owned]
        return h["components"][[owned.index(k) for k in comps]], r["components"][comps]

    out, errors = [], []
    for u in doc.updates:
        fields = DistributedUpdate.from_dict({k: getattr(u, k) for k in DistributedUpdate.__dataclass_fields__}).as_dict()
        rel = ab = 0.0
        samples = 0
        same = True
        for rec, again in zip(records, repeat):
            for it in range(steps):
                mine, theirs = pair(u.node_id, rec, it)
                r, x = relative_error(mine, theirs)
                rel, ab, samples = max(rel, r), max(ab, x), samples + int(np.size(mine))
                same = same and np.array_equal(mine, pair(u.node_id, again, it)[0])
        fields.update(maximum_relative_error=rel, maximum_absolute_error=ab, numerics_sample_count=samples,
                      numerics_evidence_id=f"{run_id}/{u.node_id}", determinism_observed=same)
        out.append(DistributedUpdate.from_dict(fields).as_dict())
    fitted = assemble(em, records)
    for name, a in fitted.arrays().items():
        r, _ = relative_error(a, ref_params.arrays()[name])
        if r > EM_TOLERANCE:
            errors.append(f"fitted {name}: relative error {r:.2e} against the single-process fit exceeds {EM_TOLERANCE:.0e}")
    for d in out:
        if d["maximum_relative_error"] > EM_TOLERANCE:
            errors.append(f"{d['node_id']}: relative error {d['maximum_relative_error']:.2e} exceeds {EM_TOLERANCE:.0e}")
    return out, errors


def fit_error(params: Params, ref_params: Params) -> float:
    """Max relative error of the fitted parameters against the single-process fit."""
    return max(relative_error(a, ref_params.arrays()[name])[0] for name, a in params.arrays().items())


def run_em_rank(doc, *, steps: int, out_dir: Path, reference: bool, data_path: str | None, timeout_s: float, progress: bool) -> dict | None:
    """One rank of an EM run; rank 0 returns the report (also written to ``out_dir``), others None."""
    import torch
    import torch.distributed as dist

    from mixle_compile.runtime.collectives import Collectives, Ledger
    from mixle_compile.runtime.em_plan import read_em_instructions
    from mixle_compile.runtime.mesh import Mesh
    from mixle_compile.runtime.report import RECEIPTS_FILE, REPORT_FILE
    from mixle_compile.runtime.session import join_process_group

    started = time.perf_counter()
    em = read_em_instructions(doc)
    data = load_data(em, data_path)
    owns = join_process_group(em.plan.world_size)
    try:
        mesh = Mesh.create(doc.groups, timeout_s=timeout_s)
        rank = mesh.rank
        comm = Collectives(mesh, Ledger(planned=em.collectives))
        receipts = (out_dir / RECEIPTS_FILE).open("w", encoding="utf-8") if rank == 0 else None
        try:
            record = fit_rank(em, comm, mesh, data, steps, receipts=receipts, progress=progress and rank == 0)
        finally:
            if receipts is not None:
                receipts.close()
        train_s = time.perf_counter() - started
        ledgers = comm.bookkeeping_gather_object(comm.ledger.as_dict(), name="report:ledgers")
        records = comm.bookkeeping_gather_object(record, name="report:fit")
        repeat_ledgers = repeat = None
        if reference:
            # The repeat: the same fit from the same start, for determinism.
            comm2 = Collectives(mesh, Ledger(planned=em.collectives))
            again = fit_rank(em, comm2, mesh, data, steps)
            repeat_ledgers = comm2.bookkeeping_gather_object(comm2.ledger.as_dict(), name="report:ledgers")
            repeat = comm2.bookkeeping_gather_object(again, name="report:fit")
        comm.barrier("report:done")
    finally:
        if owns:
            dist.destroy_process_group()
            if "mesh" in locals():
                mesh.release()
    if rank != 0:
        return None
    lls = record["lls"]
    account = em_accounting(em, ledgers, steps)
    errors = list(account["errors"]) + monotone_violations(lls)
    if any(rec["lls"] != lls for rec in records):
        errors.append("the ranks disagree on the log-likelihood")
    if repeat_ledgers is not None and [lg["updates"] for lg in repeat_ledgers] != [lg["updates"] for lg in ledgers]:
        errors.append("the repeated fit issued different collectives from the first")
    report = {
        "ok": False,
        "errors": errors,
        "warnings": [] if em.precision == "fp32" else [f"training.precision={em.precision!r}: EM runs in float64 regardless"],
        "plan": {"content_digest": em.content_digest, "world_size": em.plan.world_size, "factorisation": em.plan.factorisation(),
                 "degrees": em.plan.as_dict(), "family": "distribution", "precision": "float64", "optimizer": "em"},
        "run": {"steps": steps, "train_s": train_s, "wall_s": train_s, "data": data_path or "synthetic", "torch": torch.__version__,
                "rows": int(len(data)), "model": {"kind": em.kind, "components": em.num_components, "dim": em.dim,
                                                  "covariance": em.covariance, "num_values": em.num_values}},
        # `losses` keeps the neural report's shape: the negative mean log-likelihood per row.
        "losses": [-ll / len(data) for ll in lls],
        "log_likelihoods": lls,
        "log_likelihood_monotone": not monotone_violations(lls),
        "accounting": account,
        "evidence": None,
        "receipts": RECEIPTS_FILE,
    }
    if reference:
        ref = reference_fit(em, data, steps)
        updates, ev_errors = evidence(doc, em, records, repeat, ref, steps)
        report["errors"] += ev_errors
        if any(u["determinism_observed"] is False for u in updates):
            report["errors"].append("the repeated fit reduced different values from the first")
        report["evidence"] = {"tolerance": EM_TOLERANCE, "run_id": f"em-{em.content_digest.removeprefix('sha256:')[:12]}-{steps}",
                              "updates": updates, "fit_max_relative_error": fit_error(assemble(em, records), ref[0]),
                              "reference_log_likelihoods": ref[1]}
    report["ok"] = not report["errors"]
    report["run"]["wall_s"] = time.perf_counter() - started
    (out_dir / REPORT_FILE).write_text(json.dumps(report, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return report

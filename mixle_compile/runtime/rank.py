"""One rank of `run`, the same skeleton for every model: join the process group, build the mesh,
resume, train, gather the ledgers, tear down, and (rank 0) write the report.

What differs between a neural model (runtime/worker.py) and a distribution model fitted by EM
(runtime/em/fit.py) is supplied by a ``RankJob``: how the plan is read and a checkpoint loaded, what
one rank trains, what else is gathered for the report, and how the report is built. The skeleton
owns the order, the receipts file, the teardown (always, through ``finally``) and the report file.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Protocol

from mixle_compile.runtime import faults
from mixle_compile.runtime.report import RECEIPTS_FILE, REPORT_FILE


class RankJob(Protocol):
    """The steps of one rank that differ between the neural and the EM runtime, in the order
    ``run_job`` calls them. ``comm`` is the rank's counting layer once ``open`` has run."""

    comm: object

    def prepare(self) -> int:
        """Read the plan (and what needs no process group); return the plan's world size."""

    def open(self, mesh) -> None:
        """Build this rank's state on ``mesh`` (sessions, collectives) and resume it from a checkpoint."""

    def train(self, receipts) -> None:
        """Train this rank to the last step, writing receipts (rank 0: an open file, else None)."""

    def gather(self, ledgers: list | None) -> None:
        """Collect what the report needs besides ``ledgers`` (every rank's, on rank 0), the
        reference's repeat included; collective: every rank calls it."""

    def close(self) -> None:
        """Drop what holds the process group's handles (sessions, collectives)."""

    def report(self, train_s: float) -> dict:
        """Rank 0 only, after the teardown: the report (``run.wall_s`` is set by the skeleton)."""


def run_job(job: RankJob, groups, *, out_dir: Path, timeout_s: float) -> dict | None:
    """Run one rank of ``job`` on the plan's ``groups``; rank 0 returns the report (also written to
    ``out_dir``), other ranks None."""
    import torch.distributed as dist

    from mixle_compile.runtime.mesh import Mesh
    from mixle_compile.runtime.session import join_process_group

    started = time.perf_counter()
    world_size = job.prepare()
    faults.before_join(int(os.environ.get("RANK", "0")))
    owns = join_process_group(world_size)
    mesh = None
    try:
        mesh = Mesh.create(groups, timeout_s=timeout_s)
        job.open(mesh)
        rank = mesh.rank
        receipts = (out_dir / RECEIPTS_FILE).open("w", encoding="utf-8") if rank == 0 else None
        try:
            job.train(receipts)
        finally:
            if receipts is not None:
                receipts.close()
        train_s = time.perf_counter() - started
        job.gather(job.comm.bookkeeping_gather_object(job.comm.ledger.as_dict(), name="report:ledgers"))
        job.comm.barrier("report:done")
    finally:
        if owns:
            # Every rank leaves the group together; rank 0's report below needs no group.
            dist.destroy_process_group()
            job.close()  # their group handles go with the mesh
            if mesh is not None:
                mesh.release()
    if rank != 0:
        return None
    report = job.report(train_s)
    report["run"]["wall_s"] = time.perf_counter() - started
    (out_dir / REPORT_FILE).write_text(json.dumps(report, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return report

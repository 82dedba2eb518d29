"""Fault injection for the tests of failure handling, kept out of the production code's way.

A run reads two environment variables; unset (always, outside the tests), every hook below returns
at once and does nothing.

``MIXLE_RUNTIME_FAULT`` (``FAULT_ENV``) is ``KIND:RANK:STEP``: that rank, at that step,

- ``kill``: exits at once (status 17), just before the step;
- ``stall``: hangs just before the step (its peers time out);
- ``raise``: raises just before the step;
- ``sigkill``: sends itself SIGKILL in the middle of the step (at the first gradient of its first
  micro-batch's backward, gradients half reduced);
- ``detach``: a pipeline stage detaches the activations it receives from that step on (the silent
  bug of a received activation without requires_grad: the run completes, earlier stages get no
  gradient);
- ``savekill``: sends itself SIGKILL while the checkpoint after STEP is being saved, once the tensor
  state is written and before the checkpoint is committed;
- ``nojoin`` (STEP 0): hangs before it joins the process group (a peer that never arrives).

``MIXLE_CHECKPOINT_FAULT`` (``COMMIT_FAULT_ENV``) is ``STEP:K``: the process committing the
checkpoint of STEP exits (status 75) just before the commit's K-th rename.

The rank skeleton (runtime/rank.py) calls ``before_join``, the neural training loop
(runtime/worker.py) ``before_step`` and ``after_state_written``, and the checkpoint commit
(runtime/checkpoint.py) renames through ``CommitRenames``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

FAULT_ENV = "MIXLE_RUNTIME_FAULT"
COMMIT_FAULT_ENV = "MIXLE_CHECKPOINT_FAULT"


def planned(rank: int, step: int) -> str | None:
    """The kind of fault ``FAULT_ENV`` plans for ``rank`` at ``step``, or None."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    kind, fault_rank, fault_step = spec.split(":")
    if int(fault_rank) != rank or int(fault_step) != step:
        return None
    return kind


def before_join(rank: int) -> None:
    """Before the rank joins the process group: ``nojoin`` hangs here."""
    if planned(rank, 0) == "nojoin":
        time.sleep(3600)


def before_step(rank: int, step: int, session=None) -> None:
    """Just before ``step`` (counted from 0) of a training session: kill, stall, raise, detach, sigkill."""
    kind = planned(rank, step)
    if kind is None:
        return
    if kind == "kill":
        os._exit(17)
    if kind == "stall":
        time.sleep(3600)
    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    if kind == "detach" and session is not None and hasattr(session, "detach_received"):
        session.detach_received = True
    if kind == "sigkill" and session is not None:

        def die(use, grad):  # the first gradient of the step: mid-backward
            os.kill(os.getpid(), signal.SIGKILL)

        for store in getattr(session, "stores", {0: session.store}).values():  # a pipeline stage: every chunk's store
            store.accumulate = die


def after_state_written(rank: int, step: int) -> None:
    """The checkpoint after ``step`` steps has its tensor state written, not yet committed: ``savekill``."""
    if planned(rank, step) == "savekill":
        os.kill(os.getpid(), signal.SIGKILL)


class CommitRenames:
    """The renames of one checkpoint commit, numbered; ``COMMIT_FAULT_ENV`` may end the process before one."""

    def __init__(self, step: int) -> None:
        self.count = 0
        self.crash_at = None
        spec = os.environ.get(COMMIT_FAULT_ENV)
        if spec:
            at_step, k = spec.split(":")
            if int(at_step) == step:
                self.crash_at = int(k)

    def __call__(self, src: Path, dst: Path) -> None:
        self.count += 1
        if self.count == self.crash_at:
            os._exit(75)
        os.replace(src, dst)

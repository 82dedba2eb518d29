"""The runtime's errors. Torch-free, so a refusal can be raised before torch is imported."""

from __future__ import annotations


class RuntimeRefusal(ValueError):
    """The runtime will not start this plan; the message says what is wrong and how to fix it."""


class SpecRejected(RuntimeRefusal):
    """The spec given to run has errors: a finding, not unusable input (exit 1, as `check` and `compile`)."""


class PlanMismatch(RuntimeError):
    """The runtime was about to issue a collective the plan does not declare (or declares differently).

    Replay is literal: the plan's updates are the instructions, so this is a bug in the runtime or
    the planner, never something to work around silently.
    """


class CollectiveFailed(RuntimeError):
    """A collective raised (a peer died, or the process-group timeout expired)."""

    def __init__(self, message: str, *, node_id: str, rule: str, ranks: tuple[int, ...], timed_out: bool) -> None:
        super().__init__(message)
        self.node_id = node_id
        self.rule = rule
        self.ranks = ranks
        self.timed_out = timed_out


class RunFailed(RuntimeError):
    """A distributed run ended with a failed, dead or stalled rank."""

    def __init__(self, message: str, *, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks

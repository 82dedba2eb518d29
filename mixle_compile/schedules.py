"""Pipeline schedules, written once and read twice: which ones an engine runs, and in what order.

The verifier's schedule rules (P003, P004, P005) bound a spec with these requirements over Z3
terms; the lowering's schedule builder (:func:`mixle_compile.lower.schedule.pipeline_schedule`)
checks the same requirements over numbers before it builds a stage's program, and refuses with
the same sentence. So a spec that `check` accepts is one the builder can build, and the builder
builds exactly the orders the engine runs.

Two families of schedules exist among the engines we model:

* ``torch``: ``torch.distributed.pipelining`` (torch 2.13, ``schedules.py``), which the in-tree
  runtime follows and torchtitan uses. ``ScheduleGPipe`` takes any number of micro-batches;
  ``Schedule1F1B`` needs ``n_microbatches >= num_stages``; ``ScheduleInterleaved1F1B`` runs
  ``rounds = max(1, m // pp)`` rounds of ``m // rounds`` micro-batches and needs
  ``m % rounds == 0`` (so it accepts fewer micro-batches than stages, and one stage per rank).
* ``megatron``: ``megatron.core.pipeline_parallel.schedules`` (Megatron-Core 0.12-0.16). The
  non-interleaved 1F1B warms up ``min(pp - rank - 1, m)`` micro-batches and takes any m; the
  interleaved schedule advances micro-batches in groups of
  ``microbatch_group_size_per_vp_stage`` (default pp, ``ModelParallelConfig.__post_init__``; a
  spec's ``training.microbatch_group_size``) and needs the group within ``[pp, m]`` and ``m % group``
  either 0 or at least pp; with the default group that is ``m % pp == 0``. Megatron has no GPipe
  schedule and no interleaving without virtual stages: with ``virtual_pipeline_stages: 1`` it runs 1F1B.

Every formula takes a :class:`Logic` (the connectives that differ between numbers and solver
terms); :data:`NUMBERS` serves the builder, the verifier passes its Z3 version.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


class ScheduleFamily(StrEnum):
    TORCH = "torch"
    MEGATRON = "megatron"


class Logic(Protocol):
    def all_of(self, *terms: Any) -> Any: ...

    def any_of(self, *terms: Any) -> Any: ...

    def larger(self, a: Any, b: Any) -> Any: ...

    def quotient(self, a: Any, b: Any) -> Any:
        """Integer division rounding down (both operands >= 1)."""

    def smaller(self, a: Any, b: Any) -> Any: ...


class _Numbers:
    def all_of(self, *terms):
        return all(terms)

    def any_of(self, *terms):
        return any(terms)

    def larger(self, a, b):
        return max(a, b)

    def smaller(self, a, b):
        return min(a, b)

    def quotient(self, a, b):
        return a // b


NUMBERS: Logic = _Numbers()


def torch_rounds(logic: Logic, pp: Any, microbatches: Any) -> Any:
    """``ScheduleInterleaved1F1B.number_of_rounds``: max(1, m // pp)."""
    return logic.larger(logic.quotient(microbatches, pp), 1)


def microbatches_per_round(logic: Logic, pp: Any, microbatches: Any) -> Any:
    """The micro-batches an interleaved schedule advances through one model chunk before the next:
    torch's ``ScheduleInterleaved1F1B.microbatches_per_round`` (``m // number_of_rounds``), and
    Megatron's ``microbatch_group_size_per_vp_stage`` (default pp), which is the same number on
    every spec P004 accepts (m a multiple of pp)."""
    return logic.quotient(microbatches, torch_rounds(logic, pp, microbatches))


@dataclass(frozen=True)
class Requirement:
    """One condition an engine's schedule puts on (pp, micro-batches), with its verifier code."""

    code: str
    family: ScheduleFamily
    schedule: str  # the schedule it constrains (as the engine runs it, see `runs`)
    # (logic, pp, microbatches, group) -> condition; group: Megatron's interleaved group (resolved:
    # the spec's microbatch_group_size, or pp), which only P004 reads
    holds: Callable[[Logic, Any, Any, Any], Any]
    broken: Callable[[int, int, int], str]  # why it fails, for numbers
    fix: Callable[[int, int, int], str]
    source: str


def _plural(m: int) -> str:
    return f"{m} micro-batch{'es' * (m != 1)}"


REQUIREMENTS: tuple[Requirement, ...] = (
    Requirement(
        code="P003",
        family=ScheduleFamily.TORCH,
        schedule="1f1b",
        holds=lambda logic, pp, m, group: m >= pp,
        broken=lambda pp, m, group: (
            f"{_plural(m)} for pp={pp} stages: torch's Schedule1F1B needs at least one per stage"
        ),
        fix=lambda pp, m, group: f"use at least {pp} micro-batches, or pipeline_schedule: interleaved_1f1b or gpipe",
        source="torch 2.13 torch/distributed/pipelining/schedules.py, Schedule1F1B.__init__",
    ),
    Requirement(
        code="P004",
        family=ScheduleFamily.MEGATRON,
        schedule="interleaved_1f1b",
        holds=lambda logic, pp, m, group: logic.all_of(
            group >= pp, group <= m, logic.any_of(m % group == 0, m % group >= pp)
        ),
        broken=lambda pp, m, group: _megatron_groups_broken(pp, m, group),
        fix=lambda pp, m, group: (
            f"use a multiple of {group} micro-batches, e.g. {max(1, -(-m // group)) * group}"
            if pp <= group
            else f"set training.microbatch_group_size to at least pp={pp}, or leave it out (pp)"
        ),
        source=(
            "Megatron-Core 0.16 megatron/core/pipeline_parallel/schedules.py, "
            "forward_backward_pipelining_with_interleaving (the group within [pp, m], the last group 0 or "
            "at least pp), model_parallel_config.py (microbatch_group_size_per_vp_stage defaults to pp)"
        ),
    ),
    Requirement(
        code="P005",
        family=ScheduleFamily.TORCH,
        schedule="interleaved_1f1b",
        holds=lambda logic, pp, m, group: m % torch_rounds(logic, pp, m) == 0,
        broken=lambda pp, m, group: (
            f"{_plural(m)} over pp={pp} make {torch_rounds(NUMBERS, pp, m)} rounds, and "
            f"{m} % {torch_rounds(NUMBERS, pp, m)} != 0"
        ),
        fix=lambda pp, m, group: (
            f"use a multiple of {torch_rounds(NUMBERS, pp, m)} micro-batches, e.g. {torch_rounds(NUMBERS, pp, m) * pp}"
        ),
        source="torch 2.13 torch/distributed/pipelining/schedules.py, ScheduleInterleaved1F1B.__init__ "
        "(number_of_rounds)",
    ),
)


def requirement(code: str) -> Requirement:
    return next(r for r in REQUIREMENTS if r.code == code)


def applies(logic: Logic, r: Requirement, *, pp: Any, virtual_stages: Any, chosen: Callable[[str], Any]) -> Any:
    """When the engine runs the requirement's schedule: a pipeline, the spec's choice of schedule
    (``chosen(name)``), and for Megatron's interleaving, virtual stages (see :func:`runs`)."""
    if r.family is ScheduleFamily.MEGATRON and r.schedule == "interleaved_1f1b":
        return logic.all_of(pp > 1, chosen(r.schedule), virtual_stages > 1)
    return logic.all_of(pp > 1, chosen(r.schedule))


def pipelined(schedule: str, pp: int, virtual_stages: int) -> tuple[str, int]:
    """The schedule and virtual stages a plan states for a spec's choice: without a pipeline
    (pp == 1) there is no schedule, and micro-batches are laid out as GPipe lays them out, one
    chunk per stage, whatever the spec says."""
    if pp == 1:
        return "gpipe", 1
    return schedule, virtual_stages


def bubble_chunks(schedule: str, virtual_stages: int) -> int:
    """The model chunks per stage that divide a schedule's pipeline bubble: the virtual stages
    under an interleaved schedule, one under GPipe and 1F1B (which hold one chunk per stage)."""
    return virtual_stages if schedule == "interleaved_1f1b" else 1


def runs(family: ScheduleFamily, schedule: str, pp: int, virtual_stages: int) -> str:
    """The schedule the engine really runs for a spec's choice.

    Without a pipeline there is no schedule (:func:`pipelined`); Megatron interleaves only with
    virtual stages and otherwise runs 1F1B, even when asked for GPipe, which it does not have."""
    if pp == 1:
        return pipelined(schedule, pp, virtual_stages)[0]
    if family is ScheduleFamily.MEGATRON and (schedule == "gpipe" or virtual_stages == 1):
        return "1f1b"
    return schedule


def refusal(
    family: ScheduleFamily,
    schedule: str,
    pp: int,
    microbatches: int,
    virtual_stages: int,
    group: int | None = None,
) -> Requirement | None:
    """The first requirement the engine's schedule puts on these numbers that they break
    (``group``: Megatron's ``microbatch_group_size_per_vp_stage``, None for its default pp)."""
    for r in REQUIREMENTS:
        if r.family is not family:
            continue
        if applies(NUMBERS, r, pp=pp, virtual_stages=virtual_stages, chosen=lambda name: name == schedule):
            if not r.holds(NUMBERS, pp, microbatches, group or pp):
                return r
    return None


def _megatron_groups_broken(pp: int, m: int, group: int) -> str:
    if group == pp:
        return f"{_plural(m)} do not form whole groups of pp={pp} ({m} % {pp} != 0)"
    if not pp <= group <= m:
        return f"the micro-batch group of {group} is not within [pp={pp}, {_plural(m)}]"
    return f"{_plural(m)} leave a last group of {m % group}, fewer than pp={pp} ({m} % {group} = {m % group})"


def interleaved_group(family: ScheduleFamily, pp: int, microbatches: int, group: int | None = None) -> int:
    """How many consecutive micro-batches an interleaved schedule runs on one chunk before the next.

    torch: :func:`microbatches_per_round`; Megatron: ``microbatch_group_size_per_vp_stage``
    (``group``, a spec's ``training.microbatch_group_size``), by default pp."""
    if family is ScheduleFamily.TORCH:
        return microbatches_per_round(NUMBERS, pp, microbatches)
    return group or pp


def one_f_one_b_warmup(logic: Logic, pp: Any, microbatches: Any, stage: Any) -> Any:
    """Forwards a 1F1B stage runs before its first backward: ``min(pp - stage - 1, m)``."""
    return logic.smaller(pp - stage - 1, microbatches)


def interleaved_warmup(logic: Logic, pp: Any, microbatches: Any, virtual_stages: Any, stage: Any, group: Any) -> Any:
    """Forwards (of one model chunk and micro-batch each) an interleaved stage runs before its first
    backward: ``2 * (pp - stage - 1) + (v - 1) * group``, at most every forward of the step (torch
    ``_get_warmup_ops``; Megatron ``get_pp_rank_microbatches``)."""
    return logic.smaller(2 * (pp - stage - 1) + (virtual_stages - 1) * group, microbatches * virtual_stages)


def warmup_forwards(schedule: str, pp: int, microbatches: int, virtual_stages: int, stage: int, group: int) -> int:
    """Forward passes a stage runs before its first backward (its warm-up), as both engines count
    them: every one under GPipe, :func:`one_f_one_b_warmup`, :func:`interleaved_warmup`."""
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return one_f_one_b_warmup(NUMBERS, pp, microbatches, stage)
    return interleaved_warmup(NUMBERS, pp, microbatches, virtual_stages, stage, group)


def bubble_fraction(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The share of a step a pipeline rank sits idle: ``(pp - 1) / (v * m + pp - 1)``.

    Narayanan et al. (SC21), the bubble of 1F1B divided by v under interleaving."""
    return (pp - 1) / (virtual_stages * microbatches + pp - 1)

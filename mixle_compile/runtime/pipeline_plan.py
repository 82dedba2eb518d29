"""A pipelined plan, read without torch: which stage holds what, who executes which update, refusals.

Torch-free on purpose (like instructions.py): `run` refuses a pipelined plan the pipeline runtime
cannot execute before torch is imported and before any process starts. The executing part is
runtime/pipeline.py.

- Layout: chunk ``c`` of stage ``s`` is virtual stage ``c * pp + s``; a virtual stage holds the
  parameters the plan places on it (``parameters[].stage``, ``.chunk``): the embedding on the first,
  its layers, the final norm and the head on the last.
- Boundaries: the activation a virtual stage sends on is the residual stream after its last unit
  (``layers.{i}``, or ``embed`` for a first stage without layers); the evidence names it
  ``<unit>:boundary`` (and ``<unit>:boundary/grad`` for the gradient sent back).
- Who executes an update: a stage-boundary transfer ``stage.A->B:...`` the ranks of stages A and B
  (each counts it once); every other update the ranks of its ``stage``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mixle_compile.plan.document import PlanDocument
from mixle_compile.plan.programs import plan_programs
from mixle_compile.plan.vocabulary import Axis, UpdateId, UpdateIdError
from mixle_compile.runtime.errors import RuntimeRefusal
from mixle_compile.runtime.instructions import Collective, Instructions

DTYPE_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class PipelineLayout:
    pp: int
    chunks: int
    params: Mapping[tuple[int, int], tuple[str, ...]]  # (stage, chunk) -> parameter names
    layers: Mapping[tuple[int, int], tuple[int, ...]]  # (stage, chunk) -> layer indices, ascending

    def virtual(self, stage: int, chunk: int) -> int:
        return chunk * self.pp + stage

    def location(self, virtual: int) -> tuple[int, int]:
        """``(stage, chunk)`` of a virtual stage."""
        return virtual % self.pp, virtual // self.pp

    @property
    def last_virtual(self) -> int:
        return self.pp * self.chunks - 1

    def boundary(self, virtual: int) -> str:
        """The evidence site of what virtual stage ``virtual`` hands on: the residual after its last unit."""
        for v in range(virtual, -1, -1):
            layers = self.layers.get(self.location(v), ())
            if layers:
                return str(UpdateId.activation(f"layers.{layers[-1]}", "boundary"))
        return str(UpdateId.activation("embed", "boundary"))

    def boundary_sites(self) -> tuple[str, ...]:
        sites = []
        for v in range(self.last_virtual):
            site = self.boundary(v)
            sites += [site, str(UpdateId.parse(site).backward())]
        return tuple(dict.fromkeys(sites))


def read_layout(doc: PlanDocument) -> PipelineLayout:
    pp = int(doc.mesh.degrees.get(Axis.PP, 1))
    chunks = 1 + max((int(p.chunk or 0) for p in doc.parameters), default=0)
    params: dict[tuple[int, int], list[str]] = {}
    layers: dict[tuple[int, int], set[int]] = {}
    for p in doc.parameters:
        key = (int(p.stage or 0), int(p.chunk or 0))
        params.setdefault(key, []).append(p.logical_id)
        if p.layer is not None:
            layers.setdefault(key, set()).add(int(p.layer))
    return PipelineLayout(
        pp=pp,
        chunks=chunks,
        params={k: tuple(v) for k, v in params.items()},
        layers={k: tuple(sorted(v)) for k, v in layers.items()},
    )


def stage_of_rank(doc: PlanDocument) -> tuple[int, ...]:
    """The pipeline stage (pp coordinate) of every rank, from the plan's dense grid."""
    world = doc.groups.world_size
    for d in doc.groups.dense.dims:
        if d.axis == Axis.PP:
            return tuple((rank // d.stride) % d.size for rank in range(world))
    return (0,) * world


def transfer_stages(node_id: str) -> tuple[int, int] | None:
    """``(src, dst)`` of a pipeline transfer's update id, ``None`` for any other update."""
    try:
        return UpdateId.parse(node_id).stages
    except UpdateIdError:
        return None


def executing_stages(c: Collective) -> frozenset[int]:
    """The stages whose ranks issue update ``c`` (both ends of a transfer, else its own stage)."""
    ends = transfer_stages(c.node_id)
    if ends is not None:
        return frozenset(ends)
    return frozenset(c.stages or (c.stage,))


def activation_shape(instructions: Instructions) -> tuple[int, int, int]:
    """The local shape of a stage-boundary activation: ``[s, b, h]``, the sequence split over cp (the
    rank's two chunks), then over tp under sequence parallelism (what a rank holds between its blocks)."""
    seq = (instructions.seq_len or 1) // instructions.plan.cp
    tp = instructions.plan.tp
    if instructions.sequence_parallel:
        seq //= tp
    return (seq, instructions.micro_batch_size, instructions.spec.model.hidden_size)


def check_pipeline(doc: PlanDocument, instructions: Instructions) -> PipelineLayout:
    """Refuse a pipelined plan the pipeline runtime does not execute; returns its layout."""
    plan = instructions.plan
    if instructions.family != "transformer":
        raise RuntimeRefusal(
            f"pipeline parallelism (pp={plan.pp}) is executed for transformer models only; this plan's model is a "
            f"{instructions.family!r} model: compile it with pp: 1"
        )
    layout = read_layout(doc)
    last = layout.location(layout.last_virtual)
    num_layers = instructions.spec.model.num_layers
    for where, layers in layout.layers.items():
        depths = [i for i in layers if i >= num_layers]
        if depths and where != last:
            raise RuntimeRefusal(
                f"the plan places multi-token prediction blocks {depths} on stage {where[0]} (chunk {where[1]}); "
                f"they run after the final norm, on the last virtual stage (stage {last[0]}, chunk {last[1]}): "
                "recompile it"
            )
    if len(doc.schedule.stages) != plan.pp:
        raise RuntimeRefusal(f"the plan has pp={plan.pp} but {len(doc.schedule.stages)} stage program(s); recompile it")
    try:
        programs = plan_programs(doc.schedule, doc.updates)
    except ValueError as exc:
        raise RuntimeRefusal(f"the plan's stage programs do not expand ({exc}); recompile it") from None
    for s, program in enumerate(programs):
        seen: dict[tuple[str, int], list[int]] = {}
        for op in program:
            if op.kind in ("forward", "backward"):
                if (
                    op.microbatch is None
                    or not 0 <= op.microbatch < instructions.micro_steps
                    or not 0 <= op.chunk < layout.chunks
                ):
                    raise RuntimeRefusal(
                        f"stage {s}'s program has a {op.kind} of micro-batch {op.microbatch}, chunk "
                        f"{op.chunk}, outside the plan's step"
                    )
                seen.setdefault((op.kind, op.chunk), []).append(op.microbatch)
            elif op.kind in ("send", "recv"):
                if op.peer is None or not 0 <= op.peer < plan.pp or op.tag not in ("activation", "activation_grad"):
                    raise RuntimeRefusal(
                        f"stage {s}'s program has a {op.kind} the pipeline runtime does not understand (peer "
                        f"{op.peer}, tag {op.tag!r})"
                    )
            elif op.kind not in ("collective", "optimizer"):
                raise RuntimeRefusal(
                    f"stage {s}'s program has a {op.kind!r} op, which the pipeline runtime does not execute"
                )
        for c in range(layout.chunks):
            for kind in ("forward", "backward"):
                order = seen.get((kind, c), [])
                if sorted(order) != list(range(instructions.micro_steps)):
                    raise RuntimeRefusal(
                        f"stage {s}'s program runs the {kind} of chunk {c} for micro-batches {order}, not once "
                        "for each of the "
                        f"step's {instructions.micro_steps} (microbatches x gradient accumulation); this "
                        "runtime replays a program "
                        "that covers the whole step"
                    )
                if kind == "backward" and order != sorted(order):
                    raise RuntimeRefusal(
                        f"stage {s}'s program runs the backward of chunk {c} out of micro-batch order ({order})"
                    )
        if sum(1 for op in program if op.kind == "optimizer") != 1:
            raise RuntimeRefusal(f"stage {s}'s program must end the step with one optimizer op")
    width = DTYPE_BYTES.get(instructions.precision, 4)
    shape = activation_shape(instructions)
    local = shape[0] * shape[1] * shape[2] * width
    for c in instructions.collectives.values():
        if transfer_stages(c.node_id) is not None and c.payload_bytes != local:
            raise RuntimeRefusal(
                f"the plan sizes the transfer {c.node_id!r} at {c.payload_bytes} bytes, but a stage holds an "
                "activation of "
                f"{list(shape)} x {width} bytes = {local} bytes between its blocks; recompile the plan"
            )
    return layout


def per_step_bubble(pp: int, micro_steps: int, virtual_stages: int) -> float:
    """The modelled idle fraction of a program of ``micro_steps`` micro-batches (lower/schedule.py's formula)."""
    return (pp - 1) / (virtual_stages * micro_steps + pp - 1)


def idle_fraction(busy_s: list[float], wall_s: list[float]) -> float | None:
    """1 - compute time / step time, over the steps after the first (which also opens the
    point-to-point connections); over every step when there is only one."""
    busy, wall = (busy_s[1:], wall_s[1:]) if len(wall_s) > 1 else (busy_s, wall_s)
    if not wall or sum(wall) <= 0:
        return None
    return max(0.0, 1.0 - sum(busy) / sum(wall))


def pipeline_section(doc: PlanDocument, instructions: Instructions, stats: list[dict]) -> tuple[dict, list[str]]:
    """The report's ``pipeline`` section from every rank's stage statistics, and the errors they show:
    a stage none of whose parameters received a gradient in a step, a parameter held whole that never
    received a non-zero gradient (the trap of a received activation without requires_grad)."""
    plan = instructions.plan
    errors = []
    idle = [idle_fraction(s["busy_s"], s["wall_s"]) for s in stats]
    for rank, s in enumerate(stats):
        if s["steps_without_gradient"]:
            errors.append(
                f"stage {s['stage']} (rank {rank}): none of its {s['parameters']} parameters received a "
                "gradient in step(s) "
                f"{', '.join(map(str, s['steps_without_gradient']))}; the backward did not reach this stage"
            )
        whole = [n for n in s["parameters_without_gradient"] if instructions.param(n).mode == "replicated"]
        if whole and not s["steps_without_gradient"]:
            shown = ", ".join(whole[:3]) + (f" and {len(whole) - 3} more" if len(whole) > 3 else "")
            errors.append(f"stage {s['stage']} (rank {rank}): {shown} never received a non-zero gradient")
    stages = [s["stage"] for s in stats]
    per_stage = {}
    for stage in sorted(set(stages)):
        values = [f for f, st in zip(idle, stages, strict=True) if st == stage and f is not None]
        per_stage[str(stage)] = sum(values) / len(values) if values else None
    measured = [f for f in idle if f is not None]
    section = {
        "schedule": doc.schedule.pipeline,
        "pp": plan.pp,
        "virtual_stages": doc.schedule.virtual_stages,
        "microbatches": plan.microbatches,
        "micro_steps": instructions.micro_steps,
        "bubble_model": float(doc.schedule.bubble_fraction),
        "bubble_model_per_step": per_step_bubble(plan.pp, instructions.micro_steps, doc.schedule.virtual_stages),
        "idle_fraction": sum(measured) / len(measured) if measured else None,
        "idle_fraction_per_stage": per_stage,
        "idle_fraction_per_rank": idle,
        "stage_of_rank": stages,
        "busy_s_per_rank": [sum(s["busy_s"]) for s in stats],
        "wall_s_per_rank": [sum(s["wall_s"]) for s in stats],
        "parameters_without_gradient": {
            str(r): s["parameters_without_gradient"] for r, s in enumerate(stats) if s["parameters_without_gradient"]
        },
        "stages_without_gradient": sorted({s["stage"] for s in stats if s["steps_without_gradient"]}),
    }
    return section, errors

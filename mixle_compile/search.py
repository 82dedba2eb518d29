"""Plan search: the fastest verified plan for a model on a device budget (`mixle-compile plan`).

A spec leaves the settings it wants chosen open: a mesh field written ``auto`` (or left out, when
``--devices`` gives the budget or the spec has no mesh; micro-batches and accumulation steps
whenever left out), and the training settings of how to train that it does not state (micro-batch
size, activation checkpointing, distributed optimizer, pipeline schedule and virtual stages,
sequence parallelism). What it states stays fixed: the model, the devices, the backend, the sequence
length and the global batch, which a user fixes for convergence.

The search (docs/search.md):

1. **enumerates** meshes: every factorisation of the device count into dp_replicate, dp_shard,
   tp, pp, cp (and ep, etp for a mixture of experts) whose data-parallel size divides the global
   batch, each with the settings its candidates vary (micro-batch sizes dividing a rank's share,
   checkpointing modes, schedules and virtual stages, the distributed optimizer). Only pure
   divisibility filters here (a speed path); validity is the verifier's.
2. **prices** candidates with the step-time model (:mod:`mixle_compile.step_time`): each stage's
   compute (``stage_compute``), the lowering's own collectives (lower/updates.py) for the model cut
   to two layers, scaled to the stage's layers, micro-batch and micro-steps, and ``combine`` for
   what each engine hides, the bubble and the optimizer step: the figure `explain` gives the
   written spec (tests hold the two together).
3. goes **best first**: a mesh is opened (its candidates priced) only when no priced candidate is
   estimated below its lower bound (compute, tp and ep traffic, the data-parallel traffic that
   compute cannot hide, the least bubble), so most meshes are never priced; checkpointing modes
   whose most frugal candidate the memory rule refuses are dropped first (the memory model grows
   with every setting a mesh's candidates vary), and a mesh's schedules then wait apart, each
   under its own bound.
4. **screens** candidates in order of their step time with the verifier's own rules read with
   values (:func:`mixle_compile.verify.symbols.broken_rules`: the same constraints, no solver) and
   **confirms** each survivor with the real `check` (:func:`mixle_compile.check.check_loaded`, the
   solver), until ``top`` plans pass: one per mesh unless ``variants``.

Every plan it returns is one `check` accepted, without the warning that it fits only in the caching
allocator's reserve (R002) unless ``tight``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixle_compile import step_time
from mixle_compile.diagnostics import Severity
from mixle_compile.engines import engine_profile
from mixle_compile.layer_split import ACCOUNTED, megatron_accounted, megatron_mtp_counted, megatron_uneven_balanced
from mixle_compile.memory_model import fsdp_shards
from mixle_compile.plan.vocabulary import DATA_AXES, SHARD_AXES, Axis
from mixle_compile.spec.kinds import Engine, Family
from mixle_compile.spec.models import is_auto
from mixle_compile.verify.wording import divisors

#: Mesh fields the search chooses when the spec leaves them open.
MESH_FIELDS = (*(a.value for a in Axis), "microbatches", "gradient_accumulation_steps")
#: Training settings of how to train that the search chooses when the spec does not state them.
TRAINING_FIELDS = (
    "micro_batch_size",
    "activation_checkpointing",
    "distributed_optimizer",
    "pipeline_schedule",
    "virtual_pipeline_stages",
    "sequence_parallel",
)
CHECKPOINTING = ("none", "selective", "full")
BATCH_SPLIT = ("microbatches", "gradient_accumulation_steps")
#: The degrees that name a mesh's links (a group's bandwidth and latency depend on them and the order).
MESH_KEY = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "etp")
#: The largest micro-batch size and number of virtual stages tried (larger ones only add memory
#: in the step-time model, which prices a micro-step's work by its tokens).
MAX_MICRO_BATCH = 16
MAX_VIRTUAL_STAGES = 8
DEFAULT_TOP = 5
#: A mesh is not opened while a priced candidate is estimated within this fraction of its bound:
#: plans that close are ties for the model, and opening every tie is what makes a search slow.
TOLERANCE = 0.01


class SearchInputError(ValueError):
    """The spec cannot be searched as written (exit 2): each line says what, where and how to fix."""

    def __init__(self, lines: list[str]):
        super().__init__("; ".join(lines))
        self.lines = lines


@dataclass(frozen=True)
class Request:
    file: str
    data: dict  # the spec as written, the searched fields at placeholder values or left out
    searched: frozenset[str]  # "mesh.tp", "training.micro_batch_size", ...
    devices: int
    spec: Any  # the validated placeholder spec (pydantic Spec)


@dataclass
class Plan:
    values: dict[str, Any]
    spec_data: dict
    step: step_time.StepTime
    memory_bytes: float  # the heaviest rank, as the lowering prices it
    device_memory: int
    estimate: float
    reason: str = ""  # why it loses to the plan above

    def mesh_text(self) -> str:
        return " ".join(f"{k} {self.values[k]}" for k in MESH_FIELDS if k in self.values)

    def training_text(self) -> str:
        shown = [f"{k} {_show(self.values[k])}" for k in TRAINING_FIELDS if k in self.values]
        if self.values.get("pipeline_layers") is not None:
            shown.append(f"pipeline_layers {_split_text(self.values['pipeline_layers'])}")
        return ", ".join(shown)


@dataclass
class Outcome:
    request: Request
    plans: list[Plan] = field(default_factory=list)
    enumerated: int = 0
    screened: int = 0
    confirmed: int = 0
    rejections: Counter = field(default_factory=Counter)  # rule code -> candidates it refused
    refused_by_check: int = 0  # screened valid, refused by the solver (should stay 0)
    reason: str = ""  # why nothing was found


def _show(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _split_text(counts) -> str:
    """A layer split with its runs folded: ``[1, 2 x 62, 1]``."""
    runs: list[list[int]] = []
    for c in counts:
        if runs and runs[-1][0] == c:
            runs[-1][1] += 1
        else:
            runs.append([c, 1])
    return "[" + ", ".join(str(c) if n == 1 else f"{c} x {n}" for c, n in runs) + "]"


# --------------------------------------------------------------------------- reading the request


def read_request(path: str | Path, *, devices: int | None = None) -> Request:
    """The spec with its open fields marked; raises :class:`SearchInputError` for bad input."""
    from mixle_compile.spec.load import validate_document
    from mixle_compile.spec.source import SourceError, read_source

    name = str(path)
    try:
        doc, diags = read_source(path, display_name=name)
    except SourceError as exc:
        raise SearchInputError([d.text() for d in exc.diagnostics]) from None
    data = doc.data
    if not isinstance(data, dict):
        raise SearchInputError([f"{name}: a spec is a mapping of sections (model, mesh, training, backend, resources)"])
    searched: set[str] = set()
    mesh = data.get("mesh")
    whole_mesh = mesh is None or mesh == "auto"
    if whole_mesh:
        mesh = {}
    if not isinstance(mesh, dict):
        raise SearchInputError([f"{name}: `mesh` must be a mapping of degrees or `auto`"])
    mesh = dict(mesh)
    for key in MESH_FIELDS:
        # Micro-batching splits the global batch: like the micro-batch size, it is chosen unless stated.
        open_when_absent = whole_mesh or devices is not None or key in BATCH_SPLIT
        if mesh.get(key) == "auto" or (key not in mesh and open_when_absent):
            searched.add(f"mesh.{key}")
            mesh.pop(key, None)
    training = data.get("training")
    if not isinstance(training, dict):
        raise SearchInputError([f"{name}: `training` must be a mapping with at least global_batch_size and seq_len"])
    training = dict(training)
    if training.get("global_batch_size") in (None, "auto"):
        raise SearchInputError(
            [
                f"{name}: `training.global_batch_size` must be given: the search keeps the global batch fixed "
                "(it decides convergence) and chooses how to split it; write e.g. `global_batch_size: 256`"
            ]
        )
    for key in TRAINING_FIELDS:
        if training.get(key, "auto") == "auto":
            searched.add(f"training.{key}")
            training.pop(key, None)
    if "mesh.pp" in searched and isinstance(training.get("pipeline_layers"), list):
        raise SearchInputError(
            [
                f"{name}: `training.pipeline_layers` lists a split for one pipeline size while `mesh.pp` is searched; "
                "remove the list (the engine's split is used) or give `mesh.pp`"
            ]
        )
    if data.get("elastic") is not None:
        raise SearchInputError(
            [
                f"{name}: the search chooses a plan for one world size; remove `elastic`, search, then "
                "add the range back "
                "(`check` proves it over the chosen plan)"
            ]
        )
    resources = data.get("resources")
    if not isinstance(resources, dict):
        raise SearchInputError([f"{name}: `resources` must be a mapping with devices, kind and memory"])
    resources = dict(resources)
    if devices is not None:
        if isinstance(resources.get("devices"), list):
            raise SearchInputError([f"{name}: --devices replaces a device count; this spec lists its device groups"])
        resources["devices"] = devices
    elif resources.get("devices") == "auto":
        raise SearchInputError([f"{name}: `resources.devices: auto` needs the budget: give --devices N"])
    world = resources.get("devices")
    if isinstance(world, list):
        world = sum(g.get("count", 1) for g in world if isinstance(g, dict))
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise SearchInputError([f"{name}: `resources.devices` must be a device count (or give --devices N)"])

    # Placeholders the spec validates with: the fixed degrees, dp_shard taking the rest.
    fixed = 1
    for key in ("dp_replicate", "tp", "pp", "cp"):
        value = mesh.get(key, 1)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            fixed *= value
    if "mesh.dp_shard" in searched:
        if world % fixed:
            raise SearchInputError(
                [
                    f"{name}: the fixed mesh degrees multiply to {fixed}, which does not divide the {world} devices; "
                    "change them or set them to `auto`"
                ]
            )
        mesh["dp_shard"] = world // fixed
    base = {**data, "mesh": mesh, "training": training, "resources": resources}
    doc.data = base
    loaded = validate_document(doc, list(diags), Path(path).parent)
    if not loaded.ok:
        raise SearchInputError([d.text() for d in loaded.diagnostics if d.severity is Severity.error])
    spec = loaded.spec
    if getattr(spec.model, "family", None) != Family.TRANSFORMER:
        raise SearchInputError(
            [
                f"{name}: `plan` searches transformer specs (the step-time model prices a transformer's forward "
                f"and backward passes); this model is a {spec.model.family} model"
            ]
        )
    unpriced = step_time.why_not_predicted(spec.model_dump(mode="json", exclude_none=True))
    if unpriced:
        raise SearchInputError([f"{name}: `plan` ranks plans by their predicted step time, and {unpriced}"])
    if is_auto(spec.mesh.dp_shard):
        raise SearchInputError(
            [f"{name}: write `mesh.dp_shard: auto` only with the other degrees fixed; for a search leave it out"]
        )
    if (spec.model.num_experts or 0) == 0:
        for key in ("ep", "etp"):
            searched.discard(f"mesh.{key}")
    return Request(name, base, frozenset(searched), spec.resources.device_count, spec)


# --------------------------------------------------------------------------- enumerating


@dataclass
class Mesh:
    """A factorisation of the devices, and the settings its candidates vary over."""

    degrees: dict[str, int]
    batches: list[dict]
    schedules: list[dict]
    checkpointing: list[str]
    distributed: list[bool]
    sequence_parallel: bool
    bound: float = 0.0  # no candidate of this mesh is estimated faster (seconds)
    order: int = 0
    too_large: list[dict] = field(default_factory=list)  # candidates the memory rule refused

    @property
    def size(self) -> int:
        return len(self.batches) * len(self.schedules) * len(self.checkpointing) * len(self.distributed)

    def values(self, batch: dict, schedule: dict, ckpt: str, dist: bool) -> dict:
        return {
            **self.degrees,
            **batch,
            **schedule,
            "activation_checkpointing": ckpt,
            "distributed_optimizer": dist,
            "sequence_parallel": self.sequence_parallel,
        }

    def candidates(self, refused=None) -> list[dict]:
        """Every candidate, less the schedules ``refused`` (given one candidate of a schedule) refuses whole."""
        out = []
        for sc in self.schedules:
            if refused is not None and refused(
                self.values(self.batches[0], sc, self.checkpointing[0], self.distributed[0])
            ):
                continue
            out += [
                self.values(b, sc, c, d) for b in self.batches for c in self.checkpointing for d in self.distributed
            ]
        return out

    def outgrows(self, values: dict) -> bool:
        """Whether a candidate needs at least the memory of one that did not fit: the same schedule, a
        micro-batch at least as large, no more recomputation, and no distributed optimizer where that
        one had none (the memory model grows with each)."""
        for other in self.too_large:
            if (
                other["pipeline_schedule"] == values["pipeline_schedule"]
                and other["virtual_pipeline_stages"] == values["virtual_pipeline_stages"]
                and other.get("pipeline_layers") == values.get("pipeline_layers")
                and values["micro_batch_size"] >= other["micro_batch_size"]
                and CHECKPOINTING.index(values["activation_checkpointing"])
                <= CHECKPOINTING.index(other["activation_checkpointing"])
                and values["distributed_optimizer"] <= other["distributed_optimizer"]
            ):
                return True
        return False

    def fitting_checkpointing(self, too_large) -> list[str]:
        """The checkpointing modes whose frugal candidate the memory rule does not refuse (``too_large``
        screens one candidate): the mode with the most recomputation first, then the lighter ones."""
        modes = sorted(self.checkpointing, key=CHECKPOINTING.index, reverse=True)
        fitting: list[str] = []
        for mode in modes:
            if too_large(self.frugal(mode)):
                break
            fitting.append(mode)
        return sorted(fitting, key=CHECKPOINTING.index)

    def frugal(self, ckpt: str | None = None) -> dict:
        """The candidate that needs the least memory: the most recomputation, the smallest micro-batch, no
        interleaving, the distributed optimizer where offered (the memory model grows with each of the others)."""
        ckpt = ckpt or max(self.checkpointing, key=CHECKPOINTING.index)
        schedule = min(self.schedules, key=lambda sc: sc["virtual_pipeline_stages"])
        return self.values(self.batches[0], schedule, ckpt, self.distributed[-1])


def enumerate_meshes(req: Request) -> list[Mesh]:
    """Every factorisation of the devices the spec leaves open, with its candidates' settings (pure
    divisibility filters only; validity is the verifier's)."""
    spec = req.spec
    model, mesh, t = spec.model, spec.mesh, spec.training
    W = req.devices
    gb = t.global_batch_size
    s = req.searched

    def choices(key: str, options) -> list:
        section = "mesh" if key in MESH_FIELDS else "training"
        return list(options) if f"{section}.{key}" in s else [getattr(mesh if section == "mesh" else t, key)]

    heads = model.num_heads
    experts = model.num_experts or 0
    # Megatron's accounted splits are searched where the spec leaves the split to the engine.
    accounted = t.pipeline_layers is None and engine_profile(spec.backend).name == Engine.MEGATRON
    # and, for a model with multi-token prediction depths, the layout that counts them too (a
    # --pipeline-model-parallel-layout: Megatron-LM 0.13 and later)
    depths = model.mtp_num_layers if accounted and engine_profile(spec.backend).at_least("0.13") else 0
    out: list[Mesh] = []
    for tp in choices("tp", [d for d in divisors(W) if heads % d == 0]):
        if W % tp:
            continue
        for cp in choices("cp", divisors(W // tp)):
            if W % (tp * cp):
                continue
            for pp in choices("pp", [d for d in divisors(W // (tp * cp)) if d <= model.num_layers]):
                if W % (tp * cp * pp):
                    continue
                dp = W // (tp * cp * pp)
                if gb % dp:
                    continue
                batches = _batch_choices(choices, gb // dp, pp)
                schedules = _schedule_choices(choices, pp, model.num_layers, accounted, depths)
                if not batches or not schedules:
                    continue
                for dp_shard in choices("dp_shard", divisors(dp)):
                    if dp % dp_shard:
                        continue
                    dp_replicate = dp // dp_shard
                    if "mesh.dp_replicate" not in s and dp_replicate != mesh.dp_replicate:
                        continue
                    distributed = choices(
                        "distributed_optimizer", (False, True) if dp_shard == 1 and dp_replicate > 1 else (False,)
                    )
                    sp = choices("sequence_parallel", [tp > 1])[0]
                    for ep, etp in _expert_choices(choices, experts, W // pp, tp):
                        degrees = {
                            "dp_replicate": dp_replicate,
                            "dp_shard": dp_shard,
                            "tp": tp,
                            "pp": pp,
                            "cp": cp,
                            "ep": ep,
                            "etp": etp,
                        }
                        out.append(
                            Mesh(
                                degrees,
                                batches,
                                schedules,
                                choices("activation_checkpointing", CHECKPOINTING),
                                distributed,
                                sp,
                                order=len(out),
                            )
                        )
    return out


def _expert_choices(choices, experts: int, non_pipeline: int, tp: int):
    if experts == 0:
        return [(1, 1)]
    eps = choices("ep", [d for d in divisors(non_pipeline) if experts % d == 0])
    return [(ep, etp) for ep in eps for etp in choices("etp", sorted({1, tp}))]


def _batch_choices(choices, local: int, pp: int) -> list[dict]:
    """Micro-batch size, micro-batches and accumulation splitting one data-parallel rank's share,
    the smallest micro-batch first. Without a pipeline the share is accumulated; with one it runs
    as micro-batches of one schedule (one flush per step: accumulation would only add bubbles)."""
    out = []
    for mbs in choices("micro_batch_size", [d for d in divisors(local) if d <= MAX_MICRO_BATCH]):
        if local % mbs:
            continue
        steps = local // mbs
        for m in choices("microbatches", [1] if pp == 1 else [steps]):
            if steps % m:
                continue
            for ga in choices("gradient_accumulation_steps", [steps // m]):
                if m * ga == steps:
                    out.append({"micro_batch_size": mbs, "microbatches": m, "gradient_accumulation_steps": ga})
    return sorted(out, key=lambda b: b["micro_batch_size"])


def _schedule_choices(choices, pp: int, layers: int, accounted: bool = False, depths: int = 0) -> list[dict]:
    """Schedules and virtual stages; with ``accounted`` each also with Megatron's splits that count the
    embedding and/or the loss as a layer (``pipeline_layers``; layer_split.megatron_accounted), with
    ``depths`` multi-token prediction depths the layout that counts them as well
    (layer_split.megatron_mtp_counted), or, where the layers split none of those ways nor evenly, its
    most balanced splits with the first and/or last pipeline rank's layers set
    (layer_split.megatron_uneven_balanced)."""
    if pp == 1:
        return [
            {"pipeline_schedule": s, "virtual_pipeline_stages": v}
            for s in choices("pipeline_schedule", ["1f1b"])
            for v in choices("virtual_pipeline_stages", [1])
        ]
    out = []
    for schedule in choices("pipeline_schedule", ["1f1b", "interleaved_1f1b"]):
        stages = (
            [1] if schedule != "interleaved_1f1b" else [v for v in range(2, MAX_VIRTUAL_STAGES + 1) if pp * v <= layers]
        )
        for v in choices("virtual_pipeline_stages", stages):
            splits = [
                counts
                for flags in (ACCOUNTED if accounted else ())
                if (counts := megatron_accounted(layers, pp, v, *flags)) is not None
                and len(set(counts)) > 1  # an even one is the engine's own split
            ]
            counted = megatron_mtp_counted(layers, pp, v, depths) if depths else None
            if counted is not None and counted not in splits:
                splits.append(counted)
            if accounted and not splits and layers % (pp * v):
                # neither even nor accounted: the uneven splits with the fewest layers on the busiest rank
                splits = list(megatron_uneven_balanced(layers, pp, v))
            if not splits or layers % (pp * v) == 0:
                # the engine's own split (where Megatron's even split cannot be had and an accounted one
                # can, P001 would refuse it: a divisibility filter, as the others here)
                out.append({"pipeline_schedule": schedule, "virtual_pipeline_stages": v})
            out += [{"pipeline_schedule": schedule, "virtual_pipeline_stages": v, "pipeline_layers": c} for c in splits]
    return out


# --------------------------------------------------------------------------- pricing


class _Pricer:
    """The arithmetic estimate of a candidate's step time (the search's order, not its verdict)."""

    def __init__(self, req: Request):
        from mixle_compile.engines import engine_profile
        from mixle_compile.verify import plan_facts

        self.req = req
        self.spec_data = req.spec.model_dump(mode="json", exclude_none=True)
        self.setting = step_time._setting(self.spec_data)
        self.engine = engine_profile(req.spec.backend)
        self.footprint = plan_facts(req.spec).footprint
        self.order = req.spec.mesh.order or "tp-cp-ep-dp-pp"
        self._compute: dict[tuple, tuple] = {}
        self._links: dict[tuple, float] = {}
        self._latencies: dict[tuple, float] = {}
        self._grad_cache: dict[tuple, Any] = {}
        self._reduced_spec = None
        self._kinds: dict[str, int] | None = None
        self.flops_per_token = step_time.model_flops_per_token(self.spec_data["model"], req.spec.training.seq_len)

    def _stage(self, v: dict) -> tuple[list[int], list[float], list[float], Any, list[int]]:
        """Layers per stage, each stage's seconds (all, attention) per micro-step, and its MoE layers."""
        layers, (per_sample, fixed, attention), st, moe = self._stage_parts(v)
        b = v["micro_batch_size"]
        per_stage = [b * a + f for a, f in zip(per_sample, fixed, strict=True)]
        return layers, per_stage, [b * a for a in attention], st, moe

    def _stage_parts(self, v: dict) -> tuple[list[int], tuple[list[float], list[float], list[float]], Any, list[int]]:
        """Layers per stage, :func:`mixle_compile.step_time.stage_compute_parts` (computed once for
        every micro-batch size) and the mixture-of-experts layers per stage (counted over each
        stage's chunks: step_time.stage_moe_layers)."""
        from mixle_compile.layer_split import split_layers

        key = (
            v["tp"],
            v["cp"],
            v["pp"],
            v["virtual_pipeline_stages"],
            v["activation_checkpointing"],
            v["sequence_parallel"],
            v.get("pipeline_layers"),
        )
        hit = self._compute.get(key)
        if hit is None:
            t = self.req.spec.training
            split = split_layers(
                self.req.spec.model.num_layers,
                v["pp"],
                v["virtual_pipeline_stages"],
                v.get("pipeline_layers") or t.pipeline_layers,
                self.engine.name,
            )
            layers = [split.layers_on_stage(st) for st in range(v["pp"])]
            moe = step_time.stage_moe_layers(split, self.spec_data["model"])
            # A micro-step's compute is affine in its micro-batch size (FLOPs and activations grow
            # with the tokens; a matmul's weight is read once whatever the rows).
            training = {
                **self.spec_data["training"],
                "micro_batch_size": 1,
                "activation_checkpointing": v["activation_checkpointing"],
                "sequence_parallel": v["sequence_parallel"],
            }
            st = step_time._Setting(**{**self.setting.__dict__, "training": training})
            parts = step_time.stage_compute_parts(st, v["tp"], v["cp"], layers, moe)
            hit = self._compute[key] = (layers, parts, st, moe)
        return hit

    def latency(
        self, axes: tuple[str, ...], payload: str, call: tuple[str, int], degrees: dict, mesh_key: tuple
    ) -> float:
        """Seconds one call waits beyond its bytes (:func:`mixle_compile.step_time.call_latency`);
        ``mesh_key`` names the degrees."""
        key = ((axes, payload), call, mesh_key)
        hit = self._latencies.get(key)
        if hit is None:
            collective, size = call
            hit = self._latencies[key] = step_time.call_latency(
                list(axes),
                payload,
                {"collective": collective, "group_size": size},
                degrees,
                self.order,
                self.setting.table,
            )
        return hit

    def link(self, axes: tuple[str, ...], degrees: dict, payload: str | None = None) -> float:
        """The bandwidth of a group over ``axes`` (:func:`mixle_compile.step_time.link_bandwidth`);
        tokens are the expert-parallel all_to_all's, the only collective that carries them
        (lower/updates.py)."""
        collective = "all_to_all" if payload == "token" else None
        key = (
            collective,
            axes,
            degrees["dp_replicate"],
            degrees["dp_shard"],
            degrees["tp"],
            degrees["pp"],
            degrees["cp"],
            degrees["ep"],
            degrees["etp"],
        )
        bw = self._links.get(key)
        if bw is None:
            bw = self._links[key] = step_time.link_bandwidth(
                list(axes), degrees, self.order, self.spec_data, collective
            )
        return bw

    def _reduced(self):
        """The spec's model cut to its first two layers (a dense and a MoE one where it has both), as
        the memory rule's footprint reads it; a model without experts to its first layer (its layers
        are alike, and every figure is taken per layer of a kind)."""
        if self._reduced_spec is None:
            spec = self.req.spec
            model = spec.model
            from mixle_compile.parameters import layer_kinds_model

            reduced = layer_kinds_model(model, 2 if model.num_experts else 1)
            if reduced is not model:
                spec = spec.model_copy(update={"model": reduced})
            self._reduced_spec = spec
        return self._reduced_spec

    def _updates(self, v: dict) -> tuple[Any, list, Any]:
        """The placed parameters of the two-layer model, and their updates per step, each with what its
        count per step grows with ("steps": accumulation steps, "micro": micro-steps, "tokens": the
        micro-batch's tokens times micro-steps, "once"), for one micro-batch of one sample."""
        from mixle_compile.contracts import ParallelPlan
        from mixle_compile.layer_split import split_layers
        from mixle_compile.lower.layouts import place_parameters
        from mixle_compile.lower.updates import gradient_updates
        from mixle_compile.parameters import model_parameters

        key = tuple(
            v[k]
            for k in ("dp_replicate", "dp_shard", "tp", "cp", "ep", "etp", "distributed_optimizer", "sequence_parallel")
        )
        hit = self._grad_cache.get(key)
        if hit is None:
            spec = self._reduced()
            spec = spec.model_copy(
                update={
                    "training": spec.training.model_copy(
                        update={
                            "micro_batch_size": 1,
                            "sequence_parallel": v["sequence_parallel"],
                            "distributed_optimizer": v["distributed_optimizer"],
                        }
                    )
                }
            )
            model = spec.model
            layers = model.num_layers

            def plan(steps: int) -> ParallelPlan:
                return ParallelPlan(
                    dp_replicate=v["dp_replicate"],
                    dp_shard=v["dp_shard"],
                    tp=v["tp"],
                    pp=1,
                    cp=v["cp"],
                    ep=v["ep"],
                    etp=v["etp"],
                    microbatches=1,
                    gradient_accumulation_steps=steps,
                )

            placed = place_parameters(
                model_parameters(spec),
                plan(1),
                num_layers=layers,
                distributed_optimizer=v["distributed_optimizer"],
                num_kv_heads=model.num_kv_heads or model.num_heads,
                fsdp_over_cp=self.engine.fsdp_over_cp,
                layer_split=split_layers(layers, 1, 1, None, self.engine.name, model.mtp_num_layers),
            )
            options = dict(sequence_parallel=v["sequence_parallel"], distributed_optimizer=v["distributed_optimizer"])
            # Counted with 2 accumulation steps of 3 micro-steps each: a count of 1, 2 or 3 per step says
            # whether an update runs once, per accumulation step or per micro-step.
            grows = {1: "once", 2: "steps", 3: "micro"}
            updates = [
                (u, grows[u.occurrences_per_step])
                for u in gradient_updates(placed, plan(2), microbatches_per_step=3, **options)
            ]
            hit = self._grad_cache[key] = (placed, updates, plan(1))
        return hit

    def _where(self, placed_parameter) -> str:
        from mixle_compile.parameters import MTP_EMBEDDING, is_moe_layer, is_mtp_layer

        p = placed_parameter.parameter
        model = self._reduced().model
        if p.layer is None:
            return "first" if p.role == "embedding" and p.name != MTP_EMBEDDING else "last"
        if is_mtp_layer(model, p.layer):  # a multi-token prediction depth: the last stage's
            return "last"
        return "moe" if is_moe_layer(model, p.layer) else "dense"

    def _kind_counts(self) -> dict[str, int]:
        if self._kinds is None:
            from mixle_compile.parameters import is_moe_layer

            model = self._reduced().model
            moe = sum(1 for i in range(model.num_layers) if is_moe_layer(model, i))
            self._kinds = {"moe": moe, "dense": model.num_layers - moe, "first": 1, "last": 1}
        return self._kinds

    def _activations(self, v: dict) -> list:
        """The activation updates alone (they depend on tp, cp, ep, etp, sequence parallelism and what
        checkpointing issues again only)."""
        akey = ("activations", *(v[k] for k in ("tp", "cp", "ep", "etp", "sequence_parallel")), self._recomputing(v))
        if akey not in self._grad_cache:
            from mixle_compile.contracts import ParallelPlan
            from mixle_compile.lower.updates import activation_updates

            spec = self._reduced()
            spec = spec.model_copy(
                update={
                    "training": spec.training.model_copy(
                        update={
                            "micro_batch_size": 1,
                            "sequence_parallel": v["sequence_parallel"],
                            "activation_checkpointing": v["activation_checkpointing"],
                        }
                    )
                }
            )
            plan = ParallelPlan(
                dp_replicate=v["dp_replicate"],
                dp_shard=v["dp_shard"],
                tp=v["tp"],
                pp=1,
                cp=v["cp"],
                ep=v["ep"],
                etp=v["etp"],
            )
            layers = spec.model.num_layers
            self._grad_cache[akey] = [
                (u, "tokens") for u in activation_updates(spec, plan, {i: 0 for i in range(layers)})
            ]
        return self._grad_cache[akey]

    def _recomputing(self, v: dict) -> tuple[bool, ...]:
        """What checkpointing issues again of the collectives this mesh has (EngineProfile.recomputes):
        the activation updates' cache key, so that modes that issue the same share them."""
        mode = v["activation_checkpointing"]
        key = ("recomputing", v["tp"] > 1, v["cp"] > 1, v["ep"] > 1, mode)
        hit = self._grad_cache.get(key)
        if hit is not None:
            return hit
        combos = []
        if v["tp"] > 1:
            # the attention projections' and each MLP kind's (a dense MLP, an MoE block)
            combos += [(c, m) for m in ("attn", "mlp", "moe") for c in ("all_gather", "reduce_scatter", "all_reduce")]
            combos.append(("all_gather", "mla_up_proj"))  # MLA's latents gathered again
        if v["cp"] > 1:
            combos.append(("all_gather", "core_attn"))
        if v["ep"] > 1:
            combos.append(("all_to_all", "moe"))
        modules = self.engine.selective_modules(self.req.spec.training.recompute_modules)
        hit = self._grad_cache[key] = tuple(self.engine.recomputes(mode, c, m, modules) for c, m in combos)
        return hit

    def _summary_key(self, v: dict, activations: bool) -> tuple:
        """What :meth:`_summary` depends on in ``v``."""
        return (
            "summary",
            activations,
            *(v[k] for k in ("tp", "cp", "ep", "etp", "sequence_parallel")),
            *(
                (self._recomputing(v),)
                if activations
                else (v["dp_replicate"], v["dp_shard"], v["distributed_optimizer"])
            ),
        )

    def _summary(self, v: dict, activations: bool, key: tuple | None = None) -> dict:
        """The activation updates' (else the parameters' updates') bytes per step summed by (layer
        kind, what they grow with, axes, payload)."""
        if key is None:
            key = self._summary_key(v, activations)
        hit = self._grad_cache.get(key)
        if hit is None:
            if activations:
                placed, updates = (), self._activations(v)
            else:
                placed, updates, _ = self._updates(v)
            where = {p.name: self._where(p) for p in placed}
            model = self._reduced().model
            # Under async tensor parallelism each tp activation collective hides inside the matmuls it
            # is fused with (step_time.fused_matmul_flops): entries are kept apart by those matmuls.
            overlap = bool(self.spec_data["training"].get("async_tensor_parallel")) and v["tp"] > 1
            training = {"activation_checkpointing": v["activation_checkpointing"]}
            tokens = self.req.spec.training.seq_len / v["cp"]  # one sample's rows
            hit = {}
            for u, grows in updates:
                axes = tuple(str(getattr(a, "value", a)) for a in u.update.mesh_axes)
                if "tied" in axes or axes == ("pp",):
                    continue
                kind = where.get(u.tensor) or _site_kind(u.tensor, model)
                slot = hit.setdefault(kind, {}).setdefault(grows, {})
                # per occurrence for gradients and gathers (scaled by what they grow with); activations
                # carry their per-micro-step count (virtual boundaries) already
                nbytes = u.bytes_per_rank_per_step / (u.occurrences_per_step if grows != "tokens" else 1)
                fused = None
                if overlap and axes == ("tp",) and u.update.payload.value == "activation":
                    flops, linear = step_time.fused_matmul_flops(
                        u.update.node_id, self.spec_data["model"], training, self.engine.name, v["tp"]
                    )
                    fused = (flops, linear) if flops else None
                entry = slot.setdefault((axes, u.update.payload.value, fused), [0.0, {}, 0.0])
                entry[0] += nbytes
                if fused is not None:
                    entry[2] += u.occurrences_per_step * tokens * fused[0]
                # calls per occurrence, or (activations) per micro-step of the one-micro-step plan
                call = (u.update.collective.value, u.group_size)
                entry[1][call] = entry[1].get(call, 0) + (u.occurrences_per_step if grows == "tokens" else 1)
            for by_growth in hit.values():
                for entries in by_growth.values():
                    for entry in entries.values():
                        entry[1] = tuple(entry[1].items())
            self._grad_cache[key] = hit
        return hit

    def _traffic(self, v: dict, dense: int, moe: int, first: bool, last: bool, activations_only: bool = False) -> list:
        """Bytes per step each rank of a stage with these layers sends, by axes and payload (no pp),
        and the seconds the calls that carry them wait (:meth:`latency`)."""
        keys = (self._summary_key(v, True), None if activations_only else self._summary_key(v, False))
        mesh_key = tuple(v[k] for k in MESH_KEY)
        stage = (dense, moe, first, last)
        ga, micro = v["gradient_accumulation_steps"], v["microbatches"] * v["gradient_accumulation_steps"]
        key = ("traffic", keys, stage, mesh_key, ga, micro, v["micro_batch_size"])
        hit = self._grad_cache.get(key)
        if hit is None:
            scale = {"once": 1, "steps": ga, "micro": micro, "tokens": micro * v["micro_batch_size"]}
            calls_scale = {**scale, "tokens": micro}
            out: dict[tuple, list] = {}
            for grows, entries in self._traffic_rows(v, keys, stage, mesh_key).items():
                factor, calls_factor = scale[grows], calls_scale[grows]
                for entry, nbytes, wait, flops in entries:
                    total = out.get(entry)
                    if total is None:
                        total = out[entry] = [0.0, 0.0, 0.0]
                    total[0] += nbytes * factor
                    total[1] += wait * calls_factor
                    total[2] += flops * factor
            hit = self._grad_cache[key] = [
                (axes, payload, nbytes, wait, None if fused is None else (flops, fused[1]))
                for (axes, payload, fused), (nbytes, wait, flops) in out.items()
            ]
        return hit

    def _traffic_rows(self, v: dict, keys: tuple, stage: tuple, mesh_key: tuple) -> dict:
        """:meth:`_traffic` per unit of what each entry grows with: by growth, (entry, bytes, seconds
        its calls wait, fused FLOPs) for a stage of ``stage`` = (dense, moe, first, last) layers."""
        key = ("traffic rows", keys, stage, mesh_key)
        hit = self._grad_cache.get(key)
        if hit is not None:
            return hit
        parts = [self._summary(v, True, keys[0])] + ([] if keys[1] is None else [self._summary(v, False, keys[1])])
        kinds = self._kind_counts()
        dense, moe, first, last = stage
        times = {"dense": dense, "moe": moe, "first": int(first), "last": int(last)}
        degrees = {**{k: v[k] for k in MESH_KEY}, "world_size": self.req.devices}
        rows: dict[str, dict[tuple, list]] = {}
        for kind, by_growth in (item for summary in parts for item in summary.items()):
            if not times[kind] or not kinds[kind]:
                continue
            share = times[kind] / kinds[kind]
            for grows, entries in by_growth.items():
                into = rows.setdefault(grows, {})
                for entry, (nbytes, calls, flops) in entries.items():
                    total = into.get(entry)
                    if total is None:
                        total = into[entry] = [0.0, 0.0, 0.0]
                    total[0] += nbytes * share
                    total[2] += flops * share
                    for call, n in calls:
                        total[1] += n * share * self.latency(entry[0], entry[1], call, degrees, mesh_key)
        hit = self._grad_cache[key] = {
            grows: [(entry, *total) for entry, total in into.items()] for grows, into in rows.items()
        }
        return hit

    def _state_bytes(self, v: dict, dense: int, moe: int, first: bool, last: bool) -> float:
        """Parameters, gradients and optimizer state a rank of the stage holds, as the lowering prices them."""
        from mixle_compile.lower.memory import stage_memory

        key = (
            "state",
            *(
                v[k]
                for k in (
                    "dp_replicate",
                    "dp_shard",
                    "tp",
                    "cp",
                    "ep",
                    "etp",
                    "distributed_optimizer",
                    "sequence_parallel",
                )
            ),
        )
        per = self._grad_cache.get(key)
        if per is None:
            placed, _, plan = self._updates(v)
            kinds = self._kind_counts()
            per = {}
            for kind in kinds:
                mine = tuple(p for p in placed if self._where(p) == kind)
                if mine and kinds[kind]:
                    m = stage_memory(self._reduced(), plan, mine)[0]
                    per[kind] = (m.parameters + m.gradients + m.optimizer_state) / kinds[kind]
            self._grad_cache[key] = per
        times = {"dense": dense, "moe": moe, "first": int(first), "last": int(last)}
        return sum(per.get(kind, 0.0) * n for kind, n in times.items())

    def bound(self, mesh: Mesh) -> float:
        """Seconds no candidate of ``mesh`` is estimated below: the least compute over its layer splits
        (no more recomputation than its lightest checkpointing), its tp, ep and pp traffic (the same for
        every micro-batch split, pp's least without interleaving), and the bubble of its most micro-batches
        and virtual stages; data-parallel and context-parallel exposure and the optimizer step count 0."""
        from mixle_compile.schedules import bubble_chunks, bubble_fraction

        batch = mesh.batches[0]
        least = min(mesh.checkpointing, key=CHECKPOINTING.index)
        micro_steps = batch["microbatches"] * batch["gradient_accumulation_steps"]
        degrees = {**mesh.degrees, "world_size": self.req.devices}
        key = (
            "bound",
            mesh.degrees["tp"],
            mesh.degrees["cp"],
            mesh.degrees["pp"],
            mesh.degrees["ep"],
            mesh.degrees["etp"],
            mesh.sequence_parallel,
            least,
            batch["micro_batch_size"],
            micro_steps,
            tuple((sc["virtual_pipeline_stages"], sc.get("pipeline_layers")) for sc in mesh.schedules),
        )
        hit = self._grad_cache.get(key)
        if hit is None:
            compute = exposed = math.inf
            stages = []
            for sc in mesh.schedules:
                # The tokens' compute is the same for every micro-batch split; each micro-step also
                # reads the weights once, so the split with the fewest micro-steps costs least.
                values = mesh.values(batch, sc, least, False)
                layers, (per_sample, fixed, _), st, moe_per_stage = self._stage_parts(values)
                per_stage = [batch["micro_batch_size"] * a + f for a, f in zip(per_sample, fixed, strict=True)]
                for split in mesh.batches:
                    steps = split["microbatches"] * split["gradient_accumulation_steps"]
                    b = split["micro_batch_size"]
                    compute = min(compute, steps * max(b * a + f for a, f in zip(per_sample, fixed, strict=True)))
                busiest = max(range(len(per_stage)), key=per_stage.__getitem__)
                count = layers[busiest]
                moe = moe_per_stage[busiest]
                # what async tensor parallelism cannot hide of it (step_time.combine) counts
                tp = mesh.degrees["tp"]
                seconds = sum(
                    max(0.0, nbytes / self.link(axes, degrees) - step_time.fused_seconds(st, fused) * (tp - 1) / tp)
                    for axes, payload, nbytes, _, fused in self._traffic(
                        values, count - moe, moe, busiest == 0, busiest == len(layers) - 1, activations_only=True
                    )
                    if axes in (("tp",), ("ep",))
                )
                exposed = min(exposed, seconds)
                stages.append((count - moe, busiest == 0, busiest == len(layers) - 1))
            hit = self._grad_cache[key] = (compute, exposed, stages)
        compute, exposed, stages = hit
        data = min(self._data_lower_bound(mesh, degrees, *stage) for stage in stages)
        # Data-parallel traffic hides behind compute up to the compute's length: the step is busy for
        # at least the longer of the two.
        busy = max(compute, data) + exposed
        pp = mesh.degrees["pp"]
        if pp == 1:
            return busy
        runs = self.engine.schedule_microbatches(batch["microbatches"], batch["gradient_accumulation_steps"])
        f = min(
            bubble_fraction(pp, runs, bubble_chunks(sc["pipeline_schedule"], sc["virtual_pipeline_stages"]))
            for sc in mesh.schedules
        )
        return busy + busy * f / (1 - f)

    def _data_lower_bound(self, mesh: Mesh, degrees: dict, dense: int, first: bool, last: bool) -> float:
        """Seconds the data-parallel collectives of a stage's dense parameters take at least: the
        layouts' (lower/layouts.py) reduce-scatter and gathers over the FSDP axes, or all-reduce (a
        distributed optimizer's reduce-scatter and gather) over the replicated ones, of the unpadded
        shards, with the fewest micro-steps the mesh offers. Experts, padding, the replicas' reduction
        and tp's own gradient reductions only add to it."""
        fp = self.footprint
        d = mesh.degrees
        key = ("dense elements", d["tp"], dense, first, last)
        elements = self._grad_cache.get(key)
        if elements is None:
            elements = 0.0
            for place, n in (
                ("every_layer", dense),
                ("dense_layer", dense),
                ("first_stage", int(first)),
                ("last_stage", int(last)),
            ):
                if n:
                    elements += n * (
                        fp.share(place, "tensor_parallel").elements / d["tp"] + fp.share(place, "replicated").elements
                    )
            self._grad_cache[key] = elements
        batch = mesh.batches[-1]
        micro = batch["microbatches"] * batch["gradient_accumulation_steps"]
        element_bytes = 4 if self.req.spec.training.precision == "fp32" else 2
        if fsdp_shards(dp_shard=d["dp_shard"], cp=d["cp"], over_cp=self.engine.fsdp_over_cp):
            axes = tuple(a for a in SHARD_AXES if d[a] > 1)
            n = math.prod(d[a] for a in axes)
            nbytes = (n - 1) / n * elements * (4 * batch["gradient_accumulation_steps"] + 2 * micro * element_bytes)
        else:
            axes = tuple(a for a in DATA_AXES if d[a] > 1)
            if not axes:
                return 0.0
            n = math.prod(d[a] for a in axes)
            nbytes = (n - 1) / n * elements * min(8, 4 + element_bytes if True in mesh.distributed else 8)
        return nbytes / self.link(axes, degrees)

    def price(self, v: dict) -> step_time.StepTime:
        from mixle_compile.schedules import bubble_chunks, bubble_fraction

        model = self.req.spec.model
        t = self.req.spec.training
        layers, per_stage, attention_of, st, moe_per_stage = self._stage(v)
        tp, cp, pp = v["tp"], v["cp"], v["pp"]
        world = self.req.devices
        degrees = {
            k: v[k]
            for k in (
                "dp_replicate",
                "dp_shard",
                "tp",
                "pp",
                "cp",
                "ep",
                "etp",
                "microbatches",
                "gradient_accumulation_steps",
            )
        }
        degrees["world_size"] = world
        micro_steps = v["microbatches"] * v["gradient_accumulation_steps"]
        busiest = max(range(len(per_stage)), key=per_stage.__getitem__)
        count = layers[busiest]
        act = 4 if t.precision == "fp32" else 2
        tokens = v["micro_batch_size"] * t.seq_len // cp
        hidden = tokens * model.hidden_size * act
        sp = v["sequence_parallel"]
        mesh_key = tuple(degrees[k] for k in MESH_KEY)
        moe_layers = moe_per_stage[busiest]
        # Per-layer activation collectives (tp, cp, ep) and the data-parallel gradients and parameter
        # gathers: the lowering's own updates (lower/updates.py) for the model cut to two layers,
        # scaled to the stage's layers, micro-batch and micro-steps; in seconds over their links
        # (the same for every candidate sharing the traffic and the compute setting).
        rows = self._traffic(v, count - moe_layers, moe_layers, busiest == 0, busiest == pp - 1)
        key = ("seconds", id(rows), id(st))  # both are kept in the pricer's caches
        timed = self._grad_cache.get(key)
        if timed is None:
            timed = self._grad_cache[key] = [
                (
                    list(axes),
                    payload,
                    nbytes / self.link(axes, degrees, payload) + waited,
                    step_time.fused_seconds(st, fused),
                )
                for axes, payload, nbytes, waited, fused in rows
                if nbytes > 0
            ]
        traffic = list(timed)
        if pp > 1:
            # Pipeline sends between stages (lower/updates.py activation_updates): the stage's output
            # forward and its gradient backward, per micro-batch and virtual boundary.
            boundary = hidden / (tp if sp else 1)
            if self.engine.name == "megatron" and tp > 1 and not sp:
                boundary /= tp
            # The busiest stage sends forward over each virtual boundary it ends and backward over
            # each it starts (virtual stage w hands over to w + 1 on stage (w + 1) % pp).
            chunks = max(1, v["virtual_pipeline_stages"])
            ends = sum(1 for w in range(pp * chunks - 1) if w % pp == busiest)
            starts = sum(1 for w in range(pp * chunks - 1) if (w + 1) % pp == busiest)
            nbytes = micro_steps * (ends + starts) * boundary
            if nbytes > 0:
                waited = (
                    micro_steps * (ends + starts) * self.latency(("pp",), "activation", ("p2p", 2), degrees, mesh_key)
                )
                traffic.append((["pp"], "activation", nbytes / self.link(("pp",), degrees) + waited, 0.0))

        state = self._state_bytes(v, count - moe_layers, moe_layers, busiest == 0, busiest == pp - 1)
        bubble = 0.0
        if pp > 1:
            runs = self.engine.schedule_microbatches(v["microbatches"], v["gradient_accumulation_steps"])
            bubble = bubble_fraction(pp, runs, bubble_chunks(v["pipeline_schedule"], v["virtual_pipeline_stages"]))
        return step_time.combine(
            st,
            degrees,
            micro_steps * per_stage[busiest],
            micro_steps * attention_of[busiest],
            traffic,
            bubble,
            state,
            self.flops_per_token,
            pipeline_overlapped=self.engine.overlaps_pipeline_transfers(
                v["pipeline_schedule"], v["virtual_pipeline_stages"], t.overlap_pipeline_transfers
            ),
        )


def _site_kind(site: str, model) -> str:
    """Where an activation collective's site sits: ``layers.3.attn`` in layer 3, ``embed`` first, ``lm_head`` last."""
    from mixle_compile.parameters import is_moe_layer, is_mtp_layer

    if site.startswith("layers."):
        layer = int(site.split(".")[1])
        if is_mtp_layer(model, layer):  # a multi-token prediction depth: the last stage's
            return "last"
        return "moe" if is_moe_layer(model, layer) else "dense"
    return "first" if site.startswith("embed") else "last"


# --------------------------------------------------------------------------- the search


def spec_data_for(req: Request, values: dict) -> dict:
    """The complete spec of a candidate (what --write emits)."""
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in req.data.items()}
    mesh, training = data["mesh"], data["training"]
    for key in MESH_FIELDS:
        mesh[key] = values[key]
    for key in TRAINING_FIELDS:
        training[key] = values[key]
    if values.get("pipeline_layers") is not None:
        training["pipeline_layers"] = list(values["pipeline_layers"])
    if values["pp"] == 1:
        training["pipeline_schedule"] = (
            req.spec.training.pipeline_schedule if "training.pipeline_schedule" not in req.searched else "1f1b"
        )
    return data


def search(req: Request, top: int = DEFAULT_TOP, *, variants: bool = False, tight: bool = False) -> Outcome:
    """The ``top`` fastest plans `check` accepts, best first (see the module docstring): one per
    mesh (its degrees, :data:`MESH_KEY`) with that mesh's fastest settings, or with ``variants``
    every plan, so that settings variants of one mesh (accumulation steps, micro-batch size,
    checkpointing) may fill the list.

    A plan keeps the caching allocator's usual reserve beside its live tensors (R002 holds: `check`
    gives it no memory warning): one that fits only when the allocator gives its cache back runs with
    allocation retries, each a device synchronisation the step time does not price, and fragmentation
    can still fail it. ``tight`` admits such plans (R001 alone)."""
    import heapq

    from mixle_compile.verify.engine import PlanVerifier
    from mixle_compile.verify.facts import ENUMS
    from mixle_compile.verify.symbols import broken_rules, broken_rules_reading

    outcome = Outcome(req)
    meshes = enumerate_meshes(req)
    outcome.enumerated = sum(m.size for m in meshes)
    if not meshes:
        outcome.reason = _no_factorisation(req)
        return outcome
    pricer = _Pricer(req)

    verifier = PlanVerifier()  # one encoding per layer split: the candidates share the rest of the structure
    rules_of = RuleSets(req, tight=tight)
    refused_by = MEMORY_RULE  # the memory rule that refused the last candidate `too_large` screened

    def screen(values: dict) -> list:
        outcome.screened += 1
        facts, cheap, memory = rules_of(values)
        symbol_values = _symbol_values(values, ENUMS)
        broken = broken_rules(facts, cheap, symbol_values) or broken_rules(facts, memory, symbol_values)
        outcome.rejections.update(r.code for r in broken)
        return broken

    def too_large(values: dict) -> bool:
        nonlocal refused_by
        outcome.screened += 1
        facts, _, memory = rules_of(values)
        broken = broken_rules(facts, memory, _symbol_values(values, ENUMS))
        # the caller counts the candidates of the modes this probe drops (the probe is one of them)
        if broken:
            refused_by = broken[0].code
        return bool(broken)

    def group_refused(values: dict, mesh: Mesh) -> bool:
        """Whether a rule other than memory refuses ``values`` reading none of the settings that vary
        within its mesh and schedule: then it refuses every candidate of that group."""
        outcome.screened += 1
        facts, cheap, _ = rules_of(values)
        for rule, read in broken_rules_reading(facts, cheap, _symbol_values(values, ENUMS)):
            if "*" not in read and not read & VARYING:
                outcome.rejections[rule.code] += len(mesh.batches) * len(mesh.checkpointing) * len(mesh.distributed)
                return True
        return False

    # Best first over meshes and candidates. A mesh waits in `pending` under a bound no candidate of
    # it is estimated below; when it comes first, the checkpointing modes that cannot fit are dropped
    # (the memory model grows with every setting its candidates vary, so a mode whose frugal candidate
    # does not fit never does), its bound is recomputed, and once it is still first its candidates are
    # priced into `heap`. Candidates thus leave `heap` in the order of their estimates.
    pending = [(pricer.bound(m), m.order, False, m) for m in meshes]
    heapq.heapify(pending)
    sequence = itertools.count(len(meshes))  # the order of the schedules' parts among equal bounds
    heap: list[tuple[float, int, dict, Mesh]] = []
    count = 0
    chosen: list[Plan] = []
    taken: set[tuple[int, ...]] = set()  # the meshes of the chosen plans
    while len(chosen) < top:
        while pending and (not heap or heap[0][0] > pending[0][0] * (1 + TOLERANCE)):
            _, order, fitted, mesh = heapq.heappop(pending)
            if not fitted:
                modes = mesh.fitting_checkpointing(too_large)
                if not modes:
                    outcome.rejections[refused_by] += mesh.size
                    continue
                outcome.rejections[refused_by] += (
                    mesh.size // len(mesh.checkpointing) * (len(mesh.checkpointing) - len(modes))
                )
                mesh.checkpointing = modes
                heapq.heappush(pending, (pricer.bound(mesh), order, True, mesh))
                continue
            if len(mesh.schedules) > 1:
                # Its schedules (virtual stages, layer splits) wait apart, each under its own bound,
                # the modes that fit kept: a schedule that cannot win is never priced.
                for schedule in mesh.schedules:
                    part = dataclasses.replace(mesh, schedules=[schedule])
                    heapq.heappush(pending, (pricer.bound(part), next(sequence), True, part))
                continue
            for values in mesh.candidates(refused=lambda group, mesh=mesh: group_refused(group, mesh)):
                heapq.heappush(heap, (pricer.price(values).seconds, count, values, mesh))
                count += 1
        if not heap:
            break
        estimate, _, values, mesh = heapq.heappop(heap)
        if not variants and tuple(values[k] for k in MESH_KEY) in taken:
            continue  # candidates leave the heap fastest first: this mesh's best is already chosen
        if mesh.outgrows(values):
            outcome.rejections[MEMORY_RULE] += 1
            continue
        broken = screen(values)
        if broken:
            if any(r.code in MEMORY_RULES for r in broken):
                mesh.too_large.append(values)
            continue
        outcome.confirmed += 1
        loaded = _check(req, values, verifier, tight=tight)
        if loaded is None:
            outcome.refused_by_check += 1
            continue
        chosen.append(_plan(req, loaded, values, pricer.price(values)))
        taken.add(tuple(values[k] for k in MESH_KEY))
    if not chosen:
        outcome.reason = _rejection_text(outcome)
        return outcome
    # Plans the model prices the same (to a millionth) are ranked by their memory: the one with more
    # room left first.
    fastest = min(p.step.seconds for p in chosen)
    chosen.sort(key=lambda p: (round(p.step.seconds / fastest, 6), p.memory_bytes))
    for above, plan in zip(chosen, chosen[1:], strict=False):
        plan.reason = loses_because(plan.step, above.step)
        if not plan.reason:
            plan.reason = _tie_reason(plan, above)
    outcome.plans = chosen
    return outcome


class RuleSets:
    """The verifier's facts and the rules the search reads with values, per layer split: the spec's,
    and each listed split a candidate carries (a split is a fact, not a symbol). Called with a
    candidate: (facts, the rules other than memory, the memory rules); the memory rules cost most to
    read, so the search reads them only for a candidate the others accept. Only errors, and the
    allocator-reserve warning (R002) unless ``tight``."""

    def __init__(self, req: Request, *, tight: bool = False):
        self.req, self.tight = req, tight
        self._by_split: dict[Any, tuple] = {}

    def __call__(self, values: dict) -> tuple:
        from mixle_compile.verify import plan_facts
        from mixle_compile.verify.rule import rules_for

        split = values.get("pipeline_layers")
        hit = self._by_split.get(split)
        if hit is None:
            spec = self.req.spec
            if split is not None:
                spec = spec.model_copy(
                    update={"training": spec.training.model_copy(update={"pipeline_layers": list(split)})}
                )
            facts = plan_facts(spec)
            rules = tuple(
                r
                for r in rules_for(facts)
                if r.constraint is not None
                and (r.severity is Severity.error or (r.code == HEADROOM_RULE and not self.tight))
            )
            hit = self._by_split[split] = (
                facts,
                tuple(r for r in rules if r.code not in MEMORY_RULES),
                tuple(r for r in rules if r.code in MEMORY_RULES),
            )
        return hit


MEMORY_RULE = "R001"
#: The allocator-reserve warning: the search keeps to plans it does not fire for (unless ``tight``).
HEADROOM_RULE = "R002"
MEMORY_RULES = frozenset({MEMORY_RULE, HEADROOM_RULE})
#: The settings that vary among one mesh's candidates of one schedule.
VARYING = frozenset(
    {
        "micro_batch_size",
        "microbatches",
        "gradient_accumulation_steps",
        "activation_checkpointing",
        "distributed_optimizer",
    }
)


def _symbol_values(values: dict, enums: dict) -> dict:
    out = dict(values)
    out.pop("pipeline_layers", None)  # a fact of the split's own (search.RuleSets)
    for key in ("activation_checkpointing", "pipeline_schedule"):
        out[key] = enums[key].index(values[key])
    return out


def _check(req: Request, values: dict, verifier, *, tight: bool = False) -> Any:
    """The candidate's spec, loaded and accepted by the real check, or None; unless ``tight``, also
    None when check warns that it fits only without the allocator's reserve (R002)."""
    import yaml

    from mixle_compile.check import check_loaded
    from mixle_compile.spec import load_spec_text

    loaded = load_spec_text(yaml.safe_dump(spec_data_for(req, values), sort_keys=False), req.file)
    checked = check_loaded(loaded, verifier=verifier)
    if checked.errors or loaded.spec is None:
        return None
    if not tight and any(d.code == HEADROOM_RULE for d in checked.diagnostics):
        return None
    return loaded


def _plan(req: Request, loaded, values: dict, st: step_time.StepTime) -> Plan:
    """A confirmed candidate with its step time and the memory rule's (R001) bound on its heaviest rank."""
    from mixle_compile.verify import plan_facts
    from mixle_compile.verify.logic import concrete
    from mixle_compile.verify.rules.memory import per_rank_bytes
    from mixle_compile.verify.symbols import Symbols

    symbols = Symbols(plan_facts(loaded.spec), values={})
    with concrete():
        memory = float(sum(per_rank_bytes(symbols).values()))
    return Plan(
        dict(values), spec_data_for(req, values), st, memory, int(loaded.spec.resources.memory or 0), st.seconds
    )


def _tie_reason(plan, above) -> str:
    """Why ``plan`` follows ``above`` when :func:`loses_because` calls their step times a tie: equal
    times (to a millionth) are ranked by memory, the one with more room first; a difference below
    0.05% still orders them, and is named as such."""
    more = plan.memory_bytes - above.memory_bytes
    memory = "the same memory per rank"
    if abs(more) >= 2**26:
        memory = f"{_gib(abs(more))} {'more' if more > 0 else 'less'} memory per rank"
    slower = (plan.step.seconds - above.step.seconds) / above.step.seconds
    if round(slower, 6) <= 0:
        if more >= 2**26:
            return f"the same predicted step time, {memory}"
        return f"the same predicted step time, {memory} (ranked by its order in the search)"
    return f"+{slower:.2%} step time, a difference the model does not resolve; {memory}"


def loses_because(slower: step_time.StepTime, faster: step_time.StepTime) -> str:
    """What makes ``slower`` slower than ``faster``: the part of the step that grew the most ("" for a tie)."""

    def parts(st: step_time.StepTime) -> dict[str, float]:
        out = {"compute": st.compute, "pipeline bubble": st.bubble, "optimizer step": st.optimizer}
        for axes, seconds in st.exposed_communication.items():
            out[f"exposed {axes} communication"] = seconds
        return out

    a, b = parts(slower), parts(faster)
    deltas = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in set(a) | set(b)}
    key = max(sorted(deltas), key=lambda k: deltas[k])
    total = (slower.seconds - faster.seconds) / faster.seconds
    if total < 5e-4:
        return ""  # a tie: the caller says how the two compare in memory
    if deltas[key] <= 0:
        return f"+{total:.1%} step time"
    return f"+{deltas[key] / faster.seconds:.1%} {key} (+{total:.1%} step time)"


def _no_factorisation(req: Request) -> str:
    gb = req.spec.training.global_batch_size
    return (
        f"no mesh of the fixed and searched degrees uses exactly {req.devices} devices with a data-parallel size "
        f"that divides the global batch {gb}: change the device count, the global batch or the fixed degrees"
    )


def _rejection_text(outcome: Outcome) -> str:
    from mixle_compile.verify.rule import RULES

    if not outcome.rejections:
        return f"all {outcome.confirmed} screened candidates were refused by `check`"
    common = outcome.rejections.most_common(3)
    names = "; ".join(f"{code} {RULES[code].name} ({n:,} candidate{'s' * (n != 1)})" for code, n in common)
    return (
        f"every one of the {outcome.enumerated:,} candidates breaks a verifier rule; most often: {names}. "
        f"`mixle-compile explain {common[0][0]}` says what the rule needs"
    )


# --------------------------------------------------------------------------- reports


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}GiB"


def outcome_text(outcome: Outcome) -> str:
    req = outcome.request
    spec = req.spec
    kind = f"{spec.resources.kind} " if spec.resources.kind else ""
    head = (
        f"{req.file}: {req.devices} {kind}devices, global batch {spec.training.global_batch_size}, "
        f"{spec.backend if isinstance(spec.backend, str) else spec.backend.name}: {outcome.enumerated:,} candidates, "
        f"{outcome.screened:,} screened, {outcome.confirmed} checked"
    )
    lines = [head]
    if not outcome.plans:
        lines.append(f"no valid plan: {outcome.reason}")
        return "\n".join(lines) + "\n"
    for i, p in enumerate(outcome.plans, 1):
        st = p.step
        mfu = f", MFU {st.mfu:.1%}" if st.mfu is not None else ""
        lines.append(f"#{i} {p.mesh_text()}")
        lines.append(f"   {p.training_text()}")
        seconds = step_time.seconds_text
        lines.append(
            f"   step {seconds(st.seconds)}, {st.tokens_per_second_per_device:,.0f} tokens/s per device, "
            f"{st.tflops_per_device:.0f} TFLOP/s per device{mfu}"
        )
        exposed = ", ".join(f"{k} {seconds(v)}" for k, v in sorted(st.exposed_communication.items())) or "none"
        lines.append(
            f"   compute {seconds(st.compute)}, exposed communication: {exposed}, bubble {seconds(st.bubble)}, "
            f"optimizer {seconds(st.optimizer)}; memory {_gib(p.memory_bytes)} of {_gib(p.device_memory)} per rank"
        )
        if p.reason:
            lines.append(f"   loses to #{i - 1}: {p.reason}")
    return "\n".join(lines) + "\n"


def outcome_data(outcome: Outcome) -> dict:
    return {
        "file": outcome.request.file,
        "devices": outcome.request.devices,
        "searched": sorted(outcome.request.searched),
        "enumerated": outcome.enumerated,
        "screened": outcome.screened,
        "checked": outcome.confirmed,
        "found": bool(outcome.plans),
        "reason": outcome.reason or None,
        "rejections": dict(outcome.rejections.most_common()),
        "plans": [
            {
                "rank": i,
                "settings": p.values,
                "step_time": p.step.as_dict(),
                "memory_per_rank_bytes": p.memory_bytes,
                "device_memory_bytes": p.device_memory,
                "loses_because": p.reason or None,
            }
            for i, p in enumerate(outcome.plans, 1)
        ],
    }


def spec_yaml(plan: Plan, source: str) -> str:
    import yaml

    st = plan.step
    head = (
        f"# chosen by `mixle-compile plan {source}`: predicted step {step_time.seconds_text(st.seconds)}, "
        f"{st.tokens_per_second_per_device:,.0f} tokens/s per device\n"
    )
    return head + yaml.safe_dump(plan.spec_data, sort_keys=False)

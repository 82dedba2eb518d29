"""Devices and world size (D0xx)."""

from __future__ import annotations

from mixle_compile.schedules import NUMBERS
from mixle_compile.spec.models import auto_divisor, auto_dp_shard, auto_resolves
from mixle_compile.verify.logic import all_of, implies
from mixle_compile.verify.rule import EVERY_FAMILY, Rule, define
from mixle_compile.verify.wording import alternatives


def _world_hint(x) -> str:
    others = auto_divisor(dp_replicate=x.dp_replicate, tp=x.tp, pp=x.pp, cp=x.cp)
    if auto_resolves(x.devices, others):
        resolved = auto_dp_shard(NUMBERS, devices=x.devices, dp_replicate=x.dp_replicate, tp=x.tp, pp=x.pp, cp=x.cp)
        return f"use dp_shard: {resolved} (or dp_shard: auto)"
    return (
        f"choose degrees whose product is {x.devices}, e.g. leave dp_shard: auto and make "
        f"dp_replicate*tp*pp*cp divide {x.devices}"
    )


WORLD_SIZE = define(
    Rule(
        code="D001",
        name="world-size",
        title="The mesh's degrees multiply to the number of devices.",
        docs=(
            "Every rank belongs to exactly one coordinate of the device mesh, so "
            "`dp_replicate * dp_shard * tp * pp * cp` must equal the number of devices. `ep` and `etp` are "
            "not factors: expert groups are carved out of the ranks the other axes already use. With "
            "`dp_shard: auto` the data-parallel shard degree takes the ranks left over, and a device count "
            "that leaves no whole degree is reported by the spec check S012 instead."
        ),
        engine_reference=(
            "torchtitan `ParallelDims._validate` (dp_replicate * dp_shard * cp * tp * pp == world_size); "
            "Megatron-Core `initialize_model_parallel` (world size divisible by tp * pp * cp)"
        ),
        constraint=lambda v: v.world == v.devices,
        explain=lambda x: (
            f"dp_replicate*dp_shard*tp*pp*cp = {x.dp_replicate}*{x.dp_shard}*{x.tp}*{x.pp}*{x.cp} = {x.world}, "
            f"but there are {x.devices} devices"
        ),
        hint=_world_hint,
        fields=("dp_shard", "dp_replicate", "tp", "pp", "cp", "devices"),
        families=EVERY_FAMILY,
    )
)

ELASTIC_AXIS = define(
    Rule(
        code="D002",
        name="elastic-axis",
        title="An elastic range needs `dp_shard: auto` as its elastic axis.",
        docs=(
            "`elastic: {min_world_size, max_world_size, multiple_of}` says the job may run on any of those "
            "world sizes. Only the data-parallel shard degree can follow the world size without changing "
            "the model's layout, so it must be `auto`; every other degree stays fixed."
        ),
        engine_reference="torch.distributed.elastic (torchrun --nnodes=MIN:MAX) restarts workers at a new world size",
        constraint=lambda v: implies(v.elastic, v.dp_shard_auto),
        explain=lambda x: "an elastic range needs an elastic axis, but mesh.dp_shard is a fixed number",
        hint=lambda x: "write `dp_shard: auto` so that the data-parallel size follows the world size",
        fields=("elastic", "dp_shard_auto"),
        families=EVERY_FAMILY,
        needs=("elastic_min_world_size",),
        elastic=False,
    )
)

ELASTIC_RANGE = define(
    Rule(
        code="D003",
        name="elastic-range",
        title="Every world size in the elastic range gives a valid plan.",
        docs=(
            "A proof over the whole range, not a sample: for every world size `W` with "
            "`min_world_size <= W <= max_world_size` and `W % multiple_of == 0`, the plan with "
            "`dp_shard = W / (dp_replicate * tp * pp * cp)` must satisfy every error rule of the backend's "
            "rule set. The global batch size is held, so `gradient_accumulation_steps` is recomputed as "
            "`global_batch_size / (micro_batch_size * microbatches * dp_replicate * dp_shard)` at each size "
            "(what elastic launchers do); a size whose data-parallel size does not divide the batch fails "
            "B001. When the range is not valid throughout, the report names the smallest failing world size "
            "and the rule it breaks there. The proof runs once the plan is valid at its own device count."
        ),
        engine_reference="no engine checks this ahead of time; torchrun --nnodes=MIN:MAX discovers a bad size at "
        "restart",
        constraint=None,
        explain=lambda x: "",
        fields=("elastic",),
        families=EVERY_FAMILY,
        needs=("elastic_min_world_size",),
        elastic=False,
    )
)


def _world_sizes(x) -> range:
    step = x.elastic_multiple_of
    first = -(-x.elastic_min_world_size // step) * step
    return range(first, x.elastic_max_world_size + 1, step)


def _range_text(x) -> str:
    return f"{x.elastic_min_world_size}..{x.elastic_max_world_size}, multiples of {x.elastic_multiple_of}"


DEVICES_IN_RANGE = define(
    Rule(
        code="D004",
        name="devices-in-elastic-range",
        title="The device count is one of the elastic range's world sizes.",
        docs=(
            "The plan starts on `resources.devices`, so that count must itself be a world size the elastic "
            "range allows: between `min_world_size` and `max_world_size` and a multiple of `multiple_of`."
        ),
        engine_reference="torchrun --nnodes=MIN:MAX refuses to start outside its range",
        constraint=lambda v: all_of(
            v.elastic_min_world_size <= v.devices,
            v.devices <= v.elastic_max_world_size,
            v.devices % v.elastic_multiple_of == 0,
        ),
        explain=lambda x: f"{x.devices} devices is not a world size of the elastic range ({_range_text(x)})",
        hint=lambda x: f"use {alternatives(list(_world_sizes(x)[:6]))} devices, or widen the range",
        fields=("devices", "elastic_min_world_size", "elastic_max_world_size", "elastic_multiple_of"),
        families=EVERY_FAMILY,
        needs=("elastic_min_world_size",),
        elastic=False,
    )
)

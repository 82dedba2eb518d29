"""Differential tests against the engines' own code, where it runs on a CPU.

* torch.distributed.pipelining (torch itself): every schedule class is constructed for every
  (pp, virtual stages, micro-batches) up to 8 on a fake process group; its verdict must equal the
  verifier's and the builder's, and the compute order of every rank must equal the order the
  lowering builds (so the in-tree runtime replays what torch would run).
* Megatron-Core (the `engines` extra, installed with --no-deps): `RankGenerator`'s groups equal
  the plan's rank groups, and its pipeline schedule's warm-up counts and interleaved micro-batch
  table equal the lowering's Megatron schedules.
* torchtitan 0.3.0 (the `engines` extra): `ParallelDims`' validation accepts exactly the meshes
  `check` accepts, and its pipeline split places the layers the lowering places.
"""

from __future__ import annotations

import itertools
import warnings

import pytest

from mixle_compile.check import check_loaded
from mixle_compile.contracts import ParallelPlan
from mixle_compile.layer_split import counts_for
from mixle_compile.lower.groups import RankGrid, enumerate_groups
from mixle_compile.lower.schedule import OpKind, check_schedule, pipeline_schedule
from mixle_compile.schedules import ScheduleFamily, refusal, warmup_forwards
from mixle_compile.spec import load_spec_text

torch = pytest.importorskip("torch")

LIMIT = 8
TORCH_CASES = [
    (schedule, pp, v, m)
    for pp in range(2, LIMIT + 1)
    for v in range(1, LIMIT + 1)
    for m in range(1, LIMIT + 1)
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b")
    if v == 1 or schedule == "interleaved_1f1b"
]


def _torch_schedule(schedule: str, pp: int, v: int, m: int, rank: int):
    """torch's schedule object for one rank (raises what torch raises)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=pp, store=FakeStore())
    try:
        stages = [PipelineStage(torch.nn.Linear(2, 2), rank + k * pp, pp * v, torch.device("cpu")) for k in range(v)]
        if schedule == "interleaved_1f1b":
            return ScheduleInterleaved1F1B(stages, m)
        return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](stages[0], m)
    finally:
        dist.destroy_process_group()


def _torch_verdicts() -> dict[tuple, object]:
    """Each case's schedule for rank 0 (orders of every rank are in it), or the ValueError torch raised."""
    out = {}
    for case in TORCH_CASES:
        try:
            out[case] = _torch_schedule(*case, rank=0)
        except ValueError as exc:
            out[case] = exc
    return out


@pytest.fixture(scope="module")
def torch_verdicts():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _torch_verdicts()


def test_torch_schedule_verdicts_equal_torch_pipelining(torch_verdicts):
    refused = 0
    for (schedule, pp, v, m), verdict in torch_verdicts.items():
        ours = refusal(ScheduleFamily.TORCH, schedule, pp, m, v)
        assert (ours is None) == (not isinstance(verdict, ValueError)), ((schedule, pp, v, m), verdict, ours)
        refused += ours is not None
        if ours is None:
            programs = pipeline_schedule(pp, m, schedule, v, family="torch")
            assert check_schedule(programs, buffered_sends=True).ok, (schedule, pp, v, m)
        else:
            with pytest.raises(ValueError, match=ours.code):
                pipeline_schedule(pp, m, schedule, v, family="torch")
    assert 0 < refused < len(torch_verdicts)  # both verdicts occur


def _our_compute_order(programs, stage: int, pp: int) -> list[tuple[str, int, int]]:
    return [
        ("F" if op.kind is OpKind.forward else "B", op.chunk * pp + stage, op.microbatch)
        for op in programs[stage]
        if op.kind in (OpKind.forward, OpKind.backward)
    ]


def _torch_compute_order(schedule_object, rank: int) -> list[tuple[str, int, int]]:
    out = []
    for action in schedule_object.pipeline_order[rank]:
        if action is None:
            continue
        kind = action.computation_type.value
        if kind in ("F", "B"):
            out.append((kind, action.stage_index, action.microbatch_index))
    return out


def test_interleaved_orders_equal_torch_pipelining(torch_verdicts):
    compared = 0
    for (schedule, pp, v, m), verdict in torch_verdicts.items():
        if schedule != "interleaved_1f1b" or isinstance(verdict, ValueError):
            continue
        programs = pipeline_schedule(pp, m, schedule, v, family="torch")
        for rank in range(pp):
            assert _our_compute_order(programs, rank, pp) == _torch_compute_order(verdict, rank), (pp, v, m, rank)
        compared += 1
    assert compared > 200


def _torch_peak_in_flight(schedule_object, rank: int) -> int:
    """The most forwards (a model chunk of a micro-batch each) rank `rank` holds before their backward."""
    held = peak = 0
    for action in schedule_object.pipeline_order[rank]:
        if action is None:
            continue
        kind = action.computation_type.value
        held += (kind == "F") - (kind in ("B", "I"))
        peak = max(peak, held)
    return peak


def test_interleaved_in_flight_micro_batches_equal_torch_pipelining(torch_verdicts):
    # The memory model's activations in flight (in whole-stage units, v chunks each) are the most
    # forwards a rank of torch's interleaved schedule holds before their backward.
    from mixle_compile.memory_model import NUMBERS, micro_batches_in_flight
    from mixle_compile.schedules import NUMBERS as SCHEDULE_NUMBERS
    from mixle_compile.schedules import microbatches_per_round

    compared = 0
    for (schedule, pp, v, m), verdict in torch_verdicts.items():
        if schedule != "interleaved_1f1b" or isinstance(verdict, ValueError) or v == 1:
            continue
        for rank in range(pp):
            ours = micro_batches_in_flight(
                NUMBERS,
                pp=pp,
                stage=rank,
                microbatches=m,
                gpipe=False,
                interleaved=True,
                virtual_stages=v,
                group=microbatches_per_round(SCHEDULE_NUMBERS, pp, m),
            )
            assert ours * v == pytest.approx(_torch_peak_in_flight(verdict, rank)), (pp, v, m, rank)
        compared += 1
    assert compared > 200


def test_one_f_one_b_warmups_equal_torch_pipelining():
    # Schedule1F1B's warm-up: pp - rank - 1 forwards before the first backward.
    for pp, m in itertools.product(range(2, LIMIT + 1), range(1, LIMIT + 1)):
        if m < pp:
            continue
        programs = pipeline_schedule(pp, m, "1f1b", family="torch")
        for stage in range(pp):
            order = _our_compute_order(programs, stage, pp)
            first_backward = next(i for i, (kind, _, _) in enumerate(order) if kind == "B")
            assert first_backward == min(pp - stage - 1, m) + 1  # warm-up, then the steady state's forward


# --------------------------------------------------------------------------- Megatron-Core


@pytest.fixture(scope="module")
def megatron():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core.parallel_state"), pytest.importorskip(
            "megatron.core.pipeline_parallel.schedules"
        )


def _meshes(world_limit: int):
    for tp, pp, cp, dp in itertools.product((1, 2, 4), (1, 2, 4), (1, 2), (1, 2, 4)):
        world = tp * pp * cp * dp
        if world > world_limit:
            continue
        for etp in sorted({1, tp}):
            for ep in (1, 2, 4):
                if world % (etp * ep * pp) == 0 and (world // pp) % (etp * ep) == 0:
                    yield tp, pp, cp, dp, ep, etp


def _groups(generated) -> set[tuple[int, ...]]:
    return {tuple(g) for g in generated}


def test_rank_groups_equal_megatron_rank_generator(megatron):
    parallel_state, _ = megatron
    order = "tp-cp-ep-dp-pp"
    meshes = list(_meshes(64))
    checked = 0
    for tp, pp, cp, dp, ep, etp in meshes:
        plan = ParallelPlan(dp_shard=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
        try:
            grid = RankGrid.from_plan(plan, order)
        except ValueError:
            continue  # a grid the plan refuses (E002/E003); Megatron's expert grid is checked below
        dense = parallel_state.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
        for token, axes in (
            ("tp", "tp"),
            ("pp", "pp"),
            ("cp", "cp"),
            ("dp", ("dp_replicate", "dp_shard")),
            ("dp-cp", ("dp_replicate", "dp_shard", "cp")),
            ("tp-pp", ("tp", "pp")),
        ):
            assert _groups(dense.get_ranks(token)) == set(enumerate_groups(grid.rule(axes))), (tp, pp, cp, dp, token)
        world = tp * pp * cp * dp
        expert = parallel_state.RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=order)
        assert _groups(expert.get_ranks("ep")) == set(enumerate_groups(grid.rule("ep"))), (tp, pp, cp, dp, ep, etp)
        assert _groups(expert.get_ranks("dp")) == set(enumerate_groups(grid.rule("edp"))), (tp, pp, cp, dp, ep, etp)
        checked += 1
    assert checked >= 144


def test_optimizer_instances_are_the_hybrid_sharding_groups(megatron):
    """Megatron-FSDP with --num-distributed-optimizer-instances K shards within K contiguous blocks of
    each data-parallel-with-cp rank list (parallel_state.initialize_model_parallel: intra_partial
    groups are ``ranks_with_cp[i * size : (i + 1) * size]``) and replicates across them: the plan's
    dp_shard x cp groups and dp_replicate groups with dp_replicate = K, both rank orders (a grid the
    plan refuses, E002/E003, is left out)."""
    parallel_state, _ = megatron
    checked = 0
    for order in ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"):
        for tp, pp, cp, dp in itertools.product((1, 2), (1, 2), (1, 2), (2, 4, 8)):
            for k in (d for d in (2, 4, 8) if dp % d == 0):
                try:
                    grid = RankGrid.from_plan(
                        ParallelPlan(dp_replicate=k, dp_shard=dp // k, tp=tp, pp=pp, cp=cp, etp=tp), order
                    )
                except ValueError:
                    continue
                generated = parallel_state.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
                size = dp * cp // k
                intra = {tuple(r[i * size : (i + 1) * size]) for r in generated.get_ranks("dp-cp") for i in range(k)}
                # the instances' group: create_hierarchical_groups(expert data ranks, [size, k])'s second
                # level, ranks `size` apart (the dense layers share the expert one)
                experts = parallel_state.RankGenerator(tp=tp, ep=1, dp=dp * cp, pp=pp, cp=1, order=order)
                inter = {tuple(r[j::size]) for r in experts.get_ranks("dp") for j in range(size)}
                assert intra == set(enumerate_groups(grid.rule(("dp_shard", "cp")))), (order, tp, pp, cp, dp, k)
                assert inter == set(enumerate_groups(grid.rule("dp_replicate"))), (order, tp, pp, cp, dp, k)
                checked += 1
    assert checked >= 48


class _Group:
    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


class _Communicator:
    """What Megatron's `get_pp_rank_microbatches` reads of a P2P communicator."""

    def __init__(self, pp: int, rank: int, virtual: int | None):
        self.pp_group = _Group(pp, rank)
        self.virtual_pipeline_model_parallel_size = virtual


def test_megatron_warmups_and_interleaved_table_equal_megatron_core(megatron):
    _, schedules = megatron
    for pp, v in itertools.product(range(2, LIMIT + 1), range(1, 5)):
        for m in range(pp, 3 * pp + 1):
            if v > 1 and m % pp:
                continue  # P004
            schedule = "interleaved_1f1b" if v > 1 else "1f1b"
            programs = pipeline_schedule(pp, m, schedule, v, family="megatron")
            for stage in range(pp):
                _, _, warmup, _ = schedules.get_pp_rank_microbatches(
                    m, v, pp, p2p_communicator=_Communicator(pp, stage, v if v > 1 else None)
                )
                assert warmup == warmup_forwards(schedule, pp, m, v, stage, pp), (pp, v, m, stage)
                forwards = [
                    (mb, (vs - stage) // pp) for kind, vs, mb in _our_compute_order(programs, stage, pp) if kind == "F"
                ]
                if v > 1:
                    assert forwards == schedules.get_schedule_table(m, v, pp), (pp, v, m, stage)


def test_megatron_interleaved_groups_equal_megatron_core(megatron):
    """training.microbatch_group_size (microbatch_group_size_per_vp_stage) against Megatron-Core: every
    group its interleaved schedule accepts (within [pp, m], the last group empty or at least pp) warms
    up and orders the forwards as get_pp_rank_microbatches and get_schedule_table do."""
    from mixle_compile.schedules import ScheduleFamily, refusal

    _, schedules = megatron
    compared = 0
    for pp, v in itertools.product(range(2, 5), range(2, 4)):
        for m in range(1, 3 * pp + 2):
            for group in range(1, m + 2):
                accepted = pp <= group <= m and (m % group == 0 or m % group >= pp)  # schedules.py's checks
                assert (refusal(ScheduleFamily.MEGATRON, "interleaved_1f1b", pp, m, v, group) is None) == accepted
                if not accepted:
                    continue
                programs = pipeline_schedule(pp, m, "interleaved_1f1b", v, family="megatron", group=group)
                for stage in range(pp):
                    _, _, warmup, _ = schedules.get_pp_rank_microbatches(
                        m, v, group, p2p_communicator=_Communicator(pp, stage, v)
                    )
                    assert warmup == warmup_forwards("interleaved_1f1b", pp, m, v, stage, group), (pp, v, m, group)
                    forwards = [
                        (mb, (vs - stage) // pp)
                        for kind, vs, mb in _our_compute_order(programs, stage, pp)
                        if kind == "F"
                    ]
                    assert forwards == schedules.get_schedule_table(m, v, group), (pp, v, m, group, stage)
                compared += 1
    assert compared > 60


# --------------------------------------------------------------------------- torchtitan


@pytest.fixture(scope="module")
def torchtitan():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parallel_dims = pytest.importorskip("torchtitan.distributed.parallel_dims")
        pipeline_parallel = pytest.importorskip("torchtitan.distributed.pipeline_parallel")
    return parallel_dims, pipeline_parallel


SPEC = """\
model: {{family: transformer, vocab_size: 256, hidden_size: 64, num_layers: 8, num_heads: 8, ffn_hidden_size: 128}}
mesh: {{dp_replicate: {dpr}, dp_shard: {dps}, tp: {tp}, pp: {pp}, cp: {cp}, microbatches: 8}}
training: {{global_batch_size: {batch}, seq_len: 64, precision: bf16}}
backend: {{name: torchtitan, version: "0.3"}}
resources: {{devices: {world}, memory: 80GiB}}
"""


def test_parallel_dims_accepts_exactly_the_meshes_check_accepts(torchtitan):
    parallel_dims, _ = torchtitan
    seen = {True: 0, False: 0}
    for dpr, dps, tp, pp, cp, world in itertools.product((1, 2), (-1, 1, 2, 3), (1, 2), (1, 2), (1, 2), (4, 6, 8, 12)):
        try:
            dims = parallel_dims.ParallelDims(
                dp_replicate=dpr, dp_shard=dps, cp=cp, tp=tp, pp=pp, ep=1, world_size=world
            )
            accepted, shard = True, dims.dp_shard
        except AssertionError:
            accepted, shard = False, max(dps, 1)
        text = SPEC.format(
            dpr=dpr, dps="auto" if dps == -1 else dps, tp=tp, pp=pp, cp=cp, world=world, batch=8 * dpr * shard
        )
        codes = {d.code for d in check_loaded(load_spec_text(text, "mesh.yaml")).diagnostics}
        assert accepted == (not {"D001", "S012"} & codes), (dpr, dps, tp, pp, cp, world, codes)
        seen[accepted] += 1
    assert seen[True] and seen[False]


def test_layer_split_equals_torchtitans_pipeline_split(torchtitan):
    _, pipeline_parallel = torchtitan
    split = pipeline_parallel._generate_llm_fqn_per_model_part
    for layers, stages in itertools.product((4, 7, 8, 30, 32, 80, 126), (1, 2, 3, 4, 8, 16)):
        if stages > layers + 2:
            continue
        theirs = [sum(name.startswith("layers.") for name in part) for part in split(stages, layers)]
        assert list(counts_for("torchtitan", layers, stages)) == theirs, (layers, stages)


def _megatron_core_config(layers: int, pp: int, **config):
    """Megatron-Core's TransformerConfig for a small model on ``pp`` stages, or None where its
    __post_init__ refuses the settings."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return TransformerConfig(
                num_layers=layers,
                hidden_size=64,
                num_attention_heads=4,
                pipeline_model_parallel_size=pp,
                pipeline_dtype=torch.bfloat16,
                **config,
            )
    except (ValueError, AssertionError):
        return None


def _megatron_core_split(layers: int, pp: int, v: int, **config) -> tuple[int, ...] | None:
    """The layers Megatron-Core builds on each virtual stage (chunk c of stage s is c * pp + s), or None
    where its TransformerConfig or get_num_layers_to_build refuses, or counts a stage below none."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    made = _megatron_core_config(layers, pp, virtual_pipeline_model_parallel_size=v if v > 1 else None, **config)
    if made is None:
        return None
    try:
        counts = tuple(
            get_num_layers_to_build(made, vp_stage=c if v > 1 else None, pp_rank=s) for c in range(v) for s in range(pp)
        )
    except (ValueError, AssertionError):
        return None
    return counts if min(counts) >= 0 else None


def test_megatron_accounted_splits_equal_megatron_core(megatron):
    """layer_split.megatron_accounted against Megatron-Core's own TransformerConfig checks and
    get_num_layers_to_build, for the embedding and/or the loss counted as a layer."""
    from mixle_compile.layer_split import ACCOUNTED, megatron_accounted

    compared = refused = 0
    for layers, pp, v, flags in itertools.product(range(1, 34), (2, 3, 4, 8), (1, 2, 3, 4), ACCOUNTED):
        ours = megatron_accounted(layers, pp, v, *flags)
        theirs = _megatron_core_split(
            layers,
            pp,
            v,
            account_for_embedding_in_pipeline_split=flags[0],
            account_for_loss_in_pipeline_split=flags[1],
        )
        assert ours == theirs, (layers, pp, v, flags)
        compared += theirs is not None
        refused += theirs is None
    assert compared > 150 and refused > 1000


def test_megatron_uneven_splits_equal_megatron_core(megatron):
    """layer_split.megatron_uneven (num_layers_in_first/last_pipeline_stage) against Megatron-Core's
    TransformerConfig checks and get_num_layers_to_build, with and without virtual stages (a split
    whose layers run out, a negative count on some stage, counts as refused)."""
    from mixle_compile.layer_split import megatron_uneven, megatron_uneven_of

    compared = refused = 0
    sizes = (None, 0, 1, 2, 3, 4, 6, 8)
    for layers, pp, v, first, last in itertools.product((7, 12, 16, 24), (2, 3, 4), (1, 2, 3), sizes, sizes):
        if first is None and last is None:
            continue
        ours = megatron_uneven(layers, pp, v, first, last)
        theirs = _megatron_core_split(
            layers, pp, v, num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last
        )
        assert ours == theirs, (layers, pp, v, first, last)
        if ours is None:
            refused += 1
            continue
        got = megatron_uneven_of(ours, layers, pp, v)
        assert got is not None and megatron_uneven(layers, pp, v, *got) == ours
        compared += 1
    assert compared > 60 and refused > 500


def _random_layout(rng, pp: int, v: int, layers: int, mtp: int) -> str:
    """A layout string, usually one Megatron accepts, sometimes not (a layer or the embedding out of
    place, a stage too many, a character it does not know), written in its shorthands at random."""
    stages = [[] for _ in range(pp * v)]
    for _ in range(layers):
        stages[rng.randrange(len(stages))].append("t")
    for stage in stages:
        stage.sort()
    stages[0].insert(0, "E")
    last = len(stages) - 1 if rng.random() < 0.7 else rng.randrange(len(stages))
    if mtp:
        where = last if rng.random() < 0.6 else rng.randrange(len(stages))
        stages[where].extend("m" * mtp)
    stages[last].append("L")
    fault = rng.random()
    if fault < 0.05:
        stages.append([])
    elif fault < 0.1:
        stages[rng.randrange(len(stages))].append(rng.choice("tmEx"))
    elif fault < 0.15:
        stages[0], stages[-1] = stages[-1], stages[0]
    words = []
    for stage in stages:
        text = "".join(stage)
        if rng.random() < 0.3 and text.count("t") > 1:
            text = text.replace("t" * text.count("t"), f"t*{text.count('t')}")
        words.append(text)
    out = "|".join(words)
    if rng.random() < 0.3:
        out = out.replace("|", ",|", 1)
    return out


def test_megatron_layouts_equal_megatron_core(megatron):
    """layer_split.megatron_layout (--pipeline-model-parallel-layout) against Megatron-Core's
    TransformerConfig, which parses and validates the layout, and the layers it places per rank and
    virtual stage (what get_num_layers_to_build counts): the same
    layouts accepted, the same decoder layers on every virtual stage, the same virtual stages and the
    same pipeline rank for the multi-token prediction layers; and every split written by
    megatron_layout_text builds what it lists."""
    import random

    from megatron.core.transformer.enums import LayerType

    from mixle_compile.layer_split import LayoutError, megatron_layout, megatron_layout_text

    def theirs(text: str, pp: int, layers: int, mtp: int):
        made = _megatron_core_config(layers, pp, pipeline_model_parallel_layout=text, mtp_num_layers=mtp or None)
        if made is None:
            return None
        layout = made.pipeline_model_parallel_layout
        v = layout.virtual_pipeline_model_parallel_size
        # what get_num_layers_to_build reads for (pp rank s, virtual stage c) under a layout
        counts = tuple(layout.layout[s][c].count(LayerType.decoder) for c in range(v) for s in range(pp))
        ranks = [s for s in range(pp) if LayerType.mtp in layout.layout[s][-1]]
        return counts, v, (ranks[0] if ranks else None)

    def ours(text: str, pp: int, layers: int, mtp: int):
        try:
            got = megatron_layout(text, pp, layers, mtp)
        except LayoutError:
            return None
        return got.counts, got.virtual_stages, got.mtp_rank

    rng = random.Random(7)
    accepted = refused = standalone = 0
    for _ in range(600):
        pp, v = rng.choice((1, 2, 3, 4)), rng.choice((1, 2, 3))
        layers, mtp = rng.randrange(1, 13), rng.choice((0, 0, 1, 2))
        if pp == 1 and v > 1:
            v = 1  # Megatron-Core has no virtual stages without a pipeline
        text = _random_layout(rng, pp, v, layers, mtp)
        want = theirs(text, pp, layers, mtp)
        assert ours(text, pp, layers, mtp) == want, (text, pp, layers, mtp)
        accepted += want is not None
        refused += want is None
        standalone += want is not None and want[2] is not None and want[2] != pp - 1
    assert accepted > 150 and refused > 150 and standalone > 5, (accepted, refused, standalone)
    written = (((1,) + (2,) * 30 + (0,), 8, 1), ((3, 0, 5, 4), 2, 0), ((2, 2, 2, 1, 1, 1), 3, 2), ((4,), 1, 1))
    for counts, pp, mtp in written:
        text = megatron_layout_text(counts, pp, mtp)
        assert theirs(text, pp, sum(counts), mtp)[:2] == (counts, len(counts) // pp), text

"""The step-time model: how long one optimizer step of a verified plan takes, and why.

Read by `explain` and `diff` from a plan (its spec, its updates and its pipeline schedule), the
way :mod:`mixle_compile.memory_model` is read for memory. The model (docs/step-time.md):

- compute: the FLOPs a rank of the busiest pipeline stage executes per micro-step (forward,
  backward, and what checkpointing recomputes; attention's ``s^2`` term, halved by a causal fused
  kernel; experts by the tokens routed to them), at the device's achievable rate: its dense peak
  for the precision times an efficiency calibrated per device kind and precision
  (:data:`EFFICIENCY`, benchmarks/bench_step_time.py). Under fp8 the linear layers run at the fp8
  peak after casting their operands (:data:`FP8_CAST_BYTES`); attention and the output head stay
  in bf16. Under context parallelism the ring attention merges its steps' partial results outside
  the kernel, at the memory bandwidth (:data:`RING_MERGE_BYTES`).
- communication: every update's ring bytes per rank (:func:`ring_bytes`, the figure the plan's
  traffic reports) over the link its group crosses (inside a node or between nodes, from the
  mesh order and ``resources.topology``), then what the engine overlaps: data-parallel gradient
  and parameter traffic (FSDP prefetch, DDP bucketing) hides behind compute, context-parallel
  traffic behind attention, pipeline transfers behind compute where the engine overlaps them
  (Megatron's interleaved schedule); tensor-parallel and expert traffic is exposed.
- the pipeline bubble, from the plan's schedule (``bubble_fraction``);
- the optimizer step: every byte of parameters, gradients and optimizer state read and written
  once at the device's memory bandwidth.

Everything here is numbers only (no torch), so `explain` stays fast.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cache
from typing import Any

from mixle_compile.parameters import (
    AttentionWidths,
    attention_widths,
    block_matmuls,
    moe_layer_at,
    moe_layers_in,
    mtp_depths,
    mtp_is_moe,
)
from mixle_compile.plan.vocabulary import DATA_PARALLEL_AXES, EXPERT_DATA, RECOMPUTE, UpdateId
from mixle_compile.spec.models import compiled_components

#: Dense peak FLOP/s per precision, memory bandwidth, links, per device kind (vendor datasheets:
#: NVIDIA A100 80GB SXM, H100 SXM5, H200 SXM; dense, without sparsity). Intra-node bandwidth is
#: NVLink per direction; inter-node is the network per GPU (DGX A100: HDR 200Gb/s, DGX H100/H200:
#: NDR 400Gb/s).
DEVICES: dict[str, dict[str, Any]] = {
    "a100": {
        "peak": {"fp32": 156e12, "bf16": 312e12, "fp16": 312e12},
        "memory_bandwidth": 2.0e12,
        "intra_node": 300e9,
        "inter_node": 25e9,
        "devices_per_node": 8,
        **{"intra_node_latency": 3.4e-6, "inter_node_latency": 14e-6},
    },
    "h100": {
        "peak": {"fp32": 494e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12},
        "memory_bandwidth": 3.35e12,
        "intra_node": 450e9,
        "inter_node": 50e9,
        "devices_per_node": 8,
        **{"intra_node_latency": 3.4e-6, "inter_node_latency": 14e-6},
    },
    # H100 SXM5 96GB HBM2e (the Grand Teton hosts of torchtitan's benchmarks, run at 500 W)
    "h100-96gb": {
        "peak": {"fp32": 494e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12},
        "memory_bandwidth": 2.4e12,
        "intra_node": 450e9,
        "inter_node": 50e9,
        "devices_per_node": 8,
        **{"intra_node_latency": 3.4e-6, "inter_node_latency": 14e-6},
    },
    "h200": {
        "peak": {"fp32": 494e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12},
        "memory_bandwidth": 4.8e12,
        "intra_node": 450e9,
        "inter_node": 50e9,
        "devices_per_node": 8,
        **{"intra_node_latency": 3.4e-6, "inter_node_latency": 14e-6},
    },
    # Blackwell (NVIDIA Blackwell datasheet, dense Tensor Core figures): HGX/DGX B200 at 1,000 W and
    # B300 (Blackwell Ultra, same 16-bit and fp8 rates), 8 per NVLink 5 node (900 GB/s per direction),
    # a ConnectX-7 400Gb/s per GPU (B300: ConnectX-8 800Gb/s); GB200 and GB300 at 1,200 W and more in an
    # NVL72 rack, whose 72 GPUs share one NVLink domain (a "node" here: the devices one NVLink fabric joins).
    "b200": {
        "peak": {"fp32": 75e12, "bf16": 2250e12, "fp16": 2250e12, "fp8": 4500e12},
        "memory_bandwidth": 8.0e12,
        "intra_node": 900e9,
        "inter_node": 50e9,
        "devices_per_node": 8,
        **{"intra_node_latency": 3.4e-6, "inter_node_latency": 14e-6},
    },
    "b300": {
        "peak": {"fp32": 75e12, "bf16": 2250e12, "fp16": 2250e12, "fp8": 4500e12},
        "memory_bandwidth": 8.0e12,
        "intra_node": 900e9,
        "inter_node": 100e9,
        "devices_per_node": 8,
        # No published dense row calibrates it: it borrows B200's efficiency (see efficiency_of).
        "calibrated_as": "b200",
        **{"intra_node_latency": 3.4e-6, "inter_node_latency": 14e-6},
    },
    "gb200": {
        "peak": {"fp32": 80e12, "bf16": 2500e12, "fp16": 2500e12, "fp8": 5000e12},
        "memory_bandwidth": 8.0e12,
        "intra_node": 900e9,
        "inter_node": 50e9,
        "devices_per_node": 72,
        **{"intra_node_latency": 3.4e-6, "inter_node_latency": 14e-6},
    },
    "gb300": {
        "peak": {"fp32": 80e12, "bf16": 2500e12, "fp16": 2500e12, "fp8": 5000e12},
        "memory_bandwidth": 8.0e12,
        "intra_node": 900e9,
        "inter_node": 100e9,
        "devices_per_node": 72,
        **{"intra_node_latency": 3.4e-6, "inter_node_latency": 14e-6},
    },
}
#: Assumed for a device kind not in :data:`DEVICES` (its peak must come from resources.throughput).
GENERIC_DEVICE = {
    "memory_bandwidth": 2.0e12,
    "intra_node": 300e9,
    "inter_node": 25e9,
    "devices_per_node": 8,
    "intra_node_latency": 3.4e-6,
    "inter_node_latency": 14e-6,
}
#: What every collective call costs before its steps (NCCL's ``baseLat`` of the Ring algorithm with
#: the Simple protocol, src/graph/tuning.cc); the per-step latencies of the tables above are its
#: ``hwLat`` for Ring/Simple over NVLink (3.4 us) and the network (14 us).
BASE_LATENCY = 8.4e-6

#: The fraction of the dense peak a training step's matrix multiplications reach, by device kind
#: and precision, calibrated on published measurements (benchmarks/bench_step_time.py prints the
#: rows and the ratios; docs/step-time.md names the sources).
EFFICIENCY: dict[tuple[str, str], float] = {
    ("a100", "fp16"): 0.650,  # SC21 Table 1 (Megatron-LM, 10 rows)
    ("b200", "fp8"): 0.617,  # Megatron-Bridge 25.11, DGX-B200 (2 rows)
    ("gb200", "fp8"): 0.611,  # Megatron-Bridge 25.11, DGX-GB200 (2 rows)
    ("gb300", "fp8"): 0.765,  # Megatron-Bridge 25.11, DGX-GB300 (2 rows)
    ("h100", "fp8"): 0.743,  # Megatron-Bridge 25.11 (3 rows)
    ("h100-96gb", "bf16"): 0.446,  # torchtitan Dec 2024, Tables 1 and 3, async TP bf16 (8 rows)
    ("h100-96gb", "fp8"): 0.450,  # torchtitan Dec 2024, Tables 1-6, async TP fp8 (16 rows)
    ("h200", "fp8"): 0.526,  # torchtitan, Trainy H200 (2 rows)
}
#: For a device kind or precision without a calibrated figure: the kind's 16-bit figure (same tensor
#: cores; fp8 falls back to it too), else this.
DEFAULT_EFFICIENCY = 0.45
#: A fused attention kernel's rate relative to the matrix multiplications' (flash attention's
#: forward and backward reach a lower share of the peak than large GEMMs).
ATTENTION_EFFICIENCY = 0.4
#: Bytes element-wise operations move per activation element (in the training dtype's bytes) per
#: pass, eager and under torch.compile, which fuses chains of them (and some into the matmuls'
#: prologues and epilogues); both fitted with the efficiencies (benchmarks/bench_step_time.py --fit).
ELEMENTWISE_BYTES = {"eager": 2.0, "compiled": 1.0}
#: Bytes an fp8 step moves per element it casts to fp8 (:func:`_cast_elements`): dynamic
#: scaling reads the 16-bit tensor for its absolute maximum and again for the cast (2 + 2), and
#: writes the fp8 copy (1); fitted with the efficiencies (benchmarks/bench_step_time.py --fit).
FP8_CAST_BYTES = 5.0
#: Bytes per attention score and pass under eager attention: QK^T written, softmax read and written.
SCORE_BYTES = 6.0
#: Ring attention (context parallelism, cp > 1) merges the ring steps' partial results apart from the
#: attention kernels, per ring implementation: bytes each merge moves per element of a rank's local
#: queries (``q``) or of one of its local key and value tensors (``kv``), counted op by op for the last
#: rank of the ring, whose every later step uses all its queries (the forward's heaviest rank).
#:
#: ``torch`` (torchtitan): torch's distributed/tensor/experimental/_context_parallel/_attention.py,
#: eager element-wise ops in fp32 (``_cp_options.convert_to_f32``):
#:
#: * forward, ``cp - 1`` times (``_templated_ring_attention``, ``_SDPAMerger``): each step after the
#:   first casts its output to fp32 (read 2, write 4), then ``out - sigmoid(lse_i - lse) * (out -
#:   out_i)``: a difference (read 4 + 4, write 4), a product (4, 4) and a difference (4 + 4, 4): 38
#:   per ``q``; each step but the last concatenates the keys and values to send (``torch.cat``, read
#:   2 and write 2 each): 8 per ``kv``;
#: * forward, once: the first output cast to fp32 (6) and the result cast back (read 4, write 2): 12
#:   per ``q``;
#: * backward, ``cp - 1`` times (``_templated_ring_attention_backward``): each step after the first
#:   accumulates the query gradient in fp32 (read 4 + 2, write 4): 10 per ``q``, adds the key and
#:   value gradients into half of their fp32 accumulators (``_partial_update``: 5 each) and re-joins
#:   them (``torch.cat``, 8 each), and concatenates them in fp32 to send (8 each); each step but the
#:   last concatenates the keys and values to send (8): 50 per ``kv``;
#: * backward, once: the fp32 accumulators zero-filled (write 4 each), the first step's query (10)
#:   and key/value gradients (10 each) added, the gradients' concatenation to send (8 each), the query
#:   gradient cast back (6) and the key/value gradients cast back (6 each): 20 per ``q``, 56 per ``kv``.
#:
#: Under torch.compile the ring is traced (it waits on its collectives only outside tracing,
#: ``_maybe_wait``) and these chains fuse like the layer's other element-wise work: they are scaled by
#: the compiled over the eager :data:`ELEMENTWISE_BYTES`.
#:
#: ``transformer_engine`` (Megatron-Core's ``TEDotProductAttention``): Transformer Engine's
#: ``AttnFuncWithCPAndKVP2P`` (transformer_engine/pytorch/attention/dot_product_attention/
#: context_parallel.py), in bf16 with fused kernels (``jit_fuser``); the log-sum-exp's fp32 updates,
#: ``1 / head_dim`` of these, are left out:
#:
#: * forward, ``cp - 1`` times: each step's output scaled and added into the output
#:   (``flash_attn_fwd_out_correction``: read 2 + 2, write 2): 6 per ``q``;
#: * forward, once: the first step's output taken as the output (``..._correction_init``, 4 per
#:   ``q``) and the keys and values concatenated into the first send buffer (8 per ``kv``);
#: * backward, ``cp - 1`` times: the query gradient added (``dq.add_``, 6 per ``q``) and the key and
#:   value gradients added into the half of the received buffer the step computed (6 per ``kv``);
#: * backward, once: the keys and values copied into the first send buffer (8 per ``kv``).
RING_MERGE_BYTES = {
    "torch": {
        "forward_step": (38.0, 8.0),
        "forward_once": (12.0, 0.0),
        "backward_step": (10.0, 50.0),
        "backward_once": (20.0, 56.0),
    },
    "transformer_engine": {
        "forward_step": (6.0, 0.0),
        "forward_once": (4.0, 8.0),
        "backward_step": (6.0, 6.0),
        "backward_once": (0.0, 8.0),
    },
}


def ring_merge_bytes(q: float, kv: float, cp: int, forward_passes: int, ring: str = "torch") -> float:
    """Bytes ``ring``'s merges move per local token of one layer (:data:`RING_MERGE_BYTES`), for ``q``
    query and ``kv`` key (or value) elements per token, ``cp`` ring steps, and the layer's forward run
    ``forward_passes`` times (twice where checkpointing runs it again)."""
    if cp <= 1:
        return 0.0
    table = RING_MERGE_BYTES[ring]

    def at(key: str) -> float:
        per_q, per_kv = table[key]
        return per_q * q + per_kv * kv

    steps = cp - 1
    return (
        forward_passes * (steps * at("forward_step") + at("forward_once"))
        + steps * at("backward_step")
        + at("backward_once")
    )


#: A fused attention kernel's rate by the sequence length of one call, relative to its rate at 16k
#: tokens and beyond, with and without the causal mask: FlashAttention-2's bf16 forward at head
#: dimension 128 on an H100 SXM5, as Shah et al. 2024 (FlashAttention-3, Figure 5) measure it
#: (TFLOP/s causal 191, 260, 298, 319, 333, 335; without the mask 309, 350, 362, 368, 370, 370 at
#: 512 to 16k tokens; cuDNN's kernel and FlashAttention-3 fall off alike at short lengths). Short
#: calls leave the kernel's per-block set-up less work to amortise over; context parallelism makes
#: them: each ring step is one call over a rank's chunks (:func:`attention_length_factor`).
FUSED_ATTENTION_RATE = {
    True: ((512, 191 / 335), (1024, 260 / 335), (2048, 298 / 335), (4096, 319 / 335), (8192, 333 / 335), (16384, 1.0)),
    False: ((512, 309 / 370), (1024, 350 / 370), (2048, 362 / 370), (4096, 368 / 370), (8192, 1.0), (16384, 1.0)),
}


def efficiency_of(kind: str, precision: str) -> float:
    """The calibrated efficiency of a device kind at a precision: its own figure, else its 16-bit
    one; for a kind without any, those of the kind it is ``calibrated_as`` in :data:`DEVICES` (the
    same tensor cores in the same kind of node); else :data:`DEFAULT_EFFICIENCY`."""
    kinds = [kind]
    if not any(k == kind for k, _ in EFFICIENCY) and DEVICES.get(kind, {}).get("calibrated_as"):
        kinds.append(DEVICES[kind]["calibrated_as"])
    for k in kinds:
        for key in ((k, precision), (k, "bf16"), (k, "fp16")):
            if key in EFFICIENCY:
                return EFFICIENCY[key]
    return DEFAULT_EFFICIENCY


#: Axes whose traffic the engines overlap with compute: data-parallel gradients and parameters.
_DATA_AXES = frozenset((*DATA_PARALLEL_AXES, EXPERT_DATA))


def ring_bytes(collective: str, group_size: int, payload_bytes: float) -> float:
    """Bytes one rank sends for one collective over a ring of ``group_size`` ranks: the payload
    times :func:`ring_fraction`."""
    return _ring_factor(collective, group_size) * payload_bytes


@cache
def _ring_factor(collective: str, group_size: int) -> float:
    return float(ring_fraction(collective, group_size))


@cache
def ring_fraction(collective: str, group_size: int) -> Fraction:
    """The part of its payload one rank sends for one collective over a ring of ``group_size`` ranks:
    all_reduce 2(n-1)/n; reduce_scatter, all_gather, all_to_all and broadcast (n-1)/n; p2p 1."""
    n = group_size
    if collective == "none" or n < 1:
        return Fraction(0)
    if collective == "all_reduce":
        return Fraction(2 * (n - 1), n)
    if collective in ("reduce_scatter", "all_gather", "all_to_all", "broadcast"):
        return Fraction(n - 1, n)
    return Fraction(1)


def collective_latency(collective: str, group_size: int, nodes: int, table: dict) -> float:
    """Seconds one call of a collective waits beyond its bytes: NCCL's ring latency
    (src/graph/tuning.cc, Ring/Simple), the base latency plus one link latency per ring step, the
    steps between nodes at the network's. Steps: all_reduce 2(n-1), of them 2 x nodes between nodes
    (none inside one node); all_gather, reduce_scatter (and all_to_all, sent as n-1 pairs) n-1, of
    them nodes-1 between nodes; a broadcast or a point-to-point message one step."""
    n = group_size
    if collective == "none" or n < 2 and collective != "p2p":
        return 0.0
    intra, inter = table["intra_node_latency"], table["inter_node_latency"]
    if collective == "all_reduce":
        steps, between = 2 * (n - 1), (2 * nodes if nodes > 1 else 0)
    elif collective in ("all_gather", "reduce_scatter", "all_to_all"):
        steps, between = n - 1, nodes - 1
    else:
        steps, between = 1, (1 if nodes > 1 else 0)
    between = min(between, steps)
    return BASE_LATENCY + (steps - between) * intra + between * inter


def call_latency(axes: list[str], payload: str, update: dict, degrees: dict, order: str, table: dict) -> float:
    """The latency of one call of an update's collective, or 0 for data-parallel gradients and
    parameters: the engines issue those per FSDP unit or DDP bucket, not per tensor as the plan
    lists them (and hide them behind compute)."""
    if payload in ("gradient", "parameter") and set(axes) <= _DATA_AXES | {"cp"}:
        return 0.0
    nodes = _group_nodes(axes, degrees, order, table)
    return collective_latency(update["collective"], update["group_size"], nodes, table)


def _group_nodes(axes: list[str], degrees: dict[str, int], order: str, table: dict) -> int:
    """How many nodes one group over ``axes`` spans (its ranks laid out by the mesh order)."""
    node = table["devices_per_node"]
    total = per_node = 1
    for size, stride in _group_strides(axes, degrees, order):
        total *= size
        # the coordinates of this axis that stay inside a node of `node` consecutive ranks
        per_node *= max(1, min(size, node // stride)) if stride < node else 1
    return max(1, -(-total // per_node))


@dataclass(frozen=True)
class StepTime:
    seconds: float
    compute: float  # the busiest stage's compute over the step, without the bubble
    bubble: float
    exposed_communication: dict[str, float] = field(default_factory=dict)  # per axes ("tp", "dp_shard", ...)
    hidden_communication: dict[str, float] = field(default_factory=dict)
    optimizer: float = 0.0
    tokens_per_second: float = 0.0  # the whole job
    tokens_per_second_per_device: float = 0.0
    model_flops_per_token: float = 0.0  # 6N + 12 l d_q s, torchtitan's and PaLM's convention
    tflops_per_device: float = 0.0  # model FLOPs per second per device, in TFLOP/s
    mfu: float | None = None  # of the dense peak for the training precision
    efficiency: float = 0.0
    peak_flops: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "compute": self.compute,
            "bubble": self.bubble,
            "exposed_communication": dict(self.exposed_communication),
            "hidden_communication": dict(self.hidden_communication),
            "optimizer": self.optimizer,
            "tokens_per_second": self.tokens_per_second,
            "tokens_per_second_per_device": self.tokens_per_second_per_device,
            "model_flops_per_token": self.model_flops_per_token,
            "tflops_per_device": self.tflops_per_device,
            "mfu": self.mfu,
            "efficiency": self.efficiency,
            "peak_flops": self.peak_flops,
        }


class NoPrediction(ValueError):
    """The plan's spec does not say enough to predict a step time (e.g. a modules model)."""


@dataclass(frozen=True)
class _Layer:
    """Work per token of one layer: FLOPs of its forward pass by kind, and what checkpointing
    runs again; the bytes its element-wise operations move per pass."""

    linear: float  # projections and MLP (runs at the fp8 peak under fp8)
    attention: float  # QK^T and AV
    recompute_linear: float  # what checkpointing runs again
    recompute_attention: float
    elementwise_width: float = (
        0.0  # activation elements per token that element-wise operations read and write, per pass
    )
    score_elements: float = 0.0  # eager attention: score elements per token (softmax over s per head), per pass
    passes: int = 3  # forward, and backward counted as two
    #: The layer's matrix multiplications on one rank: (rows per token, inner size, output size, whether
    #: its weight is split over tp), each run once per pass (forward; backward's two, for the input's
    #: and the weight's gradient, move as much).
    gemms: tuple[tuple[float, float, float, bool], ...] = ()
    gemm_passes: float = 3.0


def _device(spec: dict) -> tuple[str, float | None, dict[str, Any]]:
    resources = spec["resources"]
    devices = resources["devices"]
    if isinstance(devices, list):  # a heterogeneous list: the slowest group decides
        group = min(
            devices,
            key=lambda g: g.get("throughput") or DEVICES.get(g.get("kind", ""), {}).get("peak", {}).get("bf16", 0),
        )
        kind, throughput = group.get("kind", "gpu"), group.get("throughput")
    else:
        kind, throughput = resources.get("kind") or "gpu", resources.get("throughput")
    table = dict(DEVICES.get(kind.lower(), GENERIC_DEVICE))
    topology = resources.get("topology") or {}
    if topology.get("devices_per_node"):
        table["devices_per_node"] = topology["devices_per_node"]
    if topology.get("intra_node_bandwidth"):
        table["intra_node"] = topology["intra_node_bandwidth"]
    if topology.get("inter_node_bandwidth"):
        table["inter_node"] = topology["inter_node_bandwidth"]
    for key in ("intra_node_latency", "inter_node_latency"):
        if topology.get(key):
            table[key] = topology[key]
    return kind.lower(), throughput, table


def _peak(kind: str, throughput: float | None, table: dict, precision: str) -> tuple[float, float]:
    """(peak of the linear layers, peak of attention and the head) in FLOP/s."""
    peaks = table.get("peak")
    if throughput is not None:  # resources.throughput: the device's dense peak at the training precision
        return throughput, throughput / 2 if precision == "fp8" else throughput
    if not peaks:
        raise NoPrediction(f"device kind {kind!r} has no known peak; give resources.throughput (e.g. '989TFLOPS')")
    linear = peaks.get(precision) or peaks["bf16"]
    return linear, peaks["bf16"] if precision == "fp8" else linear


def _matrices(model: dict) -> int:
    """Matrices of the MLP: 3 gated (SwiGLU), else 2."""
    return 3 if model.get("activation", "swiglu") == "swiglu" else 2


def _op_level_recomputed(a: AttentionWidths, ffn: float, matrices: int) -> dict[str, float]:
    """Forward FLOPs per token of the matmuls torchtitan's op-level policy recomputes: every second
    one of the block's (:func:`parameters.block_matmuls`; torchtitan/distributed/activation_checkpoint.py
    saves the odd-numbered ``mm`` calls): k, o and, with a gated MLP, w3 of ordinary attention."""
    return {m.name: 2 * m.inner * m.out for i, m in enumerate(block_matmuls(a, ffn, matrices)) if i % 2}


def _latent_rows(backend: str, sp: bool, tp: int) -> float:
    """How many of a micro-step's tokens one tp rank runs MLA's down projections (whole on every rank)
    for, as a multiple of the 1/tp every split matmul runs: the sequence shard where the engine
    projects down on it under sequence parallelism (EngineProfile.latent_projections_on_shards),
    else every token."""
    return 1.0 if sp and _named_engine(backend).latent_projections_on_shards else float(tp)


def _layer_flops(model: dict, training: dict, seq: float, backend: str, moe_layer: bool, tp: int = 1) -> _Layer:
    a = attention_widths(model)
    h, matrices = a.hidden, _matrices(model)
    sp = training.get("sequence_parallel", False)
    down = _latent_rows(backend, sp, tp)  # MLA's down projections (every projection split otherwise)
    projections = sum(2 * i * o * (1.0 if split else down) for i, o, split in a.projections()) + 2 * a.out * h
    if moe_layer:
        ffn = model.get("moe_ffn_hidden_size") or model["ffn_hidden_size"]
        mlp = 2 * h * model["num_experts"] + (model.get("experts_per_token") or 1) * 2 * matrices * h * ffn
        # A shared expert is a dense MLP beside them (its gate one more column); tp splits it.
        shared = model.get("moe_shared_expert_hidden_size") or 0
        mlp += 2 * matrices * h * shared + (2 * h if model.get("moe_shared_expert_gate") else 0)
    else:
        ffn = model["ffn_hidden_size"]
        mlp = 2 * matrices * h * ffn
    eager = training.get("attention") == "eager"
    # scores (q . k) and the weighted values; a fused causal kernel skips the masked half
    attention = 2 * seq * (a.q + a.out) * (1.0 if eager else 0.5)
    # Element-wise work (norms, residual adds, rotary, the MLP's activation) touches the hidden
    # state and the q, k, v and MLP widths (and MLA's latents); eager attention also writes and
    # normalises its scores.
    shared = (model.get("moe_shared_expert_hidden_size") or 0) if moe_layer else 0
    width = (h / tp if sp or tp == 1 else h) + (a.q + a.k + a.v + (matrices - 1) * ffn) / tp
    width += a.down * down / tp + (matrices - 1) * shared / tp
    scores = model["num_heads"] / tp * seq if eager else 0.0
    checkpointing = training.get("activation_checkpointing", "none")
    gemms = [(1.0 if split else down / tp, i, o / tp if split else o, split) for i, o, split in a.projections()]
    gemms.append((1.0, a.out / tp, h, True))
    if moe_layer:
        routed = (model.get("experts_per_token") or 1) / tp
        gemms += [
            (1.0, h, model["num_experts"], False),
            (routed, h, (matrices - 1) * ffn, False),
            (routed, ffn, h, False),
        ]
        if shared:
            gemms += [(1.0, h, (matrices - 1) * shared / tp, True), (1.0, shared / tp, h, True)]
    else:
        gemms += [(1.0, h, (matrices - 1) * ffn / tp, True), (1.0, ffn / tp, h, True)]
    shape = dict(elementwise_width=width, score_elements=scores, gemms=tuple(gemms))
    if checkpointing == "full":
        return _Layer(projections + mlp, attention, projections + mlp, attention, passes=4, gemm_passes=4.0, **shape)
    if checkpointing == "selective" and backend == "torchtitan":
        # torchtitan's op-level policy recomputes the even-numbered matmuls (k, o and, with a
        # gated MLP, w3) and saves attention's output.
        again = sum(_op_level_recomputed(a, ffn, matrices).values())
        return _Layer(projections + mlp, attention, again, 0.0, gemm_passes=3 + again / (projections + mlp), **shape)
    if checkpointing == "selective":
        # what the engine's selective checkpointing runs again (EngineProfile.selective_modules: the
        # attention core, or Megatron's recompute_modules); the output-discarding norms and MoE
        # activation are element-wise
        modules = _named_engine(backend).selective_modules(training.get("recompute_modules"))
        again = 0.0
        if "mla_up_proj" in modules and a.latent:
            again += sum(2 * i * o for i, o, split in a.projections() if split)
        if ("moe" if moe_layer else "mlp") in modules:
            again += mlp
        elif moe_layer and "shared_experts" in modules:
            again += 2 * matrices * h * shared
        core = attention if "core_attn" in modules else 0.0
        return _Layer(projections + mlp, attention, again, core, gemm_passes=3 + again / (projections + mlp), **shape)
    return _Layer(projections + mlp, attention, 0.0, 0.0, **shape)


def _gemm_bytes(
    gemms: tuple[tuple[float, float, float, bool], ...], tokens: float, sizes: tuple[int, int], weight_reads: int
) -> float:
    """Bytes one pass of ``gemms`` moves at ``tokens`` rows: each reads its input (rows x inner) and
    its weight (inner x output; ``weight_reads`` times when split over tp) and writes its output
    (rows x output); ``sizes`` are the bytes of an operand and of a result element."""
    operand, result = sizes
    total = 0.0
    for per_token, inner, out, split in gemms:
        rows = per_token * tokens
        reads = weight_reads if split else 1
        total += operand * (rows * inner + reads * inner * out) + result * rows * out
    return total


def _cast_elements(gemms: tuple[tuple[float, float, float, bool], ...], tokens: float) -> float:
    """Elements an fp8 step casts per pass of ``gemms`` at ``tokens`` rows (dynamic scaling: each
    cast finds its tensor's absolute maximum first): over a forward and a backward, every matmul's
    input twice (the forward's operand, and column-major for the weight's gradient) and its output's
    gradient twice (for the input's gradient, and column-major for the weight's): two thirds of
    (rows x inner + rows x output) per pass."""
    return sum(2 / 3 * per_token * tokens * (inner + out) for per_token, inner, out, _ in gemms)


def fused_matmul_flops(node_id: str, model: dict, training: dict, backend: str, tp: int) -> tuple[float, bool]:
    """Forward FLOPs per token, on one tp rank, of the matrix multiplications that async tensor
    parallelism fuses with the tensor-parallel collective ``node_id`` (torch's micro-pipelined TP,
    torch/_inductor/fx_passes/micro_pipeline_tp.py: an all-gather with the matmuls that read its
    output, ``fused_all_gather_matmul``; a matmul with the reduce-scatter of its output,
    ``fused_matmul_reduce_scatter``), and whether they run at the linear layers' peak (the output
    head runs at the 16-bit one). The sequence-parallel block's all-gathers feed the q/k/v and the
    MLP's input projections, its reduce-scatters take the output projections'; backward, the
    conjugates pair with the same matmuls' input gradients; a checkpointed block's all-gather again
    with the matmuls the recomputed forward runs (all of them under ``full``; under torchtitan's
    op-level policy the ones it does not save: k and the gated MLP's w3). Anything else (the
    embedding's, the loss's) is fused with nothing: 0."""
    a = attention_widths(model)
    h, matrices = a.hidden, _matrices(model)
    ffn = model["ffn_hidden_size"]
    uid = UpdateId.parse(node_id)
    site = uid.subject.rsplit(".", 1)[-1] if uid.subject.startswith("layers.") else uid.subject
    if site == "lm_head" and uid.kind == "in":
        return 2 * h * model["vocab_size"] / tp, False
    flops = {m.name: 2 * m.inner * m.out for m in block_matmuls(a, ffn, matrices)}
    # an engine that gathers the hidden state for MLA's down projections (and a direct wq) runs them
    # on every token of every tp rank (EngineProfile.latent_projections_on_shards); elsewhere the
    # gather carries the latents to the up projections
    on_hidden = a.latent and not _named_engine(backend).latent_projections_on_shards
    down = {"wq_a", "wkv_a"} if on_hidden else set()
    gathered = {m.name for m in block_matmuls(a, ffn, matrices) if m.gathered}
    reading = {  # the matmuls reading each collective's output, or writing its input
        ("attn", "in"): (down | {"wq"}) if on_hidden else gathered,
        ("attn", "out"): {"o"},
        ("mlp", "in"): {"w1", "w3"},
        ("mlp", "out"): {"w2"},
    }.get((site, uid.kind))
    if reading is None:
        return 0.0, True
    if uid.step == RECOMPUTE and training.get("activation_checkpointing") != "full":
        if backend != "torchtitan" or uid.kind != "in":
            return 0.0, True
        # the all-gather's output feeds the matmuls the op-level policy does not save again (k of
        # q, k, v and w3 of w1, w3)
        again = _op_level_recomputed(a, ffn, matrices)
        return sum(f * (tp if name in down else 1) for name, f in again.items() if name in reading) / tp, True
    return sum(f * (tp if name in down else 1) for name, f in flops.items() if name in reading) / tp, True


def fused_seconds(st: _Setting, fused: tuple[float, bool] | None) -> float:
    """Seconds of the matmuls a collective is fused with, from ``(their FLOPs, whether they run at
    the linear layers' rate)`` (else the 16-bit one: the output head); 0 for none."""
    if fused is None:
        return 0.0
    flops, linear = fused
    return flops / ((st.linear_peak if linear else st.other_peak) * st.efficiency)


def model_flops_per_token(model: dict, seq: float) -> float:
    """6N + 12 l d_q s: N the parameters in matrix multiplications (experts as routed, the output
    head, not the embedding lookup), the attention term non-causal, as torchtitan and PaLM count."""
    h, layers = model["hidden_size"], model["num_layers"]
    total = 0.0
    for layer in range(layers):
        moe = moe_layer_at(
            layer,
            num_experts=model.get("num_experts", 0),
            frequency=model.get("moe_layer_frequency", 1),
            first=model.get("moe_first_layer", 0),
        )
        flops = _layer_flops(model, {"activation_checkpointing": "none", "attention": "eager"}, seq, "torch", moe)
        total += 3 * flops.linear + 3 * flops.attention
    # Multi-token prediction depths: a block of the last layer's kind, the [2h -> h] projection and one more
    # pass through the output head each (Megatron-LM training.py num_floating_point_operations: "MTP norms
    # and proj", "MTP + final logit")
    depths = mtp_depths(model)
    if depths:
        flops = _layer_flops(
            model, {"activation_checkpointing": "none", "attention": "eager"}, seq, "torch", mtp_is_moe(model)
        )
        total += depths * (3 * flops.linear + 3 * flops.attention + 3 * 2 * 2 * h * h)
    return total + (1 + depths) * 3 * 2 * h * model["vocab_size"]


def _group_strides(axes: list[str], degrees: dict[str, int], order: str) -> list[tuple[int, int]]:
    """(size, stride in ranks) of each of a group's axes, the ranks laid out by the mesh order as
    lower/groups.py lays them out."""
    from mixle_compile.lower.groups import DENSE_TOKEN_AXES, EXPERT_TOKEN_AXES

    expert = any(a in ("ep", "etp", "edp") for a in axes)
    sizes = dict(degrees)
    if expert:
        sizes["edp"] = max(1, degrees["world_size"] // max(1, degrees["ep"] * degrees["etp"] * degrees["pp"]))
    tokens = EXPERT_TOKEN_AXES if expert else DENSE_TOKEN_AXES
    out, stride = [], 1
    for token in order.split("-"):
        for axis in tokens.get(token, ()):
            size = sizes.get(axis, 1)
            if axis in axes:
                out.append((size, stride))
            stride *= size
    return out


def _holds_one_of(experts: int, held: float, topk: int) -> float:
    """The chance that a token's ``topk`` experts, drawn from ``experts`` evenly loaded ones, include
    one of the ``held`` experts of a rank or node."""
    held = min(experts, round(held))
    return 1.0 - math.comb(experts - held, topk) / math.comb(experts, topk) if topk <= experts else 1.0


def _link_bandwidth(
    axes: list[str],
    degrees: dict[str, int],
    order: str,
    table: dict,
    collective: str | None = None,
    flex: tuple[int, int] | None = None,
) -> float:
    """The bandwidth a group over ``axes`` gets: within a node if all its ranks are on one. An
    ``all_to_all`` over several nodes sends ``1/n`` of its payload to each peer at once, the peers
    on the rank's own node over the node's links and the others over the network, both in flight
    together: its :func:`ring_bytes` take as long as the slower of the two shares, which this
    bandwidth expresses (a ring collective instead crosses the network with all of its bytes).

    ``flex`` = (experts, top-k): the expert exchange of a flex dispatcher (DeepEP, HybridEP), whose
    payload is still the plan's, one copy of a token per routed expert, but which sends a token once
    to each rank of its node that holds one of its experts and once to each other node that holds
    one (where it is fanned out over that node's links): per token, ``(g-1) P(rank)`` copies stay in
    the node and ``(m-1) P(node)`` cross the network, for ``g`` of the group's ``n`` ranks on each
    of its ``m`` nodes, the experts spread evenly over the ranks and the routing balanced."""
    strides = _group_strides(axes, degrees, order)
    span = sum((size - 1) * stride for size, stride in strides)
    inside = span < table["devices_per_node"]
    n = math.prod(size for size, _ in strides)
    if collective != "all_to_all" or n == 1:
        return table["intra_node"] if inside else table["inter_node"]
    nodes = 1 if inside else _group_nodes(axes, degrees, order, table)
    local = n / nodes  # the group's ranks on one node
    # What a token sends within its node and over the network, against `carried`, what the plan's
    # payload carries for it: the all-to-all sends 1/n of the payload to each peer; flex sends whole
    # copies of a token whose payload carries top-k of them.
    if flex is None:
        carried, within, across = 1, (local - 1) / n, (n - local) / n
    else:
        experts, carried = flex
        within = (local - 1) * _holds_one_of(experts, experts / n, carried)
        across = (nodes - 1) * _holds_one_of(experts, experts / nodes, carried)
    # ring_bytes counts (n-1)/n of the payload
    return (n - 1) / n * carried / max(within / table["intra_node"], across / table["inter_node"])


def flex_routing(spec: dict) -> tuple[int, int] | None:
    """(experts, top-k) where a spec's expert exchange is a flex dispatcher's, else None."""
    model, training = spec.get("model") or {}, spec.get("training") or {}
    if training.get("expert_dispatcher") != "flex" or not model.get("num_experts"):
        return None
    return model["num_experts"], model.get("experts_per_token") or 1


@dataclass(frozen=True)
class _Setting:
    """What a plan's step time depends on besides its collectives."""

    model: dict
    training: dict
    backend: str
    precision: str
    kind: str
    throughput: float | None
    table: dict
    linear_peak: float
    other_peak: float
    efficiency: float
    engine: Any = None  # the backend's EngineProfile


def _setting(spec: dict) -> _Setting:
    model = spec["model"]
    if model.get("family") != "transformer":
        raise NoPrediction("a step time is predicted for transformer models (a modules spec states no forward pass)")
    training = spec["training"]
    backend = spec["backend"] if isinstance(spec["backend"], str) else spec["backend"]["name"]
    precision = training.get("precision", "bf16")
    kind, throughput, table = _device(spec)
    linear_peak, other_peak = _peak(kind, throughput, table, precision)
    return _Setting(
        model,
        training,
        backend,
        precision,
        kind,
        throughput,
        table,
        linear_peak,
        other_peak,
        efficiency_of(kind, precision),
        _engine(spec["backend"]),
    )


def seconds_text(value: float) -> str:
    """A duration for people: seconds from one up, milliseconds and microseconds below."""
    if value == 0:
        return "0 s"
    if value >= 1:
        return f"{value:.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.1f} ms"
    return f"{value * 1e6:.1f} us"


def why_not_predicted(spec: dict) -> str | None:
    """Why no step time can be predicted for ``spec`` (JSON), or None when one can."""
    try:
        _setting(spec)
    except NoPrediction as e:
        return str(e)
    return None


@cache
def _named_engine(name: str) -> Any:
    """The EngineProfile of a backend's name (what a layer's work depends on is the same in every version)."""
    return _engine(name)


def _engine(backend: Any) -> Any:
    """The EngineProfile of a spec's ``backend`` as JSON (a name, or a mapping with its version)."""
    from types import SimpleNamespace

    from mixle_compile.engines import engine_profile

    if isinstance(backend, str):
        return engine_profile(backend)
    return engine_profile(
        SimpleNamespace(name=backend["name"], version=backend.get("version"), entry=backend.get("entry"))
    )


def stage_compute(
    spec: dict, tp: int, cp: int, stage_layers: list[int], stage_moe: list[int] | None = None
) -> tuple[list[float], list[float]]:
    """Seconds of one micro-step on each pipeline stage, and the attention part of each: the
    compute half of :func:`predict`. ``stage_moe``: each stage's MoE layers (:func:`stage_moe_layers`);
    without it each stage is taken as one block of consecutive layers."""
    return _stage_compute(_setting(spec), tp, cp, stage_layers, stage_moe)


def _stage_compute(
    st: _Setting, tp: int, cp: int, stage_layers: list[int], stage_moe: list[int] | None = None
) -> tuple[list[float], list[float]]:
    per_sample, fixed, attention = stage_compute_parts(st, tp, cp, stage_layers, stage_moe)
    b = st.training["micro_batch_size"]
    return [b * a + f for a, f in zip(per_sample, fixed, strict=True)], [b * a for a in attention]


def fused_attention_rate(length: float, causal: bool) -> float:
    """:data:`FUSED_ATTENTION_RATE` at a call of ``length`` tokens, interpolated in log2 of the length;
    1 beyond 16k, and below 512 tokens the trend of the shortest measured octave (512 to 1k, a power
    of the length) carried on."""
    points = FUSED_ATTENTION_RATE[causal]
    if length <= points[0][0]:
        (a, ra), (b, rb) = points[0], points[1]
        return ra * (length / a) ** math.log2(rb / ra)
    for (a, ra), (b, rb) in zip(points, points[1:], strict=False):
        if length <= b:
            t = (math.log2(length) - math.log2(a)) / (math.log2(b) - math.log2(a))
            return ra + t * (rb - ra)
    return 1.0


def attention_length_factor(seq: float, cp: int) -> float:
    """How much longer a rank's fused attention takes than at the kernel's long-sequence rate.
    Without context parallelism it is one causal call over the sequence. With it, the sequence is
    cut into ``2 * cp`` chunks and a rank holds two (load balancing), and attention runs as ``cp``
    ring steps (torch's ``_templated_ring_attention``, Transformer Engine's
    ``AttnFuncWithCPAndKVP2P``): the first, causal, over the rank's own ``seq / cp`` tokens, about
    ``1 / cp`` of its work; each later one without the mask, half of them all its queries against
    one chunk of keys (``seq / (2 * cp)``), half one chunk of queries against ``seq / cp`` keys."""
    if cp <= 1:
        return 1.0 / fused_attention_rate(seq, True)
    local = seq / cp
    later = 0.5 / fused_attention_rate(local / 2, False) + 0.5 / fused_attention_rate(local, False)
    return (1.0 / cp) / fused_attention_rate(local, True) + (1.0 - 1.0 / cp) * later


def stage_moe_layers(split: Any, model: dict) -> list[int]:
    """The mixture-of-experts layers each pipeline stage holds under ``split`` (a LayerSplit): over
    every chunk of its layers, so that an interleaved stage's chunks are counted where they are."""
    experts = model.get("num_experts", 0)
    out = [0] * split.pp
    if experts <= 0:
        return out
    frequency, start = model.get("moe_layer_frequency", 1), model.get("moe_first_layer", 0)
    starts = split.starts()
    for virtual in range(len(split.counts)):  # virtual stage w is chunk w // pp of stage w % pp
        a, b = starts[virtual], starts[virtual + 1]
        out[virtual % split.pp] += moe_layers_in(a, b - a, num_experts=experts, frequency=frequency, start=start)
    return out


def stage_compute_parts(
    st: _Setting, tp: int, cp: int, stage_layers: list[int], stage_moe: list[int] | None = None
) -> tuple[list[float], list[float], list[float]]:
    """Each stage's micro-step seconds as ``micro_batch_size * per_sample + fixed`` (FLOPs and
    activations grow with the tokens; a matmul reads its weight once whatever its rows), and the
    attention part per sample: (per_sample, fixed, attention per sample)."""
    model, training, table = st.model, st.training, st.table
    # Attention and the output head run in 16-bit even in an fp8 step (Float8 converts the linears),
    # at the bf16 peak, with the step's efficiency.
    efficiency = other_efficiency = st.efficiency
    seq = training["seq_len"]
    tokens = seq / cp  # one rank's tokens per sample of a micro-step
    # A fused kernel's calls (eager attention is priced by its score traffic instead).
    length_factor = 1.0 if training.get("attention") == "eager" else attention_length_factor(seq, cp)
    activation_bytes = 4 if st.precision == "fp32" else 2
    # A matrix multiplication reads its two operands and writes its result (Float8 reads fp8
    # operands and writes bf16). Async tensor parallelism multiplies tp chunks of the rows one after
    # another, each reading the whole local weight.
    operand_bytes = (1, activation_bytes) if st.precision == "fp8" else (activation_bytes, activation_bytes)
    weight_reads = tp if training.get("async_tensor_parallel") and tp > 1 else 1
    elementwise = ELEMENTWISE_BYTES[
        "compiled" if "model" in compiled_components(training.get("compile", False)) else "eager"
    ]
    bandwidth = table["memory_bandwidth"]
    # Ring attention's merges, per token of a layer (RING_MERGE_BYTES), where the engine runs a ring
    # over a fused kernel; a key head is never split over tp. Checkpointing of either engine runs them
    # again with the forward (torchtitan's op-level policy saves no element-wise op; Megatron's
    # selective recomputes the core attention, the ring with it).
    merge = 0.0
    ring = st.engine.context_parallel_ring if st.engine is not None else None
    if cp > 1 and ring is not None and training.get("attention") != "eager":
        a = attention_widths(model)
        kv = a.q / tp if st.engine.repeats_key_heads else max(a.k / tp, a.qk_head_dim)
        again = training.get("activation_checkpointing", "none") != "none"
        merge = ring_merge_bytes(a.q / tp, kv, cp, 2 if again else 1, ring)
        if ring == "torch":
            # torch.compile traces torch's ring through DTensor's dispatch and fuses the merges' chains
            # like the layer's other element-wise work (ELEMENTWISE_BYTES, relative to eager)
            merge *= elementwise / ELEMENTWISE_BYTES["eager"]

    # Each stage's compute per micro-step (a layer's index fixes whether it is MoE). Backward costs
    # twice the forward; the tp ranks of a stage split its matrix multiplications, and the routed
    # tokens' expert work spreads evenly over the ranks that hold them.
    per_sample, fixed, attention_of = [], [], []
    if stage_moe is None:  # each stage one block of consecutive layers
        starts = itertools.accumulate(stage_layers, initial=0)
        stage_moe = [
            moe_layers_in(
                a,
                n,
                num_experts=model.get("num_experts", 0),
                frequency=model.get("moe_layer_frequency", 1),
                start=model.get("moe_first_layer", 0),
            )
            for a, n in zip(starts, stage_layers, strict=False)
        ]
    kinds: dict[bool, tuple[_Layer, float, float]] = {}
    last_stage = len(stage_layers) - 1
    priced: dict[tuple[int, int, bool], tuple[float, float, float]] = {}  # stages alike cost alike
    depths = mtp_depths(model)
    for stage, (count, moe_layers) in enumerate(zip(stage_layers, stage_moe, strict=True)):
        if stage == last_stage and depths:
            # the multi-token prediction depths' blocks (of the last layer's kind) are the last stage's
            count, moe_layers = count + depths, moe_layers + (depths if mtp_is_moe(model) else 0)
        alike = (count, moe_layers, stage == last_stage)
        known_stage = priced.get(alike)
        if known_stage is not None:
            per_sample.append(known_stage[0])
            fixed.append(known_stage[1])
            attention_of.append(known_stage[2])
            continue
        # Layers of one kind (dense or MoE) cost the same: count each kind once (stage_moe_layers
        # says how many MoE layers each stage holds).
        linear = attention = moved = rows = weights = 0.0
        for moe, n in ((False, count - moe_layers), (True, moe_layers)):
            if not n:
                continue
            known = kinds.get(moe)
            if known is None:
                f = _layer_flops(model, training, seq, st.backend, moe, tp)
                at_none = _gemm_bytes(f.gemms, 0.0, operand_bytes, weight_reads)
                at_rows = _gemm_bytes(f.gemms, tokens, operand_bytes, weight_reads)
                if st.precision == "fp8":  # the casts grow with the rows too
                    at_rows += FP8_CAST_BYTES * _cast_elements(f.gemms, tokens)
                known = kinds[moe] = (f, at_rows - at_none, at_none)
            f, row_bytes, weight_bytes = known
            linear += n * (3 * f.linear + f.recompute_linear) / tp
            attention += n * (3 * f.attention + f.recompute_attention) / tp
            moved += (
                n * f.passes * (f.elementwise_width * activation_bytes * elementwise + f.score_elements * SCORE_BYTES)
                + n * merge
            )
            rows += n * f.gemm_passes * row_bytes
            weights += n * f.gemm_passes * weight_bytes
        attention_seconds = (
            tokens * attention * length_factor / (st.other_peak * other_efficiency * ATTENTION_EFFICIENCY)
        )
        sample = (
            tokens * linear / (st.linear_peak * efficiency) + attention_seconds + (tokens * moved + rows) / bandwidth
        )
        constant = weights / bandwidth
        if stage == last_stage:
            # the output head, once for the model and once more for each multi-token prediction depth
            heads = 1 + depths
            head = ((1.0, model["hidden_size"], model["vocab_size"] / tp, False),)
            at_rows = _gemm_bytes(head, tokens, (activation_bytes, activation_bytes), 1)
            at_none = _gemm_bytes(head, 0.0, (activation_bytes, activation_bytes), 1)
            sample += (
                heads
                * tokens
                * 3
                * 2
                * model["hidden_size"]
                * model["vocab_size"]
                / tp
                / (st.other_peak * other_efficiency)
            )
            sample += heads * 3 * (at_rows - at_none) / bandwidth
            constant += heads * 3 * at_none / bandwidth
            if depths:
                # each depth's [embedding, hidden] -> hidden projection: split over tp where the engine
                # splits it (EngineProfile.mtp_projection_split), run again under full checkpointing
                h = model["hidden_size"]
                split = tp if st.engine is None or st.engine.mtp_projection_split else 1
                again = 1 if training.get("activation_checkpointing") == "full" else 0
                projection = ((1.0, 2 * h, h / split, True),)
                proj_rows = _gemm_bytes(projection, tokens, operand_bytes, weight_reads)
                proj_none = _gemm_bytes(projection, 0.0, operand_bytes, weight_reads)
                sample += depths * (3 + again) * (tokens * 2 * 2 * h * h / split / (st.linear_peak * efficiency))
                sample += depths * (3 + again) * (proj_rows - proj_none) / bandwidth
                constant += depths * (3 + again) * proj_none / bandwidth
        priced[alike] = (sample, constant, attention_seconds)
        per_sample.append(sample)
        fixed.append(constant)
        attention_of.append(attention_seconds)
    return per_sample, fixed, attention_of


def predict(
    spec: dict,
    updates: list[dict],
    degrees: dict[str, int],
    order: str,
    bubble_fraction: float,
    stage_layers: list[int],
    memory: list[dict],
) -> StepTime:
    """The step time of a plan, from its JSON sections (spec, updates, mesh degrees and order,
    the schedule's bubble fraction, layers per stage, memory per stage)."""
    st = _setting(spec)
    training, table, backend = st.training, st.table, st.backend
    tp = degrees["tp"]
    micro_steps = degrees["microbatches"] * degrees["gradient_accumulation_steps"]
    split = _layer_split(spec, degrees)
    per_stage, attention_of = _stage_compute(st, tp, degrees["cp"], stage_layers, stage_moe_layers(split, st.model))
    busiest = max(range(len(per_stage)), key=per_stage.__getitem__)
    # the rows of a micro-step's tensor-parallel matmuls: its tokens (the sequence gathered)
    tokens = training["micro_batch_size"] * training["seq_len"] / degrees["cp"]

    traffic = []
    flex = flex_routing(spec)
    for u in updates:
        if u["stage"] != busiest:
            continue
        seconds = ring_bytes(u["collective"], u["group_size"], u["payload_bytes"]) * u["occurrences_per_step"]
        if not seconds:
            continue
        if backend == "megatron" and u["mesh_axes"] == ["pp"] and tp > 1 and not training.get("sequence_parallel"):
            # Megatron sends 1/tp of a stage's output from each tensor-parallel rank and gathers it
            # over the node's links (the scatter/gather optimisation, Narayanan et al. SC21 4.1;
            # with sequence parallelism the output is already split).
            seconds /= tp
        seconds /= _link_bandwidth(u["mesh_axes"], degrees, order, table, u["collective"], flex)
        seconds += u["occurrences_per_step"] * call_latency(u["mesh_axes"], u["payload"], u, degrees, order, table)
        behind = 0.0
        if u["mesh_axes"] == ["tp"] and u["payload"] == "activation":
            flops, linear = fused_matmul_flops(u["node_id"], st.model, training, backend, tp)
            behind = fused_seconds(st, (u["occurrences_per_step"] * tokens * flops, linear))
        traffic.append((u["mesh_axes"], u["payload"], seconds, behind))
    state = memory[busiest] if memory else {}
    state_bytes = sum(state.get(k, 0) for k in ("parameters", "gradients", "optimizer_state"))
    return combine(
        st,
        degrees,
        micro_steps * per_stage[busiest],
        micro_steps * attention_of[busiest],
        traffic,
        bubble_fraction,
        state_bytes,
        pipeline_overlapped=st.engine is not None
        and st.engine.overlaps_pipeline_transfers(
            training.get("pipeline_schedule"),
            training.get("virtual_pipeline_stages"),
            training.get("overlap_pipeline_transfers"),
        ),
    )


def combine(
    st: _Setting | dict,
    degrees: dict[str, int],
    compute: float,
    attention_share: float,
    traffic: list[tuple[list[str], str, float, float]],
    bubble_fraction: float,
    state_bytes: float,
    flops_per_token: float | None = None,
    pipeline_overlapped: bool = False,
) -> StepTime:
    """A step from its busiest stage's compute over the step (and the attention part of it), its
    collectives as (mesh axes, payload kind, seconds on their link, seconds of the matmuls async
    tensor parallelism fuses them with: :func:`fused_seconds`, 0 for none), the bubble fraction and the
    bytes of parameters, gradients and optimizer state the optimizer step reads and writes: what
    each engine hides and what stays exposed (the module docstring). ``flops_per_token``: the
    model's :func:`model_flops_per_token`, when the caller has it already. ``pipeline_overlapped``:
    the engine runs the stage's pipeline sends and receives beside its compute
    (EngineProfile.overlaps_pipeline_transfers), which then hides them up to its length."""
    st = _setting(st) if isinstance(st, dict) else st
    exposed: dict[str, float] = {}
    hidden: dict[str, float] = {}
    data_seconds = 0.0
    context_seconds = 0.0
    pipeline_seconds = 0.0
    tp = degrees["tp"]
    overlap_tp = bool(st.training.get("async_tensor_parallel")) and tp > 1
    for axes, payload, seconds, fused in traffic:
        key = "+".join(axes)
        if payload in ("gradient", "parameter") and set(axes) <= _DATA_AXES | {"cp"}:
            data_seconds += seconds
            hidden[key] = hidden.get(key, 0.0) + seconds
        elif list(axes) == ["cp"]:
            context_seconds += seconds
            hidden[key] = hidden.get(key, 0.0) + seconds
        elif pipeline_overlapped and list(axes) == ["pp"]:
            pipeline_seconds += seconds
            hidden[key] = hidden.get(key, 0.0) + seconds
        elif overlap_tp and list(axes) == ["tp"] and fused > 0:
            # Async tensor parallelism splits the collective into tp chunks and multiplies one chunk
            # while the next arrives, inside the matmuls it is fused with (``fused``: their seconds):
            # all but the first chunk's share of them can hide it, and only its excess is exposed.
            shown = min(seconds, fused * (tp - 1) / tp)
            hidden[key] = hidden.get(key, 0.0) + shown
            if seconds > shown:
                exposed[key] = exposed.get(key, 0.0) + seconds - shown
        else:
            exposed[key] = exposed.get(key, 0.0) + seconds
    # What compute cannot hide is exposed: data-parallel traffic behind the whole step's compute,
    # context-parallel traffic behind attention.
    if data_seconds > compute:
        exposed["data-parallel"] = data_seconds - compute
    if context_seconds > attention_share:
        exposed["cp"] = exposed.get("cp", 0.0) + context_seconds - attention_share
    if pipeline_seconds > compute:
        exposed["pp"] = exposed.get("pp", 0.0) + pipeline_seconds - compute
    busy = compute + sum(exposed.values())
    bubble = busy * bubble_fraction / (1 - bubble_fraction) if bubble_fraction < 1 else 0.0
    optimizer = 2 * state_bytes / st.table["memory_bandwidth"]
    total = busy + bubble + optimizer

    model, training = st.model, st.training
    seq = training["seq_len"]
    world = degrees["world_size"]
    global_tokens = training["global_batch_size"] * seq
    per_token = model_flops_per_token(model, seq) if flops_per_token is None else flops_per_token
    tokens_per_second = global_tokens / total
    tflops = per_token * tokens_per_second / world
    peak = st.table.get("peak", {}).get(st.precision) if st.throughput is None else st.throughput
    return StepTime(
        seconds=total,
        compute=compute,
        bubble=bubble,
        exposed_communication=exposed,
        hidden_communication=hidden,
        optimizer=optimizer,
        tokens_per_second=tokens_per_second,
        tokens_per_second_per_device=tokens_per_second / world,
        model_flops_per_token=per_token,
        tflops_per_device=tflops / 1e12,
        mfu=tflops / peak if peak else None,
        efficiency=st.efficiency,
        peak_flops=st.linear_peak,
    )


def link_bandwidth(
    axes: list[str], degrees: dict[str, int], order: str, spec: dict, collective: str | None = None
) -> float:
    """The bandwidth a group over ``axes`` gets in a plan of these degrees (:func:`predict`'s), for
    one ``collective`` of it (only an all_to_all differs, and with it the spec's expert dispatcher)."""
    return _link_bandwidth(axes, degrees, order, _device(spec)[2], collective, flex_routing(spec))


def predict_lowered(spec: Any, lowered: Any) -> StepTime:
    """:func:`predict` on a validated Spec and its lowering (``lower(spec, schedule=False)`` is enough)."""
    from mixle_compile.engines import engine_profile
    from mixle_compile.schedules import bubble_chunks, bubble_fraction

    data = spec.model_dump(mode="json")
    plan = lowered.plan
    degrees = plan.as_dict()
    t = spec.training
    bubble = 0.0
    if plan.pp > 1:
        runs = engine_profile(spec.backend).schedule_microbatches(plan.microbatches, plan.gradient_accumulation_steps)
        v = bubble_chunks(t.pipeline_schedule, t.virtual_pipeline_stages)
        bubble = bubble_fraction(plan.pp, runs, v)
    updates = [
        {
            "stage": stage,
            "collective": u.update.collective.value,
            "group_size": u.group_size,
            "payload_bytes": u.payload_bytes,
            # an update of a run's first block stands for every block of the run (lower/runs.py)
            "occurrences_per_step": u.occurrences_per_step * lowered.count(u.layer),
            "payload": u.update.payload.value,
            "mesh_axes": [str(getattr(a, "value", a)) for a in u.update.mesh_axes],
            "node_id": u.update.node_id,
        }
        for u in lowered.updates
        for stage in lowered.on_stages(u.layer, u.stage)  # and on every stage the run repeats on
    ]
    split = _split(data, degrees)
    return predict(data, updates, degrees, lowered.grid.order, bubble, split, [m.as_dict() for m in lowered.memory])


def _layer_split(spec: dict, degrees: dict) -> Any:
    from mixle_compile.layer_split import split_layers

    training = spec["training"]
    backend = spec["backend"] if isinstance(spec["backend"], str) else spec["backend"]["name"]
    pp = degrees["pp"]
    return split_layers(
        spec["model"]["num_layers"],
        pp,
        training.get("virtual_pipeline_stages", 1) if pp > 1 else 1,
        training.get("pipeline_layers"),
        backend,
    )


def _split(spec: dict, degrees: dict) -> list[int]:
    split = _layer_split(spec, degrees)
    return [split.layers_on_stage(s) for s in range(degrees["pp"])]


def predict_document(doc: Any) -> StepTime:
    """:func:`predict` on a plan document (mixle_compile.plan.document.PlanDocument)."""
    spec = doc.spec
    degrees = {**doc.mesh.degrees}
    if spec["model"].get("family") != "transformer":
        raise NoPrediction("a step time is predicted for transformer models")
    layers = _split(spec, degrees)
    bubble = doc.schedule.bubble_fraction if doc.schedule is not None else 0.0
    return predict(
        spec,
        [u.model_dump() for u in doc.updates],
        degrees,
        doc.mesh.order,
        bubble,
        layers,
        [m.model_dump() for m in doc.memory],
    )

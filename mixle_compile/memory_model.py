"""The memory model, written once and read two ways.

The lowering prices each rank's memory exactly, parameter by parameter and stage by stage
(:mod:`mixle_compile.lower.memory`); the verifier's memory rule (R001) bounds the heaviest rank
symbolically, over Z3 terms, so that it can also say which fields conflict and search for the
nearest plan that fits. Both take every formula from this module, so that the two cannot drift:
the same terms, the same constants, the same choices of what is held.

Every formula takes an ``arithmetic`` that supplies the three operations that differ between
numbers and solver terms (a conditional, a minimum, exact division); :data:`NUMBERS` serves the
lowering, the verifier passes its Z3 version. Python's operators do the rest for both.

The model (bytes per rank):

- parameters: each element in its dtype, divided by the ranks that share one copy;
- gradients: as many bytes as the parameters;
- optimizer state: Adam/AdamW keep two fp32 moments per element (:data:`MOMENT_BYTES`), and every
  element stored below fp32 has an fp32 master copy (:data:`MASTER_BYTES`);
- gathered parameters: under FSDP, the unsharded (tensor-parallel-local) parameters of
  :data:`FSDP_UNITS_IN_FLIGHT` units (a layer, or the embedding and head) at once, the one
  computing and the one prefetched;
- activations: per layer and micro-batch, Korthikanti et al. (2022) for 16-bit activations (fp32
  doubles them), times the micro-batches a stage keeps in flight
  (:func:`micro_batches_in_flight`); with checkpointing, the layer being recomputed holds its
  whole activations once more (the recompute working set: a layer without checkpointing minus
  what checkpointing kept of it); the last stage adds the logits of one micro-batch and the
  loss's buffers, as the engine's cross-entropy allocates them (:func:`loss_bytes_per_logit`);
- communication buffers: on engines that run torch's pipelining runtime, the receive buffers a
  pipeline stage allocates once per micro-batch (:func:`pipeline_buffer_bytes`); under FSDP, the
  reduce-scatter input of the unit whose gradients are being reduced
  (:func:`reduce_scatter_buffer_bytes`); under context parallelism on an engine that runs torch's
  ring attention, the exchange buffers and fp32 accumulators of its backward
  (:func:`ring_attention_bytes`); the last two are needed only once the loss's buffers are freed
  (:func:`after_loss_bytes`);
- allocator reserve: what the caching allocator holds beyond live tensors, a fraction of them
  (:data:`ALLOCATOR_RESERVE`).

docs/memory.md lists every term with its formula and its source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from mixle_compile.schedules import interleaved_warmup, one_f_one_b_warmup

MOMENT_BYTES = 8  # Adam(W): two fp32 moments per element
MASTER_BYTES = 4  # an fp32 master copy of every element stored below fp32
#: The terms of a rank's memory, in the order explain shows them (docs/memory.md defines each).
MEMORY_KINDS = (
    "parameters",
    "gathered_parameters",
    "gradients",
    "optimizer_state",
    "activations",
    "recompute",
    "loss",
    "buffers",
    "reserve",
)
#: Loss implementations (:func:`loss_bytes_per_logit`).
MATERIALIZED_LOSS = "materialized"  # fp32 logits materialised, their softmax or gradient beside them
COMPILED_LOSS = "compiled"  # torch.compile fuses upcast, softmax and gradient
VOCAB_PARALLEL_LOSS = "vocab_parallel"  # Megatron-Core's in-place vocab-parallel cross-entropy
LOSS_PARALLEL_LOSS = "loss_parallel"  # torch's DTensor loss parallelism over vocabulary shards
#: The caching allocator's reserve beyond live tensors, as a fraction of them: torchtitan reports
#: the peak of ``reserved_bytes.all.peak`` (torchtitan/tools/metrics.py, the logged "memory"), its
#: launch scripts set ``expandable_segments:True``. Calibrated on the published peaks as the
#: smallest round fraction that leaves no row below 0.9 of its measured peak (an underestimate is
#: the costly side; benchmarks/bench_memory.py, docs/memory.md). It is cache the allocator gives
#: back under pressure, so R001 compares only the live bytes with the device (R002 warns).
ALLOCATOR_RESERVE = 0.125
FSDP_UNITS_IN_FLIGHT = 2  # the unit computing and the one prefetched
ACCUMULATED_GRAD_BYTES = 4  # FSDP2 accumulates unsharded gradients in its fp32 reduce dtype
REDUCE_BYTES = 4  # FSDP2 reduces gradients in fp32 (torchtitan's mixed_precision_reduce default "float32")


@dataclass(frozen=True)
class MoESaved:
    """What an engine's mixture-of-experts block saves for its backward, in bytes at 16-bit
    activations: per routed token, ``routed_hidden`` per hidden feature, ``routed_ffn`` per local
    expert feature and ``routed_fixed`` more (its routing weight); per token entering the block,
    ``token_hidden`` per hidden feature and ``token_experts`` per expert (the router's scores).
    Each engine's figures and their source are in :meth:`mixle_compile.engines.EngineProfile.moe_saved`."""

    routed_hidden: int
    routed_ffn: int
    routed_fixed: int
    token_hidden: int
    token_experts: int


def stored_dtype(precision: str) -> str:
    """The dtype weights are stored in for a training precision. fp8 is the dtype of the matmuls, not
    of the weights: torchtitan's Float8Linear keeps its weights in high precision and casts per
    matmul (torchtitan/components/quantization/float8.py), and Megatron-Core with Transformer
    Engine keeps bf16 weights unless `--fp8-param-gather` is asked for."""
    return "bf16" if precision == "fp8" else precision


class Arithmetic(Protocol):
    def when(self, condition: Any, then: Any, otherwise: Any) -> Any: ...

    def smaller(self, a: Any, b: Any) -> Any: ...

    def exact(self, value: Any) -> Any:
        """The value as an exact quantity, so that divisions do not truncate."""


class _Numbers:
    def when(self, condition, then, otherwise):
        return then if condition else otherwise

    def smaller(self, a, b):
        return min(a, b)

    def exact(self, value):
        return float(value)


NUMBERS: Arithmetic = _Numbers()


def optimizer_bytes_per_element(ar: Arithmetic, *, adam: Any, below_fp32: Any) -> Any:
    """Optimizer bytes one parameter element costs: moments under Adam(W), a master copy below fp32."""
    return ar.when(adam, MOMENT_BYTES, 0) + ar.when(below_fp32, MASTER_BYTES, 0)


def fsdp_shards(*, dp_shard: Any, cp: Any, over_cp: bool) -> Any:
    """Whether FSDP shards parameters: dp_shard > 1, or, for an engine that applies FSDP over
    dp_shard * cp (torchtitan's ``ParallelDims.fsdp_enabled``), dp_shard * cp > 1."""
    return dp_shard * cp > 1 if over_cp else dp_shard > 1


def activation_bytes_per_layer(
    ar: Arithmetic,
    *,
    seq_len: Any,
    cp: Any,
    micro_batch_size: Any,
    hidden_size: Any,
    num_heads: Any,
    tp: Any,
    sequence_parallel: Any,
    full_recompute: Any,
    selective_recompute: Any,
    fp32: Any,
    eager_attention: Any = True,
    op_level_selective: bool = False,
    query_width: Any = 0,
    kv_width: Any = 0,
    ffn_width: Any = 0,
    fp8_saved_inputs: Any = False,
    dense_ffn_width: Any = 0,
    gated: bool | None = None,
    attention_width: Any = 0,
    latent_width: Any = 0,
    op_saved_split: Any = 0,
    op_saved_whole: Any = 0,
    up_projection_width: Any = 0,
    recomputed_modules: frozenset[str] = frozenset({"core_attn"}),
    latent_replicated: bool = False,
) -> Any:
    """Bytes one transformer layer keeps for the backward pass, per micro-batch.

    s*b*h*(10 + 24/t) + 5*a*s^2*b/t without sequence parallelism, 34*s*b*h/t + 5*a*s^2*b/t with
    it (Korthikanti et al. 2022); the 5*a*s^2*b/t term is the stored attention scores, softmax
    and its dropout mask, which only eager attention keeps: a fused (flash) kernel never stores
    them and selective recomputation recomputes them. Full recomputation keeps only the layer
    input (2*s*b*h, divided by t under sequence parallelism). s is the local sequence
    (seq_len / cp); fp32 activations double it.

    ``op_level_selective`` is torchtitan's selective checkpointing (``SelectiveAC``, op mode,
    torchtitan/distributed/activation_checkpoint.py): inside each block it saves the outputs of
    every odd-numbered matmul (the 1st, 3rd, ... of q, k, v, o, w1, w3, w2), attention's output and
    the reduce-scatters of sequence parallelism, and recomputes the rest from the block's input:
    ``2*s*b*(input + (q + v + w1)/t + w2_out + attention/t + rs)`` bytes, the input and the
    reduce-scatter outputs ``h/t`` each under sequence parallelism (``h`` input, no reduce-scatter,
    without it), the row-parallel w2 output whole (a partial sum before its reduction).

    With the block's widths known (``gated`` and the dense MLP's ``dense_ffn_width``), the same
    count is taken tensor by tensor instead of for GPT-3's shapes: per token, the two norms' inputs
    and the q/k/v and first MLP linear inputs (``h`` each, ``h/t`` under sequence parallelism), the
    queries, keys and values as the fused attention keeps them (``q + 2 kv``, over ``t``), the
    attention output (``q/t``), the first MLP linear's outputs (``2F/t`` gated, ``F/t`` not) and the
    last one's input (``F/t``), two bytes each, and one byte per element of the two dropout masks
    (``h`` each, ``h/t`` under sequence parallelism) for a non-gated (GPT-style) block, whose
    recipes train with dropout (Megatron-LM's ``--hidden-dropout`` and ``--attention-dropout``
    default to 0.1); gated blocks (Llama-family SwiGLU) are trained without (torchtitan's models have
    no dropout; Megatron-Bridge's Llama providers set both to 0). With GPT-3's shapes (``q = kv = h``,
    ``F = 4h``, not gated) this is Korthikanti's ``34`` and ``10 + 24/t`` exactly.

    ``fp8_saved_inputs``: the linear layers keep their inputs for the weight gradient as the fp8
    copy they cast (Transformer Engine's ``Linear`` and ``LayerNormLinear`` save the quantized input,
    transformer_engine/pytorch/module/linear.py, ``saved_inputmat = inputmat`` after the cast), one
    byte an element instead of two, where the linear alone keeps that input: the normalised input of
    the q/k/v projection and of the MLP's first linear (``h`` wide each; ``h/t`` under sequence
    parallelism) and the input of the MLP's last one (``dense_ffn_width/t``). The attention output
    stays kept in 16 bits by the attention kernel for its own backward, so the output projection's
    fp8 copy of it (``query_width/t``) is kept besides it. A mixture-of-experts layer replaces the
    dense MLP's share with its block's (:func:`moe_layer_extra_bytes`, which takes the same widths).

    Attention other than grouped-query attention gives its widths: ``attention_width`` the queries,
    keys, values and attention output together (``q + 2 kv + q`` when 0), ``latent_width`` what it
    keeps beside the hidden-wide inputs, ``h``-like (over ``t`` under sequence parallelism): for
    Multi-head Latent Attention the latents' norms' inputs and the up projections' inputs
    (``q_lora + kv_lora + rope`` and ``q_lora + kv_lora``), whole on every tp rank where the engine
    runs the down projections on every token (``latent_replicated``: torchtitan). ``op_saved_split`` and
    ``op_saved_whole`` are the outputs the op-level policy saves, split over ``t`` and whole (the
    odd-numbered matmuls' and attention's; ``q + kv + w1 + q`` and ``w2``'s ``h`` when 0).

    ``recomputed_modules``: what Megatron-Core's selective checkpointing runs again
    (``recompute_modules``, transformer_config.py; the tensor-by-tensor count only). ``core_attn``
    keeps eager attention's scores from being stored; ``layernorm`` discards the two norms' outputs
    (the q/k/v and first MLP linear inputs, ``2h``); ``mla_up_proj`` MLA's up projections' outputs
    (queries, keys and values, ``up_projection_width/t``); ``mlp`` a dense MLP's tensors beside its
    input (its split part). The MoE block's modules are :func:`moe_layer_extra_bytes`'."""
    s = ar.exact(seq_len) / ar.exact(cp)
    t = ar.exact(tp)
    sbh = s * ar.exact(micro_batch_size) * ar.exact(hidden_size)
    scores = 5 * ar.exact(num_heads) * s * s * ar.exact(micro_batch_size) / t
    kept = ar.when(sequence_parallel, 34 * sbh / t, sbh * (10 + 24 / t))
    if gated is not None and dense_ffn_width and query_width:
        sb = s * ar.exact(micro_batch_size)
        h = ar.exact(hidden_size)
        q, kv, f = ar.exact(query_width), ar.exact(kv_width or query_width), ar.exact(dense_ffn_width)
        masks = 0 if gated else 2 * h  # one byte an element, two masks
        # norms' inputs, q/k/v (or latent down projections') and first MLP linear inputs, masks
        latent = ar.exact(latent_width)
        whole = 2 * (4 * h + (0 if latent_replicated else latent)) + masks
        attention = ar.exact(attention_width) if attention_width else q + 2 * kv + q
        mlp = 2 * (3 if gated else 2) * f
        split = 2 * attention + mlp
        kept = ar.when(sequence_parallel, sb * (whole + split) / t, sb * (whole + split / t))
        if latent_replicated:
            kept = kept + sb * 2 * latent
        # Megatron's selective checkpointing beyond the attention core: what it does not store
        # Megatron's Transformer Engine layers fuse the norms into the linears that read them, except
        # MLA's input norm (its down projections are plain TELinear) and an MoE layer's pre-MLP norm
        # (whose output moe_layer_extra_bytes leaves out): "layernorm" discards MLA's norm output, but
        # for the fp8 copy the linear keeps (gpt_layer_specs.py; transformer_layer.py recomputes a
        # norm that is not IdentityOp)
        discarded_whole = 0
        if "layernorm" in recomputed_modules and latent_width:
            discarded_whole = ar.when(fp8_saved_inputs, 1, 2) * h if fp8_saved_inputs is not False else 2 * h
        discarded_split = (2 * ar.exact(up_projection_width) if "mla_up_proj" in recomputed_modules else 0) + (
            mlp if "mlp" in recomputed_modules else 0
        )
        modules_kept = kept - ar.when(
            sequence_parallel,
            sb * (discarded_whole + discarded_split) / t,
            sb * (discarded_whole + discarded_split / t),
        )
    else:
        modules_kept = kept
    if op_level_selective:
        sb = s * ar.exact(micro_batch_size)
        h = ar.exact(hidden_size)
        if op_saved_split:
            saved = ar.exact(op_saved_split) / t + ar.exact(op_saved_whole)
        else:
            saved = (ar.exact(query_width) + ar.exact(kv_width) + ar.exact(ffn_width) + ar.exact(query_width)) / t + h
        saved = saved + ar.when(sequence_parallel, 3 * h / t, h)
        selective = 2 * sb * saved
    else:
        # the attention core recomputed (Megatron's default) never stores eager attention's scores
        selective = (
            modules_kept if "core_attn" in recomputed_modules else modules_kept + ar.when(eager_attention, scores, 0)
        )
    per_layer = ar.when(
        full_recompute,
        ar.when(sequence_parallel, 2 * sbh / t, 2 * sbh),
        ar.when(selective_recompute, selective, ar.when(eager_attention, kept + scores, kept)),
    )
    if fp8_saved_inputs is not False:
        sb = s * ar.exact(micro_batch_size)
        h = ar.exact(hidden_size)
        whole_inputs = ar.when(sequence_parallel, 2 * h / t, 2 * h)  # q/k/v and first MLP linear inputs
        narrowed = whole_inputs + (ar.exact(dense_ffn_width) - ar.exact(query_width)) / t
        # what selective checkpointing already discards is not narrowed again
        discarded = ar.exact(dense_ffn_width) / t if "mlp" in recomputed_modules else 0
        narrowed = ar.when(selective_recompute, narrowed - discarded, narrowed)
        per_layer = per_layer - ar.when(fp8_saved_inputs, ar.when(full_recompute, 0, sb * narrowed), 0)
    return per_layer * ar.when(fp32, 2, 1)


def micro_batches_in_flight(
    ar: Arithmetic,
    *,
    pp: Any,
    stage: Any,
    microbatches: Any,
    gpipe: Any,
    interleaved: Any,
    virtual_stages: Any,
    group: Any,
) -> Any:
    """Micro-batches whose activations stage `stage` holds at once, in whole-stage units.

    One without a pipeline (each micro-batch's backward frees it before the next starts); all of
    them under GPipe. Under 1F1B and interleaved 1F1B a stage runs its warm-up's forwards, then the
    steady state's forward before its first backward, so it holds one more than its warm-up, at
    most every forward of the step (:func:`mixle_compile.schedules.one_f_one_b_warmup`,
    :func:`~mixle_compile.schedules.interleaved_warmup`, which both engines count alike):
    ``min(m, pp - stage)`` under 1F1B. An interleaved forward is one model chunk of a micro-batch,
    1/v of the stage's layers, and `group` is the micro-batches per round
    (:func:`mixle_compile.schedules.microbatches_per_round`); with m >= pp on the first stage that
    is Narayanan et al.'s ``pp * (1 + (pp - 1) / (pp * v))``, and the cap at ``m * v`` chunks
    matters when m is small against the warm-up."""
    one_f_one_b = ar.smaller(one_f_one_b_warmup(ar, pp, microbatches, stage) + 1, microbatches)
    chunks = ar.smaller(
        interleaved_warmup(ar, pp, microbatches, virtual_stages, stage, group) + 1, microbatches * virtual_stages
    )
    return ar.when(
        pp == 1,
        ar.exact(1),
        ar.when(
            gpipe,
            ar.exact(microbatches),
            ar.when(interleaved, ar.exact(chunks) / ar.exact(virtual_stages), ar.exact(one_f_one_b)),
        ),
    )


def loss_bytes_per_logit(ar: Arithmetic, *, implementation: str, fp32: Any) -> Any:
    """Bytes per logit at the loss's peak (the start of its backward, when every stored activation
    is still held), by how the engine computes the cross-entropy:

    * ``materialized`` -- 12 bytes: fp32 logits or log-probabilities kept for the backward, and two
      fp32 tensors of their size while it runs. torchtitan eager ``cross_entropy_loss``
      (``F.cross_entropy(pred.float())``: log_softmax keeps its fp32 output; nll_loss's backward
      allocates an fp32 gradient and log_softmax's backward another, torchtitan/components/loss.py);
      the in-tree runtime's ``VocabParallelCrossEntropy`` keeps fp32 logits and builds
      ``exp(logits - lse)`` and the gradient (mixle_compile/runtime/tensor_parallel.py). The
      head's own output in the training dtype is freed before (``del pred``; not saved).
    * ``compiled`` -- twice the training dtype: torchtitan compiles the loss with ``compile.enable``
      and ``"loss" in compile.components`` (0.1 onward, ``build_cross_entropy_loss``); inductor
      keeps the head's output and fuses upcast, softmax and gradient, so the gradient in the
      training dtype is the only new tensor.
    * ``loss_parallel`` -- 16 bytes: torchtitan under tensor parallelism keeps the logits sharded
      over the vocabulary and computes the loss in torch's ``loss_parallel`` context
      (``parallel_dims.loss_parallel_enabled``: tp > 1 unless disabled). Its backward
      (``_nll_loss_and_log_softmax_backward``, torch/distributed/tensor/parallel/loss.py) holds the
      saved fp32 log-probabilities, a zero-filled fp32 gradient, ``exp(x)`` and their sum at once.
    * ``vocab_parallel`` -- 4 bytes plus the training dtype (4 in fp32): Megatron-Core's
      ``VocabParallelCrossEntropy`` upcasts to fp32 once and computes max, exp and softmax in place
      on that copy, keeping it for the backward, which turns it into the gradient in place; autograd
      then casts the gradient to the logits' dtype (megatron/core/tensor_parallel/cross_entropy.py).
    """
    if implementation == COMPILED_LOSS:
        return ar.when(fp32, 8, 4)
    if implementation == VOCAB_PARALLEL_LOSS:
        return ar.when(fp32, 4, 6)
    if implementation == LOSS_PARALLEL_LOSS:
        return 16
    return 12


def logits_bytes(
    ar: Arithmetic, *, seq_len: Any, cp: Any, micro_batch_size: Any, vocab_size: Any, tp: Any, bytes_per_logit: Any
) -> Any:
    """The last stage's logits of one micro-batch (vocabulary split over tp) while the loss runs,
    at :func:`loss_bytes_per_logit` bytes each."""
    s = ar.exact(seq_len) / ar.exact(cp)
    return s * ar.exact(micro_batch_size) * ar.exact(vocab_size) / ar.exact(tp) * bytes_per_logit


#: Hidden-sized tensors a multi-token prediction depth keeps for its backward beyond its transformer
#: block, per token (Megatron-Core multi_token_prediction.py ``MultiTokenPredictionLayer``): the
#: embedding of the tokens ahead and the previous depth's hidden state (the inputs of enorm and hnorm),
#: their normalised concatenation (eh_proj's input, two hidden widths), and the input and output of
#: final_layernorm (the output is the shared head's saved input).
MTP_SAVED_HIDDEN = 6


def mtp_depth_bytes(
    ar: Arithmetic,
    *,
    seq_len: Any,
    cp: Any,
    micro_batch_size: Any,
    tp: Any,
    hidden_size: Any,
    sequence_parallel: Any,
    fp32: Any,
) -> Any:
    """What one multi-token prediction depth keeps for its backward beyond its block, per micro-batch
    (:data:`MTP_SAVED_HIDDEN` hidden-sized tensors; split over tp with sequence parallelism)."""
    s = ar.exact(seq_len) / ar.exact(cp)
    split = ar.when(sequence_parallel, ar.exact(tp), 1)
    element = ar.when(fp32, 4, 2)
    return s * ar.exact(micro_batch_size) * ar.exact(hidden_size) * MTP_SAVED_HIDDEN * element / split


def reserve_bytes(ar: Arithmetic, live: Any) -> Any:
    """What the caching allocator reserves beyond the live bytes (:data:`ALLOCATOR_RESERVE`)."""
    return ar.exact(live) * ALLOCATOR_RESERVE


def gathered_parameter_bytes(
    ar: Arithmetic,
    *,
    fsdp: Any,
    largest_unit_bytes: Any,
    keeps_stage: Any = False,
    stage_bytes: Any = 0,
    stage_elements: Any = 0,
) -> Any:
    """Under FSDP, the unsharded parameters of the units in flight.

    ``keeps_stage``: under a pipeline torchtitan does not reshard after forward (its
    ``fsdp_reshard_after_forward`` "default" is "not pp") and torch's ``PipelineStage`` runs every
    backward but the last without resharding or gradient sync (``backward_maybe_with_nosync``,
    torch/distributed/pipelining/stage.py), so a stage holds all its parameters gathered and their
    unsharded gradients, accumulated in fp32, until the step's last backward."""
    in_flight = ar.when(fsdp, FSDP_UNITS_IN_FLIGHT * largest_unit_bytes, 0)
    if keeps_stage is False:
        return in_flight
    whole_stage = stage_bytes + ACCUMULATED_GRAD_BYTES * stage_elements
    return ar.when(fsdp, ar.when(keeps_stage, whole_stage, in_flight), 0)


def boundary_bytes(
    ar: Arithmetic,
    *,
    seq_len: Any,
    cp: Any,
    micro_batch_size: Any,
    hidden_size: Any,
    tp: Any,
    sequence_parallel: Any,
    fp32: Any,
) -> Any:
    """One micro-batch of the hidden states that cross a pipeline-stage boundary: ``b * s * h``
    elements of the local sequence (``seq_len / cp``) in the activation dtype, split over tp under
    sequence parallelism (torchtitan's tensor-parallel plan ends each block with a row-parallel
    linear whose output is sequence-sharded and local, ``use_local_output``)."""
    s = ar.exact(seq_len) / ar.exact(cp)
    elements = s * ar.exact(micro_batch_size) * ar.exact(hidden_size)
    return ar.when(sequence_parallel, elements / ar.exact(tp), elements) * ar.when(fp32, 4, 2)


def pipeline_buffer_bytes(
    ar: Arithmetic,
    *,
    boundary: Any,
    microbatches: Any,
    activation_stages: Any,
    gradient_stages: Any,
    saved_inputs: Any = 0,
) -> Any:
    """The receive buffers of torch's pipelining runtime on one rank.

    A ``PipelineStage`` allocates, when its schedule first runs and for as long as it lives, one
    buffer per micro-batch for its input activations unless it is the first stage
    (``_prepare_forward_infra``) and one per micro-batch for the gradients of its outputs unless it
    is the last (``_prepare_backward_infra`` -> ``_create_grad_recv_info``),
    torch/distributed/pipelining/stage.py. ``activation_stages`` / ``gradient_stages`` count the
    rank's stages that hold each kind; ``saved_inputs`` are the received activations already priced
    as the first layer's stored input (the micro-batches in flight: the received buffer is the
    tensor the layer saves)."""
    buffers = ar.exact(microbatches) * ar.exact(activation_stages) - ar.exact(saved_inputs)
    buffers = buffers + ar.exact(microbatches) * ar.exact(gradient_stages)
    return buffers * boundary


def reduce_scatter_buffer_bytes(
    ar: Arithmetic,
    *,
    fsdp: Any,
    unit_elements: Any,
    unit_bytes: Any,
    accumulated: Any = False,
) -> Any:
    """Under FSDP2, the reduce-scatter of one unit's gradients: ``foreach_reduce`` copies the
    unsharded gradients (in the parameters' dtype, ``unit_bytes``) into one flat input in the
    reduce dtype (fp32) and frees them only after the copy
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py), so the largest unit's gradients and
    their fp32 copy are live at once. Where the unsharded gradients are already priced as
    accumulated fp32 (``accumulated``: a stage kept gathered under a pipeline), only the copy is
    new. It is needed while a layer's backward runs (:func:`after_loss_bytes`)."""
    copy = ar.exact(unit_elements) * REDUCE_BYTES + ar.when(accumulated, 0, ar.exact(unit_bytes))
    return ar.when(fsdp, copy, 0)


def ring_attention_bytes(
    ar: Arithmetic,
    *,
    seq_len: Any,
    cp: Any,
    micro_batch_size: Any,
    query_width: Any,
    key_width: Any,
    tp: Any,
    head_dim: Any,
    fp32: Any,
) -> Any:
    """What torch's ring attention allocates in one layer's backward beyond a plain attention
    backward, under context parallelism (torch/distributed/tensor/experimental/_attention.py,
    ``_templated_ring_attention_backward``; torchtitan runs it for every cp > 1):

    * the keys and values of the whole context group, all-gathered at once: ``cp * 2 * k``
      elements in the activation dtype (the default rotate method, ``allgather``:
      ``_AllGatherRotater``; torchtitan's ``context_parallel_rotate_method`` defaulted to it and,
      once the option was removed, torch's ``_cp_options.rotate_method`` does), plus the local
      concatenated copy it is gathered from (``2 * k``);
    * the query gradient accumulated in fp32 (``_cp_options.convert_to_f32``, on by default): 4
      bytes per query element;
    * the key and value gradients, accumulated in fp32 and passed round the ring by all-to-all
      (``dkv_rotater``): the received buffer being added to, the concatenated copy being sent and
      the one arriving, ``3 * 2 * k`` fp32 elements.

    ``q`` and ``k`` are a rank's query and key elements of one micro-batch: the local sequence
    (``seq_len / cp``) times the micro-batch times the widths over tp; a key head is never split,
    so its local width is at least ``head_dim`` (heads replicated when tp exceeds them; pass
    ``head_dim=0`` where the key heads are the query heads, which tp always divides).
    ``key_width`` is the width the engine hands the kernel: the query's where the model repeats
    its key heads before attention, else the key heads'."""
    local_key = ar.exact(key_width) / ar.exact(tp)
    if head_dim:  # key heads may be fewer than tp (with repeated heads they never are)
        local_key = ar.when(local_key < ar.exact(head_dim), ar.exact(head_dim), local_key)
    element = ar.when(fp32, 4, 2)
    # the whole sequence's keys and values once gathered (cp times the local ones), then per local token
    gathered = 2 * ar.exact(seq_len) * ar.exact(micro_batch_size) * local_key * element
    tokens = ar.exact(seq_len) / ar.exact(cp) * ar.exact(micro_batch_size)
    local = tokens * (local_key * (2 * element + 24) + 4 * ar.exact(query_width) / ar.exact(tp))
    return ar.when(cp > 1, gathered + local, 0)


def after_loss_bytes(ar: Arithmetic, transient: Any, freed_before: Any) -> Any:
    """Memory a layer's backward needs for a while (the reduce-scatter copy, ring attention's
    buffers) beyond ``freed_before``: bytes priced elsewhere that are freed before any layer's
    backward runs (the loss's buffers, released by the head's backward, which runs first), so only
    the excess adds to the peak."""
    return transient - ar.smaller(transient, ar.exact(freed_before))


# Korthikanti et al. (2022) Sec. 4.1: a dense MLP block keeps 19*s*b*h bytes: its input (2sbh),
# the first linear's output and the activation's output (8sbh each) and the dropout mask (sbh);
# without sequence parallelism the input and the mask (3sbh) are on every tensor-parallel rank.
DENSE_MLP_BYTES = 19
DENSE_MLP_REPLICATED_BYTES = 3


def dense_mlp_split_bytes(
    ar: Arithmetic,
    *,
    seq_len: Any,
    cp: Any,
    micro_batch_size: Any,
    tp: Any,
    dense_ffn_width: Any,
    gated: bool,
    fp32: Any,
) -> Any:
    """What a dense MLP keeps beside its input, per micro-batch (:func:`activation_bytes_per_layer`'s
    split MLP share: its first linear's outputs and its last one's input, ``6F`` gated, ``4F`` not,
    over ``t``): what Megatron's ``mlp`` recomputation discards, which an MoE layer's block, if kept,
    holds in its place."""
    tokens = ar.exact(seq_len) / ar.exact(cp) * ar.exact(micro_batch_size)
    return tokens * 2 * (3 if gated else 2) * ar.exact(dense_ffn_width) / ar.exact(tp) * ar.when(fp32, 2, 1)


def selective_moe_kept(modules: frozenset[str], block: Any, dense_split: Any, nothing: Any = 0) -> Any:
    """What an MoE layer keeps beyond a dense one under Megatron's selective checkpointing
    (``recompute_modules``): nothing with ``moe`` (the block recomputed whole); else the block less
    what its modules discard (``block(modules)``: :func:`moe_layer_extra_bytes`), and with ``mlp``
    the dense MLP's share (``dense_split()``: :func:`dense_mlp_split_bytes`), which every layer's
    count discarded and the MoE block keeps in its place. The two callables compute in the caller's
    arithmetic, whose zero is ``nothing``."""
    if "moe" in modules:
        return nothing
    kept = block(modules)
    return kept + dense_split() if "mlp" in modules else kept


def moe_layer_extra_bytes(
    ar: Arithmetic,
    *,
    seq_len: Any,
    cp: Any,
    micro_batch_size: Any,
    hidden_size: Any,
    tp: Any,
    etp: Any,
    sequence_parallel: Any,
    experts_per_token: Any,
    num_experts: Any,
    expert_width: Any,
    capacity_factor: Any,
    saved: MoESaved,
    fp32: Any,
    dense_ffn_width: Any = 0,
    gated: bool | None = None,
    fp8_saved_inputs: Any = False,
    shared_width: Any = 0,
    recomputed_modules: frozenset[str] = frozenset(),
) -> Any:
    """Bytes a mixture-of-experts layer keeps for the backward pass beyond a dense layer, per
    micro-batch: what its MoE block saves in place of the dense MLP block's share of
    :func:`activation_bytes_per_layer` (:data:`DENSE_MLP_BYTES`), never less than that share.

    A rank's MoE block takes ``T`` tokens (``seq_len / cp * micro_batch_size``, over ``tp`` under
    sequence parallelism, which every engine requires for experts with tp > 1). After dispatch it
    holds ``R = T * k * c * etp`` routed tokens: each token once per chosen expert (top-k), the
    expert-tensor-parallel ranks' tokens gathered so each computes its ``F / etp`` slice of the
    experts' hidden features, and ``c`` the capacity factor where one caps the tokens an expert
    takes (an expert's capacity is ``c`` times its even share of the routed tokens, so the rank's
    experts take at most ``c * T * k``); dropless routing (no capacity factor, ``c = 1``) is
    priced at the even share, its average. The block saves ``saved.per_routed(h, F / etp)``
    bytes per routed token and ``saved.per_token(h, E)`` per token (the router), both in 16-bit
    activations; fp32 activations double them.

    With the dense MLP's width known (``dense_ffn_width`` and ``gated``, as
    :func:`activation_bytes_per_layer` takes them) its share is counted tensor by tensor as there:
    the first linear's input (``2h``, over ``t`` under sequence parallelism), its outputs and the last
    one's input (``6F`` gated, ``4F`` not, over ``t``) and a non-gated block's dropout mask (``h``);
    under ``fp8_saved_inputs`` the dense layer kept those two inputs at a byte an element, so its
    share is that much smaller (the experts' own fp8 copies are not counted: the block is priced in
    16 bits).

    A shared expert (``shared_width`` features, 0 for none) is a dense MLP on every token of the
    block beside the routed ones, split over ``t`` like the dense MLP: it keeps its first linear's
    input (``2h``, over ``t`` under sequence parallelism, whose column-parallel linear saves the
    sequence shard and gathers it again for the backward) and its own outputs and last input
    (``6S`` gated, ``4S`` not, over ``t``), in the block's share.

    ``recomputed_modules`` (Megatron-Core's selective ``recompute_modules`` that touch the block):
    ``moe_act`` discards the experts' activation output (2 bytes a local expert feature per routed
    token), ``shared_experts`` the shared expert's own tensors beside its input. (``layernorm``
    discards the pre-MLP norm's output, a separate norm in an MoE layer, which the block's count
    leaves out already: it replaces the dense MLP's input with the routed tokens' copies.) (``moe``, the block
    recomputed whole, and ``mlp``, the dense share discarded, are the callers'.)"""
    t = ar.exact(tp)
    tokens = ar.exact(seq_len) / ar.exact(cp) * ar.exact(micro_batch_size)
    tokens = ar.when(sequence_parallel, tokens / t, tokens)
    h = ar.exact(hidden_size)
    routed = tokens * ar.exact(experts_per_token) * ar.exact(capacity_factor) * ar.exact(etp)
    local_width = ar.exact(expert_width) / ar.exact(etp)
    routed_ffn = saved.routed_ffn - (2 if "moe_act" in recomputed_modules else 0)
    block = routed * (saved.routed_hidden * h + routed_ffn * local_width + saved.routed_fixed)
    block = block + tokens * (saved.token_hidden * h + saved.token_experts * ar.exact(num_experts))
    all_tokens = ar.exact(seq_len) / ar.exact(cp) * ar.exact(micro_batch_size)
    if shared_width:
        own = (
            0
            if "shared_experts" in recomputed_modules
            else (6 if gated is not False else 4) * ar.exact(shared_width) / t
        )
        block = block + ar.when(sequence_parallel, all_tokens * (2 * h / t + own), all_tokens * (2 * h + own))
    if gated is not None and dense_ffn_width:
        f = ar.exact(dense_ffn_width)
        whole = 2 * h + (0 if gated else h)  # the first linear's input, a non-gated block's mask
        split = (6 if gated else 4) * f
        if fp8_saved_inputs is not False:
            whole = whole - ar.when(fp8_saved_inputs, h, 0)
            split = split - ar.when(fp8_saved_inputs, f, 0)
        dense = ar.when(sequence_parallel, all_tokens * (whole + split) / t, all_tokens * (whole + split / t))
    else:
        dense = ar.when(
            sequence_parallel,
            DENSE_MLP_BYTES * all_tokens * h / t,
            all_tokens * h * (DENSE_MLP_REPLICATED_BYTES + (DENSE_MLP_BYTES - DENSE_MLP_REPLICATED_BYTES) / t),
        )
    return ar.when(block > dense, block - dense, 0) * ar.when(fp32, 2, 1)

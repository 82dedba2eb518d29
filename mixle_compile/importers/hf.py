"""An HF ``config.json`` as a transformer model.

Reads the architectures the transformer family covers: Llama (and Llama-shaped: Mistral, Qwen2,
Qwen3, Phi-3, InternLM2-free ones), Mixtral, Qwen2-MoE / Qwen3-MoE, Llama 4, DeepSeek-V2 / DeepSeek-V3
(Multi-head Latent Attention; Kimi K2 as DeepSeek-V3), GPT-NeoX and GPT-2. Every other ``model_type``
is refused by name. The defaults used when a key is absent are those of
the architecture's configuration class in transformers (``models/<name>/configuration_<name>.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixle_compile.spec.source import Position, SourceDocument


# model_type -> the architecture's shape. tie: the configuration class's tie_word_embeddings
# default (LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen2MoeConfig,
# Qwen3MoeConfig, Phi3Config, GPTNeoXConfig: False; GPT2Config inherits PretrainedConfig's True).
@dataclass(frozen=True)
class _Arch:
    norm: str
    activation: str  # for hidden_act silu in a gated MLP: swiglu
    position: str
    tie: bool
    moe: str | None = None  # key scheme: "mixtral", "qwen", "llama4" or "deepseek"
    gpt2_names: bool = False


ARCHITECTURES: dict[str, _Arch] = {
    "llama": _Arch("rmsnorm", "swiglu", "rope", False),
    "mistral": _Arch("rmsnorm", "swiglu", "rope", False),
    "qwen2": _Arch("rmsnorm", "swiglu", "rope", False),
    "qwen3": _Arch("rmsnorm", "swiglu", "rope", False),
    "phi3": _Arch("rmsnorm", "swiglu", "rope", False),
    "mixtral": _Arch("rmsnorm", "swiglu", "rope", False, moe="mixtral"),
    "qwen2_moe": _Arch("rmsnorm", "swiglu", "rope", False, moe="qwen"),
    "qwen3_moe": _Arch("rmsnorm", "swiglu", "rope", False, moe="qwen"),
    # Llama4TextConfig (llama4_text); Llama4Config (llama4) wraps it as text_config beside a vision model
    "llama4_text": _Arch("rmsnorm", "swiglu", "rope", False, moe="llama4"),
    "llama4": _Arch("rmsnorm", "swiglu", "rope", False, moe="llama4"),
    # DeepseekV2Config, DeepseekV3Config: Multi-head Latent Attention and DeepSeekMoE (routed experts,
    # shared experts, dense layers first). Kimi K2 ships model_type kimi_k2 with architectures
    # DeepseekV3ForCausalLM and DeepSeek-V3's configuration_deepseek.py in its auto_map: the same model
    # under another name (its deployment guide in the MoonshotAI/Kimi-K2 repository says to
    # rename it deepseek_v3 for a framework that does not know kimi_k2); transformers has no kimi_k2.
    "deepseek_v2": _Arch("rmsnorm", "swiglu", "rope", False, moe="deepseek"),
    "deepseek_v3": _Arch("rmsnorm", "swiglu", "rope", False, moe="deepseek"),
    "kimi_k2": _Arch("rmsnorm", "swiglu", "rope", False, moe="deepseek"),
    "gpt_neox": _Arch("layernorm", "gelu", "rope", False),
    "gpt2": _Arch("layernorm", "gelu", "learned", True, gpt2_names=True),
}

# Keys that describe tokens, numerics of a kernel, inference or serialisation: nothing the plan's
# sizes, memory or communication depend on. Read and ignored without a warning.
IRRELEVANT = {
    "_name_or_path",
    "auto_map",
    "transformers.js_config",
    "architectures",
    "model_type",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_cache",
    "initializer_range",
    "rms_norm_eps",
    "layer_norm_eps",
    "layer_norm_epsilon",
    "rope_theta",
    "rope_scaling",
    "rotary_pct",
    "rotary_emb_base",
    "max_position_embeddings",
    "attention_dropout",
    "hidden_dropout",
    "attention_bias",
    "mlp_bias",
    "pretraining_tp",
    "max_window_layers",
    "use_sliding_window",
    "sliding_window",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "summary_type",
    "summary_use_proj",
    "summary_activation",
    "summary_proj_to_labels",
    "summary_first_dropout",
    "task_specific_params",
    "n_ctx",
    "use_parallel_residual",
    "classifier_dropout",
    "output_router_logits",
    "router_aux_loss_coef",
    "router_jitter_noise",
    "norm_topk_prob",
    "scale_attn_weights",
    "reorder_and_upcast_attn",
    "scale_attn_by_inverse_layer_idx",
    "layer_types",
    "original_max_position_embeddings",
    "partial_rotary_factor",
    "rope_parameters",
    "qkv_bias",
    "use_qk_norm",
    # Llama 4: which layers skip RoPE and how attention is scaled (no parameters, the same matmuls); the
    # image tokens' ids and a serving hint
    "no_rope_layers",
    "no_rope_layer_interval",
    "attn_temperature_tuning",
    "floor_scale",
    "attn_scale",
    "for_llm_compressor",
    "cache_implementation",
    "boi_token_index",
    "eoi_token_index",
    "image_token_index",
    "qk_layernorm",
}


@dataclass
class HFModel:
    """The transformer model read from a config.json, and where each field came from."""

    model: dict[str, Any]
    keys: dict[str, str]  # spec model field -> config.json key
    positions: dict[str, Position]  # spec model field -> position of that key in config.json
    problems: list[tuple[str, str, Position]] = field(default_factory=list)  # (message, hint, at)
    ignored: list[tuple[str, Position]] = field(default_factory=list)  # unmodelled keys


def read_hf_document(path: str | Path, display: str | None = None) -> SourceDocument:
    from mixle_compile.importers.builder import read_json_document

    return read_json_document(
        path, display, "HF model config", "give the path of a `config.json` (relative to the file that names it)"
    )


# The model fields of a mixture of experts: a config whose every layer is dense has none of them.
EXPERT_FIELDS = (
    "num_experts",
    "experts_per_token",
    "moe_ffn_hidden_size",
    "moe_layer_frequency",
    "moe_first_layer",
    "moe_shared_expert_hidden_size",
    "moe_shared_expert_gate",
)


def _as_dense(m: dict) -> None:
    """The model read as the dense one transformers builds where no layer is a mixture of experts."""
    for key in EXPERT_FIELDS:
        m.pop(key, None)


def _qwen_sparse(layers: int, step: int, only: list[int]) -> tuple[tuple[int, int] | None, list[int]]:
    """Qwen-MoE's sparse layers ((i + 1) % step == 0, i not in mlp_only_layers) as (moe_first_layer,
    moe_layer_frequency) or None, and the first of them (all where few; empty: none), without a list as
    long as the model: the dense layers listed take sparse ones away from a progression that is
    otherwise every step-th layer from step - 1."""
    from mixle_compile.parameters import moe_spacing_of

    first = step - 1
    count = len(range(first, layers, step))  # sparse layers before mlp_only_layers
    removed = sorted({i for i in only if first <= i < layers and (i - first) % step == 0})
    if count - len(removed) <= 0:
        return None, []
    if removed == [first + j * step for j in range(len(removed))]:  # a prefix of them: the rest is even
        start = first + len(removed) * step
        return (start, step), [start]
    if count <= 100_000:
        kept = [i for i in range(first, layers, step) if i not in set(removed)]
        return moe_spacing_of(kept, layers), kept
    return None, [first]


def _llama4_moe(data: dict, m: dict, out: HFModel, take, used: set, doc: SourceDocument, prefix: tuple) -> None:
    """Llama 4's experts (transformers/models/llama4: Llama4TextConfig, Llama4TextMoe): num_local_experts
    routed experts of intermediate_size features, top num_experts_per_tok, and a shared expert of the
    same width (Llama4TextMLP(config), no gate) in every MoE layer; the MoE layers are moe_layers, or
    interleave_moe_layer_step - 1, 2 * step - 1, ... (the class's defaults: 16 experts, top-1, 8192,
    step 1, head_dim 128)."""
    from mixle_compile.parameters import moe_spacing_of

    m["num_experts"] = take("num_experts", "num_local_experts", default=16)
    m["experts_per_token"] = take("experts_per_token", "num_experts_per_tok", default=1)
    width = take("moe_ffn_hidden_size", "intermediate_size", default=8192)
    m["moe_ffn_hidden_size"] = width
    m["moe_shared_expert_hidden_size"] = width
    if "head_dim" not in data:  # the class's default; an explicit null is hidden_size / heads
        m["head_dim"] = 128
    if "num_key_value_heads" not in data:  # likewise 8 (null: one per query head)
        m["num_kv_heads"] = 8
    chunk = data.get("attention_chunk_size", 8192)
    if chunk is not None:
        # three of every four layers attend within chunks (no_rope_layers): the same work at or below the
        # chunk's length, less beyond it; an absent key is the class's 8,192 (null: full attention)
        if "attention_chunk_size" not in data:
            out.ignored.append(
                ("attention_chunk_size (absent: Llama4TextConfig's 8192)", doc.position(prefix or ("model_type",)))
            )
    else:
        used.add("attention_chunk_size")
    layers = m.get("num_layers")
    listed = data.get("moe_layers")
    step = take("moe_layer_frequency", "interleave_moe_layer_step", default=1)
    if not isinstance(layers, int) or isinstance(layers, bool):
        return
    if listed is not None:
        used.add("moe_layers")
        where = doc.position((*prefix, "moe_layers"))
        if not isinstance(listed, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in listed):
            out.problems.append(("`moe_layers` is a list of layer indices", "list the MoE layers' indices", where))
            return
        spacing = moe_spacing_of(listed, layers)
        chosen = sorted({i for i in listed if 0 <= i < layers})
    elif isinstance(step, int) and not isinstance(step, bool) and step > 0:
        where = out.positions.get("moe_layer_frequency", Position(1, 1))
        spacing = (step - 1, step) if step - 1 < layers else None
        chosen = [] if spacing is None else [step - 1]
    else:
        out.problems.append(
            (
                f"`interleave_moe_layer_step` = {step!r} is not a positive integer",
                "give the spacing of the MoE layers (1: every layer)",
                out.positions.get("moe_layer_frequency", Position(1, 1)),
            )
        )
        return
    if not chosen:  # no MoE layer: transformers builds a dense model (of intermediate_size_mlp)
        _as_dense(m)
        return
    if spacing is None:
        shown = chosen if len(chosen) <= 16 else [*chosen[:16], "..."]
        out.problems.append(
            (
                f"the MoE layers {shown} are not dense layers first and then every k-th layer "
                "(the spec's moe_first_layer and moe_layer_frequency)",
                "use evenly spaced MoE layers after the dense ones",
                where,
            )
        )
        return
    m["moe_first_layer"], m["moe_layer_frequency"] = spacing
    out.keys["moe_first_layer"] = out.keys["moe_layer_frequency"] = "/".join(
        (*prefix, "moe_layers" if listed is not None else "interleave_moe_layer_step")
    )
    out.positions["moe_first_layer"] = out.positions["moe_layer_frequency"] = where


# The class defaults of DeepseekV3Config (transformers/models/deepseek_v3/configuration_deepseek_v3.py)
# and DeepseekV2Config (transformers/models/deepseek_v2/configuration_deepseek_v2.py) for the keys
# read, by config.json key: an absent key is this value (an explicit null is what the file says).
# Kimi K2's configuration_deepseek.py is DeepSeek-V3's, with its defaults.
DEEPSEEK_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "n_shared_experts": 1,
        "n_routed_experts": 256,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
    },
    "deepseek_v2": {
        "vocab_size": 102400,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "moe_intermediate_size": 1407,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "n_shared_experts": 2,
        "n_routed_experts": 64,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "num_experts_per_tok": None,  # no default: transformers' router needs the config to give it
        "first_k_dense_replace": 0,
    },
}
DEEPSEEK_DEFAULTS["kimi_k2"] = DEEPSEEK_DEFAULTS["deepseek_v3"]
# DeepSeek's routing and serving keys: how the router scores and groups experts (n_group, topk_group,
# topk_method on DeepSeek-V3, scoring_func, routed_scaling_factor), its auxiliary loss, the rotary
# layout and the expert-parallel size of DeepSeek's own inference code. None changes a parameter, the
# top-k count or what a routed token costs: read quietly.
DEEPSEEK_QUIET = {
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "scoring_func",
    "seq_aux",
    "aux_loss_alpha",
    "ep_size",
    "rope_interleave",
}
# DeepseekV2TopkRouter.forward (transformers/models/deepseek_v2/modeling_deepseek_v2.py) routes with
# "greedy" or "group_limited_greedy" (DeepseekV2Config's default "greedy") and has no other branch.
DEEPSEEK_V2_TOPK = ("greedy", "group_limited_greedy")


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# DeepSeek-V3's multi-token prediction depths (MTP modules), num_nextn_predict_layers: DeepSeek's
# config.json key. transformers 5.24.0's DeepseekV3Config has it as num_mtp_layers, default 1
# (attribute_map num_mtp_layers -> num_nextn_predict_layers, transformers/models/deepseek_v3/
# configuration_deepseek_v3.py); earlier releases' class had no such field and kept the key as a plain
# attribute. DeepseekV2Config has none. Kimi K2 (kimi_k2) publishes the key with DeepSeek-V3's
# configuration class (0 in Kimi-K2-Instruct's config.json).
MTP_DEFAULTS = {"deepseek_v3": 1, "kimi_k2": 1}


def _multi_token_prediction(
    data: dict, m: dict, out: HFModel, take, used: set, doc: SourceDocument, model_type: str
) -> None:
    """``num_nextn_predict_layers``: DeepSeek-V3's multi-token prediction modules (README_WEIGHTS.md of
    deepseek-ai/DeepSeek-V3: each an embedding norm and a hidden-state norm, a [2 hidden -> hidden]
    projection and one more decoder layer, stored as ``model.layers.<num_hidden_layers + k>``; the
    published V3 weights hold 1).
    DeepSeek trains them; transformers' DeepseekV3ForCausalLM does not build them and drops their weights on
    load (modeling_deepseek_v3.py, ``_keys_to_ignore_on_load_unexpected = [r"model\\.layers\\.61.*"]``).
    The spec describes the trained model, so they are read as ``model.mtp_num_layers`` (an absent key is
    the configuration class's default). DeepSeek-V2 has no such layers: a key there is named, not read."""
    key = "num_nextn_predict_layers"
    used.add(key)
    if model_type not in MTP_DEFAULTS:
        if data.get(key):
            out.ignored.append(
                (
                    f"{key} ({data[key]!r}: DeepseekV2Config has no multi-token prediction layers; read for "
                    "deepseek_v3 and kimi_k2 only)",
                    doc.position((key,)),
                )
            )
        return
    if key in data and data[key] is None:
        out.problems.append(
            (
                f"`{key}` is null: DeepSeek-V3's configuration takes a number of multi-token prediction layers",
                f"write `{key}: 0` for none (DeepSeek-V3 publishes 1)",
                doc.position((key,)),
            )
        )
        return
    layers = take("mtp_num_layers", key, default=MTP_DEFAULTS[model_type])
    if not (isinstance(layers, int) and not isinstance(layers, bool) and layers >= 0):
        out.problems.append(
            (
                f"`{key}` = {layers!r} is not a number of multi-token prediction layers",
                "write a whole number (0: none; DeepSeek-V3 publishes 1)",
                out.positions.get("mtp_num_layers", doc.position((key,))),
            )
        )
        return
    if key not in data:
        out.keys["mtp_num_layers"] = f"{key} (absent: DeepseekV3Config's default {layers})"
    m["mtp_num_layers"] = layers


def _deepseek(data: dict, m: dict, out: HFModel, take, used: set, doc: SourceDocument, model_type: str) -> None:
    """DeepSeek-V2 / DeepSeek-V3 (and Kimi K2): Multi-head Latent Attention and DeepSeekMoE, as
    transformers builds them (modeling_deepseek_v2.py, modeling_deepseek_v3.py).

    Attention (DeepseekV2Attention, DeepseekV3Attention): q_lora_rank null is one query projection
    ``q_proj``, else ``q_a_proj`` to a latent of that width, its RMSNorm and ``q_b_proj``;
    ``kv_a_proj_with_mqa`` to ``kv_lora_rank + qk_rope_head_dim``, the latent's RMSNorm and
    ``kv_b_proj`` up to ``num_heads * (qk_nope_head_dim + v_head_dim)``; every head has keys (the
    num_key_value_heads key is not read for the projections). MLP (DeepseekV3DecoderLayer): layer i
    is a DeepSeekMoE layer when ``i >= first_k_dense_replace``, else a dense MLP of
    intermediate_size; the MoE layer has n_routed_experts experts of moe_intermediate_size, top
    num_experts_per_tok, and one ungated MLP of ``moe_intermediate_size * n_shared_experts`` beside
    them (``shared_experts``). transformers does not read moe_layer_freq (DeepSeek's own modelling
    code makes every moe_layer_freq-th layer an MoE one): a config that sets it other than 1 is
    refused, as the two disagree."""
    defaults = DEEPSEEK_DEFAULTS[model_type]

    def width(field_name: str, key: str) -> Any:
        value = take(field_name, key, default=defaults[key])
        if value is not None and not _positive(value):
            out.problems.append(
                (
                    f"`{key}` = {value!r} is not a positive integer (a Multi-head Latent Attention width)",
                    f"give `{key}` as a positive integer",
                    out.positions.get(field_name, doc.position(("model_type",))),
                )
            )
            return None
        return value

    m["kv_lora_rank"] = width("kv_lora_rank", "kv_lora_rank")
    m["qk_nope_head_dim"] = width("qk_nope_head_dim", "qk_nope_head_dim")
    m["qk_rope_head_dim"] = width("qk_rope_head_dim", "qk_rope_head_dim")
    m["v_head_dim"] = width("v_head_dim", "v_head_dim")
    used.add("q_lora_rank")
    q_lora = data.get("q_lora_rank", defaults["q_lora_rank"])
    if q_lora is not None:
        m["q_lora_rank"] = take("q_lora_rank", "q_lora_rank", default=q_lora)
        if not _positive(q_lora):
            zero = q_lora == 0 and not isinstance(q_lora, bool)
            out.problems.append(
                (
                    f"`q_lora_rank` = {q_lora!r} is not a query latent's width"
                    + (
                        " (transformers reads 0 as a latent of no features, not as none: it builds q_a_proj with "
                        "0 outputs)"
                        if zero
                        else ""
                    ),
                    "write `null` for one query projection (DeepSeek-V2-Lite), or the latent's width (DeepSeek-V3: "
                    "1536)",
                    out.positions.get("q_lora_rank", doc.position(("model_type",))),
                )
            )
            m["q_lora_rank"] = None
    elif "q_lora_rank" in data:
        out.keys["q_lora_rank"] = "q_lora_rank"  # null: one query projection
    heads = data.get("num_attention_heads", defaults["num_attention_heads"])
    kv = data.get("num_key_value_heads")
    used.add("num_key_value_heads")
    if kv is not None and kv != heads:
        out.ignored.append(
            (
                f"num_key_value_heads ({kv!r}: Multi-head Latent Attention projects a key and a value for each of "
                f"the {heads!r} heads)",
                doc.position(("num_key_value_heads",)),
            )
        )
    used.add("head_dim")  # DeepseekV2Config sets head_dim to qk_rope_head_dim whatever the file says
    _multi_token_prediction(data, m, out, take, used, doc, model_type)
    used.update(k for k in DEEPSEEK_QUIET if k in data)
    method = data.get("topk_method")
    used.add("topk_method")
    if model_type == "deepseek_v2" and method is not None and method not in DEEPSEEK_V2_TOPK:
        out.problems.append(
            (
                f"`topk_method` = {method!r}: transformers' DeepseekV2 routes with "
                + " or ".join(repr(t) for t in DEEPSEEK_V2_TOPK)
                + " only (DeepseekV2TopkRouter)",
                "write greedy or group_limited_greedy (a DeepSeek-V3 config's noaux_tc is model_type deepseek_v3)",
                doc.position(("topk_method",)),
            )
        )

    # ---- DeepSeekMoE
    layers = m.get("num_layers")
    freq = data.get("moe_layer_freq", 1)
    used.add("moe_layer_freq")
    if freq != 1:
        out.problems.append(
            (
                f"`moe_layer_freq` = {freq!r}: transformers' DeepSeek makes every layer from first_k_dense_replace "
                "an MoE layer and does not read moe_layer_freq, while DeepSeek's own modelling code makes every "
                f"{freq!r}-th one an MoE layer: the two build different models",
                "write 1 (every published DeepSeek config does), or give the MoE layers another way",
                doc.position(("moe_layer_freq",)),
            )
        )
    first = take("moe_first_layer", "first_k_dense_replace", default=defaults["first_k_dense_replace"])
    if "first_k_dense_replace" in data and data["first_k_dense_replace"] is None:
        first = None
        out.problems.append(
            (
                "`first_k_dense_replace` is null: transformers compares each layer's index with it",
                "give the number of dense layers before the MoE ones (0: none)",
                doc.position(("first_k_dense_replace",)),
            )
        )
    elif not (isinstance(first, int) and not isinstance(first, bool) and first >= 0):
        out.problems.append(
            (
                f"`first_k_dense_replace` = {first!r} is not a number of layers",
                "give the number of dense layers before the MoE ones (0: none)",
                out.positions.get("moe_first_layer", doc.position(("model_type",))),
            )
        )
        first = None
    if first is None or not isinstance(layers, int) or isinstance(layers, bool):
        return
    if first >= layers:  # no MoE layer: transformers builds a dense model
        for key in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts"):
            used.add(key)
        return
    experts = take("num_experts", "n_routed_experts", default=defaults["n_routed_experts"])
    if "n_routed_experts" in data and data["n_routed_experts"] is None:
        out.problems.append(
            (
                "`n_routed_experts` is null, but transformers' DeepSeek builds routed experts in every layer from "
                "first_k_dense_replace on",
                "give the number of routed experts (or first_k_dense_replace = num_hidden_layers for a dense model)",
                doc.position(("n_routed_experts",)),
            )
        )
    m["num_experts"] = experts
    m["experts_per_token"] = take("experts_per_token", "num_experts_per_tok", default=defaults["num_experts_per_tok"])
    moe_ffn = take("moe_ffn_hidden_size", "moe_intermediate_size", default=defaults["moe_intermediate_size"])
    m["moe_ffn_hidden_size"] = moe_ffn
    m["moe_first_layer"] = first
    m["moe_layer_frequency"] = 1
    out.keys["moe_layer_frequency"] = "first_k_dense_replace"
    shared = take("moe_shared_expert_hidden_size", "n_shared_experts", default=defaults["n_shared_experts"])
    if not (isinstance(shared, int) and not isinstance(shared, bool) and shared >= 0):
        out.problems.append(
            (
                f"`n_shared_experts` = {shared!r} is not a count of shared experts",
                "give the number of shared experts (0: none)",
                out.positions.get("moe_shared_expert_hidden_size", doc.position(("model_type",))),
            )
        )
    elif shared and _positive(moe_ffn):
        m["moe_shared_expert_hidden_size"] = shared * moe_ffn  # one MLP of the experts' width times their count
        out.keys["moe_shared_expert_hidden_size"] = "n_shared_experts * moe_intermediate_size"


def hf_model(doc: SourceDocument) -> HFModel:
    """Translate an HF config document; problems are returned, never raised."""
    data = doc.data
    out = HFModel({"family": "transformer"}, {}, {})
    if not isinstance(data, dict):
        out.problems.append(("an HF config.json is a JSON object", "give the model's config.json", Position(1, 1)))
        return out
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        known = ", ".join(sorted(ARCHITECTURES))
        shown = repr(model_type) if model_type is not None else "no model_type"
        out.problems.append(
            (
                f"HF model_type {shown} is not an architecture the transformer family covers",
                f"architectures read: {known}"
                + (
                    "; Multi-head Latent Attention is read from deepseek_v2 and deepseek_v3"
                    if "kv_lora_rank" in data
                    else ""
                ),
                doc.position(("model_type",)),
            )
        )
        return out
    arch = ARCHITECTURES[model_type]
    used: set[str] = {"model_type"}
    prefix: tuple = ()  # where the language model's keys are in the document
    if model_type == "llama4":
        # Llama4ForConditionalGeneration: the language model is text_config; the vision encoder and
        # the projector beside it (vision_config) are not the transformer family's and are left out.
        inner = data.get("text_config")
        if not isinstance(inner, dict):
            out.problems.append(
                (
                    "a Llama 4 config (model_type llama4) keeps its language model under `text_config`, "
                    + ("which this file lacks" if inner is None else f"which is not an object here ({inner!r:.40})"),
                    "give the config.json whose text_config holds the sizes, or a llama4_text config",
                    doc.position(("text_config",) if "text_config" in data else ("model_type",)),
                )
            )
            return out
        for key in data:
            if key == "tie_word_embeddings" and data[key] == inner.get(key, ARCHITECTURES["llama4"].tie):
                continue  # says what the language model's own key (or its default) says
            if key not in ("model_type", "text_config") and key not in IRRELEVANT:
                out.ignored.append((key, doc.keys.get((key,), Position(1, 1))))
        data, prefix = inner, ("text_config",)

    def take(field_name: str, *keys: str, default: Any = None, required: bool = True) -> Any:
        for key in keys:
            if key in data and data[key] is not None:
                used.add(key)
                out.keys[field_name] = "/".join((*prefix, key))
                out.positions[field_name] = doc.position((*prefix, key))
                return data[key]
            used.add(key)
        if required and default is None:
            where = "/".join((*prefix, keys[0]))
            out.problems.append(
                (
                    f"the HF config has no `{where}`",
                    f"add `{keys[0]}` to the config.json" + (f" (in `{prefix[0]}`)" if prefix else ""),
                    doc.position(prefix) if prefix else Position(1, 1),
                )
            )
        return default

    m = out.model
    class_defaults = DEEPSEEK_DEFAULTS.get(model_type, {})
    names = (
        ("n_embd", "n_layer", "n_head")
        if arch.gpt2_names
        else ("hidden_size", "num_hidden_layers", "num_attention_heads")
    )
    m["vocab_size"] = take("vocab_size", "vocab_size", default=class_defaults.get("vocab_size"))
    m["hidden_size"] = take("hidden_size", names[0], default=class_defaults.get(names[0]))
    m["num_layers"] = take("num_layers", names[1], default=class_defaults.get(names[1]))
    m["num_heads"] = take("num_heads", names[2], default=class_defaults.get(names[2]))
    if arch.moe != "deepseek":  # Multi-head Latent Attention has its own head sizes (_deepseek)
        kv = take("num_kv_heads", "num_key_value_heads", required=False)
        if kv is not None:
            m["num_kv_heads"] = kv
        head_dim = take("head_dim", "head_dim", required=False)
        if head_dim is not None:
            m["head_dim"] = head_dim
    if arch.gpt2_names:  # GPT2Config: n_inner None means 4 * n_embd
        inner = take("ffn_hidden_size", "n_inner", required=False)
        hidden = m["hidden_size"]
        m["ffn_hidden_size"] = inner if inner is not None else (4 * hidden if isinstance(hidden, int) else None)
    elif arch.moe == "llama4":
        # Llama4TextMLP(config, intermediate_size=config.intermediate_size_mlp) for the dense layers;
        # intermediate_size is an expert's (and the shared expert's) width
        m["ffn_hidden_size"] = take("ffn_hidden_size", "intermediate_size_mlp", default=16384)
    else:
        m["ffn_hidden_size"] = take(
            "ffn_hidden_size", "intermediate_size", default=class_defaults.get("intermediate_size")
        )
    tie = take("tie_embeddings", "tie_word_embeddings", required=False)
    m["tie_embeddings"] = arch.tie if tie is None else tie
    act = take("activation", "activation_function" if arch.gpt2_names else "hidden_act", required=False)
    if arch.activation == "swiglu":
        if act not in (None, "silu", "swish"):
            out.problems.append(
                (
                    f"hidden_act {act!r}: the {model_type} MLP is gated and the spec models a gated MLP "
                    "only with silu (swiglu)",
                    "the transformer family covers swiglu, gelu and relu MLPs",
                    out.positions.get("activation", Position(1, 1)),
                )
            )
        m["activation"] = "swiglu"
    else:
        m["activation"] = "relu" if act == "relu" else "gelu"
    m["norm"] = arch.norm
    m["position_embedding"] = arch.position
    if arch.position == "learned":
        # GPT2Config maps max_position_embeddings to n_positions (default 1024): the rows of `wpe`.
        m["max_position_embeddings"] = take(
            "max_position_embeddings", "n_positions", "max_position_embeddings", default=1024
        )
    if arch.moe == "llama4":
        _llama4_moe(data, m, out, take, used, doc, prefix)
    if arch.moe == "deepseek":
        _deepseek(data, m, out, take, used, doc, model_type)
    if arch.moe == "mixtral":
        m["num_experts"] = take("num_experts", "num_local_experts")
        m["experts_per_token"] = take("experts_per_token", "num_experts_per_tok", default=2)
        m["moe_ffn_hidden_size"] = m["ffn_hidden_size"]
    elif arch.moe == "qwen":
        m["num_experts"] = take("num_experts", "num_experts")
        m["experts_per_token"] = take("experts_per_token", "num_experts_per_tok")
        moe_ffn = take("moe_ffn_hidden_size", "moe_intermediate_size", required=False)
        if moe_ffn is not None:
            m["moe_ffn_hidden_size"] = moe_ffn
        # Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer: layer i is sparse when i is not in
        # mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (both default to none and 1).
        step = take("moe_layer_frequency", "decoder_sparse_step", required=False)
        if step is None and "decoder_sparse_step" not in data:
            step = 1  # the class's default; an explicit null is refused below, as transformers does
        only = data.get("mlp_only_layers", [])
        layers = m.get("num_layers")
        if "mlp_only_layers" in data:
            used.add("mlp_only_layers")
        step_ok = isinstance(step, int) and not isinstance(step, bool) and step > 0
        only_ok = isinstance(only, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in only)
        if not step_ok:
            out.problems.append(
                (
                    f"`decoder_sparse_step` = {step!r} is not a positive integer",
                    "give the spacing of the sparse layers (1: every layer)",
                    out.positions.get("moe_layer_frequency", Position(1, 1)),
                )
            )
        if not only_ok:
            out.problems.append(
                (
                    f"`mlp_only_layers` = {only!r} is not a list of layer indices",
                    "list the dense layers' indices (or leave the key out)",
                    doc.position(("mlp_only_layers",)),
                )
            )
        dense = False  # no sparse layer: read as dense once the shared expert's keys are read too
        if isinstance(layers, int) and not isinstance(layers, bool) and layers > 0 and step_ok and only_ok:
            spacing, sparse = _qwen_sparse(layers, step, only)
            at = (
                doc.position(("mlp_only_layers",)) if only else out.positions.get("moe_layer_frequency", Position(1, 1))
            )
            if not sparse:  # no sparse layer: transformers builds a dense model
                dense = True
            elif spacing is None:
                shown = sparse if len(sparse) <= 16 else [*sparse[:16], "..."]
                out.problems.append(
                    (
                        f"decoder_sparse_step {step} with mlp_only_layers {only} makes layers {shown} sparse; the "
                        "spec's MoE layers are evenly spaced after the dense ones (moe_first_layer, "
                        "moe_layer_frequency)",
                        "use a pattern of dense layers first, then every k-th layer sparse",
                        at,
                    )
                )
            else:
                m["moe_first_layer"], m["moe_layer_frequency"] = spacing
                out.positions["moe_first_layer"] = at
                out.keys["moe_first_layer"] = (
                    "mlp_only_layers" if only else out.keys.get("moe_layer_frequency", "decoder_sparse_step")
                )
        if model_type == "qwen2_moe":
            # Qwen2MoeSparseMoeBlock: a shared expert (an MLP of shared_expert_intermediate_size, 5632
            # by Qwen2MoeConfig's default) beside the routed ones, its output scaled by
            # sigmoid(shared_expert_gate(x)) (transformers/models/qwen2_moe/modeling_qwen2_moe.py).
            # Qwen3-MoE has none (Qwen3MoeSparseMoeBlock): the key is not read there.
            shared = take("moe_shared_expert_hidden_size", "shared_expert_intermediate_size", default=5632)
            if isinstance(shared, int) and not isinstance(shared, bool) and shared > 0:
                m["moe_shared_expert_hidden_size"] = shared
                m["moe_shared_expert_gate"] = True
            elif shared is not None and shared != 0:
                out.problems.append(
                    (
                        f"`shared_expert_intermediate_size` = {shared!r} is not a width",
                        "give a positive integer (0: no shared expert)",
                        out.positions.get("moe_shared_expert_hidden_size", Position(1, 1)),
                    )
                )
        elif not data.get("shared_expert_intermediate_size"):
            used.add("shared_expert_intermediate_size")  # 0 or null: none, as Qwen3-MoE has
        if dense:
            _as_dense(m)
    for key in data:
        if key not in used and key not in IRRELEVANT:
            out.ignored.append((key, doc.keys.get((*prefix, key), Position(1, 1))))
    m = {k: v for k, v in m.items() if v is not None}
    out.model = m
    return out

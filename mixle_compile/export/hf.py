"""A transformer model as an HF ``config.json`` (the inverse of :mod:`mixle_compile.importers.hf`)."""

from __future__ import annotations

import json

from mixle_compile.spec.models import TransformerModel


def hf_config(model: TransformerModel, seq_len: int | None = None) -> tuple[dict | None, str]:
    """(config, "") or (None, why it cannot be written); ``seq_len`` sizes a learned position table
    the model does not size itself (``max_position_embeddings`` unset)."""
    m = model
    base = {"vocab_size": m.vocab_size, "tie_word_embeddings": m.tie_embeddings}
    heads = {
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads or m.num_heads,
        "intermediate_size": m.ffn_hidden_size,
    }
    if m.head_dim is not None:
        heads["head_dim"] = m.head_dim
    if m.latent_attention:
        return _deepseek_v3(m, heads, base)
    if m.mtp_num_layers:
        # num_nextn_predict_layers is DeepSeek-V3's key (importers/hf.py reads it for deepseek_v3 and
        # kimi_k2); none of the other architectures written here has multi-token prediction layers
        return None, (
            f"the model's multi-token prediction layers (model.mtp_num_layers {m.mtp_num_layers}): an HF config.json "
            "says them only as DeepSeek-V3's num_nextn_predict_layers, a model with Multi-head Latent Attention; "
            "export to Megatron (--mtp-num-layers), or set model.mtp_num_layers: 0"
        )
    if m.norm == "rmsnorm" and m.activation == "swiglu" and m.position_embedding == "rope":
        if m.num_experts == 0:
            return {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_act": "silu",
                **heads,
                **base,
            }, ""
        moe_ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size
        if m.moe_shared_expert_hidden_size:
            # Qwen2-MoE is the architecture with a shared expert beside routed ones that transformers
            # builds from these sizes alone; it always gates it (shared_expert_gate) and derives the head
            # size from hidden_size / num_attention_heads.
            if not m.moe_shared_expert_gate:
                if m.moe_shared_expert_hidden_size != moe_ffn:
                    return None, (
                        "an ungated shared expert is written as Llama 4's, whose shared expert is as wide as a routed "
                        f"one (here {m.moe_shared_expert_hidden_size} and {moe_ffn}); Qwen2-MoE's is gated: set "
                        "model.moe_shared_expert_gate: true, or export to Megatron"
                    )
                return _llama4_text(m, heads, base, moe_ffn), ""
            if m.head_dim not in (None, m.hidden_size // m.num_heads):
                return None, "Qwen2-MoE's head size is hidden_size / num_attention_heads: it has no head_dim"
            return {
                "architectures": ["Qwen2MoeForCausalLM"],
                "model_type": "qwen2_moe",
                "hidden_act": "silu",
                **{k: v for k, v in heads.items() if k != "head_dim"},
                **base,
                "num_experts": m.num_experts,
                "num_experts_per_tok": m.experts_per_token,
                "moe_intermediate_size": moe_ffn,
                "shared_expert_intermediate_size": m.moe_shared_expert_hidden_size,
                **_qwen_sparse_layers(m),
                "norm_topk_prob": False,
            }, ""
        if moe_ffn == m.ffn_hidden_size and m.moe_layer_frequency == 1 and m.moe_first_layer == 0:
            return {
                "architectures": ["MixtralForCausalLM"],
                "model_type": "mixtral",
                "hidden_act": "silu",
                **heads,
                **base,
                "num_local_experts": m.num_experts,
                "num_experts_per_tok": m.experts_per_token,
            }, ""
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "hidden_act": "silu",
            **heads,
            "head_dim": m.head_dim or m.hidden_size // m.num_heads,
            **base,
            "num_experts": m.num_experts,
            "num_experts_per_tok": m.experts_per_token,
            "moe_intermediate_size": moe_ffn,
            **_qwen_sparse_layers(m),
        }, ""
    if m.num_experts:
        return None, (
            "a mixture of experts is written only for RMSNorm + SwiGLU + RoPE models (Mixtral, Qwen-MoE, Llama 4)"
        )
    if m.norm == "layernorm" and m.activation == "gelu" and m.position_embedding == "rope":
        return {
            "architectures": ["GPTNeoXForCausalLM"],
            "model_type": "gpt_neox",
            "hidden_act": "gelu",
            **heads,
            **base,
        }, ""
    if m.norm == "layernorm" and m.activation == "gelu" and m.position_embedding == "learned":
        if (m.num_kv_heads not in (None, m.num_heads)) or m.head_dim not in (None, m.hidden_size // m.num_heads):
            return None, "GPT-2 has multi-head attention only (no grouped KV heads, no separate head_dim)"
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "activation_function": "gelu",
            "n_embd": m.hidden_size,
            "n_layer": m.num_layers,
            "n_head": m.num_heads,
            "n_inner": m.ffn_hidden_size,
            **({"n_positions": positions} if (positions := m.positions(seq_len)) else {}),
            **base,
        }, ""
    return None, (
        f"no HF architecture has norm {m.norm}, activation {m.activation} and {m.position_embedding} positions "
        "(written: Llama, Mixtral, Qwen2-MoE, Qwen3-MoE, Llama 4, GPT-NeoX, GPT-2)"
    )


def _deepseek_v3(m: TransformerModel, heads: dict, base: dict) -> tuple[dict | None, str]:
    """Multi-head Latent Attention as a DeepseekV3ForCausalLM config (DeepseekV3Config; the importer's
    reading, importers/hf.py _deepseek): every layer from first_k_dense_replace an MoE layer with an
    ungated shared MLP of moe_intermediate_size * n_shared_experts (modeling_deepseek_v3.py); the
    router without expert groups (n_group 1, topk_group 1: DeepseekV3TopkRouter splits the experts
    into n_group groups), and the multi-token prediction layers as num_nextn_predict_layers (DeepSeek's
    key, which transformers' DeepseekV3Config keeps and its DeepseekV3ForCausalLM does not build: the
    checkpoint and DeepSeek's training have them; importers/hf.py reads them back)."""
    if m.norm != "rmsnorm" or m.activation != "swiglu":
        return None, "DeepSeek-V3's layers are RMSNorm with a SwiGLU (silu) MLP; export to Megatron"
    if m.position_embedding == "learned":
        return None, (
            "DeepSeek-V3 has no learned position table beside its rotary part (model.position_embedding: learned); "
            "export to Megatron (--position-embedding-type learned_absolute)"
        )
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_act": "silu",
        **{k: v for k, v in heads.items() if k != "head_dim"},
        "num_key_value_heads": m.num_heads,
        **base,
        "kv_lora_rank": m.kv_lora_rank,
        "q_lora_rank": m.q_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "num_nextn_predict_layers": m.mtp_num_layers,
    }
    if not m.num_experts:
        return {**config, "first_k_dense_replace": m.num_layers}, ""
    moe_ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size
    shared = m.moe_shared_expert_hidden_size or 0
    if m.moe_layer_frequency != 1:
        return None, (
            "transformers' DeepSeek-V3 makes every layer from first_k_dense_replace an MoE layer "
            f"(model.moe_layer_frequency is {m.moe_layer_frequency}); export to Megatron"
        )
    if shared % moe_ffn or m.moe_shared_expert_gate:
        return None, (
            "DeepSeek-V3's shared experts are ungated and n_shared_experts times as wide as a routed one "
            f"(here {shared} and {moe_ffn}" + (", gated" if m.moe_shared_expert_gate else "") + "); export to Megatron"
        )
    return {
        **config,
        "first_k_dense_replace": m.moe_first_layer,
        "n_routed_experts": m.num_experts,
        "num_experts_per_tok": m.experts_per_token,
        "moe_intermediate_size": moe_ffn,
        "n_shared_experts": shared // moe_ffn,
        "n_group": 1,
        "topk_group": 1,
    }, ""


def _llama4_text(m: TransformerModel, heads: dict, base: dict, moe_ffn: int) -> dict:
    """A Llama4ForCausalLM config (Llama4TextConfig) with the spec's sizes and nothing else of Llama 4:
    RoPE in every layer (no_rope_layers all 1), full attention (no attention_chunk_size) and no
    query/key norm, so that transformers builds the spec's transformer with its routed and shared
    experts."""
    from mixle_compile.parameters import is_moe_layer

    return {
        "architectures": ["Llama4ForCausalLM"],
        "model_type": "llama4_text",
        "hidden_act": "silu",
        **{k: v for k, v in heads.items() if k != "intermediate_size"},
        "head_dim": m.head_dim or m.hidden_size // m.num_heads,
        **base,
        "intermediate_size": moe_ffn,
        "intermediate_size_mlp": m.ffn_hidden_size,
        "num_local_experts": m.num_experts,
        "num_experts_per_tok": m.experts_per_token,
        "moe_layers": [i for i in range(m.num_layers) if is_moe_layer(m, i)],
        "no_rope_layers": [1] * m.num_layers,
        "attention_chunk_size": None,
        "use_qk_norm": False,
    }


def _qwen_sparse_layers(m: TransformerModel) -> dict:
    """The model's MoE layers as Qwen-MoE's keys: transformers makes layer i sparse when
    (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers (Qwen2MoeDecoderLayer,
    Qwen3MoeDecoderLayer). Layers k - 1, 2k - 1, ... are the step alone; any other spacing lists the
    dense layers under step 1."""
    from mixle_compile.parameters import is_moe_layer

    k, first = m.moe_layer_frequency, m.moe_first_layer
    if first == k - 1:
        return {"decoder_sparse_step": k, "mlp_only_layers": []}
    return {"decoder_sparse_step": 1, "mlp_only_layers": [i for i in range(m.num_layers) if not is_moe_layer(m, i)]}


def hf_config_text(config: dict) -> str:
    return json.dumps(config, indent=2) + "\n"

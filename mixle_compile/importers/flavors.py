"""The sizes of torchtitan's published model flavors, as a transformer model of the spec.

Each entry transcribes the flavor's ``*ModelArgs`` in pytorch/torchtitan
``torchtitan/models/<model>/__init__.py`` at 238fa9953e4aec2a62582121564273d7cbb1e9f1 (the last
commit before the config refactor), with the class defaults of ``model/args.py`` filled in. The
feed-forward width of Llama 3 / Llama 4 is the one their ``FeedForward`` computes (see
:func:`llama_ffn`). Where a flavor has something the transformer family cannot express, the entry
says so (``approximations``) and the importer warns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SOURCE_COMMIT = "238fa9953e4aec2a62582121564273d7cbb1e9f1"


def llama_ffn(dim: int, multiple_of: int, multiplier: float | None, divide_by: int = 1) -> int:
    """torchtitan's Llama FeedForward width: hidden = int(2 * 4 * dim / 3), times ffn_dim_multiplier,
    (for Llama 4 experts with auto_scale_hidden_dim: divided by top_k + num_shared_experts), rounded up to
    multiple_of (models/llama3/model/model.py FeedForward; models/llama4/model/model.py TransformerBlock)."""
    hidden = int(2 * 4 * dim / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    if divide_by > 1:
        hidden = int(hidden / divide_by)
    return multiple_of * math.ceil(hidden / multiple_of)


@dataclass(frozen=True)
class Flavor:
    model: dict
    approximations: tuple[str, ...] = field(default=())


def _llama3(
    dim: int, layers: int, heads: int, kv: int | None, multiplier: float | None, multiple_of: int, vocab: int = 128256
) -> Flavor:
    m = {
        "family": "transformer",
        "vocab_size": vocab,
        "hidden_size": dim,
        "num_layers": layers,
        "num_heads": heads,
        "ffn_hidden_size": llama_ffn(dim, multiple_of, multiplier),
        "tie_embeddings": False,
    }
    if kv is not None:
        m["num_kv_heads"] = kv
    return Flavor(m)


def _llama4(experts: int, moe_step: int) -> Flavor:
    # TransformerModelArgs defaults: vocab 202048, MoEArgs top_k 1, num_shared_experts 1, auto_scale_hidden_dim.
    dim, mult, multiple_of = 5120, 1.2, 2048
    m = {
        "family": "transformer",
        "vocab_size": 202048,
        "hidden_size": dim,
        "num_layers": 48,
        "num_heads": 40,
        "num_kv_heads": 8,
        "ffn_hidden_size": llama_ffn(dim, multiple_of, mult),
        "tie_embeddings": False,
        "num_experts": experts,
        "experts_per_token": 1,
        "moe_ffn_hidden_size": llama_ffn(dim, multiple_of, mult, divide_by=2),
        "moe_layer_frequency": moe_step,
        # TransformerBlock.moe_enabled = (layer_id + 1) % interleave_moe_layer_step == 0: layers k - 1, 2k - 1, ...
        **({"moe_first_layer": moe_step - 1} if moe_step > 1 else {}),
        # MoE.shared_expert: FeedForward(dim, hidden_dim * num_shared_experts), no gate
        # (torchtitan/models/moe.py; num_shared_experts 1)
        "moe_shared_expert_hidden_size": llama_ffn(dim, multiple_of, mult, divide_by=2),
    }
    return Flavor(m)


def _qwen3(
    dim: int,
    layers: int,
    heads: int,
    kv: int,
    hidden: int,
    tied: bool,
    moe: tuple[int, int, int] | None = None,
    vocab: int = 151936,
) -> Flavor:
    m = {
        "family": "transformer",
        "vocab_size": vocab,
        "hidden_size": dim,
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": kv,
        "head_dim": 128,
        "ffn_hidden_size": hidden,
        "tie_embeddings": tied,
    }
    if moe is not None:
        experts, top_k, inter = moe
        m.update(num_experts=experts, experts_per_token=top_k, moe_ffn_hidden_size=inter)
    return Flavor(m)


def _deepseek_v3(
    vocab: int,
    dim: int,
    inter: int,
    moe_inter: int,
    layers: int,
    dense: int,
    heads: int,
    experts: int,
    shared: int,
    top_k: int,
    q_lora: int,
) -> Flavor:
    """A DeepSeekV3ModelArgs flavor: Multi-head Latent Attention (Attention in
    torchtitan/models/deepseek_v3/model.py: ``wq`` where q_lora_rank is 0, else ``wq_a``, ``q_norm``,
    ``wq_b``; ``wkv_a`` to kv_lora_rank + qk_rope_head_dim, ``kv_norm``, ``wkv_b``; every flavor has
    kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128), dense
    FeedForward layers of inter_dim before the first MoE layer (layer_id < n_dense_layers), and MoE
    layers of num_experts experts of moe_inter_dim, top_k, and one shared FeedForward of
    moe_inter_dim * num_shared_experts (torchtitan/models/moe.py, no gate). The model's defaults:
    RMSNorm, SwiGLU, RoPE, untied output (DeepSeekV3ModelArgs)."""
    m = {
        "family": "transformer",
        "vocab_size": vocab,
        "hidden_size": dim,
        "num_layers": layers,
        "num_heads": heads,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "ffn_hidden_size": inter,
        "tie_embeddings": False,
        "num_experts": experts,
        "experts_per_token": top_k,
        "moe_ffn_hidden_size": moe_inter,
        "moe_shared_expert_hidden_size": moe_inter * shared,
    }
    if q_lora:  # q_lora_rank 0: one query projection (wq)
        m["q_lora_rank"] = q_lora
    if dense:
        m["moe_first_layer"] = dense
    return Flavor(m)


FLAVORS: dict[str, dict[str, Flavor]] = {
    "llama3": {
        "debugmodel": _llama3(256, 6, 16, None, None, 256, vocab=2048),
        "8B": _llama3(4096, 32, 32, 8, 1.3, 1024),
        "70B": _llama3(8192, 80, 64, 8, 1.3, 4096),
        "405B": _llama3(16384, 126, 128, 8, 1.2, 4096),
    },
    "llama4": {
        "17bx16e": _llama4(16, 1),
        "17bx128e": _llama4(128, 2),  # interleave_moe_layer_step default 2
    },
    "qwen3": {
        "debugmodel": Flavor(
            {
                "family": "transformer",
                "vocab_size": 2048,
                "hidden_size": 256,
                "num_layers": 8,
                "num_heads": 16,
                "num_kv_heads": 8,
                "head_dim": 128,
                "ffn_hidden_size": 3072,
                "tie_embeddings": True,
            }
        ),
        "debugmodel_moe": _qwen3(256, 8, 16, 8, 3072, False, (64, 8, 768), vocab=2048),
        "0.6B": _qwen3(1024, 28, 16, 8, 3072, True),
        "1.7B": _qwen3(2048, 28, 16, 8, 6144, True),
        "4B": _qwen3(2560, 36, 32, 8, 9728, True),
        "8B": _qwen3(4096, 36, 32, 8, 12288, False),
        "14B": _qwen3(5120, 40, 40, 8, 17408, False),
        "32B": _qwen3(5120, 64, 64, 8, 25600, False),
        "30B-A3B": _qwen3(2048, 48, 32, 4, 6144, False, (128, 8, 768)),
        "235B-A22B": _qwen3(4096, 94, 64, 4, 12288, False, (128, 8, 1536)),
    },
    # torchtitan/models/deepseek_v3/__init__.py (deepseekv3_args; 0.3.0's deepseekv3_configs has the same
    # sizes, without debugmodel_flex_attn, which differs from debugmodel in its attention kernel only)
    "deepseek_v3": {
        "debugmodel": _deepseek_v3(2048, 256, 1024, 256, 6, 1, 16, 8, 2, 3, 0),
        "debugmodel_flex_attn": _deepseek_v3(2048, 256, 1024, 256, 6, 1, 16, 8, 2, 3, 0),
        "16B": _deepseek_v3(102400, 2048, 10944, 1408, 27, 1, 16, 64, 2, 6, 0),
        "236B": _deepseek_v3(102400, 5120, 12288, 1536, 60, 1, 128, 160, 2, 6, 1536),
        "671B": _deepseek_v3(129280, 7168, 18432, 2048, 61, 3, 128, 256, 1, 8, 1536),
    },
}
# Aliases torchtitan's model names take for the same tables (the llama3 flavors under "llama3_ft", etc.).
ALIASES = {"llama3_ft": "llama3", "llama3.1": "llama3"}
# Models the transformer family cannot express.
REFUSED = {
    "flux": "FLUX is a diffusion transformer, not a language model",
    "gpt_oss": "gpt-oss's attention sinks and sliding-window layers are not modelled",
}


def flavor(model: str, name: str) -> Flavor | None:
    return FLAVORS.get(ALIASES.get(model, model), {}).get(name)

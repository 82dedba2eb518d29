"""The derived parameter lists: known models come out at their published sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mixle_compile.parameters import model_parameters, unique_parameter_bytes
from mixle_compile.spec import load_spec
from tests.conftest import EXAMPLES


def params_of(name):
    loaded = load_spec(EXAMPLES / name)
    assert loaded.ok
    return model_parameters(loaded.spec)


def test_llama3_8b_has_8_03_billion_parameters():
    params = params_of("llama3-8b-hsdp-tp.yaml")
    assert sum(p.numel for p in params) == 8_030_261_248
    assert unique_parameter_bytes(params) == 2 * 8_030_261_248  # bf16
    q = next(p for p in params if p.name == "layers.0.attn.q_proj.weight")
    k = next(p for p in params if p.name == "layers.0.attn.k_proj.weight")
    assert (q.shape, k.shape, q.role) == ((4096, 4096), (1024, 4096), "column")


def test_mixtral_has_46_7_billion_parameters_and_expert_tensors():
    params = params_of("mixtral-moe-ep.yaml")
    total = sum(p.numel for p in params)
    assert 46.6e9 < total < 46.8e9  # Mixtral 8x7B: 46.7B
    experts = [p for p in params if p.role == "expert"]
    assert len(experts) == 32 * 3 and all(p.shape[0] == 8 for p in experts)


def test_tied_embeddings_count_once():
    params = params_of("tiny-transformer.yaml")
    tied = [p for p in params if p.shared_group == "tied_embedding"]
    assert [p.name for p in tied] == ["embed.weight", "lm_head.weight"]
    assert unique_parameter_bytes(params) == sum(p.bytes for p in params) - tied[1].bytes


HF_CONFIGS = Path(__file__).parent / "corpus" / "importers" / "hf"


@pytest.mark.parametrize(
    "name",
    [
        "llama-3.1-8b.json",
        "mixtral-8x7b-v0.1.json",
        "qwen3-30b-a3b.json",
        "qwen1.5-moe-a2.7b.json",
        "llama-4-scout-17b-16e.json",
        "llama-4-maverick-17b-128e-text.json",
        "deepseek-v3.json",
        "deepseek-v2-lite.json",
        "kimi-k2-instruct.json",
    ],
)
def test_parameter_counts_equal_transformers_own_models(name, tmp_path):
    """transformers builds the config's model (on the meta device, no memory): its parameters are ours (a
    shared expert and its gate included), but for what the transformer family leaves out: Qwen2's q/k/v
    biases and Qwen3's per-head query and key norms (under 0.01% of either model). DeepSeek's Multi-head
    Latent Attention is counted exactly (DeepSeek-V3: 671.03B without its multi-token prediction layer,
    which DeepseekV3ForCausalLM does not build); Kimi K2 is built as the DeepSeek-V3 it is (its
    model_type kimi_k2 is unknown to transformers)."""
    transformers = pytest.importorskip("transformers")
    import torch

    from mixle_compile.importers.hf import hf_model, read_hf_document
    from mixle_compile.parameters import is_moe_layer, transformer_parameters
    from mixle_compile.spec.models import TransformerModel

    model = TransformerModel.model_validate(hf_model(read_hf_document(HF_CONFIGS / name)).model)
    path = HF_CONFIGS / name
    if json.loads(path.read_text())["model_type"] == "kimi_k2":
        (tmp_path / "config.json").write_text(path.read_text().replace('"kimi_k2"', '"deepseek_v3"'))
        path = tmp_path / "config.json"
    config = transformers.AutoConfig.from_pretrained(str(path))
    if config.model_type == "llama4":  # the language model of the multimodal one: what training builds
        config = config.text_config
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(config)
    theirs = {
        n: p.numel()
        for n, p in built.named_parameters(remove_duplicate=False)
        if not n.endswith(".bias") and ".q_norm." not in n and ".k_norm." not in n
    }
    # DeepseekV3ForCausalLM does not build the multi-token prediction layer the config names (it drops
    # model.layers.61 on load): compared without it (tests/test_mtp.py counts it against torchtitan's)
    if name == "deepseek-v3.json":
        assert model.mtp_num_layers == 1
    ours = transformer_parameters(model.model_copy(update={"mtp_num_layers": 0}), "bf16")
    assert sum(p.numel for p in ours) == sum(theirs.values())
    shared = sum(
        v for n, v in theirs.items() if ".shared_expert." in n or ".shared_expert_gate." in n or ".shared_experts." in n
    )
    if config.model_type == "llama4_text":  # its experts and layers, as transformers builds them
        sparse = [layer.is_moe_layer for layer in built.model.layers]
        assert sparse == [is_moe_layer(model, i) for i in range(model.num_layers)]
    assert sum(p.numel for p in ours if ".moe.shared." in p.name) == shared
    assert bool(shared) == bool(model.moe_shared_expert_hidden_size)
    if model.latent_attention:  # the attention's own tensors, layer by layer
        attention = sum(v for n, v in theirs.items() if ".self_attn." in n)
        assert (
            sum(p.numel for p in ours if ".attn." in p.name and not p.name.endswith(".attn_norm.weight")) == attention
        )
        sparse = [hasattr(layer.mlp, "experts") for layer in built.model.layers]
        assert sparse == [is_moe_layer(model, i) for i in range(model.num_layers)]
    if name == "deepseek-v3.json":
        assert round(sum(p.numel for p in ours) / 1e9, 2) == 671.03


@pytest.mark.parametrize(
    "name, keys",
    [
        ("qwen1.5-moe-a2.7b.json", {"decoder_sparse_step": 2, "mlp_only_layers": [1]}),
        ("qwen3-30b-a3b.json", {"mlp_only_layers": [0, 1]}),
    ],
)
def test_the_layers_transformers_makes_sparse_are_the_spec_moe_layers(tmp_path, name, keys):
    transformers = pytest.importorskip("transformers")
    import json

    import torch

    from mixle_compile.importers.hf import hf_model, read_hf_document
    from mixle_compile.parameters import is_moe_layer, transformer_parameters
    from mixle_compile.spec.models import TransformerModel

    data = json.loads((HF_CONFIGS / name).read_text())
    data.update(keys)
    (tmp_path / "config.json").write_text(json.dumps(data))
    model = TransformerModel.model_validate(hf_model(read_hf_document(tmp_path / "config.json")).model)
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(str(tmp_path / "config.json"))
        )
    sparse = [any(".experts." in n for n, _ in layer.named_parameters()) for layer in built.model.layers]
    assert sparse == [is_moe_layer(model, i) for i in range(model.num_layers)] and any(sparse) and not all(sparse)
    assert sum(p.numel for p in transformer_parameters(model, "bf16")) == sum(
        p.numel()
        for n, p in built.named_parameters()
        if not n.endswith(".bias") and ".q_norm." not in n and ".k_norm." not in n
    )


@pytest.mark.parametrize(
    "drop, keys",
    [
        (("num_key_value_heads",), {"num_attention_heads": 16, "head_dim": 32}),  # Llama4TextConfig's default 8
        (("intermediate_size_mlp", "num_local_experts"), {"interleave_moe_layer_step": 3}),
        ((), {"moe_layers": []}),  # no MoE layer: a dense model
    ],
)
def test_llama4_absent_and_null_keys_mean_what_transformers_makes_of_them(tmp_path, drop, keys):
    transformers = pytest.importorskip("transformers")
    import json

    import torch

    from mixle_compile.importers.hf import hf_model, read_hf_document
    from mixle_compile.parameters import is_moe_layer, transformer_parameters
    from mixle_compile.spec.models import TransformerModel

    data = json.loads((HF_CONFIGS / "llama-4-maverick-17b-128e-text.json").read_text())
    data.update(num_hidden_layers=6, hidden_size=512, intermediate_size=256, vocab_size=1000, pad_token_id=0, **keys)
    for key in drop:
        data.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(data))
    imported = hf_model(read_hf_document(tmp_path / "config.json"))
    assert not imported.problems
    model = TransformerModel.model_validate(imported.model)
    try:
        config = transformers.AutoConfig.from_pretrained(str(tmp_path / "config.json"))
    except Exception as exc:  # a transformers release that refuses the key as written: nothing to compare
        pytest.skip(f"transformers refuses this config: {exc}")
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(config)
    assert sum(p.numel for p in transformer_parameters(model, "bf16")) == sum(
        p.numel() for n, p in built.named_parameters() if not n.endswith(".bias")
    )
    assert [layer.is_moe_layer for layer in built.model.layers] == [is_moe_layer(model, i) for i in range(6)]


def test_torchtitan_deepseek_v3_flavors_equal_torchtitans_own_models():
    """torchtitan 0.3.0 builds each DeepSeek-V3 flavor (deepseekv3_configs, on the meta device): its
    parameters are the flavor table's model's (MLA with and without a query latent, routed and shared
    experts, dense layers first)."""
    pytest.importorskip("torchtitan")
    import torch

    try:
        from torchtitan.models.deepseek_v3 import deepseekv3_configs
    except ImportError as exc:  # its model code imports what the torchtitan extra installs
        pytest.skip(f"torchtitan's DeepSeek-V3 model does not import here: {exc}")
    from mixle_compile.importers.flavors import FLAVORS
    from mixle_compile.parameters import transformer_parameters
    from mixle_compile.spec.models import TransformerModel

    assert set(deepseekv3_configs) <= set(FLAVORS["deepseek_v3"])
    for name, build in deepseekv3_configs.items():
        with torch.device("meta"):
            built = build(attn_backend="flex", moe_comm_backend="standard").build()
        theirs = sum(p.numel() for p in built.parameters())
        model = TransformerModel.model_validate(FLAVORS["deepseek_v3"][name].model)
        assert sum(p.numel for p in transformer_parameters(model, "bf16")) == theirs, name

"""The derived parameter lists: known models come out at their published sizes."""

from __future__ import annotations

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
    ],
)
def test_parameter_counts_equal_transformers_own_models(name):
    """transformers builds the config's model (on the meta device, no memory): its parameters are ours (a
    shared expert and its gate included), but for what the transformer family leaves out: Qwen2's q/k/v
    biases and Qwen3's per-head query and key norms (under 0.01% of either model)."""
    transformers = pytest.importorskip("transformers")
    import torch

    from mixle_compile.importers.hf import hf_model, read_hf_document
    from mixle_compile.parameters import is_moe_layer, transformer_parameters
    from mixle_compile.spec.models import TransformerModel

    model = TransformerModel.model_validate(hf_model(read_hf_document(HF_CONFIGS / name)).model)
    config = transformers.AutoConfig.from_pretrained(str(HF_CONFIGS / name))
    if config.model_type == "llama4":  # the language model of the multimodal one: what training builds
        config = config.text_config
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(config)
    theirs = {
        n: p.numel()
        for n, p in built.named_parameters(remove_duplicate=False)
        if not n.endswith(".bias") and ".q_norm." not in n and ".k_norm." not in n
    }
    ours = transformer_parameters(model, "bf16")
    assert sum(p.numel for p in ours) == sum(theirs.values())
    shared = sum(v for n, v in theirs.items() if ".shared_expert." in n or ".shared_expert_gate." in n)
    if config.model_type == "llama4_text":  # its experts and layers, as transformers builds them
        sparse = [layer.is_moe_layer for layer in built.model.layers]
        assert sparse == [is_moe_layer(model, i) for i in range(model.num_layers)]
    assert sum(p.numel for p in ours if ".moe.shared." in p.name) == shared
    assert bool(shared) == bool(model.moe_shared_expert_hidden_size)


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

"""Reading engine configs: torchtitan TOMLs, Megatron-LM launch scripts, DeepSpeed JSON, HF config.json.

The real files live in tests/corpus/importers/ (sources: its SOURCES.md and each file's header).
Expected values are read off each file by hand (and, for torchtitan, compared with the independent
transcriptions of the same presets in tests/corpus/production/torchtitan/).
"""

from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from mixle_compile import cli
from mixle_compile.importers import ImportOptions, detect_format, read_any
from mixle_compile.importers.shell import Shell
from mixle_compile.spec import load_spec
from mixle_compile.spec.models import Spec
from mixle_compile.spec.source import SourceError
from tests.conftest import ROOT

CORPUS = ROOT / "tests" / "corpus" / "importers"
TT, MG, DS, HF = (CORPUS / d for d in ("torchtitan", "megatron", "deepspeed", "hf"))
LLAMA = str(HF / "llama-3.1-8b.json")


def run_cli(capsys, *argv):
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def imported(path, **options) -> dict:
    doc, _ = read_any(path, str(path), ImportOptions(**options))
    return doc.data


def subset(data: dict, expected: dict) -> dict:
    """The entries of ``data`` named in ``expected`` (nested one level), to compare as a whole."""
    return {section: {k: data.get(section, {}).get(k) for k in fields} for section, fields in expected.items()}


# --------------------------------------------------------------------------- detection


@pytest.mark.parametrize(
    "name, text, says",
    [
        ("pyproject.toml", "[project]\nname = 'x'\n", "a Python project file"),
        ("notes.toml", "[server]\nport = 8\n", "a TOML file without torchtitan's"),
        ("train.py", "print('hi')\n", "`check --torchtitan module:function`"),
        ("run.sh", "#!/bin/bash\necho hello\n", "without Megatron-LM arguments"),
        ("config.json", json.dumps({"model_type": "llama", "hidden_size": 8}), "an HF model config"),
    ],
)
def test_an_unsupported_file_says_what_it_is_and_what_is_read(capsys, tmp_path, name, text, says):
    path = tmp_path / name
    path.write_text(text)
    status, out, _ = run_cli(capsys, "check", path)
    assert status == 2
    assert "I001" in out and says in out and "YAML" not in out
    assert "torchtitan job config" in out or "HF model config" in out  # the list of formats, or the way to use it


def test_engine_configs_are_no_longer_read_as_yaml(capsys):
    """The formats a new user tries first: none gives a YAML error or a spec key error."""
    for path, extra in (
        (TT / "llama3_8b.toml", ()),
        (MG / "train_llama3_8b_h100_fp8.sh", ()),
        (DS / "bingbertsquad_bsz24.json", ("--model", LLAMA)),
    ):
        status, out, _ = run_cli(capsys, "check", path, *extra)
        assert not any(code in out for code in ("S001", "S003", "S004", "S006")), out
        assert status in (0, 1)


def test_detection_by_content_and_extension():
    assert detect_format("a.toml", b"[model]\nname='llama3'\n") == "torchtitan"
    assert detect_format("launch", b"torchrun pretrain_gpt.py --num-layers 2\n") == "megatron"
    assert detect_format("args.txt", b"--tensor-model-parallel-size 2\n--num-layers 4\n") == "megatron"
    assert detect_format("ds.json", b'{"train_batch_size": 8}') == "deepspeed"
    assert detect_format("spec.json", b'{"model": {}}') == "spec"
    assert detect_format("spec.yaml", b"model: {}\n") == "spec"


def test_import_options_are_refused_for_a_spec(capsys):
    status, out, _ = run_cli(capsys, "check", ROOT / "examples" / "tiny-transformer.yaml", "--devices", "8")
    assert status == 2 and "are for engine configs" in out


# --------------------------------------------------------------------------- torchtitan

TORCHTITAN = {
    # file: (model, mesh, training, devices)
    "llama3_debug_model.toml": (
        {"hidden_size": 256, "num_layers": 6, "num_heads": 16, "ffn_hidden_size": 768, "vocab_size": 2048},
        {"dp_shard": "auto", "tp": 1, "pp": 1},
        {"global_batch_size": 64, "micro_batch_size": 8, "seq_len": 2048},
        8,
    ),
    "llama3_ft_debug_model.toml": (
        {"hidden_size": 256, "num_layers": 6, "vocab_size": 2048},
        {"dp_shard": "auto"},
        {"micro_batch_size": 8, "seq_len": 2048},
        8,
    ),
    "llama3_8b.toml": (
        {
            "hidden_size": 4096,
            "num_layers": 32,
            "num_heads": 32,
            "num_kv_heads": 8,
            "ffn_hidden_size": 14336,
            "vocab_size": 128256,
        },
        {"dp_shard": "auto", "tp": 1},
        {"global_batch_size": 64, "micro_batch_size": 1, "seq_len": 8192, "activation_checkpointing": "selective"},
        64,
    ),
    "llama3_70b.toml": (
        {"hidden_size": 8192, "num_layers": 80, "num_heads": 64, "ffn_hidden_size": 28672},
        {"tp": 8},
        {"global_batch_size": 64, "micro_batch_size": 8, "sequence_parallel": True, "activation_checkpointing": "full"},
        64,
    ),
    "llama3_405b.toml": (
        {"hidden_size": 16384, "num_layers": 126, "num_heads": 128, "ffn_hidden_size": 53248},
        {"tp": 8},
        {"global_batch_size": 32, "micro_batch_size": 2, "precision": "fp8", "async_tensor_parallel": True},
        128,
    ),
    "llama4_17bx16e.toml": (
        {
            "hidden_size": 5120,
            "num_experts": 16,
            "experts_per_token": 1,
            "moe_ffn_hidden_size": 8192,
            "moe_layer_frequency": 1,
            "vocab_size": 202048,
        },
        {"tp": 8, "etp": 8},
        {"global_batch_size": 64},
        64,
    ),
    "llama4_17bx128e.toml": (
        {"num_experts": 128, "moe_layer_frequency": 2, "moe_first_layer": 1, "moe_shared_expert_hidden_size": 8192},
        {"tp": 8, "pp": 4, "etp": 8, "microbatches": 1},
        {"micro_batch_size": 1, "pipeline_schedule": "1f1b"},
        32,
    ),
    "qwen3_0.6b.toml": (
        {"hidden_size": 1024, "num_layers": 28, "head_dim": 128, "tie_embeddings": True, "vocab_size": 151936},
        {"dp_shard": "auto"},
        {"micro_batch_size": 4, "seq_len": 4096},
        8,
    ),
    "qwen3_1.7b.toml": (
        {"hidden_size": 2048, "ffn_hidden_size": 6144, "tie_embeddings": True},
        {"dp_shard": "auto"},
        {"global_batch_size": 32},
        8,
    ),
    "qwen3_32b.toml": (
        {"hidden_size": 5120, "num_layers": 64, "num_heads": 64, "ffn_hidden_size": 25600, "tie_embeddings": False},
        {"dp_shard": "auto"},
        {"global_batch_size": 16, "micro_batch_size": 2},
        8,
    ),
    "qwen3_moe_debug.toml": (
        {"num_experts": 64, "experts_per_token": 8, "moe_ffn_hidden_size": 768},
        {"dp_shard": "auto"},
        {"micro_batch_size": 4},
        8,
    ),
    "old_2024_llama3_8b.toml": (
        {"hidden_size": 4096, "ffn_hidden_size": 14336},
        {"dp_shard": "auto"},
        {"micro_batch_size": 1, "seq_len": 8192},
        64,
    ),
    "old_2024_llama3_405b.toml": (
        {"num_layers": 126},
        {"tp": 8},
        {"micro_batch_size": 2, "precision": "fp8", "activation_checkpointing": "full", "async_tensor_parallel": True},
        128,
    ),
    "old_2024_debug_model.toml": (
        {"hidden_size": 256, "vocab_size": 2048},
        {"dp_shard": "auto"},
        {"micro_batch_size": 8},
        8,
    ),
}


@pytest.mark.parametrize("name", sorted(TORCHTITAN))
def test_each_torchtitan_toml_imports_with_its_degrees_and_sizes(name):
    """pytorch/torchtitan train configs (source in each file's first line)."""
    model, mesh, training, devices = TORCHTITAN[name]
    data = imported(TT / name)
    assert subset(data, {"model": model, "mesh": mesh, "training": training}) == {
        "model": model,
        "mesh": mesh,
        "training": training,
    }
    assert data["resources"]["devices"] == devices
    assert data["backend"] == {"name": "torchtitan", "version": "0.2"}
    Spec.model_validate(data)  # a well-formed spec


@pytest.mark.parametrize(
    "toml, production",
    [
        ("llama3_8b.toml", "llama3_8b_64gpu_fsdp64_a100.yaml"),
        ("llama3_70b.toml", "llama3_70b_64gpu_fsdp8_tp8_a100.yaml"),
        ("llama4_17bx16e.toml", "llama4_17bx16e_64gpu_fsdp8_tp8.yaml"),
        ("qwen3_1.7b.toml", "qwen3_1.7b_8gpu_fsdp8_tied.yaml"),
        ("qwen3_32b.toml", "qwen3_32b_8gpu_fsdp8.yaml"),
    ],
)
def test_torchtitan_import_agrees_with_the_hand_transcription_of_the_same_preset(toml, production):
    """tests/corpus/production/torchtitan/ transcribes these presets by hand, citing the flavors' args."""
    ours = imported(TT / toml)
    theirs = yaml.safe_load((ROOT / "tests" / "corpus" / "production" / "torchtitan" / production).read_text())
    for key, value in theirs["model"].items():
        assert (
            ours["model"].get(
                key,
                {"norm": "rmsnorm", "activation": "swiglu", "position_embedding": "rope", "moe_layer_frequency": 1}.get(
                    key
                ),
            )
            == value
        ), key
    for key in ("global_batch_size", "micro_batch_size", "seq_len", "activation_checkpointing"):
        assert ours["training"][key] == theirs["training"][key], key
    assert ours["resources"]["devices"] == theirs["resources"]["devices"]


def test_torchtitan_diagnostics_point_into_the_toml(capsys):
    status, out, _ = run_cli(capsys, "check", "--format", "json", TT / "llama4_17bx128e.toml")
    found = json.loads(out)
    p003 = next(d for d in found if d["code"] == "P003")
    lines = (TT / "llama4_17bx128e.toml").read_text().splitlines()
    assert (
        status == 1
        and "pipeline_parallel_degree" in lines[p003["line"] - 1]
        or "local_batch_size" in lines[p003["line"] - 1]
    )


def test_torchtitan_deepseek_v3_is_its_flavor_with_latent_attention():
    """torchtitan's DeepSeek-V3 16B job reads as DeepSeekV3ModelArgs' 16B flavor: MLA without a query
    latent (q_lora_rank 0), 64 routed experts of 1408 (top 6), two shared ones, one dense layer first."""
    from mixle_compile.importers.flavors import FLAVORS

    model = imported(TT / "deepseek_v3_16b.toml", devices=8)["model"]
    assert model == FLAVORS["deepseek_v3"]["16B"].model
    assert subset(
        {"m": model}, {"m": ["kv_lora_rank", "q_lora_rank", "moe_first_layer", "moe_shared_expert_hidden_size"]}
    ) == {"m": {"kv_lora_rank": 512, "q_lora_rank": None, "moe_first_layer": 1, "moe_shared_expert_hidden_size": 2816}}


@pytest.mark.parametrize("name, says", [("flux", "FLUX is a diffusion transformer"), ("gpt_oss", "attention sinks")])
def test_torchtitan_refuses_what_it_cannot_express(tmp_path, capsys, name, says):
    path = tmp_path / "job.toml"
    path.write_text(f'[model]\nname = "{name}"\nflavor = "x"\n')
    status, out, _ = run_cli(capsys, "check", path, "--devices", "8")
    assert status == 2 and "I004" in out and says in out
    assert int(out.split(".toml:")[1].split(":")[0]) == 2  # at `name = ...`


def test_torchtitan_unknown_keys_are_named(tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_text(
        '[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\ntensor_parallel_degree = 2\nshiny_new_degree = 4\n'
        "[training]\nlocal_batch_size = 2\nseq_len = 1024\n"
    )
    status, out, _ = run_cli(capsys, "check", path, "--devices", "8")
    assert "I002" in out and "parallelism.shiny_new_degree" in out and f"{path}:6:1" in out


def test_torchtitan_flavor_outside_the_table(tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_text('[model]\nname = "llama3"\nflavor = "9B"\n')
    status, out, _ = run_cli(capsys, "check", path)
    assert status == 2 and "9B" in out and "8B, 70B, 405B" in out and f"{path}:3:" in out


def test_torchtitan_model_from_an_hf_config_next_to_it(tmp_path):
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_text((HF / "qwen3-8b.json").read_text())
    path = tmp_path / "job.toml"
    path.write_text(
        '[model]\nname = "qwen3"\nflavor = "custom"\nhf_assets_path = "./assets"\n[training]\nlocal_batch_size = 1\n'
    )
    data = imported(path, devices=8)
    assert data["model"]["num_layers"] == 36 and data["model"]["ffn_hidden_size"] == 12288


def test_torchtitan_toml_builds_no_mtp_layers_an_hf_config_names(tmp_path):
    """torchtitan's job TOML (0.2 era) has no multi-token prediction: DeepSeek-V3's config.json beside it sizes the
    model, and its num_nextn_predict_layers is named (I002) and left out, not read into the spec."""
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_text((HF / "deepseek-v3.json").read_text())
    path = tmp_path / "job.toml"
    path.write_text(
        '[model]\nname = "deepseek_v3"\nflavor = "custom"\nhf_assets_path = "./assets"\n'
        "[training]\nlocal_batch_size = 1\n"
    )
    doc, diags = read_any(path, str(path), ImportOptions(devices=8))
    assert doc.data["model"]["kv_lora_rank"] == 512 and doc.data["model"]["mtp_num_layers"] == 0
    (named,) = [d for d in diags if "multi-token prediction" in d.message]
    assert named.code == "I002" and "job TOML (0.2) builds no multi-token prediction layers" in named.message
    assert named.line == 3  # at `flavor = ...`
    # a flavor from the table has none to leave out
    assert "mtp_num_layers" not in imported(TT / "deepseek_v3_16b.toml", devices=8)["model"]


def test_invalid_toml_is_a_toml_error_at_its_position(tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_text('[model]\nname = "llama3"\nflavor = \n')
    status, out, _ = run_cli(capsys, "check", path)
    assert status == 2 and "invalid TOML" in out and f"{path}:3:" in out


# --------------------------------------------------------------------------- Megatron-LM

MEGATRON = {
    "train_llama3_8b_h100_fp8.sh": (
        {},
        {
            "hidden_size": 4096,
            "num_layers": 32,
            "num_heads": 32,
            "num_kv_heads": 8,
            "head_dim": 128,
            "ffn_hidden_size": 14336,
            "vocab_size": 128256,
            "tie_embeddings": False,
            "norm": "rmsnorm",
        },
        {"tp": 1, "pp": 1, "cp": 1, "dp_replicate": 8, "dp_shard": None, "microbatches": 16},
        {
            "global_batch_size": 128,
            "micro_batch_size": 1,
            "seq_len": 8192,
            "precision": "fp8",
            "distributed_optimizer": True,
            "sequence_parallel": True,
        },
        8,
    ),
    "train_llama3_8b_fsdp_h100_fp8.sh": (
        {},
        {"hidden_size": 4096, "num_kv_heads": 8, "ffn_hidden_size": 14336},
        {"tp": 1, "cp": 1, "dp_shard": 8},
        {"global_batch_size": 128, "precision": "fp8"},
        8,
    ),
    "train_gpt3_175b_distributed.sh": (
        {},
        {
            "hidden_size": 12288,
            "num_layers": 96,
            "num_heads": 96,
            "ffn_hidden_size": 49152,
            "vocab_size": 51200,
            "tie_embeddings": True,
            "norm": "layernorm",
            "position_embedding": "learned",
            "activation": "gelu",
        },
        {"tp": 8, "pp": 16, "dp_replicate": 1},
        {"global_batch_size": 1536, "micro_batch_size": 1, "seq_len": 2048, "precision": "fp16"},
        8,
    ),
    "train_mixtral_8x7b_distributed.sh": (
        {"devices": 32},
        {
            "num_experts": 8,
            "experts_per_token": 2,
            "vocab_size": 32000,
            "num_kv_heads": 8,
            "position_embedding": "rope",
        },
        {"tp": 1, "pp": 4, "ep": 8, "etp": 1, "dp_replicate": 8, "microbatches": 32},
        {"global_batch_size": 256, "seq_len": 4096, "precision": "bf16", "steps": 500000},
        32,
    ),
    "gptoss_02_train.sh": ({}, {"num_layers": 12, "vocab_size": 128256}, {"pp": 8}, {"global_batch_size": 128}, 8),
    "conf_Llama-3.1-8B-Instruct.sh": (
        {"model": LLAMA},
        {"hidden_size": 4096, "num_layers": 32, "ffn_hidden_size": 14336, "vocab_size": 128256, "num_kv_heads": 8},
        {"tp": 1, "dp_replicate": 8},
        {"micro_batch_size": 1, "seq_len": 4096, "precision": "bf16"},
        8,
    ),
    "conf_Qwen3-30B-A3B.sh": (
        {"model": str(HF / "qwen3-30b-a3b.json")},
        {
            "hidden_size": 2048,
            "num_layers": 48,
            "num_kv_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "experts_per_token": 8,
            "moe_ffn_hidden_size": 768,
            "vocab_size": 151936,
        },
        {"tp": 1},
        {"seq_len": 4096},
        8,
    ),
    "model_config_moe_tp2_pp2_ep4_etp1_layout_mtp.yaml": (  # a functional-test config, with a pipeline layout
        {},
        {"hidden_size": 1024, "num_layers": 16, "num_experts": 32, "moe_first_layer": 3, "mtp_num_layers": 1},
        {"tp": 2, "pp": 2, "ep": 4, "etp": 1, "dp_replicate": 2, "microbatches": 4},
        {
            "pipeline_layers": [3, 2, 2, 2, 2, 2, 2, 1],
            "virtual_pipeline_stages": 4,
            "recompute_modules": ["layernorm", "mla_up_proj", "mlp", "moe_act"],
            "micro_batch_size": 4,
            "seq_len": 4096,
        },
        8,
    ),
    "conf_Qwen3-8B.sh": (
        {"model": str(HF / "qwen3-8b.json")},
        {"hidden_size": 4096, "num_layers": 36, "ffn_hidden_size": 12288, "vocab_size": 151936},
        {"tp": 1},
        {"seq_len": 4096},
        8,
    ),
}


@pytest.mark.parametrize("name", sorted(MEGATRON))
def test_each_megatron_script_imports_with_its_degrees_and_sizes(name):
    """NVIDIA/Megatron-LM examples (source in each file's second line)."""
    options, model, mesh, training, devices = MEGATRON[name]
    data = imported(MG / name, **options)
    assert subset(data, {"model": model, "mesh": mesh, "training": training}) == {
        "model": model,
        "mesh": mesh,
        "training": training,
    }
    assert data["resources"]["devices"] == devices
    assert data["backend"] == {"name": "megatron", "entry": "arguments"}
    Spec.model_validate(data)


@pytest.mark.parametrize(
    "name, says",
    [
        ("conf_Llama-3.2-1B-Instruct.sh", "vocabulary size"),
        ("conf_DeepSeek-V2-Lite.sh", "the vocabulary size is not in the arguments (tokenizer HuggingFaceTokenizer"),
        ("train_bert_340m_distributed.sh", "pretrain_bert.py"),
    ],
)
def test_megatron_scripts_the_spec_cannot_express_are_refused_by_name(capsys, name, says):
    status, out, _ = run_cli(capsys, "check", MG / name)
    assert status == 2 and "I004" in out and says in out


def test_megatron_llama4_launch_is_the_model_transformers_builds_from_its_hf_config():
    """Megatron-LM's own Llama 4 Scout arguments (routed and shared experts, the vocabulary as
    --padded-vocab-size gives it, unpadded) and the published HF config read as one model."""
    from mixle_compile.importers.hf import hf_model, read_hf_document

    megatron = imported(MG / "conf_Llama-4-Scout-17B-16E-Instruct.sh", devices=8)["model"]
    hf = hf_model(read_hf_document(HF / "llama-4-scout-17b-16e.json")).model
    for field_name in (
        "vocab_size",
        "hidden_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "ffn_hidden_size",
        "num_experts",
        "experts_per_token",
        "moe_ffn_hidden_size",
        "moe_shared_expert_hidden_size",
    ):
        assert megatron[field_name] == hf[field_name], field_name
    assert megatron.get("moe_first_layer", 0) == hf["moe_first_layer"] == 0


def test_megatron_values_are_reported_where_the_script_writes_them(capsys):
    """GBS is set through GLOBAL_BATCH_SIZE=128 and passed as --global-batch-size $GLOBAL_BATCH_SIZE."""
    path = MG / "train_llama3_8b_h100_fp8.sh"
    doc, _ = read_any(path, str(path))
    lines = path.read_text().splitlines()
    assert lines[doc.position(("training", "global_batch_size")).line - 1].startswith("GLOBAL_BATCH_SIZE=128")
    assert "--num-query-groups 8" in lines[doc.position(("model", "num_kv_heads")).line - 1]
    status, out, _ = run_cli(capsys, "check", path)
    q004 = next(line for line in out.splitlines() if " Q004 " in line)
    assert "--sequence-parallel" in lines[int(q004.split(":")[1]) - 1]


def test_the_gpt3_script_as_published_does_not_fit_its_own_node(capsys, tmp_path):
    """TP 8 x PP 16 on the script's NUM_NODES=1 x 8 GPUs: the world size check names the degrees."""
    # It also passes a batch-size schedule with --global-batch-size, which validate_args refuses: that comes first.
    status, out, _ = run_cli(capsys, "check", MG / "train_gpt3_175b_distributed.sh")
    assert status == 1 and "I005" in out and "--step-batch-size-schedule" in out
    fixed = tmp_path / "train_gpt3_175b.sh"
    fixed.write_text(
        "\n".join(
            line
            for line in (MG / "train_gpt3_175b_distributed.sh").read_text().splitlines()
            if "--step-batch-size-schedule" not in line
        )
    )
    status, out, _ = run_cli(capsys, "check", fixed)
    assert status == 1 and "D001" in out
    status, out, _ = run_cli(capsys, "check", fixed, "--devices", "1024")
    assert "D001" not in out


def _small_megatron_launch(tmp_path, flags: str):
    """A small model's Megatron-LM arguments file with ``flags`` added."""
    path = tmp_path / "args.txt"
    path.write_text(
        "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --vocab-size 128 --micro-batch-size 1 "
        f"--global-batch-size 8 --seq-length 64 --bf16 {flags}\n"
    )
    return path


# Megatron-FSDP as validate_args takes it (it asserts the checkpoint format)
MEGATRON_FSDP = "--use-megatron-fsdp --ckpt-format fsdp_dtensor"


@pytest.mark.parametrize(
    "flags, mesh, distributed",
    [
        ("", {"dp_replicate": 8}, False),
        # the distributed optimizer is ZeRO-1: weights and gradients whole, optimizer state sharded
        ("--use-distributed-optimizer", {"dp_replicate": 8}, True),
        # Megatron-FSDP's default strategy, optim_grads_params, shards the weights too
        (MEGATRON_FSDP, {"dp_shard": 8}, False),
        (MEGATRON_FSDP + " --use-distributed-optimizer", {"dp_shard": 8}, True),
        (MEGATRON_FSDP + " --data-parallel-sharding-strategy optim_grads_params", {"dp_shard": 8}, False),
        (MEGATRON_FSDP + " --data-parallel-sharding-strategy optim", {"dp_replicate": 8}, True),
        (MEGATRON_FSDP + " --data-parallel-sharding-strategy optim_grads", {"dp_replicate": 8}, True),
        (MEGATRON_FSDP + " --data-parallel-sharding-strategy no_shard", {"dp_replicate": 8}, False),
        # several optimizer instances: Megatron-FSDP shards within each block of dp / K ranks (HSDP)
        (MEGATRON_FSDP + " --num-distributed-optimizer-instances 2", {"dp_replicate": 2, "dp_shard": 4}, False),
        (MEGATRON_FSDP + " --num-distributed-optimizer-instances 8", {"dp_replicate": 8, "dp_shard": 1}, False),
        # the distributed optimizer keeps K copies: read as sharded over all the ranks, with a warning
        ("--use-distributed-optimizer --num-distributed-optimizer-instances 2", {"dp_replicate": 8}, True),
        # plain data parallelism reduces in two steps to the same sum
        ("--num-distributed-optimizer-instances 2", {"dp_replicate": 8}, False),
        # torch FSDP2 is ZeRO-3 (validate_args wants these flags with it)
        (
            "--use-torch-fsdp2 --no-gradient-accumulation-fusion --untie-embeddings-and-output-weights",
            {"dp_shard": 8},
            False,
        ),
        # its wrapper takes no optimizer instances
        (
            "--use-torch-fsdp2 --no-gradient-accumulation-fusion --untie-embeddings-and-output-weights "
            "--num-distributed-optimizer-instances 2",
            {"dp_shard": 8},
            False,
        ),
    ],
)
def test_megatron_data_parallelism_says_what_it_shards(tmp_path, flags, mesh, distributed):
    path = _small_megatron_launch(tmp_path, flags)
    doc, diagnostics = read_any(path, str(path), ImportOptions(devices=8))
    data = doc.data
    assert {k: v for k, v in data["mesh"].items() if k.startswith("dp_")} == mesh
    assert data["training"]["distributed_optimizer"] is distributed
    zero2 = [d for d in diagnostics if "optim_grads (ZeRO-2)" in d.message]
    assert len(zero2) == (1 if flags.endswith(" optim_grads") else 0)
    copies = [d for d in diagnostics if "keeps 2 copies" in d.message]
    assert len(copies) == (1 if distributed and "instances 2" in flags else 0)
    assert all(d.severity.value != "error" for d in diagnostics), [d.message for d in diagnostics]
    Spec.model_validate(data)


def test_megatron_fsdp_example_with_its_optimizer_instances_is_hybrid_sharding(tmp_path, capsys):
    # Megatron-LM's own Megatron-FSDP example offers the knob commented out; turned on it is HSDP
    text = (MG / "train_llama3_8b_fsdp_h100_fp8.sh").read_text()
    assert "# --num-distributed-optimizer-instances 2" in text
    path = tmp_path / "train_llama3_8b_fsdp_h100_fp8.sh"
    knob = "--num-distributed-optimizer-instances 2"
    path.write_text(text.replace(f"# {knob}", knob))
    doc, _ = read_any(path, str(path), ImportOptions())
    assert (doc.data["mesh"]["dp_replicate"], doc.data["mesh"]["dp_shard"]) == (2, 4)
    status, out, _ = run_cli(capsys, "check", path)
    assert status == 0, out


@pytest.mark.parametrize(
    "flags, code, says",
    [
        # initialize_model_parallel asserts that the instances divide dp * cp
        ("--use-megatron-fsdp --num-distributed-optimizer-instances 3", "I005", "does not divide the 8 data ranks"),
        # 4 divides dp * cp = 2 * 4 but not dp = 2: the blocks would cut across the context-parallel ranks
        (
            "--use-megatron-fsdp --context-parallel-size 4 --num-distributed-optimizer-instances 4",
            "I004",
            "divides the data-parallel ranks alone",
        ),
        ("--use-distributed-optimizer --num-distributed-optimizer-instances 0", "I004", "at least 1"),
        # what validate_args asserts under each FSDP
        ("--use-megatron-fsdp --ckpt-format torch_dist", "I005", "fsdp_dtensor"),
        ("--use-megatron-fsdp --ckpt-format fsdp_dtensor --optimizer muon", "I005", "muon optimizer"),
        ("--use-torch-fsdp2 --untie-embeddings-and-output-weights", "I005", "gradient accumulation fusion"),
        ("--use-torch-fsdp2 --no-gradient-accumulation-fusion", "I005", "--untie-embeddings-and-output-weights"),
        (
            "--use-torch-fsdp2 --no-gradient-accumulation-fusion --untie-embeddings-and-output-weights "
            "--use-distributed-optimizer",
            "I005",
            "distributed optimizer",
        ),
        ("--use-torch-fsdp2 --use-megatron-fsdp", "I004", "two FSDP implementations"),
    ],
)
def test_megatron_refuses_optimizer_instances_it_cannot_say(tmp_path, flags, code, says):
    path = _small_megatron_launch(tmp_path, flags)
    try:
        _, diagnostics = read_any(path, str(path), ImportOptions(devices=8))
    except SourceError as refused:  # what the spec cannot say is refused (exit 2), what Megatron refuses is I005
        diagnostics = refused.diagnostics
    found = [d for d in diagnostics if d.code == code]
    assert any(says in d.message for d in found), [(d.code, d.message) for d in diagnostics]


def test_megatron_refuses_a_sharding_strategy_it_does_not_take(tmp_path, capsys):
    path = _small_megatron_launch(tmp_path, "--use-megatron-fsdp --data-parallel-sharding-strategy full")
    status, out, _ = run_cli(capsys, "check", path, "--devices", "8")
    assert status == 2 and "--data-parallel-sharding-strategy" in out and "optim_grads_params" in out


def test_megatron_defaults_follow_validate_args(tmp_path):
    path = tmp_path / "args.txt"
    path.write_text(
        "--num-layers 4\n--hidden-size 1000\n--num-attention-heads 8\n--swiglu\n--vocab-size 1000\n"
        "--tensor-model-parallel-size 2\n--micro-batch-size 2\n--num-experts 4\n"
    )
    data = imported(path, devices=8)
    assert data["model"]["ffn_hidden_size"] == int((4 * 1000 * 2 / 3) / 64) * 64  # 2624
    assert data["model"]["vocab_size"] == 1024  # padded to 128 * tp
    assert data["model"]["experts_per_token"] == 2 and data["mesh"]["etp"] == 2
    assert data["training"]["global_batch_size"] == 2 * 4 and data["mesh"]["dp_replicate"] == 4
    assert data["model"]["tie_embeddings"] is True and data["model"]["position_embedding"] == "learned"


def test_megatron_padded_vocab_size_is_the_models_vocabulary_unpadded(tmp_path):
    path = tmp_path / "args.txt"
    base = (
        "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --tensor-model-parallel-size 2 --micro-batch-size 1 "
    )
    path.write_text(base + "--vocab-size 1000\n")
    assert imported(path, devices=2)["model"]["vocab_size"] == 1024  # padded to 128 * tp
    path.write_text(base + "--vocab-size 1000 --padded-vocab-size 1002 --tokenizer-type HuggingFaceTokenizer\n")
    assert imported(path, devices=2)["model"]["vocab_size"] == 1002
    # used as given, it must split over tp (VocabParallelEmbedding's divide asserts): Megatron refuses 1001
    path.write_text(base + "--seq-length 128 --global-batch-size 8 --padded-vocab-size 1001\n")
    diagnostics = read_any(path, str(path), ImportOptions(devices=2))[1]
    assert any(d.code == "I005" and "--padded-vocab-size 1001 with tp 2" in d.message for d in diagnostics)


def test_megatron_capacity_factor_caps_the_experts_tokens(tmp_path):
    path = tmp_path / "args.txt"
    base = (
        "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --vocab-size 128 --seq-length 32 "
        "--num-experts 4 --expert-model-parallel-size 2"
    )
    path.write_text(base + " --moe-expert-capacity-factor 1.25\n")
    assert imported(path, devices=2)["model"]["expert_capacity_factor"] == 1.25
    # TransformerConfig turns a negative factor into None: dropless routing
    for dropless in (base, base + " --moe-expert-capacity-factor -1"):
        path.write_text(dropless + "\n")
        assert "expert_capacity_factor" not in imported(path, devices=2)["model"]


@pytest.mark.parametrize(
    "pattern, spacing, says",
    [
        ("2", (0, 2), None),
        ("'([0]*3+[1]*5)'", (3, 1), None),
        ('"([0,1]*4)"', (1, 2), None),
        ("[1,0,0,1,0,0,1,0]", (0, 3), None),
        ("'([1]*3+[0]*1)*2'", None, "makes layers [0, 1, 2, 4, 5, 6] MoE layers"),
        ("'[0]*8'", None, "makes layers none MoE layers"),
        ("'([0]*3+[1]*6)'", None, "names more than 8 layers, the model has 8"),
        ("'([0]*3+[1]*4)'", None, "names 7 layers, the model has 8"),
        ("'([1]*100000)*100000'", None, "names more than 8 layers"),  # refused before it is built
        ("'[0]*3+[2]*5'", None, "neither an integer nor a list of 0s and 1s"),
        ("'__import__(1)'", None, "neither an integer nor a list of 0s and 1s"),
    ],
)
def test_megatron_moe_layer_patterns_are_dense_layers_then_every_kth(tmp_path, capsys, pattern, spacing, says):
    path = tmp_path / "train.sh"
    path.write_text(
        "torchrun --nproc_per_node 2 pretrain_gpt.py --num-layers 8 --hidden-size 64 --num-attention-heads 4 "
        "--vocab-size 128 --seq-length 32 --num-experts 4 --expert-model-parallel-size 2 "
        f"--moe-token-dispatcher-type alltoall --moe-layer-freq {pattern}\n"
    )
    if spacing is None:
        status, out, _ = run_cli(capsys, "check", str(path))
        assert status == 2 and "I004" in out and says in out, out
        return
    model = imported(path)["model"]
    assert (model.get("moe_first_layer", 0), model["moe_layer_frequency"]) == spacing
    status, out, _ = run_cli(capsys, "check", str(path), "--device-memory", "80GiB")
    assert status == 0, out


def test_megatron_shared_expert_and_its_gate(tmp_path, capsys):
    path = tmp_path / "args.txt"
    base = (
        "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --vocab-size 128 --seq-length 32 "
        "--num-experts 4 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
    )
    path.write_text(
        base + " --moe-shared-expert-intermediate-size 96 --moe-shared-expert-gate --moe-shared-expert-overlap\n"
    )
    model = imported(path, devices=2)["model"]
    assert model["moe_shared_expert_hidden_size"] == 96 and model["moe_shared_expert_gate"] is True
    status, out, _ = run_cli(capsys, "check", str(path), "--devices", "2", "--device-memory", "80GiB")
    assert status == 0 and "I002" not in out, out  # the overlap is a schedule of the same work
    path.write_text(base + "\n")
    assert "moe_shared_expert_hidden_size" not in imported(path, devices=2)["model"]
    # a gate with no shared expert gates nothing (MoELayer passes it only to shared experts it builds)
    path.write_text(base + " --moe-shared-expert-gate\n")
    status, out, _ = run_cli(capsys, "check", str(path), "--devices", "2", "--device-memory", "80GiB")
    assert status == 0 and "I002" in out and "no shared expert to gate" in out, out
    # TransformerConfig.__post_init__ refuses a width that is not positive
    path.write_text(base + " --moe-shared-expert-intermediate-size 0\n")
    status, out, _ = run_cli(capsys, "check", str(path), "--devices", "2")
    assert status == 2 and "I004" in out and "not positive" in out


@pytest.mark.parametrize(
    "flags, says",
    [
        ("--moe-token-dispatcher-type alltoall", None),
        ("", "the `allgather` token dispatcher (Megatron's default, no --moe-token-dispatcher-type)"),
        ("--moe-token-dispatcher-type allgather", "the `allgather` token dispatcher is planned as `alltoall`"),
        ("--moe-token-dispatcher-type flex", None),
        ("--moe-enable-deepep", None),
    ],
)
def test_megatron_token_dispatchers_are_read_or_named(tmp_path, capsys, flags, says):
    """alltoall and flex are what the plan can price (training.expert_dispatcher); Megatron's default,
    allgather, is named with what the plan prices instead."""
    path = tmp_path / "args.txt"
    path.write_text(
        "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --vocab-size 128 --seq-length 32 "
        f"--num-experts 4 --expert-model-parallel-size 2 {flags}\n"
    )
    status, out, _ = run_cli(capsys, "check", str(path), "--devices", "2", "--device-memory", "80GiB")
    assert status == 0, out
    if says is None:
        assert "dispatcher" not in out
        want = "flex" if "flex" in flags or "deepep" in flags else "all_to_all"
        assert imported(path, devices=2)["training"].get("expert_dispatcher", "all_to_all") == want
    else:
        assert "I003" in out and says in out, out


def test_megatron_refuses_a_token_dispatcher_it_does_not_have(tmp_path, capsys):
    path = tmp_path / "args.txt"
    path.write_text(
        "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --vocab-size 128 --seq-length 32 "
        "--num-experts 4 --moe-token-dispatcher-type alltoal\n"
    )
    status, out, _ = run_cli(capsys, "check", str(path), "--devices", "2")
    assert status == 2 and "I004" in out and "`--moe-token-dispatcher-type alltoal` is not a Megatron" in out


def test_megatron_tp_comm_overlap_is_async_tensor_parallelism(tmp_path, capsys):
    path = tmp_path / "args.txt"
    base = (
        "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --vocab-size 128 --seq-length 32 "
        "--tensor-model-parallel-size 2"
    )
    path.write_text(base + " --sequence-parallel --tp-comm-overlap\n")
    assert imported(path, devices=2)["training"]["async_tensor_parallel"] is True
    # Megatron asserts sequence parallelism under the overlap (C010)
    path.write_text(base + " --tp-comm-overlap\n")
    status, out, _ = run_cli(capsys, "check", str(path), "--devices", "2")
    assert status == 1 and "C010" in out


def test_megatron_virtual_stages_from_layers_per_virtual_stage(tmp_path):
    path = tmp_path / "args.txt"
    path.write_text(
        "--num-layers 16 --hidden-size 64 --num-attention-heads 4 --vocab-size 128 "
        "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2 --global-batch-size 8\n"
    )
    data = imported(path, devices=2)
    assert (
        data["training"]["virtual_pipeline_stages"] == 4 and data["training"]["pipeline_schedule"] == "interleaved_1f1b"
    )
    assert data["mesh"]["microbatches"] == 8
    # its transfers overlap by default (overlap_p2p_comm); --no-overlap-p2p-communication turns that off
    assert "overlap_pipeline_transfers" not in data["training"]
    path.write_text(path.read_text().strip() + " --no-overlap-p2p-communication\n")
    assert imported(path, devices=2)["training"]["overlap_pipeline_transfers"] is False


# --------------------------------------------------------------------------- the shell reader


def test_the_shell_reader_runs_the_subset_launch_scripts_use():
    script = """\
A=${UNSET:-4}
B=$((A * 2))
ARGS=(
    --one $A \\
    --two "$B"   # a comment
)
if [[ "$A" == "4" ]] || [ -z "$NOPE" ]; then
    ARGS+=(--three)
else
    ARGS+=(--never)
fi
case $1 in
    x) A=99 ;;
esac
torchrun --nproc_per_node $B pretrain_gpt.py ${ARGS[@]} \\
    --four 'lit eral'
"""
    run = Shell().execute(script)
    words = [w.text for w in run.commands[-1]]
    assert words == [
        "torchrun",
        "--nproc_per_node",
        "8",
        "pretrain_gpt.py",
        "--one",
        "4",
        "--two",
        "8",
        "--three",
        "--four",
        "lit eral",
    ]
    assert run.scalars["A"].text == "4" and run.skipped
    two = next(w for w in run.commands[-1] if w.text == "--two")
    assert (two.pos.line, two.pos.column) == (5, 5)


# --------------------------------------------------------------------------- DeepSpeed

DEEPSPEED = {
    # file: (options, mesh, training)
    "bingbertsquad_bsz24.json": (
        {"devices": 8},
        {"dp_replicate": 8, "gradient_accumulation_steps": 1},
        {"global_batch_size": 24, "micro_batch_size": 3, "precision": "fp16", "optimizer": "adam"},
    ),
    "compression_gpt2.json": (
        {"devices": 2},
        {"dp_replicate": 2, "gradient_accumulation_steps": 1},
        {"global_batch_size": 8, "micro_batch_size": 4, "precision": "fp16", "learning_rate": 0.001},
    ),
    "zenflow_finetuning.json": (
        {"devices": 8},
        {"dp_replicate": 8, "gradient_accumulation_steps": 1},
        {"global_batch_size": 8, "micro_batch_size": 1, "precision": "bf16", "distributed_optimizer": True},
    ),
    "bing_bert_bsz4k_01adam_seq128.json": (
        {"devices": 64},
        {"dp_replicate": 64, "gradient_accumulation_steps": 4},
        {"global_batch_size": 4096, "micro_batch_size": 16, "precision": "fp16"},
    ),
    "pipeline_parallelism.json": (
        {"devices": 4},
        {"dp_replicate": 4, "gradient_accumulation_steps": 8},
        {"global_batch_size": 256, "micro_batch_size": 8, "precision": "fp32"},
    ),
    "imagenet_fp16_z1.json": (
        {"devices": 8},
        {"dp_replicate": 8, "gradient_accumulation_steps": 1},
        {"global_batch_size": 256, "micro_batch_size": 32, "distributed_optimizer": True},
    ),
    "bf16_master_weight_full.json": (
        {"devices": 8},
        {"dp_shard": 8, "gradient_accumulation_steps": 1},
        {"global_batch_size": 32, "micro_batch_size": 4, "precision": "bf16", "optimizer": "adamw"},
    ),
}


@pytest.mark.parametrize("name", sorted(DEEPSPEED))
def test_each_deepspeed_config_imports_with_its_batch_and_zero_stage(name):
    """deepspeedai/DeepSpeedExamples configs (sources in tests/corpus/importers/deepspeed/SOURCES.md)."""
    options, mesh, training = DEEPSPEED[name]
    data = imported(DS / name, model=LLAMA, seq_len=2048, **options)
    assert subset(data, {"mesh": mesh, "training": training}) == {"mesh": mesh, "training": training}
    assert data["model"]["hidden_size"] == 4096 and data["backend"] == "deepspeed"
    Spec.model_validate(data)


def test_deepspeed_world_size_follows_from_the_three_batch_sizes(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "train_batch_size": 96,
                "train_micro_batch_size_per_gpu": 3,
                "gradient_accumulation_steps": 2,
                "zero_optimization": {"stage": 3},
                "bf16": {"enabled": True},
            }
        )
    )
    data = imported(path, model=LLAMA, seq_len=1024)
    assert data["resources"]["devices"] == 16 and data["mesh"]["dp_shard"] == 16


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 8),
    st.integers(1, 8),
    st.integers(1, 16),
    st.sampled_from(["tbs+mbs", "tbs+gas", "mbs+gas", "tbs", "mbs"]),
)
def test_deepspeed_batch_identity_holds_for_every_pair_given(tmp_path_factory, mbs, gas, dp, given_):
    """train_batch_size = micro * accumulation * dp, whichever of them the config leaves out."""
    full = {
        "train_batch_size": mbs * gas * dp,
        "train_micro_batch_size_per_gpu": mbs,
        "gradient_accumulation_steps": gas,
    }
    keep = {
        "tbs+mbs": ("train_batch_size", "train_micro_batch_size_per_gpu"),
        "tbs+gas": ("train_batch_size", "gradient_accumulation_steps"),
        "mbs+gas": ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"),
        "tbs": ("train_batch_size",),
        "mbs": ("train_micro_batch_size_per_gpu",),
    }[given_]
    path = tmp_path_factory.mktemp("ds") / "ds.json"
    path.write_text(json.dumps({k: full[k] for k in keep}))
    data = imported(path, model=LLAMA, seq_len=128, devices=dp)
    t, m = data["training"], data["mesh"]
    assert t["global_batch_size"] == t["micro_batch_size"] * m["gradient_accumulation_steps"] * dp
    for key, field in (
        ("train_batch_size", t["global_batch_size"]),
        ("train_micro_batch_size_per_gpu", t["micro_batch_size"]),
        ("gradient_accumulation_steps", m["gradient_accumulation_steps"]),
    ):
        if key in keep:
            assert field == full[key]


def test_deepspeed_refusals(capsys, tmp_path):
    status, out, _ = run_cli(capsys, "check", DS / "hf_integration_tp_auto.json", "--model", LLAMA)
    assert status == 2 and out.count("I004") == 3 and '"auto"' in out and "S006" not in out
    status, out, _ = run_cli(capsys, "check", DS / "bingbertsquad_bsz24.json")
    assert status == 2 and "--model config.json" in out
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1})
    )
    status, out, _ = run_cli(capsys, "check", path, "--model", LLAMA)
    assert status == 2 and "micro * accumulation * dp" in out


def test_deepspeed_ulysses_counts_data_parallel_ranks_and_is_refused_by_name(capsys, tmp_path):
    """deepspeed/runtime/config.py (0.19.8) DeepSpeedConfig: world = dist.get_world_size() /
    config["sequence_parallel_size"] before train = micro * accumulation * world is asserted.
    DeepSpeedExamples' benchmarks/autosp/configs/autosp_config.json runs on 2 GPUs with sp 2."""
    path = tmp_path / "autosp.json"
    config = {
        "train_batch_size": 1,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "sequence_parallel_size": 2,
        "zero_optimization": {"stage": 0},
        "bf16": {"enabled": True},
    }
    path.write_text(json.dumps(config, indent=2))
    for extra in ((), ("--devices", "2")):
        status, out, _ = run_cli(capsys, "check", path, "--model", LLAMA, "--seq-len", "64", *extra)
        assert status == 2 and "identity" not in out, out
        assert "I004 `sequence_parallel_size` 2 is DeepSpeed-Ulysses" in out and f"{path}:5:" in out
        # without --devices: the batch sizes' 1 data-parallel rank times sp 2
        assert "here 1 data-parallel rank of 2 devices" in out and "--devices 1" in out and "I002" not in out
    # On 8 devices, 4 data-parallel ranks: an identity that holds there is not refused as one.
    path.write_text(json.dumps({**config, "train_batch_size": 4}))
    status, out, _ = run_cli(capsys, "check", path, "--model", LLAMA, "--seq-len", "64", "--devices", "8")
    assert status == 2 and "identity" not in out and "here 4 data-parallel ranks of 8 devices" in out
    status, out, _ = run_cli(capsys, "check", path, "--model", LLAMA, "--seq-len", "64", "--devices", "4")
    assert "identity" in out and "on 2 data-parallel ranks (4 devices / sequence_parallel_size 2)" in out
    status, out, _ = run_cli(capsys, "check", path, "--model", LLAMA, "--seq-len", "64", "--devices", "3")
    assert status == 2 and "does not divide the 3 devices" in out
    path.write_text(json.dumps({**config, "sequence_parallel_size": "two"}))
    status, out, _ = run_cli(capsys, "check", path, "--model", LLAMA, "--seq-len", "64")
    assert status == 2 and "`sequence_parallel_size` must be a positive integer" in out
    # sequence_parallel_size 1 is no sequence parallelism: read, not named.
    path.write_text(json.dumps({**config, "sequence_parallel_size": 1}))
    status, out, _ = run_cli(capsys, "check", path, "--model", LLAMA, "--seq-len", "64", "--devices", "1")
    assert "sequence_parallel_size" not in out and "I004" not in out, out


def test_deepspeed_unmodelled_keys_are_named(capsys):
    status, out, _ = run_cli(
        capsys, "check", DS / "zenflow_finetuning.json", "--model", LLAMA, "--devices", "8", "--seq-len", "512"
    )
    assert "zero_optimization.offload_optimizer" in out and "zero_optimization.zenflow" in out and "I002" in out


# --------------------------------------------------------------------------- HF config.json


@pytest.mark.parametrize(
    "name, expected",
    [
        (
            "llama-3.1-8b.json",
            {
                "vocab_size": 128256,
                "hidden_size": 4096,
                "num_layers": 32,
                "num_heads": 32,
                "num_kv_heads": 8,
                "ffn_hidden_size": 14336,
                "tie_embeddings": False,
                "activation": "swiglu",
                "norm": "rmsnorm",
            },
        ),
        (
            "mixtral-8x7b-v0.1.json",
            {"num_experts": 8, "experts_per_token": 2, "moe_ffn_hidden_size": 14336, "vocab_size": 32000},
        ),
        (
            "qwen3-30b-a3b.json",
            {
                "num_experts": 128,
                "experts_per_token": 8,
                "moe_ffn_hidden_size": 768,
                "head_dim": 128,
                "num_kv_heads": 4,
                "moe_layer_frequency": 1,
            },
        ),
        (
            "qwen1.5-moe-a2.7b.json",
            {
                "num_experts": 60,
                "experts_per_token": 4,
                "moe_ffn_hidden_size": 1408,
                "ffn_hidden_size": 5632,
                "moe_shared_expert_hidden_size": 5632,
                "moe_shared_expert_gate": True,
            },
        ),
        (
            "llama-4-scout-17b-16e.json",
            {
                "num_experts": 16,
                "experts_per_token": 1,
                "ffn_hidden_size": 16384,
                "moe_ffn_hidden_size": 8192,
                "moe_shared_expert_hidden_size": 8192,
                "moe_shared_expert_gate": False,
                "moe_first_layer": 0,
                "moe_layer_frequency": 1,
                "head_dim": 128,
            },
        ),
        (
            "llama-4-maverick-17b-128e-text.json",
            {"num_experts": 128, "moe_first_layer": 1, "moe_layer_frequency": 2, "ffn_hidden_size": 16384},
        ),
        (
            "gpt-neox-20b.json",
            {
                "hidden_size": 6144,
                "num_layers": 44,
                "num_heads": 64,
                "ffn_hidden_size": 24576,
                "norm": "layernorm",
                "activation": "gelu",
                "vocab_size": 50432,
            },
        ),
    ],
)
def test_a_spec_takes_its_model_from_an_hf_config(write, tmp_path, name, expected):
    (tmp_path / "config.json").write_text((HF / name).read_text())
    path = write("""\
        model: {from: hf, path: config.json}
        mesh: {dp_shard: 8}
        training: {global_batch_size: 8, seq_len: 128}
        backend: torch
        resources: {devices: 8, memory: 141GB}
        """)
    loaded = load_spec(path)
    assert loaded.spec is not None, [d.text() for d in loaded.diagnostics]
    assert {k: getattr(loaded.spec.model, k) for k in expected} == expected


def test_llama4_reads_its_language_model_and_names_what_it_leaves_out(write, tmp_path, capsys):
    (tmp_path / "config.json").write_text((HF / "llama-4-scout-17b-16e.json").read_text())
    path = write(
        "model: {from: hf, path: config.json}\nmesh: {dp_shard: 8}\ntraining: {global_batch_size: 8, seq_len: 128}\n"
        "backend: torch\nresources: {devices: 8, memory: 141GB}\n"
    )
    loaded = load_spec(path)
    ignored = sorted(d.message.split("`")[1] for d in loaded.diagnostics if d.code == "I002")
    assert ignored == ["attention_chunk_size", "vision_config"]  # chunked attention, and the vision encoder
    # an absent chunk size is the class's 8192 (named); null is full attention (nothing left out)
    data = json.loads((HF / "llama-4-maverick-17b-128e-text.json").read_text())
    for value, named in ((None, False), ("absent", True)):
        if value == "absent":
            data.pop("attention_chunk_size")
        else:
            data["attention_chunk_size"] = value
        (tmp_path / "config.json").write_text(json.dumps(data))
        named_now = [d for d in load_spec(path).diagnostics if d.code == "I002" and "attention_chunk_size" in d.message]
        assert bool(named_now) == named
    # a listed moe_layers overrides the step; one that is not dense layers then every k-th is refused
    data = json.loads((HF / "llama-4-maverick-17b-128e-text.json").read_text())
    for layers, want in (([3, 5, 7, 9], None), ([0, 1, 5], "not dense layers first")):
        data["num_hidden_layers"] = 10
        data["moe_layers"] = layers
        (tmp_path / "config.json").write_text(json.dumps(data))
        loaded = load_spec(path)
        if want is None:
            assert (loaded.spec.model.moe_first_layer, loaded.spec.model.moe_layer_frequency) == (3, 2)
        else:
            assert loaded.spec is None and any(want in d.message for d in loaded.diagnostics)
    data["text_config"] = None
    data["model_type"] = "llama4"
    (tmp_path / "config.json").write_text(json.dumps(data))
    status, out, _ = run_cli(capsys, "check", path)
    assert status == 1 and "I004" in out and "under `text_config`" in out


def test_an_hf_architecture_outside_the_family_is_refused_by_name(write, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "hidden_size": 8}))
    path = write(
        "model: {from: hf, path: config.json}\nmesh: {}\ntraining: {global_batch_size: 1, seq_len: 8}\n"
        "backend: torch\nresources: {devices: 1, memory: 1GiB}\n"
    )
    status, out, _ = run_cli(capsys, "check", path)
    assert status == 1 and "I004" in out and "'mamba'" in out and "llama" in out and f"{path}:1:" in out
    # only why: not the fields the refused file left unfilled
    assert "S006" not in out and "vocab_size" not in out


# --------------------------------------------------------------------------- start-up


def test_checking_an_engine_config_imports_no_torch():
    code = (
        "import sys; from mixle_compile.cli import main; "
        f"main(['check', {str(TT / 'llama3_8b.toml')!r}]); "
        f"main(['check', {str(MG / 'train_llama3_8b_h100_fp8.sh')!r}]); "
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.splitlines()[-1] == "NO-TORCH"


def test_reading_never_raises_for_a_bad_engine_file(tmp_path):
    for name, text in (
        ("a.toml", "[model]\nname = 3\n[parallelism]\ntensor_parallel_degree = 'x'\n"),
        ("a.sh", "torchrun pretrain_gpt.py --num-layers x --hidden-size\n"),
        ("a.json", '{"train_batch_size": -1}'),
    ):
        path = tmp_path / name
        path.write_text(text)
        try:
            read_any(path, name, ImportOptions(model=LLAMA))
        except SourceError as exc:
            assert exc.diagnostics


# --------------------------------------------------------------------------- torchtitan 0.3 Python configs

REGISTRY_MODULE = """\
from types import SimpleNamespace

from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC


def llama3_70b_async_tp():
    return SimpleNamespace(
        model_spec=SimpleNamespace(name="llama3", flavor="70B"),
        training=TrainingConfig(local_batch_size=4, seq_len=8192, steps=100),
        parallelism=ParallelismConfig(tensor_parallel_degree=8),
        compile=CompileConfig(enable=True, enable_async_tensor_parallel=True),
        activation_checkpoint=FullAC.Config(),
        optimizer=SimpleNamespace(lr=1e-4),
    )


def llama3_70b_tp8():
    return SimpleNamespace(
        model_spec=SimpleNamespace(name="llama3", flavor="70B"),
        training=TrainingConfig(
            local_batch_size=4,
            seq_len=8192,
            steps=100,
        ),
        parallelism=ParallelismConfig(
            tensor_parallel_degree=8,
            pipeline_parallel_degree=2,
            pipeline_parallel_schedule="Interleaved1F1B",
        ),
        activation_checkpoint=FullAC.Config(),
        optimizer=SimpleNamespace(lr=1e-4),
    )


def deepseek_mtp(pipeline=1, loss=True):
    model = SimpleNamespace(mtp_layers=_mtp_layers(num_mtp_layers=2))
    return SimpleNamespace(
        model_spec=SimpleNamespace(name="deepseek_v3", flavor="debugmodel", model=model),
        training=TrainingConfig(local_batch_size=8, seq_len=2048, steps=10),
        parallelism=ParallelismConfig(pipeline_parallel_degree=pipeline),
        activation_checkpoint=FullAC.Config(),
        optimizer=SimpleNamespace(lr=1e-4),
        loss=SimpleNamespace(mtp_scale=0.5) if loss else SimpleNamespace(),
    )


def deepseek_mtp_pp2():
    return deepseek_mtp(pipeline=2)


def deepseek_mtp_plain_loss():
    return deepseek_mtp(loss=False)


def deepseek_mtp_loss_only():
    config = deepseek_mtp()
    config.model_spec.model.mtp_layers = []
    return config


def _mtp_layers(num_mtp_layers):
    return [SimpleNamespace() for _ in range(num_mtp_layers)]


def not_a_config():
    return 3
"""


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A config-registry module built from torchtitan 0.3's own config classes."""
    config = pytest.importorskip("torchtitan.config")
    if not hasattr(config, "ParallelismConfig"):
        pytest.skip("torchtitan before 0.3 has no Python config classes")
    (tmp_path / "my_registry.py").write_text(REGISTRY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_torchtitan_config_function_is_read_through_its_config_classes(registry):
    from mixle_compile.importers.torchtitan_registry import load_registry_function, read_trainer_config

    function, config = load_registry_function("my_registry:llama3_70b_tp8")
    doc, _ = read_trainer_config(function, config, "my_registry:llama3_70b_tp8", ImportOptions(devices=64))
    data = doc.data
    assert data["model"]["hidden_size"] == 8192 and data["model"]["ffn_hidden_size"] == 28672
    assert data["mesh"] == {
        "dp_replicate": 1,
        "tp": 8,
        "pp": 2,
        "cp": 1,
        "ep": 1,
        "etp": 1,
        "dp_shard": "auto",
        "gradient_accumulation_steps": 1,
        "microbatches": 4,
    }
    assert (
        data["training"]["pipeline_schedule"] == "interleaved_1f1b" and data["training"]["virtual_pipeline_stages"] == 2
    )
    assert data["training"]["activation_checkpointing"] == "full" and data["training"]["sequence_parallel"] is True
    assert data["training"]["global_batch_size"] == 4 * 4  # local * dp (64 / (8 * 2))
    assert data["backend"] == {"name": "torchtitan", "version": "0.3"}
    # positions: the line of the function that sets the field
    assert doc.file == "my_registry.py"
    line = doc.position(("mesh", "tp")).line
    assert "tensor_parallel_degree=8" in REGISTRY_MODULE.splitlines()[line - 1]


def test_a_torchtitan_compile_config_states_async_tensor_parallelism(registry):
    from mixle_compile.importers.torchtitan_registry import load_registry_function, read_trainer_config

    function, config = load_registry_function("my_registry:llama3_70b_async_tp")
    doc, _ = read_trainer_config(function, config, "my_registry:llama3_70b_async_tp", ImportOptions(devices=64))
    assert doc.data["training"]["async_tensor_parallel"] is True and doc.data["training"]["compile"] is True
    function, config = load_registry_function("my_registry:llama3_70b_tp8")
    doc, _ = read_trainer_config(function, config, "my_registry:llama3_70b_tp8", ImportOptions(devices=64))
    assert doc.data["training"].get("async_tensor_parallel", False) is False


def test_check_torchtitan_module_function(registry, capsys):
    status, out, _ = run_cli(capsys, "check", "--torchtitan", "my_registry:llama3_70b_tp8", "--devices", "64")
    assert status in (0, 1) and "my_registry.py:" in out and "S0" not in out
    assert "P008" in out  # 4 micro-batches over 2 stages; the working directory's configuration can ignore it
    (registry / "mixle-compile.toml").write_text('ignore = ["P008"]\n')
    assert "P008" not in run_cli(capsys, "check", "--torchtitan", "my_registry:llama3_70b_tp8", "--devices", "64")[1]
    (registry / "mixle-compile.toml").unlink()
    status, out, _ = run_cli(capsys, "check", "--torchtitan", "my_registry:not_a_config")
    assert status == 2 and "not a torchtitan Trainer.Config" in out
    status, out, _ = run_cli(capsys, "check", "--torchtitan", "no_such_module:f")
    assert status == 2 and "cannot import no_such_module" in out
    status, out, _ = run_cli(capsys, "check")
    assert status == 2


def test_a_torchtitan_config_functions_mtp_layers_and_loss_weight_are_read(registry, capsys):
    """torchtitan 0.3's deepseek_v3 model config lists its multi-token prediction layers in mtp_layers
    (model_registry(flavor, num_mtp_layers=N)) and MTPLoss.Config carries their loss weight (mtp_scale):
    model.mtp_num_layers and training.mtp_loss_scaling_factor. torchtitan refuses MTP under a pipeline, and a
    model with MTP layers needs MTPLoss (I005)."""
    from mixle_compile.importers.torchtitan_registry import load_registry_function, read_trainer_config

    function, config = load_registry_function("my_registry:deepseek_mtp")
    doc, diags = read_trainer_config(function, config, "my_registry:deepseek_mtp", ImportOptions(devices=8))
    assert not [d for d in diags if d.severity.value == "error"], [d.text() for d in diags]
    spec = Spec.model_validate(doc.data)
    assert spec.model.mtp_num_layers == 2 and spec.training.mtp_loss_scaling_factor == 0.5
    assert spec.model.kv_lora_rank == 512  # the debugmodel flavor's sizes, from the table
    line = doc.position(("model", "mtp_num_layers")).line
    assert "num_mtp_layers=2" in REGISTRY_MODULE.splitlines()[line - 1]
    for target, says in (
        ("my_registry:deepseek_mtp_pp2", "refuses multi-token prediction with parallelism.pipeline_parallel_degree 2"),
        ("my_registry:deepseek_mtp_plain_loss", "the loss is not MTPLoss"),
        ("my_registry:deepseek_mtp_loss_only", "the loss is MTPLoss, and the model has no multi-token prediction"),
    ):
        status, out, err = run_cli(capsys, "check", "--torchtitan", target, "--devices", "8")
        assert status == 2 and "I005" in out and says in out, out  # check --torchtitan stops at a config's error
        assert "Traceback" not in out + err


def test_torchtitans_own_mtp_config_function_reads_with_its_mtp_layer():
    """torchtitan 0.3.0's deepseek_v3_debugmodel_mtp (config_registry.py: model_registry("debugmodel",
    num_mtp_layers=1), MTPLoss.Config's default mtp_scale 0.3), where its model registry imports."""
    from mixle_compile.importers.torchtitan_registry import load_registry_function, read_trainer_config

    module = "torchtitan.models.deepseek_v3.config_registry"
    try:
        importlib.import_module(module)
    except ImportError as exc:
        pytest.skip(f"torchtitan's deepseek_v3 registry does not import here: {exc}")
    for function, layers, factor in (("deepseek_v3_debugmodel_mtp", 1, 0.3), ("deepseek_v3_debugmodel", 0, None)):
        fn, config = load_registry_function(f"{module}:{function}")
        doc, _ = read_trainer_config(fn, config, f"{module}:{function}", ImportOptions(devices=8))
        spec = Spec.model_validate(doc.data)
        assert (spec.model.mtp_num_layers, spec.training.mtp_loss_scaling_factor) == (layers, factor), function
        assert len(getattr(config.model_spec.model, "mtp_layers", [])) == layers


def test_a_config_functions_findings_without_a_key_are_at_its_def(registry, capsys):
    """docs/importers.md: the findings of a 0.3 config function point at the function, not the module's
    first line (torchtitan's config_registry.py modules define a dozen functions)."""
    line = REGISTRY_MODULE.splitlines().index("def llama3_70b_tp8():") + 1
    status, out, _ = run_cli(capsys, "check", "--torchtitan", "my_registry:llama3_70b_tp8")
    found = [f for f in out.splitlines() if "my_registry.py:" in f and not f.startswith(" ")]
    assert found and not any("my_registry.py:1:1:" in f for f in found), out
    assert f"my_registry.py:{line}:1: I003 (warning) a torchtitan job config does not say how many devices" in out


@pytest.mark.parametrize(
    "module, function, flavor",
    [
        ("llama3", "llama3_debugmodel", "debugmodel"),
        ("llama3", "llama3_8b", "8B"),
        ("llama3", "llama3_70b", "70B"),
        ("qwen3", "qwen3_0_6b", "0.6B"),
        ("qwen3", "qwen3_1_7b", "1.7B"),
        ("qwen3", "qwen3_32b", "32B"),
    ],
)
def test_torchtitan_own_config_registry(module, function, flavor, capsys):
    """torchtitan 0.3.0's own config_registry functions, where torchtitan and its dependencies import: the degrees
    and batch come from its ParallelismConfig and TrainingConfig, the sizes from its model config, and they agree
    with the flavor table transcribed from the TOML era."""
    from mixle_compile.importers import flavors
    from mixle_compile.importers.torchtitan_registry import load_registry_function, read_trainer_config

    target = f"torchtitan.models.{module}.config_registry:{function}"
    try:
        importlib.import_module(f"torchtitan.models.{module}.config_registry")
    except ImportError as exc:  # its model code needs triton and its trainer torchdata, tensorboard, datasets
        pytest.skip(f"torchtitan's model registry does not import here: {exc}")
    fn, config = load_registry_function(target)
    doc, _ = read_trainer_config(fn, config, target, ImportOptions(devices=64))
    data = doc.data
    p, t = config.parallelism, config.training
    assert (data["mesh"]["tp"], data["mesh"]["pp"], data["mesh"]["cp"]) == (
        p.tensor_parallel_degree,
        p.pipeline_parallel_degree,
        p.context_parallel_degree,
    )
    assert data["training"]["seq_len"] == t.seq_len and data["model"]["hidden_size"] == config.model_spec.model.dim
    assert data["backend"] == {"name": "torchtitan", "version": "0.3"}
    table = dict(flavors.flavor(module, flavor).model)
    ours = dict(data["model"])
    for m in (table, ours):  # an explicit head size equal to hidden / heads is the default
        m["head_dim"] = m.get("head_dim") or m["hidden_size"] // m["num_heads"]
    assert {k: ours.get(k) for k in table} == table
    status, out, _ = run_cli(capsys, "check", "--torchtitan", target, "--devices", "64")
    assert status in (0, 1) and "I004" not in out and "S0" not in out


@pytest.mark.parametrize("name", sorted(n for n in TORCHTITAN if not n.startswith("old_2024")))
def test_torchtitan_config_manager_reads_the_corpus_tomls_as_we_do(name):
    """torchtitan 0.2.2's own ConfigManager (where that release is installed) and the importer agree on every
    degree, batch size and sequence length of the real train configs."""
    try:
        from torchtitan.config.manager import ConfigManager
    except ImportError:
        pytest.skip("torchtitan is not installed")
    if not hasattr(ConfigManager, "_maybe_load_toml"):
        pytest.skip("torchtitan's TOML ConfigManager (0.2.x) is not installed")
    job = ConfigManager().parse_args(["--job.config_file", str(TT / name)])
    data = imported(TT / name)
    p, mesh, t = job.parallelism, data["mesh"], data["training"]
    assert (mesh["dp_replicate"], mesh["dp_shard"], mesh["tp"], mesh["pp"], mesh["cp"], mesh["ep"], mesh["etp"]) == (
        p.data_parallel_replicate_degree,
        "auto" if p.data_parallel_shard_degree == -1 else p.data_parallel_shard_degree,
        p.tensor_parallel_degree,
        p.pipeline_parallel_degree,
        p.context_parallel_degree,
        p.expert_parallel_degree,
        p.expert_tensor_parallel_degree,
    )
    assert t["seq_len"] == job.training.seq_len and t["activation_checkpointing"] == job.activation_checkpoint.mode
    assert t["micro_batch_size"] * mesh.get("microbatches", 1) == job.training.local_batch_size
    assert (t["precision"] == "fp8") == ("float8" in job.model.converters)


def deepspeed_config(path, dp: int, monkeypatch):
    """DeepSpeed's own DeepSpeedConfig on ``dp`` data-parallel ranks (no process group: its rank is faked)."""
    try:
        from deepspeed.runtime import config as ds_config
    except ImportError:
        pytest.skip("deepspeed is not installed")
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *args, **kwargs: 0)

    class DataParallel:  # the mpu DeepSpeedConfig asks for the data-parallel world size
        def get_data_parallel_world_size(self):
            return dp

    return ds_config.DeepSpeedConfig(str(path), mpu=DataParallel())


@pytest.mark.parametrize("name", sorted(DEEPSPEED))
def test_deepspeed_config_class_reads_the_corpus_configs_as_we_do(name, monkeypatch):
    """DeepSpeed's DeepSpeedConfig (where deepspeed installs) derives the same batch sizes and ZeRO stage."""
    options, mesh, _ = DEEPSPEED[name]
    ds = deepspeed_config(DS / name, options["devices"], monkeypatch)
    data = imported(DS / name, model=LLAMA, seq_len=2048, **options)
    assert (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (
        data["training"]["global_batch_size"],
        data["training"]["micro_batch_size"],
        data["mesh"]["gradient_accumulation_steps"],
    )
    assert ds.zero_optimization_stage in ({3} if "dp_shard" in mesh else {0, 1, 2})
    precision = "bf16" if ds.bfloat16_config.enabled else "fp16" if ds.float16_config.enabled else "fp32"
    assert precision == data["training"]["precision"]


def test_deepspeed_config_class_counts_ulysses_ranks_as_we_do(monkeypatch, tmp_path, capsys):
    """DeepSpeedConfig without an mpu divides the world by sequence_parallel_size before its batch assertion."""
    try:
        from deepspeed.runtime import config as ds_config
    except ImportError:
        pytest.skip("deepspeed is not installed")
    config = {
        "train_batch_size": 2,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "sequence_parallel_size": 2,
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *args, **kwargs: 0)
    for world, holds in ((4, True), (2, False)):
        monkeypatch.setattr(ds_config.dist, "get_world_size", lambda *args, w=world, **kwargs: w)
        try:
            ds_config.DeepSpeedConfig(dict(config))  # asserts train == micro * accumulation * world / sp
            engine_holds = True
        except AssertionError:
            engine_holds = False
        _, out, _ = run_cli(capsys, "check", path, "--model", LLAMA, "--seq-len", "64", "--devices", world)
        assert engine_holds is holds and ("identity" not in out) is holds, (world, out)


def test_megatron_uneven_pipeline_split(tmp_path):
    path = tmp_path / "args.txt"
    path.write_text(
        "--num-layers 12 --hidden-size 64 --num-attention-heads 4 --vocab-size 128 --pipeline-model-parallel-size 4 "
        "--decoder-first-pipeline-num-layers 2 --decoder-last-pipeline-num-layers 2 --global-batch-size 8\n"
    )
    assert imported(path, devices=4)["training"]["pipeline_layers"] == [2, 4, 4, 2]
    # With virtual stages the first and last ranks' layers are over all their chunks (Megatron-Core's
    # get_num_layers_to_build): 2 + 2 + 8 middle layers, each rank's in 2 chunks.
    path.write_text(
        "--num-layers 12 --hidden-size 64 --num-attention-heads 4 --vocab-size 128 --pipeline-model-parallel-size 4 "
        "--num-virtual-stages-per-pipeline-rank 2 "
        "--decoder-first-pipeline-num-layers 2 --decoder-last-pipeline-num-layers 2 --global-batch-size 8\n"
    )
    assert imported(path, devices=4)["training"]["pipeline_layers"] == [1, 2, 2, 1, 1, 2, 2, 1]
    path.write_text(
        "--num-layers 12 --hidden-size 64 --num-attention-heads 4 --vocab-size 128 --pipeline-model-parallel-size 4 "
        "--decoder-first-pipeline-num-layers 4 --global-batch-size 8 --use-megatron-fsdp\n"
    )
    with pytest.raises(SourceError) as info:
        imported(path, devices=4)
    assert "first 4" in info.value.diagnostics[-1].message


def test_compile_diff_and_suggest_take_engine_configs(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    status, _, _ = run_cli(capsys, "compile", TT / "llama3_8b.toml", "-o", plan)
    assert status == 0 and json.loads(plan.read_text())["format_version"]
    changed = tmp_path / "llama3_8b_tp2.toml"
    changed.write_text(
        (TT / "llama3_8b.toml").read_text().replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 2")
    )
    status, out, _ = run_cli(capsys, "diff", "--exit-code", TT / "llama3_8b.toml", changed)
    assert status == 1 and "tp" in out
    fixed = tmp_path / "fixed_shard.toml"
    fixed.write_text(
        (TT / "llama3_8b.toml")
        .read_text()
        .replace("data_parallel_shard_degree = -1", "data_parallel_shard_degree = 8")
        .replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 2")
    )
    status, out, _ = run_cli(capsys, "check", "--suggest", fixed, "--devices", "8")
    assert status == 1 and "D001" in out and "valid plan on the same 8 devices" in out


def _line_of(path, needle: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), start=1) if line.lstrip().startswith(needle))


@pytest.mark.parametrize("name, table", [("llama3_8b.toml", "parallelism"), ("old_2024_llama3_8b.toml", "training")])
def test_suggest_on_a_torchtitan_toml_names_its_keys_at_their_lines(tmp_path, capsys, name, table):
    """The fix is said as the TOML's own key, in the table this layout keeps it in, at the line it is written."""
    path = tmp_path / name
    path.write_text(
        (TT / name)
        .read_text()
        .replace("data_parallel_shard_degree = -1", "data_parallel_shard_degree = 8")
        .replace("\ntensor_parallel_degree = 1", "\ntensor_parallel_degree = 2")
    )
    status, out, _ = run_cli(capsys, "check", "--suggest", path, "--devices", "8")
    line = _line_of(path, "tensor_parallel_degree")
    assert status == 1
    assert f"{path}:{line}:26: set [{table}] tensor_parallel_degree = 1  (was 2)" in out
    assert "mesh:\n" not in out and "# (spec fields: mesh.tp)" in out
    status, out, _ = run_cli(capsys, "check", "--suggest", "--format", "json", path, "--devices", "8")
    suggestion = next(f["fix"] for f in json.loads(out) if f["fix"])  # every error of the file carries its fix
    assert suggestion["engine_changes"] == [
        {
            "key": f"{table}.tensor_parallel_degree",
            "action": "set",
            "value": 1,
            "was": 2,
            "line": line,
            "column": 26,
            "edit": f"set [{table}] tensor_parallel_degree = 1  (was 2)",
        }
    ]


def test_suggest_on_a_megatron_script_names_its_flags(tmp_path, capsys):
    """A degree set through a variable is fixed where the variable is assigned; etp, which follows tp when not
    written (validate_args), and the vocabulary padding (a model size) are not part of the fix."""
    path = tmp_path / "train.sh"
    path.write_text(
        "#!/bin/bash\nTP=3\ntorchrun --nproc_per_node 8 pretrain_gpt.py \\\n"
        "    --num-layers 12 --hidden-size 768 --num-attention-heads 12 \\\n"
        "    --seq-length 1024 --max-position-embeddings 1024 --vocab-size 50304 \\\n"
        "    --micro-batch-size 4 --global-batch-size 64 \\\n"
        "    --tensor-model-parallel-size $TP --bf16\n"
    )
    status, out, _ = run_cli(capsys, "check", "--suggest", "--format", "json", path)
    assert status == 1
    suggestion = next(f["fix"] for f in json.loads(out) if f["fix"])  # every error of the file carries its fix
    changes = {c["key"]: c for c in suggestion["engine_changes"]}
    tp = changes["--tensor-model-parallel-size"]
    assert (tp["action"], tp["was"], tp["line"], tp["column"]) == ("set", "3", 2, 4) and tp["value"] in ("2", "4")
    assert "--make-vocab-size-divisible-by" not in changes
    # Several plans are equally near (tp 4 with etp 4 or 2, tp 2 with etp 2): etp is added only when it differs from tp.
    etp = suggestion["changes"].get("mesh.etp")
    if etp == tp["value"]:
        assert "--expert-tensor-parallel-size" not in changes
    else:
        assert changes["--expert-tensor-parallel-size"]["action"] == "add"
    status, out, _ = run_cli(capsys, "check", "--suggest", path)
    assert f"{path}:2:4: set --tensor-model-parallel-size {tp['value']}  (was 3)" in out and "\nmesh:\n" not in out
    # Given the fix tp 4 and etp 4, the flag for etp is not written: it follows tp.
    from mixle_compile.importers.suggest import engine_patch
    from mixle_compile.verify.facts import Field
    from mixle_compile.verify.suggest import Change, Suggestion

    loaded = load_spec(path)
    both = Suggestion((Change(Field("tp", ("mesh", "tp"), 3), 4), Change(Field("etp", ("mesh", "etp"), 3), 4)), 8, True)
    assert [c.key for c in engine_patch(loaded.spec, both, loaded.document).changes] == ["--tensor-model-parallel-size"]
    apart = Suggestion(
        (Change(Field("tp", ("mesh", "tp"), 3), 4), Change(Field("etp", ("mesh", "etp"), 3), 2)), 8, True
    )
    assert [c.key for c in engine_patch(loaded.spec, apart, loaded.document).changes] == [
        "--tensor-model-parallel-size",
        "--expert-tensor-parallel-size",
    ]
    # A switch the fix turns on is added where the file has none.
    path.write_text(
        "torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 32 --hidden-size 4096 --num-attention-heads 32 "
        "--seq-length 8192 --max-position-embeddings 8192 --vocab-size 128256 --micro-batch-size 4 "
        "--global-batch-size 64 --tensor-model-parallel-size 8 --bf16\n"
    )
    status, out, _ = run_cli(capsys, "check", "--suggest", "--format", "json", path, "--device-memory", "20GiB")
    suggestion = next(f["fix"] for f in json.loads(out) if f["fix"])  # every error of the file carries its fix
    assert suggestion["found"], suggestion
    assert suggestion["engine_changes"]
    # Equally near fixes may set a flag the script writes (--micro-batch-size) or add switches it lacks.
    for change in suggestion["engine_changes"]:
        assert change["key"].startswith("--")
        assert (change["action"] == "add") == (change["line"] is None)
    assert any(c["action"] == "add" for c in suggestion["engine_changes"]) or "--micro-batch-size" in {
        c["key"] for c in suggestion["engine_changes"]
    }


def test_accumulation_steps_of_a_fix_are_said_as_the_engines_batching():
    """Without a pipeline Megatron has only micro-batches and torchtitan only accumulation steps."""
    from mixle_compile.importers.suggest import _engine_consistent

    spec = load_spec(ROOT / "examples" / "llama3-8b-hsdp-tp.yaml").spec
    data = spec.model_dump(mode="json", exclude_none=True)
    data["mesh"].update(gradient_accumulation_steps=2, microbatches=2, pp=1)
    fixed = Spec.model_validate(data)
    megatron, torchtitan = _engine_consistent(spec, fixed, "megatron"), _engine_consistent(spec, fixed, "torchtitan")
    assert (megatron.mesh.microbatches, megatron.mesh.gradient_accumulation_steps) == (4, 1)
    assert (torchtitan.mesh.microbatches, torchtitan.mesh.gradient_accumulation_steps) == (1, 4)


def test_suggest_on_a_deepspeed_config_names_its_json_path(tmp_path, capsys):
    path = tmp_path / "ds_config.json"
    path.write_text(
        '{\n  "train_batch_size": 64,\n  "train_micro_batch_size_per_gpu": 1,\n  "gradient_accumulation_steps": 8,\n'
        '  "zero_optimization": {"stage": 0},\n  "bf16": {"enabled": true}\n}\n'
    )
    status, out, _ = run_cli(capsys, "check", "--suggest", path, "--model", LLAMA, "--seq-len", "1024")
    assert status == 1
    assert f'{path}:5:34: set "zero_optimization.stage": 1  (was 0)' in out
    assert "# (spec fields: training.distributed_optimizer)" in out


def test_hints_on_engine_configs_name_the_keys_of_the_fields(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text(
        (TT / "llama3_8b.toml")
        .read_text()
        .replace("data_parallel_shard_degree = -1", "data_parallel_shard_degree = 8")
        .replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 2")
    )
    status, out, _ = run_cli(capsys, "check", path, "--devices", "8")
    assert status == 1
    assert (
        "(in this file: mesh.dp_shard <- parallelism.data_parallel_shard_degree; "
        "mesh.tp <- parallelism.tensor_parallel_degree)"
    ) in out


MEGATRON_TAIL = (
    "torchrun --nproc_per_node 8 pretrain_gpt.py ${MODEL_ARGS[@]} --seq-length 1024 --max-position-embeddings 1024 "
    "--vocab-size 50304 --micro-batch-size 4 --global-batch-size 64 --tensor-model-parallel-size $TP\n"
)


def _diagnostics(path, **options):
    from mixle_compile.spec.source import SourceError

    try:
        return read_any(path, str(path), ImportOptions(**options))
    except SourceError as exc:
        return None, exc.diagnostics


def test_a_sourced_file_is_read_next_to_the_script_with_its_own_positions(tmp_path, monkeypatch):
    """`source conf/model.sh` is found next to the script even when run from elsewhere; its values keep their
    positions in that file, and `$(dirname $0)` is the sourcing file's directory."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "model.sh").write_text(
        "# sizes\nMODEL_ARGS=(\n  --num-layers 12\n  --hidden-size 768 --num-attention-heads 12\n)\n"
        ". $(dirname $0)/parallel.sh\n"
    )
    (tmp_path / "conf" / "parallel.sh").write_text("TP=3\n")
    script = tmp_path / "launch.sh"
    script.write_text("#!/bin/bash\nsource conf/model.sh\n" + MEGATRON_TAIL)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    doc, diags = read_any(script, str(script), ImportOptions(device_memory="80GiB"))
    assert doc.data["model"]["num_layers"] == 12 and doc.data["mesh"]["tp"] == 3
    pos = doc.values[("model", "num_layers")]
    assert (pos.file, pos.line, pos.column) == (str(tmp_path / "conf" / "model.sh"), 3, 16)
    assert not [d for d in diags if "source" in d.message]
    # A finding at a value the sourced file sets is reported in that file.
    result = check_file_result(script)
    (d001,) = [d for d in result.diagnostics if d.code == "D001"]
    assert (d001.file, d001.line, d001.column) == (str(tmp_path / "conf" / "parallel.sh"), 1, 4)


def check_file_result(path, **options):
    from mixle_compile.check import check_file

    return check_file(path, options=ImportOptions(device_memory="80GiB", **options))


def test_a_sourced_file_is_found_in_the_working_directory_as_bash_would(tmp_path, monkeypatch):
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "model.sh").write_text(
        "MODEL_ARGS=(--num-layers 6 --hidden-size 512 --num-attention-heads 8)\nTP=2\n"
    )
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "launch.sh"
    script.write_text("source common/model.sh\n" + MEGATRON_TAIL)
    monkeypatch.chdir(tmp_path)
    doc, _ = read_any(script, "scripts/launch.sh", ImportOptions(device_memory="80GiB"))
    assert doc.data["model"]["num_layers"] == 6
    assert doc.values[("model", "num_layers")].file == "common/model.sh"


@pytest.mark.parametrize(
    "line, expected",
    [
        ("source missing.sh", "`source missing.sh` is ignored: missing.sh is not found (looked for "),
        (
            ". $CONF_DIR/model.sh",
            "`. $CONF_DIR/model.sh` is ignored: the path is computed from $CONF_DIR, which the script does not set",
        ),
        (
            "source $(find . -name model.sh)",
            "the path is computed from the command substitution $(find . -name model.sh)",
        ),
    ],
)
def test_a_sourced_file_that_cannot_be_read_is_named(tmp_path, monkeypatch, line, expected):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "launch.sh"
    script.write_text(
        f"MODEL_ARGS=(--num-layers 4 --hidden-size 256 --num-attention-heads 4)\nTP=2\n{line}\n" + MEGATRON_TAIL
    )
    doc, diags = read_any(script, "launch.sh", ImportOptions(device_memory="80GiB"))
    (warning,) = [d for d in diags if "ignored" in d.message and "source" in d.message or d.message.startswith("`.")]
    assert expected in warning.message and (warning.code, warning.line, warning.column) == ("I002", 3, 1)
    assert doc.data["model"]["num_layers"] == 4  # the rest of the script is still read


def test_sourcing_cycles_and_depth_are_bounded_and_nothing_is_run(tmp_path, monkeypatch):
    from mixle_compile.importers.shell import MAX_SOURCE_DEPTH

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.sh").write_text(
        "source b.sh\nMODEL_ARGS=(--num-layers 4 --hidden-size 256 --num-attention-heads 4)\n"
    )
    (tmp_path / "b.sh").write_text("source a.sh\ntouch ran-b\n$(touch ran-c)\nTP=2\n")
    script = tmp_path / "launch.sh"
    script.write_text("source a.sh\n" + MEGATRON_TAIL)
    doc, diags = read_any(script, "launch.sh", ImportOptions(device_memory="80GiB"))
    (cycle,) = [d for d in diags if "cycle" in d.message]
    assert "a cycle (a.sh -> b.sh -> a.sh)" in cycle.message and (cycle.file, cycle.line) == ("b.sh", 1)
    assert doc.data["mesh"]["tp"] == 2 and not (tmp_path / "ran-b").exists() and not (tmp_path / "ran-c").exists()
    # A chain deeper than the limit stops there, with a warning at the file that would go deeper.
    for k in range(MAX_SOURCE_DEPTH + 2):
        (tmp_path / f"d{k}.sh").write_text(f"source d{k + 1}.sh\nLEVEL={k}\n")
    script.write_text(
        "MODEL_ARGS=(--num-layers 4 --hidden-size 256 --num-attention-heads 4)\nTP=2\nsource d0.sh\n" + MEGATRON_TAIL
    )
    doc, diags = read_any(script, "launch.sh", ImportOptions(device_memory="80GiB"))
    (deep,) = [d for d in diags if "deep" in d.message]
    assert f"more than {MAX_SOURCE_DEPTH} deep" in deep.message and deep.file == f"d{MAX_SOURCE_DEPTH - 2}.sh"


def test_megatron_deepseek_v2_lite_launch_is_the_model_its_hf_config_gives():
    """Megatron-LM's DeepSeek-V2-Lite arguments (--multi-latent-attention, no --q-lora-rank, the MoE
    pattern ([0]+[1]*26) and 2816 of shared experts) and the published HF config read as one model; the
    launch's --kv-channels, which MLA does not read, is named."""
    from mixle_compile.importers.hf import hf_model, read_hf_document

    doc, diags = read_any(
        MG / "conf_DeepSeek-V2-Lite.sh", "launch.sh", ImportOptions(model=str(HF / "deepseek-v2-lite.json"), devices=8)
    )
    hf = hf_model(read_hf_document(HF / "deepseek-v2-lite.json")).model
    megatron = doc.data["model"]
    for field_name in hf:
        assert megatron.get(field_name) == hf[field_name], field_name
    assert "head_dim" not in megatron and "num_kv_heads" not in megatron and "q_lora_rank" not in megatron
    assert any("`--kv-channels` is ignored: Multi-head Latent Attention does not read it" in d.message for d in diags)
    assert not any("--qk-layernorm" in d.message for d in diags)  # the launch passes it: the latents' norms


MLA_LAUNCH = (
    "torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 4 --hidden-size 256 --num-attention-heads 4 "
    "--seq-length 128 --max-position-embeddings 128 --micro-batch-size 1 --vocab-size 1024 --swiglu "
    "--normalization RMSNorm --bf16 --multi-latent-attention "
)


def test_megatron_latent_attention_takes_megatrons_defaults_and_says_what_it_leaves_out():
    """megatron/training/arguments.py _add_mla_args: --kv-lora-rank 32, --qk-head-dim 128,
    --qk-pos-emb-head-dim 64, --v-head-dim 128, no query latent; the latents' norms only with
    --qk-layernorm (an I003 without it), and --mtp-num-layers read as the model's multi-token prediction layers."""
    doc, diags = read_any_text(MLA_LAUNCH + "--position-embedding-type rope --mtp-num-layers 1")
    model = doc.data["model"]
    assert (model["kv_lora_rank"], model["qk_nope_head_dim"], model["qk_rope_head_dim"], model["v_head_dim"]) == (
        32,
        128,
        64,
        128,
    )
    assert "q_lora_rank" not in model
    codes_of = {d.code: d.message for d in diags}
    assert "--qk-layernorm" in codes_of["I003"]
    assert model["mtp_num_layers"] == 1 and doc.origins[("model", "mtp_num_layers")] == "--mtp-num-layers"
    assert not any("mtp" in d.message for d in diags)  # read, not named as left out
    # no --mtp-loss-scaling-factor: Megatron-Core's default (0.1), the spec's null
    assert "mtp_loss_scaling_factor" not in doc.data["training"]
    Spec.model_validate(doc.data)


def test_megatron_multi_token_prediction_flags_are_read_into_the_spec():
    """--mtp-num-layers N and --mtp-loss-scaling-factor X (TransformerConfig.mtp_num_layers and
    mtp_loss_scaling_factor, flags through ArgumentGroupFactory) are model.mtp_num_layers and
    training.mtp_loss_scaling_factor, each at its place in the launch."""
    doc, diags = read_any_text(
        MLA_LAUNCH + "--position-embedding-type rope --qk-layernorm --mtp-num-layers 2 --mtp-loss-scaling-factor 0.3"
    )
    assert not [d for d in diags if d.severity.value == "error"], [d.text() for d in diags]
    spec = Spec.model_validate(doc.data)
    assert spec.model.mtp_num_layers == 2 and spec.training.mtp_loss_scaling_factor == 0.3
    text = MLA_LAUNCH + "--position-embedding-type rope --qk-layernorm --mtp-num-layers 2"
    assert doc.values[("model", "mtp_num_layers")].column == len(text)  # at the value, 2
    assert doc.origins[("training", "mtp_loss_scaling_factor")] == "--mtp-loss-scaling-factor"
    # a dense launch (no latent attention) takes them too: Megatron's MTP layers are of the decoder's kind
    dense = MLA_LAUNCH.replace("--multi-latent-attention ", "")
    doc, _ = read_any_text(dense + "--position-embedding-type rope --mtp-num-layers 1")
    assert doc.data["model"]["mtp_num_layers"] == 1 and "kv_lora_rank" not in doc.data["model"]


@pytest.mark.parametrize(
    "extra, code, says",
    [
        # validate_args: MTP with --position-embedding-type rope or none only
        ("--mtp-num-layers 1", "I005", "--position-embedding-type learned_absolute (the default)"),
        ("--position-embedding-type yarn --mtp-num-layers 1", "I005", "supported with rope and none only"),
        ("--position-embedding-type rope --mtp-num-layers -1", "I004", "`--mtp-num-layers -1` is not a number"),
        ("--position-embedding-type rope --mtp-num-layers one", "I004", "`--mtp-num-layers` must be a number"),
        (
            "--position-embedding-type rope --mtp-num-layers 1 --mtp-loss-scaling-factor 0",
            "I004",
            "`--mtp-loss-scaling-factor 0` is not a weight",
        ),
        (
            "--position-embedding-type rope --mtp-num-layers 1 --mtp-loss-scaling-factor nan",
            "I004",
            "`--mtp-loss-scaling-factor nan` is not a weight",
        ),
        (
            "--position-embedding-type rope --mtp-num-layers 1 --use-legacy-models",
            "I005",
            "legacy models do not support Multi-Token Prediction",
        ),
    ],
)
def test_megatron_bad_multi_token_prediction_flags_are_clear_errors(capsys, tmp_path, extra, code, says):
    path = tmp_path / "launch.sh"
    path.write_text(MLA_LAUNCH.replace("--multi-latent-attention ", "") + extra + "\n")
    status, out, err = run_cli(capsys, "check", path)
    assert status == (2 if code == "I004" else 1) and code in out and says in out, out
    assert "Traceback" not in out + err


def test_megatron_loss_weight_without_mtp_layers_is_named_and_an_hf_models_mtp_is_not_the_launchs(tmp_path):
    """--mtp-loss-scaling-factor without --mtp-num-layers weighs nothing (I002, not read); sizes taken from an
    HF config whose num_nextn_predict_layers is 1 build no MTP layer unless the launch passes the flag."""
    doc, diags = read_any_text(MLA_LAUNCH + "--position-embedding-type rope --mtp-loss-scaling-factor 0.2")
    assert "mtp_loss_scaling_factor" not in doc.data["training"] and "mtp_num_layers" not in doc.data["model"]
    (named,) = [d for d in diags if "--mtp-loss-scaling-factor" in d.message]
    assert named.code == "I002" and "no multi-token prediction loss to weigh" in named.message
    launch = (
        "torchrun --nproc_per_node 8 pretrain_gpt.py --seq-length 4096 --micro-batch-size 1 --bf16 "
        "--position-embedding-type rope"
    )
    (tmp_path / "launch.sh").write_text(launch + "\n")
    options = ImportOptions(model=str(HF / "deepseek-v3.json"), device_memory="80GiB")
    doc, _ = read_any(tmp_path / "launch.sh", "launch.sh", options)
    assert doc.data["model"]["mtp_num_layers"] == 0
    assert "no --mtp-num-layers" in doc.origins[("model", "mtp_num_layers")]
    (tmp_path / "launch.sh").write_text(launch + " --mtp-num-layers 1\n")
    doc, _ = read_any(tmp_path / "launch.sh", "launch.sh", options)
    assert doc.data["model"]["mtp_num_layers"] == 1


@pytest.mark.parametrize(
    "extra, says",
    [
        ("--kv-lora-rank -4 --position-embedding-type rope", "`--kv-lora-rank -4` is not a width"),
        ("--q-lora-rank 0 --position-embedding-type rope", "`--q-lora-rank 0` is not a query latent's width"),
    ],
)
def test_megatron_bad_latent_attention_arguments_are_refused_clearly(capsys, tmp_path, extra, says):
    path = tmp_path / "launch.sh"
    path.write_text(MLA_LAUNCH + extra + "\n")
    status, out, err = run_cli(capsys, "check", path)
    assert status == 2 and "I004" in out and says in out and "Traceback" not in out + err


def test_megatron_latent_attention_with_learned_positions_holds_both(capsys, tmp_path):
    """Megatron's default --position-embedding-type learned_absolute with --multi-latent-attention:
    GPTModel's embedding adds its position table and MLA still turns its rotary part (its own rotary
    embedding, multi_latent_attention.py): the spec's learned positions on an MLA model, with the table."""
    from mixle_compile.parameters import model_parameters

    path = tmp_path / "launch.sh"
    path.write_text(MLA_LAUNCH + "--qk-layernorm\n")
    doc, _ = read_any(path, "launch.sh", ImportOptions(device_memory="80GiB"))
    assert doc.data["model"]["position_embedding"] == "learned" and doc.data["model"]["kv_lora_rank"]
    status, out, _ = run_cli(capsys, "check", path, "--device-memory", "80GiB")
    assert status == 0, out
    spec = load_spec(path).spec
    assert "pos_embed.weight" in {p.name for p in model_parameters(spec)}


def test_megatron_refuses_grouped_query_attention_with_latent_attention(capsys, tmp_path):
    path = tmp_path / "launch.sh"
    path.write_text(
        MLA_LAUNCH + "--position-embedding-type rope --qk-layernorm --group-query-attention --num-query-groups 2\n"
    )
    status, out, _ = run_cli(capsys, "check", path)
    assert status == 1 and "I005" in out and "mutually exclusive" in out


def read_any_text(text: str):
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp())
    (folder / "launch.sh").write_text(text + "\n")
    return read_any(folder / "launch.sh", "launch.sh", ImportOptions(device_memory="80GiB"))


DEEPSEEK_HF = [
    # (file, parameters of the spec's model, as transformers' own model has them: test_parameters.py)
    ("deepseek-v3.json", {"q_lora_rank": 1536, "moe_first_layer": 3, "num_experts": 256, "experts_per_token": 8}),
    ("deepseek-v2-lite.json", {"q_lora_rank": None, "moe_first_layer": 1, "num_experts": 64, "experts_per_token": 6}),
    ("kimi-k2-instruct.json", {"q_lora_rank": 1536, "moe_first_layer": 1, "num_experts": 384, "experts_per_token": 8}),
]


@pytest.mark.parametrize("name, expected", DEEPSEEK_HF)
def test_hf_deepseek_configs_read_as_latent_attention(name, expected):
    from mixle_compile.importers.hf import hf_model, read_hf_document

    hf = hf_model(read_hf_document(HF / name))
    assert not hf.problems
    assert {k: hf.model.get(k) for k in expected} == expected
    assert (hf.model["kv_lora_rank"], hf.model["qk_nope_head_dim"], hf.model["qk_rope_head_dim"]) == (512, 128, 64)
    assert "head_dim" not in hf.model and "num_kv_heads" not in hf.model
    # read, not named: V3 publishes one MTP layer, Kimi K2 none; DeepSeek-V2 has no such key
    assert not [key for key, _ in hf.ignored if key.startswith("num_nextn_predict_layers")]
    mtp = {"deepseek-v3.json": 1, "kimi-k2-instruct.json": 0}.get(name)
    assert hf.model.get("mtp_num_layers") == mtp
    if mtp is not None:
        assert hf.keys["mtp_num_layers"] == "num_nextn_predict_layers"


@pytest.mark.parametrize(
    "keys, says",
    [
        ({"num_nextn_predict_layers": -1}, "`num_nextn_predict_layers` = -1 is not a number of multi-token"),
        ({"num_nextn_predict_layers": True}, "`num_nextn_predict_layers` = True is not a number"),
        ({"num_nextn_predict_layers": "1"}, "`num_nextn_predict_layers` = '1' is not a number"),
        ({"num_nextn_predict_layers": None}, "`num_nextn_predict_layers` is null"),
    ],
)
def test_a_bad_mtp_key_is_a_clear_error(tmp_path, capsys, keys, says):
    data = json.loads((HF / "deepseek-v3.json").read_text())
    data.update(keys)
    (tmp_path / "config.json").write_text(json.dumps(data))
    ds = tmp_path / "ds.json"
    ds.write_text('{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1}')
    status, out, err = run_cli(capsys, "check", ds, "--model", tmp_path / "config.json", "--seq-len", "1024")
    assert status == 2 and "I004" in out and says in out, out
    # a spec that takes its model from the file reports it too (an error in the spec: exit 1)
    (tmp_path / "spec.yaml").write_text(
        "model: {from: hf, path: config.json}\nmesh: {dp_shard: 8}\n"
        "training: {global_batch_size: 8, micro_batch_size: 1, seq_len: 1024}\n"
        "resources: {devices: 8, memory: 80GiB}\nbackend: torch\n"
    )
    status, out2, err2 = run_cli(capsys, "check", tmp_path / "spec.yaml")
    assert status == 1 and "I004" in out2 and says in out2, out2
    assert "Traceback" not in out + err + out2 + err2


def test_hf_mtp_layers_are_deepseek_v3s_key_and_absent_is_the_class_default(tmp_path):
    """num_nextn_predict_layers is read for deepseek_v3 and kimi_k2; absent, DeepseekV3Config's default
    (transformers 5: num_mtp_layers 1); on DeepSeek-V2, whose class has no MTP, it is named, not read."""
    from mixle_compile.importers.hf import hf_model, read_hf_document

    sizes = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 100}
    for model_type, keys, want in (
        ("deepseek_v3", {}, 1),
        ("kimi_k2", {"num_nextn_predict_layers": 3}, 3),
        ("deepseek_v3", {"num_nextn_predict_layers": 0}, 0),
    ):
        (tmp_path / "c.json").write_text(json.dumps({"model_type": model_type, **sizes, **keys}))
        hf = hf_model(read_hf_document(tmp_path / "c.json"))
        assert not hf.problems and not hf.ignored and hf.model["mtp_num_layers"] == want, (model_type, keys)
    (tmp_path / "v2.json").write_text(
        json.dumps({"model_type": "deepseek_v2", "num_experts_per_tok": 2, "num_nextn_predict_layers": 1, **sizes})
    )
    hf = hf_model(read_hf_document(tmp_path / "v2.json"))
    assert "mtp_num_layers" not in hf.model
    assert any(k.startswith("num_nextn_predict_layers (1: DeepseekV2Config has no") for k, _ in hf.ignored)
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config()  # the class default the absent key takes (transformers 5)
    if hasattr(config, "num_nextn_predict_layers"):
        assert config.num_nextn_predict_layers == 1


def test_hf_deepseek_absent_keys_take_the_configuration_class_defaults(tmp_path):
    """DeepseekV3Config: q_lora_rank 1536 where absent (null: none), first_k_dense_replace 3,
    n_shared_experts 1 of moe_intermediate_size 2048; DeepseekV2Config: first_k_dense_replace 0, two
    shared experts of 1407."""
    from mixle_compile.importers.hf import hf_model, read_hf_document

    sizes = {
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "vocab_size": 100,
        "intermediate_size": 96,
    }
    (tmp_path / "v3.json").write_text(json.dumps({"model_type": "deepseek_v3", **sizes}))
    v3 = hf_model(read_hf_document(tmp_path / "v3.json")).model
    assert (v3["q_lora_rank"], v3["moe_first_layer"], v3["moe_shared_expert_hidden_size"], v3["kv_lora_rank"]) == (
        1536,
        3,
        2048,
        512,
    )
    (tmp_path / "v2.json").write_text(json.dumps({"model_type": "deepseek_v2", "num_experts_per_tok": 2, **sizes}))
    v2 = hf_model(read_hf_document(tmp_path / "v2.json")).model
    assert (v2["moe_first_layer"], v2["moe_shared_expert_hidden_size"], v2["num_experts"]) == (0, 2 * 1407, 64)
    (tmp_path / "dense.json").write_text(json.dumps({"model_type": "deepseek_v3", "first_k_dense_replace": 4, **sizes}))
    dense = hf_model(read_hf_document(tmp_path / "dense.json")).model  # no MoE layer: the dense model
    assert "num_experts" not in dense and dense["kv_lora_rank"] == 512


@pytest.mark.parametrize(
    "keys, says",
    [
        ({"kv_lora_rank": -512}, "`kv_lora_rank` = -512 is not a positive integer"),
        ({"qk_rope_head_dim": "64"}, "`qk_rope_head_dim` = '64' is not a positive integer"),
        ({"q_lora_rank": 0}, "transformers reads 0 as a latent of no features, not as none"),
        ({"moe_layer_freq": 2}, "does not read moe_layer_freq"),
        ({"first_k_dense_replace": None}, "`first_k_dense_replace` is null"),
        ({"n_routed_experts": None}, "`n_routed_experts` is null"),
        ({"n_shared_experts": -1}, "`n_shared_experts` = -1 is not a count"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"model_type": "deepseek_v2", "topk_method": "noaux_tc"}, "transformers' DeepseekV2 routes with 'greedy'"),
        ({"model_type": "deepseek_v2", "num_experts_per_tok": None}, "the HF config has no `num_experts_per_tok`"),
    ],
)
def test_a_bad_deepseek_key_is_a_clear_error(tmp_path, capsys, keys, says):
    data = json.loads((HF / "deepseek-v3.json").read_text())
    data.update(keys)
    (tmp_path / "config.json").write_text(json.dumps(data))
    ds = tmp_path / "ds.json"
    ds.write_text('{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1}')
    status, out, err = run_cli(capsys, "check", ds, "--model", tmp_path / "config.json", "--seq-len", "1024")
    assert status == 2 and "I004" in out and says in out, out
    assert "Traceback" not in out + err


def test_an_unknown_model_type_with_latent_attention_names_the_deepseek_types(tmp_path):
    from mixle_compile.importers.hf import hf_model, read_hf_document

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mystery", "kv_lora_rank": 512}))
    (problem,) = hf_model(read_hf_document(tmp_path / "config.json")).problems
    assert "not an architecture the transformer family covers" in problem[0]
    assert "Multi-head Latent Attention is read from deepseek_v2 and deepseek_v3" in problem[1]


TRICKY_TOML = '''# a = 1 in a comment
[model]   # comment = with equals
name = "llama3"  # x = y
"quoted.key" = 1
'lit' = 2
dotted.inner = 3
converters = [
    "float8",  # k = v, an open [ in a comment
    "x = y",
]
inline = { a = 1, b = { c = 2 } }
desc = """
fake = 5
[not_a_table]
"""
lit_multi = \'\'\'
also = 6
\'\'\'
esc = """ends with \\""""
after = 8
[ parallelism . "deep" ]
k = 9
[[array_of.tables]]
m = 10
[parallelism]
pipeline_parallel_split_points = [
    ["layers.4"]
]
tensor_parallel_degree = 2
 indented = 11
'''


def test_toml_positions_on_the_tricky_cases():
    """Multi-line arrays (one holding an array on its own line, which looks like a table header), inline
    tables, dotted and quoted keys, comments with `=`, multi-line strings holding `key = value` and `[table]`."""
    from mixle_compile.importers.toml_source import read_toml

    doc = read_toml(TRICKY_TOML, "t.toml")
    lines = TRICKY_TOML.splitlines()
    expected = {
        ("model", "name"): 3,
        ("model", "quoted.key"): 4,
        ("model", "lit"): 5,
        ("model", "dotted", "inner"): 6,
        ("model", "converters"): 7,
        ("model", "inline"): 11,
        ("model", "desc"): 12,
        ("model", "lit_multi"): 16,
        ("model", "esc"): 19,
        ("model", "after"): 20,
        ("parallelism", "deep", "k"): 22,
        ("array_of", "tables", "m"): 24,
        ("parallelism", "pipeline_parallel_split_points"): 26,
        ("parallelism", "tensor_parallel_degree"): 29,
        ("parallelism", "indented"): 30,
    }
    keyed = {path: pos.line for path, pos in doc.keys.items() if len(path) > 1 and path[-1] not in ("deep", "tables")}
    assert keyed == expected
    assert doc.values[("parallelism", "tensor_parallel_degree")].column == 26 and lines[28][25] == "2"
    assert doc.keys[("parallelism", "indented")].column == 2
    assert doc.data["model"]["desc"] == "fake = 5\n[not_a_table]\n"  # tomllib's values, the scanner's positions


@pytest.mark.parametrize("name", sorted(p.name for p in TT.glob("*.toml")))
def test_every_key_of_the_corpus_tomls_is_found_where_it_is_written(name):
    from mixle_compile.importers.toml_source import read_toml

    text = (TT / name).read_text()
    doc, lines = read_toml(text, name), text.splitlines()

    def leaves(data, prefix=()):
        for k, v in data.items():
            if isinstance(v, dict):
                yield from leaves(v, (*prefix, k))
            else:
                yield (*prefix, k)

    for path in leaves(doc.data):
        pos = doc.keys[path]
        assert lines[pos.line - 1][pos.column - 1 :].startswith(path[-1]), (path, pos)


# --------------------------------------------------------------------------- launches as published


MEGATRON_SIZES = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--vocab-size 256"
)


def test_a_script_finds_its_own_directory_however_it_spells_it(tmp_path):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "arguments.sh").write_text(f'MODEL_ARGS="{MEGATRON_SIZES}"\n')
    launch = "torchrun --nproc_per_node 2 pretrain_gpt.py ${MODEL_ARGS} --micro-batch-size 1 --global-batch-size 2\n"
    spellings = [
        'SCRIPT_DIR="$(dirname "$(readlink -f "$0")")"\nsource ${SCRIPT_DIR}/conf/arguments.sh\n',
        'HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)\n. $HERE/conf/arguments.sh\n',
        "source $(realpath $(dirname $0))/conf/arguments.sh\n",
        "source $(dirname $0)/conf/arguments.sh\n",
    ]
    for i, lines in enumerate(spellings):
        path = tmp_path / f"train{i}.sh"
        path.write_text(lines + launch)
        data = imported(path)
        assert data["model"]["num_layers"] == 2 and data["resources"]["devices"] == 2, lines


def test_a_source_path_from_pwd_or_another_command_says_which(tmp_path, monkeypatch):
    (tmp_path / "CONFIG.sh").write_text(f'MODEL_ARGS="{MEGATRON_SIZES}"\n')
    monkeypatch.chdir(tmp_path)
    run = Shell().execute(". `pwd`/CONFIG.sh\nsource `hostname`/x.sh\n")
    assert "--num-layers" in run.scalars["MODEL_ARGS"].text  # `pwd` is the working directory
    ((what, _, why),) = run.unsourced
    assert what == "source `hostname`/x.sh" and "the command substitution `hostname`" in why


def test_a_bare_python_launch_is_one_process(tmp_path):
    path = tmp_path / "pretrain_gpt.sh"
    path.write_text(f"python pretrain_gpt.py {MEGATRON_SIZES} --micro-batch-size 4 --global-batch-size 8\n")
    data = imported(path)
    # WORLD_SIZE defaults to 1 without a launcher: 8 samples as 2 micro-batches of 4 on one rank.
    assert data["resources"]["devices"] == 1 and data["mesh"]["microbatches"] == 2
    path.write_text(f"python -m torch.distributed.launch --nproc_per_node 4 pretrain_gpt.py {MEGATRON_SIZES}\n")
    assert imported(path)["resources"]["devices"] == 4


def test_a_torchrun_launch_without_its_sizes_is_torchruns_defaults(capsys, tmp_path):
    """torch/distributed/run.py: --nproc-per-node defaults to "1" and --nnodes to "1:1"; the deprecated
    torch.distributed.launch parses with the same get_args_parser. Megatron-LM's examples/pretrain_gpt.sh
    (the single-GPU "345M" example) runs `torchrun pretrain_gpt.py` with micro 4 and global 8."""
    path = tmp_path / "pretrain_gpt.sh"
    batch = "--micro-batch-size 4 --global-batch-size 8"
    path.write_text(f"torchrun pretrain_gpt.py {MEGATRON_SIZES} {batch}\n")
    status, out, _ = run_cli(capsys, "check", path, "--device-memory", "80GiB")
    assert status == 0 and "I003" not in out and "B001" not in out, out
    doc, _ = read_any(path, str(path))
    assert doc.data["resources"]["devices"] == 1 and doc.data["mesh"]["microbatches"] == 2
    assert "--nproc-per-node default 1" in doc.origins[("resources", "devices")]
    assert doc.position(("resources", "devices")).line == 1
    for launcher, devices in [
        ("python -m torch.distributed.launch", 1),
        ("python3 -m torch.distributed.run --nnodes 2", 2),
        ("torchrun --nnodes=2:2 --nproc-per-node=4", 8),
        ("PET_NPROC_PER_NODE=4\ntorchrun --nnodes 2", 8),  # run.py's env action: PET_* before the default
    ]:
        path.write_text(f"{launcher} pretrain_gpt.py {MEGATRON_SIZES}\n")
        assert imported(path)["resources"]["devices"] == devices, launcher
    # Launches that do not say: the count is assumed, with the warning.
    for launcher in (
        "torchrun --nproc_per_node gpu",  # counted on the machine (determine_local_world_size)
        "torchrun --nnodes 1:4 --nproc_per_node 8",  # elastic: the size is decided at rendezvous
        "torchrun --nproc_per_node $UNSET_GPUS",
        "deepspeed",
        "srun python",
    ):
        path.write_text(f"{launcher} pretrain_gpt.py {MEGATRON_SIZES}\n")
        status, out, _ = run_cli(capsys, "check", path, "--device-memory", "80GiB")
        assert "does not say how many devices run it; assumed 8" in out, launcher


def test_pretrain_gpt2_is_megatrons_gpt_and_its_old_flags_are_what_validate_args_refuses(capsys, tmp_path):
    path = tmp_path / "pretrain_gpt2_distributed.sh"
    path.write_text(
        f"torchrun --nproc_per_node 4 pretrain_gpt2.py --model-parallel-size 2 --batch-size 4 {MEGATRON_SIZES}\n"
    )
    status, out, _ = run_cli(capsys, "check", path)
    assert status == 1, out
    assert "I004" not in out and "trains a model other than" not in out
    assert out.count("I005") == 2 and "use --tensor-model-parallel-size" in out and "use --micro-batch-size" in out
    path.write_text(
        "torchrun --nproc_per_node 4 pretrain_gpt2.py --tensor-model-parallel-size 2 --micro-batch-size 4 "
        f"{MEGATRON_SIZES}\n"
    )
    data = imported(path)
    assert data["mesh"]["tp"] == 2 and data["training"]["micro_batch_size"] == 4


def test_deepspeed_assumes_a_world_size_its_batch_sizes_allow(capsys, tmp_path):
    path = tmp_path / "ds.json"
    # train 4 = micro 2 * accumulation * dp: one node of 8 is impossible; 2 is the most that fits.
    path.write_text(json.dumps({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2}))
    data = imported(path, model=LLAMA, seq_len=1024)
    assert data["resources"]["devices"] == 2 and data["mesh"]["gradient_accumulation_steps"] == 1
    path.write_text(json.dumps({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 32}))
    assert imported(path, model=LLAMA, seq_len=1024)["resources"]["devices"] == 1
    path.write_text(json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2}))
    assert imported(path, model=LLAMA, seq_len=1024)["resources"]["devices"] == 8  # one node fits: unchanged


def test_a_launch_run_as_one_string_is_read_word_by_word(tmp_path):
    # Megatron-LM's examples/pretrain_gpt3_175B.sh (2021-2024): options in a string, run by `sh -c`.
    path = tmp_path / "pretrain_gpt3.sh"
    path.write_text(
        'options=" \\\n --tensor-model-parallel-size 2 \\\n'
        f' {MEGATRON_SIZES} \\\n --micro-batch-size 1 --global-batch-size 8"\n'
        'run_cmd="python -u pretrain_gpt.py $@ ${options}"\n'
        'srun -l sh -c "${run_cmd}"\n'
    )
    data = imported(path, devices=16)
    assert data["mesh"]["tp"] == 2 and data["model"]["num_layers"] == 2
    assert data["training"]["global_batch_size"] == 8 and data["mesh"]["dp_replicate"] == 8


def test_words_expanded_from_one_string_are_where_their_text_is_written(capsys, tmp_path):
    """Megatron-LM's examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh: `MBS=${MBS:-4}`, the flags in an
    array, the launch one string (`TRAINING_CMD="... python ${MEGATRON_PATH}/pretrain_gpt.py
    ${PRETRAIN_ARGS[@]}"`) run by `bash -c`. Each flag is reported on its own line, a value set through a
    variable where the value is written."""
    path = tmp_path / "sbatch_train.sh"
    lines = [
        'MEGATRON_PATH=${MEGATRON_PATH:-"/opt/megatron"}',  # 1
        "MBS=${MBS:-4}",  # 2
        "GBS=${GBS:-24}",  # 3
        "PRETRAIN_ARGS=(",  # 4
        "    --tensor-model-parallel-size 1",  # 5
        "    --sequence-parallel",  # 6
        "    --micro-batch-size ${MBS}",  # 7
        "    --global-batch-size ${GBS}",  # 8
        "    --unmodelled-switch",  # 9
        f"    {MEGATRON_SIZES}",  # 10
        ")",  # 11
        'TRAINING_CMD="',  # 12
        "cd ${MEGATRON_PATH};",  # 13
        'python ${MEGATRON_PATH}/pretrain_gpt.py ${PRETRAIN_ARGS[@]}"',  # 14
        'srun bash -x -c "${TRAINING_CMD}"',  # 15
    ]
    path.write_text("\n".join(lines) + "\n")
    doc, _ = read_any(path, str(path), ImportOptions(devices=8))
    mbs = doc.position(("training", "micro_batch_size"))
    assert (mbs.line, mbs.column) == (2, 12)  # the 4 of MBS=${MBS:-4}
    assert doc.position(("training", "global_batch_size")).line == 3
    assert doc.position(("mesh", "tp")).line == 5
    _, out, _ = run_cli(capsys, "check", path, "--devices", "8", "--device-memory", "80GiB")
    assert f"{path}:9:5: I002 (warning) `--unmodelled-switch` is ignored" in out, out
    assert f"{path}:6:5: Q004" in out  # --sequence-parallel with tp 1
    assert f"{path}:3:12: B001" in out  # 24 is not 4 * 8 * a whole number
    # Megatron-LM's examples/pretrain_gpt3_175B.sh: options in a string, run_cmd="python -u ${DIR}/pretrain_gpt.py
    # $@ ${options}" run by `srun sh -c`: a flag is on its own line, not at DIR=`pwd`.
    path.write_text(
        "DIR=`pwd`\n"
        'options=" \\\n'
        f"\t{MEGATRON_SIZES} \\\n"
        "\t--micro-batch-size 1 \\\n"
        '\t--rampup-batch-size 16 16 5859375"\n'
        'run_cmd="python -u ${DIR}/pretrain_gpt.py $@ ${options}"\n'
        'srun -l sh -c "${run_cmd}"\n'
    )
    _, out, _ = run_cli(capsys, "check", path, "--devices", "8", "--device-memory", "80GiB")
    assert f"{path}:5:2: I002 (warning) `--rampup-batch-size` is ignored" in out, out


def test_the_shell_reader_keeps_where_each_expanded_character_is_written():
    run = Shell().execute(
        'TP=${TP:-2}\nV="--a 1 \\\n  --b $TP"\nARR=(--c=$TP "--d $TP")\nrun $V --e=${TP} ${ARR[@]} "$V"\n'
    )
    words = run.commands[-1]
    where = {(w.text, (w.pos.line, w.pos.column)) for w in words}
    assert {("--a", (2, 4)), ("1", (2, 8)), ("--b", (3, 3)), ("2", (1, 10)), ("--e=2", (5, 8))} <= where
    assert ("--c=2", (4, 6)) in where and ("--d", (4, 15)) in where  # an array's element split where written
    e = next(w for w in words if w.text == "--e=2")
    assert (e.tail(4).text, e.tail(4).pos.line, e.tail(4).pos.column) == ("2", 1, 10)
    quoted = words[-1]  # "$V": one word, each part of it still where it is written
    assert [(p.text, p.pos.line) for p in quoted.split()] == [("--a", 2), ("1", 2), ("--b", 3), ("2", 1)]
    # An array assigned to a scalar is its elements joined (an empty one, nothing), never an error.
    run = Shell().execute('E=()\nX=${E[@]}\nY="${ARR[@]}"\nARR=(a "b c")\nZ=${ARR[@]}\n')
    assert run.scalars["X"].text == "" and run.scalars["Z"].text == "a b c"


def test_a_launch_of_another_training_script_is_read_by_its_code_or_refused_by_name(capsys, tmp_path, monkeypatch):
    """Megatron-LM's examples/detxoify_lm/finetune_gpt_distributed-1.3b.sh runs `python -m torch.distributed.run
    $DISTRIBUTED_ARGS examples/detxoify_lm/finetune_gpt.py --num-layers 24 ...`: the flags after the script are
    the launch's, torchrun's (DISTRIBUTED_ARGS) never are. finetune_gpt.py trains GPTModel through Megatron's
    pretrain() (its standard arguments); examples/multimodal/train.py builds LLaVAModel."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "finetune_gpt_distributed.sh"
    path.write_text(
        "GPUS_PER_NODE=2\n"
        'DISTRIBUTED_ARGS="--nproc_per_node $GPUS_PER_NODE --nnodes 1 --node_rank 0 --master_addr localhost '
        '--master_port 6000"\n'
        "python -m torch.distributed.run $DISTRIBUTED_ARGS \\\n"
        "     examples/detxoify_lm/finetune_gpt.py \\\n"
        f"     {MEGATRON_SIZES} --micro-batch-size 4 --global-batch-size 8\n"
    )
    status, out, _ = run_cli(capsys, "check", path, "--device-memory", "80GiB")
    assert status == 2 and f"{path}:4:6: I004 the launch runs examples/detxoify_lm/finetune_gpt.py" in out, out
    assert "not found" in out and "is not set" not in out and "--nproc_per_node" not in out and "I001" not in out
    script = tmp_path / "examples" / "detxoify_lm" / "finetune_gpt.py"
    script.parent.mkdir(parents=True)
    script.write_text(
        "from megatron.model import GPTModel, ModelType\nfrom megatron.training import pretrain\n\n"
        "def model_provider(pre_process=True, post_process=True):\n    return GPTModel(num_tokentypes=0)\n\n"
        "if __name__ == '__main__':\n    pretrain(None, model_provider, ModelType.encoder_or_decoder, None)\n"
    )
    doc, _ = read_any(path, str(path))
    assert doc.data["resources"]["devices"] == 2 and doc.data["model"]["num_layers"] == 2
    assert "finetune_gpt.py" in doc.origins[("model", "family")]
    # A script that builds another of Megatron's models, or does not train through pretrain(), is refused by name.
    for code, says in [
        (
            "from megatron.core.models.multimodal.llava_model import LLaVAModel\n"
            "from megatron.training import pretrain\n",
            "builds LLaVAModel",
        ),
        ("from megatron.core.models.gpt import GPTModel\n", "does not train through Megatron-LM's pretrain()"),
    ]:
        script.write_text(code)
        status, out, _ = run_cli(capsys, "check", path, "--device-memory", "80GiB")
        assert status == 2 and says in out and "examples/detxoify_lm/finetune_gpt.py" in out, out
    # Megatron-LM's examples/multimodal/pretrain_mistral_clip.sh: its entry named, not "no --num-layers".
    path.write_text(
        f'OPTIONS=" \\\n  {MEGATRON_SIZES}"\ntorchrun --nproc_per_node 8 examples/multimodal/train.py ${{OPTIONS}}\n'
    )
    status, out, _ = run_cli(capsys, "check", path)
    assert status == 2 and f"{path}:3:29: I004 the launch runs examples/multimodal/train.py" in out, out
    assert "without Megatron-LM arguments" not in out


def test_launcher_variables_are_never_read_as_the_models_flags(capsys, tmp_path):
    path = tmp_path / "model_args.sh"
    path.write_text(
        f'MODEL_ARGS="{MEGATRON_SIZES} --micro-batch-size 1"\n'
        'DISTRIBUTED_ARGS="--nproc_per_node 8 --nnodes 1"\n'
        "LAUNCHER_ARGS=(--nnodes 2 --master_port 6000 --rdzv_backend c10d)\n"
        'TORCHRUN_ARGS="--nproc-per-node=4 --standalone"\n'
    )
    status, out, _ = run_cli(capsys, "check", path, "--devices", "8", "--device-memory", "80GiB")
    assert status == 0 and "I002" not in out, out
    assert imported(path, devices=8)["model"]["num_layers"] == 2


def test_hybrid_mamba_models_are_refused_as_such(capsys, tmp_path):
    """Megatron-LM's examples/post_training/modelopt/conf/nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.sh: a
    --hybrid-layer-pattern and no --num-layers (validate_args derives it from the pattern)."""
    path = tmp_path / "nemotron_nano.sh"
    for text in (
        'MODEL_ARGS=" \\\n  --hidden-size 2688 --num-attention-heads 32 \\\n  --hybrid-layer-pattern MEMEM*EMEM \\\n'
        '  --mamba-num-heads 64"\n',
        f"torchrun pretrain_gpt.py {MEGATRON_SIZES} --hybrid-override-pattern M*M*\n",
    ):
        path.write_text(text)
        status, out, _ = run_cli(capsys, "check", path)
        assert (
            status == 2 and "makes this a hybrid Mamba model" in out and "is not set" not in out and "I002" not in out
        ), out
    assert f"{path}:1:144: I004 `--hybrid-override-pattern`" in out  # at the flag
    path.write_text(f"torchrun --nproc_per_node 8 pretrain_mamba.py {MEGATRON_SIZES}\n")
    status, out, _ = run_cli(capsys, "check", path)
    assert status == 2 and "pretrain_mamba.py trains a Mamba or hybrid Mamba model" in out, out


def test_a_slurm_job_says_its_devices_through_its_sbatch_directives(capsys, tmp_path, monkeypatch):
    """Megatron-LM's examples/pretrain_gpt3_175B.sh: `#SBATCH <SLURM OPTIONS> --nodes=128 --exclusive
    --ntasks-per-node=8` and `srun ... sh -c "${run_cmd}"`, one process per task (sbatch(1), srun(1))."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "pretrain_gpt3.sh"
    launch = f'run_cmd="python -u pretrain_gpt.py {MEGATRON_SIZES} --micro-batch-size 1 --global-batch-size 128"\n'
    path.write_text(
        "#!/bin/bash\n\n#SBATCH <SLURM OPTIONS> --nodes=16 --exclusive --ntasks-per-node=8 --job-name=gpt3\n\n"
        + launch
        + 'srun -l --container-image "nvcr.io/nvidia/pytorch:24.01-py3" sh -c "${run_cmd}"\n'
    )
    status, out, _ = run_cli(capsys, "check", path, "--device-memory", "80GiB")
    assert status == 0 and "I003" not in out, out
    doc, _ = read_any(path, str(path))
    devices = doc.position(("resources", "devices"))
    assert doc.data["resources"]["devices"] == 128 and (devices.line, devices.column) == (3, 66)  # the 8
    assert "#SBATCH --nodes 16 * #SBATCH --ntasks-per-node 8" in doc.origins[("resources", "devices")]
    sized = f"torchrun --nnodes $SLURM_NNODES --nproc_per_node $SLURM_GPUS_PER_NODE pretrain_gpt.py {MEGATRON_SIZES}"
    for text, expected in [
        (f"#SBATCH -N 2\n#SBATCH --ntasks-per-node 4\nsrun python pretrain_gpt.py {MEGATRON_SIZES}\n", 8),
        (f"#SBATCH -N 2 --ntasks-per-node=4\nsrun -n 4 python pretrain_gpt.py {MEGATRON_SIZES}\n", 4),  # srun's own
        (f"#SBATCH -N 2 --ntasks-per-node=4\nsrun -N1 python pretrain_gpt.py {MEGATRON_SIZES}\n", 4),
        (f"#SBATCH --nodes=2 --gpus-per-node=4\n{sized}\n", 8),  # SLURM_* as the batch job sees them
        # a here-document fed to sbatch is a batch script of its own
        (
            f"set +e\nsbatch <<EOF\n#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=8\n"
            f"srun python pretrain_gpt.py {MEGATRON_SIZES}\nEOF\n",
            16,
        ),
    ]:
        path.write_text(text)
        assert imported(path)["resources"]["devices"] == expected, text
    # sbatch's own options take precedence over the script's directives.
    (tmp_path / "job.sh").write_text(
        f"#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=8\nsrun python pretrain_gpt.py {MEGATRON_SIZES}\n"
    )
    path.write_text("sbatch --nodes=4 job.sh\n")
    assert imported(path)["resources"]["devices"] == 32
    # Directives after the first command are not sbatch's (nor is a bare python run by the batch script
    # anything but one process); a placeholder is named, and the count assumed.
    path.write_text(
        f"echo start\n#SBATCH --nodes=4 --ntasks-per-node=8\nsrun python pretrain_gpt.py {MEGATRON_SIZES}\n"
    )
    status, out, _ = run_cli(capsys, "check", path, "--device-memory", "80GiB")
    assert "does not say how many devices run it; assumed 8" in out
    path.write_text(f"#SBATCH --nodes=4 --ntasks-per-node=8\npython pretrain_gpt.py {MEGATRON_SIZES}\n")
    assert imported(path)["resources"]["devices"] == 1
    path.write_text(f"#SBATCH --nodes=your_own_num_nodes\nsrun python pretrain_gpt.py {MEGATRON_SIZES}\n")
    status, out, _ = run_cli(capsys, "check", path, "--device-memory", "80GiB")
    assert f"{path}:1:17: I002 (warning) `--nodes your_own_num_nodes` is ignored: not a number" in out, out
    assert "does not say how many devices run it" in out


def _tokens_config():
    # torchtitan after 0.3 (73aed7f, "fold batch dim"): batches counted in tokens.
    from types import SimpleNamespace

    return SimpleNamespace(
        model_spec=SimpleNamespace(name="llama3", flavor="70B"),
        training=SimpleNamespace(
            num_tokens_per_microbatch_per_dp_rank=2 * 4096,
            max_context_length=4096,
            num_tokens_per_train_step=2 * 4096 * 4 * 4 * 3,
            steps=10,
        ),
        parallelism=SimpleNamespace(
            tensor_parallel_degree=8,
            pipeline_parallel_degree=2,
            num_pp_microbatches=4,
            pipeline_parallel_schedule="1F1B",
        ),
        optimizer=SimpleNamespace(lr=1e-4),
    )


def test_a_trainer_config_counting_batches_in_tokens_is_read_in_sequences():
    from mixle_compile.importers.torchtitan_registry import read_trainer_config

    doc, _ = read_trainer_config(_tokens_config, _tokens_config(), "tokens", ImportOptions(devices=64))
    data = doc.data
    # 2 sequences of 4096 a micro-batch, 4 pipeline micro-batches, dp 64 / (8 * 2) = 4, and a step of
    # 3 times that many tokens: 3 accumulation steps.
    assert data["training"]["seq_len"] == 4096 and data["training"]["micro_batch_size"] == 2
    assert data["mesh"]["microbatches"] == 4 and data["mesh"]["gradient_accumulation_steps"] == 3
    assert data["training"]["global_batch_size"] == 2 * 4 * 4 * 3
    line = doc.position(("training", "seq_len")).line
    source, start = inspect.getsourcelines(_tokens_config)
    assert "max_context_length=4096" in source[line - start]


def test_a_token_count_that_is_not_whole_sequences_is_refused():
    from mixle_compile.importers.torchtitan_registry import read_trainer_config

    config = _tokens_config()
    config.training.num_tokens_per_microbatch_per_dp_rank = 5000
    with pytest.raises(SourceError) as raised:
        read_trainer_config(_tokens_config, config, "tokens", ImportOptions(devices=64))
    (d,) = raised.value.diagnostics
    assert "num_tokens_per_microbatch_per_dp_rank = 5000 is not a whole number of sequences" in d.message


def test_torchtitan_early_spellings_read_as_torchtitan_read_them(tmp_path, capsys):
    path = tmp_path / "job.toml"
    # config_manager's string_list: `converters = "float8"` is the list ["float8"] (early 2025 presets).
    path.write_text('[model]\nname = "llama3"\nflavor = "8B"\nconverters = "float8"\n[training]\nseq_len = 1024\n')
    assert imported(path, devices=8)["training"]["precision"] == "fp8"
    path.write_text('[model]\nname = "llama3"\nflavor = "8B"\nconverters = "float8, other"\n')
    assert imported(path, devices=8)["training"]["precision"] == "fp8"
    # March 2024: the tensor-parallel degree was [training] sequence_parallel_degree (train.py: ParallelDims sp).
    path.write_text(
        '[model]\nname = "llama3"\nflavor = "8B"\n[training]\nsequence_parallel_degree = 8\nbatch_size = 1\n'
        "seq_len = 1024\n"
    )
    assert imported(path, devices=8)["mesh"]["tp"] == 8
    status, out, _ = run_cli(capsys, "check", path, "--devices", "8")
    assert "sequence_parallel_degree` is ignored" not in out


def test_a_config_function_that_checks_the_machine_is_not_blamed_on_the_config(tmp_path, monkeypatch, capsys):
    (tmp_path / "machine_registry.py").write_text(
        "def float8_preset():\n"
        "    raise ValueError('Failed to swap to Float8Linear because float8 is only supported on NVIDIA SM89')\n"
        "def needs_torchao():\n"
        "    raise ImportError('torchao is not installed', name='torchao')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    status, out, _ = run_cli(capsys, "check", "--torchtitan", "machine_registry:float8_preset")
    assert status == 2 and "raised ValueError: Failed to swap" in out and "SM89 or newer GPU" in out
    status, out, _ = run_cli(capsys, "check", "--torchtitan", "machine_registry:needs_torchao")
    assert status == 2 and "install what the config imports (torchao)" in out


def test_a_batch_job_script_is_followed_to_its_launch(tmp_path, monkeypatch):
    # Megatron-LM's examples/academic_paper_scripts/sc21: run_table_1.sh sets the sizes, sources
    # CONFIG.sh (MEGATRON_PARAMS) and SBATCH.sh, which submits SRUN.sh: `srun sh -c "python pretrain_gpt.py ..."`.
    (tmp_path / "CONFIG.sh").write_text(
        'export MEGATRON_PARAMS=" ${MEGATRON_EXTRA_PARAMS} --tensor-model-parallel-size ${TP} '
        "--micro-batch-size ${MBS} --global-batch-size ${GBS} --num-layers ${NLS} --hidden-size ${HS} "
        '--num-attention-heads ${NAH} --seq-length 32 --max-position-embeddings 32 --vocab-size 256 --fp16"\n'
    )
    (tmp_path / "SBATCH.sh").write_text("sbatch -p ${PART} --nodes=${NNODES} --export=MEGATRON_PARAMS SRUN.sh\n")
    (tmp_path / "SRUN.sh").write_text(
        'CMD="python -u ${MEGATRON_CODE_DIR}/pretrain_gpt.py ${MEGATRON_PARAMS}"\nsrun -l sh -c "${CMD}"\n'
    )
    path = tmp_path / "run_table_1.sh"
    path.write_text(
        'MODEL_SIZE=small\nif [ ${MODEL_SIZE} == "small" ]; then\n    TP=2\n    MBS=2\n    GBS=16\n    NLS=2\n'
        '    HS=64\n    NAH=4\n    MEGATRON_EXTRA_PARAMS="--activations-checkpoint-method uniform "\nfi\n'
        ". `pwd`/CONFIG.sh\n. `pwd`/SBATCH.sh\n"
    )
    monkeypatch.chdir(tmp_path)
    data = imported(path, devices=8)
    assert data["mesh"]["tp"] == 2 and data["model"]["hidden_size"] == 64 and data["mesh"]["microbatches"] == 2
    assert data["training"]["activation_checkpointing"] == "full" and data["training"]["precision"] == "fp16"


def test_torchtitan_models_outside_the_table_are_refused_with_the_table(tmp_path, capsys):
    path = tmp_path / "job.toml"
    for name, flavor, says in (
        ("deepseek_v2", "deepseek-ai/DeepSeek-V2-Lite", "models in the table: llama3, llama4, qwen3, deepseek_v3"),
        ("deepseek_v3", "7B", "the flavors of deepseek_v3: debugmodel, debugmodel_flex_attn, 16B, 236B, 671B"),
    ):
        path.write_text(f'[model]\nname = "{name}"\nflavor = "{flavor}"\n')
        status, out, _ = run_cli(capsys, "check", path, "--devices", "8")
        assert status == 2 and says in out, out


# --------------------------------------------------------------------------- position limits

GPT2_CONFIG = {  # openai-community/gpt2's config.json (sizes and the keys that say them)
    "architectures": ["GPT2LMHeadModel"],
    "model_type": "gpt2",
    "activation_function": "gelu_new",
    "n_ctx": 1024,
    "n_embd": 768,
    "n_head": 12,
    "n_layer": 12,
    "n_positions": 1024,
    "vocab_size": 50257,
}


def test_a_gpt2_config_bounds_the_sequence_by_its_position_table(write, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(GPT2_CONFIG))
    spec = (
        "model: {{from: hf, path: config.json}}\nmesh: {{dp_shard: 4}}\n"
        "training: {{global_batch_size: 8, seq_len: {seq}}}\nbackend: torch\nresources: {{devices: 4, memory: 80GB}}\n"
    )
    path = write(spec.format(seq=1024))
    loaded = load_spec(path)
    assert loaded.spec is not None and loaded.spec.model.max_position_embeddings == 1024
    from mixle_compile.parameters import model_parameters

    (table,) = [p for p in model_parameters(loaded.spec) if p.name == "pos_embed.weight"]
    assert table.shape == (1024, 768)  # wpe's rows, whatever the sequence
    path = write(spec.format(seq=4096))
    status, out, _ = run_cli(capsys, "check", path)
    assert status == 1 and "Q007" in out and "1024 rows" in out
    # GPT2Config's default when the key is absent
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in GPT2_CONFIG.items() if k != "n_positions"}))
    status, out, _ = run_cli(capsys, "check", path)
    assert status == 1 and "Q007" in out


def test_megatron_refuses_a_sequence_longer_than_max_position_embeddings(tmp_path, capsys):
    sizes = MEGATRON_SIZES.replace("--max-position-embeddings 32", "--max-position-embeddings 16")
    path = tmp_path / "train.sh"
    path.write_text(
        "torchrun --nproc_per_node 2 pretrain_gpt.py --position-embedding-type rope "
        f"{sizes} --micro-batch-size 1 --global-batch-size 2\n"
    )
    assert imported(path)["model"]["max_position_embeddings"] == 16
    status, out, _ = run_cli(capsys, "check", path)
    assert status == 1 and "Q008" in out and "max_position_embeddings=16" in out
    # a value the reader cannot resolve is left out, not refused
    path.write_text(path.read_text().replace("--max-position-embeddings 16", "--max-position-embeddings ${MAXPOS}"))
    assert "max_position_embeddings" not in imported(path)["model"]


def test_hf_keys_that_mean_none_or_serialisation_are_not_warned_about(write, tmp_path, capsys):
    config = json.loads((HF / "qwen3-30b-a3b.json").read_text())
    config.update(
        mlp_only_layers=[],
        shared_expert_intermediate_size=0,
        auto_map={"AutoConfig": "configuration_x.XConfig"},
        **{"transformers.js_config": {"dtype": "q4"}},
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    path = write(
        "model: {from: hf, path: config.json}\nmesh: {dp_shard: 8}\ntraining: {global_batch_size: 8, seq_len: 128}\n"
        "backend: torch\nresources: {devices: 8, memory: 141GB}\n"
    )
    loaded = load_spec(path)
    assert loaded.spec is not None
    assert not [d for d in loaded.diagnostics if d.code == "I002"], [d.text() for d in loaded.diagnostics]
    config.update(shared_expert_intermediate_size=512, mlp_only_layers=[0])
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_spec(path)
    diagnostics = loaded.diagnostics
    assert loaded.spec.model.moe_first_layer == 1  # a dense first layer, then every layer sparse
    # Qwen3-MoE has no shared expert: transformers does not read the key there, and neither does the import
    ignored = [d.message for d in diagnostics if d.code == "I002"]
    assert len(ignored) == 1 and ignored[0].endswith(
        "`shared_expert_intermediate_size` is ignored: the spec does not model it"
    )


def _qwen3_moe_spec(write, tmp_path, keys: dict):
    """Qwen3-30B-A3B's published config with ``keys`` changed, and a spec that reads it."""
    config = json.loads((HF / "qwen3-30b-a3b.json").read_text())
    config.update(keys)
    (tmp_path / "config.json").write_text(json.dumps(config))
    path = write(
        "model: {from: hf, path: config.json}\nmesh: {dp_shard: 8}\ntraining: {global_batch_size: 8, seq_len: 128}\n"
        "backend: torch\nresources: {devices: 8, memory: 141GB}\n"
    )
    return config, path


@pytest.mark.parametrize(
    "keys, spacing",
    [
        ({}, (0, 1)),
        ({"decoder_sparse_step": 2}, (1, 2)),  # (i + 1) % 2 == 0: layers 1, 3, 5, ...
        ({"decoder_sparse_step": 3, "mlp_only_layers": [2]}, (5, 3)),
        ({"mlp_only_layers": [0, 1, 2]}, (3, 1)),
        ({"mlp_only_layers": [5]}, None),  # a dense layer among sparse ones
        ({"mlp_only_layers": list(range(48))}, "dense"),  # no sparse layer: transformers builds a dense model
        ({"decoder_sparse_step": 100}, "dense"),
        ({"num_hidden_layers": 10**9, "mlp_only_layers": [0, 1]}, (2, 1)),  # no list as long as the model
        ({"num_hidden_layers": 10**9, "decoder_sparse_step": 2, "mlp_only_layers": [1, 3]}, (5, 2)),
    ],
)
def test_hf_qwen_moe_layers_follow_transformers_rule(write, tmp_path, keys, spacing):
    config, path = _qwen3_moe_spec(write, tmp_path, keys)
    loaded = load_spec(path)
    if spacing is None:
        assert loaded.spec is None and any(
            d.code == "I004" and "evenly spaced after the dense ones" in d.message for d in loaded.diagnostics
        )
        return
    model = loaded.spec.model
    if spacing == "dense":
        assert model.num_experts == 0 and model.ffn_hidden_size == config["intermediate_size"]
        return
    assert (model.moe_first_layer, model.moe_layer_frequency) == spacing
    # the layers transformers builds sparse are the spec's MoE layers
    from mixle_compile.parameters import is_moe_layer

    step, only = keys.get("decoder_sparse_step", 1), keys.get("mlp_only_layers", [])
    assert [is_moe_layer(model, i) for i in range(48)] == [i not in only and (i + 1) % step == 0 for i in range(48)]


def test_hf_qwen2_moe_whose_every_layer_is_dense_is_the_dense_model_without_its_shared_expert(write, tmp_path):
    config = json.loads((HF / "qwen1.5-moe-a2.7b.json").read_text())
    config["mlp_only_layers"] = list(range(config["num_hidden_layers"]))
    (tmp_path / "config.json").write_text(json.dumps(config))
    path = write(
        "model: {from: hf, path: config.json}\nmesh: {dp_shard: 8}\ntraining: {global_batch_size: 8, seq_len: 128}\n"
        "backend: torch\nresources: {devices: 8, memory: 141GB}\n"
    )
    loaded = load_spec(path)
    assert loaded.spec is not None, [d.text() for d in loaded.diagnostics]
    model = loaded.spec.model
    assert model.num_experts == 0 and model.moe_shared_expert_hidden_size is None and not model.moe_shared_expert_gate


@pytest.mark.parametrize(
    "keys, says",
    [
        ({"decoder_sparse_step": 0}, "`decoder_sparse_step` = 0 is not a positive integer"),
        ({"decoder_sparse_step": 2.0}, "`decoder_sparse_step` = 2.0 is not a positive integer"),
        ({"decoder_sparse_step": "abc"}, "is not a positive integer"),
        ({"mlp_only_layers": "0,1"}, "`mlp_only_layers` = '0,1' is not a list of layer indices"),
        ({"mlp_only_layers": [True]}, "is not a list of layer indices"),
        ({"mlp_only_layers": 0}, "`mlp_only_layers` = 0 is not a list of layer indices"),
        ({"mlp_only_layers": {}}, "is not a list of layer indices"),
        ({"decoder_sparse_step": None}, "`decoder_sparse_step` = None is not a positive integer"),
    ],
)
def test_hf_qwen_moe_layer_keys_of_the_wrong_kind_are_refused(write, tmp_path, capsys, keys, says):
    config, path = _qwen3_moe_spec(write, tmp_path, keys)
    status, out, _ = run_cli(capsys, "check", path)
    assert status == 1 and "I004" in out and says in out, out


def test_megatron_embedding_and_loss_counted_in_the_pipeline_split(tmp_path):
    path = tmp_path / "args.txt"
    base = (
        "--num-layers 14 --hidden-size 64 --num-attention-heads 4 --vocab-size 128 --pipeline-model-parallel-size 4 "
        "--global-batch-size 8 "
    )
    path.write_text(base + "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split\n")
    assert imported(path, devices=4)["training"]["pipeline_layers"] == [3, 4, 4, 3]
    path.write_text(
        base + "--num-virtual-stages-per-pipeline-rank 2 --account-for-embedding-in-pipeline-split "
        "--account-for-loss-in-pipeline-split\n"
    )
    assert imported(path, devices=4)["training"]["pipeline_layers"] == [1, 2, 2, 2, 2, 2, 2, 1]
    path.write_text(base + "--account-for-embedding-in-pipeline-split\n")  # 15 layers do not split over 4
    with pytest.raises(SourceError) as info:
        imported(path, devices=4)
    assert "does not divide" in info.value.diagnostics[-1].message
    path.write_text(
        base + "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split "
        "--decoder-first-pipeline-num-layers 2\n"
    )
    with pytest.raises(SourceError) as info:
        imported(path, devices=4)
    assert "decoder-first" in info.value.diagnostics[-1].message


@pytest.mark.parametrize(
    "value, dispatcher", [("standard", "all_to_all"), ("deepep", "flex"), ("hybridep", "flex"), ("nccl", None)]
)
def test_torchtitan_expert_parallel_comm_backend_is_the_expert_dispatcher(tmp_path, capsys, value, dispatcher):
    text = (
        (TT / "llama3_8b.toml")
        .read_text()
        .replace("[parallelism]", f'[parallelism]\nexpert_parallel_comm_backend = "{value}"', 1)
    )
    path = tmp_path / "job.toml"
    path.write_text(text)
    if dispatcher is None:
        status, out, _ = run_cli(capsys, "check", str(path))
        assert status == 2 and "I004" in out and "expert_parallel_comm_backend = 'nccl'" in out, out
    else:
        assert imported(path)["training"]["expert_dispatcher"] == dispatcher


MOE_FLAGS = "--num-experts 4 --moe-router-topk 2 "


@pytest.mark.parametrize(
    ("flags", "modules", "checkpointing", "code"),
    [
        (
            "--recompute-granularity selective --recompute-modules mlp layernorm",
            ["mlp", "layernorm"],
            "selective",
            None,
        ),
        ("--recompute-granularity selective --recompute-modules moe --sequence-parallel", ["moe"], "selective", None),
        ("--recompute-activations --recompute-modules=core_attn", ["core_attn"], "selective", None),
        # no names: nothing is recomputed (the default, core_attn, stands for an absent flag)
        ("--recompute-granularity selective --recompute-modules", None, "none", None),
        ("--recompute-granularity selective --recompute-modules mlp attention", None, "selective", "I005"),
        (
            MOE_FLAGS + "--moe-grouped-gemm --recompute-granularity selective --recompute-modules moe_act",
            ["moe_act"],
            "selective",
            None,
        ),
        # TransformerConfig: 'moe_act in recompute_modules is only supported with moe_grouped_gemm'
        (MOE_FLAGS + "--recompute-granularity selective --recompute-modules moe_act", ["moe_act"], "selective", "I005"),
    ],
)
def test_megatron_recompute_modules_are_read_as_a_list(tmp_path, flags, modules, checkpointing, code):
    """argparse's nargs="*": every word up to the next flag (megatron/training/arguments.py --recompute-modules);
    TransformerConfig asserts each is a module it knows."""
    path = _small_megatron_launch(tmp_path, flags)
    doc, diagnostics = read_any(path, str(path), ImportOptions(devices=8))
    assert doc.data["training"].get("recompute_modules") == modules
    assert doc.data["training"]["activation_checkpointing"] == checkpointing
    codes_found = {d.code for d in diagnostics if d.severity.value == "error"}
    assert codes_found == ({code} if code else set()), [d.message for d in diagnostics]


def test_megatron_recompute_modules_of_other_architectures_are_refused_by_name(tmp_path):
    path = _small_megatron_launch(tmp_path, "--recompute-granularity selective --recompute-modules gdn_norm_out")
    with pytest.raises(SourceError) as refused:
        read_any(path, str(path), ImportOptions(devices=8))
    (found,) = [d for d in refused.value.diagnostics if d.code == "I004"]
    assert "gdn_norm_out" in found.message and found.line == 1


def _deepseek_layout_launch(tmp_path, layout: str, extra: str = ""):
    """A DeepSeek-V3 Megatron-LM launch on 1,024 GPUs with the pipeline layout Megatron-Bridge's H100
    recipe sets (scripts/performance/configs/deepseek/deepseek_llm_pretrain.py: "Et|(tt|)*30mL")."""
    path = tmp_path / "train.sh"
    path.write_text(
        "torchrun --nproc_per_node 8 --nnodes 128 pretrain_gpt.py \\\n"
        "  --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 \\\n"
        "  --moe-ffn-hidden-size 2048 --num-experts 256 --moe-router-topk 8 --moe-layer-freq '([0]*3+[1]*58)' \\\n"
        "  --moe-shared-expert-intermediate-size 2048 --moe-token-dispatcher-type alltoall --moe-grouped-gemm \\\n"
        "  --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 \\\n"
        "  --qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm --mtp-num-layers 1 \\\n"
        "  --seq-length 4096 --max-position-embeddings 4096 \\\n"
        "  --vocab-size 129280 --position-embedding-type rope --normalization RMSNorm --swiglu \\\n"
        "  --untie-embeddings-and-output-weights --tensor-model-parallel-size 4 --pipeline-model-parallel-size 8 \\\n"
        "  --expert-model-parallel-size 64 --expert-tensor-parallel-size 1 --sequence-parallel \\\n"
        "  --recompute-granularity selective --use-distributed-optimizer --micro-batch-size 1 \\\n"
        f"  --global-batch-size 8192 --bf16 --pipeline-model-parallel-layout '{layout}' {extra}\n"
    )
    return path


def test_megatron_pipeline_layout_is_the_listed_split(tmp_path, capsys):
    """--pipeline-model-parallel-layout: the decoder layers of each virtual stage become the listed
    split and the stages per rank the virtual stages; the DeepSeek-V3 launch that P001 refused while
    the flag was ignored (61 layers do not split evenly over 32 stages) now checks."""
    path = _deepseek_layout_launch(tmp_path, "Et|(tt|)*30mL")
    data = imported(path, device_memory="80GiB")
    assert data["training"]["pipeline_layers"] == [1] + [2] * 30 + [0]
    assert data["training"]["virtual_pipeline_stages"] == 4
    assert data["training"]["pipeline_schedule"] == "interleaved_1f1b"
    status, out, _ = run_cli(capsys, "check", str(path), "--device-memory", "80GiB")
    assert status == 0 and "P001" not in out and "layout" not in out, out
    # one stage per rank: no virtual stages
    path = _deepseek_layout_launch(tmp_path, "Ettttttt|(t*8|)*6,ttttttmL")
    data = imported(path, device_memory="80GiB")
    assert data["training"]["pipeline_layers"] == [7] + [8] * 6 + [6]
    assert data["training"]["pipeline_schedule"] == "1f1b" and "virtual_pipeline_stages" not in data["training"]


@pytest.mark.parametrize(
    "layout, extra, says",
    [
        ("Et|(tt|)*29mL", "", "31 stages, which the pipeline size 8 does not divide"),
        ("Et|(tt|)*30Lm", "", "end with the loss"),
        ("Et|(tt|)*30L", "", "holds 0 multi-token prediction layers (m) but the model has 1"),
        ("Ett|(tt|)*30mL", "", "holds 62 decoder layers (t) but the model has 61"),
        ("Et|(tt|)*29,tm|tL", "", "a decoder layer (t) follows a multi-token prediction layer"),
        ("Et|(tt|)*30mL", "x", None),
        ("Et|(tt|)*30,mX", "", "'X' is not a layer character"),
        ("Et*3|(tt|)*29m|L", "", "on pipeline rank 6, not the last (7)"),
        ("Et|(tt|)*30mL", "--num-virtual-stages-per-pipeline-rank 4", "is given with --num-layers-per-virtual"),
        ("Et|(tt|)*30mL", "--decoder-first-pipeline-num-layers 7", "is given with --decoder-first-pipeline-num-layers"),
        ("Et|(tt|)*30mL", "--account-for-loss-in-pipeline-split", "--account-for-loss-in-pipeline-split"),
        ("Et|(tt|)*30mL", "--virtual-pipeline-model-parallel-size 2", "conflicts with the layout's 4 virtual stages"),
    ],
)
def test_megatron_pipeline_layouts_megatron_refuses_are_refused(tmp_path, layout, extra, says):
    if says is None:  # the control: the same launch with the recipe's layout reads
        imported(_deepseek_layout_launch(tmp_path, layout), device_memory="80GiB")
        return
    with pytest.raises(SourceError) as info:
        imported(_deepseek_layout_launch(tmp_path, layout, extra), device_memory="80GiB")
    messages = [d.message for d in info.value.diagnostics]
    assert any(says in m for m in messages), messages


def test_megatron_functional_test_configs_are_read_as_their_harness_passes_them(tmp_path, capsys):
    """Megatron-LM's functional-test configs (MODEL_ARGS of flags) become the arguments
    _run_training.sh passes: anchors merged, xargs then eval on each value (a layout's escaped bars),
    `true` the bare flag, `[...]` its words, an empty value dropped, a harness variable in a value
    the reader needs noted; the world, which the file does not give, assumed so the batch divides."""
    path = tmp_path / "model_config.yaml"
    path.write_text(
        "ENV_VARS:\n  CUDA_DEVICE_MAX_CONNECTIONS: 1\n"
        "BASE: &BASE\n  --num-layers: 8\n  --hidden-size: 64\n"
        "MODEL_ARGS:\n  <<: *BASE\n  --num-attention-heads: 4\n  --vocab-size: 128\n"
        "  --pipeline-model-parallel-size: 2\n"
        "  --pipeline-model-parallel-layout: Et*3\\\\|\\\\(t\\\\)*5L # Et*3|(t)*5L\n"
        '  --recompute-granularity: selective\n  --recompute-modules: "[core_attn mlp]"\n'
        "  --sequence-parallel: true\n  --tensor-model-parallel-size: 2\n  --bf16: true\n"
        "  --micro-batch-size: 1\n  --global-batch-size: 3\n  --seq-length: 128\n"
        "  --max-position-embeddings: 128\n  --seed: ${REPEAT}\n  --data-path: ${DATA_PATH}/x\n"
        "  --lr-decay-style: ''\n"
        "TEST_TYPE: regular\n"
    )
    doc, diagnostics = read_any(path, str(path), ImportOptions(device_memory="80GiB"))
    data = doc.data
    assert data["model"]["num_layers"] == 8 and data["model"]["hidden_size"] == 64
    assert data["training"]["pipeline_layers"] == [3, 5] and "virtual_pipeline_stages" not in data["training"]
    assert data["training"]["recompute_modules"] == ["core_attn", "mlp"]
    assert data["training"]["sequence_parallel"] is True and data["training"]["precision"] == "bf16"
    # 8 devices would make dp 2, which does not divide the global batch of 3 sequences: 4 (dp 1)
    assert data["resources"]["devices"] == 4 and data["mesh"]["dp_replicate"] == 1
    texts = [d.text() for d in diagnostics]
    assert any("`--seed` is ignored" in t and "${REPEAT}" in t for t in texts), texts
    assert not any("--data-path" in t or "lr-decay" in t for t in texts), texts
    status, out, _ = run_cli(capsys, "check", str(path), "--device-memory", "80GiB")
    assert status == 0, out
    nemo = tmp_path / "nemo.yaml"
    nemo.write_text("MODEL_ARGS:\n  trainer.devices: 8\n  model.num_layers: 2\n")
    status, out, _ = run_cli(capsys, "check", str(nemo))
    assert status == 2 and "holds no Megatron-LM arguments" in out, out


@pytest.mark.parametrize(
    "model, case, says",
    [
        ("gpt", "gpt3_x", None),
        ("moe", "gpt3_moe_x", None),
        ("bert", "bert_x", "pretrain_bert.py trains a model other than"),
        ("t5", "t5_x", "pretrain_t5.py trains a model other than"),
        ("hybrid", "hybrid_x", "pretrain_mamba.py trains a Mamba"),
        ("gpt", "gpt_dynamic_inference_x", "is an inference test"),
        ("gpt", "gpt_grpo_x", "train_rl.py"),
    ],
)
def test_a_functional_test_config_runs_its_recipes_script(tmp_path, capsys, model, case, says):
    """Megatron-LM's recipes (tests/test_utils/recipes/h100/<model>.yaml) run TRAINING_SCRIPT_PATH with
    test_cases/<model>/<case>/model_config.yaml: the folder names the script, so a BERT case is refused by
    name rather than read as a GPT model's arguments."""
    folder = tmp_path / "tests" / "functional_tests" / "test_cases" / model / case
    folder.mkdir(parents=True)
    path = folder / "model_config.yaml"
    path.write_text(
        "MODEL_ARGS:\n  --num-layers: 4\n  --hidden-size: 64\n  --num-attention-heads: 4\n  --vocab-size: 128\n"
        "  --micro-batch-size: 1\n  --global-batch-size: 8\n  --seq-length: 64\n  --max-position-embeddings: 64\n"
    )
    status, out, _ = run_cli(capsys, "check", str(path), "--device-memory", "80GiB")
    if says is None:
        assert status == 0 and "functional-test config away from" not in out, out
    else:
        assert status == 2 and says in out, out
    elsewhere = tmp_path / "model_config.yaml"
    elsewhere.write_text(path.read_text())
    status, out, _ = run_cli(capsys, "check", str(elsewhere), "--device-memory", "80GiB")
    assert status == 0 and "read as pretrain_gpt.py's arguments" in out, out


def test_a_broken_functional_test_config_is_refused_where_it_breaks(tmp_path, capsys):
    path = tmp_path / "model_config.yaml"
    path.write_text("MODEL_ARGS:\n  --num-layers: 4\n  bad: [\n")
    status, out, _ = run_cli(capsys, "check", str(path))
    assert status == 2 and f"{path}:4:1: S001 invalid YAML" in out, out
    # a layout whose repeats unroll beyond any model is refused before it is built
    path.write_text(
        "MODEL_ARGS:\n  --num-layers: 4\n  --hidden-size: 64\n  --num-attention-heads: 4\n  --vocab-size: 128\n"
        "  --pipeline-model-parallel-size: 2\n  --global-batch-size: 8\n"
        '  --pipeline-model-parallel-layout: "E(t|)*99999999999L"\n'
    )
    status, out, _ = run_cli(capsys, "check", str(path))
    assert status == 2 and "unrolls to" in out, out


def _titan_listed(tmp_path, lines: str, older: bool = False):
    """llama3 8B (32 layers) on a pipeline of 2 with the split the config lists."""
    if older:  # the 2024 layout: degrees in [training] and [experimental], split points there
        text = (
            (TT / "old_2024_llama3_8b.toml")
            .read_text()
            .replace("pipeline_parallel_degree = 1", "pipeline_parallel_degree = 2\n" + lines, 1)
        )
    else:
        text = (
            (TT / "llama3_8b.toml")
            .read_text()
            .replace("pipeline_parallel_degree = 1", "pipeline_parallel_degree = 2\n" + lines, 1)
        )
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def _stages(*runs) -> str:
    """module_fqns_per_model_part for consecutive runs of layers, the embedding first, norm and output last."""
    parts, start = [], 0
    for i, n in enumerate(runs):
        names = [f'"layers.{k}"' for k in range(start, start + n)]
        if i == 0:
            names.insert(0, '"tok_embeddings"')
        if i == len(runs) - 1:
            names += ['"norm"', '"output"']
        parts.append("[" + ", ".join(names) + "]")
        start += n
    return "module_fqns_per_model_part = [" + ", ".join(parts) + "]"


def test_torchtitan_listed_module_fqns_are_the_pipeline_split(tmp_path, capsys):
    """module_fqns_per_model_part (torchtitan 0.2+: pipeline_module_split builds stage i from list i, the
    stages over pp ranks) and the first configs' pipeline_parallel_split_points (stage i from split i - 1
    up to split i) are the listed split, with the stages per rank; neither is read quietly."""
    path = _titan_listed(tmp_path, 'pipeline_parallel_schedule = "Interleaved1F1B"\n' + _stages(7, 9, 9, 7))
    data = imported(path, devices=8, device_memory="80GiB")
    assert data["training"]["pipeline_layers"] == [7, 9, 9, 7] and data["training"]["virtual_pipeline_stages"] == 2
    status, out, _ = run_cli(capsys, "check", str(path), "--devices", "8", "--device-memory", "80GiB")
    assert status == 0 and "module_fqns" not in out, out
    path = _titan_listed(
        tmp_path, 'pipeline_parallel_split_points = ["layers.12"]\npipeline_parallel_microbatches = 1', older=True
    )
    data = imported(path, devices=8, device_memory="80GiB")
    assert data["training"]["pipeline_layers"] == [12, 20]


@pytest.mark.parametrize(
    "lines, says",
    [
        (_stages(10, 11, 11), "3 stages do not divide over pipeline_parallel_degree 2"),
        (_stages(7, 9, 9, 7).replace('"layers.8", ', ""), "do not hold layers 0 to 31 once each"),
        (_stages(7, 9, 9, 7).replace('"layers.8", "layers.9"', '"layers.9", "layers.8"'), "in order"),
        (
            _stages(7, 9, 9, 7)
            .replace('"tok_embeddings", ', "")
            .replace('["layers.7"', '["tok_embeddings", "layers.7"'),
            "'tok_embeddings' is in stage 1",
        ),
        (_stages(16, 16).replace('"norm", ', ""), "leaves out tok_embeddings, norm or output"),
        (_stages(16, 16).replace('"layers.3"', '"layers.3.attention"'), "is not a module the reader knows"),
        ("module_fqns_per_model_part = [1, 2]", "is not a list of lists"),
    ],
)
def test_torchtitan_listed_splits_it_cannot_build_are_refused(tmp_path, lines, says):
    path = _titan_listed(tmp_path, lines)
    with pytest.raises(SourceError) as info:
        imported(path, devices=8, device_memory="80GiB")
    messages = [d.message for d in info.value.diagnostics]
    assert any(says in m for m in messages), messages

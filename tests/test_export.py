"""export --to torchtitan|megatron|deepspeed, and the round trip import(export(spec)) == spec."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mixle_compile import cli
from mixle_compile.engines import engine_profile
from mixle_compile.export import TARGETS, ExportRefused, export_spec, memory_text, on_backend
from mixle_compile.export.megatron import megatron_arguments
from mixle_compile.importers import ImportOptions, read_any
from mixle_compile.spec import load_spec, load_spec_text
from mixle_compile.spec.models import Spec, TransformerModel, parallel_plan
from tests.conftest import EXAMPLES, ROOT

PRODUCTION = sorted((ROOT / "tests" / "corpus" / "production").glob("*/*.yaml"))
SPECS = sorted(EXAMPLES.glob("*.yaml")) + PRODUCTION


def canonical(spec: Spec) -> dict:
    """The spec with its defaults resolved (auto, KV heads, head size, expert width), to compare meaning."""
    data = spec.model_dump(mode="json")
    plan = parallel_plan(spec)
    data["mesh"]["dp_shard"] = plan.dp_shard
    m = data["model"]
    m["num_kv_heads"] = m["num_kv_heads"] or m["num_heads"]
    m["head_dim"] = m["head_dim"] or m["hidden_size"] // m["num_heads"]
    if m["num_experts"]:
        m["moe_ffn_hidden_size"] = m["moe_ffn_hidden_size"] or m["ffn_hidden_size"]
    m["max_position_embeddings"] = spec.model.positions(spec.training.seq_len)  # unset: the sequence length
    if data["mesh"]["order"] == "tp-cp-ep-dp-pp":  # Megatron's default rank order, the one an unset order means
        data["mesh"]["order"] = None
    data["resources"]["throughput"] = None  # a speed, not an engine setting: export drops it (and says so)
    if data["mesh"]["pp"] == 1:  # a schedule without a pipeline says nothing
        data["training"]["pipeline_schedule"] = "1f1b"
    data["training"]["overlap_pipeline_transfers"] = overlapped(spec)
    return data


def overlapped(spec: Spec) -> bool:
    """Whether the spec's engine overlaps its pipeline transfers (its field, or the engine's default)."""
    t = spec.training
    return parallel_plan(spec).pp > 1 and engine_profile(spec.backend).overlaps_pipeline_transfers(
        t.pipeline_schedule, t.virtual_pipeline_stages, t.overlap_pipeline_transfers
    )


def reimport(exported, folder: Path, spec: Spec) -> Spec:
    for name, text in exported.files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    options = ImportOptions()
    if exported.target == "deepspeed":  # the JSON names neither the model file nor the sequence length
        options = ImportOptions(
            model=str(folder / f"{Path(exported.main).stem}.model.json"),
            seq_len=spec.training.seq_len,
            device_memory=memory_text(spec.resources.memory),
        )
    doc, _ = read_any(folder / exported.main, exported.main, options)
    return Spec.model_validate(doc.data)


def round_trip(spec: Spec, target: str, folder: Path) -> bool:
    """True when exported and read back equal; False when refused. Fails when they differ."""
    try:
        exported = export_spec(spec, target)
    except ExportRefused as exc:
        assert exc.reasons and all(isinstance(r, str) and r for _, r in exc.reasons)
        return False
    back = reimport(exported, folder, spec)
    want = canonical(on_backend(spec, target))
    if target == "megatron" and engine_profile(spec.backend).name == "megatron":
        # a Megatron spec's launch runs what its own front end does (entry: core's default too); another
        # engine's spec gets Megatron-LM's default
        want["training"]["overlap_pipeline_transfers"] = overlapped(spec)
    got = canonical(back)
    if target == "deepspeed":  # a DeepSpeed config has no device kind, step count or seed (the script's)
        want["resources"]["kind"] = got["resources"]["kind"]
        for key in ("steps", "seed"):
            want["training"][key] = got["training"][key]
    assert got == want, exported.files[exported.main]
    return True


@pytest.mark.parametrize("target", TARGETS)
def test_every_example_and_production_spec_round_trips_or_is_refused(target, tmp_path):
    done = []
    for i, path in enumerate(SPECS):
        spec = load_spec(path).spec
        assert spec is not None, path
        if round_trip(spec, target, tmp_path / str(i)):
            done.append(path.name)
    # The production configs all use model parallelism or activation checkpointing, which a DeepSpeed JSON cannot
    # say; generated specs cover DeepSpeed below.
    assert len(done) >= {"torchtitan": 20, "megatron": 25, "deepspeed": 0}[target], done


@pytest.mark.parametrize(
    "spec_file, target, fragment",
    [
        ("llama3-8b-hsdp-tp.yaml", "torchtitan", 'name = "llama3"\nflavor = "8B"'),
        ("llama3-8b-hsdp-tp.yaml", "torchtitan", "data_parallel_replicate_degree = 2"),
        ("mixtral-moe-ep.yaml", "megatron", "--expert-model-parallel-size 8"),
        ("mixtral-moe-ep.yaml", "megatron", "pretrain_gpt.py"),
        # the plan's exchange is the alltoall dispatcher's; Megatron's own default is allgather
        ("mixtral-moe-ep.yaml", "megatron", "--moe-token-dispatcher-type alltoall"),
    ],
)
def test_exported_configs_say_what_the_spec_says(spec_file, target, fragment):
    exported = export_spec(load_spec(EXAMPLES / spec_file).spec, target)
    assert fragment in exported.files[exported.main]


def test_a_capacity_factor_reaches_megatron_and_is_refused_by_the_dropless_engines(tmp_path):
    spec = load_spec(EXAMPLES / "mixtral-moe-ep.yaml").spec
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"expert_capacity_factor": 1.5})})
    exported = export_spec(spec, "megatron")
    assert "--moe-expert-capacity-factor 1.5" in exported.files[exported.main]
    assert round_trip(spec, "megatron", tmp_path)
    with pytest.raises(ExportRefused) as refused:
        export_spec(
            spec.model_copy(update={"training": spec.training.model_copy(update={"distributed_optimizer": False})}),
            "torchtitan",
        )
    assert any("E011" in reason for _, reason in refused.value.reasons)


def test_a_shared_expert_reaches_megatron_and_hf_and_an_ungated_one_is_refused_by_hf(tmp_path):
    from mixle_compile.export.hf import hf_config, hf_config_text
    from mixle_compile.importers.hf import hf_model, read_hf_document

    spec = load_spec(EXAMPLES / "mixtral-moe-ep.yaml").spec
    shared = {"moe_shared_expert_hidden_size": 4096, "moe_shared_expert_gate": True}
    spec = spec.model_copy(update={"model": spec.model.model_copy(update=shared)})
    exported = export_spec(spec, "megatron")
    launch = exported.files[exported.main]
    assert "--moe-shared-expert-intermediate-size 4096 \\\n    --moe-shared-expert-gate" in launch
    assert round_trip(spec, "megatron", tmp_path)
    config, why = hf_config(spec.model)
    assert config is not None and config["model_type"] == "qwen2_moe", why
    (tmp_path / "config.json").write_text(hf_config_text(config))
    back = hf_model(read_hf_document(tmp_path / "config.json"))
    assert not back.problems and TransformerModel.model_validate(back.model) == spec.model
    ungated = spec.model.model_copy(update={"moe_shared_expert_gate": False})
    config, why = hf_config(ungated)
    assert config is None and "Llama 4's, whose shared expert is as wide as a routed one" in why
    # as wide as a routed expert: Llama 4's shape, written as a Llama4ForCausalLM config and read back
    llama4 = ungated.model_copy(
        update={"moe_shared_expert_hidden_size": 7168, "moe_ffn_hidden_size": 7168, "head_dim": 128, "num_kv_heads": 8}
    )
    config, why = hf_config(llama4)
    assert config is not None and config["model_type"] == "llama4_text", why
    (tmp_path / "l4.json").write_text(hf_config_text(config))
    back = hf_model(read_hf_document(tmp_path / "l4.json"))
    assert not back.problems and TransformerModel.model_validate(back.model) == llama4
    assert "--moe-shared-expert-gate" not in " ".join(
        export_spec(spec.model_copy(update={"model": ungated}), "megatron").files.values()
    )


@pytest.mark.parametrize("first, frequency", [(1, 2), (3, 1), (0, 2), (2, 3)])
def test_dense_layers_before_the_moe_ones_reach_megatron_and_hf(tmp_path, first, frequency):
    from mixle_compile.export.hf import hf_config, hf_config_text
    from mixle_compile.parameters import is_moe_layer

    spec = load_spec(EXAMPLES / "mixtral-moe-ep.yaml").spec
    layers = {"moe_first_layer": first, "moe_layer_frequency": frequency, "moe_ffn_hidden_size": 7168}
    spec = spec.model_copy(update={"model": spec.model.model_copy(update=layers)})
    assert round_trip(spec, "megatron", tmp_path / "megatron")
    config, why = hf_config(spec.model)
    assert config is not None, why
    transformers = pytest.importorskip("transformers")
    import torch

    (tmp_path / "config.json").write_text(hf_config_text(config))
    with torch.device("meta"):
        small = transformers.AutoConfig.from_pretrained(str(tmp_path / "config.json"))
        small.hidden_size, small.intermediate_size, small.moe_intermediate_size, small.vocab_size = 64, 64, 32, 128
        small.num_attention_heads, small.num_key_value_heads, small.head_dim = 4, 4, 16
        built = transformers.AutoModelForCausalLM.from_config(small)
    sparse = [any(".experts." in n for n, _ in layer.named_parameters()) for layer in built.model.layers]
    assert sparse == [is_moe_layer(spec.model, i) for i in range(spec.model.num_layers)]


@pytest.mark.parametrize("name", ["deepseek-v3.json", "deepseek-v2-lite.json"])
def test_latent_attention_reaches_megatron_and_hf_and_transformers_builds_it(tmp_path, name):
    """DeepSeek's published models (MLA with and without a query latent, shared experts, dense layers
    first) exported: Megatron's MLA flags read back as the model; the deepseek_v3 config.json reads
    back as the model, and transformers builds it with the parameters the spec counts."""
    from mixle_compile.export.hf import hf_config, hf_config_text
    from mixle_compile.importers.hf import hf_model, read_hf_document
    from mixle_compile.parameters import transformer_parameters

    published = TransformerModel.model_validate(
        hf_model(read_hf_document(ROOT / "tests/corpus/importers/hf" / name)).model
    )
    # its attention and layer kinds as published, fewer and narrower layers so that the plan verifies
    shared = published.moe_shared_expert_hidden_size // published.moe_ffn_hidden_size
    model = published.model_copy(
        update={"hidden_size": 512, "num_heads": 8, "vocab_size": 1024, "num_layers": 4, "ffn_hidden_size": 1024}
        | {"num_experts": 16, "moe_ffn_hidden_size": 128, "moe_shared_expert_hidden_size": 128 * shared}
    )
    spec = load_spec(EXAMPLES / "mixtral-moe-ep.yaml").spec
    spec = spec.model_copy(update={"model": model})
    exported = export_spec(spec, "megatron")
    launch = exported.files[exported.main]
    assert "--multi-latent-attention" in launch and "--qk-layernorm" in launch and "--kv-channels" not in launch
    assert ("--q-lora-rank 1536" in launch) == (model.q_lora_rank == 1536)
    back = reimport(exported, tmp_path / "megatron", spec)
    assert back.model == model
    config, why = hf_config(model)
    assert config is not None and config["model_type"] == "deepseek_v3", why
    (tmp_path / "config.json").write_text(hf_config_text(config))
    read = hf_model(read_hf_document(tmp_path / "config.json"))
    assert not read.problems and not read.ignored and TransformerModel.model_validate(read.model) == model
    transformers = pytest.importorskip("transformers")
    import torch

    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(str(tmp_path / "config.json"))
        )
    # transformers' DeepseekV3ForCausalLM does not build the multi-token prediction layers the config names
    # (modeling_deepseek_v3.py drops their weights on load): it is the model without them
    built_model = model.model_copy(update={"mtp_num_layers": 0})
    assert sum(p.numel() for p in built.parameters()) == sum(
        p.numel for p in transformer_parameters(built_model, "bf16")
    )
    assert config["num_nextn_predict_layers"] == model.mtp_num_layers == (1 if name == "deepseek-v3.json" else 0)


def test_multi_token_prediction_reaches_megatron_and_hf_and_round_trips(tmp_path):
    """model.mtp_num_layers is Megatron's --mtp-num-layers (with --mtp-loss-scaling-factor where the spec weighs
    the loss) and DeepSeek-V3's num_nextn_predict_layers; each reads back as the same spec."""
    from mixle_compile.export.hf import hf_config, hf_config_text
    from mixle_compile.importers.hf import hf_model, read_hf_document

    spec = load_spec(EXAMPLES / "mixtral-moe-ep.yaml").spec
    mla = {"kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "num_kv_heads": None}
    for model_update, factor in (({"mtp_num_layers": 2}, 0.25), ({"mtp_num_layers": 1, **mla}, None)):
        mtp = spec.model_copy(
            update={
                "model": spec.model.model_copy(update=model_update),
                "training": spec.training.model_copy(update={"mtp_loss_scaling_factor": factor}),
            }
        )
        launch = " ".join(megatron_arguments(mtp))
        assert f"--mtp-num-layers {model_update['mtp_num_layers']}" in launch
        assert ("--mtp-loss-scaling-factor 0.25" in launch) == (factor is not None)
        assert round_trip(mtp, "megatron", tmp_path / f"megatron{len(model_update)}")
        back = reimport(export_spec(mtp, "megatron"), tmp_path / f"again{len(model_update)}", mtp)
        assert back.model.mtp_num_layers == model_update["mtp_num_layers"]
        assert back.training.mtp_loss_scaling_factor == factor
    # Multi-head Latent Attention: DeepSeek-V3's config.json, its num_nextn_predict_layers read back
    config, why = hf_config(mtp.model)
    assert config is not None and config["num_nextn_predict_layers"] == 1, why
    (tmp_path / "config.json").write_text(hf_config_text(config))
    read = hf_model(read_hf_document(tmp_path / "config.json"))
    assert not read.problems and not read.ignored and TransformerModel.model_validate(read.model) == mtp.model
    # any other architecture written has no such key: refused, not dropped
    config, why = hf_config(spec.model.model_copy(update={"mtp_num_layers": 1}))
    assert config is None and "only as DeepSeek-V3's num_nextn_predict_layers" in why


def test_export_refuses_multi_token_prediction_where_the_engine_config_cannot_say_it():
    """torchtitan: the 0.2 job TOML has no MTP (JobConfig at 238fa99), and torchtitan 0.3.0 builds it only in its
    deepseek_v3 registry, which the 0.3 export does not write; DeepSpeed's JSON has no MTP loss weight; Megatron
    refuses MTP with learned positions (validate_args), and a loss weight without MTP layers weighs nothing.
    Each refusal names its field."""
    spec = load_spec(EXAMPLES / "llama3-8b-hsdp-tp.yaml").spec
    mtp = spec.model_copy(update={"model": spec.model.model_copy(update={"mtp_num_layers": 1})})
    weighed = mtp.model_copy(update={"training": mtp.training.model_copy(update={"mtp_loss_scaling_factor": 0.2})})
    for version in ("0.2", "0.3"):
        with pytest.raises(ExportRefused) as refused:
            export_spec(weighed, "torchtitan", torchtitan_version=version)
        fields = dict(refused.value.reasons)
        # torchtitan builds the depths in its DeepSeek-V3 model only: C013 refuses them on a Llama first
        assert "C013" in fields["model.mtp_num_layers"], fields
        assert "model" not in fields  # llama3 8B is a published flavor: the MTP layers are what it cannot say
    assert export_spec(spec, "torchtitan", torchtitan_version="0.3").main == "train.py"
    small = load_spec(EXAMPLES / "export" / "zero3-8-gpus.yaml").spec
    small = small.model_copy(update={"training": small.training.model_copy(update={"mtp_loss_scaling_factor": 0.2})})
    with pytest.raises(ExportRefused) as refused:
        export_spec(small, "deepspeed")
    assert "training.mtp_loss_scaling_factor" in dict(refused.value.reasons)
    learned = mtp.model.model_copy(update={"position_embedding": "learned", "max_position_embeddings": 8192})
    with pytest.raises(ExportRefused) as refused:
        megatron_arguments(mtp.model_copy(update={"model": learned}))
    assert "validate_args asserts" in dict(refused.value.reasons)["model.mtp_num_layers"]
    with pytest.raises(ExportRefused) as refused:
        megatron_arguments(small)
    assert "has no MTP layers" in dict(refused.value.reasons)["training.mtp_loss_scaling_factor"]


def test_hf_export_refuses_latent_attention_transformers_cannot_build(tmp_path):
    from mixle_compile.export.hf import hf_config
    from mixle_compile.importers.hf import hf_model, read_hf_document

    model = TransformerModel.model_validate(
        hf_model(read_hf_document(ROOT / "tests/corpus/importers/hf/deepseek-v3.json")).model
    )
    for update, says in (
        ({"moe_layer_frequency": 2}, "every layer from first_k_dense_replace an MoE layer"),
        ({"moe_shared_expert_hidden_size": 3000}, "n_shared_experts times as wide as a routed one"),
        ({"moe_shared_expert_gate": True}, "gated"),
        ({"norm": "layernorm"}, "RMSNorm with a SwiGLU"),
    ):
        config, why = hf_config(model.model_copy(update=update))
        assert config is None and says in why, update


def test_megatron_export_refuses_torch_compile_and_writes_megatron_fsdp_for_dp_shard(tmp_path):
    spec = load_spec(EXAMPLES / "mixtral-moe-ep.yaml").spec
    compiled = spec.model_copy(update={"training": spec.training.model_copy(update={"compile": True})})
    with pytest.raises(ExportRefused) as refused:
        export_spec(compiled, "megatron")
    assert [field for field, _ in refused.value.reasons] == ["training.compile"]
    launch = " ".join(megatron_arguments(spec))
    assert parallel_plan(spec).dp_shard > 1
    assert "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params" in launch
    assert "--ckpt-format fsdp_dtensor" in launch
    assert round_trip(spec, "megatron", tmp_path)


def test_hybrid_sharding_reaches_megatron_fsdp_as_optimizer_instances(tmp_path):
    spec = load_spec(EXAMPLES / "llama3-8b-hsdp-tp.yaml").spec  # dp_replicate 2 x dp_shard 4 x tp 8
    mesh = spec.mesh.model_copy(update={"microbatches": 8, "gradient_accumulation_steps": 1})
    spec = spec.model_copy(update={"mesh": mesh})
    launch = " ".join(megatron_arguments(spec))
    assert "--use-megatron-fsdp" in launch and "--num-distributed-optimizer-instances 2" in launch
    assert round_trip(spec, "megatron", tmp_path)
    plan = parallel_plan(spec)
    assert (plan.dp_replicate, plan.dp_shard) == (2, 4)


def test_export_refuses_a_spec_that_does_not_verify_on_the_engine(capsys):
    status = cli.main(["export", "--to", "torchtitan", str(EXAMPLES / "mixtral-moe-ep.yaml")])
    err = capsys.readouterr().err
    assert status == 1 and "`training.distributed_optimizer`" in err and "C004" in err
    status = cli.main(["export", "--to", "deepspeed", str(EXAMPLES / "gaussian-mixture.yaml")])
    assert status == 1 and "the engines train transformers" in capsys.readouterr().err


def test_export_cli_writes_the_model_config_beside_the_deepspeed_json(tmp_path, capsys, write):
    spec = write("""\
        model: {family: transformer, vocab_size: 32000, hidden_size: 1024, num_layers: 8, num_heads: 16, \
ffn_hidden_size: 4096}
        mesh: {dp_shard: 8, gradient_accumulation_steps: 2}
        training: {global_batch_size: 64, micro_batch_size: 4, seq_len: 1024, precision: bf16}
        backend: torch
        resources: {devices: 8, memory: 80GiB}
        """)
    out = tmp_path / "ds_config.json"
    assert cli.main(["export", "--to", "deepspeed", str(spec), "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    assert (
        data["zero_optimization"]["stage"] == 3
        and data["train_batch_size"] == 64
        and data["gradient_accumulation_steps"] == 2
    )
    assert json.loads((tmp_path / "ds_config.model.json").read_text())["model_type"] == "llama"
    capsys.readouterr()
    status = cli.main(["check", str(out), "--model", str(tmp_path / "ds_config.model.json"), "--seq-len", "1024"])
    assert status == 0, capsys.readouterr().out
    assert cli.main(["export", "--to", "deepspeed", str(spec)]) == 2  # two files need -o


def test_export_cli_makes_the_folder_of_a_model_file_the_config_names(tmp_path, write):
    spec = write("""\
        model: {family: transformer, vocab_size: 32000, hidden_size: 1024, num_layers: 8, num_heads: 16, \
ffn_hidden_size: 4096}
        mesh: {dp_shard: 8}
        training: {global_batch_size: 64, micro_batch_size: 8, seq_len: 1024, precision: bf16}
        backend: torchtitan
        resources: {devices: 8, memory: 80GiB}
        """)
    out = tmp_path / "new" / "job.toml"
    assert cli.main(["export", "--to", "torchtitan", str(spec), "-o", str(out)]) == 0
    assert out.exists() and json.loads((out.parent / "job.hf" / "config.json").read_text())["hidden_size"] == 1024


def test_export_from_an_engine_config_and_from_a_plan(tmp_path, capsys):
    toml = ROOT / "tests" / "corpus" / "importers" / "torchtitan" / "llama3_8b.toml"
    # torchtitan's FSDP (ZeRO-3 over dp_shard) is Megatron-FSDP's optim_grads_params
    assert cli.main(["export", "--to", "megatron", str(toml)]) == 0
    assert "--data-parallel-sharding-strategy optim_grads_params" in capsys.readouterr().out
    plan = tmp_path / "plan.json"
    assert cli.main(["compile", str(EXAMPLES / "llama3-8b-hsdp-tp.yaml"), "-o", str(plan)]) == 0
    capsys.readouterr()
    assert cli.main(["export", "--to", "torchtitan", str(plan)]) == 0
    assert "[parallelism]" in capsys.readouterr().out


# --------------------------------------------------------------------------- generated specs

divisors = [1, 2, 4]


@st.composite
def transformer_specs(draw):
    heads = draw(st.sampled_from([4, 8, 16]))
    tp = draw(st.sampled_from([d for d in divisors if heads % d == 0]))
    pp = draw(st.sampled_from([1, 2]))
    cp = draw(st.sampled_from([1, 2]))
    dp = draw(st.sampled_from([1, 2, 4]))
    layers = pp * draw(st.sampled_from([2, 4]))
    micro = draw(st.sampled_from([1, 2]))
    microbatches = pp * draw(st.sampled_from([1, 2])) if pp > 1 else 1
    accumulation = draw(st.sampled_from([1, 2]))
    shard = draw(st.booleans())
    experts = draw(st.sampled_from([0, 0, 4]))
    model = {
        "family": "transformer",
        "vocab_size": 256 * tp,
        "hidden_size": 32 * heads,
        "num_layers": layers,
        "num_heads": heads,
        "ffn_hidden_size": 64 * heads,
        "tie_embeddings": draw(st.booleans()) and pp == 1,
        "norm": draw(st.sampled_from(["rmsnorm", "layernorm"])),
    }
    model["activation"] = "swiglu" if model["norm"] == "rmsnorm" else "gelu"
    if experts:
        model.update(num_experts=experts, experts_per_token=2, norm="rmsnorm", activation="swiglu")
    kv = draw(st.sampled_from([None, heads // 2]))
    if draw(st.sampled_from([False, False, True])):  # Multi-head Latent Attention
        model.update(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, position_embedding="rope")
        if draw(st.booleans()):
            model["q_lora_rank"] = 48
    elif kv and kv % tp == 0:
        model["num_kv_heads"] = kv
    mtp = draw(st.sampled_from([0, 0, 0, 1, 2]))  # multi-token prediction layers, and maybe their loss weight
    if mtp:
        model["mtp_num_layers"] = mtp
    mesh = {
        "dp_replicate": 1 if shard else dp,
        "dp_shard": dp if shard else 1,
        "tp": tp,
        "pp": pp,
        "cp": cp,
        "microbatches": microbatches,
        "gradient_accumulation_steps": accumulation,
    }
    training = {
        "global_batch_size": micro * microbatches * accumulation * dp,
        "micro_batch_size": micro,
        "seq_len": 64 * 2 * cp * tp,
        "precision": draw(st.sampled_from(["bf16", "fp32"])),
        "sequence_parallel": tp > 1,
        "activation_checkpointing": draw(st.sampled_from(["none", "selective", "full"])),
        "learning_rate": draw(st.sampled_from([1e-3, 3e-4])),
        "steps": draw(st.integers(1, 1000)),
    }
    if pp > 1 and draw(st.booleans()):
        training.update(pipeline_schedule="interleaved_1f1b", virtual_pipeline_stages=2)
    if mtp and draw(st.booleans()):
        training["mtp_loss_scaling_factor"] = draw(st.sampled_from([0.1, 0.3, 1]))
    devices = dp * tp * pp * cp
    return Spec.model_validate(
        {
            "model": model,
            "mesh": mesh,
            "training": training,
            "backend": "torch",
            "resources": {"devices": devices, "memory": "80GiB"},
        }
    )


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(spec=transformer_specs(), target=st.sampled_from(TARGETS))
def test_generated_specs_round_trip_or_are_refused(tmp_path_factory, spec, target):
    assert isinstance(spec.model, TransformerModel)
    round_trip(spec, target, tmp_path_factory.mktemp("rt"))


def test_generated_specs_do_round_trip_on_every_engine(tmp_path):
    """Not every generated spec is refused: one per engine that each engine can run."""
    base = {
        "model": {
            "family": "transformer",
            "vocab_size": 1024,
            "hidden_size": 256,
            "num_layers": 4,
            "num_heads": 8,
            "ffn_hidden_size": 512,
        },
        "backend": "torch",
        "resources": {"devices": 8, "memory": "80GiB"},
    }
    cases = {
        "torchtitan": {
            "mesh": {"dp_shard": 4, "tp": 2, "gradient_accumulation_steps": 2},
            "training": {"global_batch_size": 16, "micro_batch_size": 2, "seq_len": 256, "sequence_parallel": True},
        },
        "megatron": {
            "mesh": {"dp_shard": 2, "tp": 2, "pp": 2, "microbatches": 4},
            "training": {
                "global_batch_size": 8,
                "micro_batch_size": 1,
                "seq_len": 256,
                "distributed_optimizer": True,
                "sequence_parallel": True,
            },
        },
        "deepspeed": {
            "mesh": {"dp_shard": 8, "gradient_accumulation_steps": 2},
            "training": {"global_batch_size": 32, "micro_batch_size": 2, "seq_len": 256},
        },
    }
    for target, part in cases.items():
        spec = Spec.model_validate({**base, **part})
        assert round_trip(spec, target, tmp_path / target), target


# ------------------------------------------------------------------- the engines' own parsers (the `engines` extra)


@pytest.mark.parametrize(
    "name",
    [
        "llama-3.1-8b.json",
        "mixtral-8x7b-v0.1.json",
        "qwen3-30b-a3b.json",
        "qwen1.5-moe-a2.7b.json",
        "llama-4-maverick-17b-128e-text.json",
        "gpt-neox-20b.json",
    ],
)
def test_transformers_autoconfig_reads_our_hf_configs_as_we_do(tmp_path, name):
    """The model config.json export writes (for torchtitan and DeepSpeed) is parsed by transformers' AutoConfig
    from the local file, and its sizes are the spec's."""
    transformers = pytest.importorskip("transformers")
    from mixle_compile.export.hf import hf_config, hf_config_text
    from mixle_compile.importers.hf import hf_model, read_hf_document

    model = TransformerModel.model_validate(
        hf_model(read_hf_document(ROOT / "tests" / "corpus" / "importers" / "hf" / name)).model
    )
    config, why = hf_config(model)
    assert config is not None, why
    path = tmp_path / "config.json"
    path.write_text(hf_config_text(config))
    hf = transformers.AutoConfig.from_pretrained(str(path))
    assert hf.model_type == config["model_type"]
    layers = getattr(hf, "num_hidden_layers", None) or hf.n_layer
    assert (hf.vocab_size, hf.hidden_size, layers, hf.num_attention_heads) == (
        model.vocab_size,
        model.hidden_size,
        model.num_layers,
        model.num_heads,
    )
    assert getattr(hf, "num_key_value_heads", hf.num_attention_heads) == (model.num_kv_heads or model.num_heads)
    dense = getattr(hf, "intermediate_size_mlp", hf.intermediate_size)  # Llama 4 names its dense MLP's width so
    assert dense == model.ffn_hidden_size and bool(hf.tie_word_embeddings) == model.tie_embeddings
    if model.num_experts:
        experts = getattr(hf, "num_local_experts", None) or hf.num_experts
        assert (experts, hf.num_experts_per_tok) == (model.num_experts, model.experts_per_token)
    if hf.model_type == "llama4_text":  # its shared expert is as wide as a routed one; its MoE layers listed
        assert hf.intermediate_size == model.moe_shared_expert_hidden_size == model.moe_ffn_hidden_size
        assert hf.moe_layers == [i for i in range(model.num_layers) if i % 2 == 1]
    else:
        assert getattr(hf, "shared_expert_intermediate_size", None) == model.moe_shared_expert_hidden_size


def _toml_era_config_manager():
    """torchtitan's TOML-era ConfigManager (0.2.x), where that release is the one installed."""
    try:
        from torchtitan.config.manager import ConfigManager
    except ImportError:
        return None
    return ConfigManager if hasattr(ConfigManager, "_maybe_load_toml") else None


@pytest.mark.parametrize(
    "spec_file", ["llama3-8b-hsdp-tp.yaml", *[p.name for p in PRODUCTION if p.parent.name == "torchtitan"]]
)
def test_torchtitan_config_manager_reads_the_exported_toml_as_we_do(tmp_path, spec_file):
    """torchtitan 0.2.2's own ConfigManager parses the exported job TOML (it refuses unknown keys), and the
    JobConfig it builds has the spec's degrees, batch, schedule and checkpointing. Needs torchtitan 0.2.x
    installed (the engines extra installs 0.3.0, whose configs are Python)."""
    manager = _toml_era_config_manager()
    if manager is None:
        pytest.skip("torchtitan's TOML ConfigManager (0.2.x) is not installed")
    path = (
        EXAMPLES / spec_file if (EXAMPLES / spec_file).exists() else next(p for p in PRODUCTION if p.name == spec_file)
    )
    spec = on_backend(load_spec(path).spec, "torchtitan")
    try:
        exported = export_spec(spec, "torchtitan")
    except ExportRefused:
        pytest.skip("not exportable to torchtitan")
    for name, text in exported.files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    job = manager().parse_args(["--job.config_file", str(tmp_path / exported.main)])
    m, t, p = spec.mesh, spec.training, job.parallelism
    assert (
        p.data_parallel_replicate_degree,
        p.data_parallel_shard_degree,
        p.tensor_parallel_degree,
        p.pipeline_parallel_degree,
        p.context_parallel_degree,
        p.expert_parallel_degree,
        p.expert_tensor_parallel_degree,
    ) == (m.dp_replicate, -1 if m.dp_shard == "auto" else m.dp_shard, m.tp, m.pp, m.cp, m.ep, m.etp)
    assert (
        job.training.local_batch_size,
        job.training.global_batch_size,
        job.training.seq_len,
        job.training.steps,
    ) == (t.micro_batch_size * m.microbatches, t.global_batch_size, t.seq_len, t.steps)
    assert job.activation_checkpoint.mode == t.activation_checkpointing and job.debug.seed == t.seed
    assert job.optimizer.lr == t.learning_rate
    if m.pp > 1:
        assert p.pipeline_parallel_microbatch_size == t.micro_batch_size
        assert (
            p.pipeline_parallel_schedule
            == {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved_1f1b": "Interleaved1F1B"}[t.pipeline_schedule]
        )
    assert ("float8" in job.model.converters) == (t.precision == "fp8")


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(
    micro=st.integers(1, 8),
    accumulation=st.integers(1, 4),
    dp=st.sampled_from([1, 2, 4, 8, 16]),
    shard=st.booleans(),
    precision=st.sampled_from(["bf16", "fp16", "fp32"]),
)
def test_deepspeed_config_class_reads_the_exported_json_as_the_spec_says(
    tmp_path_factory, micro, accumulation, dp, shard, precision
):
    """DeepSpeed's own DeepSpeedConfig (where deepspeed installs) parses the exported JSON: its batch identity holds
    on the spec's data-parallel ranks, with the spec's sizes, ZeRO stage and precision."""
    try:
        from deepspeed.runtime import config as ds_config
    except ImportError:
        pytest.skip("deepspeed is not installed")
    spec = Spec.model_validate(
        {
            "model": {
                "family": "transformer",
                "vocab_size": 1024,
                "hidden_size": 256,
                "num_layers": 2,
                "num_heads": 4,
                "ffn_hidden_size": 512,
            },
            "mesh": {
                "dp_shard": dp if shard else 1,
                "dp_replicate": 1 if shard else dp,
                "gradient_accumulation_steps": accumulation,
            },
            "training": {
                "global_batch_size": micro * accumulation * dp,
                "micro_batch_size": micro,
                "seq_len": 128,
                "precision": precision,
                "distributed_optimizer": not shard and dp > 1,
            },
            "backend": "torch",
            "resources": {"devices": dp, "memory": "80GiB"},
        }
    )
    exported = export_spec(spec, "deepspeed")
    path = tmp_path_factory.mktemp("ds") / exported.main
    path.write_text(exported.files[exported.main])
    original = ds_config.dist.get_rank
    ds_config.dist.get_rank = lambda *args, **kwargs: 0
    try:

        class DataParallel:
            def get_data_parallel_world_size(self):
                return dp

        ds = ds_config.DeepSpeedConfig(str(path), mpu=DataParallel())
    finally:
        ds_config.dist.get_rank = original
    assert (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (
        spec.training.global_batch_size,
        micro,
        accumulation,
    )
    assert ds.zero_optimization_stage == (3 if shard and dp > 1 else 1 if dp > 1 else 0)
    assert (ds.bfloat16_config.enabled, ds.float16_config.enabled) == (precision == "bf16", precision == "fp16")


# ---- torchtitan 0.3: a Python config-registry function returning Trainer.Config


def _torchtitan_source(relative: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec("torchtitan")
    if spec is None or spec.origin is None:
        pytest.skip("torchtitan is not installed")
    path = Path(spec.origin).parent / relative
    if not path.is_file():
        pytest.skip(f"this torchtitan has no {relative} (not 0.3)")
    return path


def _trainer_config_fields() -> set[str]:
    """Trainer.Config's fields, read off torchtitan/trainer.py (importing it needs triton)."""
    import ast

    tree = ast.parse(_torchtitan_source("trainer.py").read_text())
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    config = next(n for n in trainer.body if isinstance(n, ast.ClassDef) and n.name == "Config")
    return {n.target.id for n in config.body if isinstance(n, ast.AnnAssign)}


def _registered_flavors(family: str) -> set[str]:
    import ast

    tree = ast.parse(_torchtitan_source(f"models/{family}/__init__.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == f"{family}_configs" for t in node.targets):
            return {k.value for k in node.value.keys}
    raise AssertionError(f"no {family}_configs in torchtitan/models/{family}/__init__.py")


def _evaluated_config(text: str):
    """The Trainer.Config keywords of the written function, each evaluated with torchtitan's own config classes
    (torchtitan.config, activation_checkpoint, default_adamw, all importable without triton); the model is
    named by its family and flavor, as ModelSpec.name/.flavor carry them."""
    import ast
    from types import SimpleNamespace

    config_module = pytest.importorskip("torchtitan.config")
    if not hasattr(config_module, "ParallelismConfig"):
        pytest.skip("this torchtitan has no Python configs")
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    tree = ast.parse(text)
    (function,) = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    (ret,) = [n for n in ast.walk(function) if isinstance(n, ast.Return)]
    call = ret.value
    assert ast.unparse(call.func) == "Trainer.Config"
    names = {
        "default_adamw": default_adamw,
        "SelectiveAC": SelectiveAC,
        "FullAC": FullAC,
        **{
            n: getattr(config_module, n)
            for n in ("CompileConfig", "DebugConfig", "ParallelismConfig", "TrainingConfig")
        },
    }
    module = next(
        n.module
        for n in tree.body
        if isinstance(n, ast.ImportFrom) and any(a.name == "model_registry" for a in n.names)
    )
    values = {}
    for kw in call.keywords:
        if kw.arg == "model_spec":
            assert ast.unparse(kw.value.func) == "model_registry"
            family = module.rsplit(".", 1)[1]
            values[kw.arg] = SimpleNamespace(name=family, flavor=kw.value.args[0].value, model=None)
        else:
            values[kw.arg] = eval(compile(ast.Expression(kw.value), "<exported>", "eval"), names)  # noqa: S307 (our own output)
    return function.name, module, values


def test_torchtitan_03_export_uses_torchtitans_own_classes_and_fields():
    """Every keyword the written function passes is a field of the torchtitan 0.3.0 class it constructs
    (the dataclasses of torchtitan/config/configs.py; Trainer.Config's fields from torchtitan/trainer.py) and
    the flavor is one its model_registry registers."""
    import dataclasses

    exported = export_spec(load_spec(EXAMPLES / "llama3-8b-hsdp-tp.yaml").spec, "torchtitan", torchtitan_version="0.3")
    assert exported.main == "train.py"
    name, module, values = _evaluated_config(exported.files[exported.main])
    assert name == "train" and module == "torchtitan.models.llama3"
    assert set(values) <= _trainer_config_fields()
    for table in ("training", "parallelism", "compile", "debug"):
        assert dataclasses.is_dataclass(values[table])
    assert values["model_spec"].flavor in _registered_flavors("llama3")
    assert values["parallelism"].tensor_parallel_degree == 8 and values["training"].seq_len == 8192


def test_torchtitan_03_export_round_trips_through_the_registry_reader(tmp_path):
    """import(export(spec)) == spec for every example and production spec the 0.3 writer takes: the written
    values, built by torchtitan's own config classes, are read by the same reader as `check --torchtitan`."""
    from types import SimpleNamespace

    from mixle_compile.importers.torchtitan import import_job
    from mixle_compile.importers.torchtitan_registry import trainer_config_tables
    from mixle_compile.spec.source import SourceDocument

    done = []
    for path in SPECS:
        spec = load_spec(path).spec
        try:
            exported = export_spec(spec, "torchtitan", torchtitan_version="0.3")
        except ExportRefused as exc:
            assert exc.reasons and all(r for _, r in exc.reasons)
            continue
        text = exported.files[exported.main]
        _, _, values = _evaluated_config(text)
        doc = SourceDocument(file="train.py", data=trainer_config_tables(SimpleNamespace(**values)))
        back, diags = import_job(doc, text, tmp_path, ImportOptions(), version="0.3", source_format="torchtitan-python")
        assert not [d for d in diags if d.severity.value == "error"], [d.text() for d in diags]
        want = canonical(on_backend(spec, "torchtitan", "0.3"))
        assert canonical(Spec.model_validate(back.data)) == want, text
        done.append(path.name)
    assert len(done) >= 10, done


def test_torchtitan_03_export_live_round_trip(tmp_path, monkeypatch, capsys):
    """Where torchtitan's trainer imports, `check --torchtitan module:function` reads the written module itself."""
    try:
        import torchtitan.models.llama3  # noqa: F401
        import torchtitan.trainer  # noqa: F401
    except ImportError as exc:
        pytest.skip(
            f"torchtitan 0.3's trainer or model registry does not import here: {exc} (torchtitan.trainer needs "
            "torchdata; the model registry imports triton through torchtitan/distributed/minimal_async_ep)"
        )
    spec = load_spec(EXAMPLES / "llama3-8b-hsdp-tp.yaml").spec
    exported = export_spec(spec, "torchtitan", torchtitan_version="0.3", stem="exported_llama")
    (tmp_path / exported.main).write_text(exported.files[exported.main])
    monkeypatch.syspath_prepend(str(tmp_path))
    from mixle_compile.importers.torchtitan_registry import load_registry_function, read_trainer_config

    function, config = load_registry_function("exported_llama:exported_llama")
    doc, _ = read_trainer_config(function, config, "exported_llama:exported_llama", ImportOptions())
    assert canonical(Spec.model_validate(doc.data)) == canonical(on_backend(spec, "torchtitan", "0.3"))


def test_torchtitan_version_follows_the_spec_backend_and_refuses_what_03_cannot_say(write):
    spec = load_spec(EXAMPLES / "llama3-8b-hsdp-tp.yaml").spec
    data = spec.model_dump(mode="json", exclude_none=True)
    on_03 = Spec.model_validate({**data, "backend": {"name": "torchtitan", "version": "0.3"}})
    assert export_spec(on_03, "torchtitan").main == "train.py"
    assert export_spec(on_03, "torchtitan", torchtitan_version="0.2").main == "train.toml"
    custom = Spec.model_validate({**data, "model": {**data["model"], "num_layers": 30}})
    with pytest.raises(ExportRefused) as info:
        export_spec(custom, "torchtitan", torchtitan_version="0.3")
    assert "model_registry(flavor)" in str(info.value) and "not a published flavor" in str(info.value)


def test_export_cli_writes_a_torchtitan_03_module(tmp_path, capsys):
    out = tmp_path / "my_llama.py"
    status = cli.main(
        [
            "export",
            "--to",
            "torchtitan",
            "--torchtitan-version",
            "0.3",
            str(EXAMPLES / "llama3-8b-hsdp-tp.yaml"),
            "-o",
            str(out),
        ]
    )
    capsys.readouterr()
    assert status == 0 and "def my_llama() -> Trainer.Config:" in out.read_text()
    status = cli.main(
        ["export", "--to", "torchtitan", "--torchtitan-version", "0.4", str(EXAMPLES / "llama3-8b-hsdp-tp.yaml")]
    )
    assert status == 2 and "invalid choice" in capsys.readouterr().err


def test_async_tensor_parallelism_is_written_as_each_engine_states_it():
    titan = load_spec(ROOT / "tests/corpus/production/torchtitan/llama3_70b_256gpu_fsdp32_tp8_asynctp.yaml").spec
    toml = export_spec(titan, "torchtitan")
    assert "enable_async_tensor_parallel = true" in toml.files[toml.main]
    module = export_spec(titan, "torchtitan", torchtitan_version="0.3")
    _, _, values = _evaluated_config(module.files[module.main])
    assert values["compile"].enable_async_tensor_parallel is True and values["compile"].enable is True
    bridge = load_spec(ROOT / "tests/corpus/production/bridge_nemo/bridge_llama3_70b_h100_bf16_v2.yaml").spec
    script = export_spec(bridge, "megatron")
    assert "--tp-comm-overlap" in script.files[script.main] and "--sequence-parallel" in script.files[script.main]
    plain = titan.model_copy(update={"training": titan.training.model_copy(update={"async_tensor_parallel": False})})
    assert "enable_async_tensor_parallel" not in export_spec(plain, "torchtitan").files["train.toml"]


@pytest.mark.parametrize("virtual", [1, 2])
@pytest.mark.parametrize("kind", ["accounted", "uneven"])
def test_megatron_layer_splits_round_trip_as_megatron_lm_flags(tmp_path, virtual, kind):
    from mixle_compile.layer_split import megatron_accounted, megatron_uneven

    spec = load_spec(EXAMPLES / "mixtral-moe-ep.yaml").spec
    if kind == "accounted":  # 30 layers and the embedding and loss: 32 slots, [7, 8, 8, 7] or [3, 4 x 6, 3]
        layers, split, flags = 30, megatron_accounted(30, 4, virtual, True, True), ["--account-for-embedding"]
    else:  # the first and last ranks 4 layers each, the middle ranks 12: [4, 12, 12, 4] or [2, 6, 6, 2] x 2
        layers, split, flags = 32, megatron_uneven(32, 4, virtual, 4, 4), ["--decoder-first-pipeline-num-layers 4"]
    training = spec.training.model_copy(
        update={
            "pipeline_layers": list(split),
            "virtual_pipeline_stages": virtual,
            "pipeline_schedule": "interleaved_1f1b" if virtual > 1 else "1f1b",
        }
    )
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"num_layers": layers}), "training": training})
    exported = export_spec(spec, "megatron")
    text = exported.files[exported.main]
    assert all(flag in text for flag in flags), text
    assert ("--num-virtual-stages-per-pipeline-rank 2" in text) == (virtual == 2)
    assert "--num-layers-per-virtual-pipeline-stage" not in text
    assert round_trip(spec, "megatron", tmp_path)


def test_an_exported_megatron_moe_launch_runs_the_dispatcher_the_plan_prices(tmp_path):
    """Megatron's default token dispatcher is allgather; the export names alltoall, so reading it back
    raises no dispatcher warning."""
    exported = export_spec(load_spec(EXAMPLES / "mixtral-moe-ep.yaml").spec, "megatron")
    for name, text in exported.files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    _, diagnostics = read_any(tmp_path / exported.main, exported.main, ImportOptions())
    assert not [d for d in diagnostics if "dispatcher" in d.text()], [d.text() for d in diagnostics]
    without = exported.files[exported.main].replace("--moe-token-dispatcher-type alltoall", "")
    (tmp_path / exported.main).write_text(without)
    _, diagnostics = read_any(tmp_path / exported.main, exported.main, ImportOptions())
    assert [d for d in diagnostics if "`allgather` token dispatcher" in d.text()]


def test_a_flex_dispatcher_is_written_as_each_engine_states_it(tmp_path):
    spec = load_spec(EXAMPLES / "mixtral-moe-ep.yaml").spec
    flex = spec.model_copy(update={"training": spec.training.model_copy(update={"expert_dispatcher": "flex"})})
    exported = export_spec(flex, "megatron")
    assert "--moe-token-dispatcher-type flex" in exported.files[exported.main]
    assert round_trip(flex, "megatron", tmp_path / "megatron")
    data = flex.model_dump(mode="json")
    data["training"]["distributed_optimizer"] = False  # torchtitan has no ZeRO-1 (E-rules)
    for version in ("0.2", "0.3"):
        data["backend"] = {"name": "torchtitan", "version": version}
        titan = load_spec_text(yaml.safe_dump(data), "titan.yaml").spec
        if version == "0.2":
            toml = export_spec(titan, "torchtitan")
            assert 'expert_parallel_comm_backend = "deepep"' in toml.files[toml.main]
            assert round_trip(titan, "torchtitan", tmp_path / "titan")
        else:
            with pytest.raises(ExportRefused) as refused:
                export_spec(titan, "torchtitan")
            assert any(field == "training.expert_dispatcher" for field, _ in refused.value.reasons)


def test_megatron_pipeline_overlap_is_written_where_the_launch_would_differ(tmp_path):
    text = """
model: {family: transformer, vocab_size: 256, hidden_size: 64, num_layers: 8, num_heads: 4, ffn_hidden_size: 128}
mesh: {pp: 2, microbatches: 4}
training: {global_batch_size: 4, seq_len: 32, pipeline_schedule: interleaved_1f1b, virtual_pipeline_stages: 2 EXTRA}
backend: {name: megatron, version: "0.16", entry: ENTRY}
resources: {devices: 2, memory: 8GiB}
"""
    for entry, extra, written in [
        ("arguments", "", False),  # Megatron-LM's default: on, nothing to write
        ("arguments", ", overlap_pipeline_transfers: false", True),
        ("core", "", True),  # Megatron-Core's default is off: the Megatron-LM launch must turn it off
        ("core", ", overlap_pipeline_transfers: true", False),
    ]:
        spec = load_spec_text(text.replace("ENTRY", entry).replace(" EXTRA", extra), "p.yaml").spec
        exported = export_spec(spec, "megatron")
        assert ("--no-overlap-p2p-communication" in exported.files[exported.main]) == written, (entry, extra)
        assert round_trip(spec, "megatron", tmp_path / f"{entry}{len(extra)}")
        # to torchtitan, whose pipelining has no such switch (P012), the field is left out
        assert round_trip(spec, "torchtitan", tmp_path / f"titan-{entry}{len(extra)}")


def test_recompute_modules_reach_megatron_and_moe_act_comes_with_grouped_gemm(tmp_path):
    """The list is exported as --recompute-modules and read back; an MoE launch names --moe-grouped-gemm, without
    which Megatron-Core refuses moe_act (transformer_config.py) and the importer says so (I005)."""
    spec = load_spec(EXAMPLES / "mixtral-moe-ep.yaml").spec
    training = spec.training.model_copy(
        update={"activation_checkpointing": "selective", "recompute_modules": ["moe_act", "layernorm"]}
    )
    spec = spec.model_copy(update={"training": training, "backend": "megatron"})
    exported = export_spec(spec, "megatron")
    launch = exported.files[exported.main]
    assert "--recompute-modules moe_act layernorm" in launch and "--moe-grouped-gemm" in launch
    for name, text in exported.files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    doc, diagnostics = read_any(tmp_path / exported.main, exported.main, ImportOptions())
    assert doc.data["training"]["recompute_modules"] == ["moe_act", "layernorm"]
    assert not [d for d in diagnostics if d.severity.value == "error"], [d.message for d in diagnostics]


@pytest.mark.parametrize("target", TARGETS)
def test_multi_token_prediction_is_written_or_refused_never_dropped(target, tmp_path):
    # an exported config without the depths would train another model without saying so
    def exports(spec) -> bool:
        try:
            export_spec(spec, target)
        except ExportRefused:
            return False
        return True

    names = ("tiny-transformer.yaml", "mixtral-moe-ep.yaml", "llama3-8b-hsdp-tp.yaml", "export/zero3-8-gpus.yaml")
    base = next(s for s in (load_spec(EXAMPLES / n).spec for n in names) if exports(s))  # one exports as is
    spec = base.model_copy(update={"model": base.model.model_copy(update={"mtp_num_layers": 1})})
    try:
        exported = export_spec(spec, target)
    except ExportRefused as refused:
        assert any("mtp_num_layers" in f"{field} {why}" for field, why in refused.reasons), refused.reasons
        return
    assert reimport(exported, tmp_path, spec).model.mtp_num_layers == 1


@pytest.mark.parametrize("virtual", [1, 4])
def test_any_megatron_split_exports_as_a_pipeline_layout(tmp_path, virtual):
    """A listed split that is neither an accounted nor a first/last split is written as
    --pipeline-model-parallel-layout (Megatron-LM 0.13 and later) and reads back as itself, the
    multi-token prediction layers with the loss on the last stage."""
    spec = load_spec(ROOT / "tests/corpus/production/bridge_nemo/bridge_deepseek_v3_h100_bf16_v1.yaml").spec
    split = [1] + [2] * 30 + [0] if virtual == 4 else [5, 7, 8, 8, 8, 8, 8, 9]
    training = spec.training.model_copy(
        update={
            "pipeline_layers": split,
            "virtual_pipeline_stages": virtual,
            "pipeline_schedule": "interleaved_1f1b" if virtual > 1 else "1f1b",
        }
    )
    spec = spec.model_copy(update={"training": training})
    exported = export_spec(spec, "megatron")
    text = exported.files[exported.main]
    assert "--pipeline-model-parallel-layout" in text and "mL" in text, text
    assert "--num-virtual-stages-per-pipeline-rank" not in text and "--num-layers-per-virtual" not in text
    assert round_trip(spec, "megatron", tmp_path)


def test_latent_attention_with_learned_positions_exports_to_megatron_only(tmp_path):
    """An MLA model with Megatron's learned position table: Megatron-LM's launch says it
    (--position-embedding-type learned_absolute) and reads back the same; an HF DeepSeek-V3 config has no
    such table and is refused by field, never written without it."""
    spec = load_spec(ROOT / "tests/corpus/production/bridge_nemo/bridge_deepseek_v3_h100_bf16_v1.yaml").spec
    model = spec.model.model_copy(update={"position_embedding": "learned", "mtp_num_layers": 0})
    spec = spec.model_copy(update={"model": model})
    exported = export_spec(spec, "megatron")
    assert "--position-embedding-type learned_absolute" in exported.files[exported.main]
    assert round_trip(spec, "megatron", tmp_path)
    from mixle_compile.export.hf import hf_config

    config, why = hf_config(spec.model, spec.training.seq_len)
    assert config is None and "learned position table" in why


@pytest.mark.parametrize("split, virtual", [([7, 9, 9, 7], 2), ([20, 12], 1), ("even", 2)])
def test_a_listed_split_exports_to_torchtitan_as_module_fqns_and_reads_back(tmp_path, split, virtual):
    """torchtitan's module_fqns_per_model_part carries any split (the embedding first, the final norm and
    output last), which the importer reads back as the same listed split."""
    data = yaml.safe_load((EXAMPLES / "llama3-8b-hsdp-tp.yaml").read_text())  # Llama 3 8B's 32 layers
    data["mesh"] = {"dp_shard": 4, "pp": 2, "microbatches": 8}
    data["training"] = {
        "global_batch_size": 32,
        "micro_batch_size": 1,
        "seq_len": 2048,
        "pipeline_schedule": "interleaved_1f1b" if virtual > 1 else "1f1b",
        "virtual_pipeline_stages": virtual,
        "pipeline_layers": split,
    }
    data["backend"] = {"name": "torchtitan", "version": "0.2"}
    data["resources"] = {"devices": 8, "memory": "80GiB"}
    spec = load_spec_text(yaml.safe_dump(data), "s.yaml").spec
    exported = export_spec(spec, "torchtitan")
    assert "module_fqns_per_model_part" in exported.files[exported.main]
    if split == "even":  # read back as the list it is
        spec = spec.model_copy(update={"training": spec.training.model_copy(update={"pipeline_layers": [8, 8, 8, 8]})})
    assert round_trip(spec, "torchtitan", tmp_path)

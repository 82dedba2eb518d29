"""The step-time model: its parts behave as their formulas say, explain and diff show it, and it
predicts published measurements (benchmarks/bench_step_time.py holds every row; a few quick ones
are checked here)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import yaml

from mixle_compile import cli
from mixle_compile.lower.lowering import lower
from mixle_compile.spec import load_spec_text
from mixle_compile.step_time import attention_length_factor, fused_attention_rate, predict_lowered, ring_bytes
from tests.conftest import EXAMPLES, ROOT

SPEC = """\
model: {family: transformer, vocab_size: 32000, hidden_size: 4096, num_layers: 8, num_heads: 32, ffn_hidden_size: 11008}
mesh: {dp_shard: DS, tp: TP, gradient_accumulation_steps: GA}
training: {global_batch_size: GBS, micro_batch_size: 1, seq_len: 4096, activation_checkpointing: AC, \
sequence_parallel: SP}
backend: torch
resources: {devices: 8, kind: h100, memory: 80GiB}
"""


#: Llama 3 8B's dimensions, as step_time reads a spec's model.
LLAMA3_8B = {
    "family": "transformer",
    "hidden_size": 4096,
    "num_heads": 32,
    "num_kv_heads": 8,
    "ffn_hidden_size": 14336,
    "vocab_size": 128256,
    "num_layers": 32,
}


def predicted(ds=8, tp=1, ga=1, ac="none"):
    text = (
        SPEC.replace("DS", str(ds))
        .replace("TP", str(tp))
        .replace("GA", str(ga))
        .replace("AC", ac)
        .replace("GBS", str(ds * ga))
        .replace("SP", str(tp > 1).lower())
    )
    spec = load_spec_text(text, "s.yaml").spec
    return predict_lowered(spec, lower(spec, schedule=False))


def test_ring_costs():
    assert ring_bytes("all_reduce", 4, 100) == 150
    assert ring_bytes("all_gather", 4, 100) == ring_bytes("reduce_scatter", 4, 100) == 75
    assert ring_bytes("p2p", 2, 100) == 100 and ring_bytes("none", 4, 100) == 0


def test_compute_follows_the_work():
    base = predicted()
    assert predicted(ga=2).compute == pytest.approx(2 * base.compute)  # twice the micro-steps
    full = predicted(ac="full")
    assert 1.2 * base.compute < full.compute < 1.4 * base.compute  # one forward more: about 4/3
    split = predicted(ds=4, tp=2)  # a step of half the samples, each layer split over two ranks
    assert split.compute == pytest.approx(base.compute / 2, rel=0.1)
    assert split.exposed_communication.get("tp", 0) > 0  # tensor-parallel traffic is not hidden
    assert base.tokens_per_second == pytest.approx(8 * 4096 / base.seconds)
    assert 0 < base.mfu < 1


def test_explain_and_diff_show_the_prediction(capsys, tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    text = (EXAMPLES / "tiny-transformer.yaml").read_text().replace("kind: cpu", "kind: h100")
    (tmp_path / "a.yaml").write_text(text)
    (tmp_path / "b.yaml").write_text(text.replace("seq_len: 32", "seq_len: 64"))
    assert cli.main(["compile", str(tmp_path / "a.yaml"), "-o", str(a)]) == 0
    assert cli.main(["compile", str(tmp_path / "b.yaml"), "-o", str(b)]) == 0
    capsys.readouterr()
    cli.main(["explain", str(a)])
    out = capsys.readouterr().out
    assert "predicted step time:" in out and "tokens/s" in out and "compute" in out
    cli.main(["explain", str(a), "--format", "json"])
    step = json.loads(capsys.readouterr().out)["step_time"]
    assert step["seconds"] > 0 and step["compute"] <= step["seconds"]
    cli.main(["diff", str(a), str(b)])
    assert "predicted step time:" in capsys.readouterr().out


@pytest.mark.parametrize(
    "name, reason", [("modules-mlp.yaml", "transformer"), ("tiny-transformer.yaml", "resources.throughput")]
)
def test_a_plan_without_a_prediction_says_why(capsys, tmp_path, name, reason):
    plan = tmp_path / "m.json"
    assert cli.main(["compile", str(EXAMPLES / name), "-o", str(plan)]) == 0
    capsys.readouterr()
    cli.main(["explain", str(plan)])
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("predicted step time"))
    assert "not available" in line and reason in line


def _bench():
    spec = importlib.util.spec_from_file_location("bench_step_time", ROOT / "benchmarks" / "bench_step_time.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "label",
    [
        "titan T1 8B FSDP",
        "titan T1 8B FSDP+compile+fp8",
        "SC21 GPT 1.7B",
        "SC21 GPT 7.5B",
        "bridge 8B FSDP8 GA16",
        "titan H200 8B FSDP32 fp8",
        "bridge GB200 8B DDP8 GA8",
        "bridge B200 8B DDP8 GA8",
    ],
)
def test_published_rows_are_predicted_within_15_percent(label):
    bench = _bench()
    ((data, measured),) = [(d, m) for name, d, m in bench.ROWS if name == label]
    spec = load_spec_text(yaml.safe_dump(data), "row.yaml").spec
    ratio = predict_lowered(spec, lower(spec, schedule=False)).tokens_per_second_per_device / measured
    assert 0.85 <= ratio <= 1.15, ratio


def test_an_nvl72_rack_is_one_nvlink_domain():
    """GB200 NVL72: 64 ranks of one group talk over NVLink; DGX B200's 8-GPU nodes send them over the network."""
    from mixle_compile import step_time

    def bandwidth(kind: str) -> float:
        return step_time.link_bandwidth(
            ["dp_shard"], {"dp_shard": 64}, "tp-cp-ep-dp-pp", {"resources": {"devices": 64, "kind": kind}}
        )

    assert bandwidth("gb200") == step_time.DEVICES["gb200"]["intra_node"]
    assert bandwidth("b200") == step_time.DEVICES["b200"]["inter_node"]


def test_the_topology_sets_the_links_a_group_crosses(monkeypatch):
    from mixle_compile import step_time

    text = (
        SPEC.replace("DS", "4")
        .replace("TP", "2")
        .replace("GA", "1")
        .replace("AC", "none")
        .replace("GBS", "4")
        .replace("SP", "true")
    )

    def exposed_tp(topology: str, latency: str = "intra_node_latency: 1ns, inter_node_latency: 1ns") -> float:
        topology = topology[:-1] + (", " if len(topology) > 2 else "") + latency + "}" if latency else topology
        spec = load_spec_text(text.replace("memory: 80GiB}", f"memory: 80GiB, topology: {topology}}}"), "t.yaml").spec
        return predict_lowered(spec, lower(spec, schedule=False)).exposed_communication["tp"]

    # the bytes' part (no base latency, link latencies of a nanosecond): the link's bandwidth
    monkeypatch.setattr(step_time, "BASE_LATENCY", 0.0)
    inside = exposed_tp("{devices_per_node: 8}")
    across = exposed_tp("{devices_per_node: 1, inter_node_bandwidth: 400Gb/s}")  # every tp pair now spans two nodes
    assert across == pytest.approx(inside * 450e9 / 50e9, rel=1e-3)
    assert exposed_tp("{intra_node_bandwidth: 900GB/s}") == pytest.approx(inside / 2, rel=1e-3)
    # the calls' part: NCCL's ring latency, its base and one link latency per step (tp 2: 2 steps per
    # all-reduce, 1 per gather or scatter), over the network's once the pair spans two nodes
    slow = exposed_tp("{devices_per_node: 8}", "intra_node_latency: 1ms, inter_node_latency: 1ns")
    assert slow > inside + 1e-3
    apart = exposed_tp("{devices_per_node: 1}")
    assert exposed_tp("{devices_per_node: 1}", "intra_node_latency: 1ms, inter_node_latency: 1ns") == pytest.approx(
        apart, rel=1e-6
    )
    assert exposed_tp("{devices_per_node: 1}", "intra_node_latency: 1ns, inter_node_latency: 1ms") > apart + 1e-3
    bad = load_spec_text(
        text.replace("memory: 80GiB}", "memory: 80GiB, topology: {inter_node_bandwidth: 3GiB/s}}"), "t.yaml"
    )
    (d,) = bad.diagnostics
    assert d.code == "S005" and "cannot read bandwidth '3GiB/s'" in d.message


def test_async_tensor_parallelism_hides_tp_traffic_behind_the_matmuls():
    # torchtitan's async TP table (benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md): the same 70B
    # run with and without it; the predicted speed-up is the measured one within a few percent.
    bench = _bench()
    rows = {name: (d, m) for name, d, m in bench.ROWS}
    out = {}
    for mode in ("vanilla", "async"):
        data, measured = rows[f"titan aTP 70B fp8 {mode}"]
        spec = load_spec_text(yaml.safe_dump(data), "row.yaml").spec
        out[mode] = (predict_lowered(spec, lower(spec, schedule=False)), measured)
    (vanilla, v_measured), (overlapped, a_measured) = out["vanilla"], out["async"]
    exposed, hidden = overlapped.exposed_communication.get("tp", 0), overlapped.hidden_communication["tp"]
    # Most is hidden; what is fused with no matmul (the embedding's reduce-scatter, the loss's gather)
    # or exceeds its matmuls stays exposed; together they are the vanilla run's traffic.
    assert 0 < exposed < vanilla.exposed_communication["tp"] / 4
    assert hidden + exposed == pytest.approx(vanilla.exposed_communication["tp"])
    # Each chunk's matmul reads the whole local weight: async TP moves more bytes for the same FLOPs.
    assert vanilla.compute < overlapped.compute < vanilla.compute * 1.02
    speedup = overlapped.tokens_per_second_per_device / vanilla.tokens_per_second_per_device
    assert speedup == pytest.approx(a_measured / v_measured, rel=0.05)


def test_async_tensor_parallelism_hides_a_collective_behind_its_own_matmuls_only():
    # A collective of 9 s fused with matmuls of 8 s at tp 4 hides behind (tp - 1) / tp of them (6 s);
    # one fused with none (the embedding's) stays exposed, however much other compute the step has.
    from mixle_compile.step_time import _setting, combine

    bench = _bench()
    data, _ = {name: (d, m) for name, d, m in bench.ROWS}["titan aTP 70B fp8 async"]
    st = _setting(data)
    degrees = {"tp": 4, "world_size": 8}
    traffic = [(["tp"], "activation", 9.0, 8.0), (["tp"], "activation", 1.0, 0.0)]
    step = combine(st, degrees, 100.0, 2.0, traffic, 0.0, 0.0, flops_per_token=1.0)
    assert step.hidden_communication["tp"] == pytest.approx(6.0)
    assert step.exposed_communication["tp"] == pytest.approx(3.0 + 1.0)
    plain = _setting({**data, "training": {**data["training"], "async_tensor_parallel": False}})
    step = combine(plain, degrees, 100.0, 2.0, traffic, 0.0, 0.0, flops_per_token=1.0)
    assert step.exposed_communication["tp"] == pytest.approx(10.0) and "tp" not in step.hidden_communication


def test_the_matmuls_a_tp_collective_is_fused_with():
    from mixle_compile.step_time import fused_matmul_flops

    model = {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 128, "vocab_size": 256}
    full, op_level = {"activation_checkpointing": "full"}, {"activation_checkpointing": "selective"}
    qkv = 2 * 64 * (64 + 2 * 32) / 4
    assert fused_matmul_flops("layers.3.attn:in", model, full, "torchtitan", 4) == (qkv, True)
    assert fused_matmul_flops("layers.3.attn:in/grad", model, full, "torchtitan", 4) == (qkv, True)
    assert fused_matmul_flops("layers.3.attn:in/recompute", model, full, "torchtitan", 4) == (qkv, True)
    # op-level checkpointing recomputes k of q, k, v and w3 of w1, w3 (every second matmul)
    assert fused_matmul_flops("layers.3.attn:in/recompute", model, op_level, "torchtitan", 4) == (2 * 64 * 32 / 4, True)
    assert fused_matmul_flops("layers.3.mlp:in/recompute", model, op_level, "torchtitan", 4) == (2 * 64 * 128 / 4, True)
    assert fused_matmul_flops("layers.3.mlp:out/grad", model, full, "torchtitan", 4) == (2 * 128 * 64 / 4, True)
    assert fused_matmul_flops("lm_head:in", model, full, "torchtitan", 4) == (2 * 64 * 256 / 4, False)
    assert fused_matmul_flops("embed:out", model, full, "torchtitan", 4)[0] == 0
    assert fused_matmul_flops("lm_head:loss", model, full, "torchtitan", 4)[0] == 0


def test_matmul_operands_make_narrow_shards_slower_than_their_flops():
    # Every matmul reads its input and weight and writes its output at the memory bandwidth: split
    # over tp ranks, a layer's FLOPs divide by tp but its input rows do not, so tp 8 takes more than
    # an eighth of tp 1's time; at the fp8 peak the same bytes weigh twice as much.
    from mixle_compile import step_time

    spec = {
        "model": LLAMA3_8B,
        "training": {"seq_len": 8192, "micro_batch_size": 1, "sequence_parallel": True, "precision": "bf16"},
        "backend": "torchtitan",
        "resources": {"kind": "h100", "devices": 8},
    }
    one, _ = step_time.stage_compute(spec, 1, 1, [32])
    eight, _ = step_time.stage_compute(spec, 8, 1, [32])
    assert eight[0] * 8 > one[0] * 1.03
    saved = step_time.DEVICES["h100"]["memory_bandwidth"]
    try:
        step_time.DEVICES["h100"]["memory_bandwidth"] = 1e30  # no bytes cost: the split is exact again
        one_free, _ = step_time.stage_compute(spec, 1, 1, [32])
        eight_free, _ = step_time.stage_compute(spec, 8, 1, [32])
    finally:
        step_time.DEVICES["h100"]["memory_bandwidth"] = saved
    assert eight_free[0] * 8 == pytest.approx(one_free[0], rel=0.02)


def test_an_fp8_step_prices_its_casts_and_narrow_shards_pay_most(monkeypatch):
    # Dynamic scaling casts every matmul's input twice and its output's gradient twice per forward
    # and backward, FP8_CAST_BYTES an element at the memory bandwidth: two thirds of
    # (rows x inner + rows x output) per pass, three passes without checkpointing.
    from mixle_compile import step_time

    model = {**LLAMA3_8B, "num_layers": 2}
    training = {"seq_len": 8192, "micro_batch_size": 1, "sequence_parallel": True, "precision": "fp8"}
    spec = {"model": model, "training": training, "backend": "torchtitan", "resources": {"kind": "h100", "devices": 8}}
    bandwidth = step_time.DEVICES["h100"]["memory_bandwidth"]

    def cast_seconds(data, tp):
        monkeypatch.setattr(step_time, "FP8_CAST_BYTES", 0.0)
        without, _ = step_time.stage_compute(data, tp, 1, [2])
        monkeypatch.setattr(step_time, "FP8_CAST_BYTES", 5.0)
        with_casts, _ = step_time.stage_compute(data, tp, 1, [2])
        return with_casts[0] - without[0]

    # one layer's matmuls on a rank at tp 1: q/k/v, o, the gated MLP's w1+w3, w2 (rows, inner, output)
    tokens, h, kv, ffn = 8192, 4096, 1024, 14336
    gemms = [(h, h + 2 * kv), (h, h), (h, 2 * ffn), (ffn, h)]
    expected = 2 * 3 * 5.0 * sum(2 / 3 * tokens * (inner + out) for inner, out in gemms) / bandwidth
    assert cast_seconds(spec, 1) == pytest.approx(expected)
    # 16-bit steps cast nothing
    bf16 = {**spec, "training": {**training, "precision": "bf16"}}
    assert cast_seconds(bf16, 1) == 0.0
    # per FLOP, tp 8 casts more than twice what tp 1 does (the rows stay, the widths shrink)
    assert cast_seconds(spec, 8) * 8 > 2 * cast_seconds(spec, 1)


def test_a_collective_waits_nccls_ring_latency():
    # NCCL src/graph/tuning.cc, Ring/Simple: baseLat 8.4 us, hwLat 3.4 us per step over NVLink and
    # 14 us over the network; all-reduce 2(n-1) steps (2 x nodes of them between nodes), all-gather
    # n-1 (nodes - 1 between nodes).
    from mixle_compile.step_time import collective_latency

    table = {"intra_node_latency": 3.4e-6, "inter_node_latency": 14e-6}
    assert collective_latency("all_reduce", 8, 1, table) == pytest.approx(8.4e-6 + 14 * 3.4e-6)
    assert collective_latency("all_gather", 8, 1, table) == pytest.approx(8.4e-6 + 7 * 3.4e-6)
    assert collective_latency("all_reduce", 16, 2, table) == pytest.approx(8.4e-6 + 26 * 3.4e-6 + 4 * 14e-6)
    assert collective_latency("reduce_scatter", 16, 2, table) == pytest.approx(8.4e-6 + 14 * 3.4e-6 + 14e-6)
    assert collective_latency("p2p", 2, 2, table) == pytest.approx(8.4e-6 + 14e-6)
    assert collective_latency("all_reduce", 1, 1, table) == 0.0


def test_fused_attention_runs_slower_in_the_short_calls_context_parallelism_makes():
    # The measured points are reproduced; between and beyond them the rate rises with the length.
    assert fused_attention_rate(512, True) == pytest.approx(191 / 335)
    assert fused_attention_rate(2048, False) == pytest.approx(362 / 370)
    assert fused_attention_rate(16384, True) == fused_attention_rate(10**6, True) == 1.0
    for causal in (True, False):
        rates = [fused_attention_rate(2**k, causal) for k in range(6, 14)]  # 64 to 8k tokens
        assert rates == sorted(rates) and len(set(rates)) == len(rates)
    # One causal call over the sequence; with cp > 1, cp ring steps over a rank's chunks.
    assert attention_length_factor(8192, 1) == pytest.approx(335 / 333)
    for seq in (2048, 8192, 32768):
        factors = [attention_length_factor(seq, cp) for cp in (1, 2, 4, 8, 16)]
        assert factors == sorted(factors)
    assert attention_length_factor(262144, 8) == 1.0  # 32k tokens a rank: every call at full rate

    def attention_seconds(seq, cp, attention="flash"):
        data = {
            "model": yaml.safe_load(SPEC)["model"],
            "mesh": {"dp_shard": 8 // cp, "cp": cp},
            # cp samples of seq / cp tokens a rank: the same tokens and FLOPs a rank at every cp
            "training": {"global_batch_size": 8, "micro_batch_size": cp, "seq_len": seq, "attention": attention},
            "backend": "torch",
            "resources": {"devices": 8, "kind": "h100", "memory": "80GiB"},
        }
        spec = load_spec_text(yaml.safe_dump(data), "s.yaml").spec
        return predict_lowered(spec, lower(spec, schedule=False)).compute

    # At 4k tokens, splitting a sequence over 4 ranks costs compute beyond its share; at 64k it
    # does not, and eager attention (priced by its score traffic) is not a fused kernel's calls.
    assert attention_seconds(4096, 4) > 1.01 * attention_seconds(4096, 1)
    assert attention_seconds(65536, 4) == pytest.approx(attention_seconds(65536, 1), rel=1e-3)
    assert attention_seconds(4096, 4, "eager") == pytest.approx(attention_seconds(4096, 1, "eager"), rel=1e-3)


@pytest.mark.parametrize(
    "label",
    [
        "bridge B200 405B TP4 PP8 CP2 VP8",
        "bridge GB200 405B TP4 PP16 VP4",
        "bridge GB300 405B TP2 PP8 CP2 VP4",
        "bridge26.06 GB300 Qwen3 30B EP8",
        "bridge26.06 B300 Qwen3 30B EP8",
        "bridge26.06 GB300 Qwen3 235B PP4 VP12",
        "bridge26.06 GB200 Qwen3 235B PP8 VP3",
        "nemo25.07 GB200 Llama4 Scout EP16",
    ],
)
def test_published_blackwell_layouts_pass_check(label):
    """Megatron-Bridge runs these (its performance summary): the memory rule must not refuse them."""
    from mixle_compile.check import check_loaded
    from mixle_compile.diagnostics import Severity

    bench = _bench()
    ((data,),) = [(d,) for name, d, _ in bench.ROWS + bench.HELD_OUT if name == label]
    result = check_loaded(load_spec_text(yaml.safe_dump(data), "row.yaml"))
    assert not [d.text() for d in result.diagnostics if d.severity is Severity.error]


def test_torch_ring_attention_merges_move_bytes_outside_the_kernel():
    import dataclasses

    from mixle_compile.engines import EngineProfile
    from mixle_compile.step_time import (
        ELEMENTWISE_BYTES,
        RING_MERGE_BYTES,
        _setting,
        ring_merge_bytes,
        stage_compute_parts,
    )

    # The op-by-op count: nothing without a ring; each ring step after the first adds its forward
    # and backward share; a forward run again (checkpointing) adds the forward's part once more.
    assert ring_merge_bytes(4096, 1024, 1, 1) == 0.0
    one, two, four = (ring_merge_bytes(4096, 1024, cp, 1) for cp in (2, 3, 5))
    assert two - one == pytest.approx((four - one) / 3)  # linear in the steps after the first
    step_q, step_kv = RING_MERGE_BYTES["torch"]["forward_step"]
    once_q, _ = RING_MERGE_BYTES["torch"]["forward_once"]
    again = ring_merge_bytes(4096, 1024, 4, 2) - ring_merge_bytes(4096, 1024, 4, 1)
    assert again == pytest.approx(3 * (step_q * 4096 + step_kv * 1024) + once_q * 4096)

    def setting(backend, cp, **training):
        data = {
            "model": {**LLAMA3_8B, "num_layers": 4},
            "mesh": {"dp_shard": 8 // cp, "cp": cp},
            "training": {"global_batch_size": 8, "micro_batch_size": 1, "seq_len": 8192, **training},
            "backend": backend,
            "resources": {"devices": 8, "kind": "h100", "memory": "80GiB"},
        }
        return _setting(load_spec_text(yaml.safe_dump(data), "s.yaml").spec.model_dump(mode="json"))

    def merge_seconds(st, cp, tp=1):
        # a rank's per-sample seconds with the engine's ring against the same setting without one
        with_ring = stage_compute_parts(st, tp, cp, [4])[0][0]
        without = stage_compute_parts(dataclasses.replace(st, engine=None), tp, cp, [4])[0][0]
        return with_ring - without

    bandwidth = setting("torchtitan", 2).table["memory_bandwidth"]
    for cp in (2, 4, 8):
        st = setting({"name": "torchtitan", "version": "0.3"}, cp)
        expected = 8192 / cp * 4 * ring_merge_bytes(4096, 1024, cp, 1) / bandwidth
        assert merge_seconds(st, cp) == pytest.approx(expected)
        # tp splits the query heads and the key heads (8 of them: none split below one head)
        assert merge_seconds(st, cp, tp=8) == pytest.approx(
            8192 / cp * 4 * ring_merge_bytes(512, 128, cp, 1) / bandwidth
        )
    # torchtitan 0.2 repeats the key heads before attention: the ring carries the queries' width
    st = setting({"name": "torchtitan", "version": "0.2"}, 4)
    assert merge_seconds(st, 4) == pytest.approx(2048 * 4 * ring_merge_bytes(4096, 4096, 4, 1) / bandwidth)
    # checkpointing runs the forward's merges again; torch.compile fuses them like other element-wise work
    full = setting("torchtitan", 4, activation_checkpointing="full")
    assert merge_seconds(full, 4) == pytest.approx(2048 * 4 * ring_merge_bytes(4096, 1024, 4, 2) / bandwidth)
    compiled = setting("torchtitan", 4, compile=["model"])
    ratio = ELEMENTWISE_BYTES["compiled"] / ELEMENTWISE_BYTES["eager"]
    assert merge_seconds(compiled, 4) == pytest.approx(ratio * merge_seconds(setting("torchtitan", 4), 4))
    # Megatron's ring is Transformer Engine's: fused bf16 merges, its own count, and fewer bytes
    te = ring_merge_bytes(4096, 1024, 4, 1, "transformer_engine")
    assert 0 < te < ring_merge_bytes(4096, 1024, 4, 1) / 4
    assert merge_seconds(setting("megatron", 4), 4) == pytest.approx(2048 * 4 * te / bandwidth)
    full_te = setting("megatron", 4, activation_checkpointing="selective")  # the core attention again
    assert merge_seconds(full_te, 4) == pytest.approx(
        2048 * 4 * ring_merge_bytes(4096, 1024, 4, 2, "transformer_engine") / bandwidth
    )
    # no ring without context parallelism or on the in-tree runtime, and none for eager attention
    # (torchtitan's ring runs over SDPA's kernels)
    assert merge_seconds(setting("torchtitan", 1), 1) == 0.0
    assert merge_seconds(setting("torch", 4), 4) == 0.0
    assert merge_seconds(setting("torchtitan", 4, attention="eager"), 4) == 0.0
    assert isinstance(setting("torchtitan", 4).engine, EngineProfile)


def test_an_all_to_all_over_nodes_sends_its_local_share_over_the_node_and_the_rest_over_the_network(monkeypatch):
    """Expert parallelism's all_to_all sends 1/n of its payload to each peer at once: of ep 16 on
    8-GPU nodes, 7 peers share the rank's node and 8 are on the other, both shares in flight together
    (a ring collective instead sends all of its bytes over the network once it spans two nodes)."""
    from mixle_compile import step_time

    text = """\
model: {family: transformer, vocab_size: 32000, hidden_size: 2048, num_layers: 4, num_heads: 16,
  ffn_hidden_size: 6144, num_experts: 32, experts_per_token: 4, moe_ffn_hidden_size: 768}
mesh: {dp_replicate: 16, ep: 16}
training: {global_batch_size: 16, micro_batch_size: 1, seq_len: 4096, distributed_optimizer: true}
backend: {name: megatron, version: "0.16"}
resources: {devices: 16, kind: h100, memory: 80GiB, topology: TOPOLOGY}
"""

    def exposed_ep(topology: str) -> float:
        spec = load_spec_text(text.replace("TOPOLOGY", topology), "moe.yaml")
        assert spec.ok, [d.text() for d in spec.diagnostics]
        return predict_lowered(spec.spec, lower(spec.spec, schedule=False)).exposed_communication["ep"]

    monkeypatch.setattr(step_time, "BASE_LATENCY", 0.0)
    latency = "intra_node_latency: 1ns, inter_node_latency: 1ns"
    links = f"intra_node_bandwidth: 450GB/s, inter_node_bandwidth: 50GB/s, {latency}"
    inside = exposed_ep(f"{{devices_per_node: 16, {links}}}")
    across = exposed_ep(f"{{devices_per_node: 8, {links}}}")
    assert across == pytest.approx(inside * 450e9 * max(7 / 450e9, 8 / 50e9) / 15, rel=1e-3)
    # on nodes of 4 GPUs, 3 peers are local and 12 remote; on single GPUs, every byte crosses the network
    assert exposed_ep(f"{{devices_per_node: 4, {links}}}") == pytest.approx(inside * 450e9 * (12 / 50e9) / 15, rel=1e-3)
    assert exposed_ep(f"{{devices_per_node: 1, {links}}}") == pytest.approx(inside * 450 / 50, rel=1e-3)
    # where the network is the faster link (never on real machines), the node's share sets the time
    fast = f"intra_node_bandwidth: 50GB/s, inter_node_bandwidth: 450GB/s, {latency}"
    assert exposed_ep(f"{{devices_per_node: 8, {fast}}}") == pytest.approx(
        exposed_ep(f"{{devices_per_node: 16, {fast}}}") * 50e9 * (7 / 50e9) / 15, rel=1e-3
    )


def test_a_flex_dispatcher_sends_a_token_once_per_rank_in_its_node_and_once_per_other_node(monkeypatch):
    """DeepEP / HybridEP (training.expert_dispatcher: flex): of ep 16 on two 8-GPU nodes, with 32 experts
    (2 a rank, 16 a node) and top-4 routing, a token goes to each of its node's 7 other ranks holding
    one of its experts and, at most once, to the other node; the plan's payload is still 4 copies."""
    import math

    from mixle_compile import step_time

    text = """\
model: {family: transformer, vocab_size: 32000, hidden_size: 2048, num_layers: 4, num_heads: 16,
  ffn_hidden_size: 6144, num_experts: 32, experts_per_token: 4, moe_ffn_hidden_size: 768}
mesh: {dp_replicate: 16, ep: 16}
training: {global_batch_size: 16, micro_batch_size: 1, seq_len: 4096, distributed_optimizer: true,
  expert_dispatcher: DISPATCH}
backend: {name: megatron, version: "0.16"}
resources: {devices: 16, kind: h100, memory: 80GiB, topology: {devices_per_node: NODE,
  intra_node_bandwidth: 450GB/s, inter_node_bandwidth: 50GB/s, intra_node_latency: 1ns, inter_node_latency: 1ns}}
"""

    def exposed_ep(dispatch: str, node: int) -> float:
        loaded = load_spec_text(text.replace("DISPATCH", dispatch).replace("NODE", str(node)), "moe.yaml")
        assert loaded.ok, [d.text() for d in loaded.diagnostics]
        return predict_lowered(loaded.spec, lower(loaded.spec, schedule=False)).exposed_communication["ep"]

    monkeypatch.setattr(step_time, "BASE_LATENCY", 0.0)
    # the plan's payload S over one node's links: all_to_all sends 15/16 of it
    inside = exposed_ep("all_to_all", 16)
    per_token = inside * 450e9 / (15 / 16) / 4  # S / k over one byte a second
    p_rank = 1 - math.comb(30, 4) / math.comb(32, 4)
    p_node = 1 - math.comb(16, 4) / math.comb(32, 4)
    assert exposed_ep("flex", 16) == pytest.approx(per_token * 15 * p_rank / 450e9, rel=1e-3)
    assert exposed_ep("flex", 8) == pytest.approx(per_token * max(7 * p_rank / 450e9, p_node / 50e9), rel=1e-3)
    # over the network, all_to_all sends 4 x 8/16 = 2 copies a token, flex fewer than one
    assert exposed_ep("flex", 8) == pytest.approx(exposed_ep("all_to_all", 8) * p_node / 2, rel=1e-3)


def test_a_kind_without_calibrated_rows_borrows_its_siblings_efficiency(monkeypatch):
    from mixle_compile import step_time

    # B300 has no calibrated row: it takes B200's figure, not the generic fallback
    assert not any(kind == "b300" for kind, _ in step_time.EFFICIENCY)
    assert step_time.efficiency_of("b300", "fp8") == step_time.EFFICIENCY[("b200", "fp8")]
    assert step_time.efficiency_of("b300", "bf16") == step_time.efficiency_of("b200", "bf16")
    # a figure of its own wins over the sibling's
    monkeypatch.setitem(step_time.EFFICIENCY, ("b300", "bf16"), 0.5)
    assert step_time.efficiency_of("b300", "fp8") == 0.5
    # a kind without a sibling, or unknown, keeps the generic fallback
    assert step_time.efficiency_of("mi300x", "bf16") == step_time.DEFAULT_EFFICIENCY


def test_durations_are_written_in_a_unit_people_read():
    from mixle_compile.step_time import seconds_text

    assert seconds_text(2.5) == "2.50 s"
    assert seconds_text(0.0123) == "12.3 ms"
    assert seconds_text(2e-6) == "2.0 us"
    assert seconds_text(0) == "0 s"


PIPELINED = """
model: {family: transformer, vocab_size: 32000, hidden_size: 4096, num_layers: 32, num_heads: 32,
  ffn_hidden_size: 11008}
mesh: {dp_replicate: 2, pp: 8, microbatches: 16}
training: {global_batch_size: 32, seq_len: 4096, precision: bf16, pipeline_schedule: SCHEDULE,
  virtual_pipeline_stages: VP OVERLAP}
backend: {name: megatron, version: "0.16", entry: ENTRY}
resources: {devices: 16, kind: h100, memory: 80GiB, topology: {devices_per_node: 2}}
"""


@pytest.mark.parametrize(
    "schedule,vp,entry,asked,overlapped",
    [
        ("interleaved_1f1b", 2, "arguments", None, True),  # Megatron-LM: on by default
        ("interleaved_1f1b", 2, "arguments", False, False),  # --no-overlap-p2p-communication
        ("interleaved_1f1b", 2, "core", None, False),  # Megatron-Core's ModelParallelConfig: off
        ("interleaved_1f1b", 2, "core", True, True),  # Megatron-Bridge turns it on with virtual stages
        ("1f1b", 1, "arguments", True, False),  # no virtual stages: Megatron turns it off
    ],
)
def test_megatron_overlaps_pipeline_transfers_only_under_its_interleaved_schedule(
    schedule, vp, entry, asked, overlapped
):
    def predicted(overlap: bool | None):
        text = PIPELINED.replace("SCHEDULE", schedule).replace("VP", str(vp)).replace("ENTRY", entry)
        text = text.replace(
            " OVERLAP", "" if overlap is None else f", overlap_pipeline_transfers: {str(overlap).lower()}"
        )
        loaded = load_spec_text(text, "p.yaml")
        assert loaded.ok, [d.text() for d in loaded.diagnostics]
        return predict_lowered(loaded.spec, lower(loaded.spec, schedule=False))

    st = predicted(asked)
    # every pipeline group spans 8 nodes of 2: the transfers cross the network
    if overlapped:
        assert "pp" not in st.exposed_communication and st.hidden_communication["pp"] > 0
        exposed = predicted(False)
        assert exposed.exposed_communication["pp"] == pytest.approx(st.hidden_communication["pp"], rel=1e-9)
        assert st.seconds < exposed.seconds
    else:
        assert st.exposed_communication["pp"] > 0 and "pp" not in st.hidden_communication


def test_explain_names_the_communication_compute_hides(capsys):
    # Megatron-Bridge's 70B recipe: FSDP-free data parallelism, async TP, and interleaved stages whose
    # transfers Bridge overlaps (overlap_pipeline_transfers: true)
    spec = ROOT / "tests" / "corpus" / "production" / "bridge_nemo" / "bridge_llama3_70b_h100_bf16_v2.yaml"
    assert cli.main(["explain", str(spec)]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "hidden behind compute" in x]
    assert "(" in line and " pp " in line and "tp " in line, line


def test_a_shared_expert_is_priced_as_a_dense_mlp_every_token_passes_through():
    from mixle_compile.step_time import model_flops_per_token

    moe = dict(LLAMA3_8B, num_experts=8, experts_per_token=2, moe_ffn_hidden_size=4096, moe_layer_frequency=2)
    shared = dict(moe, moe_shared_expert_hidden_size=2048)
    gated = dict(shared, moe_shared_expert_gate=True)
    h, moe_layers = 4096, 16
    # forward and backward (3 x 2 FLOPs a weight) over three matrices per MoE layer, and the gate's column
    assert model_flops_per_token(shared, 4096) - model_flops_per_token(moe, 4096) == 6 * 3 * h * 2048 * moe_layers
    assert model_flops_per_token(gated, 4096) - model_flops_per_token(shared, 4096) == 6 * h * moe_layers

    def step(model):
        data = {
            "model": model,
            "mesh": {"dp_shard": 4, "tp": 2, "ep": 2},
            "training": {"global_batch_size": 4, "micro_batch_size": 1, "seq_len": 4096, "sequence_parallel": True},
            "backend": "torch",
            "resources": {"devices": 8, "kind": "h100", "memory": "80GiB"},
        }
        spec = load_spec_text(yaml.safe_dump(data), "s.yaml").spec
        return predict_lowered(spec, lower(spec, schedule=False))

    assert step(shared).compute > step(moe).compute


def test_each_pipeline_stage_holds_the_moe_layers_of_its_own_chunks():
    from mixle_compile.layer_split import split_layers
    from mixle_compile.parameters import moe_layer_at
    from mixle_compile.step_time import stage_moe_layers

    for layers, pp, virtual, first, k in [(16, 2, 2, 8, 1), (61, 8, 4, 3, 1), (24, 4, 3, 1, 2), (10, 2, 1, 0, 3)]:
        model = {"num_layers": layers, "num_experts": 4, "moe_layer_frequency": k, "moe_first_layer": first}
        split = split_layers(layers, pp, virtual, None, "megatron" if layers % (pp * virtual) == 0 else "torchtitan")
        want = [0] * pp
        for layer in range(layers):
            if moe_layer_at(layer, num_experts=4, frequency=k, first=first):
                want[split.location(layer)[0]] += 1
        assert stage_moe_layers(split, model) == want


def test_a_published_shared_expert_run_is_predicted_within_15_percent_and_only_with_its_shared_expert():
    """NeMo's Llama 4 Scout row (held out, never fitted): its shared expert is a third of its compute."""
    bench = _bench()
    ((data, measured),) = [(d, m) for name, d, m in bench.HELD_OUT if name == "nemo25.07 GB200 Llama4 Scout EP16"]

    def ratio(model):
        spec = load_spec_text(yaml.safe_dump({**data, "model": model}), "row.yaml").spec
        return predict_lowered(spec, lower(spec, schedule=False)).tokens_per_second_per_device / measured

    assert 0.85 <= ratio(data["model"]) <= 1.15
    without = {k: v for k, v in data["model"].items() if k != "moe_shared_expert_hidden_size"}
    assert ratio(without) > 1.25


#: DeepSeek-V3's dimensions (Megatron-Bridge DeepSeekV3ModelProvider; HF config.json), as step_time reads them.
DEEPSEEK_V3 = {
    "family": "transformer",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "num_layers": 61,
    "num_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "ffn_hidden_size": 18432,
    "num_experts": 256,
    "experts_per_token": 8,
    "moe_ffn_hidden_size": 2048,
    "moe_first_layer": 3,
    "moe_shared_expert_hidden_size": 2048,
}


def test_latent_attention_flops_are_megatrons_count():
    """Megatron-LM's own FLOPs of an MLA model (megatron/training/training.py, num_floating_point_operations,
    the multi_latent_attention branch, without MTP layers and its ``+ 1`` per latent norm): the projections
    and the causal core; ours counts the core without the mask, as torchtitan's and PaLM's MFU do, and the
    router's ``2*h*E`` per MoE layer, which Megatron's leaves out."""
    from mixle_compile.step_time import model_flops_per_token

    m, seq = DEEPSEEK_V3, 4096
    h, n, nope, rope, v = m["hidden_size"], m["num_heads"], 128, 64, 128
    linear = (
        m["q_lora_rank"] * (h + n * (nope + rope)) + m["kv_lora_rank"] * (h + n * (nope + v)) + h * rope + n * v * h
    )
    core = n * (nope + rope) / 2 + n * v / 2  # per token of the sequence, causal
    dense, moe = 3, 58
    mlp = dense * 3 * h * m["ffn_hidden_size"] + moe * 3 * h * (8 * 2048 + 2048)
    router = moe * h * 256
    megatron_linear = 6 * (61 * linear + mlp + h * m["vocab_size"])
    ours_only = 6 * router
    megatron_core = 6 * 61 * core * seq
    assert model_flops_per_token(m, seq) == pytest.approx(megatron_linear + ours_only + 2 * megatron_core, rel=1e-9)


def test_latent_down_projections_run_on_every_token_where_the_engine_does_not_shard_them():
    """Megatron-Core splits MLA's duplicated down projections over tp by the sequence shard under sequence
    parallelism; torchtitan's NoParallel wq_a/wkv_a, and Megatron without sequence parallelism, run them on
    every token of every tp rank: tp times their FLOPs, counted in a layer's (which stage_compute divides by tp)."""
    from mixle_compile.step_time import _layer_flops

    def linear(backend, sp, tp=4):
        return _layer_flops(DEEPSEEK_V3, {"sequence_parallel": sp}, 4096, backend, False, tp).linear

    down = 2 * 7168 * (1536 + 512 + 64)
    assert linear("torchtitan", True) - linear("megatron", True) == pytest.approx(3 * down)
    assert linear("megatron", False) == linear("torchtitan", True)
    assert linear("megatron", True, tp=1) == linear("torchtitan", True, tp=1)


def test_torchtitans_op_level_policy_recomputes_every_second_matmul_of_latent_attention():
    """torchtitan's DeepSeek-V3 block runs wq_a, wq_b, wkv_a, wkv_b, wo, w1, w3, w2; its op-level policy saves the
    odd-numbered mm calls: wq_b, wkv_b, w1 and w2 run again. Without a query latent (wq, wkv_a, wkv_b, wo, w1, w3,
    w2): wkv_a, wo and w3."""
    from mixle_compile.parameters import attention_widths
    from mixle_compile.step_time import _op_level_recomputed

    assert set(_op_level_recomputed(attention_widths(DEEPSEEK_V3), 2048, 3)) == {"wq_b", "wkv_b", "w1", "w2"}
    direct = {**DEEPSEEK_V3, "q_lora_rank": None}
    assert set(_op_level_recomputed(attention_widths(direct), 2048, 3)) == {"wkv_a", "o", "w3"}
    assert set(_op_level_recomputed(attention_widths(LLAMA3_8B), 14336, 3)) == {"k", "o", "w3"}


@pytest.mark.parametrize("label", ["bridge25.09 H100 DeepSeek-V3 EP64", "bridge25.11 GB200 DeepSeek-V3 EP64"])
def test_a_published_latent_attention_run_is_predicted_within_15_percent(label):
    """Megatron-Bridge's DeepSeek-V3 on 1,024 H100s and on 256 GB200s (held out, never fitted)."""
    bench = _bench()
    ((data, measured),) = [(d, m) for name, d, m in bench.HELD_OUT if name == label]
    spec = load_spec_text(yaml.safe_dump(data), "row.yaml").spec
    ratio = predict_lowered(spec, lower(spec, schedule=False)).tokens_per_second_per_device / measured
    assert 0.85 <= ratio <= 1.15, ratio

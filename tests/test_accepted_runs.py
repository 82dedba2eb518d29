"""Accepted means runnable; rejected never runs.

For a sample of specs the verifier accepts (small transformers on meshes the runtime executes, at
world size <= 4, KV heads split over tp or shared by several tp ranks), `run` completes with
planned == observed accounting. A spec the verifier rejects is refused before any rank starts.
"""

from __future__ import annotations

import random

import pytest

from mixle_compile.check import check_loaded
from mixle_compile.spec import load_spec_text
from tests.conftest import EXAMPLES
from tests.test_runtime_support import compile_text

pytest.importorskip("torch")

from mixle_compile.runtime import RuntimeRefusal, run_plan  # noqa: E402

SPEC = """\
model: {{family: transformer, vocab_size: {vocab}, hidden_size: {hidden}, num_layers: {layers}, num_heads: {heads},
        num_kv_heads: {kv}, ffn_hidden_size: {ffn}, tie_embeddings: {tie}}}
mesh: {{dp_replicate: {dr}, dp_shard: {ds}, tp: {tp}, gradient_accumulation_steps: {gas}}}
training: {{global_batch_size: {gbs}, micro_batch_size: 2, seq_len: 16, precision: fp32, optimizer: {opt},
           sequence_parallel: {sp}, steps: 2}}
backend: torch
resources: {{devices: {world}, memory: 1GiB}}
"""


def candidate(rng: random.Random) -> str:
    dr, ds, tp = rng.choice([(1, 1, 2), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 2, 2), (2, 1, 2), (1, 1, 4), (1, 4, 1)])
    gas = rng.choice([1, 2])
    heads = rng.choice([2, 4, 8])
    return SPEC.format(
        vocab=rng.choice([64, 96, 128]),
        hidden=heads * rng.choice([4, 8]),
        layers=rng.choice([1, 2]),
        heads=heads,
        kv=rng.choice([h for h in (1, 2, 4, 8) if heads % h == 0]),
        ffn=rng.choice([32, 48, 64]),
        tie=str(rng.random() < 0.5).lower(),
        dr=dr,
        ds=ds,
        tp=tp,
        gas=gas,
        gbs=2 * gas * dr * ds,
        opt=rng.choice(["sgd", "adamw"]),
        sp=str(tp > 1 and rng.random() < 0.5).lower(),
        world=dr * ds * tp,
    )


def accepted_sample(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        text = candidate(rng)
        loaded = load_spec_text(text, "sample.yaml")
        if loaded.ok and not check_loaded(loaded).errors:
            out.append(text)
    return out


def run_text(tmp_path, text: str, name: str = "sample.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return run_plan(path, out_dir=tmp_path / "out", progress=False)


@pytest.mark.parametrize("text", accepted_sample(3, seed=11), ids=lambda t: t.split("mesh: ")[1].split("}")[0])
def test_accepted_specs_run_with_exact_accounting(tmp_path, text):
    report = run_text(tmp_path, text)
    assert report.ok and report.accounting_ok, report.summary()
    assert len(report.losses) == 2


@pytest.mark.slow
@pytest.mark.parametrize("text", accepted_sample(12, seed=12), ids=lambda t: t.split("mesh: ")[1].split("}")[0])
def test_accepted_specs_run_with_exact_accounting_wider(tmp_path, text):
    report = run_text(tmp_path, text)
    assert report.ok and report.accounting_ok, report.summary()


EVERY_AXIS = """\
model: {{family: transformer, vocab_size: {vocab}, hidden_size: {hidden}, num_layers: {layers}, num_heads: {heads},
        num_kv_heads: {kv}, ffn_hidden_size: {ffn}, tie_embeddings: {tie}{moe}}}
mesh: {{dp_replicate: {dr}, dp_shard: {ds}, tp: {tp}, pp: {pp}, cp: {cp}, ep: {ep}, etp: {etp}, microbatches: {mb},
       gradient_accumulation_steps: {gas}}}
training: {{global_batch_size: {gbs}, micro_batch_size: 2, seq_len: 16, precision: fp32, optimizer: {opt},
           sequence_parallel: {sp}, pipeline_schedule: {schedule}, virtual_pipeline_stages: {vpp},
           distributed_optimizer: {dopt}, steps: 2}}
backend: torch
resources: {{devices: {world}, memory: 1GiB}}
"""


def every_axis_candidate(rng: random.Random, max_world: int = 8) -> str:
    """A small transformer on a mesh drawn over every axis (pp, cp, ep and etp included), dense or MoE."""
    while True:
        dr, ds, tp, pp, cp = (rng.choice(c) for c in ([1, 1, 2], [1, 2, 4], [1, 1, 2, 4], [1, 1, 2], [1, 1, 2]))
        if dr * ds * tp * pp * cp <= max_world:
            break
    experts = rng.choice([0, 0, 4, 8])
    heads = rng.choice([2, 4, 8])
    mb = rng.choice([pp, 2 * pp]) if pp > 1 else 1
    gas = rng.choice([1, 2])
    vpp = rng.choice([1, 2]) if pp > 1 else 1
    return EVERY_AXIS.format(
        vocab=rng.choice([64, 128]),
        hidden=heads * rng.choice([4, 8]),
        layers=rng.choice([2, 4]),
        heads=heads,
        kv=rng.choice([h for h in (1, 2, 4, 8) if heads % h == 0]),
        ffn=rng.choice([32, 64]),
        tie=str(rng.random() < 0.3).lower(),
        moe=f", num_experts: {experts}, experts_per_token: {rng.choice([1, 2])}" if experts else "",
        dr=dr,
        ds=ds,
        tp=tp,
        pp=pp,
        cp=cp,
        ep=rng.choice([1, 2, 4]) if experts else 1,
        etp=rng.choice([1, tp]) if experts else 1,
        mb=mb,
        gas=gas,
        gbs=2 * mb * gas * dr * ds,
        opt=rng.choice(["sgd", "adamw"]),
        sp=str(tp > 1 and (experts > 0 or rng.random() < 0.6)).lower(),
        schedule="interleaved_1f1b" if vpp > 1 else rng.choice(["gpipe", "1f1b"]),
        vpp=vpp,
        dopt=str(rng.random() < 0.2).lower(),
        world=dr * ds * tp * pp * cp,
    )


def accepted_every_axis(count: int, seed: int, max_world: int = 8) -> list[str]:
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        text = every_axis_candidate(rng, max_world)
        loaded = load_spec_text(text, "sample.yaml")
        if loaded.ok and not check_loaded(loaded).errors:
            out.append(text)
    return out


def _mesh_of(text: str) -> str:
    return " ".join(text.split("mesh: ")[1].split("}")[0].split())


def test_specs_accepted_on_every_axis_pass_the_runtimes_checks_before_start():
    """The runtime's whole pre-start reading (the one `run` does) refuses none of 200 accepted specs
    drawn over every axis at world size <= 8, pipelines, context and expert parallelism included."""
    from mixle_compile.runtime.launch import preflight

    texts = accepted_every_axis(200, seed=5)
    seen = {axis: 0 for axis in ("pp", "cp", "ep", "tp", "num_experts", "ep+cp", "ep+etp", "pp+tie")}
    for text in texts:
        loaded = load_spec_text(text, "sample.yaml")
        try:
            preflight(compile_text(text))
        except RuntimeRefusal as exc:  # pragma: no cover - the failure message is the point
            pytest.fail(f"accepted but refused by the runtime: {exc}\n{text}")
        m = loaded.spec.mesh
        for axis in ("pp", "cp", "ep", "tp"):
            seen[axis] += getattr(m, axis) > 1
        seen["num_experts"] += loaded.spec.model.num_experts > 0
        seen["ep+cp"] += m.ep > 1 and m.cp > 1
        seen["ep+etp"] += m.ep > 1 and m.etp > 1
        seen["pp+tie"] += m.pp > 1 and loaded.spec.model.tie_embeddings
    # the sample really covers every axis, expert parallelism with cp and with experts split over tp,
    # and tied embeddings across pipeline stages
    assert all(count >= (5 if "+" in axis else 10) for axis, count in seen.items()), seen


@pytest.mark.parametrize("text", accepted_every_axis(2, seed=21, max_world=4), ids=_mesh_of)
def test_accepted_specs_on_every_axis_run_with_exact_accounting(tmp_path, text):
    report = run_text(tmp_path, text)
    assert report.ok and report.accounting_ok, report.summary()


@pytest.mark.slow
@pytest.mark.parametrize("text", accepted_every_axis(10, seed=22, max_world=8), ids=_mesh_of)
def test_accepted_specs_on_every_axis_run_with_exact_accounting_wider(tmp_path, text):
    report = run_text(tmp_path, text)
    assert report.ok and report.accounting_ok, report.summary()


@pytest.mark.parametrize(
    "name", ["t001-heads-split-by-tp.yaml", "b001-global-batch-size.yaml", "s003-unknown-key.yaml"]
)
def test_rejected_specs_never_reach_the_ranks(tmp_path, name):
    with pytest.raises(RuntimeRefusal, match="does not check cleanly"):
        run_plan(EXAMPLES / "invalid" / name, out_dir=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())

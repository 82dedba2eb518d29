"""Helpers shared by the runtime tests (no tests here): specs of every mesh shape, compiled plans."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from mixle_compile.lower.lowering import lower
from mixle_compile.plan import build_plan, load_plan_text, plan_text
from mixle_compile.spec import load_spec_text


def spec_text(
    *,
    dr: int = 1,
    ds: int = 1,
    tp: int = 1,
    mb: int = 1,
    gas: int = 1,
    sp: bool = False,
    dopt: bool = False,
    precision: str = "fp32",
    optimizer: str = "sgd",
    tie: bool = True,
    norm: str = "rmsnorm",
    activation: str = "swiglu",
    position: str = "rope",
    kv_heads: int = 2,
    lr: float = 1e-2,
    steps: int = 3,
    pp: int = 1,
    cp: int = 1,
) -> str:
    """A small transformer on ``dr * ds * tp * pp * cp`` CPU ranks (2 samples per micro-batch, 16 tokens each)."""
    world = dr * ds * tp * pp * cp
    return textwrap.dedent(
        f"""\
        model: {{family: transformer, vocab_size: 128, hidden_size: 32, num_layers: 2, num_heads: 4, \
num_kv_heads: {kv_heads},
                ffn_hidden_size: 64, tie_embeddings: {str(tie).lower()}, norm: {norm}, activation: {activation},
                position_embedding: {position}}}
        mesh: {{dp_replicate: {dr}, dp_shard: {ds}, tp: {tp}, pp: {pp}, cp: {cp}, microbatches: {max(mb, pp)}, \
gradient_accumulation_steps: {gas}}}
        training: {{global_batch_size: {2 * max(mb, pp) * gas * dr * ds}, micro_batch_size: 2, seq_len: 16, \
precision: {precision},
                   optimizer: {optimizer}, learning_rate: {lr}, sequence_parallel: {str(sp).lower()},
                   distributed_optimizer: {str(dopt).lower()}, steps: {steps}}}
        backend: torch
        resources: {{devices: {world}, memory: 1GiB, kind: cpu}}
        """
    )


def compile_text(text: str):
    """The verified PlanDocument of a spec text."""
    loaded = load_spec_text(text, "spec.yaml")
    assert loaded.ok, [d.text() for d in loaded.diagnostics]
    return load_plan_text(plan_text(build_plan(loaded.spec, lower(loaded.spec), loaded.diagnostics)))


def plan_for(**kwargs):
    return compile_text(spec_text(**kwargs))


def explain_without_torch(path) -> subprocess.CompletedProcess:
    """`mixle-compile explain PATH` in a fresh interpreter; its last output line says whether torch
    was imported (``NO-TORCH 0``: it was not, and the command exited 0)."""
    from tests.conftest import ROOT

    probe = (
        "import sys\nfrom mixle_compile.cli import main\n"
        f"status = main(['explain', {str(path)!r}])\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', status)"
    )
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)

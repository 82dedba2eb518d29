"""Your own nn.Module through the `torch` backend: the documented example, and equivalence with torch.

Both start ranks with torchrun (``python -m torch.distributed.run --standalone``), as a user would.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

torch = pytest.importorskip("torch")


def torchrun(args: list[str], cwd, nproc: int = 2) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    env = {
        k: v
        for k, v in __import__("os").environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=240, env=env)


def doc_examples() -> dict[str, str]:
    text = (ROOT / "docs" / "runtime.md").read_text(encoding="utf-8")
    return {m.group(1): m.group(2) for m in re.finditer(r"<!-- example: (\S+) -->\n```\w+\n(.*?)```", text, re.S)}


def test_the_documented_example_trains(tmp_path):
    examples = doc_examples()
    assert set(examples) == {"tiny-lm.yaml", "train_tiny_lm.py"}
    for name, body in examples.items():
        (tmp_path / name).write_text(body, encoding="utf-8")
    out = torchrun(["train_tiny_lm.py"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+), 16 examples", out.stdout)]
    assert len(losses) == 3, out.stdout
    assert losses[-1] < losses[0] / 2  # counting upwards is easy to learn


WORKER = """
import json, os, sys
import torch
from torch import nn
import torch.nn.functional as F
from mixle_compile.contracts import get_training_backend
from mixle_compile.runtime import load_plan_or_spec, plan_of

TIED = len(sys.argv) > 3 and sys.argv[3] == "tied"  # the output layer's weight is the embedding's
WIDTH = 16 if TIED else 24

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.hidden = nn.Linear(16, WIDTH)
        self.out = nn.Linear(WIDTH, 32)
        if TIED:
            self.out.weight = self.embed.weight
    def forward(self, tokens):
        return self.out(torch.tanh(self.hidden(self.embed(tokens))))

def batch(step, a, d):
    g = torch.Generator().manual_seed(100 * step + 10 * a + d)
    t = torch.randint(32, (4, 6), generator=g)
    return t[:, :-1], t[:, 1:]

doc = load_plan_or_spec(sys.argv[1])
plan = plan_of(doc)
torch.manual_seed(0)
model = Net()
start = {k: v.detach().clone() for k, v in model.named_parameters()}
session = get_training_backend("torch").prepare(model, plan=plan, document=doc, precision="fp32")
gas, dp = plan.gradient_accumulation_steps, plan.data_parallel_size
receipts = []
for step in range(3):
    for a in range(gas):
        r = session.train_batch(*batch(step, a, session.data_rank))
        receipts.append(r.as_dict())
final = session.parameters_global()
if session.mesh.rank == 0:
    ref = Net()
    ref.load_state_dict(start, strict=not TIED)  # (tied: one tensor, listed once)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        for a in range(gas):
            for d in range(dp):
                x, y = batch(step, a, d)
                (F.cross_entropy(ref(x).reshape(-1, 32), y.reshape(-1)) / (gas * dp)).backward()
        opt.step()
        opt.zero_grad()
    errors = {n: float((final[n] - p).norm() / p.norm()) for n, p in ref.named_parameters()}
    moved = {n: float((p - start[n]).norm() / start[n].norm()) for n, p in ref.named_parameters()}
    json.dump({"errors": errors, "moved": moved, "receipts": receipts, "ledger": session.ledger.as_dict()}, \
open(sys.argv[2], "w"))
session.close()
"""

SPEC = """\
model:
  family: modules
  parameters:
    - {{name: embed.weight, shape: [32, 16], role: embedding}}
    - {{name: hidden.weight, shape: [24, 16], role: column}}
    - {{name: hidden.bias, shape: [24], role: bias}}
    - {{name: out.weight, shape: [32, 24], role: row}}
    - {{name: out.bias, shape: [32], role: bias}}
mesh: {{{mesh}, gradient_accumulation_steps: 2}}
training: {{global_batch_size: 16, micro_batch_size: 4, precision: fp32, optimizer: adamw, learning_rate: 1.0e-2, \
distributed_optimizer: {dopt}}}
backend: torch
resources: {{devices: 2, memory: 1GiB, kind: cpu}}
"""


def tied_spec(text: str) -> str:
    """SPEC with the output layer's weight tied to the embedding (one [32, 16] tensor, hidden width 16)."""
    text = text.replace(
        "{name: hidden.weight, shape: [24, 16], role: column}", "{name: hidden.weight, shape: [16, 16], role: column}"
    )
    text = text.replace("{name: hidden.bias, shape: [24], role: bias}", "{name: hidden.bias, shape: [16], role: bias}")
    text = text.replace(
        "{name: embed.weight, shape: [32, 16], role: embedding}",
        "{name: embed.weight, shape: [32, 16], role: embedding, shared_group: tied}",
    )
    return text.replace(
        "{name: out.weight, shape: [32, 24], role: row}",
        "{name: out.weight, shape: [32, 16], role: head, shared_group: tied}",
    )


@pytest.mark.parametrize(
    ("mesh", "dopt", "tied"),
    [
        ("dp_shard: 2", "false", False),
        ("dp_replicate: 2", "true", False),
        ("dp_shard: 2", "false", True),
        ("dp_replicate: 2", "true", True),
    ],
)
def test_a_user_module_trains_like_plain_torch(tmp_path, mesh, dopt, tied):
    # Tied: the plan reduces (and the distributed optimizer gathers) the one tensor once, as its
    # first use; the other use's gradient is added to it first.
    text = SPEC.format(mesh=mesh, dopt=dopt)
    (tmp_path / "spec.yaml").write_text(tied_spec(text) if tied else text)
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))
    out = torchrun(["worker.py", "spec.yaml", "result.json", "tied" if tied else "untied"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert min(result["moved"].values()) > 1e-3  # training moved every tensor ...
    assert max(result["errors"].values()) < 1e-5, result["errors"]  # ... exactly as plain torch did
    skipped = [r["skipped"] for r in result["receipts"]]
    assert skipped == [True, False] * 3
    assert all(r["global_examples_observed"] == 16 for r in result["receipts"] if not r["skipped"])
    kinds = {name.split(":")[1] for name in result["ledger"]["updates"]}
    assert kinds == (
        {"grad/scatter", "param/gather-forward", "param/gather-backward"}
        if "shard" in mesh
        else {"grad/scatter", "param/gather"}
    )
    reduced = {name.split(":")[0] for name in result["ledger"]["updates"] if ":grad/" in name}
    assert ("out.weight" in reduced) == (not tied) and "embed.weight" in reduced


def test_prepare_names_parameters_that_do_not_match(tmp_path):
    single = (
        SPEC.format(mesh="dp_replicate: 1", dopt="false")
        .replace("devices: 2", "devices: 1")
        .replace("global_batch_size: 16", "global_batch_size: 8")
    )
    (tmp_path / "spec.yaml").write_text(single)
    script = textwrap.dedent("""
        import torch
        from torch import nn
        from mixle_compile.contracts import get_training_backend
        from mixle_compile.runtime import RuntimeRefusal, load_plan_or_spec, plan_of
        doc = load_plan_or_spec("spec.yaml")
        model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 24))
        try:
            get_training_backend("torch").prepare(model, plan=plan_of(doc), document=doc)
        except RuntimeRefusal as exc:
            print(exc)
    """)
    (tmp_path / "bad.py").write_text(script)
    out = subprocess.run(
        [sys.executable, "bad.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "the spec lists embed.weight, hidden.bias" in out.stdout
    assert "the module has 0.weight, 1.bias, 1.weight" in out.stdout


def test_a_batch_is_split_into_micro_batches_or_refused_with_the_reason():
    from mixle_compile.runtime.session import micro_batches

    inputs, targets = torch.arange(12).reshape(6, 2), torch.arange(6)
    pieces = micro_batches(inputs, targets, 3)
    assert [(x.tolist(), y.tolist()) for x, y in pieces] == [
        ([[0, 1], [2, 3]], [0, 1]),
        ([[4, 5], [6, 7]], [2, 3]),
        ([[8, 9], [10, 11]], [4, 5]),
    ]
    with pytest.raises(ValueError, match="a batch of 6 examples does not split into microbatches=4"):
        micro_batches(inputs, targets, 4)
    with pytest.raises(ValueError, match="the batch has 6 input examples but 4 target rows; give one target row"):
        micro_batches(inputs, targets[:4], 2)

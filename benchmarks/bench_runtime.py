"""Runtime step time vs hand-written torch-native equivalents, side by side in one run.

Two comparisons on the same transformer, the same batches and AdamW, fp32, on CPU with gloo:

- data parallel (``dp_replicate``): the runtime's plan replay vs ``DistributedDataParallel``;
- FSDP (``dp_shard``): the runtime's plan replay vs FSDP2 ``fully_shard`` per block and at the root
  (parameters freed after forward and gathered again for backward, as the plan does).

Each comparison starts its ranks once; every rank alternates timed rounds of the runtime and of the
native job, so both see the same machine state. Printed: the median step time of each and their
ratio (runtime / native; the target is <= 1.05), both in wall-clock time and in the CPU time of
the rank's process (every thread, communication included), which is steadier on a shared machine.
Nothing asserts an absolute time.

    .venv/bin/python benchmarks/bench_runtime.py [--ranks 2] [--steps 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import textwrap
import time

SPEC = """
model: {{family: transformer, vocab_size: 2048, hidden_size: 256, num_layers: 4, num_heads: 8, num_kv_heads: 4,
        ffn_hidden_size: 768, tie_embeddings: false}}
mesh: {{dp_replicate: {dr}, dp_shard: {ds}}}
training: {{global_batch_size: {gbs}, micro_batch_size: 4, seq_len: 128, precision: fp32, optimizer: adamw,
           learning_rate: 1.0e-4, steps: 1}}
backend: torch
resources: {{devices: {world}, memory: 4GiB, kind: cpu}}
"""


def _doc(kind: str, ranks: int):
    from mixle_compile.lower.lowering import lower
    from mixle_compile.plan import build_plan, load_plan_text, plan_text
    from mixle_compile.spec import load_spec_text

    dr, ds = (ranks, 1) if kind == "ddp" else (1, ranks)
    loaded = load_spec_text(textwrap.dedent(SPEC.format(dr=dr, ds=ds, gbs=4 * ranks, world=ranks)), "bench.yaml")
    assert loaded.ok, [d.text() for d in loaded.diagnostics]
    return load_plan_text(plan_text(build_plan(loaded.spec, lower(loaded.spec), loaded.diagnostics)))


def _native(instructions, kind: str):
    """The same transformer as an nn.Module of blocks, for DDP and FSDP2."""
    import torch
    from torch import nn

    from mixle_compile.runtime import model as m
    from mixle_compile.runtime.parameters import initial_value

    shape = m.TransformerShape.from_spec(instructions.spec)

    class Part(nn.Module):
        def __init__(self, names):
            super().__init__()
            self.names = list(names)
            self.weights = nn.ParameterList(
                [nn.Parameter(initial_value(instructions.param(n), instructions.seed)) for n in names]
            )

    def Ops(part):  # noqa: N802 (reads like the class it builds)
        return m.LocalOps(dict(zip(part.names, part.weights, strict=True)))

    class Block(Part):
        def forward(self, x, rope):
            ops, unit = Ops(self), self.unit
            h = m._norm(ops, shape, x, f"{unit}.attn_norm")
            x = x + m._attention(ops, shape, unit, h, rope)
            h = m._norm(ops, shape, x, f"{unit}.mlp_norm")
            return x + m._mlp(ops, shape, unit, h)

    class Embedding(Part):
        def forward(self, ids):
            return m._vocab_lookup(ids, Ops(self).weight("embed.weight"), 0)

    class Head(Part):
        def forward(self, x, targets):
            ops = Ops(self)
            h = m._norm(ops, shape, x, "final_norm")
            logits = torch.nn.functional.linear(h, ops.weight("lm_head.weight")).float()
            return ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.t().reshape(-1), 0).mean()

    class Transformer(nn.Module):
        def __init__(self):
            super().__init__()
            names = [p.name for p in instructions.params]
            self.embed = Embedding([n for n in names if n.startswith("embed.")])
            self.blocks = nn.ModuleList()
            for i in range(shape.num_layers):
                block = Block([n for n in names if n.startswith(f"layers.{i}.")])
                block.unit = f"layers.{i}"
                self.blocks.append(block)
            self.head = Head([n for n in names if n.startswith(("final_norm", "lm_head"))])

        def forward(self, inputs, targets):
            ids = inputs.t()
            x = self.embed(ids)
            rope = m._rope_tables(ids.shape[0], shape.head_dim, x.dtype, x.device)
            for block in self.blocks:
                x = block(x, rope)
            return self.head(x, targets)

    model = Transformer()
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model.embed, mesh=mesh)
        fully_shard(model.head, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped = model
    return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=instructions.learning_rate)


def _rank_main(kind: str, steps: int, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    from mixle_compile.runtime.data import local_batch
    from mixle_compile.runtime.instructions import read_instructions
    from mixle_compile.runtime.mesh import Mesh
    from mixle_compile.runtime.session import DistributedSession, join_process_group
    from mixle_compile.runtime.worker import batch_layout, token_source

    torch.set_num_threads(1)
    ranks = int(os.environ["WORLD_SIZE"])
    doc = _doc(kind, ranks)
    instructions = read_instructions(doc)
    join_process_group(ranks)
    mesh = Mesh.create(doc.groups, timeout_s=120)
    session = DistributedSession(instructions, mesh, device=torch.device("cpu"))
    native, optimizer = _native(instructions, kind)
    source, layout = token_source(instructions, None), batch_layout(instructions)
    batches = [local_batch(source, layout, s, 0, mesh.data_rank) for s in range(steps)]

    def runtime_round():
        for inputs, targets in batches:
            session.train_batch(inputs, targets)

    def native_round():
        for inputs, targets in batches:
            native(inputs, targets).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    wall = {"runtime": [], "native": []}
    cpu = {"runtime": [], "native": []}
    runtime_round(), native_round()  # warm up both
    for i in range(rounds):
        # Alternate which goes first, so that neither always follows the other.
        jobs = (("runtime", runtime_round), ("native", native_round))
        for name, job in jobs if i % 2 == 0 else jobs[::-1]:
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            job()
            dist.barrier()
            wall[name].append((time.perf_counter() - start) / steps)
            cpu[name].append((time.process_time() - start_cpu) / steps)
    if mesh.rank == 0:
        label = "DDP" if kind == "ddp" else "FSDP2 fully_shard"
        for what, times in (("wall", wall), ("cpu", cpu)):
            r, n = statistics.median(times["runtime"]), statistics.median(times["native"])
            ratios = sorted(a / b for a, b in zip(times["runtime"], times["native"], strict=True))
            print(
                f"{kind:5s} {ranks} ranks, {what:4s} time: runtime {r * 1e3:7.1f} ms/step  "
                f"{label:17s} {n * 1e3:7.1f} ms/step  "
                f"ratio {statistics.median(ratios):.3f} (median of {rounds} paired rounds, "
                f"range {ratios[0]:.3f}-{ratios[-1]:.3f})",
                flush=True,
            )
    dist.destroy_process_group()


def _launch(kind: str, ranks: int, steps: int, rounds: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(ranks):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(ranks),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--rank-main", kind, "--steps", str(steps), "--rounds", str(rounds)], env=env
            )
        )
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"{kind}: ranks exited with {codes}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--rank-main", choices=("ddp", "fsdp"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        _rank_main(args.rank_main, args.steps, args.rounds)
        return
    for kind in ("ddp", "fsdp"):
        _launch(kind, args.ranks, args.steps, args.rounds)


if __name__ == "__main__":
    main()

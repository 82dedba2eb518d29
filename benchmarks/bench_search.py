"""Plan search: how long `mixle-compile plan` takes, and where it ranks published layouts.

    python benchmarks/bench_search.py            # search time for Llama 3 8B/70B/405B at several device counts
    python benchmarks/bench_search.py --anchors  # every published row of bench_step_time.py, searched

Timing: each search runs in this process (imports and the first solver call warmed by a small
search first); the wall time and the process's CPU time are printed side by side (the CPU time
is what the search costs; the wall time also counts other processes on a shared machine), with
the candidates enumerated, screened with the verifier's rules and confirmed by `check`.

Anchors: for every row of benchmarks/bench_step_time.py (published measurements), the search gets
the row's model, device count and kind, global batch, sequence length, precision, compile setting
and engine, and chooses everything else (mesh, micro-batching, checkpointing, schedule, virtual
stages, distributed optimizer, sequence parallelism) that the row's engine could do: a row measured
on an engine older than the backend version it is checked with (bench_step_time.ENGINE_LIMITS: the
SC21 rows, Megatron-LM of April 2021) keeps what that engine lacked fixed, and its checkpointing is
searched over the modes it had (one search per mode, merged). The search lists one plan per mesh (its
degrees, with that mesh's fastest settings), as `mixle-compile plan` does. Printed per row: the
published mesh's rank among the search's top 20 meshes, the top choice, and the predicted step
time of the published layout over the top choice's (>= 1: the top choice is predicted at least as
fast); the same again with the row's training settings kept. Nothing asserts.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import yaml  # noqa: E402

from mixle_compile.search import MESH_KEY, TRAINING_FIELDS, loses_because, read_request, search  # noqa: E402

LLAMA = {
    "8B": dict(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336),
    "70B": dict(
        vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8, ffn_hidden_size=28672
    ),
    "405B": dict(
        vocab_size=128256, hidden_size=16384, num_layers=126, num_heads=128, num_kv_heads=8, ffn_hidden_size=53248
    ),
}
#: Llama 3's published pre-training batch: 16M tokens of 8192 (Dubey et al. 2024, 3.4.1) for 405B; the
#: same batch in sequences for the others keeps every device count below it in the data-parallel range.
GLOBAL_BATCH = 2048


def timing_spec(size: str, devices: int, backend: dict) -> dict:
    return {
        "model": {"family": "transformer", **LLAMA[size]},
        "training": {"global_batch_size": GLOBAL_BATCH, "seq_len": 8192, "precision": "bf16"},
        "backend": backend,
        "resources": {"devices": devices, "kind": "h100", "memory": "80GiB"},
    }


def run(data: dict, top: int = 5):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "spec.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        wall, cpu = time.perf_counter(), time.process_time()
        outcome = search(read_request(path), top=top)
        return outcome, time.perf_counter() - wall, time.process_time() - cpu


def timings() -> None:
    run(timing_spec("8B", 8, {"name": "torchtitan", "version": "0.2"}), top=1)  # warm imports and the solver
    print(
        f"{'model':6} {'devices':>7} {'backend':10} {'wall s':>7} {'cpu s':>6} "
        f"{'enumerated':>11} {'screened':>9} {'checked':>8}  best"
    )
    for size, counts in (("8B", (64, 1024, 16384)), ("70B", (64, 1024, 16384)), ("405B", (512, 4096, 16384))):
        for devices in counts:
            for backend in ({"name": "torchtitan", "version": "0.2"}, {"name": "megatron", "version": "0.16"}):
                outcome, wall, cpu = run(timing_spec(size, devices, backend))
                best = outcome.plans[0].mesh_text() if outcome.plans else f"none: {outcome.reason}"
                print(
                    f"{size:6} {devices:7} {backend['name']:10} {wall:7.2f} {cpu:6.2f} {outcome.enumerated:11,} "
                    f"{outcome.screened:9,} {outcome.confirmed:8}  {best}"
                )


def _rank(outcome, values: dict, keys) -> int | None:
    return next((i for i, p in enumerate(outcome.plans, 1) if all(p.values[k] == values[k] for k in keys)), None)


class _Merged:
    """Searches of one row merged: every plan, fastest first, one per mesh (as the search lists them)."""

    def __init__(self, outcomes: list, top: int):
        seen, self.plans = set(), []
        for plan in sorted((p for o in outcomes for p in o.plans), key=lambda p: p.step.seconds):
            key = tuple(plan.values[k] for k in MESH_KEY)
            if key not in seen:
                seen.add(key)
                self.plans.append(plan)
        self.plans = self.plans[:top]
        self.reason = "; ".join(o.reason for o in outcomes if o.reason)


def _requests(data: dict, keep_training: bool, limits: dict | None) -> list[dict]:
    """The search requests of a row: its mesh left open (and its training settings unless kept), within
    what the row's engine could do (bench_step_time.ENGINE_LIMITS): one request per checkpointing mode it
    had when checkpointing is searched."""
    request = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    request.pop("mesh")
    request["training"].pop("pipeline_layers", None)
    if not keep_training:
        for key in TRAINING_FIELDS:
            request["training"].pop(key, None)
    if limits is None:
        return [request]
    request["mesh"] = {**{k: "auto" for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp")}, **limits["mesh"]}
    request["training"].update(limits["training"])
    if keep_training:
        return [request]
    out = []
    for mode in limits["checkpointing"]:
        one = {**request, "training": {**request["training"], "activation_checkpointing": mode}}
        out.append(one)
    return out


def anchors() -> None:
    import bench_step_time as rows

    from mixle_compile.lower.lowering import lower
    from mixle_compile.spec import load_spec_text
    from mixle_compile.step_time import predict_lowered

    print("mesh: the published mesh degrees' place among the top 20 meshes (every setting searched);")
    print("ratio: published predicted step / top choice's; the starred columns search the mesh alone, the row's")
    print("micro-batch, checkpointing, schedule and optimizer kept.")
    print()
    print("why: the part of the step that makes the published layout slower than the top choice, by the model.")
    print()
    print(f"{'row':34} {'mesh':>5} {'ratio':>6} {'mesh*':>6} {'ratio*':>6}  {'why':44} top choice (all searched)")
    # The model's resolution: its median error over the rows it is calibrated on (bench_step_time.py).
    import statistics

    ratios = rows.ratios_of(rows.lowered_rows())
    errors = [abs(r - 1) for (label, *_), r in zip(rows.ROWS, ratios, strict=True) if rows.counted(label)]
    band = statistics.median(errors)
    in_top = in_top_kept = counted = near = near_missed = 0
    for label, data, _ in rows.ROWS:
        loaded = load_spec_text(yaml.safe_dump(data), "row.yaml")
        published = loaded.spec
        predicted = predict_lowered(published, lower(published, schedule=False))
        published_seconds = predicted.seconds
        values = {**published.mesh.model_dump(), **published.training.model_dump()}
        results = []
        limits = getattr(rows, "ENGINE_LIMITS", {}).get(label)
        for keep_training in (False, True):
            outcomes, wall = [], 0.0
            for request in _requests(data, keep_training, limits):
                outcome, seconds, _ = run(request, top=20)
                outcomes.append(outcome)
                wall += seconds
            results.append((outcomes[0] if len(outcomes) == 1 else _Merged(outcomes, 20), wall))
        (free, wall), (kept, _) = results
        if not free.plans:
            print(f"{label:34} no plan: {free.reason}")
            continue
        show = lambda r: str(r) if r is not None else ">20"  # noqa: E731
        mesh_rank = _rank(free, values, MESH_KEY)
        kept_rank = _rank(kept, values, MESH_KEY) if kept.plans else None
        kept_ratio = f"{published_seconds / kept.plans[0].step.seconds:6.3f}" if kept.plans else "     -"
        top = free.plans[0]
        counted += 1
        in_top += mesh_rank is not None and mesh_rank <= 5
        in_top_kept += kept_rank is not None and kept_rank <= 5
        close = published_seconds / top.step.seconds <= 1 + band
        near += close
        near_missed += close and (mesh_rank is None or mesh_rank > 5)
        why = loses_because(predicted, top.step) or "-"
        print(
            f"{label:34} {show(mesh_rank):>5} {published_seconds / top.step.seconds:6.3f} {show(kept_rank):>6} "
            f"{kept_ratio}  {why:44} {top.mesh_text()}; {top.training_text()} ({wall:.1f}s)"
        )
    print(
        f"\npublished mesh in the top 5 meshes: {in_top} of {counted} rows with every setting searched, "
        f"{in_top_kept} of {counted} with the row's training settings kept"
    )
    print(
        f"published layout predicted within {band:.1%} of the top choice (the model's median error on these rows, "
        f"inside which it does not tell layouts apart): {near} of {counted} rows, {near_missed} of them "
        "outside the top 5"
    )


def main(argv: list[str]) -> int:
    if "--anchors" in argv:
        anchors()
    else:
        timings()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

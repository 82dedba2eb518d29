"""Lowering time at 64 ranks against 131,072 ranks, same model, measured side by side.

Lowering is symbolic in the ranks (layouts, updates and memory depend on the model and the
degrees; groups are rules, not rank lists; the schedule is checked on one representative rank
per pipeline stage), so the two times should be about equal.

    python benchmarks/bench_lower.py
"""

from __future__ import annotations

import statistics
import time

from mixle_compile.lower.lowering import lower
from mixle_compile.spec import load_spec_text

SPEC = """\
model: {{family: transformer, vocab_size: 128256, hidden_size: 4096, num_layers: 32, num_heads: 32, num_kv_heads: 8,
        ffn_hidden_size: 14336}}
mesh: {{dp_shard: {dp_shard}, tp: 8, pp: 4, microbatches: 8}}
training: {{global_batch_size: {gbs}, micro_batch_size: 1, seq_len: 8192, sequence_parallel: true}}
backend: torch
resources: {{devices: {world}, memory: 80GiB}}
"""


def spec_for(world: int):
    dp_shard = world // 32  # both worlds shard with FSDP, so both plans hold the same updates
    loaded = load_spec_text(SPEC.format(dp_shard=dp_shard, gbs=8 * dp_shard, world=world), f"{world}.yaml")
    assert loaded.ok, [d.text() for d in loaded.diagnostics]
    return loaded.spec


def median_time(spec, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        lowered = lower(spec)
        times.append(time.perf_counter() - start)
        assert lowered.schedule.check.ok and not lowered.reduction_problems
    return statistics.median(times)


def main() -> None:
    small, large = spec_for(64), spec_for(131_072)
    lower(small)  # warm caches and imports
    t_small, t_large = median_time(small), median_time(large)
    print(f"{'world':>10} {'lower() median':>16}")
    print(f"{64:>10} {t_small * 1e3:>13.1f} ms")
    print(f"{131_072:>10} {t_large * 1e3:>13.1f} ms")
    print(f"ratio 131,072 / 64 ranks: {t_large / t_small:.2f}")


if __name__ == "__main__":
    main()

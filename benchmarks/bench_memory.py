"""The memory model against measured peaks: explain's heaviest rank / the engine's measured peak.

    python benchmarks/bench_memory.py

Every row is a published measurement: torchtitan's benchmark tables report the peak memory per
GPU of each run (`benchmarks/llama3_h100_202412_torchtitan.md` Tables 1-6 and the Trainy H200
benchmark, at the commits named in each spec's header). The spec of each row is the corpus file
in tests/corpus/production/torchtitan/ that translates that run. The script prints, per row, the
estimate of the heaviest rank (the lowering's exact pricing, which R001 bounds), the measured
peak, their ratio, whether R001 accepts the spec (and whether R002 warns that it fits only without
the allocator's reserve), and the summary (min, median, max).

Nothing here asserts: the figures are for people (and for the memory-model work that must bring
every ratio into 0.8-1.25).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mixle_compile.check import check_file  # noqa: E402
from mixle_compile.diagnostics import Severity  # noqa: E402
from mixle_compile.lower.lowering import lower  # noqa: E402
from mixle_compile.spec import load_spec  # noqa: E402

CORPUS = ROOT / "tests" / "corpus" / "production" / "torchtitan"
GIB = 2**30

# (corpus file, measured peak GiB per GPU, the table it comes from)
ROWS = [
    ("llama3_8b_8gpu_fsdp8.yaml", 82.4, "Table 1, FSDP"),
    ("llama3_8b_8gpu_fsdp8_fp8.yaml", 76.8, "Table 1, FSDP + compile + Float8"),
    ("llama3_8b_8gpu_fsdp8_cp1_seq32k_fp8.yaml", 83.9, "Table 2, FSDP 8 CP 1"),
    ("llama3_8b_8gpu_fsdp4_cp2_seq64k_fp8.yaml", 84.2, "Table 2, FSDP 4 CP 2"),
    ("llama3_8b_8gpu_fsdp2_cp4_seq128k_fp8.yaml", 84.0, "Table 2, FSDP 2 CP 4"),
    ("llama3_8b_8gpu_fsdp1_cp8_seq256k_fp8.yaml", 84.5, "Table 2, FSDP 1 CP 8"),
    ("llama3_8b_128gpu_fsdp128.yaml", 67.0, "Table 3, FSDP"),
    ("llama3_8b_128gpu_fsdp128_fp8.yaml", 61.8, "Table 3, FSDP + compile + Float8"),
    ("llama3_70b_256gpu_fsdp32_tp8_fp8_asynctp.yaml", 67.6, "Table 4, 2D + AsyncTP"),
    ("llama3_405b_512gpu_fsdp8_tp8_pp8_1f1b.yaml", 82.5, "Table 5, 1F1B"),
    ("llama3_405b_512gpu_fsdp8_tp8_pp8_interleaved1f1b.yaml", 72.7, "Table 5, Interleaved 1F1B"),
    ("llama3_405b_512gpu_fsdp8_tp8_pp8_cp1_seq32k.yaml", 75.3, "Table 6, FSDP 8 CP 1"),
    ("llama3_405b_512gpu_fsdp4_tp8_pp8_cp2_seq64k.yaml", 75.9, "Table 6, FSDP 4 CP 2"),
    ("llama3_405b_512gpu_fsdp2_tp8_pp8_cp4_seq128k.yaml", 77.1, "Table 6, FSDP 2 CP 4"),
    ("llama3_405b_512gpu_fsdp1_tp8_pp8_cp8_seq256k.yaml", 84.9, "Table 6, FSDP 1 CP 8"),
    ("llama3_8b_h200_32gpu_fsdp32_fp8.yaml", 47.96, "Trainy H200, 4 nodes"),
    ("llama3_8b_h200_64gpu_fsdp64_fp8.yaml", 46.97, "Trainy H200, 8 nodes"),
]


def main() -> int:
    ratios = []
    print(f"{'row':52} {'estimate':>9} {'measured':>9} {'ratio':>6}  R001")
    for name, measured, source in ROWS:
        path = CORPUS / name
        spec = load_spec(path).spec
        heaviest = max(stage.total for stage in lower(spec, schedule=False).memory) / GIB
        found = check_file(path).diagnostics
        accepted = not any(d.code == "R001" and d.severity is Severity.error for d in found)
        squeezed = any(d.code == "R002" for d in found)
        ratio = heaviest / measured
        ratios.append(ratio)
        verdict = ("accepts" if accepted else "refuses") + (" (R002)" if squeezed else "")
        print(f"{source:52} {heaviest:8.1f}G {measured:8.1f}G {ratio:6.2f}  {verdict}")
    print(
        f"\nexplain / measured over {len(ratios)} rows: min {min(ratios):.2f}, median {statistics.median(ratios):.2f}, "
        f"max {max(ratios):.2f}; within 0.8-1.25: {sum(0.8 <= r <= 1.25 for r in ratios)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

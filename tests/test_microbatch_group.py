"""Megatron's interleaved micro-batch group (``training.microbatch_group_size``).

Megatron-Core runs its interleaved schedule in groups of ``microbatch_group_size_per_vp_stage``
micro-batches per virtual stage (default pp): P004 holds Megatron's own checks on it, the lowered
schedule runs the engine's order for it (compared with Megatron-Core's table in
tests/test_engines.py), the memory rule and the lowering count the micro-batches it holds alike,
the Megatron-LM reader and writer carry its flag, and torch's engines refuse it (P013).
"""

from __future__ import annotations

import textwrap

import pytest

from mixle_compile.check import check_loaded
from mixle_compile.export import ExportRefused, export_spec
from mixle_compile.importers import ImportOptions, read_any
from mixle_compile.lower.lowering import lower
from mixle_compile.lower.schedule import pipeline_schedule
from mixle_compile.schedules import ScheduleFamily, refusal
from mixle_compile.spec import load_spec_text
from mixle_compile.verify import memory_bound


def spec_text(*, microbatches: int, group: int | None, backend: str = "megatron", pp: int = 4, v: int = 2) -> str:
    group_text = "" if group is None else f", microbatch_group_size: {group}"
    backend_text = "{name: megatron, version: '0.16'}" if backend == "megatron" else backend
    return textwrap.dedent(
        f"""\
        model: {{family: transformer, vocab_size: 128, hidden_size: 32, num_layers: 8, num_heads: 4,
                ffn_hidden_size: 64}}
        mesh: {{dp_replicate: 1, tp: 1, pp: {pp}, microbatches: {microbatches}}}
        training: {{global_batch_size: {microbatches}, micro_batch_size: 1, seq_len: 64, precision: bf16,
                   optimizer: adamw, pipeline_schedule: interleaved_1f1b, virtual_pipeline_stages: {v}{group_text}}}
        backend: {backend_text}
        resources: {{devices: {pp}, memory: 80GiB}}
        """
    )


def errors(text: str) -> list:
    result = check_loaded(load_spec_text(text, "x.yaml"), group=False)
    return [d for d in result.diagnostics if d.severity.value == "error"]


def codes(text: str) -> set[str]:
    return {d.code for d in errors(text)}


@pytest.mark.parametrize(
    "m, group, refused",
    [
        (8, None, False),  # the default group, pp: m % pp == 0
        (5, None, True),
        (5, 5, False),  # Megatron-LM's tunable-overlap test: pp 4, 5 micro-batches in one group of 5
        (9, 5, False),  # a last group of 4, not fewer than pp
        (7, 5, True),  # a last group of 2 < pp
        (8, 3, True),  # a group below pp
        (8, 9, True),  # a group above the micro-batches
        (12, 6, False),
    ],
)
def test_p004_applies_megatrons_group_checks(m, group, refused):
    """forward_backward_pipelining_with_interleaving (Megatron-Core 0.16): the group within [pp, m]
    and the last group either empty or at least pp; the verifier, the schedule builder's refusal and
    the numbers agree."""
    assert ("P004" in codes(spec_text(microbatches=m, group=group))) == refused
    assert (refusal(ScheduleFamily.MEGATRON, "interleaved_1f1b", 4, m, 2, group) is not None) == refused
    if not refused:
        programs = pipeline_schedule(4, m, "interleaved_1f1b", 2, family="megatron", group=group)
        assert len(programs) == 4
    else:
        with pytest.raises(ValueError, match="P004"):
            pipeline_schedule(4, m, "interleaved_1f1b", 2, family="megatron", group=group)


def test_the_explanation_names_the_group_and_why():
    (p004,) = [d for d in errors(spec_text(microbatches=7, group=5)) if d.code == "P004"]
    assert "last group of 2, fewer than pp=4" in p004.message and "microbatch_group_size=5" in p004.message
    (p004,) = [d for d in errors(spec_text(microbatches=8, group=3)) if d.code == "P004"]
    assert "not within [pp=4, 8 micro-batches]" in p004.message


@pytest.mark.parametrize("backend", ["torch", "torchtitan"])
def test_torch_engines_refuse_the_group(backend):
    assert "P013" in codes(spec_text(microbatches=8, group=4, backend=backend))
    assert "P013" not in codes(spec_text(microbatches=8, group=None, backend=backend))


@pytest.mark.parametrize("group", [4, 8, 16])
def test_a_larger_group_holds_more_micro_batches_and_both_memory_readings_agree(group):
    """Megatron's warm-up is 2 (pp - rank - 1) + (v - 1) * group forwards: a larger group keeps more
    chunks' activations; the lowering's stages and R001's bound count them alike."""
    spec = load_spec_text(spec_text(microbatches=16, group=group), "x.yaml").spec
    stages = lower(spec, schedule=False).memory
    bound = {kind: float(v) for kind, v in memory_bound(spec).items()}
    assert stages[0].activations == pytest.approx(bound["activations"], rel=1e-9, abs=1)
    default = lower(load_spec_text(spec_text(microbatches=16, group=None), "x.yaml").spec, schedule=False).memory
    if group == 4:
        assert stages[0].activations == default[0].activations
    else:
        assert stages[0].activations > default[0].activations


def test_the_megatron_launch_carries_the_group_both_ways(tmp_path):
    spec = load_spec_text(spec_text(microbatches=10, group=5), "x.yaml").spec
    exported = export_spec(spec, "megatron")
    text = exported.files[exported.main]
    assert "--microbatch-group-size-per-virtual-pipeline-stage 5" in text
    (tmp_path / exported.main).write_text(text)
    doc, _ = read_any(tmp_path / exported.main, exported.main, ImportOptions())
    assert doc.data["training"]["microbatch_group_size"] == 5
    with pytest.raises(ExportRefused):
        export_spec(spec, "torchtitan")
    bad = tmp_path / "bad.args"
    bad.write_text(
        "--num-layers 8 --hidden-size 32 --num-attention-heads 4 --vocab-size 128 --micro-batch-size 1 "
        "--global-batch-size 8 --microbatch-group-size-per-virtual-pipeline-stage 0\n"
    )
    from mixle_compile.spec.source import SourceError

    with pytest.raises(SourceError, match="must be at least 1"):
        read_any(bad, "bad.args", ImportOptions())


def test_every_group_check_accepts_compiles_to_a_checked_schedule():
    """Over pipelines of 2 to 4 stages, 2 and 3 virtual stages and every group: what the rules accept
    (P004, P014) lowers to a schedule that passes its own check (with Megatron's receives prefetched
    under a group above pp: EngineProfile.sends_buffered); two stages with a larger group are refused."""
    compiled = refused_two = 0
    for pp in range(2, 5):
        for v in (2, 3):
            for m in range(pp, 2 * pp + 3):
                for group in range(pp, m + 1):
                    text = spec_text(microbatches=m, group=group, pp=pp, v=v).replace(
                        "num_layers: 8", f"num_layers: {pp * v * 2}"
                    )
                    found = codes(text)
                    if "P004" in found:
                        continue
                    if pp == 2 and group > pp:
                        assert "P014" in found
                        refused_two += 1
                        continue
                    assert not found, (pp, v, m, group, found)
                    lowered = lower(load_spec_text(text, "x.yaml").spec)
                    assert lowered.schedule.check.ok, (pp, v, m, group, lowered.schedule.check.problems[:1])
                    compiled += 1
    assert compiled > 40 and refused_two > 5


def test_a_megatron_plan_with_a_larger_group_replays_as_planned_and_matches_one_process(tmp_path):
    """Three stages, two virtual stages each, 7 micro-batches in a group of 4 and a last group of 3: the
    runtime replays the lowered order (the engine's), every planned collective observed, every update
    equal to the single-process reference."""
    from mixle_compile.runtime import run_plan
    from tests.test_runtime_support import compile_text

    text = (
        spec_text(microbatches=7, group=4, pp=3)
        .replace("num_layers: 8", "num_layers: 6")
        .replace("precision: bf16", "precision: fp32")
        .replace("memory: 80GiB", "memory: 1GiB")
    )
    doc = compile_text(text)
    report = run_plan(doc, steps=2, out_dir=tmp_path, reference=True, progress=False, timeout_s=120)
    assert report.ok, report.errors
    assert report.accounting_ok and report.updates_checked > 0
    assert report.max_relative_error <= 1e-5

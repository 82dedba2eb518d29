"""explain --plot: what the figure draws, read back from matplotlib's Figure (Agg backend)."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("matplotlib")

from matplotlib.patches import Rectangle  # noqa: E402

from mixle_compile import cli  # noqa: E402
from mixle_compile.compile import compile_file  # noqa: E402
from mixle_compile.memory_model import MEMORY_KINDS  # noqa: E402
from mixle_compile.plan import load_plan_text, plan_text  # noqa: E402
from mixle_compile.plot import INSTALL_HINT, PlotError, byte_unit, plan_figure, plot_plan, timeline  # noqa: E402
from mixle_compile.report import traffic_per_axis  # noqa: E402
from tests.conftest import EXAMPLES  # noqa: E402

PIPELINED = """\
model: {family: transformer, vocab_size: 256, hidden_size: 64, num_layers: 8, num_heads: 4, num_kv_heads: 2, \
ffn_hidden_size: 128}
mesh: {pp: 4, microbatches: 4}
training: {global_batch_size: 8, micro_batch_size: 2, seq_len: 32, precision: fp32, pipeline_schedule: SCHEDULE}
backend: torch
resources: {devices: 4, kind: cpu, memory: 2GiB}
"""


def plan_of(path):
    result = compile_file(path)
    assert result.plan is not None, [d.text() for d in result.check.diagnostics]
    return load_plan_text(plan_text(result.plan))


@pytest.fixture(scope="module")
def moe():
    return plan_of(EXAMPLES / "tiny-moe-every-axis.yaml")


@pytest.fixture(scope="module")
def figure(moe):
    import matplotlib.pyplot as plt

    fig = plan_figure(moe)
    yield fig
    plt.close(fig)


def panel(fig, title: str):
    (ax,) = [ax for ax in fig.axes if ax.get_title().startswith(title)]
    return ax


def bars(ax):
    return [p for p in ax.patches if isinstance(p, Rectangle)]


def test_byte_units_read_below_1024():
    assert byte_unit(500) == ("B", 1.0)
    assert byte_unit(402 * 1024) == ("KiB", 1024.0)
    assert byte_unit(80 * 2**30) == ("GiB", 2.0**30)
    assert byte_unit(2**70)[0] == "PiB"


def test_memory_is_a_stacked_bar_per_stage_of_the_memory_terms(moe, figure):
    ax = panel(figure, "memory per rank")
    unit, scale = byte_unit(max(m.total for m in moe.memory))  # the device (1 GiB) is far above: no line
    assert ax.get_ylabel() == unit == "KiB"
    held = [k for k in MEMORY_KINDS if any(getattr(m, k) for m in moe.memory)]
    assert [c.get_label() for c in ax.containers] == [k.replace("_", " ") for k in held]
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"stage {m.stage}" for m in moe.memory]
    for stage, m in enumerate(moe.memory):
        heights = [c.patches[stage].get_height() for c in ax.containers]
        assert heights == pytest.approx([getattr(m, k) / scale for k in held])
        assert sum(heights) == pytest.approx(m.total / scale)  # the segments add up to the rank's total
    labels = [t.get_text() for t in ax.texts]
    assert labels[0].startswith(f"{moe.memory[0].total / 1024:.2f} KiB")  # readable units on the bar
    assert 100 * 1024 < moe.memory[0].total < 1000 * 1024


def test_traffic_is_one_bar_per_axis_summing_its_collectives(moe, figure):
    ax = panel(figure, "traffic per rank per step")
    totals = traffic_per_axis(moe)
    unit, scale = byte_unit(max(totals.values()))
    assert ax.get_xlabel() == unit
    names = [t.get_text() for t in ax.get_yticklabels()]
    assert sorted(names) == sorted(totals) and "ep" in names and "tp" in names
    widths = {name: 0.0 for name in names}
    for rect in bars(ax):
        widths[names[round(rect.get_y() + rect.get_height() / 2)]] += rect.get_width()
    assert widths == pytest.approx({axes: total / scale for axes, total in totals.items()})
    assert {c.get_label() for c in ax.containers} == {t.collective for t in moe.traffic if t.bytes_per_rank_per_step}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_the_timeline_draws_every_compute_op_and_the_bubble(tmp_path, schedule):
    import matplotlib.pyplot as plt

    text = PIPELINED.replace("SCHEDULE", schedule)
    if schedule == "interleaved_1f1b":
        text = text.replace("pipeline_schedule", "virtual_pipeline_stages: 2, pipeline_schedule")
    spec = tmp_path / "pipe.yaml"
    spec.write_text(text)
    doc = plan_of(spec)
    fig = plan_figure(doc)
    ax = panel(fig, "pipeline schedule")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 0", "stage 1", "stage 2", "stage 3"]
    drawn = {"forward": 0, "backward": 0}
    idle = 0.0
    for rect in bars(ax):
        colour = rect.get_facecolor()
        import matplotlib.colors as mc

        if mc.to_hex(colour) == "#4c72b0":
            drawn["forward"] += 1
        elif mc.to_hex(colour) == "#dd8452":
            drawn["backward"] += 1
        elif mc.to_hex(colour) == "#e6e6e6":
            idle += rect.get_width()
    from mixle_compile.lower.compact import plan_programs

    ops = [op.kind for program in plan_programs(doc.schedule, doc.updates) for op in program]
    assert drawn == {"forward": ops.count("forward"), "backward": ops.count("backward")}
    makespan = timeline(doc)["makespan"]
    assert ax.get_xlim()[1] == pytest.approx(makespan)
    # the hatched idle time is the bubble the plan states: (pp - 1) / (v * m + pp - 1)
    assert idle / (4 * makespan) == pytest.approx(doc.schedule.bubble_fraction)
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"forward", "backward", "bubble"}
    plt.close(fig)


def test_plot_writes_png_and_svg_and_refuses_other_names(moe, tmp_path):
    plot_plan(moe, str(tmp_path / "plan.png"))
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plot_plan(moe, str(tmp_path / "plan.svg"))
    svg = (tmp_path / "plan.svg").read_text()
    assert svg.lstrip().startswith("<?xml") and "memory per rank" in svg
    with pytest.raises(PlotError, match=r"writes \.png or \.svg files"):
        plot_plan(moe, str(tmp_path / "plan.jpeg"))


def test_explain_plot_from_the_command_line(capsys, tmp_path):
    out = tmp_path / "tiny.svg"
    assert cli.main(["explain", str(EXAMPLES / "tiny-transformer.yaml"), "--plot", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().err and out.stat().st_size > 10_000
    assert cli.main(["explain", str(EXAMPLES / "tiny-transformer.yaml"), "--plot", str(tmp_path / "x.txt")]) == 2
    assert "--plot writes .png or .svg files" in capsys.readouterr().err


def test_without_matplotlib_the_message_says_how_to_install_it(capsys, tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    status = cli.main(["explain", str(EXAMPLES / "tiny-transformer.yaml"), "--plot", str(tmp_path / "p.png")])
    err = capsys.readouterr().err
    assert status == 2 and INSTALL_HINT in err and not (tmp_path / "p.png").exists()
    assert "pip install -e '.[plot]'" in err and "git+" in err
    assert "pip install mixle-compile" not in err and "pip install 'mixle-compile[plot]'" not in err


def test_an_em_plan_draws_its_passes_by_name():
    import matplotlib.pyplot as plt

    doc = plan_of(EXAMPLES / "composite-nested-mixture.yaml")
    fig = plan_figure(doc)
    ax = panel(fig, "step program")
    from mixle_compile.lower.compact import plan_programs

    names = [op.name for program in plan_programs(doc.schedule, doc.updates) for op in program if op.kind == "forward"]
    assert [t.get_text() for t in ax.texts] == names == ["e_step/score", "e_step/statistics"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["pass over the data"]
    assert "micro-batch" not in ax.get_xlabel()
    plt.close(fig)

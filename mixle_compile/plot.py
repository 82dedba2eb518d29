"""`explain --plot`: a plan drawn as memory per rank, traffic per axis and the pipeline timeline.

Every figure is rendered from a verified PlanDocument only:

- memory per rank: one stacked bar per pipeline stage, one segment per term of
  :data:`mixle_compile.memory_model.MEMORY_KINDS` (docs/memory.md), against the device's memory;
- traffic per axis: the bytes a rank of the busiest stage moves over each set of mesh axes per step
  (:func:`mixle_compile.report.traffic_per_axis`), per collective;
- the pipeline schedule: each stage's program (every rank of a stage runs it) run through the
  schedule simulation of :mod:`mixle_compile.lower.schedule`, forward one unit and backward two
  (divided among virtual chunks), communication instantaneous; the idle time between compute ops
  is the bubble.

matplotlib is the optional `plot` extra; :func:`plan_figure` returns the Figure so that tests can
read what is drawn.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from mixle_compile.memory_model import MEMORY_KINDS
from mixle_compile.plan.document import PlanDocument

#: What `--plot` can write, by file suffix.
FORMATS = (".png", ".svg")
#: How to get matplotlib: the package is installed from a clone or a git URL (docs/ci.md), not an index.
INSTALL_HINT = (
    "plotting needs matplotlib, the `plot` extra: from a clone of this repository run "
    "`pip install -e '.[plot]'`, or install from its git URL with `pip install 'mixle-compile[plot] @ git+URL'` "
    "(see docs/ci.md)"
)
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
#: Colours of the timeline (forward, backward, optimizer, bubble) and of the memory terms.
TIMELINE_COLOURS = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868", "bubble": "#e6e6e6"}


class PlotError(RuntimeError):
    """Why a plot cannot be drawn (matplotlib missing, an unknown file type)."""


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, never a window
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotError(INSTALL_HINT) from exc
    return plt


def byte_unit(largest: float) -> tuple[str, float]:
    """The binary unit in which `largest` bytes reads as a number below 1024 (at least 1 where possible)."""
    scale = 1.0
    for unit in _UNITS:
        if largest < 1024 * scale or unit == _UNITS[-1]:
            return unit, scale
        scale *= 1024
    raise AssertionError("unreachable")


def _ops(doc: PlanDocument):
    from mixle_compile.plan.programs import plan_programs

    return [list(program) for program in plan_programs(doc.schedule, doc.updates)]


def timeline(doc: PlanDocument) -> dict[str, Any]:
    """The simulated step of each pipeline stage: compute spans (kind, micro-batch, chunk, start,
    duration), idle spans (the bubble), the makespan and the mean idle fraction."""
    from mixle_compile.contracts import ParallelPlan
    from mixle_compile.lower.groups import RankGrid
    from mixle_compile.lower.schedule import OpKind, simulate_schedule

    if doc.schedule is None:
        return {"stages": [], "makespan": 0, "idle_fraction": 0.0}
    plan = ParallelPlan.from_dict(doc.mesh.degrees)
    grid = RankGrid.from_plan(plan, order=doc.groups.order, extra_rules=[tuple(r.axes) for r in doc.groups.rules])
    chunks = doc.schedule.virtual_stages
    forward, backward = Fraction(1, chunks), Fraction(2, chunks)  # a chunk holds 1/v of a stage's layers

    def cost(op):
        return forward if op.kind is OpKind.forward else backward if op.kind is OpKind.backward else 0

    programs = _ops(doc)
    # One representative rank per stage (exhaustive_limit 0): every rank of a stage runs its program.
    sim = simulate_schedule(
        programs, grid, cost=cost, exhaustive_limit=0, buffered_sends=doc.schedule.sends == "buffered"
    )
    if not sim.finished:
        raise PlotError("the plan's schedule does not finish in simulation: " + "; ".join(sim.deadlock[:2]))
    stages = []
    for rank, spans in sorted(sim.spans.items(), key=lambda item: grid.stage_of(item[0])):
        program = programs[grid.stage_of(rank)]
        busy, idle, clock = [], [], Fraction(0)
        for start, duration, position in spans:
            op = program[position]
            if start > clock:
                idle.append((float(clock), float(start - clock)))
            if duration:
                busy.append(
                    {
                        "kind": op.kind.value,
                        "name": op.name if op.name and op.name != op.kind.value else "",
                        "microbatch": op.microbatch,
                        "chunk": op.chunk,
                        "start": float(start),
                        "duration": float(duration),
                    }
                )
            clock = max(clock, start + duration)
        if sim.makespan > clock:
            idle.append((float(clock), float(sim.makespan - clock)))
        stages.append({"stage": grid.stage_of(rank), "rank": rank, "busy": busy, "idle": idle})
    return {"stages": stages, "makespan": float(sim.makespan), "idle_fraction": sim.bubble}


def plan_figure(doc: PlanDocument):
    """The Figure `explain --plot` writes: memory per rank, traffic per axis, the pipeline timeline."""
    from mixle_compile.report import explain_data, human_bytes

    plt = _pyplot()
    data = explain_data(doc)
    fig = plt.figure(figsize=(13, 8.5))
    grid = fig.add_gridspec(2, 2, height_ratios=(1, 1), width_ratios=(1, 1.2))
    memory, traffic, schedule = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :])
    _draw_memory(memory, data, human_bytes)
    _draw_traffic(traffic, doc, human_bytes)
    _draw_timeline(schedule, doc)
    mesh = data["mesh"]
    fig.suptitle(
        f"plan {doc.content_digest[:19]}: "
        + " x ".join(f"{n}={s}" for n, s in zip(mesh["names"], mesh["shape"], strict=True))
        + f", world {mesh['world_size']}",
        fontsize=11,
    )
    fig.tight_layout()
    return fig


def _draw_memory(ax, data: dict[str, Any], human_bytes) -> None:
    rows = data["memory_per_rank"]
    device = rows[0]["device_memory"] if rows else None
    heaviest = max([r["total"] for r in rows] + [1])
    # the device's line only where it shares a scale with the bars (a few MiB on an 80 GiB device would vanish)
    line = device is not None and device <= 3 * heaviest
    unit, scale = byte_unit(max(heaviest, device) if line else heaviest)
    stages = [f"stage {r['stage']}" for r in rows]
    bottom = [0.0] * len(rows)
    for kind in MEMORY_KINDS:
        values = [r[kind] / scale for r in rows]
        if not any(values):
            continue  # a term no stage holds (no recompute, no loss buffers) stays out of the legend
        ax.bar(stages, values, bottom=bottom, label=kind.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for x, r in enumerate(rows):
        share = "" if not device else f" ({r['total'] / device:.0%})" if r["total"] >= device / 100 else " (<1%)"
        ax.annotate(human_bytes(r["total"]) + share, (x, r["total"] / scale), ha="center", va="bottom", fontsize=8)
    if line:
        ax.axhline(
            device / scale, color="black", linestyle="--", linewidth=1, label=f"device memory {human_bytes(device)}"
        )
    ax.set(
        title="memory per rank (by pipeline stage)" + (f", of {human_bytes(device)} per device" if device else ""),
        ylabel=unit,
    )
    ax.margins(y=0.12)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _draw_traffic(ax, doc: PlanDocument, human_bytes) -> None:
    from mixle_compile.report import traffic_per_axis

    totals = traffic_per_axis(doc)
    if not totals:
        ax.text(0.5, 0.5, "no communication", ha="center", va="center", transform=ax.transAxes)
        ax.set(title="traffic per rank per step (busiest stage)")
        ax.set_xticks([]), ax.set_yticks([])
        return
    unit, scale = byte_unit(max(totals.values()) or 1)
    # the collectives behind each axis's total (of its busiest stage)
    busiest: dict[str, tuple[int, int]] = {}
    per_stage: dict[tuple[str, int], int] = {}
    for t in doc.traffic:
        key = ("+".join(t.axes), t.stage)
        per_stage[key] = per_stage.get(key, 0) + t.bytes_per_rank_per_step
    for (axes, stage), total in per_stage.items():
        if total > busiest.get(axes, (-1, -1))[1]:
            busiest[axes] = (stage, total)
    labels = sorted(totals, key=totals.get)
    kinds = sorted({t.collective for t in doc.traffic})
    left = [0.0] * len(labels)
    for kind in kinds:
        values = [
            sum(
                t.bytes_per_rank_per_step
                for t in doc.traffic
                if "+".join(t.axes) == axes and t.stage == busiest[axes][0] and t.collective == kind
            )
            / scale
            for axes in labels
        ]
        if any(values):
            ax.barh(labels, values, left=left, label=kind)
            left = [a + v for a, v in zip(left, values, strict=True)]
    for y, axes in enumerate(labels):
        ax.annotate(" " + human_bytes(totals[axes]), (totals[axes] / scale, y), va="center", fontsize=8)
    ax.set(title="traffic per rank per step (busiest stage)", xlabel=unit, ylabel="mesh axes")
    ax.margins(x=0.25)
    ax.legend(fontsize=7, loc="lower right")


def _draw_timeline(ax, doc: PlanDocument) -> None:
    if doc.schedule is None:
        ax.set_title("pipeline schedule")
        ax.text(0.5, 0.5, "no pipeline schedule", ha="center", va="center", transform=ax.transAxes)
        return
    t = timeline(doc)
    trained = any(span["kind"] == "backward" for s in t["stages"] for span in s["busy"])
    ax.set_title(
        "pipeline schedule (one step; forward 1 unit, backward 2, communication not timed)"
        if trained
        else "step program (one iteration; each pass over the data 1 unit, communication not timed)"
    )
    drawn: set[str] = set()
    few = sum(len(s["busy"]) for s in t["stages"]) <= 160  # micro-batch numbers where they fit
    for row, s in enumerate(t["stages"]):
        for span in s["busy"]:
            kind = span["kind"]
            name = kind if trained or kind != "forward" else "pass over the data"
            ax.barh(
                row,
                span["duration"],
                left=span["start"],
                height=0.8,
                color=TIMELINE_COLOURS[kind],
                edgecolor="white",
                linewidth=0.5,
                label=None if kind in drawn else name,
            )
            drawn.add(kind)
            if few and span["name"] and not trained:  # an EM iteration's passes, by name (e_step/score, ...)
                ax.text(
                    span["start"] + span["duration"] / 2,
                    row,
                    span["name"],
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white",
                )
            elif few and span["microbatch"] is not None:
                text = f"{span['microbatch']}" + (f"/{span['chunk']}" if doc.schedule.virtual_stages > 1 else "")
                ax.text(
                    span["start"] + span["duration"] / 2, row, text, ha="center", va="center", fontsize=6, color="white"
                )
        for start, duration in s["idle"]:
            ax.barh(
                row,
                duration,
                left=start,
                height=0.8,
                color=TIMELINE_COLOURS["bubble"],
                hatch="//",
                edgecolor="#bbbbbb",
                linewidth=0,
                label=None if "bubble" in drawn else "bubble",
            )
            drawn.add("bubble")
    ax.set_yticks(range(len(t["stages"])), [f"stage {s['stage']}" for s in t["stages"]])
    ax.invert_yaxis()
    chunks = doc.schedule.virtual_stages
    ax.set_xlabel(
        (
            f"time (units of one forward; {doc.schedule.pipeline}, {chunks} virtual, "
            f"{doc.schedule.micro_steps} micro-steps; "
            f"idle {t['idle_fraction']:.1%}, model bubble {doc.schedule.bubble_fraction:.1%})"
            if trained
            else f"time (units of one pass; idle {t['idle_fraction']:.1%})"
        )
        + ("" if not few or not trained else "; labels: micro-batch/chunk" if chunks > 1 else "; labels: micro-batch")
    )
    ax.set_ylabel("ranks of the stage")
    ax.set_xlim(0, max(t["makespan"], 1e-9))
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def plot_plan(doc: PlanDocument, path: str) -> None:
    """Write :func:`plan_figure` to `path` (.png or .svg)."""
    suffix = "." + str(path).rsplit(".", 1)[-1].lower() if "." in str(path) else ""
    if suffix not in FORMATS:
        raise PlotError(f"--plot writes {' or '.join(FORMATS)} files; got {path!r} (name the file e.g. plan.png)")
    plt = _pyplot()
    fig = plan_figure(doc)
    try:
        fig.savefig(path, dpi=110, metadata={"Date": None} if suffix == ".svg" else None)
    except OSError as exc:
        raise PlotError(f"cannot write {path}: {exc.strerror or exc}") from exc
    finally:
        plt.close(fig)

"""Human-facing views of a plan: `explain` tables and plots, and `diff` between two plans.

Everything here reads a verified PlanDocument (or its JSON-ready dict) and nothing else, so the
same views serve a freshly compiled spec and a plan file from a pull request.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

from mixle_compile.memory_model import MEMORY_KINDS
from mixle_compile.plan.document import PlanDocument


def human_bytes(n: float) -> str:
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def explain_data(doc: PlanDocument) -> dict[str, Any]:
    """What `explain --format json` prints: the numbers behind the tables."""
    degrees = doc.mesh.degrees
    device_memory = _device_memory(doc)
    return {
        "spec_digest": doc.spec_digest,
        "content_digest": doc.content_digest,
        "verdict": {"ok": doc.verdict.ok, "errors": doc.verdict.errors, "warnings": doc.verdict.warnings},
        "mesh": {"names": doc.mesh.names, "shape": doc.mesh.shape, "order": doc.mesh.order, **degrees},
        "memory_per_rank": [
            {**m.model_dump(), "device_memory": device_memory, "fraction_of_device": m.total / device_memory if device_memory else None}
            for m in doc.memory
        ],
        "traffic_per_step": [t.model_dump() for t in doc.traffic],
        "collectives": [
            {"axes": list(axes), "collective": kind, "count": count}
            for (axes, kind), count in sorted(_collective_counts(doc).items())
        ],
        "pipeline": None
        if doc.schedule is None
        else {
            "schedule": doc.schedule.pipeline,
            "virtual_stages": doc.schedule.virtual_stages,
            "micro_steps": doc.schedule.micro_steps,
            "bubble_fraction": doc.schedule.bubble_fraction,
            "deadlock_free": doc.schedule.check.ok,
            "check": doc.schedule.check.note,
        },
        "model_cut": doc.decomposition,
        "step_time": _step_time(doc),
    }


def _step_time(doc: PlanDocument) -> dict[str, Any]:
    """The predicted step time (mixle_compile.step_time), or why there is none."""
    from mixle_compile.step_time import NoPrediction, predict_document

    try:
        return predict_document(doc).as_dict()
    except NoPrediction as exc:
        return {"unavailable": str(exc)}


def _changed(a: float, b: float) -> bool:
    return abs(a - b) > 5e-4 * max(abs(a), abs(b))  # what the printed figures can show


def _seconds(value: float) -> str:
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def step_time_lines(step: dict[str, Any]) -> list[str]:
    if "unavailable" in step:
        return [f"predicted step time: not available ({step['unavailable']})"]
    mfu = f", MFU {step['mfu']:.1%}" if step["mfu"] is not None else ""
    lines = [
        f"predicted step time: {_seconds(step['seconds'])}  ({step['tokens_per_second']:,.0f} tokens/s, "
        f"{step['tokens_per_second_per_device']:,.0f} per device; {step['tflops_per_device']:.0f} TFLOP/s per device{mfu})",
        f"  compute {_seconds(step['compute'])} (busiest stage, at {step['efficiency']:.0%} of a {step['peak_flops'] / 1e12:.0f} TFLOP/s peak)",
    ]
    for axes, seconds in sorted(step["exposed_communication"].items(), key=lambda item: -item[1]):
        lines.append(f"  exposed communication over {axes}: {_seconds(seconds)}")
    hidden = sum(step["hidden_communication"].values())
    if hidden:
        lines.append(f"  communication hidden behind compute: {_seconds(hidden)}")
    if step["bubble"]:
        lines.append(f"  pipeline bubble: {_seconds(step['bubble'])}")
    lines.append(f"  optimizer step: {_seconds(step['optimizer'])}")
    return lines


def _device_memory(doc: PlanDocument) -> int | None:
    resources = doc.spec["resources"]
    if isinstance(resources["devices"], int):
        return resources["memory"]
    return min(group["memory"] for group in resources["devices"])


def _collective_counts(doc: PlanDocument) -> Counter:
    return Counter((tuple(u.mesh_axes), u.collective) for u in doc.updates)


def explain_text(doc: PlanDocument) -> str:
    data = explain_data(doc)
    mesh = data["mesh"]
    out = [
        f"plan {doc.content_digest[:19]}  (spec {doc.spec_digest[:19]}, format {doc.format_version}, mixle-compile {doc.compiler_version})",
        f"verdict: {'ok' if doc.verdict.ok else 'NOT OK'} ({doc.verdict.errors} errors, {doc.verdict.warnings} warnings)",
        f"mesh: {' x '.join(f'{n}={s}' for n, s in zip(mesh['names'], mesh['shape']))}  world {mesh['world_size']}, "
        f"data-parallel {mesh['data_parallel_size']}, ep {mesh['ep']}, etp {mesh['etp']}, order {mesh['order']}",
        "",
        "memory per rank (by pipeline stage)",
    ]
    device = data["memory_per_rank"][0]["device_memory"] if data["memory_per_rank"] else None
    rows = []
    for m in data["memory_per_rank"]:
        share = f"{m['total'] / device:.0%}" if device else "-"
        rows.append([str(m["stage"]), *(human_bytes(m[k]) for k in MEMORY_KINDS), human_bytes(m["total"]), share])
    out.append(_table(
        ["stage", "params", "gathered", "grads", "optimizer", "activations", "recompute", "loss", "reserve", "total", "of device"], rows
    ))
    out += ["", "traffic per rank per step (ring costs)"]
    rows = [[str(t["stage"]), "+".join(t["axes"]), t["collective"], human_bytes(t["bytes_per_rank_per_step"])] for t in data["traffic_per_step"]]
    out.append(_table(["stage", "axes", "collective", "bytes"], rows) if rows else "(no communication)")
    pipe = data["pipeline"]
    if pipe is not None and mesh["pp"] == 1:
        out += ["", f"pipeline: none (one stage), {pipe['micro_steps']} micro-step(s) per step; {'deadlock-free' if pipe['deadlock_free'] else 'DEADLOCK'} ({pipe['check']})"]
    elif pipe is not None:
        out += [
            "",
            f"pipeline: {pipe['schedule']}, {mesh['pp']} stage(s) x {pipe['virtual_stages']} virtual, {pipe['micro_steps']} micro-steps per step; "
            f"bubble fraction {pipe['bubble_fraction']:.1%}; {'deadlock-free' if pipe['deadlock_free'] else 'DEADLOCK'} ({pipe['check']})",
        ]
    step = data["step_time"]
    if step is not None and not (doc.decomposition is not None and "unavailable" in step):
        out += ["", *step_time_lines(step)]
    cut = data["model_cut"]
    if cut is not None:
        out += ["", f"model cut: axis {cut['axis']} at {cut['path']} ({cut['num_units']} units)"]
        if cut["cuts"]:
            rows = [
                [str(i), f"{c['device']['kind']}#{c['device']['rank']}", f"{c['start']}..{c['stop'] - 1}", f"{c['work']:.4g}", human_bytes(c["param_bytes"])]
                for i, c in enumerate(cut["cuts"])
            ]
            out.append(_table(["shard", "device", "positions", "work", "bytes"], rows))
        out.append(f"rationale: {cut['rationale']}")
    return "\n".join(out) + "\n"


def plot_plan(doc: PlanDocument, path: str) -> None:
    """Draw per-rank memory by kind and traffic per axis (needs matplotlib: the `plot` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("plotting needs matplotlib: pip install 'mixle-compile[plot]'") from exc
    data = explain_data(doc)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    stages = [m["stage"] for m in data["memory_per_rank"]]
    bottom = [0.0] * len(stages)
    for kind in MEMORY_KINDS:
        values = [m[kind] / 2**30 for m in data["memory_per_rank"]]
        left.bar([str(s) for s in stages], values, bottom=bottom, label=kind.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values)]
    device = data["memory_per_rank"][0]["device_memory"] if data["memory_per_rank"] else None
    if device:
        left.axhline(device / 2**30, color="black", linestyle="--", linewidth=1, label="device memory")
    left.set(title="memory per rank", xlabel="pipeline stage", ylabel="GiB")
    left.legend(fontsize=8)
    per_axis: dict[str, float] = {}
    for t in data["traffic_per_step"]:
        key = f"{'+'.join(t['axes'])} {t['collective']}"
        per_axis[key] = max(per_axis.get(key, 0.0), t["bytes_per_rank_per_step"] / 2**30)
    labels = sorted(per_axis, key=per_axis.get)
    right.barh(labels, [per_axis[k] for k in labels])
    right.set(title="traffic per rank per step (busiest stage)", xlabel="GiB")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def rank_groups(doc: PlanDocument, limit: int) -> list[dict[str, Any]]:
    """Concrete ranks of the plan's groups, in the global creation order: the first `limit` groups
    of each rule (the plan itself keeps groups symbolic, so large worlds are listed only on request)."""
    from mixle_compile.contracts import ParallelPlan
    from mixle_compile.lower.groups import RankGrid, enumerate_groups

    plan = ParallelPlan.from_dict(doc.mesh.degrees)
    grid = RankGrid.from_plan(plan, order=doc.groups.order, extra_rules=[tuple(r.axes) for r in doc.groups.rules])
    out = []
    for rule in grid.rules:
        out.append({"rule": rule.name, "size": rule.size, "num_groups": rule.num_groups, "groups": [list(g) for g in enumerate_groups(rule, limit)]})
    return out


def rank_groups_text(doc: PlanDocument, limit: int) -> str:
    lines = ["", f"rank groups (creation order; at most {limit} per rule)"]
    for entry in rank_groups(doc, limit):
        shown = " ".join("{" + ",".join(map(str, g)) + "}" for g in entry["groups"])
        more = f" ... ({entry['num_groups'] - len(entry['groups'])} more)" if entry["num_groups"] > len(entry["groups"]) else ""
        lines.append(f"  {entry['rule']} (size {entry['size']}, {entry['num_groups']} groups): {shown}{more}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- diff


def diff_data(a: PlanDocument, b: PlanDocument) -> dict[str, Any]:
    """What changed from plan `a` to plan `b`."""
    degrees = {
        k: {"from": a.mesh.degrees.get(k), "to": b.mesh.degrees.get(k)}
        for k in sorted(set(a.mesh.degrees) | set(b.mesh.degrees))
        if a.mesh.degrees.get(k) != b.mesh.degrees.get(k)
    }
    if a.mesh.order != b.mesh.order:
        degrees["order"] = {"from": a.mesh.order, "to": b.mesh.order}
    la = {p.logical_id: p for p in a.parameters}
    lb = {p.logical_id: p for p in b.parameters}
    layouts = []
    for name in sorted(set(la) | set(lb)):
        pa, pb = la.get(name), lb.get(name)
        if pa is None or pb is None:
            layouts.append({"parameter": name, "change": "added" if pa is None else "removed"})
            continue
        fields = {}
        for f in ("global_shape", "placements", "optimizer_state", "stage", "local_shape", "shared_group", "owner"):
            if getattr(pa, f) != getattr(pb, f):
                fields[f] = {"from": getattr(pa, f), "to": getattr(pb, f)}
        if fields:
            layouts.append({"parameter": name, "change": "changed", "fields": fields})
    ca, cb = _collective_counts(a), _collective_counts(b)
    collectives = [
        {"axes": list(axes), "collective": kind, "from": ca.get((axes, kind), 0), "to": cb.get((axes, kind), 0)}
        for axes, kind in sorted(set(ca) | set(cb))
        if ca.get((axes, kind), 0) != cb.get((axes, kind), 0)
    ]
    ma = {m.stage: m for m in a.memory}
    mb = {m.stage: m for m in b.memory}
    memory = []
    for stage in sorted(set(ma) | set(mb)):
        row = {"stage": stage}
        for kind in (*MEMORY_KINDS, "total"):
            va = getattr(ma[stage], kind) if stage in ma else 0
            vb = getattr(mb[stage], kind) if stage in mb else 0
            row[kind] = {"from": va, "to": vb, "delta": vb - va}
        if any(row[k]["delta"] for k in (*MEMORY_KINDS, "total")):
            memory.append(row)
    ta = {(t.stage, tuple(t.axes), t.collective): t.bytes_per_rank_per_step for t in a.traffic}
    tb = {(t.stage, tuple(t.axes), t.collective): t.bytes_per_rank_per_step for t in b.traffic}
    traffic = [
        {"stage": s, "axes": list(axes), "collective": kind, "from": ta.get(key, 0), "to": tb.get(key, 0), "delta": tb.get(key, 0) - ta.get(key, 0)}
        for key in sorted(set(ta) | set(tb))
        for s, axes, kind in [key]
        if ta.get(key, 0) != tb.get(key, 0)
    ]
    return {
        "same": a.content_digest == b.content_digest,
        "spec_changed": a.spec_digest != b.spec_digest,
        "mesh": degrees,
        "layouts": layouts,
        "collectives": collectives,
        "memory": memory,
        "traffic": traffic,
        "verdict": {"from": a.verdict.ok, "to": b.verdict.ok},
        "step_time": _step_time_change(a, b),
    }


def _step_time_change(a: PlanDocument, b: PlanDocument) -> dict[str, Any] | None:
    before, after = _step_time(a), _step_time(b)
    if "unavailable" in before or "unavailable" in after:
        return None
    keys = ("seconds", "compute", "bubble", "optimizer", "tokens_per_second")
    change = {k: {"from": before[k], "to": after[k]} for k in keys}
    for side, name in ((before, "from"), (after, "to")):
        for axes, seconds in side["exposed_communication"].items():
            change.setdefault(f"exposed {axes}", {"from": 0.0, "to": 0.0})[name] = seconds
    return change


def diff_text(a: PlanDocument, b: PlanDocument, name_a: str = "a", name_b: str = "b") -> str:
    d = diff_data(a, b)
    if d["same"]:
        return f"{name_a} and {name_b} are the same plan ({a.content_digest[:19]})\n"
    out = [f"--- {name_a}  {a.content_digest[:19]}", f"+++ {name_b}  {b.content_digest[:19]}"]
    if d["verdict"]["from"] != d["verdict"]["to"]:
        out.append(f"verdict: {'ok' if d['verdict']['from'] else 'NOT OK'} -> {'ok' if d['verdict']['to'] else 'NOT OK'}")
    if d["mesh"]:
        out.append("mesh:")
        out += [f"  {k}: {v['from']} -> {v['to']}" for k, v in d["mesh"].items()]
    if d["layouts"]:
        out.append(f"layouts: {len(d['layouts'])} parameter(s) changed")
        for entry in d["layouts"][:20]:
            if entry["change"] != "changed":
                out.append(f"  {entry['parameter']}: {entry['change']}")
            else:
                changes = "; ".join(f"{k} {v['from']} -> {v['to']}" for k, v in entry["fields"].items())
                out.append(f"  {entry['parameter']}: {changes}")
        if len(d["layouts"]) > 20:
            out.append(f"  ... and {len(d['layouts']) - 20} more (see --format json)")
    if d["collectives"]:
        out.append("collectives (updates per step plan):")
        out += [f"  {'+'.join(c['axes'])} {c['collective']}: {c['from']} -> {c['to']}" for c in d["collectives"]]
    if d["memory"]:
        out.append("memory per rank:")
        for row in d["memory"]:
            parts = [f"{k} {human_bytes(row[k]['delta']) if row[k]['delta'] < 0 else '+' + human_bytes(row[k]['delta'])}" for k in (*MEMORY_KINDS, "total") if row[k]["delta"]]
            out.append(f"  stage {row['stage']}: " + ", ".join(parts) + f"  (total {human_bytes(row['total']['from'])} -> {human_bytes(row['total']['to'])})")
    step = d["step_time"]
    if step is not None and _changed(step["seconds"]["from"], step["seconds"]["to"]):
        before, after = step["seconds"]["from"], step["seconds"]["to"]
        parts = [
            f"{k} {_seconds(v['from'])} -> {_seconds(v['to'])}"
            for k, v in step.items() if k not in ("seconds", "tokens_per_second") and _changed(v["from"], v["to"])
        ]
        out.append(f"predicted step time: {_seconds(before)} -> {_seconds(after)} ({after / before - 1:+.1%})" + (f"; {', '.join(parts)}" if parts else ""))
    if d["traffic"]:
        out.append("traffic per rank per step:")
        for t in d["traffic"]:
            sign = "+" if t["delta"] >= 0 else ""
            out.append(f"  stage {t['stage']} {'+'.join(t['axes'])} {t['collective']}: {human_bytes(t['from'])} -> {human_bytes(t['to'])} ({sign}{human_bytes(t['delta'])})")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- checkpoints


def _saved_layout(p: dict[str, Any]) -> str:
    parts = [p.get("layout", "?") + (f" over {'+'.join(p['shard_axes'])}" if p.get("shard_axes") else "")]
    if p.get("tp_dim") is not None:
        parts.append(f"tp dim {p['tp_dim']}")
    return ", ".join(parts)


def checkpoint_text(view: dict[str, Any], limit: int = 12) -> str:
    """`explain CHECKPOINT`: what runtime.checkpoint.checkpoint_view read from the manifest."""
    plan, mesh, data = view.get("plan", {}), view.get("mesh", {}), view.get("data", {})
    out = [f"checkpoint {view['checkpoint']}  (step {view['step']}, {view.get('kind')}, format {view.get('format_version')}, complete)"]
    verified = view.get("verified")
    if verified:
        out.append(f"sealed: {verified['files']} file(s), {verified['bytes']:,} bytes, verified against their SHA-256; run {verified.get('run_id')}")
    fit = view.get("fit") or {}
    if plan and plan.get("optimizer") == "em":
        out.append(f"plan: {plan.get('content_digest', '?')}  {plan.get('family', '?')}, fitted by EM in {plan.get('precision', '?')}")
    elif plan:
        out.append(
            f"plan: {plan.get('content_digest', '?')}  {plan.get('family', '?')}, {plan.get('optimizer', '?')} "
            f"(lr {plan.get('learning_rate', '?')}), {plan.get('precision', '?')}"
        )
    if fit:
        lls = fit.get("log_likelihoods") or []
        trend = f", log-likelihood {lls[0]:.6g} -> {lls[-1]:.6g} over {len(lls)} iteration(s)" if lls else ""
        cut = fit.get("cut")
        out.append(f"fit: iteration {fit.get('iteration')}{trend}" + (f"; components cut at {cut.get('path')} over {cut.get('axis')}" if cut else ""))
    if mesh:
        axes = " x ".join(f"{a}={mesh[a]}" for a in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep") if a in mesh)
        out.append(
            f"mesh: {axes}  world {mesh.get('world_size', '?')}, data-parallel {mesh.get('data_parallel_size', '?')}, "
            f"{mesh.get('microbatches', '?')} micro-batch(es) x {mesh.get('gradient_accumulation_steps', '?')} accumulation step(s)"
        )
    if data:
        source = data.get("source") or {}
        what = f"synthetic, seed {source.get('seed')}" if source.get("kind") == "synthetic" else f"file {source.get('name')}" if source else "?"
        seq = f", seq_len {data['seq_len']}" if data.get("seq_len") is not None else ""
        unit = "rows per iteration" if fit else "global batch"
        out.append(f"data: {data.get('samples_consumed')} samples consumed ({view['step']} x {unit} {data.get('global_batch_size')}{seq}); {what}")
    optimizer = view.get("optimizer") or {}
    if optimizer:
        out.append(f"optimizer state: {', '.join(optimizer.get('state', [])) or 'none (saved before the first step)'}")
    params = view.get("parameters") or []
    if params:
        total = sum(math.prod(p["shape"]) for p in params)
        out += ["", f"parameters: {len(params)} tensors, {total:,} values"]
        rows = [[p["name"], "x".join(map(str, p["shape"])), p.get("dtype", "?"), _saved_layout(p)] for p in params[:limit]]
        out.append(_table(["name", "shape", "dtype", "layout"], rows))
        if len(params) > limit:
            out.append(f"... and {len(params) - limit} more (see --format json)")
    arrays = view.get("arrays")
    if arrays:
        out += ["", f"arrays: {len(arrays)}"]
        out.append(_table(["name", "shape", "dtype"], [[n, "x".join(map(str, a["shape"])) or "scalar", a["dtype"]] for n, a in sorted(arrays.items())]))
    others = view.get("others_in_root") or []
    if others:
        shown = ", ".join(f"{o['step']}{'' if o['complete'] else ' (incomplete)'}" for o in others)
        out += ["", f"other steps in {Path(view['checkpoint']).parent}: {shown}"]
    return "\n".join(out) + "\n"

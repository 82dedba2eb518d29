"""Human-facing views of a plan: `explain` tables and plots, and `diff` between two plans.

Everything here reads a verified PlanDocument (or its JSON-ready dict) and nothing else, so the
same views serve a freshly compiled spec and a plan file from a pull request.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from mixle_compile.memory_model import MEMORY_KINDS
from mixle_compile.plan.document import PlanDocument
from mixle_compile.plan.vocabulary import DEGREE_AXES


def human_bytes(n: float) -> str:
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


#: The memory table's column for each term of the memory model, in MEMORY_KINDS order.
MEMORY_COLUMNS = {
    "parameters": "params",
    "gathered_parameters": "gathered",
    "gradients": "grads",
    "optimizer_state": "optimizer",
    "activations": "activations",
    "recompute": "recompute",
    "loss": "loss",
    "buffers": "buffers",
    "reserve": "reserve",
}


def _table(header: list[str], rows: list[list[str]]) -> str:
    # every row has a cell for each column the header names
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

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
            {
                **m.model_dump(),
                "device_memory": device_memory,
                "fraction_of_device": m.total / device_memory if device_memory else None,
            }
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
    from mixle_compile.step_time import seconds_text

    return seconds_text(value)


def step_time_lines(step: dict[str, Any]) -> list[str]:
    if "unavailable" in step:
        return [f"predicted step time: not available ({step['unavailable']})"]
    mfu = f", MFU {step['mfu']:.1%}" if step["mfu"] is not None else ""
    lines = [
        f"predicted step time: {_seconds(step['seconds'])}  ({step['tokens_per_second']:,.0f} tokens/s, "
        f"{step['tokens_per_second_per_device']:,.0f} per device; {step['tflops_per_device']:.0f} TFLOP/s "
        f"per device{mfu})",
        f"  compute {_seconds(step['compute'])} (busiest stage, at {step['efficiency']:.0%} of a "
        f"{step['peak_flops'] / 1e12:.0f} TFLOP/s peak)",
    ]
    for axes, seconds in sorted(step["exposed_communication"].items(), key=lambda item: -item[1]):
        lines.append(f"  exposed communication over {axes}: {_seconds(seconds)}")
    hidden = sum(step["hidden_communication"].values())
    if hidden:
        parts = sorted(step["hidden_communication"].items(), key=lambda item: -item[1])
        by_axes = ", ".join(f"{axes} {_seconds(seconds)}" for axes, seconds in parts if seconds)
        lines.append(f"  communication hidden behind compute: {_seconds(hidden)} ({by_axes})")
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
        f"plan {doc.content_digest[:19]}  (spec {doc.spec_digest[:19]}, format {doc.format_version}, "
        f"mixle-compile {doc.compiler_version})",
        f"verdict: {'ok' if doc.verdict.ok else 'NOT OK'} ({doc.verdict.errors} errors, "
        f"{doc.verdict.warnings} warnings)",
        f"mesh: {' x '.join(f'{n}={s}' for n, s in zip(mesh['names'], mesh['shape'], strict=True))}  "
        f"world {mesh['world_size']}, "
        f"data-parallel {mesh['data_parallel_size']}, ep {mesh['ep']}, etp {mesh['etp']}, order {mesh['order']}",
        "",
        "memory per rank (by pipeline stage)",
    ]
    device = data["memory_per_rank"][0]["device_memory"] if data["memory_per_rank"] else None
    rows = []
    for m in data["memory_per_rank"]:
        share = f"{m['total'] / device:.0%}" if device else "-"
        rows.append([str(m["stage"]), *(human_bytes(m[k]) for k in MEMORY_KINDS), human_bytes(m["total"]), share])
    out.append(_table(["stage", *(MEMORY_COLUMNS[k] for k in MEMORY_KINDS), "total", "of device"], rows))
    out += ["", "traffic per rank per step (ring costs)"]
    rows = [
        [str(t["stage"]), "+".join(t["axes"]), t["collective"], human_bytes(t["bytes_per_rank_per_step"])]
        for t in data["traffic_per_step"]
    ]
    out.append(_table(["stage", "axes", "collective", "bytes"], rows) if rows else "(no communication)")
    pipe = data["pipeline"]
    if pipe is not None and mesh["pp"] == 1:
        out += [
            "",
            f"pipeline: none (one stage), {pipe['micro_steps']} micro-step(s) per step; "
            f"{'deadlock-free' if pipe['deadlock_free'] else 'DEADLOCK'} ({pipe['check']})",
        ]
    elif pipe is not None:
        out += [
            "",
            f"pipeline: {pipe['schedule']}, {mesh['pp']} stage(s) x {pipe['virtual_stages']} virtual, "
            f"{pipe['micro_steps']} micro-steps per step; "
            f"bubble fraction {pipe['bubble_fraction']:.1%}; "
            f"{'deadlock-free' if pipe['deadlock_free'] else 'DEADLOCK'} ({pipe['check']})",
        ]
    step = data["step_time"]
    if step is not None and not (doc.decomposition is not None and "unavailable" in step):
        out += ["", *step_time_lines(step)]
    cut = data["model_cut"]
    if cut is not None:
        out += ["", f"model cut: axis {cut['axis']} at {cut['path']} ({cut['num_units']} units)"]
        if cut["cuts"]:
            rows = [
                [
                    str(i),
                    f"{c['device']['kind']}#{c['device']['rank']}",
                    f"{c['start']}..{c['stop'] - 1}",
                    f"{c['work']:.4g}",
                    human_bytes(c["param_bytes"]),
                ]
                for i, c in enumerate(cut["cuts"])
            ]
            out.append(_table(["shard", "device", "positions", "work", "bytes"], rows))
        out.append(f"rationale: {cut['rationale']}")
    return "\n".join(out) + "\n"


def rank_groups(doc: PlanDocument, limit: int) -> list[dict[str, Any]]:
    """Concrete ranks of the plan's groups, in the global creation order: the first `limit` groups
    of each rule (the plan itself keeps groups symbolic, so large worlds are listed only on request)."""
    from mixle_compile.contracts import ParallelPlan
    from mixle_compile.lower.groups import RankGrid, enumerate_groups

    plan = ParallelPlan.from_dict(doc.mesh.degrees)
    grid = RankGrid.from_plan(plan, order=doc.groups.order, extra_rules=[tuple(r.axes) for r in doc.groups.rules])
    out = []
    for rule in grid.rules:
        out.append(
            {
                "rule": rule.name,
                "size": rule.size,
                "num_groups": rule.num_groups,
                "groups": [list(g) for g in enumerate_groups(rule, limit)],
            }
        )
    return out


def rank_groups_text(doc: PlanDocument, limit: int) -> str:
    lines = ["", f"rank groups (creation order; at most {limit} per rule)"]
    for entry in rank_groups(doc, limit):
        shown = " ".join("{" + ",".join(map(str, g)) + "}" for g in entry["groups"])
        more = (
            f" ... ({entry['num_groups'] - len(entry['groups'])} more)"
            if entry["num_groups"] > len(entry["groups"])
            else ""
        )
        lines.append(f"  {entry['rule']} (size {entry['size']}, {entry['num_groups']} groups): {shown}{more}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- diff


def spec_changes(a: Any, b: Any, path: str = "") -> list[dict[str, Any]]:
    """Every difference between two JSON-ready values, as dotted paths (``training.optimizer``,
    ``resources.devices[1].memory``): a recursive diff of the normalized specs (or of any section).
    Each entry says ``changed`` (with ``from`` and ``to``), ``added`` (``to``) or ``removed`` (``from``)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[dict[str, Any]] = []
        for key in sorted(set(a) | set(b), key=str):
            sub = f"{path}.{key}" if path else str(key)
            if key not in a:
                out.append({"path": sub, "change": "added", "to": b[key]})
            elif key not in b:
                out.append({"path": sub, "change": "removed", "from": a[key]})
            else:
                out += spec_changes(a[key], b[key], sub)
        return out
    if isinstance(a, list) and isinstance(b, list) and any(isinstance(v, (dict, list)) for v in (*a, *b)):
        out = []
        for i in range(max(len(a), len(b))):
            sub = f"{path}[{i}]"
            if i >= len(a):
                out.append({"path": sub, "change": "added", "to": b[i]})
            elif i >= len(b):
                out.append({"path": sub, "change": "removed", "from": a[i]})
            else:
                out += spec_changes(a[i], b[i], sub)
        return out
    if a == b and type(a) is type(b):
        return []
    return [{"path": path, "change": "changed", "from": a, "to": b}]


def _from_to(a: Any, b: Any) -> dict[str, Any]:
    return {"from": a, "to": b}


def _pipeline_view(doc: PlanDocument) -> dict[str, Any] | None:
    from mixle_compile.plan.programs import plan_programs

    s = doc.schedule
    if s is None:
        return None
    return {
        "schedule": s.pipeline,
        "virtual_stages": s.virtual_stages,
        "micro_steps": s.micro_steps,
        "bubble_fraction": s.bubble_fraction,
        "sends": s.sends,
        "deadlock_free": s.check.ok,
        "ops_per_stage": [len(ops) for ops in plan_programs(s, doc.updates)],
    }


def _pipeline_change(a: PlanDocument, b: PlanDocument) -> dict[str, Any]:
    va, vb = _pipeline_view(a), _pipeline_view(b)
    if va is None or vb is None:
        return {} if va == vb else {"pipeline": _from_to(va, vb)}
    change = {k: _from_to(va[k], vb[k]) for k in va if va[k] != vb[k]}
    if "ops_per_stage" not in change and a.schedule.stages != b.schedule.stages:
        change["programs"] = _from_to("", "reordered")  # the same number of operations, in another order
    return change


def _update_key(u) -> str:
    tensor = "" if u.node_id.startswith(u.tensor) else f" of {u.tensor}"
    return f"{u.node_id}{tensor} ({u.phase}, stage {u.stage})"


def _updates_change(a: PlanDocument, b: PlanDocument) -> dict[str, Any]:
    ua = {_update_key(u): u.model_dump() for u in a.updates}
    ub = {_update_key(u): u.model_dump() for u in b.updates}
    changed = []
    for key in sorted(set(ua) & set(ub)):
        fields = {k: _from_to(ua[key][k], ub[key][k]) for k in ua[key] if ua[key][k] != ub[key][k]}
        if fields:
            changed.append({"update": key, "fields": fields})
    return {
        "count": _from_to(len(a.updates), len(b.updates)),
        "added": sorted(set(ub) - set(ua)),
        "removed": sorted(set(ua) - set(ub)),
        "changed": changed,
    }


def _groups_change(a: PlanDocument, b: PlanDocument) -> dict[str, Any]:
    ga = {r.name: r.model_dump() for r in a.groups.rules}
    gb = {r.name: r.model_dump() for r in b.groups.rules}
    out: dict[str, Any] = {}
    if a.groups.order != b.groups.order:
        out["order"] = _from_to(a.groups.order, b.groups.order)
    rules = []
    for name in [*ga, *(n for n in gb if n not in ga)]:
        ra, rb = ga.get(name), gb.get(name)
        if ra is None or rb is None:
            rules.append({"rule": name, "change": "added" if ra is None else "removed"})
            continue
        fields = {
            k: _from_to(ra[k], rb[k]) for k in ("axes", "size", "num_groups", "dims", "base_dims") if ra[k] != rb[k]
        }
        if fields:
            rules.append({"rule": name, "change": "changed", "fields": fields})
    if rules:
        out["rules"] = rules
    for grid in ("dense", "expert"):
        if getattr(a.groups, grid) != getattr(b.groups, grid):
            out[f"{grid}_grid"] = _from_to(getattr(a.groups, grid).model_dump(), getattr(b.groups, grid).model_dump())
    return out


def traffic_per_axis(doc: PlanDocument) -> dict[str, int]:
    """Bytes a rank of the busiest stage moves over each set of mesh axes per step (all collectives)."""
    per_stage: dict[tuple[str, int], int] = {}
    for t in doc.traffic:
        key = ("+".join(t.axes), t.stage)
        per_stage[key] = per_stage.get(key, 0) + t.bytes_per_rank_per_step
    out: dict[str, int] = {}
    for (axes, _), total in per_stage.items():
        out[axes] = max(out.get(axes, 0), total)
    return dict(sorted(out.items()))


def _verdict_change(a: PlanDocument, b: PlanDocument) -> dict[str, Any]:
    out = {
        k: _from_to(getattr(a.verdict, k), getattr(b.verdict, k))
        for k in ("ok", "errors", "warnings", "reductions_exactly_once")
    }
    ca, cb = Counter(d.code for d in a.verdict.diagnostics), Counter(d.code for d in b.verdict.diagnostics)
    out["new_findings"] = sorted((cb - ca).elements())
    out["resolved_findings"] = sorted((ca - cb).elements())
    by_code: dict[str, list[str]] = {}
    for d in a.verdict.diagnostics:
        by_code.setdefault(d.code, []).append(f"{d.message} (line {d.line})")
    changed = []
    for d in b.verdict.diagnostics:  # a finding both plans have, whose figures or place moved
        before = by_code.get(d.code)
        if before:
            was, now = before.pop(0), f"{d.message} (line {d.line})"
            if was != now:
                changed.append({"code": d.code, "from": was, "to": now})
    out["changed_findings"] = changed
    return out


#: The plan's sections that diff_data compares one by one (each under its own key); the digests and
#: the spec itself are compared as a whole and field by field.
_SECTIONS = (
    "spec",
    "mesh",
    "groups",
    "parameters",
    "updates",
    "schedule",
    "decomposition",
    "memory",
    "traffic",
    "verdict",
)


def diff_data(a: PlanDocument, b: PlanDocument) -> dict[str, Any]:
    """What changed from plan `a` to plan `b`: every spec field (dotted paths) and every consequence
    in the plan (mesh, pipeline, step time, memory, traffic, collectives, updates, groups, layouts, model cut)."""
    degrees = {
        k: _from_to(a.mesh.degrees.get(k), b.mesh.degrees.get(k))
        for k in sorted(set(a.mesh.degrees) | set(b.mesh.degrees))
        if a.mesh.degrees.get(k) != b.mesh.degrees.get(k)
    }
    for f in ("order", "names", "shape"):
        if getattr(a.mesh, f) != getattr(b.mesh, f):
            degrees[f] = _from_to(getattr(a.mesh, f), getattr(b.mesh, f))
    la = {p.logical_id: p for p in a.parameters}
    lb = {p.logical_id: p for p in b.parameters}
    layouts = []
    for name in sorted(set(la) | set(lb)):
        pa, pb = la.get(name), lb.get(name)
        if pa is None or pb is None:
            layouts.append({"parameter": name, "change": "added" if pa is None else "removed"})
            continue
        fields = {
            f: _from_to(v, getattr(pb, f))
            for f, v in pa.model_dump().items()
            if v != getattr(pb, f) and f != "logical_id"
        }
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
    peak = _from_to(max((m.total for m in a.memory), default=0), max((m.total for m in b.memory), default=0))
    ta = {(t.stage, tuple(t.axes), t.collective): t.bytes_per_rank_per_step for t in a.traffic}
    tb = {(t.stage, tuple(t.axes), t.collective): t.bytes_per_rank_per_step for t in b.traffic}
    traffic = [
        {
            "stage": s,
            "axes": list(axes),
            "collective": kind,
            "from": ta.get(key, 0),
            "to": tb.get(key, 0),
            "delta": tb.get(key, 0) - ta.get(key, 0),
        }
        for key in sorted(set(ta) | set(tb))
        for s, axes, kind in [key]
        if ta.get(key, 0) != tb.get(key, 0)
    ]
    xa, xb = traffic_per_axis(a), traffic_per_axis(b)
    per_axis = [
        {"axes": axes, "from": xa.get(axes, 0), "to": xb.get(axes, 0), "delta": xb.get(axes, 0) - xa.get(axes, 0)}
        for axes in sorted(set(xa) | set(xb))
        if xa.get(axes, 0) != xb.get(axes, 0)
    ]
    sections = {name: getattr(a, name) != getattr(b, name) for name in _SECTIONS}
    return {
        "same": a.content_digest == b.content_digest,
        "spec_changed": a.spec_digest != b.spec_digest,
        "compiler": {
            k: _from_to(getattr(a, k), getattr(b, k))
            for k in ("compiler_version", "format_version")
            if getattr(a, k) != getattr(b, k)
        },
        "spec": spec_changes(a.spec, b.spec),
        "mesh": degrees,
        "pipeline": _pipeline_change(a, b),
        "layouts": layouts,
        "collectives": collectives,
        "updates": _updates_change(a, b),
        "groups": _groups_change(a, b),
        "memory": memory,
        "peak_memory": peak,
        "traffic": traffic,
        "traffic_per_axis": per_axis,
        "model_cut": spec_changes(a.decomposition, b.decomposition, "decomposition"),
        "verdict": _verdict_change(a, b),
        "step_time": _step_time_change(a, b),
        "changed_sections": sorted(name for name, changed in sections.items() if changed),
    }


def _step_time_change(a: PlanDocument, b: PlanDocument) -> dict[str, Any] | None:
    """The predicted step time before and after; None where neither plan has a prediction for the same reason."""
    before, after = _step_time(a), _step_time(b)
    if "unavailable" in before or "unavailable" in after:
        reasons = (before.get("unavailable"), after.get("unavailable"))
        return None if reasons[0] == reasons[1] else {"unavailable": _from_to(*reasons)}
    keys = ("seconds", "compute", "bubble", "optimizer", "tokens_per_second", "mfu")
    change = {k: _from_to(before[k], after[k]) for k in keys}
    for side, name in ((before, "from"), (after, "to")):
        for axes, seconds in side["exposed_communication"].items():
            change.setdefault(f"exposed {axes}", {"from": 0.0, "to": 0.0})[name] = seconds
    return change


def _value(v: Any) -> str:
    return json.dumps(v) if isinstance(v, (dict, list)) or v is None or isinstance(v, bool) else str(v)


def _spec_line(entry: dict[str, Any]) -> str:
    if entry["change"] == "added":
        return f"  {entry['path']}: (absent) -> {_value(entry['to'])}"
    if entry["change"] == "removed":
        return f"  {entry['path']}: {_value(entry['from'])} -> (absent)"
    return f"  {entry['path']}: {_value(entry['from'])} -> {_value(entry['to'])}"


def _signed(n: int) -> str:
    return human_bytes(n) if n < 0 else "+" + human_bytes(n)


def _pipeline_lines(change: dict[str, Any]) -> list[str]:
    if "pipeline" in change:
        a, b = change["pipeline"]["from"], change["pipeline"]["to"]

        def show(v: dict[str, Any] | None) -> str:
            if v is None:
                return "none"
            return f"{v['schedule']} x{v['virtual_stages']} virtual, bubble {v['bubble_fraction']:.1%}"

        return [f"  {show(a)} -> {show(b)}"]
    out = []
    for key, v in change.items():
        if key == "bubble_fraction":
            out.append(f"  bubble fraction: {v['from']:.1%} -> {v['to']:.1%}")
        elif key == "ops_per_stage":
            out.append(f"  operations per stage: {_value(v['from'])} -> {_value(v['to'])}")
        elif key == "programs":
            out.append("  stage programs: the same operations in another order")
        else:
            out.append(f"  {key.replace('_', ' ')}: {_value(v['from'])} -> {_value(v['to'])}")
    return out


def diff_text(a: PlanDocument, b: PlanDocument, name_a: str = "a", name_b: str = "b", limit: int = 20) -> str:
    d = diff_data(a, b)
    if d["same"]:
        return f"{name_a} and {name_b} are the same plan ({a.content_digest[:19]})\n"
    out = [f"--- {name_a}  {a.content_digest[:19]}", f"+++ {name_b}  {b.content_digest[:19]}"]
    more = lambda n: [f"  ... and {n - limit} more (see --format json)"] if n > limit else []  # noqa: E731
    for k, v in d["compiler"].items():
        out.append(f"{k.replace('_', ' ')}: {v['from']} -> {v['to']}")
    verdict = d["verdict"]
    if verdict["ok"]["from"] != verdict["ok"]["to"]:
        out.append(
            f"verdict: {'ok' if verdict['ok']['from'] else 'NOT OK'} -> {'ok' if verdict['ok']['to'] else 'NOT OK'}"
        )
    counts = [
        f"{k} {verdict[k]['from']} -> {verdict[k]['to']}"
        for k in ("errors", "warnings")
        if verdict[k]["from"] != verdict[k]["to"]
    ]
    found = ([f"new {', '.join(verdict['new_findings'])}"] if verdict["new_findings"] else []) + (
        [f"resolved {', '.join(verdict['resolved_findings'])}"] if verdict["resolved_findings"] else []
    )
    if counts or found:
        out.append("findings: " + "; ".join(counts + found))
    for f in verdict["changed_findings"][:limit]:
        out.append(f"finding {f['code']}: {f['from']}")
        out.append(f"     now {f['code']}: {f['to']}")
    if d["spec"]:
        out.append(f"spec: {len(d['spec'])} field(s) changed")
        out += [_spec_line(e) for e in d["spec"][:limit]] + more(len(d["spec"]))
    if d["mesh"]:
        out.append("mesh:")
        out += [f"  {k}: {_value(v['from'])} -> {_value(v['to'])}" for k, v in d["mesh"].items()]
    if d["pipeline"]:
        out.append("pipeline:")
        out += _pipeline_lines(d["pipeline"])
    step = d["step_time"]
    if step is not None and "unavailable" in step:
        u = step["unavailable"]
        out.append(
            f"predicted step time: {'not available' if u['from'] else 'available'} -> "
            f"{'not available (' + u['to'] + ')' if u['to'] else 'available'}"
        )
    elif step is not None and _changed(step["seconds"]["from"], step["seconds"]["to"]):
        before, after = step["seconds"]["from"], step["seconds"]["to"]
        parts = [
            f"{k} {_seconds(v['from'])} -> {_seconds(v['to'])}"
            for k, v in step.items()
            if k not in ("seconds", "tokens_per_second", "mfu") and _changed(v["from"], v["to"])
        ]
        out.append(
            f"predicted step time: {_seconds(before)} -> {_seconds(after)} ({after / before - 1:+.1%})"
            + (f"; {', '.join(parts)}" if parts else "")
        )
        tps = step["tokens_per_second"]
        out.append(f"  tokens/s: {tps['from']:,.0f} -> {tps['to']:,.0f}")
    if d["memory"]:
        peak = d["peak_memory"]
        out.append(f"memory per rank: peak {human_bytes(peak['from'])} -> {human_bytes(peak['to'])}")
        for row in d["memory"]:
            parts = [f"{k} {_signed(row[k]['delta'])}" for k in (*MEMORY_KINDS, "total") if row[k]["delta"]]
            out.append(
                f"  stage {row['stage']}: "
                + ", ".join(parts)
                + f"  (total {human_bytes(row['total']['from'])} -> {human_bytes(row['total']['to'])})"
            )
    if d["traffic_per_axis"]:
        out.append("traffic per axis (per rank per step, busiest stage):")
        out += [
            f"  {t['axes']}: {human_bytes(t['from'])} -> {human_bytes(t['to'])} ({_signed(t['delta'])})"
            for t in d["traffic_per_axis"]
        ]
    if d["traffic"]:
        out.append("traffic per rank per step:")
        for t in d["traffic"][:limit]:
            out.append(
                f"  stage {t['stage']} {'+'.join(t['axes'])} {t['collective']}: {human_bytes(t['from'])} "
                f"-> {human_bytes(t['to'])} ({_signed(t['delta'])})"
            )
        out += more(len(d["traffic"]))
    if d["collectives"]:
        out.append("collectives (updates per step plan):")
        out += [f"  {'+'.join(c['axes'])} {c['collective']}: {c['from']} -> {c['to']}" for c in d["collectives"]]
    u = d["updates"]
    if u["added"] or u["removed"] or u["changed"]:
        fields = Counter(k for entry in u["changed"] for k in entry["fields"])
        which = f": {', '.join(f'{k} in {n}' for k, n in fields.most_common())}" if fields else ""
        out.append(
            f"updates: {u['count']['from']} -> {u['count']['to']} ({len(u['added'])} added, "
            f"{len(u['removed'])} removed, "
            f"{len(u['changed'])} changed{which})"
        )
        few = 5  # the rest follow the same pattern; --format json lists every one
        out += [f"  added: {name}" for name in u["added"][:few]] + [f"  removed: {name}" for name in u["removed"][:few]]
        for entry in u["changed"][:few]:
            changes = "; ".join(f"{k} {_value(v['from'])} -> {_value(v['to'])}" for k, v in entry["fields"].items())
            out.append(f"  {entry['update']}: {changes}")
        rest = max(len(u["added"]) - few, 0) + max(len(u["removed"]) - few, 0) + max(len(u["changed"]) - few, 0)
        if rest:
            out.append(f"  ... and {rest} more (see --format json)")
    g = d["groups"]
    if g:
        out.append("rank groups:")
        if "order" in g:
            out.append(f"  order: {g['order']['from']} -> {g['order']['to']}")
        for entry in g.get("rules", [])[:limit]:
            if entry["change"] != "changed":
                out.append(f"  {entry['rule']}: {entry['change']}")
            else:
                out.append(
                    f"  {entry['rule']}: "
                    + "; ".join(f"{k} {_value(v['from'])} -> {_value(v['to'])}" for k, v in entry["fields"].items())
                )
        out += more(len(g.get("rules", [])))
        for grid in ("dense_grid", "expert_grid"):
            if grid in g:
                out.append(f"  {grid.replace('_', ' ')} changed")
    if d["layouts"]:
        out.append(f"layouts: {len(d['layouts'])} parameter(s) changed")
        for entry in d["layouts"][:limit]:
            if entry["change"] != "changed":
                out.append(f"  {entry['parameter']}: {entry['change']}")
            else:
                changes = "; ".join(f"{k} {_value(v['from'])} -> {_value(v['to'])}" for k, v in entry["fields"].items())
                out.append(f"  {entry['parameter']}: {changes}")
        out += more(len(d["layouts"]))
    if d["model_cut"]:
        out.append("model cut:")
        out += [_spec_line(e) for e in d["model_cut"][:limit]] + more(len(d["model_cut"]))
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
    out = [
        f"checkpoint {view['checkpoint']}  (step {view['step']}, {view.get('kind')}, format "
        f"{view.get('format_version')}, complete)"
    ]
    verified = view.get("verified")
    if verified:
        out.append(
            f"sealed: {verified['files']} file(s), {verified['bytes']:,} bytes, verified against their "
            f"SHA-256; run {verified.get('run_id')}"
        )
    fit = view.get("fit") or {}
    if plan and plan.get("optimizer") == "em":
        out.append(
            f"plan: {plan.get('content_digest', '?')}  {plan.get('family', '?')}, fitted by EM in "
            f"{plan.get('precision', '?')}"
        )
    elif plan:
        out.append(
            f"plan: {plan.get('content_digest', '?')}  {plan.get('family', '?')}, {plan.get('optimizer', '?')} "
            f"(lr {plan.get('learning_rate', '?')}), {plan.get('precision', '?')}"
        )
    if fit:
        lls = fit.get("log_likelihoods") or []
        trend = f", log-likelihood {lls[0]:.6g} -> {lls[-1]:.6g} over {len(lls)} iteration(s)" if lls else ""
        cut = fit.get("cut")
        out.append(
            f"fit: iteration {fit.get('iteration')}{trend}"
            + (f"; components cut at {cut.get('path')} over {cut.get('axis')}" if cut else "")
        )
    if mesh:
        axes = " x ".join(f"{a}={mesh[a]}" for a in DEGREE_AXES if a in mesh)
        out.append(
            f"mesh: {axes}  world {mesh.get('world_size', '?')}, data-parallel {mesh.get('data_parallel_size', '?')}, "
            f"{mesh.get('microbatches', '?')} micro-batch(es) x "
            f"{mesh.get('gradient_accumulation_steps', '?')} accumulation step(s)"
        )
    if data:
        source = data.get("source") or {}
        what = (
            f"synthetic, seed {source.get('seed')}"
            if source.get("kind") == "synthetic"
            else f"file {source.get('name')}"
            if source
            else "?"
        )
        seq = f", seq_len {data['seq_len']}" if data.get("seq_len") is not None else ""
        unit = "rows per iteration" if fit else "global batch"
        out.append(
            f"data: {data.get('samples_consumed')} samples consumed ({view['step']} x {unit} "
            f"{data.get('global_batch_size')}{seq}); {what}"
        )
    optimizer = view.get("optimizer") or {}
    if optimizer:
        out.append(f"optimizer state: {', '.join(optimizer.get('state', [])) or 'none (saved before the first step)'}")
    params = view.get("parameters") or []
    if params:
        total = sum(math.prod(p["shape"]) for p in params)
        out += ["", f"parameters: {len(params)} tensors, {total:,} values"]
        rows = [
            [p["name"], "x".join(map(str, p["shape"])), p.get("dtype", "?"), _saved_layout(p)] for p in params[:limit]
        ]
        out.append(_table(["name", "shape", "dtype", "layout"], rows))
        if len(params) > limit:
            out.append(f"... and {len(params) - limit} more (see --format json)")
    arrays = view.get("arrays")
    if arrays:
        out += ["", f"arrays: {len(arrays)}"]
        out.append(
            _table(
                ["name", "shape", "dtype"],
                [[n, "x".join(map(str, a["shape"])) or "scalar", a["dtype"]] for n, a in sorted(arrays.items())],
            )
        )
    others = view.get("others_in_root") or []
    if others:
        shown = ", ".join(f"{o['step']}{'' if o['complete'] else ' (incomplete)'}" for o in others)
        out += ["", f"other steps in {Path(view['checkpoint']).parent}: {shown}"]
    return "\n".join(out) + "\n"

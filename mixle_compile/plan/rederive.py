"""A plan re-derived from its own spec: what `run` trusts of a plan read from disk.

The digest catches accidents; it cannot catch a plan edited and resealed (docs/plan-format.md says
how to reseal). So before anything runs, the plan's embedded spec is checked and lowered again and
every derived section (mesh, groups, parameter layouts, updates with their groups and divisors,
schedule, memory, traffic, decomposition and the verdict) must equal what the compiler derives; the
first difference is named. A plan whose spec no longer checks cleanly is refused too.
"""

from __future__ import annotations

import json
from typing import Any

from mixle_compile.plan.document import PlanDocument

DERIVED = ("mesh", "groups", "parameters", "updates", "schedule", "memory", "traffic", "decomposition")


class PlanMismatch(ValueError):
    """The plan differs from what its spec compiles to."""


def rederive(doc: PlanDocument) -> None:
    """Raise :class:`PlanMismatch` naming the first derived value that its spec does not give."""
    from mixle_compile.compile import compile_loaded
    from mixle_compile.spec import load_spec_text

    loaded = load_spec_text(json.dumps(doc.spec), "the plan's spec", json_syntax=True)
    result = compile_loaded(loaded)
    if result.plan is None:
        errors = [d for d in result.check.diagnostics if d.severity.value == "error"]
        shown = "; ".join(f"{d.code} {d.message}" for d in errors[:3])
        raise PlanMismatch(f"the plan's own spec does not check cleanly ({shown}), yet the plan says it was verified")
    from mixle_compile.plan.artifact import expanded

    fresh = expanded(result.plan)  # as loading reads it: every layer's entries
    claimed = doc.model_dump(mode="json")

    # The verdict is its errors (warnings change nothing that runs, and a plan built through the
    # library may not carry the verifier's warnings).
    def verdict(plan: dict) -> dict:
        errors = sorted(d["code"] for d in plan["verdict"]["diagnostics"] if d["severity"] == "error")
        return {"ok": plan["verdict"]["ok"], "errors": errors}

    ours, theirs = verdict(fresh), verdict(claimed)
    if ours != theirs:
        raise PlanMismatch(f"the plan's verdict {theirs} is not the one its spec gets: {ours}")
    for section in DERIVED:
        where = first_difference(claimed.get(section), fresh.get(section), section)
        if where is not None:
            raise PlanMismatch(
                f"the plan's {where}; its spec compiles to another plan, so it was edited (or is from another spec)"
            )


def first_difference(claimed: Any, fresh: Any, path: str) -> str | None:
    """The first place two JSON values differ, as `path: claimed != derived`, or None."""
    if isinstance(claimed, dict) and isinstance(fresh, dict):
        for key in sorted(set(claimed) | set(fresh)):
            if key not in fresh:
                return f"{path}.{key} is not part of the plan its spec compiles to"
            if key not in claimed:
                return f"{path}.{key} is missing"
            found = first_difference(claimed[key], fresh[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(claimed, list) and isinstance(fresh, list):
        for i, (a, b) in enumerate(zip(claimed, fresh, strict=False)):
            found = first_difference(a, b, f"{path}[{_label(a, i)}]")
            if found:
                return found
        if len(claimed) != len(fresh):
            return f"{path} has {len(claimed)} entries where its spec gives {len(fresh)}"
        return None
    if claimed != fresh:
        return f"{path} is {_show(claimed)} where its spec gives {_show(fresh)}"
    return None


def _label(item: Any, index: int) -> str:
    if isinstance(item, dict):
        for key in ("node_id", "logical_id", "name"):
            if isinstance(item.get(key), str):
                return f"{index} {item[key]}"
    return str(index)


def _show(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."

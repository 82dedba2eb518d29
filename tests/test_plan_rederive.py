"""`run` re-derives a plan from its own spec and refuses one that was edited and resealed.

Each case edits a compiled plan the way an attacker (or a bad merge) would, recomputes its
digests as docs/plan-format.md describes, and hands it to `run`: every one is refused before any
rank starts (exit 2), naming the first value that the plan's spec does not give. Before, each of
them trained wrongly (or ran an unverified spec) and exited 0.
"""

from __future__ import annotations

import copy

import pytest

from mixle_compile.plan import content_digest, load_plan_text, plan_text, spec_digest
from mixle_compile.plan.artifact import plan_spec
from mixle_compile.plan.rederive import PlanMismatch, rederive
from mixle_compile.runtime.errors import RuntimeRefusal
from tests.test_runtime_support import compile_text, spec_text


def _resealed(data: dict):
    """The plan with its content digest recomputed, loaded (so the digest check passes)."""
    data = copy.deepcopy(data)
    data["content_digest"] = content_digest(data)
    return load_plan_text(plan_text(data), "resealed.plan.json")


@pytest.fixture(scope="module")
def plan():
    return compile_text(spec_text(ds=2, tp=2)).model_dump(mode="json")


def _gradient_updates(data):
    return [u for u in data["updates"] if u["payload"] == "gradient"]


def drop_a_reduction(data):
    data["updates"].remove(_gradient_updates(data)[0])


def divisor_one(data):
    for u in _gradient_updates(data):
        u["gradient_divisor"] = 1


def divisor_seven(data):
    _gradient_updates(data)[0]["gradient_divisor"] = 7


def swap_groups(data):
    other = compile_text(spec_text(dr=2, tp=2)).model_dump(mode="json")
    data["groups"], data["mesh"] = other["groups"], other["mesh"]


def zero_memory(data):
    for stage in data["memory"]:
        for key in stage:
            if key != "stage":
                stage[key] = 0


def rejected_spec_marked_ok(data):
    data["spec"]["resources"]["memory"] = 1024  # 1 KiB: R001 refuses it
    data["spec_digest"] = spec_digest(plan_spec(_as_doc(data)))


def _as_doc(data):
    from mixle_compile.plan.document import PlanDocument

    return PlanDocument.model_validate(data)


@pytest.mark.parametrize(
    "edit,named",
    [
        (drop_a_reduction, "updates"),
        (divisor_one, "gradient_divisor"),
        (divisor_seven, "gradient_divisor"),
        (swap_groups, "mesh"),
        (zero_memory, "memory"),
        (rejected_spec_marked_ok, "does not check cleanly"),
    ],
)
def test_a_resealed_lying_plan_is_refused_naming_the_difference(plan, tmp_path, edit, named):
    data = copy.deepcopy(plan)
    edit(data)
    doc = _resealed(data)  # its digests hold: only re-derivation can tell
    with pytest.raises(PlanMismatch, match=named):
        rederive(doc)
    from mixle_compile.runtime import run_plan

    with pytest.raises(RuntimeRefusal, match=named):
        run_plan(doc, out_dir=tmp_path, progress=False)
    assert not (tmp_path / "logs").exists()


def test_an_honest_plan_re_derives(plan):
    rederive(_resealed(plan))

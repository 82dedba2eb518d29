"""Repeated layers stated once (plan/layers.py): folding gives every entry back, keeps the plan's
size flat in layers, and a folded group edited by hand is caught."""

from __future__ import annotations

import copy
import re

import pytest

from mixle_compile.compile import compile_loaded
from mixle_compile.plan import PlanError, content_digest, load_plan_text, plan_text
from mixle_compile.plan.artifact import expanded
from mixle_compile.plan.layers import fold, layer_of, unfold
from mixle_compile.plan.rederive import PlanMismatch, rederive
from mixle_compile.spec import load_spec_text
from tests.conftest import ROOT

SPEC = (ROOT / "examples" / "tiny-transformer.yaml").read_text()


def plan_with(layers: int, pp: int = 1) -> dict:
    text = re.sub(r"num_layers: \d+", f"num_layers: {layers}", SPEC)
    if pp > 1:
        text = text.replace("mesh:", f"mesh:\n  pp: {pp}\n  microbatches: {pp}", 1)
        text = text.replace("devices: 4", f"devices: {4 * pp}").replace("tie_embeddings: true", "tie_embeddings: false")
        text = text.replace("global_batch_size: 8", f"global_batch_size: {8 * pp}")
    loaded = load_spec_text(text, "tiny.yaml")
    result = compile_loaded(loaded)
    assert result.plan is not None, [d.text() for d in result.check.diagnostics]
    return result.plan


@pytest.fixture(scope="module")
def deep():
    return plan_with(24)


def test_folding_gives_every_entry_back(deep):
    full = expanded(deep)
    for key in ("parameters", "updates"):
        assert len(deep[key]) < len(full[key]) / 4  # folded
        assert fold(full[key]) == deep[key] and unfold(deep[key]) == full[key]
        assert sorted({layer_of(e) for e in full[key]} - {None}) == list(range(24))
    doc = load_plan_text(plan_text(deep))
    assert [u.node_id for u in doc.updates] == [u["node_id"] for u in full["updates"]]


def test_plan_size_is_flat_in_layers():
    small, large = len(plan_text(plan_with(4))), len(plan_text(plan_with(64)))
    assert large < 1.05 * small, (small, large)


def _resealed(data: dict):
    data = copy.deepcopy(data)
    data["content_digest"] = content_digest(data)
    return load_plan_text(plan_text(data), "resealed.plan.json")


def _group(data, key):
    return next(item for item in data[key] if "layers" in item and "entries" in item)


@pytest.mark.parametrize(
    "edit,named",
    [
        (lambda d: _group(d, "updates").update(layers=_group(d, "updates")["layers"] - 1), "updates"),
        (lambda d: _group(d, "updates")["entries"][0].update(gradient_divisor=3), "updates"),
        (lambda d: _group(d, "parameters")["entries"][0].update(stage=0, local_shape=[1]), "parameters"),
    ],
)
def test_an_edited_folded_group_is_caught(deep, edit, named):
    edited = copy.deepcopy(deep)
    edit(edited)
    with pytest.raises(PlanError, match="digest mismatch"):
        load_plan_text(plan_text(edited), "edited.plan.json")
    with pytest.raises(PlanMismatch, match=named):
        rederive(_resealed(edited))


@pytest.mark.parametrize(
    "plan,edit,said",
    [
        ("deep", lambda d: _group(d, "updates").update(layers=0), "layers` >= 1"),
        (
            "deep",
            lambda d: _group(d, "updates")["entries"][-1].update(node_id="layers.99.x:grad", tensor="layers.99.x"),
            "same one layer",
        ),
        ("staged", lambda d: _staged_groups(d, "updates")[0].update(stages=0), "stages` >= 1"),
        ("staged", lambda d: _staged_groups(d, "updates")[0].update(stages=True), "stages` >= 1"),
        ("staged", lambda d: _staged_groups(d, "updates")[0]["entries"][0].pop("stage"), "stage"),
    ],
)
def test_a_malformed_folded_group_is_refused_clearly(request, plan, edit, said):
    edited = copy.deepcopy(request.getfixturevalue(plan))
    edit(edited)
    edited["content_digest"] = content_digest(edited)
    with pytest.raises(PlanError, match=said):
        load_plan_text(plan_text(edited), "edited.plan.json")


def test_a_plan_is_written_back_in_the_folded_form_its_digest_covers(deep):
    from mixle_compile.plan.artifact import written_text
    from mixle_compile.plan.document import PlanDocument

    text = plan_text(deep)
    assert written_text(load_plan_text(text)) == text
    # a model built without its bytes (every entry unfolded) is folded again as compiled
    rebuilt = PlanDocument.model_validate(load_plan_text(text).model_dump(mode="json"))
    assert written_text(rebuilt) == text
    load_plan_text(written_text(rebuilt))


@pytest.mark.parametrize("seed", range(4))
def test_folding_round_trips_names_made_to_confuse_it(seed):
    # Names with the index twice, inside other words, after another prefix, a literal that looks like
    # a blank, a second layer's index; layers that repeat, and copies broken in one field.
    import random

    rng = random.Random(seed)
    names = [
        "layers.{i}.w",
        "layers.#.q",
        "xlayers.{i}.w",
        "layers.{i}.a.layers.{i}.b",
        "layers.{j}.c",
        "blocks.layers.{i}.w",
        "a.layers.{i}.w",
        "layers.{i}",
    ]
    folded = 0
    for _ in range(500):
        template = [
            {"name": rng.choice(names), "stage": 0, **({"layer": "L"} if rng.random() < 0.5 else {})}
            for _ in range(rng.randint(1, 3))
        ]
        entries = []
        for i in range(rng.randint(2, 7)):
            for t in template:
                e = {"name": t["name"].format(i=i, j=rng.choice([i, i + 1])), "stage": t["stage"]}
                if "layer" in t:
                    e["layer"] = i if rng.random() > 0.05 else None
                if rng.random() < 0.05:
                    e["stage"] = 1
                entries.append(e)
        assert unfold(fold(entries)) == entries
        folded += any(set(x) == {"layers", "entries"} for x in fold(entries))
    assert folded > 25


@pytest.fixture(scope="module")
def staged():
    return plan_with(24, pp=4)  # 6 blocks on each of 4 stages


def _staged_groups(data, key):
    return [item for item in data[key] if set(item) == {"layers", "entries", "stages"}]


def test_stages_that_repeat_are_one_group(staged):
    full = expanded(staged)
    for key in ("parameters", "updates"):
        groups = _staged_groups(staged, key)  # the updates: the gradients' pass, then the activations'
        assert len(groups) == (1 if key == "parameters" else 2)
        for group in groups:
            assert group["layers"] == 6 and group["stages"] == 4
            assert {e["stage"] for e in group["entries"]} == {0}
        assert fold(full[key]) == staged[key] and unfold(staged[key]) == full[key]
        blocks = [e for e in full[key] if layer_of(e) is not None]
        # every block's entries, on the stage that holds it
        assert {(layer_of(e), e["stage"]) for e in blocks} == {(i, i // 6) for i in range(24)}
    doc = load_plan_text(plan_text(staged))
    assert [u.node_id for u in doc.updates] == [u["node_id"] for u in full["updates"]]


def test_plan_size_is_flat_in_stages_that_repeat():
    two, eight = len(plan_text(plan_with(16, pp=2))), len(plan_text(plan_with(16, pp=8)))
    # what grows is the stages' own programs, memory and traffic, not their blocks' entries
    assert eight < 2 * two, (two, eight)


def test_an_edited_staged_group_is_caught(staged):
    edited = copy.deepcopy(staged)
    _staged_groups(edited, "updates")[0].update(stages=3)
    with pytest.raises(PlanError, match="digest mismatch"):
        load_plan_text(plan_text(edited), "edited.plan.json")
    with pytest.raises(PlanMismatch, match="updates"):
        rederive(_resealed(edited))


@pytest.mark.parametrize("seed", range(4))
def test_folding_over_stages_round_trips(seed):
    # runs of layers on consecutive stages, some copies broken in one field or one stage off
    import random

    rng = random.Random(seed)
    staged = 0
    for _ in range(300):
        template = [{"name": "layers.{i}.w", "x": rng.randint(0, 1)} for _ in range(rng.randint(1, 2))]
        per_stage = rng.randint(1, 3)
        entries = []
        for stage in range(rng.randint(2, 5)):
            for k in range(per_stage):
                i = stage * per_stage + k
                for t in template:
                    e = {"name": t["name"].format(i=i), "x": t["x"], "stage": stage, "layer": i}
                    if rng.random() < 0.03:
                        e["x"] = 2
                    if rng.random() < 0.03:
                        e["stage"] += 1
                    entries.append(e)
        folded = fold(entries)
        assert unfold(folded) == entries
        assert fold(unfold(folded)) == folded
        staged += any(set(x) == {"layers", "entries", "stages"} for x in folded)
    assert staged > 100

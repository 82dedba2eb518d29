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
        text = text.replace("mesh:", f"mesh:\n  pp: {pp}", 1)
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
    "edit,said",
    [
        (lambda d: _group(d, "updates").update(layers=0), "layers` >= 1"),
        (
            lambda d: _group(d, "updates")["entries"][-1].update(node_id="layers.99.x:grad", tensor="layers.99.x"),
            "same one layer",
        ),
    ],
)
def test_a_malformed_folded_group_is_refused_clearly(deep, edit, said):
    edited = copy.deepcopy(deep)
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

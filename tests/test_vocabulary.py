"""The plan vocabulary: placements and update ids read back what they write, and the runtime reads
the plan through it, never through the lowering's modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mixle_compile.plan.vocabulary import (
    DATA_AXES,
    REPLICATE,
    Axis,
    Placement,
    PlacementError,
    Replicate,
    Shard,
    UpdateId,
    UpdateIdError,
    rule_name,
    shard_dim,
)

RUNTIME = Path(__file__).resolve().parent.parent / "mixle_compile" / "runtime"


@pytest.mark.parametrize("text", ["replicate", "shard(0)", "shard(1)", "shard(12)"])
def test_placement_round_trip(text):
    placement = Placement.parse(text)
    assert str(placement) == text
    assert Placement.parse(str(placement)) == placement


def test_placement_types():
    assert Placement.parse("replicate") is REPLICATE and isinstance(REPLICATE, Replicate) and REPLICATE.dim is None
    assert Placement.parse("shard(3)") == Shard(3) and Shard(3).dim == 3 and shard_dim("shard(3)") == 3
    assert shard_dim("replicate") is None


@pytest.mark.parametrize(
    "text", ["shard(01)", "Shard(0)", "shard()", "shard(-1)", "replicated", " shard(0)", "", 3, None]
)
def test_bad_placement_is_refused_with_the_grammar(text):
    with pytest.raises(PlacementError, match=r"malformed placement .*expected 'replicate' or 'shard\(<dim>\)'"):
        Placement.parse(text)


@pytest.mark.parametrize("dim", [-1, True, 1.0])
def test_a_shard_dimension_is_a_non_negative_integer(dim):
    with pytest.raises(PlacementError, match="integer >= 0"):
        Shard(dim)


@pytest.mark.parametrize(
    ("built", "text"),
    [
        (UpdateId.activation("layers.3.mlp", "out"), "layers.3.mlp:out"),
        (UpdateId.activation("layers.3.mlp", "out", backward=True), "layers.3.mlp:out/grad"),
        (UpdateId.activation("layers.0.moe", "dispatch", backward=True), "layers.0.moe:dispatch/grad"),
        (UpdateId.activation("lm_head", "loss"), "lm_head:loss"),
        (UpdateId.gradient("embed.weight", "scatter"), "embed.weight:grad/scatter"),
        (UpdateId.gradient("embed", "tied"), "embed:grad/tied"),
        (UpdateId.gather("layers.1.mlp.up_proj.weight"), "layers.1.mlp.up_proj.weight:param/gather"),
        (UpdateId.gather("layers.1.mlp.up_proj.weight", "forward"), "layers.1.mlp.up_proj.weight:param/gather-forward"),
        (UpdateId.transfer(1, 0, backward=True), "stage.1->0:activation/grad"),
    ],
)
def test_update_id_build_parse_round_trip(built, text):
    assert str(built) == text
    assert UpdateId.parse(text) == built


def test_update_id_readers():
    assert UpdateId.parse("stage.2->3:activation").stages == (2, 3)
    assert UpdateId.parse("stage.3->2:activation/grad").stages == (3, 2)
    assert UpdateId.parse("layers.0.attn:kv").stages is None
    forward = UpdateId.parse("layers.0.attn:kv")
    assert forward.backward() == UpdateId.parse("layers.0.attn:kv/grad") and forward.backward().is_backward
    assert not forward.is_backward and not UpdateId.parse("embed.weight:grad/tp").is_backward


@pytest.mark.parametrize("text", ["embed", "embed:", ":out", "layers.0.mlp:out/", "a:b/c/d", 7])
def test_bad_update_id_is_refused_with_its_shape(text):
    with pytest.raises(UpdateIdError, match=r"malformed update id .*'<subject>:<kind>'"):
        UpdateId.parse(text)


def test_unknown_gradient_step_is_refused():
    with pytest.raises(UpdateIdError, match="unknown gradient step 'sum'; valid steps: tied, tp, kv, scatter, reduce"):
        UpdateId.gradient("w", "sum")


def test_axes_are_the_plans_names():
    assert DATA_AXES == ("dp_replicate", "dp_shard", "cp") and Axis.TP == "tp" and f"{Axis.DP_SHARD}" == "dp_shard"
    assert rule_name((Axis.CP, Axis.DP_SHARD, Axis.DP_REPLICATE)) == "dp_replicate+dp_shard+cp"


def _lower_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("mixle_compile.lower")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("mixle_compile.lower") or (
                node.module == "mixle_compile" and any(a.name == "lower" for a in node.names)
            ):
                found.append(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level and (node.module or "").startswith("lower"):
            found.append("." * node.level + node.module)
    return found


def test_no_runtime_module_imports_the_lowering():
    modules = sorted(RUNTIME.rglob("*.py"))  # subpackages too
    assert len(modules) > 10
    offenders = {str(p.relative_to(RUNTIME)): _lower_imports(p) for p in modules if _lower_imports(p)}
    assert offenders == {}, (
        f"runtime modules import mixle_compile.lower: {offenders}; import the plan's vocabulary instead"
    )


def test_the_import_check_sees_an_import_of_the_lowering(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "def f():\n    from mixle_compile.lower.groups import rule_name\n    import mixle_compile.lower.layouts\n"
    )
    assert _lower_imports(sample) == ["mixle_compile.lower.groups", "mixle_compile.lower.layouts"]


def test_statistics_id_round_trip():
    built = UpdateId.statistics("model.root.components[0]")
    assert str(built) == "model.root.components[0]:statistics" and UpdateId.parse(str(built)) == built

"""graph: readable for an 8B model (repeated layers collapsed, binary units, children in order)."""

from __future__ import annotations

import re

from mixle_compile import cli
from mixle_compile.graph import build_model_graph
from mixle_compile.graph.export import graph_view, to_dot, to_mermaid, to_text
from mixle_compile.spec import load_spec, load_spec_text
from tests.conftest import EXAMPLES


def graph_of(name: str):
    loaded = load_spec(EXAMPLES / name)
    return build_model_graph(loaded.spec, loaded.document)


def test_an_8b_transformer_reads_as_five_lines():
    graph = graph_of("llama3-8b-hsdp-tp.yaml")
    text = to_text(graph)
    assert text.splitlines() == [
        "model  transformer, 14.96 GiB of parameters",
        "├─ embed  block, 1002.00 MiB",
        "├─ layers.0..31 ×32  block, 416.02 MiB each, 13.00 GiB in all",
        "├─ final_norm  block, 8.00 KiB",
        "└─ lm_head  block, 1002.00 MiB",
    ]
    layer = graph.node("model.layers.0")
    assert layer.own_param_bytes * 32 == sum(graph.node(f"model.layers.{i}").own_param_bytes for i in range(32))
    assert graph.node().subtree_param_bytes == 16_060_522_496  # 8.03e9 bf16 parameters: 14.96 GiB


def test_dot_and_mermaid_draw_the_collapsed_view():
    graph = graph_of("llama3-8b-hsdp-tp.yaml")
    dot = to_dot(graph)
    assert len(re.findall(r"^  n\d+ \[label=", dot, re.M)) == 5 and dot.count(" -> ") == 4
    assert 'label="layers.0..31 ×32\\nblock\\n416.02 MiB each, 13.00 GiB in all", style=bold' in dot
    assert "436,224,000 B" not in dot and "416.02 MiB" in dot  # binary units, not raw byte counts
    mermaid = to_mermaid(graph)
    assert mermaid.count("-->") == 4 and "layers.0..31 ×32<br/>block" in mermaid


def test_children_come_in_the_models_order_and_expand_shows_every_layer():
    graph = graph_of("llama3-8b-hsdp-tp.yaml")
    expanded = graph_view(graph, collapse=False)
    names = [v.label for v in expanded]
    assert names == ["model", "embed", *(f"layers.{i}" for i in range(32)), "final_norm", "lm_head"]
    dot = to_dot(graph, collapse=False)
    assert dot.index('"layers.0\\n') < dot.index('"layers.1\\n') < dot.index('"layers.31\\n') < dot.index('"lm_head\\n')


def test_only_identical_neighbours_are_collapsed():
    spec = (
        (EXAMPLES / "tiny-moe-every-axis.yaml")
        .read_text()
        .replace("moe_ffn_hidden_size: 48", "moe_ffn_hidden_size: 48\n  moe_layer_frequency: 2")
    )
    loaded = load_spec_text(spec, "alternating.yaml")
    graph = build_model_graph(loaded.spec, loaded.document)
    labels = [v.label for v in graph_view(graph)]
    assert [x for x in labels if x.startswith("layers")] == [
        "layers.0",
        "layers.1",
        "layers.2",
        "layers.3",
    ]  # dense, MoE, dense, MoE
    tied = to_text(graph_of("tiny-moe-every-axis.yaml"))
    assert "layers.0..3 ×4" in tied and tied.count("tied.tied_embedding") == 2 and "(shared, above)" in tied


def test_graph_text_from_the_command_line(capsys, tmp_path):
    assert cli.main(["graph", str(EXAMPLES / "mixtral-moe-ep.yaml"), "--format", "text"]) == 0
    out = capsys.readouterr().out
    assert "layers.0..31 ×32" in out and "[expert ×8] experts.expert" in out
    assert cli.main(["graph", str(EXAMPLES / "mixtral-moe-ep.yaml"), "--expand", "-o", str(tmp_path / "g.dot")]) == 0
    assert (tmp_path / "g.dot").read_text().count('"layers.') == 32
    assert cli.main(["graph", str(EXAMPLES / "mixtral-moe-ep.yaml"), "-o", str(tmp_path / "missing" / "g.dot")]) == 2
    assert "cannot write" in capsys.readouterr().err

"""The decomposition DAG as Graphviz DOT or Mermaid text, for docs and pull requests."""

from __future__ import annotations

from mixle_compile.graph.build import ModelGraph


def _label(graph: ModelGraph, node_id: str) -> str:
    n = graph.node(node_id)
    short = node_id.removeprefix("model.") or node_id
    parts = [short, n.kind]
    if n.axis.value != "none":
        parts.append(f"{n.axis.value} x{n.num_units} ({n.reduction.value})")
    if n.own_param_bytes:
        parts.append(f"{n.own_param_bytes:,} B")
    if n.shared:
        parts.append("shared")
    return "\\n".join(parts)


def _ids(graph: ModelGraph) -> dict[str, str]:
    # Stable short identifiers in the graph's own children-first order.
    return {node: f"n{i}" for i, node in enumerate(reversed(graph.order))}


def _edges(graph: ModelGraph, ids: dict[str, str]):
    for parent in reversed(graph.order):
        for child in graph.graph.successors(parent):
            attrs = graph.graph.edges[parent, child]
            times = attrs.get("multiplicity", 1)
            yield ids[parent], ids[child], (f"{attrs.get('role', '')} x{times}" if times > 1 else attrs.get("role", ""))


def to_dot(graph: ModelGraph) -> str:
    ids = _ids(graph)
    lines = ["digraph decomposition {", "  rankdir=TB;", '  node [shape=box, fontname="Helvetica", fontsize=10];']
    for node, nid in ids.items():
        style = ", style=dashed" if graph.node(node).shared else ""
        label = _label(graph, node).replace('"', '\\"')
        lines.append(f'  {nid} [label="{label}"{style}];')
    for a, b, label in _edges(graph, ids):
        lines.append(f'  {a} -> {b} [label="{label}"];' if label else f"  {a} -> {b};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def to_mermaid(graph: ModelGraph) -> str:
    ids = _ids(graph)
    lines = ["flowchart TD"]
    for node, nid in ids.items():
        label = _label(graph, node).replace("\\n", "<br/>").replace('"', "'")
        lines.append(f'  {nid}["{label}"]')
    for a, b, label in _edges(graph, ids):
        lines.append(f"  {a} -->|{label}| {b}" if label else f"  {a} --> {b}")
    return "\n".join(lines) + "\n"

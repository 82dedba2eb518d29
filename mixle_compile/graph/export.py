"""The decomposition DAG as an indented tree, Graphviz DOT or Mermaid text, for docs and pull requests.

All three read one view of the graph (:func:`graph_view`): nodes parent first, children in the
order the model declares them (embedding, layers 0..n-1, final norm, head), a shared node once, and
runs of identical sibling blocks named ``prefix.0``, ``prefix.1``, ... collapsed into one node
``prefix.0..31 ×32``, so that an 8B transformer reads as five lines instead of thirty-six.
Sizes are in binary units (KiB, MiB, GiB).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mixle_compile.graph.build import ModelGraph

_NUMBERED = re.compile(r"^(?P<prefix>.+)\.(?P<index>\d+)$")
#: The fewest identical siblings collapsed into one node.
MIN_RUN = 3


def human_bytes(n: float) -> str:
    """Bytes in the binary unit that reads best (the report's unit, imported lazily to keep graph light)."""
    from mixle_compile.report import human_bytes as _human

    return _human(n)


@dataclass(frozen=True)
class ViewNode:
    """A node of the view: one graph node, or a run of identical siblings (``members`` > 1)."""

    members: tuple[str, ...]
    label: str  # short name: "layers.0..31 ×32" for a run
    depth: int
    parent: int | None  # index in the view
    edge: str  # the edge from its parent: role, and "×N" where the parent holds N copies

    @property
    def first(self) -> str:
        return self.members[0]


def _short(node_id: str) -> str:
    return node_id.removeprefix("model.") or node_id


def _signature(graph: ModelGraph, parent: str, child: str):
    """What must agree for siblings to be drawn as one: kind, sizes, axis, edge and children."""
    n = graph.node(child)
    edge = graph.graph.edges[parent, child]
    below = tuple(
        (c, graph.graph.edges[child, c].get("role", ""), graph.graph.edges[child, c].get("multiplicity", 1))
        for c in graph.graph.successors(child)
    )
    return (
        n.kind,
        n.own_param_bytes,
        n.axis,
        n.num_units,
        n.reduction,
        n.shared,
        edge.get("role"),
        edge.get("multiplicity", 1),
        below,
    )


def _runs(graph: ModelGraph, parent: str, children: list[str], collapse: bool) -> list[tuple[str, ...]]:
    """Children grouped into runs of consecutive identical numbered siblings (singletons otherwise)."""
    out: list[list[str]] = []
    for child in children:
        if collapse and out:
            last = out[-1]
            a, b = _NUMBERED.match(_short(last[-1])), _NUMBERED.match(_short(child))
            if (
                a
                and b
                and a["prefix"] == b["prefix"]
                and int(b["index"]) == int(a["index"]) + 1
                and not graph.node(child).shared
                and _signature(graph, parent, child) == _signature(graph, parent, last[0])
            ):
                last.append(child)
                continue
        out.append([child])
    runs: list[tuple[str, ...]] = []
    for run in out:
        if len(run) >= MIN_RUN:
            runs.append(tuple(run))
        else:
            runs += [(c,) for c in run]
    return runs


def graph_view(graph: ModelGraph, *, collapse: bool = True) -> list[ViewNode]:
    """The nodes to draw, parent first and children in declaration order; shared nodes once."""
    view: list[ViewNode] = []
    seen: set[str] = set()
    stack: list[tuple[tuple[str, ...], int, int | None, str]] = [((graph.root,), 0, None, "")]
    while stack:
        members, depth, parent, edge = stack.pop()
        first = members[0]
        if first in seen:
            continue
        seen.update(members)
        if len(members) > 1:
            a, b = _NUMBERED.match(_short(members[0])), _NUMBERED.match(_short(members[-1]))
            label = f"{a['prefix']}.{a['index']}..{b['index']} ×{len(members)}"
        else:
            label = _short(first)
        view.append(ViewNode(members, label, depth, parent, edge))
        index = len(view) - 1
        children = list(graph.graph.successors(first))
        pending = []
        for run in _runs(graph, first, children, collapse):
            attrs = graph.graph.edges[first, run[0]]
            times = attrs.get("multiplicity", 1)
            role = attrs.get("role", "")
            pending.append((run, depth + 1, index, f"{role} ×{times}" if times > 1 else role))
        stack.extend(reversed(pending))  # the first child is drawn first
    return view


def _facts(graph: ModelGraph, v: ViewNode) -> list[str]:
    n = graph.node(v.first)
    parts = [n.kind]
    if n.axis.value != "none":
        parts.append(f"{n.axis.value} ×{n.num_units} ({n.reduction.value})")
    if n.own_param_bytes:
        count = len(v.members)
        parts.append(
            f"{human_bytes(n.own_param_bytes)} each, {human_bytes(count * n.own_param_bytes)} in all"
            if count > 1
            else human_bytes(n.own_param_bytes)
        )
    if v.depth == 0 and n.subtree_param_bytes:
        parts.append(f"{human_bytes(n.subtree_param_bytes)} of parameters")
    if n.shared:
        parts.append("shared")
    return parts


def _edges(view: list[ViewNode], graph: ModelGraph):
    """(parent, child, label) in the view's indices, every edge of the graph between drawn nodes."""
    where = {m: i for i, v in enumerate(view) for m in v.members}
    for i, v in enumerate(view):
        done: set[int] = set()
        for child in graph.graph.successors(v.first):
            j = where[child]
            if j in done:
                continue
            done.add(j)
            attrs = graph.graph.edges[v.first, child]
            times = attrs.get("multiplicity", 1)
            role = attrs.get("role", "")
            yield i, j, (f"{role} ×{times}" if times > 1 else role)


def to_text(graph: ModelGraph, *, collapse: bool = True) -> str:
    """The graph as an indented tree; a shared node reached a second time is named, not repeated."""
    view = graph_view(graph, collapse=collapse)
    index = {m: i for i, v in enumerate(view) for m in v.members}
    children: dict[int, list[tuple[int, str]]] = {}
    for i, j, label in _edges(view, graph):
        children.setdefault(i, []).append((j, label))
    lines: list[str] = []
    printed: set[int] = set()

    def walk(i: int, prefix: str, tail: str, edge: str) -> None:
        v = view[i]
        role = f"[{edge}] " if edge and edge != graph.node(v.first).kind else ""  # "[block] ... block" says nothing
        if i in printed:
            lines.append(f"{prefix}{tail}{role}{v.label} (shared, above)")
            return
        printed.add(i)
        lines.append(f"{prefix}{tail}{role}{v.label}  " + ", ".join(_facts(graph, v)))
        kids = children.get(i, [])
        inner = prefix + ("" if not tail else "   " if tail.startswith("└") else "│  ")
        for k, (j, label) in enumerate(kids):
            walk(j, inner, "└─ " if k == len(kids) - 1 else "├─ ", label)

    walk(index[graph.root], "", "", "")
    return "\n".join(lines) + "\n"


def _dot_label(graph: ModelGraph, v: ViewNode) -> str:
    return "\\n".join([v.label, *_facts(graph, v)])


def to_dot(graph: ModelGraph, *, collapse: bool = True) -> str:
    view = graph_view(graph, collapse=collapse)
    lines = ["digraph decomposition {", "  rankdir=TB;", '  node [shape=box, fontname="Helvetica", fontsize=10];']
    for i, v in enumerate(view):
        style = ", style=dashed" if graph.node(v.first).shared else ", style=bold" if len(v.members) > 1 else ""
        label = _dot_label(graph, v).replace('"', '\\"')
        lines.append(f'  n{i} [label="{label}"{style}];')
    for a, b, label in _edges(view, graph):
        lines.append(f'  n{a} -> n{b} [label="{label}"];' if label else f"  n{a} -> n{b};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def to_mermaid(graph: ModelGraph, *, collapse: bool = True) -> str:
    view = graph_view(graph, collapse=collapse)
    lines = ["flowchart TD"]
    for i, v in enumerate(view):
        label = _dot_label(graph, v).replace("\\n", "<br/>").replace('"', "'")
        lines.append(f'  n{i}["{label}"]')
    for a, b, label in _edges(view, graph):
        lines.append(f"  n{a} -->|{label}| n{b}" if label else f"  n{a} --> n{b}")
    return "\n".join(lines) + "\n"

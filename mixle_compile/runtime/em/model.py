"""The distribution tree EM fits: scoring, sufficient statistics and the maximiser, node by node.

Torch-free (numpy, float64). A record (one row of the data) is a flat vector of float64 columns;
each node reads its own columns:

- ``gaussian`` (dim D): D columns; ``categorical``: one column of integers in [0, V);
  ``poisson``: D non-negative integer columns; ``exponential``: D positive columns;
- ``mixture``: the columns of its components (all components read the same number of columns);
- ``composite``: its factors' columns side by side, in factor order;
- ``hmm``: one sequence, ``seq_len`` steps of its emissions' columns, step-major (a data rank
  holds whole sequences);
- ``sequence``: ``seq_len`` steps of its base's columns, step-major, each step scored by the base
  (the steps are independent);
- an ``hmm`` or a ``sequence`` with a ``length`` distribution reads one more column first: the
  sequence's number of steps ``L`` (an integer in ``[0, seq_len]``); only its first ``L`` steps are
  read (the rest is padding, any value), and the length node scores ``L``. Without ``length`` every
  sequence has ``seq_len`` steps. This is how mixle scores them: the forward likelihood (an hmm) or
  the sum of the steps' log-densities (a sequence), plus ``len_dist.log_density(L)``
  (mixle/stats/latent/hidden_markov.py, ``log_density``; mixle/stats/combinator/sequence.py,
  ``log_density``), and how its EM fits them: the length estimator receives each sequence's
  length with the sequence's weight, the steps the weight of their state or of the sequence
  (``HiddenMarkovAccumulator.seq_update``, ``SequenceAccumulator.seq_update``).

Node ids are the spec paths the plan uses (``model.root.components[0].emission``). A node held
once per unit of a ``repeat`` (or per HMM state) has one row of parameters and statistics per
instance: instance ``i`` of a parent repeated ``R`` times holds child instances ``i*R .. i*R+R-1``.
A shared node (``model.shared.NAME``) has one instance, whoever uses it.

Sufficient statistics per instance (float64 elements; the plan sizes its updates from this table):

| node | statistics |
|---|---|
| gaussian, diag, D | weight, sum x (D), sum x^2 (D): 1 + 2D |
| gaussian, full, D | weight, sum x (D), sum x x^T (D*D): 1 + D + D*D |
| categorical, V | weighted count of each value: V |
| poisson / exponential, D | weight, sum x (D): 1 + D |
| transitions, or an hmm's own, S | expected initial states (S), expected transitions (S*S) |
| mixture, K | responsibilities' sums: K |

A weight flows down the tree per row (1 at the root): a mixture splits it by the posterior, a
composite hands it to every factor, an HMM turns it into per-step state occupancies, a sequence
hands it to each of its steps; a length node receives the weight of its sequence.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mixle_compile.spec.models import (
    HMM,
    Categorical,
    Composite,
    Exponential,
    Gaussian,
    Mixture,
    Poisson,
    Ref,
    Sequence,
    Transitions,
)

LOG_2PI = float(np.log(2.0 * np.pi))
# Below this weight an instance keeps its parameters (its maximiser is undefined).
MIN_WEIGHT = 1e-8
_lgamma = np.frompyfunc(math.lgamma, 1, 1)


class ModelError(ValueError):
    """The model cannot be fitted by this EM (the message says what and where)."""


@dataclass
class TreeNode:
    id: str
    kind: str
    spec: Any
    instances: int = 0
    width: int = 0  # columns of one record of this node (an hmm: steps x emission columns)
    children: list[tuple[TreeNode, int]] = field(default_factory=list)  # (child, instances per own instance)
    transitions: TreeNode | None = None  # an hmm's transitions node (None: its own)
    length: TreeNode | None = (
        None  # an hmm's or a sequence's length distribution (None: every sequence has seq_len steps)
    )
    shared: bool = False

    def linked(self) -> list[TreeNode]:
        """Every node this one reaches directly: its units, its transitions and its length."""
        return [c for c, _ in self.children] + [n for n in (self.transitions, self.length) if n is not None]

    def length_instance(self, inst: int) -> int:
        """The instance of ``self.length`` that instance ``inst`` of this node holds."""
        return 0 if self.length.shared else inst

    @property
    def num_units(self) -> int:
        if self.kind == "mixture":
            return self.spec.num_components
        if self.kind == "composite":
            return len(self.spec.factors)
        return 1

    def unit_child(self, unit: int, inst: int) -> tuple[TreeNode, int]:
        """The node and instance of unit ``unit`` of instance ``inst`` (a component or a factor)."""
        if len(self.children) == 1:
            child, r = self.children[0]
            return child, 0 if child.shared else inst * r + unit
        child = self.children[unit][0]
        return child, 0 if child.shared else inst

    def stat_width(self) -> int:
        s = self.spec
        if self.kind == "gaussian":
            return 1 + s.dim + (s.dim * s.dim if s.covariance == "full" else s.dim)
        if self.kind == "categorical":
            return s.num_values
        if self.kind in ("poisson", "exponential"):
            return 1 + s.dim
        if self.kind == "transitions" or (self.kind == "hmm" and self.transitions is None):
            return s.num_states + s.num_states * s.num_states
        if self.kind == "mixture":
            return s.num_components
        return 0


@dataclass
class Tree:
    root: TreeNode
    nodes: dict[str, TreeNode]  # every node, parents before children
    seq_len: int | None

    @property
    def width(self) -> int:
        return self.root.width

    def with_statistics(self) -> list[TreeNode]:
        return [n for n in self.nodes.values() if n.stat_width()]


def build_tree(model, seq_len: int | None) -> Tree:
    """The runtime tree of a distribution model; raises ModelError for what EM cannot fit."""
    nodes: dict[str, TreeNode] = {}
    shared = model.shared

    def resolve(child, path: str) -> tuple[str, Any, bool]:
        if isinstance(child, Ref):
            if child.ref not in shared:
                raise ModelError(f"{path}: `ref: {child.ref}` names no entry of model.shared")
            return f"model.shared.{child.ref}", shared[child.ref], True
        return path, child, False

    def add_children(node: TreeNode, one, one_field: str, repeat: int, many, many_field: str, depth: int) -> None:
        """A node's children: one child repeated `repeat` times (held once when shared), or a list."""
        if one is not None:
            cid, cspec, cs = resolve(one, f"{node.id}.{one_field}")
            r = 1 if cs else repeat
            node.children.append((visit(cid, cspec, node.instances * r, cs, depth + 1), r))
            return
        for k, c in enumerate(many):
            cid, cspec, cs = resolve(c, f"{node.id}.{many_field}[{k}]")
            node.children.append((visit(cid, cspec, node.instances, cs, depth + 1), 1))

    def visit(node_id: str, spec, copies: int, is_shared: bool, depth: int = 0) -> TreeNode:
        if depth > 200:
            raise ModelError(f"{node_id}: the model is nested more than 200 levels deep")
        if node_id in nodes:  # a shared node, reached again through another ref
            return nodes[node_id]
        node = TreeNode(node_id, spec.type, spec, instances=1 if is_shared else copies, shared=is_shared)
        nodes[node_id] = node
        copies = node.instances
        if isinstance(spec, Gaussian) or isinstance(spec, (Poisson, Exponential)):
            node.width = spec.dim
        elif isinstance(spec, Categorical):
            node.width = 1
        elif isinstance(spec, Transitions):
            node.width = 0
        elif isinstance(spec, Mixture):
            add_children(node, spec.component, "component", spec.repeat, spec.components, "components", depth)
            widths = {c.width for c, _ in node.children}
            if len(widths) != 1:
                kinds = ", ".join(f"{c.kind} ({c.width} column{'s' if c.width != 1 else ''})" for c, _ in node.children)
                raise ModelError(
                    f"{node_id}: the components of a mixture must read the same record; these read {kinds}"
                )
            node.width = widths.pop()
        elif isinstance(spec, Composite):
            for j, f in enumerate(spec.factors):
                fid, fspec, fs = resolve(f, f"{node_id}.factors[{j}]")
                node.children.append((visit(fid, fspec, copies, fs, depth + 1), 1))
            node.width = sum(c.width for c, _ in node.children)
        elif isinstance(spec, HMM):
            if seq_len is None:
                raise ModelError(
                    f"{node_id}: an hmm reads sequences of up to training.seq_len steps; set training.seq_len"
                )
            s = spec.num_states
            add_children(node, spec.emission, "emission", s, spec.emissions, "emissions", depth)
            widths = {c.width for c, _ in node.children}
            if len(widths) != 1:
                raise ModelError(f"{node_id}: the emissions of an hmm must read the same columns")
            if any(c.kind in STEPPED or _contains_steps(c) for c, _ in node.children):
                raise ModelError(
                    f"{node_id}: an hmm's emissions cannot contain another hmm or a sequence (one training.seq_len)"
                )
            add_length(node, spec.length, depth)
            if spec.transitions is not None:
                tid, tspec, ts = resolve(spec.transitions, f"{node_id}.transitions")
                if not isinstance(tspec, Transitions):
                    raise ModelError(f"{tid}: an hmm's transitions must be a `transitions` node, not {tspec.type!r}")
                if tspec.num_states != s:
                    raise ModelError(f"{tid}: {tspec.num_states} states, but the hmm {node_id} has {s}")
                node.transitions = visit(tid, tspec, copies, ts, depth + 1)
            node.width = (1 if node.length else 0) + seq_len * widths.pop()
        elif isinstance(spec, Sequence):
            if seq_len is None:
                raise ModelError(f"{node_id}: a sequence reads up to training.seq_len steps; set training.seq_len")
            bid, bspec, bs = resolve(spec.base, f"{node_id}.base")
            base = visit(bid, bspec, copies, bs, depth + 1)
            node.children.append((base, 1))
            if base.kind in STEPPED or _contains_steps(base):
                raise ModelError(
                    f"{node_id}: a sequence's base cannot contain an hmm or another sequence (one training.seq_len)"
                )
            add_length(node, spec.length, depth)
            node.width = (1 if node.length else 0) + seq_len * base.width
        else:
            raise ModelError(f"{node_id}: EM does not fit a {spec.type!r} node")
        return node

    def add_length(node: TreeNode, length, depth: int) -> None:
        """An hmm's or a sequence's length distribution: a node reading one column, the length."""
        if length is None:
            return
        lid, lspec, ls = resolve(length, f"{node.id}.length")
        node.length = visit(lid, lspec, node.instances, ls, depth + 1)
        if node.length.width != 1 or node.length.kind in STEPPED or _contains_steps(node.length):
            raise ModelError(
                f"{lid}: a length distribution reads one column (each sequence's number of steps); "
                f"this {node.length.kind} reads {node.length.width}"
            )

    root_id, root_spec, root_shared = resolve(model.root, "model.root")
    if isinstance(root_spec, Transitions):
        raise ModelError(f"{root_id}: a `transitions` node alone describes no data; use it inside an hmm")
    root = visit(root_id, root_spec, 1, root_shared)
    return Tree(root, nodes, seq_len)


# Nodes that read sequences of up to training.seq_len steps.
STEPPED = ("hmm", "sequence")


def _contains_steps(node: TreeNode) -> bool:
    return any(c.kind in STEPPED or _contains_steps(c) for c in node.linked())


# -- parameters -----------------------------------------------------------------------------

Params = dict[str, dict[str, np.ndarray]]
Stats = dict[str, np.ndarray]


def zero_statistics(tree: Tree) -> Stats:
    return {n.id: np.zeros((n.instances, n.stat_width())) for n in tree.with_statistics()}


def _views(tree: Tree, data: np.ndarray) -> dict[str, np.ndarray]:
    """Every node's columns over all rows (an hmm's emissions: every step of every sequence)."""
    views: dict[str, np.ndarray] = {}

    def walk(node: TreeNode, x: np.ndarray) -> None:
        if node.id in views:
            return
        views[node.id] = x
        if node.kind == "composite":
            start = 0
            for c, _ in node.children:
                walk(c, x[:, start : start + c.width])
                start += c.width
        elif node.kind in STEPPED:
            lengths, steps, mask = _stepped(tree, node, x)
            for c, _ in node.children:
                walk(c, steps[mask])
            if node.length is not None:
                walk(node.length, lengths[:, None].astype(np.float64))
        else:
            for c, _ in node.children:
                walk(c, x)

    walk(tree.root, data)
    return views


def _stepped(tree: Tree, node: TreeNode, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(lengths, steps, mask)`` of the records ``x`` of an hmm or a sequence: each record's number
    of steps (``seq_len`` without a length node), its steps ``(n, seq_len, columns)`` and which of
    them are read (``mask[i, t]``: ``t < lengths[i]``)."""
    n, t_len = len(x), tree.seq_len
    if node.length is not None:
        with np.errstate(invalid="ignore"):
            lengths = np.clip(np.nan_to_num(x[:, 0]), 0, t_len).astype(np.int64)
        steps = x[:, 1:].reshape(n, t_len, -1)
    else:
        lengths = np.full(n, t_len, dtype=np.int64)
        steps = x.reshape(n, t_len, -1)
    return lengths, steps, np.arange(t_len)[None, :] < lengths[:, None]


def initial_params(tree: Tree, data: np.ndarray, seed: int) -> Params:
    """The start every rank (and the single-process reference) uses: the values the spec states
    (:func:`stated_values`), else seeded, from all rows."""
    rng = np.random.default_rng(seed)
    views = _views(tree, data)
    params: Params = {}
    for node in tree.nodes.values():
        n, s, x = node.instances, node.spec, views.get(node.id)
        if node.kind == "mixture":
            params[node.id] = {"weights": np.full((n, s.num_components), 1.0 / s.num_components)}
        elif node.kind == "gaussian":
            picks = rng.choice(len(x), size=n, replace=len(x) < n)
            var = x.var(axis=0) + 1e-6
            covs = np.tile(np.diag(var), (n, 1, 1)) if s.covariance == "full" else np.tile(var, (n, 1))
            params[node.id] = {"means": x[picks].astype(np.float64).copy(), "covs": covs}
        elif node.kind == "categorical":
            params[node.id] = {"probs": rng.dirichlet(np.full(s.num_values, 5.0), size=n)}
        elif node.kind == "poisson":
            params[node.id] = {"rates": (x.mean(axis=0) + 0.1) * rng.uniform(0.5, 1.5, size=(n, s.dim))}
        elif node.kind == "exponential":
            params[node.id] = {"rates": rng.uniform(0.5, 1.5, size=(n, s.dim)) / np.maximum(x.mean(axis=0), 1e-6)}
        elif node.kind == "transitions" or (node.kind == "hmm" and node.transitions is None):
            k = s.num_states
            params[node.id] = {
                "initial": rng.dirichlet(np.full(k, 5.0), size=n),
                "transition": rng.dirichlet(np.full(k, 5.0), size=(n, k)),
            }
        # Values the spec states (a model read from mixle keeps its own) replace the seeded start;
        # the draws above are made all the same, so the nodes that state none start as before.
        for name, value in stated_values(node).items():
            params[node.id][name] = np.broadcast_to(value, params[node.id][name].shape).copy()
    return params


def stated_values(node: TreeNode) -> dict[str, np.ndarray]:
    """The parameter values the spec states for ``node``, as one instance's arrays (float64)."""
    s, out = node.spec, {}
    if node.kind == "mixture" and s.weights is not None:
        out["weights"] = np.asarray(s.weights, dtype=np.float64)
    elif node.kind == "gaussian":
        if s.mean is not None:
            out["means"] = np.asarray(s.mean, dtype=np.float64)
        cov = s.covariance_matrix if s.covariance == "full" else s.variance
        if cov is not None:
            out["covs"] = np.asarray(cov, dtype=np.float64)
    elif node.kind == "categorical" and s.probs is not None:
        out["probs"] = np.asarray(s.probs, dtype=np.float64)
    elif node.kind in ("poisson", "exponential") and s.rate is not None:
        out["rates"] = np.asarray(s.rate, dtype=np.float64)
    elif node.kind == "transitions" or (node.kind == "hmm" and node.transitions is None):
        if s.initial is not None:
            out["initial"] = np.asarray(s.initial, dtype=np.float64)
        if s.transition is not None:
            out["transition"] = np.asarray(s.transition, dtype=np.float64)
    return out


def param_shapes(tree: Tree) -> dict[str, dict[str, tuple[int, ...]]]:
    """Every node's parameter arrays and their global shapes (one row per instance), as
    ``initial_params`` creates them: what a checkpoint of this model holds."""
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    for node in tree.nodes.values():
        n, s = node.instances, node.spec
        if node.kind == "mixture":
            shapes[node.id] = {"weights": (n, s.num_components)}
        elif node.kind == "gaussian":
            shapes[node.id] = {"means": (n, s.dim), "covs": (n, s.dim, s.dim) if s.covariance == "full" else (n, s.dim)}
        elif node.kind == "categorical":
            shapes[node.id] = {"probs": (n, s.num_values)}
        elif node.kind in ("poisson", "exponential"):
            shapes[node.id] = {"rates": (n, s.dim)}
        elif node.kind == "transitions" or (node.kind == "hmm" and node.transitions is None):
            shapes[node.id] = {"initial": (n, s.num_states), "transition": (n, s.num_states, s.num_states)}
    return shapes


def true_params(tree: Tree, seed: int) -> Params:
    """A random model of the spec's shape, the source of synthetic data (separated components,
    sticky transitions)."""
    rng = np.random.default_rng(seed)
    params: Params = {}
    for node in tree.nodes.values():
        n, s = node.instances, node.spec
        if node.kind == "mixture":
            params[node.id] = {"weights": rng.dirichlet(np.full(s.num_components, 2.0), size=n)}
        elif node.kind == "gaussian":
            d = s.dim
            means = rng.normal(0.0, 4.0, size=(n, d))
            scales = rng.uniform(0.5, 1.5, size=(n, d))
            if s.covariance == "full":
                mixing = (np.eye(d) + 0.3 * rng.normal(size=(n, d, d))) * scales[:, :, None]
                covs = np.einsum("kij,klj->kil", mixing, mixing)
            else:
                covs = scales * scales
            params[node.id] = {"means": means, "covs": covs}
        elif node.kind == "categorical":
            params[node.id] = {"probs": rng.dirichlet(np.full(s.num_values, 0.5), size=n)}
        elif node.kind == "poisson":
            params[node.id] = {"rates": rng.uniform(0.5, 12.0, size=(n, s.dim))}
        elif node.kind == "exponential":
            params[node.id] = {"rates": rng.uniform(0.2, 3.0, size=(n, s.dim))}
        elif node.kind == "transitions" or (node.kind == "hmm" and node.transitions is None):
            k = s.num_states
            trans = rng.dirichlet(np.full(k, 1.0), size=(n, k)) + 4.0 * np.eye(k)
            params[node.id] = {
                "initial": rng.dirichlet(np.full(k, 2.0), size=n),
                "transition": trans / trans.sum(axis=2, keepdims=True),
            }
    return params


def sample(tree: Tree, params: Params, rows: int, seed: int) -> np.ndarray:
    """``rows`` records drawn from ``params``."""
    rng = np.random.default_rng(seed)

    def draw(node: TreeNode, inst: np.ndarray) -> np.ndarray:
        """One record per entry of ``inst`` (the instance each record is drawn from)."""
        n, s, p = len(inst), node.spec, params.get(node.id)
        if node.kind == "mixture":
            w = p["weights"][inst]
            labels = (rng.random(n)[:, None] > np.cumsum(w, axis=1)).sum(axis=1).clip(0, s.num_components - 1)
            out = np.zeros((n, node.width))
            for k in range(s.num_components):
                rows_k = np.flatnonzero(labels == k)
                child, ci = _unit(node, k, inst[rows_k])
                out[rows_k] = draw(child, ci)
            return out
        if node.kind == "composite":
            return (
                np.hstack([draw(*_unit(node, j, inst)) for j in range(len(node.children))])
                if n
                else np.zeros((0, node.width))
            )
        if node.kind in STEPPED:
            return draw_steps(node, inst)
        if node.kind == "gaussian":
            z = rng.normal(size=(n, s.dim))
            if s.covariance == "full":
                chol = np.linalg.cholesky(p["covs"][inst])
                return p["means"][inst] + np.einsum("nij,nj->ni", chol, z)
            return p["means"][inst] + z * np.sqrt(p["covs"][inst])
        if node.kind == "categorical":
            cdf = np.cumsum(p["probs"][inst], axis=1)
            return (rng.random(n)[:, None] > cdf).sum(axis=1).clip(0, s.num_values - 1)[:, None].astype(np.float64)
        if node.kind == "poisson":
            return rng.poisson(p["rates"][inst]).astype(np.float64)
        if node.kind == "exponential":
            return rng.exponential(1.0 / p["rates"][inst])
        raise ModelError(f"{node.id}: cannot sample a {node.kind!r} node")

    def draw_steps(node: TreeNode, inst: np.ndarray) -> np.ndarray:
        """Records of an hmm or a sequence: the lengths drawn from its length node (above seq_len:
        seq_len), the steps after each length zero."""
        n, t_len = len(inst), tree.seq_len
        if node.kind == "hmm":
            k = node.spec.num_states
            tp = params[node.transitions.id if node.transitions else node.id]
            ti = np.zeros(n, dtype=np.int64) if node.transitions is not None and node.transitions.shared else inst
            states = np.zeros((n, t_len), dtype=np.int64)
            u = rng.random((n, t_len))
            states[:, 0] = (u[:, 0, None] > np.cumsum(tp["initial"][ti], axis=1)).sum(axis=1).clip(0, k - 1)
            for t in range(1, t_len):
                cdf = np.cumsum(tp["transition"][ti, states[:, t - 1]], axis=1)
                states[:, t] = (u[:, t, None] > cdf).sum(axis=1).clip(0, k - 1)
        else:
            k, states = 1, np.zeros((n, t_len), dtype=np.int64)
        e_width = node.children[0][0].width
        out = np.zeros((n, t_len, e_width))
        for state in range(k):
            which = np.argwhere(states == state)
            child, ci = _unit(node, state, inst[which[:, 0]])
            out[which[:, 0], which[:, 1]] = draw(child, ci)
        if node.length is None:
            return out.reshape(n, -1)
        linst = np.zeros_like(inst) if node.length.shared else inst
        lengths = np.clip(np.rint(draw(node.length, linst)[:, 0]), 0, t_len)
        out[np.arange(t_len)[None, :] >= lengths[:, None]] = 0.0
        return np.hstack([lengths[:, None], out.reshape(n, -1)])

    return draw(tree.root, np.zeros(rows, dtype=np.int64))


def _unit(node: TreeNode, unit: int, inst: np.ndarray) -> tuple[TreeNode, np.ndarray]:
    """``TreeNode.unit_child`` for an array of instances."""
    if len(node.children) == 1:
        child, r = node.children[0]
        return child, np.zeros_like(inst) if child.shared else inst * r + unit
    child = node.children[unit][0]
    return child, np.zeros_like(inst) if child.shared else inst


def describe_columns(tree: Tree) -> str:
    """What one record holds, for a message about a data file of the wrong shape."""
    stepped = [n for n in tree.nodes.values() if n.kind in STEPPED]
    if stepped:
        lengths = [n.id for n in stepped if n.length is not None]
        first = f"; {', '.join(lengths)}: the number of steps first, then the steps" if lengths else ""
        return f"sequences of training.seq_len={tree.seq_len} steps, flattened step-major{first}"
    return (
        ", ".join(f"{n.id}: {n.width}" for n in tree.nodes.values() if not n.children and n.width) or "one per column"
    )


def check_records(tree: Tree, data: np.ndarray, where: str) -> None:
    """Raises ModelError when a column holds values its node cannot have produced."""
    views = _views(tree, data)
    for node in tree.nodes.values():
        x = views.get(node.id)
        if x is not None and node.kind in STEPPED and node.length is not None:
            lengths = x[:, 0]
            if (
                not np.all(np.isfinite(lengths))
                or np.any(np.mod(lengths, 1) != 0)
                or lengths.min(initial=0) < 0
                or lengths.max(initial=0) > tree.seq_len
            ):
                raise ModelError(
                    f"{where}: the first column of {node.id} is each sequence's number of steps: "
                    f"integers in [0, {tree.seq_len}] (training.seq_len)"
                )
    for node in tree.nodes.values():
        x = views.get(node.id)
        if x is None or node.kind not in ("categorical", "poisson", "exponential", "gaussian"):
            continue
        if not np.all(np.isfinite(x)):
            raise ModelError(f"{where}: the columns of {node.id} hold non-finite values")
        if node.kind == "categorical" and (
            np.any(np.mod(x, 1) != 0) or x.min(initial=0) < 0 or x.max(initial=0) >= node.spec.num_values
        ):
            raise ModelError(f"{where}: categorical data for {node.id} must be integers in [0, {node.spec.num_values})")
        if node.kind == "poisson" and (np.any(np.mod(x, 1) != 0) or x.min(initial=0) < 0):
            raise ModelError(f"{where}: poisson data for {node.id} must be non-negative integers")
        if node.kind == "exponential" and x.min(initial=1) <= 0:
            raise ModelError(f"{where}: exponential data for {node.id} must be positive")


# -- the E-step -----------------------------------------------------------------------------


@dataclass
class Scoring:
    """How one rank scores the tree.

    ``cut``: the node whose units are split across tp ranks (None: every unit here), with
    ``owned`` the units this rank scores and ``combine(values) -> (max, sum)`` per row: for a
    component cut, the max and sum of exponentials over every rank's log-joints; for a factor
    cut, (0, the sum over every rank's factors). ``record``: keep each row's (max, sum) at the cut
    node (the single-process reference records them at the node the plan cuts).
    """

    params: Params
    stats: Stats
    cut: str | None = None
    owned: tuple[int, ...] = ()
    combine: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None
    record: str | None = None
    maxes: list[np.ndarray] = field(default_factory=list)
    sums: list[np.ndarray] = field(default_factory=list)


def score(tree: Tree, node: TreeNode, inst: int, x: np.ndarray, sc: Scoring):
    """(log p(row) per row, acc) where ``acc(w)`` adds the rows' statistics weighted by ``w``."""
    kind, s = node.kind, node.spec
    if kind == "mixture":
        units = list(sc.owned) if node.id == sc.cut else list(range(s.num_components))
        log_w = _log(sc.params[node.id]["weights"][inst][units])
        scored = [score(tree, *node.unit_child(k, inst), x, sc) for k in units]
        a = (np.stack([lp for lp, _ in scored], axis=1) if scored else np.zeros((len(x), 0))) + log_w[None]
        if node.id == sc.cut:
            m, total = sc.combine(a)
        else:
            m = a.max(axis=1) if a.shape[1] else np.full(len(x), -np.inf)
            with np.errstate(invalid="ignore"):
                total = np.exp(a - m[:, None]).sum(axis=1)
        if node.id == sc.record:
            sc.maxes.append(m)
            sc.sums.append(total)
        lse = m + np.log(total)

        def acc(w: np.ndarray) -> None:
            r = np.exp(a - lse[:, None]) * w[:, None]
            sc.stats[node.id][inst, units] += r.sum(axis=0)
            for j, (_, child_acc) in enumerate(scored):
                child_acc(r[:, j])

        return lse, acc
    if kind == "composite":
        units = list(sc.owned) if node.id == sc.cut else list(range(len(s.factors)))
        starts = np.cumsum([0] + [c.width for c, _ in node.children])
        scored = []
        for j in units:
            scored.append(score(tree, *node.unit_child(j, inst), x[:, starts[j] : starts[j + 1]], sc))
        local = np.sum([lp for lp, _ in scored], axis=0) if scored else np.zeros(len(x))
        total = sc.combine(local)[1] if node.id == sc.cut else local
        if node.id == sc.record:
            sc.maxes.append(np.zeros(len(x)))
            sc.sums.append(total)

        def acc(w: np.ndarray) -> None:
            for _, child_acc in scored:
                child_acc(w)

        return total, acc
    if kind == "hmm":
        return _score_hmm(tree, node, inst, x, sc)
    if kind == "sequence":
        lengths, steps, mask = _stepped(tree, node, x)
        rows = np.nonzero(mask)[0]
        lp_steps, base_acc = score(tree, *node.unit_child(0, inst), steps[mask], sc)
        lp = np.bincount(rows, weights=lp_steps, minlength=len(x)).astype(np.float64)
        lp_len, len_acc = _score_length(tree, node, inst, lengths, sc)

        def acc(w: np.ndarray) -> None:
            base_acc(w[rows])
            len_acc(w)

        return lp + lp_len, acc
    p = sc.params[node.id]
    if kind == "gaussian":
        d = s.dim
        mean, cov = p["means"][inst], p["covs"][inst]
        if s.covariance == "full":
            chol = np.linalg.cholesky(cov)
            z = np.linalg.solve(chol, (x - mean).T)
            lp = -0.5 * (d * LOG_2PI + 2.0 * np.log(np.diag(chol)).sum() + (z * z).sum(axis=0))
        else:
            diff = x - mean
            lp = -0.5 * (d * LOG_2PI + np.log(cov).sum() + (diff * diff / cov).sum(axis=1))

        def acc(w: np.ndarray) -> None:
            row = sc.stats[node.id][inst]
            row[0] += w.sum()
            row[1 : 1 + d] += w @ x
            row[1 + d :] += ((x * w[:, None]).T @ x).ravel() if s.covariance == "full" else w @ (x * x)

        return lp, acc
    if kind == "categorical":
        values = x[:, 0].astype(np.int64)
        lp = _log(p["probs"][inst][values])

        def acc(w: np.ndarray) -> None:
            sc.stats[node.id][inst] += np.bincount(values, weights=w, minlength=s.num_values)

        return lp, acc
    if kind in ("poisson", "exponential"):
        rates = p["rates"][inst]
        if kind == "poisson":
            lp = (x * _log(rates) - rates - _lgamma(x + 1.0).astype(np.float64)).sum(axis=1)
        else:
            lp = (_log(rates) - rates * x).sum(axis=1)

        def acc(w: np.ndarray) -> None:
            row = sc.stats[node.id][inst]
            row[0] += w.sum()
            row[1:] += w @ x

        return lp, acc
    raise ModelError(f"{node.id}: EM does not score a {kind!r} node")


def _score_length(tree: Tree, node: TreeNode, inst: int, lengths: np.ndarray, sc: Scoring):
    """(log p(length), acc) of an hmm's or a sequence's length node; zeros without one."""
    if node.length is None:
        return np.zeros(len(lengths)), lambda w: None
    return score(tree, node.length, node.length_instance(inst), lengths[:, None].astype(np.float64), sc)


def _score_hmm(tree: Tree, node: TreeNode, inst: int, x: np.ndarray, sc: Scoring):
    """Forward-backward in log space over ``n`` sequences of up to ``seq_len`` steps at once: a
    sequence of ``L`` steps reads its first ``L`` (the steps after them score 0 and take no weight);
    one of no steps scores only its length."""
    s, t_len, n = node.spec.num_states, tree.seq_len, len(x)
    lengths, steps, mask = _stepped(tree, node, x)
    real = steps[mask]
    emitted = []
    for state in range(s):
        emitted.append(score(tree, *node.unit_child(state, inst), real, sc))
    b = np.zeros((n, t_len, s))
    b[mask] = np.stack([lp for lp, _ in emitted], axis=1)
    t_node = node.transitions or node
    t_inst = 0 if t_node.shared else inst
    tp = sc.params[t_node.id]
    log_a, log_pi = _log(tp["transition"][t_inst]), _log(tp["initial"][t_inst])
    alpha = np.empty((n, t_len, s))
    alpha[:, 0] = log_pi[None] + b[:, 0]
    for t in range(1, t_len):
        alpha[:, t] = _lse(alpha[:, t - 1, :, None] + log_a[None], axis=1) + b[:, t]
    beta = np.zeros((n, t_len, s))
    for t in range(t_len - 2, -1, -1):
        inside = (t < lengths - 1)[:, None]  # beta is 0 (log 1) at a sequence's last step and after it
        beta[:, t] = np.where(inside, _lse(log_a[None] + (b[:, t + 1] + beta[:, t + 1])[:, None, :], axis=2), 0.0)
    last = alpha[np.arange(n), np.maximum(lengths - 1, 0)]
    chain = np.where(lengths > 0, _lse(last, axis=1), 0.0)
    lp_len, len_acc = _score_length(tree, node, inst, lengths, sc)

    def acc(w: np.ndarray) -> None:
        gamma = np.exp(alpha + beta - chain[:, None, None]) * (w[:, None] * mask)[:, :, None]
        row = sc.stats[t_node.id][t_inst]
        row[:s] += gamma[:, 0].sum(axis=0)
        if t_len > 1:
            xi = np.exp(
                alpha[:, :-1, :, None]
                + log_a[None, None]
                + (b[:, 1:] + beta[:, 1:])[:, :, None, :]
                - chain[:, None, None, None]
            )
            row[s:] += np.einsum("nt,ntij->ij", w[:, None] * mask[:, 1:], xi).ravel()
        occupancy = gamma[mask]
        for state, (_, child_acc) in enumerate(emitted):
            child_acc(occupancy[:, state])
        len_acc(w)

    return chain + lp_len, acc


def _log(a: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(a)


def _lse(a: np.ndarray, axis: int) -> np.ndarray:
    m = a.max(axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return (np.log(np.exp(a - m).sum(axis=axis, keepdims=True)) + m).squeeze(axis)


# -- the M-step -----------------------------------------------------------------------------


def m_step(
    tree: Tree,
    old: Params,
    stats: Stats,
    *,
    keep: Callable[[str], np.ndarray | None] = lambda node_id: None,
    totals: dict[str, float] | None = None,
) -> Params:
    """The maximiser given every node's summed statistics. ``keep(node_id)`` is a mask of entries
    (instances; the cut node: its units) this rank does not own and must leave as they are.
    ``totals``: the weight that reached a mixture when this rank sees only some of its
    components (the cut node: the number of rows)."""
    new: Params = {}
    for node in tree.nodes.values():
        if node.id not in old:
            continue
        p = {k: v.copy() for k, v in old[node.id].items()}
        st = stats.get(node.id)
        s = node.spec
        if node.kind == "mixture":
            total = (
                st.sum(axis=1, keepdims=True)
                if node.id not in (totals or {})
                else np.full((len(st), 1), float(totals[node.id]))
            )
            alive = total[:, 0] > MIN_WEIGHT
            p["weights"][alive] = st[alive] / total[alive]
        elif node.kind == "gaussian":
            d = s.dim
            count = st[:, 0]
            alive = count > MIN_WEIGHT
            c = np.where(alive, count, 1.0)[:, None]
            means = st[:, 1 : 1 + d] / c
            second = st[:, 1 + d :] / c
            # An instance whose covariance would be singular keeps all its parameters: a partial
            # maximisation still never lowers the expected log-likelihood (generalised EM).
            if s.covariance == "full":
                cov = second.reshape(-1, d, d) - np.einsum("ki,kj->kij", means, means)
                cov = 0.5 * (cov + np.transpose(cov, (0, 2, 1)))
                alive &= count > d
                alive[alive] = [_well_conditioned(c) for c in cov[alive]]
            else:
                cov = second - means * means
                alive &= (count > 1) & np.all(cov > 1e-12 * (second + 1e-300), axis=1)
            p["means"][alive] = means[alive]
            p["covs"][alive] = cov[alive]
        elif node.kind == "categorical":
            count = st.sum(axis=1)
            alive = count > MIN_WEIGHT
            p["probs"][alive] = st[alive] / count[alive, None]
        elif node.kind == "poisson":
            alive = st[:, 0] > MIN_WEIGHT
            p["rates"][alive] = st[alive, 1:] / st[alive, 0, None]
        elif node.kind == "exponential":
            alive = (st[:, 0] > MIN_WEIGHT) & np.all(st[:, 1:] > 0, axis=1)
            p["rates"][alive] = st[alive, 0, None] / st[alive, 1:]
        elif "initial" in p:
            k = s.num_states
            init, trans = st[:, :k], st[:, k:].reshape(-1, k, k)
            total = init.sum(axis=1)
            alive = total > MIN_WEIGHT
            p["initial"][alive] = init[alive] / total[alive, None]
            rows = trans.sum(axis=2)
            live = rows > MIN_WEIGHT
            p["transition"][live] = trans[live] / rows[live][:, None]
        mask = keep(node.id)
        if mask is not None:
            for name, a in p.items():
                a[mask] = old[node.id][name][mask]
        new[node.id] = p
    return new


def _well_conditioned(cov: np.ndarray) -> bool:
    try:
        diag = np.diag(np.linalg.cholesky(cov))
    except np.linalg.LinAlgError:
        return False
    return bool(diag.min() > 1e-6 * diag.max())


# -- the single-process reference -----------------------------------------------------------


def chunks_of(x: np.ndarray, size: int) -> list[np.ndarray]:
    step = max(1, size)
    return [x[start : start + step] for start in range(0, len(x), step)] or [x]


def reference_fit(
    tree: Tree, data: np.ndarray, steps: int, *, seed: int, micro_batch_size: int, record: str | None = None
):
    """EM on all rows in one process: (parameters, log-likelihoods, per iteration the statistics,
    and with ``record`` every row's (max, sum) at that node)."""
    params = initial_params(tree, data, seed)
    lls, history = [], []
    for _ in range(steps):
        sc = Scoring(params, zero_statistics(tree), record=record)
        ll = 0.0
        for xb in chunks_of(data, micro_batch_size):
            lp, acc = score(tree, tree.root, 0, xb, sc)
            acc(np.ones(len(xb)))
            ll += float(lp.sum())
        entry = dict(sc.stats)
        if record is not None:
            entry["max"] = np.concatenate(sc.maxes)
            entry["sum"] = np.concatenate(sc.sums)
        history.append(entry)
        lls.append(ll)
        params = m_step(tree, params, sc.stats)
    return params, lls, history

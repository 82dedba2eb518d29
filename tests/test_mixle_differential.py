"""Against mixle itself (the ``mixle`` extra; skipped where mixle is not installed).

On real mixle models built with mixle's API (tests/mixle_models/make_models.py): the live models
read like their committed to_dict() JSON, our sizing, axes and cuts against mixle's planner (each
difference equal or a mixle bug docs/mixle.md documents), and one EM iteration of ours from the
model's own parameters against mixle's own EM update, to 1e-9 relative.
"""

from __future__ import annotations

import json
import re
import sys
import warnings

import numpy as np
import pytest

mixle = pytest.importorskip("mixle", reason="the comparisons with mixle need the `mixle` extra")

from mixle.utils.parallel import model_decomposition as md  # noqa: E402
from mixle.utils.parallel.planner import DeviceSpec, Resources  # noqa: E402

from mixle_compile import MixleModelError, from_mixle  # noqa: E402
from mixle_compile.decompose import best_parallel_axis, decompose_model, tree_axes  # noqa: E402
from mixle_compile.decompose.cut import optimal_contiguous_cut, prefix_sums  # noqa: E402
from mixle_compile.graph import build_model_graph  # noqa: E402
from mixle_compile.mixle_models import UNBOUNDED_MEMORY  # noqa: E402
from mixle_compile.runtime.em import model as em_model  # noqa: E402
from tests.test_mixle_models import MODELS, READABLE, _model  # noqa: E402

sys.path.insert(0, str(MODELS))
from make_models import build_models, build_refused  # noqa: E402


@pytest.fixture(scope="module")
def live():
    return build_models()


@pytest.mark.parametrize("name", READABLE)
def test_a_live_model_reads_like_its_committed_json(live, name):
    assert from_mixle(live[name]) == _model(name)


def test_from_mixle_refuses_by_class_and_place():
    with pytest.raises(
        MixleModelError,
        match=r"model.root.components\[1\]: mixle GammaDistribution cannot be expressed.*\$\.state\.items",
    ):
        from_mixle(build_refused()["refused_gamma"])
    with pytest.raises(TypeError, match="takes a mixle model"):
        from_mixle({"family": "distribution"})


# Parameters each class holds (our bytes: 8 per scalar, in fp64) and the derived arrays mixle also
# keeps in the object and counts as parameter bytes (model_decomposition._own_param_bytes sums every
# ndarray attribute). Read from each class's __init__ in mixle/stats (docs/mixle.md).
PARAMETERS = {
    "GaussianDistribution": ("mu", "sigma2"),
    "DiagonalGaussianDistribution": ("mu", "covar"),
    "MultivariateGaussianDistribution": ("mu", "covar"),
    "IntegerCategoricalDistribution": ("p_vec",),
    "CategoricalDistribution": ("pmap",),
    "PoissonDistribution": ("lam",),
    "ExponentialDistribution": ("beta",),
    "MixtureDistribution": ("w",),
    "HiddenMarkovModelDistribution": ("w", "transitions"),
    "CompositeDistribution": (),
    "SequenceDistribution": (),
    "NullDistribution": (),
}
DERIVED = {
    "DiagonalGaussianDistribution": ("ca", "cb"),
    "MultivariateGaussianDistribution": ("inv_covar",),
    "IntegerCategoricalDistribution": ("log_p_vec",),
    "MixtureDistribution": ("zw", "log_w"),
    "HiddenMarkovModelDistribution": ("log_w", "log_transitions"),
}


def _live_nodes(model, node_id="model.root"):
    """(our node id, live mixle node) for every node of a live model, shared objects once."""
    seen, out, stack = set(), [], [(node_id, model)]
    while stack:
        nid, m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        out.append((nid, m))
        cls = type(m).__name__
        if cls == "MixtureDistribution":
            stack += [(f"{nid}.components[{i}]", c) for i, c in enumerate(m.components)]
        elif cls == "CompositeDistribution":
            stack += [(f"{nid}.factors[{i}]", c) for i, c in enumerate(m.dists)]
        elif cls == "HiddenMarkovModelDistribution":
            stack += [(f"{nid}.emissions[{i}]", c) for i, c in enumerate(m.topics)]
            if type(m.len_dist).__name__ != "NullDistribution":
                stack.append((f"{nid}.length", m.len_dist))
        elif cls == "SequenceDistribution":
            stack.append((f"{nid}.base", m.dist))
            if not m.null_len_dist:
                stack.append((f"{nid}.length", m.len_dist))
    return out


def _scalars(value) -> int:
    return len(value) if isinstance(value, dict) else int(np.size(value))


@pytest.mark.parametrize("name", READABLE)
def test_sizing_equals_mixle_but_for_its_documented_byte_count(live, name):
    """Per node, our bytes are the parameters' float64 bytes; mixle's are the bytes of every ndarray
    attribute: the parameters held as arrays plus its derived caches, without the parameters held as
    Python floats or a dict (docs/mixle.md, sizing)."""
    model = live[name]
    graph = build_model_graph(from_mixle(model))
    for nid, node in _live_nodes(model):
        cls = type(node).__name__
        ours_id = nid if nid in graph.graph.nodes else next(n for n in graph.order if n.startswith("model.shared."))
        params = PARAMETERS[cls]
        assert graph.node(ours_id).own_param_bytes == 8 * sum(_scalars(getattr(node, a)) for a in params), (name, nid)
        arrays = {k: v for k, v in vars(node).items() if isinstance(v, np.ndarray)}
        assert set(arrays) <= set(params) | set(DERIVED.get(cls, ())), (cls, sorted(arrays))
        assert md.size_model_tree(node).own_param_bytes == sum(v.nbytes for v in arrays.values()), (name, nid)


def _mixle_path(our_path: str) -> str:
    """Our node id -> the path mixle's tree_axes gives the same node."""
    rest = our_path.removeprefix("model.root")
    parts = re.findall(r"\.(components|factors|emissions)\[(\d+)\]", rest)
    roles = {"components": "component", "factors": "factor", "emissions": "state"}
    return "/".join(f"{roles[kind]}_{i}" for kind, i in parts) or "/"


@pytest.mark.parametrize("name", READABLE)
def test_the_same_axes_and_the_same_choice(live, name):
    model = live[name]
    ours, theirs = tree_axes(model), md.tree_axes(model)
    # the same candidates (each lists parents before children, in its own walk order)
    assert sorted((_mixle_path(c.path), c.axis.value, c.num_units) for c in ours) == sorted(
        (c.path, c.axis.value, c.num_units) for c in theirs
    )
    for p in (2, 4, 16):
        a, b = best_parallel_axis(model, p), md.best_parallel_axis(model, p)
        assert (a is None) == (b is None)
        if a is not None:
            assert (_mixle_path(a.path), a.axis.value, a.num_units, a.reduction.value) == (
                b.path,
                b.axis.value,
                b.num_units,
                b.reduction.value,
            )


def _resources(throughputs, memory=None):
    return Resources(
        tuple(
            DeviceSpec(f"gpu{i}", kind="cuda", memory_bytes=None if memory is None else memory[i], throughput=t)
            for i, t in enumerate(throughputs)
        )
    )


def _shards(cuts):
    return [(c.device.name, c.start, c.stop) for c in cuts]


def _time(shards, works, devices):
    prefix = prefix_sums(works)
    speed = {d.name: d.throughput for d in devices}
    return max((prefix[stop] - prefix[start]) / speed[name] for name, start, stop in shards)


def _optimum(works, unit_bytes, devices, min_units=1):
    caps = [UNBOUNDED_MEMORY if d.memory_bytes is None else d.memory_bytes for d in devices]
    return optimal_contiguous_cut(works, unit_bytes, [d.throughput for d in devices], caps, min_units)


CASES = [
    # (model, throughputs, memory per device, min_components_per_shard)
    ("big_mixture", (1.0, 1.0, 1.0, 1.0), None, 1),
    ("nested", (1.0, 1.0, 1.0, 1.0), None, 1),
    ("nested", (1.0, 2.0, 3.0, 4.0), None, 1),
    ("diag_mixture", (1.0, 2.0, 3.0, 4.0), None, 1),
    ("composite", (1.0, 2.0, 3.0, 4.0), None, 1),
    ("big_mixture", (1.0, 1.0, 1.0, 8.0), None, 8),
    ("big_mixture", (1.0, 1.0, 1.0, 8.0), (10**6, 10**6, 10**6, 2000), 1),
    ("hmm", (1.0, 1.0, 1.0), None, 1),
]


def _mixle_bugs(dec, works, unit_bytes, devices, min_units):
    """The documented mixle bugs this decomposition shows (docs/mixle.md)."""
    bugs = set()
    shards = _shards(dec.cuts)
    names = [d.name for d in devices]
    used = [name for name, _, _ in shards]
    if len(shards) < min(len(devices), len(works) // min_units) and used == names[: len(used)]:
        # empty shards dropped, the rest handed to the first devices: moving them onto the devices
        # after the dropped ones would be faster
        shifted = [(names[len(names) - len(shards) + i], s, e) for i, (_, s, e) in enumerate(shards)]
        if _time(shifted, works, devices) < _time(shards, works, devices):
            bugs.add("empty shards dropped, cuts on the wrong devices")
    if any(stop - start < min_units for _, start, stop in shards):
        bugs.add("min_components_per_shard not honoured")
    memory = {d.name: d.memory_bytes for d in devices}
    if any(memory[n] is not None and sum(unit_bytes[s:e]) > memory[n] for n, s, e in shards):
        bugs.add("cuts ignore device memory")
    return bugs


@pytest.mark.parametrize("name, throughputs, memory, min_units", CASES)
def test_cuts_equal_mixle_or_show_a_documented_mixle_bug(live, name, throughputs, memory, min_units):
    model = live[name]
    resources = _resources(throughputs, memory)
    devices = resources.devices
    theirs = md.decompose_model(model, resources, prefer_data_parallel=False, min_components_per_shard=min_units)
    ours = decompose_model(model, resources, prefer_data_parallel=False, min_components_per_shard=min_units)
    assert ours.ok
    assert (_mixle_path(ours.path), ours.axis.value, ours.num_units) == (
        theirs.extra["path"],
        theirs.axis.value,
        theirs.num_units,
    )
    # ours: every shard on the device named, within its memory and minimum (our own byte count)
    for cut in ours.cuts:
        assert cut.device.name == devices[cut.device.rank].name
        assert cut.stop - cut.start >= min_units
        assert cut.param_bytes <= cut.device.memory_bytes
    # ours is the best cut by our own works: no worse than mixle's cut, where that one fits our constraints
    mixle_cut = _shards(theirs.cuts)
    room = {d.name: UNBOUNDED_MEMORY if d.memory_bytes is None else d.memory_bytes for d in devices}
    fits = all(
        stop - start >= min_units and sum(ours.unit_bytes[start:stop]) + ours.held_whole_bytes <= room[n]
        for n, start, stop in mixle_cut
    )
    if fits:
        assert ours.bottleneck <= _time(mixle_cut, list(ours.unit_works), devices) * (1 + 1e-12)
    # the cut algorithms compared on mixle's own unit works and bytes
    cand = md.best_parallel_axis(model, len(devices))
    works, unit_bytes = list(cand.unit_works), list(cand.unit_bytes)
    best = _optimum(works, unit_bytes, devices, min_units)
    optimum = [(devices[s.device].name, s.start, s.stop) for s in best.shards]
    mixle_shards = _shards(theirs.cuts)
    assert mixle_shards[0][1] == 0 and mixle_shards[-1][2] == len(works)  # contiguous cover, as ours
    if mixle_shards == optimum:
        return
    bugs = _mixle_bugs(theirs, works, unit_bytes, devices, min_units)
    if not bugs:
        # a feasible cut mixle chose: its greedy quantile split is then merely no better than the optimum
        assert _time(mixle_shards, works, devices) > best.bottleneck
        bugs.add("greedy split above the optimum")
    EXPECTED_BUGS[(name, throughputs, memory, min_units)] = bugs
    assert bugs <= {
        "empty shards dropped, cuts on the wrong devices",
        "min_components_per_shard not honoured",
        "cuts ignore device memory",
        "greedy split above the optimum",
    }


EXPECTED_BUGS: dict = {}


def test_each_documented_cut_bug_is_seen(live):
    """Each bug docs/mixle.md names is provoked by one of the cases above, on mixle 0.8.2."""
    for case in CASES:
        if case not in EXPECTED_BUGS:
            test_cuts_equal_mixle_or_show_a_documented_mixle_bug(live, *case)
    seen = set().union(*EXPECTED_BUGS.values())
    assert {
        "empty shards dropped, cuts on the wrong devices",
        "min_components_per_shard not honoured",
        "cuts ignore device memory",
    } <= seen


def test_data_parallel_preference_agrees(live):
    """Both keep a model that fits replicated when the data dominates (mixle: memory unknown fits)."""
    resources = _resources((1.0, 1.0, 1.0, 1.0))
    for name in ("diag_mixture", "hmm", "composite"):
        ours, theirs = decompose_model(live[name], resources), md.decompose_model(live[name], resources)
        assert (ours.axis.value, ours.cuts) == (theirs.axis.value, ()) == ("none", ())


# -- one EM iteration --------------------------------------------------------------------------


def _record(obs) -> np.ndarray:
    if isinstance(obs, tuple):
        return np.concatenate([_record(x) for x in obs])
    return np.atleast_1d(np.asarray(obs, dtype=np.float64)).ravel()


def _mle_estimator(model):
    """mixle's estimator for ``model``, with the full-covariance ridge off: mixle's
    MultivariateGaussianEstimator adds ridge * cov_ii (ridge 1e-6) to each variance by default, and
    1e-8 when the ridge is 0 unless min_covar is given (multivariate_gaussian.py,
    _regularized_covar_and_ridge); min_covar must be positive, so 1e-300 leaves the maximum likelihood."""
    from mixle.stats.combinator.composite import CompositeEstimator
    from mixle.stats.latent.mixture import MixtureEstimator
    from mixle.stats.multivariate.multivariate_gaussian import MultivariateGaussianEstimator

    cls = type(model).__name__
    if cls == "MultivariateGaussianDistribution":
        return MultivariateGaussianEstimator(dim=model.dim, ridge=0.0, min_covar=1e-300)
    if cls == "MixtureDistribution":
        return MixtureEstimator([_mle_estimator(c) for c in model.components])
    if cls == "CompositeDistribution":
        return CompositeEstimator(tuple(_mle_estimator(d) for d in model.dists))
    return model.estimator()


EM_MODELS = ["diag_mixture", "full_mixture", "composite", "categorical_mixture", "nested", "hmm"]


@pytest.mark.parametrize("name", EM_MODELS)
def test_one_em_iteration_equals_mixles(live, name):
    from mixle.stats.compute.sequence import seq_encode, seq_estimate

    model = live[name]
    spec_model = from_mixle(model)
    if name == "hmm":  # mixle's sampler needs a length distribution; sequences of 20 steps drawn by ours
        seq_len = 20
        tree = em_model.build_tree(spec_model, seq_len)
        rows = em_model.sample(tree, em_model.initial_params(tree, np.zeros((1, seq_len)), 0), 150, 3)
        observations = [list(r) for r in rows]
    else:
        seq_len = None
        observations = model.sampler(seed=11).sample(300)
        rows = np.stack([_record(o) for o in observations])
    with warnings.catch_warnings():  # mixle warns about small components after one iteration
        warnings.simplefilter("ignore")
        updated = seq_estimate(seq_encode(observations, model=model), _mle_estimator(model), model)
    tree = em_model.build_tree(spec_model, seq_len)
    ours, _, _ = em_model.reference_fit(tree, rows, 1, seed=0, micro_batch_size=64)
    theirs = em_model.initial_params(em_model.build_tree(from_mixle(updated), seq_len), rows, 0)
    start = em_model.initial_params(tree, rows, 0)
    assert ours.keys() == theirs.keys()
    for node_id, arrays in ours.items():
        for key, value in arrays.items():
            expected = theirs[node_id][key]
            assert not np.array_equal(value, start[node_id][key]), (node_id, key)  # the iteration moved it
            np.testing.assert_allclose(value, expected, rtol=1e-9, atol=0, err_msg=f"{name}: {node_id} {key}")


def _length_rows(observations, seq_len: int) -> np.ndarray:
    """mixle's variable-length sequences as our records: the length, then seq_len steps (zero after it)."""
    rows = []
    width = max(np.size(v) for obs in observations for v in obs)
    for obs in observations:
        steps = np.zeros((seq_len, width))
        for t, value in enumerate(obs):
            steps[t] = np.atleast_1d(np.asarray(value, dtype=np.float64))
        rows.append(np.concatenate([[len(obs)], steps.ravel()]))
    return np.stack(rows)


LENGTH_MODELS = ["hmm_length", "sequence", "sequence_mixture"]


@pytest.mark.parametrize("name", LENGTH_MODELS)
def test_one_em_iteration_fits_lengths_and_sequences_as_mixle_does(live, name):
    """An hmm with a length distribution, a sequence and a mixture of sequences: variable-length
    sequences drawn by mixle's own sampler (an empty one and a one-step one added), one iteration
    of ours from the model's parameters against mixle's own update, every parameter (the length
    distributions' too) to 1e-9 relative."""
    from mixle.stats.compute.sequence import seq_encode, seq_estimate

    model = live[name]
    observations = list(model.sampler(seed=11).sample(300))
    observations += [[], observations[0][:1]]
    seq_len = max(len(o) for o in observations)
    rows = _length_rows(observations, seq_len)
    assert rows[:, 0].min() == 0 and rows[:, 0].max() == seq_len > 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        updated = seq_estimate(seq_encode(observations, model=model), model.estimator(), model)
    tree = em_model.build_tree(from_mixle(model), seq_len)
    assert any(n.id.endswith(".length") for n in tree.with_statistics())
    ours, lls, _ = em_model.reference_fit(tree, rows, 1, seed=0, micro_batch_size=64)
    theirs = em_model.initial_params(em_model.build_tree(from_mixle(updated), seq_len), rows, 0)
    start = em_model.initial_params(tree, rows, 0)
    # the log-likelihood of the starting model is mixle's too
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected_ll = sum(model.log_density(o) for o in observations)
    assert lls[0] == pytest.approx(expected_ll, rel=1e-12)
    assert ours.keys() == theirs.keys()
    for node_id, arrays in ours.items():
        for key, value in arrays.items():
            assert not np.array_equal(value, start[node_id][key]), (node_id, key)
            np.testing.assert_allclose(
                value, theirs[node_id][key], rtol=1e-9, atol=0, err_msg=f"{name}: {node_id} {key}"
            )


FITTED = [
    "categorical_mixture",
    "composite",
    "diag_mixture",
    "full_mixture",
    "hmm",
    "hmm_length",
    "nested",
    "sequence",
    "sequence_mixture",
    "shared_component",
]


@pytest.mark.parametrize("name", FITTED)
def test_unchanged_parameters_come_back_as_the_same_mixle_model(live, name):
    """mixle model -> ours -> its own parameters -> a mixle model (mixle's own loader) whose
    to_dict() is the original's, byte for byte: parameters and every cache mixle derives."""
    import json

    from mixle_compile import to_mixle, to_mixle_dict

    model = live[name]
    tree = em_model.build_tree(from_mixle(model), 4)
    params = em_model.initial_params(tree, np.ones((1, tree.width)), 0)  # the model's own values
    back = to_mixle(params, model)
    assert type(back) is type(model) and back is not model
    assert json.dumps(back.to_dict(), sort_keys=True) == json.dumps(model.to_dict(), sort_keys=True)
    assert to_mixle_dict(params, model) == model.to_dict()


def _assert_close_json(ours, theirs, where="$", rtol=1e-9):
    """Two to_dict() payloads alike but for floats, which agree to ``rtol`` (a fit's receipt ignored)."""
    import base64

    from mixle_compile.importers.mixle import TAG

    if isinstance(theirs, dict) and theirs.get(TAG) == "ndarray":
        assert ours.get(TAG) == "ndarray" and ours["shape"] == theirs["shape"] and ours["dtype"] == theirs["dtype"], (
            where
        )
        dtype = np.dtype(theirs["dtype"]["value"])
        a, b = (np.frombuffer(base64.b64decode(x["data"]), dtype=dtype) for x in (ours, theirs))
        np.testing.assert_allclose(a, b, rtol=rtol, atol=0, err_msg=where)
    elif isinstance(theirs, dict):
        keys = set(theirs) - {"fit_provenance", "numerical_repairs"}
        assert set(ours) - {"fit_provenance", "numerical_repairs"} == keys, where
        for k in keys:
            _assert_close_json(ours[k], theirs[k], f"{where}.{k}", rtol)
    elif isinstance(theirs, list) and len(theirs) == 2 and theirs[0] == "pmap":
        # mixle's CategoricalEstimator lists the categories in its own order; ours keeps the model's
        # (the same distribution: the pairs compared by category)
        pairs = [
            {p["items"][0]: p["items"][1] for p in (x[1]["items"] if isinstance(x[1], dict) else x[1])}
            for x in (ours, theirs)
        ]
        assert pairs[0].keys() == pairs[1].keys(), where
        for k in pairs[1]:
            assert pairs[0][k] == pytest.approx(pairs[1][k], rel=rtol, abs=0), f"{where}: category {k}"
    elif isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs), where
        for i, (x, y) in enumerate(zip(ours, theirs, strict=True)):
            _assert_close_json(x, y, f"{where}[{i}]", rtol)
    elif isinstance(theirs, float) and not isinstance(ours, bool):
        assert ours == pytest.approx(theirs, rel=rtol, abs=0), where
    else:
        assert ours == theirs, where


@pytest.mark.parametrize("name", ["diag_mixture", "composite", "categorical_mixture", "hmm_length", "sequence_mixture"])
def test_one_em_iteration_comes_back_as_mixles_own_updated_model(live, name):
    """Fitted by ours for one iteration and written back: the mixle model mixle's own EM update
    gives, every parameter and derived cache to 1e-9 relative."""
    from mixle.stats.compute.sequence import seq_encode, seq_estimate

    from mixle_compile import to_mixle

    model = live[name]
    observations = list(model.sampler(seed=11).sample(300))
    if name in LENGTH_MODELS:
        seq_len = max(len(o) for o in observations)
        rows = _length_rows(observations, seq_len)
    else:
        seq_len, rows = None, np.stack([_record(o) for o in observations])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        updated = seq_estimate(seq_encode(observations, model=model), model.estimator(), model)
    tree = em_model.build_tree(from_mixle(model), seq_len)
    ours, _, _ = em_model.reference_fit(tree, rows, 1, seed=0, micro_batch_size=300)
    back = to_mixle(ours, model)
    _assert_close_json(back.to_dict(), updated.to_dict())
    assert back.to_dict() != model.to_dict()  # the iteration moved it


def test_the_planning_example_in_docs_mixle_md_runs(capsys):
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "mixle.md").read_text(encoding="utf-8")
    (code,) = [
        block.split("```", 1)[0] for block in text.split("```python\n")[1:] if "mixle.utils.parallel.planner" in block
    ]
    namespace: dict = {}
    exec(compile(code, "docs/mixle.md", "exec"), namespace)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "880" and printed[1] == "model.root.factors[1]"
    assert namespace["plan"].is_model_parallel
    assert namespace["spec_model"]["root"]["factors"][1]["weights"] == [1 / 12] * 12


def test_one_iteration_of_mixle_compile_run_equals_mixles(live, tmp_path):
    """The distributed runtime itself: `run` on two data-parallel ranks, one iteration from the
    model's to_dict() JSON, against mixle's own update on the same records."""
    pytest.importorskip("torch")
    import json
    import os
    import subprocess

    from mixle.stats.compute.sequence import seq_encode, seq_estimate

    model = live["diag_mixture"]
    observations = model.sampler(seed=5).sample(300)
    np.save(tmp_path / "data.npy", np.stack(observations))
    (tmp_path / "model.json").write_text(json.dumps(model.to_dict()))
    (tmp_path / "spec.yaml").write_text(
        "model: {from: mixle, path: model.json}\n"
        "mesh: {dp_replicate: 2}\n"
        "training: {global_batch_size: 300, micro_batch_size: 150, precision: fp64, steps: 1}\n"
        "backend: torch\n"
        "resources: {devices: 2, kind: cpu, memory: 1GiB}\n"
    )
    env = {**os.environ, "PYTHONPATH": str(MODELS.parent.parent)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mixle_compile",
            "run",
            "spec.yaml",
            "--data",
            "data.npy",
            "--out",
            "fit",
            "--save-every",
            "1",
            "--quiet",
            "--mixle-out",
            "fitted.json",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "written to fitted.json as mixle's to_dict() JSON" in done.stdout
    step = tmp_path / "fit" / "checkpoints" / "step-00000001"
    arrays = json.loads((step / "manifest.json").read_text())["arrays"]
    fitted = {name: np.load(step / "state" / a["file"]) for name, a in arrays.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        updated = seq_estimate(seq_encode(observations, model=model), model.estimator(), model)
    expected = from_mixle(updated).root
    np.testing.assert_allclose(fitted["model.root/weights"][0], expected.weights, rtol=1e-9, atol=0)
    for k, comp in enumerate(expected.components):
        np.testing.assert_allclose(fitted[f"model.root.components[{k}]/means"][0], comp.mean, rtol=1e-9, atol=0)
        np.testing.assert_allclose(fitted[f"model.root.components[{k}]/covs"][0], comp.variance, rtol=1e-9, atol=0)
    assert not np.allclose(fitted["model.root/weights"][0], from_mixle(model).root.weights, rtol=1e-6)  # it moved
    # --mixle-out: the fitted model, loaded by mixle itself, is mixle's own updated model
    from mixle.stats.compute.pdist import ProbabilityDistribution

    back = ProbabilityDistribution.from_dict(json.loads((tmp_path / "fitted.json").read_text()))
    _assert_close_json(back.to_dict(), updated.to_dict())


def test_mixle_fits_a_shared_object_in_each_place_separately(live):
    """Why the reader warns about an object mixle holds twice: mixle's EM gives each place its own
    estimator, so after one iteration the places differ; ours fits the one shared node once."""
    from mixle.stats.compute.sequence import seq_encode, seq_estimate

    model = live["shared_component"]
    assert model.dists[0].components[0] is model.dists[1].components[0]
    observations = model.sampler(seed=11).sample(300)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        updated = seq_estimate(seq_encode(observations, model=model), model.estimator(), model)
    first, second = updated.dists[0].components[0], updated.dists[1].components[0]
    assert first is not second and not np.allclose(first.mu, second.mu)
    rows = np.stack([_record(o) for o in observations])
    tree = em_model.build_tree(from_mixle(model), None)
    ours, _, _ = em_model.reference_fit(tree, rows, 1, seed=0, micro_batch_size=300)
    assert ours["model.shared.background"]["means"].shape == (1, 2)  # one node, one fitted mean


def _doc_block(lang: str, needle: str) -> str:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "mixle.md").read_text(encoding="utf-8")
    (block,) = [b.split("```", 1)[0] for b in text.split(f"```{lang}\n")[1:] if needle in b.split("```", 1)[0]]
    return block


def test_the_fitting_walkthrough_in_docs_mixle_md_runs_as_written(tmp_path):
    """docs/mixle.md's script, run by the shell in an empty directory with `mixle-compile` and
    `python` on PATH (the docs command test skips it: it writes its own inputs), then its Python
    way back: the fitted model is mixle's, its weights those of the last checkpoint, and the
    documented `records` lays out mixle's sequences as the EM reads them."""
    import os
    import subprocess

    pytest.importorskip("torch")
    from mixle_compile.runtime.checkpoint import read_array_checkpoint

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, target in (("mixle-compile", f'"{sys.executable}" -m mixle_compile'), ("python", f'"{sys.executable}"')):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {target} "$@"\n')
        (bin_dir / name).chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "PYTHONPATH": str(MODELS.parent.parent),
    }
    done = subprocess.run(
        ["bash", "-e", "-c", _doc_block("sh", "--mixle-out")],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "MixtureDistribution [" in done.stdout
    namespace: dict = {}
    cwd = os.getcwd()
    os.chdir(work)
    try:
        exec(compile(_doc_block("python", "to_mixle_dict("), "docs/mixle.md", "exec"), namespace)
    finally:
        os.chdir(cwd)
    _, arrays = read_array_checkpoint(work / "fit" / "checkpoints" / "step-00000005")
    np.testing.assert_array_equal(namespace["fitted"].w, arrays["model.root/weights"][0])
    from mixle.stats.compute.pdist import ProbabilityDistribution

    last = ProbabilityDistribution.from_dict(namespace["payload"])
    assert last.to_dict() == json.loads((work / "fitted.json").read_text())
    exec(compile(_doc_block("python", "def records("), "docs/mixle.md", "exec"), namespace)
    observations = list(build_models()["hmm_length"].sampler(seed=2).sample(20)) + [[]]
    rows = namespace["records"](observations, max(len(o) for o in observations))
    np.testing.assert_array_equal(rows, _length_rows(observations, max(len(o) for o in observations)))


def test_a_length_from_one_is_told_to_start_from_zero():
    """An integer-categorical length from min_val=1 cannot be fitted as read (a length column holds
    the number of steps); the reader says so, and the length from 0 it suggests is mixle's same model."""
    import mixle.stats as S

    seq = S.SequenceDistribution(S.PoissonDistribution(2.0), S.IntegerCategoricalDistribution(1, [0.5, 0.5]))
    notes = []
    from_mixle(seq, warnings=notes)
    assert any(
        "model.root.length" in m and "fit it shifted by 1" in m and "IntegerCategoricalDistribution(0, [0.0] * 1" in h
        for m, h, _ in notes
    )
    same = S.SequenceDistribution(S.PoissonDistribution(2.0), S.IntegerCategoricalDistribution(0, [0.0, 0.5, 0.5]))
    notes = []
    from_mixle(same, warnings=notes)
    assert not any("min_val" in m for m, _, _ in notes)
    for obs in ([1.0], [0.0, 3.0]):
        assert same.log_density(obs) == pytest.approx(seq.log_density(obs), rel=1e-15)

"""mixle models read without mixle: the to_dict() JSON committed under tests/mixle_models/.

make_models.py wrote the JSON with mixle 0.8.2; tests/test_mixle_differential.py (which needs
mixle, the ``mixle`` extra) checks that the live models read alike and compares our planner and
EM with mixle's.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from mixle_compile.decompose import best_parallel_axis, decompose_model, size_model_tree, tree_axes
from mixle_compile.graph import build_model_graph
from mixle_compile.importers.mixle import mixle_model
from mixle_compile.mixle_models import UNBOUNDED_MEMORY, as_devices
from mixle_compile.runtime.em import model as em_model
from mixle_compile.spec.load import load_spec
from mixle_compile.spec.models import DistributionModel

MODELS = Path(__file__).parent / "mixle_models"
ROOT = Path(__file__).parent.parent
READABLE = [
    "big_mixture",
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


def _json(name: str):
    return json.loads((MODELS / f"{name}.json").read_text())


def _model(name: str) -> DistributionModel:
    read = mixle_model(_json(name))
    assert read.problems == []
    return DistributionModel.model_validate(read.model)


# ---------------------------------------------------------------------------
# The to_dict() reader (no mixle needed)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", READABLE)
def test_every_committed_model_reads(name):
    model = _model(name)
    assert build_model_graph(model).ok


def test_parameter_values_are_kept():
    comp = _model("composite").root
    gauss, cat, poisson, expo = comp.factors
    assert (gauss.type, gauss.dim, gauss.mean, gauss.variance) == ("gaussian", 1, [1.5], [2.0])
    assert cat.type == "categorical" and cat.num_values == 5 and abs(sum(cat.probs) - 1) < 1e-12
    assert (poisson.type, poisson.rate) == ("poisson", [3.5])
    assert expo.type == "exponential" and expo.rate == [pytest.approx(1 / 0.8, rel=1e-15)]  # mixle's beta is the scale
    hmm = _model("hmm").root
    assert hmm.type == "hmm" and hmm.num_states == 3 and hmm.initial == [0.5, 0.3, 0.2]
    assert len(hmm.transition) == 3 and all(abs(sum(r) - 1) < 1e-12 for r in hmm.transition)
    assert [e.mean for e in hmm.emissions] == [[-3.0], [0.0], [3.0]] and hmm.length is None
    full = _model("full_mixture").root
    assert full.components[0].covariance == "full" and len(full.components[0].covariance_matrix) == 3
    assert len(full.weights) == 4


def test_hmm_length_and_sequence_length_are_read():
    hmm = _model("hmm_length").root
    assert hmm.length is not None and (hmm.length.type, hmm.length.rate) == ("poisson", [12.0])
    seq = _model("sequence").root
    assert (seq.type, seq.base.type, seq.base.probs, seq.length.rate) == (
        "sequence",
        "categorical",
        [0.1, 0.2, 0.7],
        [5.0],
    )
    graph = build_model_graph(_model("hmm_length"))
    # the length is held whole: it is not a unit of the state axis
    assert [c.num_units for c in tree_axes(graph)] == [2]
    assert any(n.endswith(".length") for n in graph.order)


def test_an_object_mixle_holds_twice_is_one_shared_node():
    model = _model("shared_component")
    assert list(model.shared) == ["background"]
    assert model.root.factors[0].components[0].ref == "background" == model.root.factors[1].components[0].ref
    (warning,) = mixle_model(_json("shared_component")).warnings
    assert "in 2 places" in warning[0] and "fitted once, tied" in warning[0]
    graph = build_model_graph(model)
    # held once: two mixtures of two weights, two private and one shared diagonal gaussian of dim 2
    assert graph.node("model.shared.background").own_param_bytes == 8 * 4
    assert graph.node().subtree_param_bytes == 8 * (2 * 2 + 3 * 4)


def test_fp64_sizes_a_model_given_alone():
    graph = build_model_graph(_model("diag_mixture"))
    # 6 weights and 6 diagonal gaussians of dim 3 (mean and variance): float64 each
    assert graph.node().subtree_param_bytes == 8 * (6 + 6 * 2 * 3)
    assert build_model_graph(_model("diag_mixture"), precision="fp32").node().subtree_param_bytes == 4 * (6 + 36)


def test_a_class_the_spec_cannot_express_is_named_with_its_place():
    data = _json("refused_gamma")
    read = mixle_model(data)
    assert len(read.problems) == 1
    message, hint, path = read.problems[0]
    assert "mixle GammaDistribution cannot be expressed" in message and "model.root.components[1]" in message
    assert "MixtureDistribution" in hint
    # the path leads to the refused object's `type` in the JSON
    node = data
    for key in path[:-1]:
        node = node[key]
    assert node["type"].endswith("GammaDistribution") and path[-1] == "type"


@pytest.mark.parametrize(
    "payload, words",
    [
        ([1, 2], "expected a mixle distribution object"),
        ({"__pysp_type__": "ref", "id": "o9"}, "names no object"),
        ({"__pysp_type__": "object", "id": "o0", "type": "x.PoissonDistribution", "state": {}}, "tagged dict"),
        (
            {
                "__pysp_type__": "object",
                "id": "o0",
                "type": "x.PoissonDistribution",
                "state": {"__pysp_type__": "dict", "items": [["lam", "3"]]},
            },
            "`lam` must be a number",
        ),
        (
            {
                "__pysp_type__": "object",
                "id": "o0",
                "type": "x.DiagonalGaussianDistribution",
                "state": {
                    "__pysp_type__": "dict",
                    "items": [
                        [
                            "mu",
                            {
                                "__pysp_type__": "ndarray",
                                "dtype": {"kind": "str", "value": "<f8"},
                                "shape": [2],
                                "data": "AAAA",
                            },
                        ],
                        ["covar", [1.0, 1.0]],
                    ],
                },
            },
            "holds 3 bytes",
        ),
        (
            {
                "__pysp_type__": "object",
                "id": "o0",
                "type": "x.HiddenMarkovModelDistribution",
                "state": {"__pysp_type__": "dict", "items": [["taus", [[1.0]]]]},
            },
            "`taus`",
        ),
        (
            {
                "__pysp_type__": "object",
                "id": "o0",
                "type": "x.PoissonDistribution",
                "state": {"__pysp_type__": "dict", "items": [["lam", 2.0], ["keys", "k"]]},
            },
            "keyed parameter tying",
        ),
    ],
)
def test_malformed_payloads_are_problems_not_tracebacks(payload, words):
    read = mixle_model(payload)
    assert read.problems and words in read.problems[0][0]


def _spec(tmp_path: Path, model_file: str, precision: str = "fp64") -> Path:
    (tmp_path / "model.json").write_text((MODELS / f"{model_file}.json").read_text())
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        textwrap.dedent(f"""\
        model: {{from: mixle, path: model.json}}
        mesh: {{dp_replicate: 2}}
        training: {{global_batch_size: 512, micro_batch_size: 256, precision: {precision}, steps: 5}}
        backend: torch
        resources: {{devices: 2, kind: cpu, memory: 1GiB}}
        """)
    )
    return spec


def test_a_spec_reads_its_model_from_mixle_json(tmp_path):
    loaded = load_spec(_spec(tmp_path, "diag_mixture"))
    assert loaded.ok, loaded.diagnostics
    assert loaded.spec.model == _model("diag_mixture")
    assert loaded.document.origins[("model", "root")] == "model.json: mixle MixtureDistribution"


def test_warnings_reach_the_spec_with_their_place(tmp_path):
    loaded = load_spec(_spec(tmp_path, "shared_component"))
    assert loaded.ok
    (d,) = [d for d in loaded.diagnostics if d.code == "I003"]
    assert d.severity.value == "warning" and "model.json:" in d.message and "fitted once, tied" in d.message
    prior = {
        "__pysp_type__": "object",
        "id": "o0",
        "type": "x.PoissonDistribution",
        "state": {"__pysp_type__": "dict", "items": [["lam", 2.0], ["prior", {"__pysp_type__": "object"}]]},
    }
    read = mixle_model(prior)
    assert read.problems == [] and read.warnings == [] and "prior is ignored" in read.ignored[0][0]
    assert read.ignored[0][2] == ("state", "items", 1, 1)


def test_a_refused_mixle_model_is_bad_input_at_its_line(tmp_path):
    loaded = load_spec(_spec(tmp_path, "refused_gamma"))
    assert loaded.spec is None and loaded.unreadable
    (d,) = [d for d in loaded.diagnostics if d.code == "I004"]
    assert d.line == 1 and "GammaDistribution" in d.message
    text = (tmp_path / "model.json").read_text().splitlines()
    line, col = (int(x) for x in d.message.split(":", 3)[1:3])
    assert "GammaDistribution" in text[line - 1][col - 1 :]


def test_a_mixle_file_checked_alone_says_how_to_use_it():
    loaded = load_spec(MODELS / "hmm.json")
    assert loaded.unreadable and loaded.spec is None
    (d,) = loaded.diagnostics
    assert d.code == "I001" and "is a mixle model" in d.message and "model: {from: mixle, path: hmm.json}" in d.hint


def test_a_missing_mixle_file_is_named(tmp_path):
    spec = _spec(tmp_path, "hmm")
    (tmp_path / "model.json").unlink()
    loaded = load_spec(spec)
    assert loaded.unreadable and any("cannot read the mixle model model.json" in d.message for d in loaded.diagnostics)


def test_check_cli_exit_codes_for_mixle_models(tmp_path):
    def check(spec: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "mixle_compile", "check", str(spec)],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        )

    ok = check(_spec(tmp_path, "hmm"))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    (tmp_path / "bad").mkdir()
    bad = check(_spec(tmp_path / "bad", "refused_gamma"))
    assert bad.returncode == 2 and "I004" in bad.stdout + bad.stderr and "GammaDistribution" in bad.stdout + bad.stderr


def test_fp64_is_for_distribution_models_only(tmp_path):
    from mixle_compile.check import check_file

    text = (ROOT / "examples" / "tiny-transformer.yaml").read_text()
    assert "precision: fp32" in text
    neural = tmp_path / "neural.yaml"
    neural.write_text(text.replace("precision: fp32", "precision: fp64"))
    assert "C008" in {d.code for d in check_file(neural).diagnostics}
    fitted = check_file(_spec(tmp_path, "diag_mixture", precision="fp64"))
    assert fitted.errors == 0, fitted.diagnostics


@dataclasses.dataclass(frozen=True)
class _MixleStyleDevice:  # the attributes of mixle's DeviceSpec the planner reads
    name: str
    kind: str = "cpu"
    memory_bytes: int | None = None
    throughput: float = 1.0


@dataclasses.dataclass(frozen=True)
class _MixleStyleResources:
    devices: tuple


def test_planner_takes_a_model_and_mixle_style_devices():
    model = _model("nested")
    resources = _MixleStyleResources(
        tuple(_MixleStyleDevice(f"d{i}", memory_bytes=None if i else 10**6, throughput=1.0 + i) for i in range(3))
    )
    devices = as_devices(resources)
    assert [d.label for d in devices] == ["d0", "d1", "d2"] and devices[1].memory_bytes == UNBOUNDED_MEMORY
    best = best_parallel_axis(model, 3)
    assert (best.path, best.axis.value, best.num_units) == ("model.root.factors[1]", "component", 12)
    dec = decompose_model(model, resources, prefer_data_parallel=False)
    assert dec.is_model_parallel and [c.device.name for c in dec.cuts] == ["d0", "d1", "d2"]
    assert size_model_tree(model).subtree_param_bytes == build_model_graph(model).node().subtree_param_bytes


def test_em_starts_from_the_stated_parameters():
    model = _model("full_mixture")
    tree = em_model.build_tree(model, None)
    data = np.zeros((4, 3))
    params = em_model.initial_params(tree, data, seed=0)
    assert np.array_equal(params["model.root"]["weights"][0], model.root.weights)
    comp = model.root.components[2]
    assert np.array_equal(params["model.root.components[2]"]["means"][0], comp.mean)
    assert np.array_equal(params["model.root.components[2]"]["covs"][0], np.asarray(comp.covariance_matrix))


# ---------------------------------------------------------------------------
# The way back: fitted parameters into the model's to_dict() JSON (no mixle needed)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", [n for n in READABLE if n != "big_mixture"])
def test_the_models_own_parameters_write_back_its_own_json(name):
    from mixle_compile import to_mixle_dict

    tree = em_model.build_tree(_model(name), 4)
    params = em_model.initial_params(tree, np.ones((1, tree.width)), 0)  # the values the JSON states
    assert to_mixle_dict(params, MODELS / f"{name}.json") == _json(name)
    flat = {f"{node}/{key}": a for node, arrays in params.items() for key, a in arrays.items()}
    assert to_mixle_dict(flat, _json(name)) == _json(name)


def test_written_back_parameters_and_what_mixle_derives_from_them():
    import base64

    from mixle_compile import to_mixle_dict

    params = em_model.initial_params(em_model.build_tree(_model("composite"), None), np.ones((1, 4)), 0)
    params["model.root.factors[0]"] = {"means": np.array([[0.5]]), "covs": np.array([[4.0]])}
    params["model.root.factors[2]"]["rates"] = np.array([[2.0]])
    params["model.root.factors[3]"]["rates"] = np.array([[4.0]])
    out = to_mixle_dict(params, _json("composite"))
    states = [dict(o["state"]["items"]) for o in out["state"]["items"][0][1]["items"]]
    gauss, _, poisson, expo = states
    assert (gauss["mu"], gauss["sigma2"]) == (0.5, 4.0)
    assert gauss["log_const"] == pytest.approx(-0.5 * np.log(2 * np.pi * 4.0), rel=1e-15)
    assert gauss["const"] == pytest.approx(1 / np.sqrt(2 * np.pi * 4.0), rel=1e-15)
    assert (poisson["lam"], poisson["log_lambda"]) == (2.0, pytest.approx(np.log(2.0), rel=1e-15))
    assert (expo["beta"], expo["log_beta"]) == (0.25, pytest.approx(np.log(0.25), rel=1e-15))  # beta is the scale
    mixture = _json("diag_mixture")
    params = em_model.initial_params(em_model.build_tree(_model("diag_mixture"), None), np.ones((1, 3)), 0)
    params["model.root"]["weights"] = np.array([[0.5, 0.5, 0.0, 0.0, 0.0, 0.0]])
    root = dict(to_mixle_dict(params, mixture)["state"]["items"])
    decode = lambda a, dtype: np.frombuffer(base64.b64decode(a["data"]), dtype=dtype)  # noqa: E731
    np.testing.assert_array_equal(decode(root["zw"], bool), [False, False, True, True, True, True])
    np.testing.assert_array_equal(decode(root["log_w"], "<f8"), [np.log(0.5)] * 2 + [-np.inf] * 4)
    assert mixture == _json("diag_mixture")  # the model given is not changed


def test_parameters_of_another_model_are_refused_by_name(tmp_path):
    from mixle_compile import FittedParametersError, to_mixle_dict

    params = em_model.initial_params(em_model.build_tree(_model("diag_mixture"), None), np.ones((1, 3)), 0)
    with pytest.raises(
        FittedParametersError,
        match=r"missing model.root.factors\[0\]/covs.*; not in the model: model.root.components\[0\]/covs",
    ):
        to_mixle_dict(params, _json("composite"))
    params = em_model.initial_params(em_model.build_tree(_model("diag_mixture"), None), np.ones((1, 3)), 0)
    params["model.root"]["weights"] = np.ones((1, 5)) / 5
    with pytest.raises(FittedParametersError, match=r"model.root/weights has shape \[1, 5\], the model's is \[1, 6\]"):
        to_mixle_dict(params, _json("diag_mixture"))
    with pytest.raises(FittedParametersError, match="not fitted by EM"):
        to_mixle_dict({}, _json("big_mixture"))
    with pytest.raises(FittedParametersError, match="cannot read the mixle model"):
        to_mixle_dict({}, tmp_path / "absent.json")
    with pytest.raises(FittedParametersError, match="checkpoint"):
        to_mixle_dict(tmp_path, _json("diag_mixture"))


def test_run_mixle_out_needs_a_spec_reading_a_mixle_model(tmp_path):
    """`run --mixle-out` refuses, before any rank starts, a spec whose model is not read from mixle."""
    (tmp_path / "written.yaml").write_text(
        "model: {family: distribution, root: {type: mixture, component: {type: gaussian, dim: 2}, repeat: 2}}\n"
        "mesh: {dp_replicate: 1}\ntraining: {global_batch_size: 8, micro_batch_size: 8, precision: fp64, steps: 1}\n"
        "backend: torch\nresources: {devices: 1, kind: cpu, memory: 1GiB}\n"
    )
    for args, says in (
        (["written.yaml"], "written.yaml has a 'distribution' model written out"),
        (["absent.txt"], "absent.txt is not a spec file"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "mixle_compile", "run", *args, "--mixle-out", "out.json", "--quiet"],
            cwd=tmp_path,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, done.stdout + done.stderr
        assert (
            "PLAN must be a spec whose model is `{from: mixle, path: model.json}`" in done.stderr
            and says in done.stderr
        )
        assert not (tmp_path / "out.json").exists()

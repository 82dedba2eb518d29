"""mixle's models and devices in, this package's planner out.

* :func:`from_mixle` turns a live mixle model into the spec's distribution model, through the
  model's own ``to_dict()`` and the reader of :mod:`mixle_compile.importers.mixle` (the same one
  ``model: {from: mixle, path: model.json}`` uses), so a live model and its saved JSON read alike.
* :func:`as_model_graph` is what the planner's entry points (``size_model_tree``, ``tree_axes``,
  ``best_parallel_axis``, ``decompose_model``) call first: a :class:`~mixle_compile.graph.ModelGraph`
  passes through, a spec, a distribution model or a live mixle model is built into one (a model
  without its spec sized in fp64, as mixle holds it).
* :func:`as_devices` reads the devices: the spec's ``Resources``, a sequence of
  :class:`~mixle_compile.decompose.Device`, or mixle's ``Resources`` / ``DeviceSpec``
  (``mixle/utils/parallel/planner.py``) by their attributes, so mixle need not be imported.
* :func:`to_mixle_dict` is the way back: fitted parameters (what ``mixle-compile run`` saves for
  an EM model) written into the model they were fitted from, as mixle's ``to_dict()`` JSON;
  :func:`to_mixle` loads that JSON with mixle's own loader into a live model.

mixle is never imported here; a live model is recognised by its class's module (``mixle.``) and
its ``to_dict`` method.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from mixle_compile.spec.models import DistributionModel, Spec

# mixle's DeviceSpec.memory_bytes may be None ("not known"); its planner then never refuses a
# placement for memory (model_decomposition.decompose_model: `mem == 0 or ...`). Such a device is
# given a memory no model reaches, so a cut is never limited by it either.
UNBOUNDED_MEMORY = 1 << 62


class MixleModelError(ValueError):
    """A mixle model that the distribution spec cannot express; the message names class and place."""

    def __init__(self, problems: list[tuple[str, str, tuple]]):
        from mixle_compile.importers.mixle import json_path_text

        self.problems = problems
        lines = [
            f"{message} (at {json_path_text(path)} of its to_dict() JSON); {hint}" for message, hint, path in problems
        ]
        super().__init__("; ".join(lines) if lines else "the mixle model cannot be read")


def is_mixle_model(obj: Any) -> bool:
    """Whether ``obj`` is a live mixle model (an instance of a class from the ``mixle`` package with ``to_dict``)."""
    module = type(obj).__module__ or ""
    return (module == "mixle" or module.startswith("mixle.")) and callable(getattr(obj, "to_dict", None))


def from_mixle(model: Any, *, warnings: list | None = None) -> DistributionModel:
    """The spec's distribution model of a live mixle model, parameter values kept.

    Raises :class:`MixleModelError` naming the class and its place in ``model.to_dict()`` when
    the model holds something the spec cannot express. ``warnings``, when given, receives the
    ``(message, hint, json_path)`` of what was read but not kept (a prior, a categorical's labels).
    """
    if not is_mixle_model(model):
        raise TypeError(
            "from_mixle takes a mixle model (a mixle.stats distribution), got "
            f"{type(model).__module__}.{type(model).__qualname__}"
        )
    from mixle_compile.importers.mixle import mixle_model

    read = mixle_model(model.to_dict())
    if read.problems:
        raise MixleModelError(read.problems)
    if warnings is not None:
        warnings.extend(read.warnings + read.ignored)
    return DistributionModel.model_validate(read.model)


def as_model_graph(model: Any, *, precision: str = "fp64"):
    """A :class:`~mixle_compile.graph.ModelGraph` of ``model`` (see the module docstring)."""
    from mixle_compile.graph import ModelGraph, build_model_graph

    if isinstance(model, ModelGraph):
        return model
    if isinstance(model, Spec):
        return build_model_graph(model)
    if isinstance(model, DistributionModel):
        return build_model_graph(model, precision=precision)
    if is_mixle_model(model):
        return build_model_graph(from_mixle(model), precision=precision)
    raise TypeError(
        "the planner takes a ModelGraph (mixle_compile.graph.build_model_graph), a Spec, a distribution model "
        f"or a live mixle model, got {type(model).__module__}.{type(model).__qualname__}"
    )


def as_devices(resources: Any) -> tuple:
    """The devices of ``resources`` in rank order, as :class:`~mixle_compile.decompose.Device`."""
    from mixle_compile.decompose.devices import Device, devices_from_resources
    from mixle_compile.spec.models import Resources

    if isinstance(resources, Resources):
        return devices_from_resources(resources)
    items = getattr(resources, "devices", resources)  # mixle's Resources holds a tuple of DeviceSpec
    if not isinstance(items, Sequence) or isinstance(items, (str, bytes)):
        raise TypeError(
            "devices must be the spec's Resources, mixle's Resources or a sequence of devices, got "
            f"{type(resources).__qualname__}"
        )
    out = []
    for rank, d in enumerate(items):
        if isinstance(d, Device):
            out.append(d)
            continue
        if not hasattr(d, "throughput") or not hasattr(d, "memory_bytes"):
            raise TypeError(
                f"device {rank} ({type(d).__qualname__}) has no `throughput` and `memory_bytes`; give a "
                "mixle DeviceSpec or a Device"
            )
        memory = d.memory_bytes
        out.append(
            Device(
                rank=rank,
                kind=str(getattr(d, "kind", "gpu")),
                memory_bytes=UNBOUNDED_MEMORY if memory is None else int(memory),
                throughput=float(d.throughput),
                throughput_stated=True,
                name=getattr(d, "name", None),
            )
        )
    return tuple(out)


# -- the way back: fitted parameters as a mixle model ----------------------------------------


class FittedParametersError(ValueError):
    """Fitted parameters that do not fit the mixle model they are written into (the message says which)."""


def to_mixle_dict(fitted: Any, like: Any) -> dict:
    """mixle's ``to_dict()`` JSON of the model ``like`` with the parameters ``fitted``; mixle is not imported.

    ``like`` is the model the parameters were fitted from: its ``to_dict()`` JSON (a mapping, or the
    path of the file ``model: {from: mixle, path: ...}`` names), or the live mixle model. Everything
    but the parameters is kept as ``like`` holds it (classes, names, ``min_val``, the categories of
    a ``CategoricalDistribution``, priors, the objects mixle shares); the caches mixle derives from
    the parameters are recomputed as its constructors compute them (``GaussianDistribution``:
    ``log_const``, ``const``; ``DiagonalGaussianDistribution``: ``log_c``, ``ca``, ``cb``, ``cc``;
    ``IntegerCategoricalDistribution``: ``log_p_vec``; ``PoissonDistribution``: ``log_lambda``;
    ``ExponentialDistribution``: ``log_beta``; ``MixtureDistribution``: ``zw``, ``log_w``;
    ``HiddenMarkovModelDistribution``: ``log_w``, ``log_transitions``, in mixle/stats/), since
    mixle's loader (``mixle.utils.serialization._constructor_decode``) rebuilds each object through
    its constructor and refuses a state that differs from the rebuilt one. A fit's receipt
    (``fit_provenance``, ``numerical_repairs``) describes the fit ``like`` came from, not this one,
    and is dropped.

    ``fitted``: what ``mixle-compile run`` saves for an EM model (docs/checkpoints.md): a checkpoint
    (a ``step-NNNNNNNN`` directory, or a checkpoint directory for its latest complete step), its
    arrays as ``{"<node>/<name>": array}``, or ``{node: {name: array}}``; each array has one row per
    instance of its node. Raises :class:`FittedParametersError` naming the node when a parameter is
    missing, extra or of another shape, :class:`MixleModelError` when ``like`` cannot be read.
    """
    import copy
    import json
    from pathlib import Path

    import numpy as np

    from mixle_compile.importers.mixle import TAG, mixle_model
    from mixle_compile.runtime.em import model as em_model

    if is_mixle_model(like):
        template = like.to_dict()
    elif isinstance(like, (str, Path)):
        try:
            template = json.loads(Path(like).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise FittedParametersError(f"{like}: cannot read the mixle model's to_dict() JSON ({exc})") from None
    elif isinstance(like, dict):
        template = copy.deepcopy(like)
    else:
        raise TypeError(
            "to_mixle_dict takes the model as its to_dict() JSON, that file's path or a live mixle "
            f"model, got {type(like).__qualname__}"
        )
    read = mixle_model(template)
    if read.problems:
        raise MixleModelError(read.problems)
    model = DistributionModel.model_validate(read.model)
    try:
        tree = em_model.build_tree(model, 1)  # the parameters' shapes do not depend on the sequences' length
    except em_model.ModelError as exc:
        raise FittedParametersError(
            f"this model is not fitted by EM, so no parameters of it are fitted: {exc}"
        ) from None
    shapes = em_model.param_shapes(tree)
    params = _fitted_arrays(fitted)
    wanted = {f"{node}/{name}": shape for node, names in shapes.items() for name, shape in names.items()}
    missing = sorted(set(wanted) - set(params))
    extra = sorted(set(params) - set(wanted))
    wrong = [
        f"{name} has shape {list(np.shape(params[name]))}, the model's is {list(wanted[name])}"
        for name in sorted(set(wanted) & set(params))
        if tuple(np.shape(params[name])) != tuple(wanted[name])
    ]
    if missing or extra or wrong:
        told = (
            ([f"missing {', '.join(missing)}"] if missing else [])
            + ([f"not in the model: {', '.join(extra)}"] if extra else [])
            + wrong
        )
        raise FittedParametersError(
            "the fitted parameters are not of this model: "
            + "; ".join(told)
            + ". Give the model the fit started from (the JSON its spec's `model: {from: mixle, path}` names)"
        )
    for name, a in params.items():
        if not np.all(np.isfinite(np.asarray(a, dtype=np.float64))):
            raise FittedParametersError(f"the fitted {name} holds non-finite values")

    def obj_at(path: tuple) -> dict:
        value = template
        for part in path:
            value = value[part]
        return value

    for node_id, cls in read.classes.items():
        names = shapes.get(node_id)
        if not names:
            continue
        values = {name: np.asarray(params[f"{node_id}/{name}"], dtype=np.float64)[0] for name in names}
        obj = obj_at(read.objects[node_id])
        obj.pop("fit_provenance", None)
        obj.pop("numerical_repairs", None)
        _write_state(obj, cls, values, TAG)
    return template


def to_mixle(fitted: Any, like: Any):
    """The live mixle model of :func:`to_mixle_dict`, built by mixle's own loader
    (``ProbabilityDistribution.from_dict``, mixle/stats/compute/pdist.py); needs mixle installed."""
    try:
        from mixle.stats.compute.pdist import ProbabilityDistribution
    except ImportError:
        raise ImportError(
            "to_mixle builds a live mixle model and needs mixle (pip install 'mixle-compile[mixle]'); "
            "to_mixle_dict writes its to_dict() JSON without it"
        ) from None
    return ProbabilityDistribution.from_dict(to_mixle_dict(fitted, like))


def _fitted_arrays(fitted: Any) -> dict:
    """``{"<node>/<name>": array}`` of a checkpoint path, a flat mapping or a nested one."""
    from pathlib import Path

    if isinstance(fitted, (str, Path)):
        from mixle_compile.runtime.checkpoint import CheckpointError, read_array_checkpoint

        try:
            manifest, arrays = read_array_checkpoint(fitted)
        except CheckpointError as exc:
            raise FittedParametersError(str(exc)) from None
        if manifest.get("runtime") != "em":
            raise FittedParametersError(
                f"checkpoint {fitted} holds {manifest.get('runtime') or manifest.get('kind')!r} state, not an EM fit "
                "of a distribution model"
            )
        return dict(arrays)
    if not isinstance(fitted, dict):
        raise TypeError(
            f"the fitted parameters must be a checkpoint path or a mapping of arrays, got {type(fitted).__qualname__}"
        )
    if all(isinstance(v, dict) for v in fitted.values()):
        return {f"{node}/{name}": a for node, arrays in fitted.items() for name, a in arrays.items()}
    return dict(fitted)


def _write_state(obj: dict, cls: str, values: dict, tag: str) -> None:
    """Rewrite the parameters of one mixle object's state, and what its constructor derives from them."""
    import numpy as np

    items = obj["state"]["items"]
    index = {pair[0]: i for i, pair in enumerate(items)}

    def put(name: str, value) -> None:
        if name not in index:
            raise FittedParametersError(
                f"mixle {cls} state has no `{name}`; give the JSON exactly as `model.to_dict()` returns it"
            )
        items[index[name]][1] = _encode(value, items[index[name]][1], tag)

    with np.errstate(divide="ignore"):
        if cls == "GaussianDistribution":  # univariate/continuous/gaussian.py, __setattr__ of sigma2
            mu, sigma2 = float(values["means"][0]), float(values["covs"][0])
            put("mu", mu)
            put("sigma2", sigma2)
            put("log_const", -0.5 * math.log(2.0 * math.pi * sigma2))
            put("const", 1.0 / math.sqrt(2.0 * math.pi * sigma2))
        elif cls == "DiagonalGaussianDistribution":  # multivariate/diagonal_gaussian.py, __init__
            mu, covar = values["means"].copy(), values["covs"].copy()
            log_c = -0.5 * (np.log(2.0 * np.pi) * len(mu) + np.log(covar).sum())
            put("mu", mu)
            put("covar", covar)
            put("log_c", log_c)
            put("ca", -0.5 / covar)
            put("cb", mu / covar)
            put("cc", (-0.5 * mu * mu / covar).sum() + log_c)
        elif cls == "MultivariateGaussianDistribution":  # its __pysp_setstate__ recomputes the rest
            put("mu", values["means"].copy())
            put("covar", values["covs"].copy())
        elif cls == "IntegerCategoricalDistribution":  # univariate/discrete/integer_categorical.py
            p = values["probs"].copy()
            put("p_vec", p)
            put("log_p_vec", np.log(p))
        elif cls == "CategoricalDistribution":  # its __pysp_setstate__ keeps the pairs' order
            pmap = items[index["pmap"]][1]
            pairs = pmap["items"] if isinstance(pmap, dict) and pmap.get(tag) in ("list", "tuple", "dict") else pmap
            kvs = [pair["items"] if isinstance(pair, dict) and pair.get(tag) == "tuple" else pair for pair in pairs]
            keys = [kv[0] for kv in kvs]
            by_key = all(isinstance(k, int) and not isinstance(k, bool) for k in keys) and sorted(keys) == list(
                range(len(keys))
            )
            # The reader's order (importers/mixle.py): value k is key k when the keys are 0..n-1, else the i-th pair.
            for i, kv in enumerate(kvs):
                kv[1] = float(values["probs"][kv[0] if by_key else i])
        elif cls == "PoissonDistribution":  # univariate/discrete/poisson.py: math.log
            lam = float(values["rates"][0])
            put("lam", lam)
            put("log_lambda", math.log(lam))
        elif cls == "ExponentialDistribution":  # univariate/continuous/exponential.py: beta is the scale
            beta = float(1.0 / values["rates"][0])
            put("beta", beta)
            put("log_beta", np.log(beta))
        elif cls == "MixtureDistribution":  # latent/mixture.py, __init__
            w = values["weights"].copy()
            zw = w == 0.0
            log_w = np.log(w + zw)
            log_w[zw] = -np.inf
            put("w", w)
            put("zw", zw)
            put("log_w", log_w)
        elif cls == "HiddenMarkovModelDistribution":  # latent/hidden_markov.py, __init__
            w, transitions = values["initial"].copy(), values["transition"].copy()
            put("w", w)
            put("transitions", transitions)
            put("log_w", np.log(w))
            put("log_transitions", np.log(transitions))
        else:
            raise FittedParametersError(f"mixle {cls} holds parameters this package does not write back")


def _encode(value, old, tag: str):
    """``value`` in mixle's tagged JSON, shaped like the value it replaces (an ndarray keeps its dtype)."""
    import base64

    import numpy as np

    if isinstance(old, dict) and old.get(tag) == "ndarray":
        code = old["dtype"]["value"] if isinstance(old.get("dtype"), dict) else old.get("dtype")
        a = np.ascontiguousarray(value, dtype=np.dtype(code))
        return {**old, "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode("ascii")}
    number = float(value)
    if not math.isfinite(number):
        return {tag: "float", "value": "nan" if math.isnan(number) else ("inf" if number > 0 else "-inf")}
    return number

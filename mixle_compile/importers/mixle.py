"""A mixle model as a distribution model: its ``to_dict()`` JSON read without importing mixle.

mixle serialises a model with ``mixle.utils.serialization.to_serializable`` (what
``SequenceEncodableProbabilityDistribution.to_dict()`` returns): every value is tagged with
``__pysp_type__``; a model object is ``{"__pysp_type__": "object", "id": "o3", "type":
"<module>.<Class>", "state": {"__pysp_type__": "dict", "items": [[name, value], ...]}}``, an array
is ``{"__pysp_type__": "ndarray", "dtype": {"kind": "str", "value": "<f8"}, "shape": [...],
"data": <base64 of the C-order bytes>}``, a non-finite float ``{"__pysp_type__": "float", "value":
"inf"}``, and an object met a second time is ``{"__pysp_type__": "ref", "id": "o3"}``
(``_encode_object`` memoises by identity). An object reached twice becomes a ``model.shared`` entry
used through ``{ref: NAME}`` wherever mixle shares it.

The classes read (mixle 0.8.2, files under ``mixle/stats/``), each with the spec node it becomes
and the attributes its constructor keeps:

- ``GaussianDistribution`` (univariate/continuous/gaussian.py) -> ``gaussian``, dim 1: ``mu``, ``sigma2`` (variance)
- ``DiagonalGaussianDistribution`` (multivariate/diagonal_gaussian.py) ->
  ``gaussian``, diag: ``mu``, ``covar`` (variances)
- ``MultivariateGaussianDistribution`` (multivariate/multivariate_gaussian.py) -> ``gaussian``, full: ``mu``, ``covar``
- ``IntegerCategoricalDistribution`` (univariate/discrete/integer_categorical.py) ->
  ``categorical``: ``p_vec`` (value ``min_val + i``)
- ``CategoricalDistribution`` (univariate/discrete/categorical.py) -> ``categorical``: ``pmap``
- ``PoissonDistribution`` (univariate/discrete/poisson.py) -> ``poisson``, dim 1: ``lam``
- ``ExponentialDistribution`` (univariate/continuous/exponential.py) ->
  ``exponential``, dim 1: ``beta`` is the scale: rate ``1/beta``
- ``MixtureDistribution`` (latent/mixture.py) -> ``mixture``: ``components``, ``w``
- ``CompositeDistribution`` (combinator/composite.py) -> ``composite``: ``dists``
- ``SequenceDistribution`` (combinator/sequence.py) ->
  ``sequence``: ``dist``, ``len_dist`` (none when ``null_len_dist``)
- ``HiddenMarkovModelDistribution`` (latent/hidden_markov.py) ->
  ``hmm``: ``topics``, ``w``, ``transitions``, ``len_dist``

Every other class, and a feature of these the spec cannot state (an HMM's ``taus`` topic
mixtures or terminal states, keyed parameter tying), is refused with the class and the place in
the JSON. A prior is read and ignored with a warning: EM fits maximum likelihood.
"""

from __future__ import annotations

import base64
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixle_compile.spec.source import SourceDocument

TAG = "__pysp_type__"
JsonPath = tuple[Any, ...]

# Dtypes an ndarray of parameters may carry (mixle fits in float64; integer arrays appear in tables).
_DTYPES = {"<f8": ("d", 8), "<f4": ("f", 4), "<i8": ("q", 8), "<i4": ("i", 4)}


@dataclass
class MixleModel:
    """The distribution model read from a mixle model's JSON, and what could not be read.

    ``problems`` (what cannot be expressed), ``warnings`` (a value read in a way to know about) and
    ``ignored`` (what is read and not kept) are ``(message, hint, json_path)``: the path indexes the
    JSON (keys and list positions), so a file's reader turns it into a line and column.
    """

    model: dict[str, Any]
    problems: list[tuple[str, str, JsonPath]] = field(default_factory=list)
    warnings: list[tuple[str, str, JsonPath]] = field(default_factory=list)
    ignored: list[tuple[str, str, JsonPath]] = field(default_factory=list)
    classes: dict[str, str] = field(default_factory=dict)  # spec node path -> mixle class
    objects: dict[str, JsonPath] = field(default_factory=dict)  # spec node path -> where its object is in the JSON


class _Unreadable(Exception):
    pass


def _short(type_id: Any) -> str:
    return type_id.rsplit(".", 1)[-1] if isinstance(type_id, str) else repr(type_id)


class _Reader:
    def __init__(self, data: Any):
        self.data = data
        self.out = MixleModel({"family": "distribution"})
        self.objects: dict[str, tuple[dict, JsonPath]] = {}
        self.refs: dict[str, int] = {}
        self.shared: dict[str, dict] = {}
        self.shared_names: dict[str, str] = {}
        self._index(data, ())

    # -- the tagged JSON ----------------------------------------------------------------------

    def _index(self, value: Any, path: JsonPath) -> None:
        """Every object by id, and how often each is reached again by a ``ref``."""
        stack = [(value, path)]
        while stack:
            v, p = stack.pop()
            if isinstance(v, dict):
                tag = v.get(TAG)
                if tag == "object" and isinstance(v.get("id"), str):
                    self.objects.setdefault(v["id"], (v, p))
                elif tag == "ref" and isinstance(v.get("id"), str):
                    self.refs[v["id"]] = self.refs.get(v["id"], 0) + 1
                if tag == "ndarray":
                    continue
                stack.extend((item, (*p, k)) for k, item in v.items())
            elif isinstance(v, list):
                stack.extend((item, (*p, i)) for i, item in enumerate(v))

    def problem(self, message: str, hint: str, path: JsonPath) -> None:
        self.out.problems.append((message, hint, path))
        raise _Unreadable

    def state(self, obj: dict, path: JsonPath, where: str) -> dict[str, tuple[Any, JsonPath]]:
        st = obj.get("state")
        if not (isinstance(st, dict) and st.get(TAG) == "dict" and isinstance(st.get("items"), list)):
            self.problem(
                f"{where}: a mixle object's `state` must be a tagged dict of its attributes",
                "give the JSON exactly as `model.to_dict()` returns it",
                (*path, "state"),
            )
        out: dict[str, tuple[Any, JsonPath]] = {}
        for i, pair in enumerate(st["items"]):
            if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str):
                out[pair[0]] = (pair[1], (*path, "state", "items", i, 1))
        return out

    def number(self, value: Any, path: JsonPath, where: str, name: str) -> float:
        if isinstance(value, dict) and value.get(TAG) == "float" and value.get("value") in ("nan", "inf", "-inf"):
            self.problem(f"{where}: `{name}` is {value['value']}", "fit the model to finite parameters first", path)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.problem(
                f"{where}: `{name}` must be a number", "give the JSON exactly as `model.to_dict()` returns it", path
            )
        return float(value)

    def array(self, value: Any, path: JsonPath, where: str, name: str) -> tuple[list[float], tuple[int, ...]]:
        """An ndarray's values (row-major) and shape; a plain list or number is read as well."""
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return [float(value)], ()
        if isinstance(value, list):
            flat: list[float] = []
            rows = [self.array(v, (*path, i), where, name) for i, v in enumerate(value)]
            for values, _ in rows:
                flat += values
            inner = rows[0][1] if rows else ()
            return flat, (len(value), *inner)
        if not (isinstance(value, dict) and value.get(TAG) == "ndarray"):
            self.problem(
                f"{where}: `{name}` must be an array", "give the JSON exactly as `model.to_dict()` returns it", path
            )
        dtype = value.get("dtype")
        code = dtype.get("value") if isinstance(dtype, dict) else dtype
        if code not in _DTYPES:
            self.problem(
                f"{where}: `{name}` has dtype {code!r}; parameters are read as float64 ('<f8')",
                "convert the model's parameters to float64",
                (*path, "dtype"),
            )
        shape = value.get("shape")
        if not (
            isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            self.problem(
                f"{where}: `{name}` has no valid `shape`",
                "give the JSON exactly as `model.to_dict()` returns it",
                (*path, "shape"),
            )
        fmt, size = _DTYPES[code]
        try:
            raw = base64.b64decode(str(value.get("data", "")).encode("ascii"), validate=True)
        except (ValueError, UnicodeEncodeError):
            self.problem(
                f"{where}: `{name}` data is not base64",
                "give the JSON exactly as `model.to_dict()` returns it",
                (*path, "data"),
            )
        count = math.prod(shape)
        if len(raw) != count * size:
            self.problem(
                f"{where}: `{name}` holds {len(raw)} bytes, but shape {shape} of {code} needs {count * size}",
                "give the JSON exactly as `model.to_dict()` returns it",
                (*path, "data"),
            )
        values = list(struct.unpack(f"<{count}{fmt}", raw))
        if not all(math.isfinite(v) for v in values):
            self.problem(f"{where}: `{name}` holds non-finite values", "fit the model to finite parameters first", path)
        return [float(v) for v in values], tuple(shape)

    def items(self, value: Any, path: JsonPath, where: str, name: str) -> list[tuple[Any, JsonPath]]:
        """A list or tagged tuple of child objects."""
        if isinstance(value, dict) and value.get(TAG) == "tuple" and isinstance(value.get("items"), list):
            return [(v, (*path, "items", i)) for i, v in enumerate(value["items"])]
        if isinstance(value, list):
            return [(v, (*path, i)) for i, v in enumerate(value)]
        self.problem(
            f"{where}: `{name}` must be a list of distributions",
            "give the JSON exactly as `model.to_dict()` returns it",
            path,
        )

    # -- the model ------------------------------------------------------------------------------

    def node(self, value: Any, path: JsonPath, where: str) -> dict:
        """The spec node of one mixle object (or ``{ref: NAME}`` for one mixle holds more than once)."""
        if isinstance(value, dict) and value.get(TAG) == "ref":
            rid = value.get("id")
            if rid not in self.objects:
                self.problem(
                    f"{where}: reference {rid!r} names no object of the JSON",
                    "give the JSON exactly as `model.to_dict()` returns it",
                    path,
                )
            obj, obj_path = self.objects[rid]
            return self._shared(rid, obj, obj_path, where)
        if not (isinstance(value, dict) and value.get(TAG) == "object"):
            self.problem(
                f"{where}: expected a mixle distribution object (`{TAG}: object`)",
                "give the JSON exactly as `model.to_dict()` returns it",
                path,
            )
        rid = value.get("id")
        if isinstance(rid, str) and self.refs.get(rid):
            return self._shared(rid, value, path, where)
        return self._convert(value, path, where)

    def _shared(self, rid: str, obj: dict, path: JsonPath, where: str) -> dict:
        if rid not in self.shared_names:
            st = obj.get("state")
            label = None
            if isinstance(st, dict) and isinstance(st.get("items"), list):
                label = next(
                    (p[1] for p in st["items"] if isinstance(p, list) and len(p) == 2 and p[0] == "name"), None
                )
            name = label if isinstance(label, str) and label and label not in self.shared_names.values() else rid
            self.shared_names[rid] = name
            self.out.warnings.append(
                (
                    f"{where}: mixle holds this {_short(obj.get('type'))} in {self.refs[rid] + 1} places; "
                    "it is read as one "
                    f"shared node, model.shared.{name}, sized once (as mixle's planner sizes it) and "
                    "fitted once, tied; "
                    "mixle's own EM fits each place separately unless their estimators share `keys`",
                    "to fit each place on its own, give mixle a copy of the object in each place",
                    path,
                )
            )
            self.shared[name] = self._convert(obj, path, f"model.shared.{name}")
        return {"ref": self.shared_names[rid]}

    def _convert(self, obj: dict, path: JsonPath, where: str) -> dict:
        tid = obj.get("type")
        cls = _short(tid)
        st = self.state(obj, path, where)
        self.out.classes[where] = cls
        self.out.objects[where] = path
        here = f"{where} ({cls})"

        def get(name: str) -> tuple[Any, JsonPath]:
            if name not in st:
                self.problem(
                    f"{here}: the state has no `{name}`",
                    "give the JSON exactly as `model.to_dict()` returns it",
                    (*path, "state"),
                )
            return st[name]

        def absent(name: str) -> bool:
            return name not in st or st[name][0] is None

        if not absent("prior") or st.get("has_conj_prior", (False,))[0] is True:
            self.out.ignored.append(
                (
                    f"{here}: its prior is ignored: EM fits maximum likelihood",
                    "fit without the prior to compare",
                    st.get("prior", (None, path))[1],
                )
            )
        if not absent("keys"):
            self.problem(
                f"{here}: keyed parameter tying (`keys` = {st['keys'][0]!r}) cannot be expressed",
                "share the object itself (mixle then holds it once; it becomes a model.shared entry) or drop the keys",
                st["keys"][1],
            )
        name = st.get("name", (None,))[0]
        node: dict[str, Any] = {}
        if isinstance(name, str) and name:
            node["name"] = name

        if cls == "GaussianDistribution":
            mu, sigma2 = (self.number(*get(k), here, k) for k in ("mu", "sigma2"))
            if not sigma2 > 0:
                self.problem(
                    f"{here}: `sigma2` is {sigma2}; a variance must be positive",
                    "fit the model first",
                    get("sigma2")[1],
                )
            node.update(type="gaussian", dim=1, covariance="diag", mean=[mu], variance=[sigma2])
        elif cls == "DiagonalGaussianDistribution":
            mu, mshape = self.array(*get("mu"), here, "mu")
            var, _ = self.array(*get("covar"), here, "covar")
            if len(var) != len(mu) or len(mshape) > 1:
                self.problem(
                    f"{here}: `mu` ({len(mu)}) and `covar` ({len(var)}) must be vectors of one length",
                    "fit the model first",
                    get("covar")[1],
                )
            node.update(type="gaussian", dim=len(mu), covariance="diag", mean=mu, variance=var)
        elif cls == "MultivariateGaussianDistribution":
            mu, _ = self.array(*get("mu"), here, "mu")
            cov, cshape = self.array(*get("covar"), here, "covar")
            d = len(mu)
            if cshape != (d, d):
                self.problem(
                    f"{here}: `covar` has shape {list(cshape)}, the mean {d} values",
                    "fit the model first",
                    get("covar")[1],
                )
            node.update(
                type="gaussian",
                dim=d,
                covariance="full",
                mean=mu,
                covariance_matrix=[cov[i * d : (i + 1) * d] for i in range(d)],
            )
        elif cls == "IntegerCategoricalDistribution":
            probs, _ = self.array(*get("p_vec"), here, "p_vec")
            low, low_path = get("min_val")
            if low != 0 and where.endswith(".length"):
                # A length column holds the number of steps itself (runtime/em/model.py), so it cannot be shifted.
                self.out.warnings.append(
                    (
                        f"{here}: a length distribution whose values start at min_val={low}: the spec's categorical "
                        f"reads a length L as value L (0..{len(probs) - 1}), so EM would fit it shifted by {low}",
                        f"give mixle the same length distribution from 0: IntegerCategoricalDistribution(0, "
                        f"[0.0] * {low} + list(p_vec))",
                        low_path,
                    )
                )
            elif low != 0:
                self.out.warnings.append(
                    (
                        f"{here}: its values start at min_val={low}; the spec's categorical reads value - "
                        f"{low} (0..{len(probs) - 1})",
                        f"subtract {low} from that column of the records to fit them",
                        low_path,
                    )
                )
            node.update(type="categorical", num_values=len(probs), probs=probs)
        elif cls == "CategoricalDistribution":
            pmap, pmap_path = get("pmap")
            pairs = (
                self.items(pmap, pmap_path, here, "pmap")
                if not (isinstance(pmap, dict) and pmap.get(TAG) == "dict")
                else [(p, (*pmap_path, "items", i)) for i, p in enumerate(pmap.get("items", []))]
            )
            keys, probs = [], []
            for pair, pair_path in pairs:
                kv = pair.get("items") if isinstance(pair, dict) and pair.get(TAG) == "tuple" else pair
                if not (isinstance(kv, list) and len(kv) == 2):
                    self.problem(
                        f"{here}: `pmap` entries must be (value, probability) pairs",
                        "give the JSON exactly as `model.to_dict()` returns it",
                        pair_path,
                    )
                keys.append(kv[0])
                probs.append(self.number(kv[1], pair_path, here, "pmap"))
            if all(isinstance(k, int) and not isinstance(k, bool) for k in keys) and sorted(keys) == list(
                range(len(keys))
            ):
                probs = [p for _, p in sorted(zip(keys, probs, strict=True))]
            else:
                shown = ", ".join(repr(k) for k in keys[:8]) + (", ..." if len(keys) > 8 else "")
                self.out.warnings.append(
                    (
                        f"{here}: its values are not 0..{len(keys) - 1}; the spec's categorical reads "
                        f"value i as the i-th of {shown}",
                        "encode that column of the records as the index of each value in this order",
                        pmap_path,
                    )
                )
            default = st.get("default_value", (0.0,))[0]
            if isinstance(default, (int, float)) and default > 0:
                self.out.ignored.append(
                    (
                        f"{here}: default_value={default} (probability of values outside pmap) is ignored",
                        "the spec's categorical has exactly num_values values",
                        st["default_value"][1],
                    )
                )
            total = sum(probs)
            if total > 0 and abs(total - 1.0) > 1e-6:
                self.problem(f"{here}: `pmap` sums to {total!r}, not 1", "normalise the probabilities", pmap_path)
            node.update(type="categorical", num_values=max(1, len(probs)), probs=probs)
        elif cls == "PoissonDistribution":
            lam = self.number(*get("lam"), here, "lam")
            node.update(type="poisson", dim=1, rate=[lam])
        elif cls == "ExponentialDistribution":
            beta = self.number(*get("beta"), here, "beta")
            if not beta > 0:
                self.problem(
                    f"{here}: `beta` is {beta}; the scale must be positive", "fit the model first", get("beta")[1]
                )
            node.update(type="exponential", dim=1, rate=[1.0 / beta])  # mixle: log f = -log(beta) - x/beta
        elif cls == "MixtureDistribution":
            comps = self.items(*get("components"), here, "components")
            w, _ = self.array(*get("w"), here, "w")
            node.update(
                type="mixture",
                components=[self.node(c, p, f"{where}.components[{i}]") for i, (c, p) in enumerate(comps)],
                weights=w,
            )
        elif cls == "CompositeDistribution":
            dists = self.items(*get("dists"), here, "dists")
            node.update(
                type="composite", factors=[self.node(c, p, f"{where}.factors[{i}]") for i, (c, p) in enumerate(dists)]
            )
        elif cls == "SequenceDistribution":
            node.update(type="sequence", base=self.node(*get("dist"), f"{where}.base"))
            if st.get("len_normalized", (False,))[0] is True:
                self.out.ignored.append(
                    (
                        f"{here}: len_normalized (the geometric-mean density) is ignored",
                        "the spec scores the plain density",
                        st["len_normalized"][1],
                    )
                )
            length = self._length(st, f"{where}.length")
            if length is not None:
                node["length"] = length
        elif cls == "HiddenMarkovModelDistribution":
            for feature, hint in (
                ("taus", "per-state mixtures over shared topics"),
                ("terminal_values", "terminal emitted values"),
                ("terminal_states", "terminal states"),
            ):
                if not absent(feature):
                    self.problem(
                        f"{here}: `{feature}` ({hint}) cannot be expressed by the spec's hmm",
                        "the spec's hmm has one emission per state and no terminal states",
                        st[feature][1],
                    )
            topics = self.items(*get("topics"), here, "topics")
            w, _ = self.array(*get("w"), here, "w")
            trans, tshape = self.array(*get("transitions"), here, "transitions")
            s = len(topics)
            if len(w) != s or tshape != (s, s):
                self.problem(
                    f"{here}: {s} emissions, {len(w)} initial probabilities and a {list(tshape)} "
                    "transition matrix do not agree",
                    "fit the model first",
                    get("transitions")[1],
                )
            node.update(
                type="hmm",
                num_states=s,
                emissions=[self.node(c, p, f"{where}.emissions[{i}]") for i, (c, p) in enumerate(topics)],
                initial=w,
                transition=[trans[i * s : (i + 1) * s] for i in range(s)],
            )
            length = self._length(st, f"{where}.length")
            if length is not None:
                node["length"] = length
        else:
            self.problem(
                f"{where}: mixle {cls} cannot be expressed by the distribution spec",
                "read are GaussianDistribution, DiagonalGaussianDistribution, MultivariateGaussianDistribution, "
                "CategoricalDistribution, IntegerCategoricalDistribution, PoissonDistribution, "
                "ExponentialDistribution, "
                "MixtureDistribution, CompositeDistribution, SequenceDistribution, HiddenMarkovModelDistribution",
                (*path, "type"),
            )
        return node

    def _length(self, st: dict, where: str) -> dict | None:
        value, path = st.get("len_dist", (None, ()))
        if value is None or st.get("null_len_dist", (False,))[0] is True:
            return None
        if isinstance(value, dict) and value.get(TAG) == "object" and _short(value.get("type")) == "NullDistribution":
            return None
        return self.node(value, path, where)


def mixle_model(data: Any) -> MixleModel:
    """Translate a mixle ``to_dict()`` payload; problems are returned, never raised.

    Reading stops at the first problem (one to fix before anything else is read); warnings
    collected until then are kept.
    """
    reader = _Reader(data)
    try:
        reader.out.model["root"] = reader.node(data, (), "model.root")
    except _Unreadable:
        pass
    except RecursionError:
        reader.out.problems.append(("the model nests too deeply to read", "flatten the model", ()))
    if reader.shared:
        reader.out.model["shared"] = reader.shared
    return reader.out


def read_mixle_document(path: str | Path, display: str | None = None) -> SourceDocument:
    from mixle_compile.importers.builder import read_json_document

    return read_json_document(
        path,
        display,
        "mixle model",
        "give the path of the JSON `model.to_dict()` returns (relative to the file that names it), "
        "written with `json.dump(model.to_dict(), f)`",
    )


def json_path_text(path: JsonPath) -> str:
    """``("state", "items", 0, 1)`` -> ``$.state.items[0][1]``."""
    out = "$"
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out

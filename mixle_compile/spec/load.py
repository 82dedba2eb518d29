"""Loading a spec: read with positions, validate the schema, check the spec's own consistency.

Entry point: :func:`load_spec`. It never raises for bad input; everything wrong with the file
comes back as diagnostics that carry file, line, column and dotted field paths.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from mixle_compile.diagnostics import Diagnostic, Severity
from mixle_compile.spec import codes
from mixle_compile.spec.models import (
    FAMILIES,
    HMM,
    NODE_TYPES,
    DistributionModel,
    Mixture,
    ModulesModel,
    Ref,
    Spec,
    TransformerModel,
    _backend_tag,
    _devices_tag,
    _family_tag,
    _node_tag,
    _show,
    auto_divisor,
    auto_resolves,
    is_auto,
)
from mixle_compile.spec.source import Path_, SourceDocument, SourceError, dotted, parse_source

#: How the engines spell some of our values (torch dtypes, Megatron flags, optimizer class names).
ENGINE_SPELLINGS = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
    "float8": "fp8",
    "e4m3": "fp8",
    "adam_w": "adamw",
}


def closest(value: str, choices, n: int = 1, cutoff: float = 0.5) -> list[str]:
    """The likeliest meant choices: one equal but for case (or an engine's spelling of it) first,
    then the closest by spelling, compared in lower case so that `BF16` means `bf16`, not `fp16`."""
    choices = [str(c) for c in choices]
    lowered = {c.lower(): c for c in choices}
    key = str(value).strip().lower()
    for candidate in (key, ENGINE_SPELLINGS.get(key), key.replace("-", "_")):
        if candidate is not None and candidate in lowered:
            return [lowered[candidate]]
    return [lowered[c] for c in difflib.get_close_matches(key, list(lowered), n=n, cutoff=cutoff)]


@dataclass
class LoadedSpec:
    """The outcome of loading one file: the spec when it is valid, and every diagnostic."""

    file: str
    spec: Spec | None
    document: SourceDocument | None
    diagnostics: list[Diagnostic] = field(default_factory=list)
    unreadable: bool = False
    # A spec whose only errors are an unresolvable `dp_shard: auto` (S012): not valid, but its
    # settings are whole, so the nearest valid plan can still be searched for from it.
    unresolved: Spec | None = None

    @property
    def ok(self) -> bool:
        return self.spec is not None and not any(d.severity is Severity.error for d in self.diagnostics)


def load_spec(
    path: str | Path, *, display_name: str | None = None, options: Any = None, default_backend: str | None = None
) -> LoadedSpec:
    """Load a spec file, or an engine config that an importer reads (see :mod:`mixle_compile.importers`).

    ``options`` (an :class:`~mixle_compile.importers.ImportOptions`) gives what an engine config may
    not say: the device count and memory, an HF config.json for the model. ``default_backend`` (a
    configuration's ``backend``) is the backend of a spec that names none.
    """
    from mixle_compile.importers import read_any

    name = display_name or str(path)
    try:
        doc, diags = read_any(path, name, options)
    except SourceError as exc:
        return LoadedSpec(name, None, None, list(exc.diagnostics), unreadable=exc.unreadable)
    _default_backend(doc, default_backend)
    return _validate(doc, diags, Path(path).parent)


def load_spec_text(
    text: str | bytes,
    name: str = "<string>",
    *,
    json_syntax: bool = False,
    base: Path | None = None,
    default_backend: str | None = None,
) -> LoadedSpec:
    """``base``: the folder a `model: {from: ...}` path is relative to (default: the working directory)."""
    raw = text.encode("utf-8") if isinstance(text, str) else text
    try:
        doc, diags = parse_source(raw, name, json_syntax=json_syntax)
    except SourceError as exc:
        return LoadedSpec(name, None, None, list(exc.diagnostics), unreadable=exc.unreadable)
    _default_backend(doc, default_backend)
    return _validate(doc, diags, base)


def _default_backend(doc: SourceDocument, backend: str | None) -> None:
    if backend is not None and isinstance(doc.data, dict) and "backend" not in doc.data:
        doc.data["backend"] = backend


def validate_document(doc: SourceDocument, diags: list[Diagnostic], base: Path | None = None) -> LoadedSpec:
    """Validate a document an importer built (its positions already point into the engine's file);
    ``base``: the folder a ``model: {from: hf, path: ...}`` is relative to."""
    return _validate(doc, list(diags), base)


def _validate(doc: SourceDocument, diags: list[Diagnostic], base: Path | None = None) -> LoadedSpec:
    data = doc.data
    if isinstance(data, dict) and isinstance(data.get("model"), dict) and "from" in data["model"]:
        try:
            _model_from_file(doc, diags, base or Path("."))
        except SourceError as exc:
            return LoadedSpec(doc.file, None, doc, diags + list(exc.diagnostics), unreadable=exc.unreadable)
    if data is None:
        diags.append(
            doc.diagnostic(
                codes.MISSING_FIELD.code,
                "the spec is empty",
                hint="a spec needs the sections model, mesh, training, backend and resources (see examples/)",
            )
        )
        return LoadedSpec(doc.file, None, doc, diags)
    if not isinstance(data, dict):
        diags.append(
            doc.diagnostic(
                codes.WRONG_TYPE.code,
                f"the spec must be a mapping of sections, got {_show(data)}",
                hint="start the file with `model:`, `mesh:`, `training:`, `backend:` and `resources:`",
            )
        )
        return LoadedSpec(doc.file, None, doc, diags)
    try:
        spec = Spec.model_validate(data)
    except ValidationError as exc:
        diags.extend(_schema_diagnostics(exc, doc))
        return LoadedSpec(doc.file, None, doc, _dedupe(diags))
    except RecursionError:
        diags.append(
            doc.diagnostic(codes.LIMITS.code, "the spec nests too deeply to validate", hint="flatten the structure")
        )
        return LoadedSpec(doc.file, None, doc, diags)
    diags.extend(consistency_diagnostics(spec, doc))
    errors = [d for d in diags if d.severity is Severity.error]
    if errors:
        only_auto = all(d.code == codes.AUTO_UNRESOLVABLE.code for d in errors)
        return LoadedSpec(doc.file, None, doc, _dedupe(diags), unresolved=spec if only_auto else None)
    return LoadedSpec(doc.file, spec, doc, diags)


def _model_from_file(doc: SourceDocument, diags: list[Diagnostic], base: Path) -> None:
    """``model: {from: hf | mixle, path: FILE}``: the model read from an HF config.json or a mixle
    model's ``to_dict()`` JSON (the path relative to the spec)."""
    from mixle_compile.spec.models import ModelFile

    ref = doc.data["model"]
    try:
        ModelFile.model_validate(ref)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        key = err["loc"][0] if err["loc"] else "from"
        what = (
            f"unknown key `model.{key}`"
            if err["type"] == "extra_forbidden"
            else (
                "`model.from` must be 'hf' (an HF config.json) or 'mixle' (a mixle model's to_dict() "
                "JSON) with `model.path` naming the file"
            )
        )
        raise SourceError(
            [
                doc.diagnostic(
                    codes.UNKNOWN_KEY.code if err["type"] == "extra_forbidden" else codes.INVALID_VALUE.code,
                    f"a model read from a file: {what}",
                    ("model", key),
                    hint="write `model: {from: hf, path: config.json}` or `model: {from: mixle, path: "
                    "model.json}` (the path relative to this spec)",
                )
            ]
        ) from exc
    target = base / ref["path"]
    at = ("model", "path")
    if ref["from"] == "mixle":
        _mixle_model(doc, diags, target, ref["path"], at)
        return
    from mixle_compile.importers.hf import hf_model, read_hf_document

    hf = hf_model(read_hf_document(target, ref["path"]))
    for message, hint, pos in hf.problems:
        diags.append(doc.diagnostic("I004", f"{ref['path']}:{pos.line}:{pos.column}: {message}", at, hint=hint))
    for key, pos in hf.ignored:
        diags.append(
            doc.diagnostic(
                "I002",
                f"{ref['path']}:{pos.line}:{pos.column}: `{key}` is ignored: the spec does not model it",
                at,
                hint="see docs/importers.md for the keys that are read",
                severity=Severity.warning,
            )
        )
    if hf.problems:
        # The model read is incomplete or does not mean what the file says: stop at the reasons
        # (the spec checks would only add that the fields left out are missing).
        raise SourceError([])
    pos = doc.position(at)
    doc.data["model"] = hf.model
    for field_name in hf.model:
        doc.values[("model", field_name)] = pos
        if field_name in hf.keys:
            doc.origins[("model", field_name)] = f"{ref['path']}: {hf.keys[field_name]}"


def _mixle_model(doc: SourceDocument, diags: list[Diagnostic], target: Path, display: str, at: tuple) -> None:
    """A mixle model's ``to_dict()`` JSON as the distribution model (mixle_compile/importers/mixle.py)."""
    from mixle_compile.importers.mixle import mixle_model, read_mixle_document

    source = read_mixle_document(target, display)
    read = mixle_model(source.data)
    for message, hint, path in read.problems:
        pos = source.position(path)
        diags.append(doc.diagnostic("I004", f"{display}:{pos.line}:{pos.column}: {message}", at, hint=hint))
    for code, notes in (("I003", read.warnings), ("I002", read.ignored)):
        for message, hint, path in notes:
            pos = source.position(path)
            diags.append(
                doc.diagnostic(
                    code, f"{display}:{pos.line}:{pos.column}: {message}", at, hint=hint, severity=Severity.warning
                )
            )
    if read.problems:
        raise SourceError([], unreadable=True)
    pos = doc.position(at)
    doc.data["model"] = read.model
    for field_name in read.model:
        doc.values[("model", field_name)] = pos
    doc.origins[("model", "root")] = f"{display}: mixle {read.classes.get('model.root', 'model')}"


def _dedupe(diags: list[Diagnostic]) -> list[Diagnostic]:
    seen: set = set()
    out = []
    for d in diags:
        key = (d.code, d.line, d.column, d.message)
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


# --------------------------------------------------------------------------- schema errors

_TYPE_WORDS = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "float_type": "a number",
    "float_parsing": "a number",
    "list_type": "a list",
    "tuple_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
}
_RANGE_WORDS = {
    "greater_than_equal": (">=", "ge"),
    "greater_than": (">", "gt"),
    "less_than_equal": ("<=", "le"),
    "less_than": ("<", "lt"),
}
_DISCRIMINATORS = {
    _family_tag.__name__: ("family", FAMILIES),
    _node_tag.__name__: ("type", NODE_TYPES),
    _devices_tag.__name__: (None, ()),
    _backend_tag.__name__: (None, ()),
}


# Past this many findings in one file a report stops helping; the rest are counted, not described.
MAX_SCHEMA_DIAGNOSTICS = 100


def _schema_diagnostics(exc: ValidationError, doc: SourceDocument) -> list[Diagnostic]:
    out: list[Diagnostic] = []
    seen_paths: set = set()
    errors = exc.errors(include_url=False)
    for number, err in enumerate(errors):
        if len(out) >= MAX_SCHEMA_DIAGNOSTICS:
            out.append(
                doc.diagnostic(
                    codes.LIMITS.code,
                    f"{len(errors) - number} more schema problems not shown (the first "
                    f"{MAX_SCHEMA_DIAGNOSTICS} are listed)",
                    hint="fix the problems above and check again",
                )
            )
            break
        path, value, complete = _data_path(doc.data, err["loc"])
        diag = _schema_diagnostic(err, path, value, complete, doc)
        # A union reports one error per member; the first one for a value is enough.
        key = (path, diag.code)
        if key in seen_paths:
            continue
        seen_paths.add(key)
        out.append(diag)
    return out


def _data_path(data: Any, loc: tuple) -> tuple[Path_, Any, bool]:
    """Map a pydantic error location onto the data, skipping union tags.

    Returns (path, value at path, whether the full location exists in the data).
    """
    path: list = []
    cur = data
    complete = True
    for part in loc:
        if isinstance(cur, dict) and isinstance(part, str) and part in cur:
            path.append(part)
            cur = cur[part]
        elif isinstance(cur, list) and isinstance(part, int) and 0 <= part < len(cur):
            path.append(part)
            cur = cur[part]
        else:
            complete = False
    # A missing key leaves `complete` False with the parent as the path; a union tag is skipped.
    return tuple(path), cur, complete


def _schema_diagnostic(err: dict, path: Path_, value: Any, complete: bool, doc: SourceDocument) -> Diagnostic:
    etype = err["type"]
    loc = err["loc"]
    where = dotted(path) or "the spec"
    if etype == "missing":
        missing = loc[-1]
        full = (*path, missing)
        if not path:
            return doc.diagnostic(
                codes.MISSING_FIELD.code,
                f"missing required section `{missing}`",
                (),
                hint=f"add a `{missing}:` section (see examples/)",
                extra_fields=(full,),
            )
        return doc.diagnostic(
            codes.MISSING_FIELD.code,
            f"missing required field `{dotted(full)}`",
            path,
            hint=f"add `{missing}:` to `{where}`",
            prefer_key=True,
            extra_fields=(full,),
        )
    if etype == "extra_forbidden":
        key = loc[-1]
        allowed = _allowed_keys(loc[:-1])
        close = closest(str(key), allowed, n=1, cutoff=0.5)
        parent = dotted(path[:-1]) or "the top level"
        hint = f"did you mean `{close[0]}`?" if close else ""
        if allowed:
            hint = (hint + " " if hint else "") + f"valid keys in {parent}: {', '.join(allowed)}"
        return doc.diagnostic(codes.UNKNOWN_KEY.code, f"unknown key `{dotted(path)}`", path, hint=hint, prefer_key=True)
    if etype in ("union_tag_not_found", "union_tag_invalid"):
        return _union_diagnostic(err, path, value, doc)
    if etype in _TYPE_WORDS:
        expected = _TYPE_WORDS[etype]
        hint = ""
        if isinstance(value, float) and value.is_integer() and "integer" in expected:
            hint = f"write {int(value)}"
        elif isinstance(value, str) and "integer" in expected and value.strip().lstrip("-").isdigit():
            hint = "remove the quotes"
        elif isinstance(value, bool) and "integer" in expected:
            hint = "write a number, not true/false"
        elif isinstance(value, str) and expected == "true or false":
            hint = "write true or false without quotes"
        return doc.diagnostic(
            codes.WRONG_TYPE.code, f"`{where}` must be {expected}, got {_show(value)}", path, hint=hint
        )
    if etype == "literal_error":
        choices = re.findall(r"'([^']*)'", err.get("ctx", {}).get("expected", ""))
        close = closest(str(value), choices, n=1, cutoff=0.4) if isinstance(value, str) else []
        hint = f"did you mean {close[0]!r}?" if close else f"use one of: {', '.join(choices)}"
        if not isinstance(value, str):
            return doc.diagnostic(
                codes.WRONG_TYPE.code,
                f"`{where}` must be one of {', '.join(choices)}, got {_show(value)}",
                path,
                hint=hint,
            )
        return doc.diagnostic(
            codes.INVALID_VALUE.code, f"`{where}` must be one of {', '.join(choices)}, got {value!r}", path, hint=hint
        )
    if etype in _RANGE_WORDS:
        op, key = _RANGE_WORDS[etype]
        bound = err.get("ctx", {}).get(key)
        return doc.diagnostic(
            codes.INVALID_VALUE.code,
            f"`{where}` must be {op} {bound}, got {value!r}",
            path,
            hint=f"use a value {op} {bound}",
        )
    if etype in ("too_short", "too_long", "string_too_short", "string_too_long"):
        ctx = err.get("ctx", {})
        if etype == "too_short":
            text = f"must have at least {ctx.get('min_length')} item(s)"
        elif etype == "too_long":
            text = f"must have at most {ctx.get('max_length')} items"
        elif etype == "string_too_short":
            text = "must not be empty"
        else:
            text = f"must be at most {ctx.get('max_length')} characters"
        return doc.diagnostic(codes.INVALID_VALUE.code, f"`{where}` {text}", path)
    message = str(err.get("msg", "invalid value"))
    message = re.sub(r"^(Value error|Assertion failed), ", "", message)
    if etype == "value_error" and message.startswith(("must", "cannot", "memory", "throughput")):
        message = f"`{where}` {message}" if message.startswith("must") else f"`{where}`: {message}"
    elif path:
        message = f"`{where}`: {message}"
    return doc.diagnostic(codes.INVALID_VALUE.code, message, path)


def _union_diagnostic(err: dict, path: Path_, value: Any, doc: SourceDocument) -> Diagnostic:
    where = dotted(path) or "the spec"
    discriminator = str(err.get("ctx", {}).get("discriminator", ""))
    key, choices = next(((k, c) for fn, (k, c) in _DISCRIMINATORS.items() if fn in discriminator), (None, ()))
    if key is None:
        if _backend_tag.__name__ in discriminator:
            expected = "a backend name (torch, torchtitan, megatron) or a mapping {name, version, entry}"
        else:
            expected = "an integer >= 1 (a device count) or a list of device groups"
        return doc.diagnostic(codes.WRONG_TYPE.code, f"`{where}` must be {expected}, got {_show(value)}", path)
    what = "a model" if key == "family" else "a distribution node"
    if not isinstance(value, dict):
        return doc.diagnostic(
            codes.WRONG_TYPE.code, f"`{where}` must be {what} (a mapping with `{key}:`), got {_show(value)}", path
        )
    if key == "type":
        choices = (*choices, "ref")
    tag = value.get(key)
    if tag is None:
        extra = " or a `{ref: NAME}`" if key == "type" else ""
        return doc.diagnostic(
            codes.MISSING_FIELD.code,
            f"`{where}` needs `{key}:` (one of {', '.join(c for c in choices if c != 'ref')}){extra}",
            path,
            hint=f"add `{key}:`",
            prefer_key=True,
            extra_fields=((*path, key),),
        )
    close = closest(str(tag), choices, n=1, cutoff=0.4)
    hint = f"did you mean {close[0]!r}?" if close else f"use one of: {', '.join(choices)}"
    return doc.diagnostic(
        codes.INVALID_VALUE.code if isinstance(tag, str) else codes.WRONG_TYPE.code,
        f"`{dotted((*path, key))}` must be one of {', '.join(c for c in choices if c != 'ref')}, got "
        f"{_show(tag) if not isinstance(tag, str) else repr(tag)}",
        (*path, key),
        hint=hint,
    )


def _allowed_keys(loc: tuple) -> list[str]:
    """The field names of the model that a pydantic location points into."""
    tp: Any = Spec
    for part in loc:
        tp = _step(tp, part)
        if tp is None:
            return []
    tp = _unwrap(tp)[0]
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return list(tp.model_fields)
    return []


def _unwrap(tp: Any) -> tuple[Any, tuple]:
    meta: tuple = ()
    while typing.get_origin(tp) is typing.Annotated:
        meta += tuple(tp.__metadata__)
        tp = tp.__origin__
    return tp, meta


def _step(tp: Any, part: Any) -> Any:
    tp, _ = _unwrap(tp)
    if isinstance(tp, str):
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        members = [m for m in typing.get_args(tp) if m is not type(None)]
        for member in members:
            _, meta = _unwrap(member)
            if any(getattr(m, "tag", None) == part for m in meta):
                return member
        if len(members) == 1:
            return _step(members[0], part)
        for member in members:  # Optional[Union[...]]: try each
            stepped = _step(member, part)
            if stepped is not None:
                return stepped
        return None
    if origin in (list, tuple) and isinstance(part, int):
        return typing.get_args(tp)[0]
    if origin is dict:
        return typing.get_args(tp)[1]
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        f = tp.model_fields.get(part)
        if f is None:
            return None
        ann = f.annotation
        return typing.Annotated[(ann, *f.metadata)] if f.metadata else ann
    return None


# --------------------------------------------------------------------------- consistency


def consistency_diagnostics(spec: Spec, doc: SourceDocument) -> list[Diagnostic]:
    """Checks of the spec against itself that a schema cannot express."""
    out: list[Diagnostic] = []
    out += _backend_diagnostics(spec, doc)
    out += _auto_diagnostics(spec, doc)
    out += _recompute_modules_diagnostics(spec, doc)
    out += _mtp_loss_diagnostics(spec, doc)
    model = spec.model
    if isinstance(model, TransformerModel):
        out += _transformer_diagnostics(model, spec, doc)
    elif isinstance(model, ModulesModel):
        out += _modules_diagnostics(model, doc)
    elif isinstance(model, DistributionModel):
        out += _distribution_diagnostics(model, doc)
    return out


def _backend_diagnostics(spec: Spec, doc: SourceDocument) -> list[Diagnostic]:
    from mixle_compile.contracts import available_training_backends
    from mixle_compile.engines import UnknownVersion, backend_name, engine_profile

    names = available_training_backends()
    name = backend_name(spec.backend)
    at = ("backend",) if isinstance(spec.backend, str) else ("backend", "name")
    if name not in names:
        close = closest(name, names, n=1, cutoff=0.4)
        hint = (f"did you mean {close[0]!r}? " if close else "") + f"registered backends: {', '.join(names)}"
        return [
            doc.diagnostic(
                codes.UNKNOWN_BACKEND.code, f"`backend` {name!r} is not a registered training backend", at, hint=hint
            )
        ]
    try:
        engine_profile(spec.backend)
    except UnknownVersion as exc:
        return [doc.diagnostic(codes.INVALID_VALUE.code, str(exc), ("backend", exc.field), hint=exc.hint)]
    return []


def _recompute_modules_diagnostics(spec: Spec, doc: SourceDocument) -> list[Diagnostic]:
    """``training.recompute_modules`` as Megatron-Core reads it (transformer_config.py ``__post_init__``:
    only under selective granularity; ``mla_up_proj`` only with multi-latent attention, a ValueError
    otherwise)."""
    from mixle_compile.engines import Engine, backend_name

    t, model = spec.training, spec.model
    modules = t.recompute_modules
    if not modules:
        return []
    at = ("training", "recompute_modules")
    out = []
    if len(set(modules)) != len(modules):
        repeated = next(m for m in modules if modules.count(m) > 1)
        out.append(
            doc.diagnostic(
                codes.INCONSISTENT.code,
                f"training.recompute_modules names {repeated!r} twice",
                at,
                hint="name each module once",
            )
        )
    if backend_name(spec.backend) != Engine.MEGATRON:
        out.append(
            doc.diagnostic(
                codes.INCONSISTENT.code,
                f"training.recompute_modules is Megatron-Core's setting; backend {backend_name(spec.backend)!r} "
                "does not read it",
                at,
                hint="remove it (selective checkpointing then recomputes what the engine chooses)",
                severity=Severity.warning,
            )
        )
    elif t.activation_checkpointing != "selective":
        out.append(
            doc.diagnostic(
                codes.INCONSISTENT.code,
                f"training.recompute_modules is read under selective checkpointing only, and "
                f"training.activation_checkpointing is {t.activation_checkpointing!r}",
                at,
                hint="set `activation_checkpointing: selective`, or remove recompute_modules",
                severity=Severity.warning,
                extra_fields=(("training", "activation_checkpointing"),),
            )
        )
    megatron_selective = backend_name(spec.backend) == Engine.MEGATRON and t.activation_checkpointing == "selective"
    if (
        megatron_selective
        and "mla_up_proj" in modules
        and not (isinstance(model, TransformerModel) and model.latent_attention)
    ):
        out.append(
            doc.diagnostic(
                codes.INCONSISTENT.code,
                "training.recompute_modules names 'mla_up_proj', but the model has no Multi-head Latent "
                "Attention (Megatron-Core raises 'mla_up_proj in recompute_modules is only supported with "
                "multi_latent_attention')",
                at,
                hint="remove 'mla_up_proj', or give the model kv_lora_rank",
            )
        )
    return out


def _mtp_loss_diagnostics(spec: Spec, doc: SourceDocument) -> list[Diagnostic]:
    """``training.mtp_loss_scaling_factor`` weighs the multi-token prediction loss: without
    multi-token prediction layers nothing reads it."""
    if spec.training.mtp_loss_scaling_factor is None:
        return []
    model = spec.model
    if isinstance(model, TransformerModel) and model.mtp_num_layers > 0:
        return []
    return [
        doc.diagnostic(
            codes.INCONSISTENT.code,
            "training.mtp_loss_scaling_factor is set, but the model has no multi-token prediction layers "
            "(model.mtp_num_layers), so there is no such loss to weigh",
            ("training", "mtp_loss_scaling_factor"),
            hint="remove mtp_loss_scaling_factor, or give the transformer mtp_num_layers",
            severity=Severity.warning,
        )
    ]


def _auto_diagnostics(spec: Spec, doc: SourceDocument) -> list[Diagnostic]:
    mesh = spec.mesh
    if not is_auto(mesh.dp_shard):
        return []
    others = auto_divisor(dp_replicate=mesh.dp_replicate, tp=mesh.tp, pp=mesh.pp, cp=mesh.cp)
    devices = spec.resources.device_count
    if auto_resolves(devices, others):
        return []
    lower = (devices // others) * others
    return [
        doc.diagnostic(
            codes.AUTO_UNRESOLVABLE.code,
            f"`mesh.dp_shard: auto` needs the {devices} devices to be a multiple of dp_replicate*tp*pp*cp = "
            f"{mesh.dp_replicate}*{mesh.tp}*{mesh.pp}*{mesh.cp} = {others}",
            ("mesh", "dp_shard"),
            hint=f"use {lower or others} or {lower + others} devices, or change tp/pp/cp/dp_replicate",
            extra_fields=(("resources", "devices"),),
        )
    ]


def _transformer_diagnostics(model: TransformerModel, spec: Spec, doc: SourceDocument) -> list[Diagnostic]:
    out = []
    if spec.training.seq_len is None:
        out.append(
            doc.diagnostic(
                codes.MISSING_FIELD.code,
                "missing required field `training.seq_len` (a transformer needs its sequence length)",
                ("training",),
                hint="add `seq_len:` to `training`",
                prefer_key=True,
                extra_fields=(("training", "seq_len"),),
            )
        )
    out.extend(_latent_attention_diagnostics(model, doc))
    if model.head_dim is None and not model.latent_attention and model.hidden_size % model.num_heads:
        out.append(
            doc.diagnostic(
                codes.INCONSISTENT.code,
                f"model.hidden_size={model.hidden_size} is not divisible by "
                f"model.num_heads={model.num_heads}, so the head size is undefined",
                ("model", "num_heads"),
                hint="set `model.head_dim` explicitly or choose num_heads dividing hidden_size",
                extra_fields=(("model", "hidden_size"),),
            )
        )
    if model.latent_attention:
        rotary, name, what = model.qk_rope_head_dim, "qk_rope_head_dim", "model.qk_rope_head_dim"
    elif model.head_dim is not None:
        rotary, name, what = model.head_dim, "head_dim", "model.head_dim"
    else:
        divides = model.hidden_size % model.num_heads == 0
        rotary = model.hidden_size // model.num_heads if divides else None
        name, what = "num_heads", "the head size hidden_size / num_heads"
    if model.position_embedding == "rope" and rotary is not None and rotary % 2:
        # every engine turns rotary features in pairs: HF's rotate_half, torchtitan's view_as_complex,
        # Megatron-Core's apply_rotary_pos_emb split a head's rotary features in halves
        out.append(
            doc.diagnostic(
                codes.INCONSISTENT.code,
                f"{what} is {rotary}, an odd number, but rotary position embeddings turn a head's features in pairs",
                ("model", name),
                hint="make it even" + ("" if name == "num_heads" else f", e.g. {rotary + 1}"),
                extra_fields=(("model", "position_embedding"),),
            )
        )
    kv = model.num_kv_heads
    if kv is not None and (kv > model.num_heads or model.num_heads % kv):
        out.append(
            doc.diagnostic(
                codes.INCONSISTENT.code,
                f"model.num_kv_heads={kv} must divide model.num_heads={model.num_heads} (each KV head "
                "serves a whole group of query heads)",
                ("model", "num_kv_heads"),
                hint="use a divisor of num_heads, e.g. " + ", ".join(str(d) for d in _divisors(model.num_heads)[-4:]),
                extra_fields=(("model", "num_heads"),),
            )
        )
    if model.num_experts > 0:
        if model.experts_per_token is None:
            out.append(
                doc.diagnostic(
                    codes.MISSING_FIELD.code,
                    "missing required field `model.experts_per_token` (a model with experts needs its top-k)",
                    ("model", "num_experts"),
                    hint="add `experts_per_token:` (e.g. 2)",
                    prefer_key=True,
                    extra_fields=(("model", "experts_per_token"),),
                )
            )
        elif model.moe_first_layer >= model.num_layers:
            out.append(
                doc.diagnostic(
                    codes.INCONSISTENT.code,
                    f"model.moe_first_layer={model.moe_first_layer} leaves no mixture-of-experts layer among "
                    f"the model's {model.num_layers} (layers 0 to {model.num_layers - 1})",
                    ("model", "moe_first_layer"),
                    hint=f"use a layer below {model.num_layers}, or num_experts: 0 for a dense model",
                    extra_fields=(("model", "num_layers"),),
                )
            )
        elif model.experts_per_token > model.num_experts:
            out.append(
                doc.diagnostic(
                    codes.INCONSISTENT.code,
                    f"model.experts_per_token={model.experts_per_token} exceeds model.num_experts={model.num_experts}",
                    ("model", "experts_per_token"),
                    hint=f"use at most {model.num_experts}",
                    extra_fields=(("model", "num_experts"),),
                )
            )
    elif expert_only := [
        f
        for f in (
            "experts_per_token",
            "moe_ffn_hidden_size",
            "expert_capacity_factor",
            "moe_shared_expert_hidden_size",
            "moe_first_layer",
        )
        if getattr(model, f) not in (None, 0)  # moe_first_layer's default is 0
    ]:
        field_name = expert_only[0]
        out.append(
            doc.diagnostic(
                codes.INCONSISTENT.code,
                f"model.{field_name} is set but model.num_experts is 0 (a dense model)",
                ("model", field_name),
                hint="set `num_experts` for a mixture-of-experts model, or remove the field",
            )
        )
    if model.moe_shared_expert_gate and model.moe_shared_expert_hidden_size is None:
        out.append(
            doc.diagnostic(
                codes.INCONSISTENT.code,
                "model.moe_shared_expert_gate is true but the model has no shared expert "
                "(model.moe_shared_expert_hidden_size is not set)",
                ("model", "moe_shared_expert_gate"),
                hint="set `moe_shared_expert_hidden_size`, or remove the gate",
            )
        )
    return out


_MLA_HEAD_FIELDS = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _latent_attention_diagnostics(model: TransformerModel, doc: SourceDocument) -> list[Diagnostic]:
    """Multi-head Latent Attention's fields: all of them with kv_lora_rank, none without it."""
    out = []
    if not model.latent_attention:
        stray = [f for f in ("q_lora_rank", *_MLA_HEAD_FIELDS) if getattr(model, f) is not None]
        if stray:
            out.append(
                doc.diagnostic(
                    codes.INCONSISTENT.code,
                    f"model.{stray[0]} is set but model.kv_lora_rank is not: it is a field of Multi-head Latent "
                    "Attention (MLA), which kv_lora_rank turns on",
                    ("model", stray[0]),
                    hint="set `kv_lora_rank` (and qk_nope_head_dim, qk_rope_head_dim, v_head_dim) for MLA, or "
                    "remove the field",
                )
            )
        return out
    for f in _MLA_HEAD_FIELDS:
        if getattr(model, f) is None:
            out.append(
                doc.diagnostic(
                    codes.MISSING_FIELD.code,
                    f"missing required field `model.{f}` (Multi-head Latent Attention, set by kv_lora_rank, needs "
                    "its head sizes)",
                    ("model", "kv_lora_rank"),
                    hint=f"add `{f}:` (DeepSeek-V3: qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128)",
                    prefer_key=True,
                    extra_fields=(("model", f),),
                )
            )
    if model.head_dim is not None:
        out.append(
            doc.diagnostic(
                codes.INCONSISTENT.code,
                "model.head_dim is set on a model with Multi-head Latent Attention (kv_lora_rank), whose head "
                "sizes are qk_nope_head_dim + qk_rope_head_dim for queries and keys and v_head_dim for values",
                ("model", "head_dim"),
                hint="remove `head_dim` (write the query/key size without rotary positions as `qk_nope_head_dim`)",
                extra_fields=(("model", "kv_lora_rank"),),
            )
        )
    if model.num_kv_heads is not None and model.num_kv_heads != model.num_heads:
        out.append(
            doc.diagnostic(
                codes.INCONSISTENT.code,
                f"model.num_kv_heads={model.num_kv_heads} differs from model.num_heads={model.num_heads}, but "
                "Multi-head Latent Attention (kv_lora_rank) projects a key and a value for every query head",
                ("model", "num_kv_heads"),
                hint="remove `num_kv_heads`",
                extra_fields=(("model", "kv_lora_rank"),),
            )
        )
    return out


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _modules_diagnostics(model: ModulesModel, doc: SourceDocument) -> list[Diagnostic]:
    out = []
    first_index: dict[str, int] = {}
    group_shape: dict[str, tuple[int, tuple]] = {}
    for i, p in enumerate(model.parameters):
        path = ("model", "parameters", i)
        if p.name in first_index:
            out.append(
                doc.diagnostic(
                    codes.DUPLICATE_KEY.code,
                    f"parameter name {p.name!r} is used twice (first at model.parameters[{first_index[p.name]}])",
                    (*path, "name"),
                    hint="give every parameter a unique name; tie weights with `shared_group`",
                )
            )
        else:
            first_index[p.name] = i
        if p.shared_group is not None:
            if p.shared_group in group_shape and group_shape[p.shared_group][1] != tuple(p.shape):
                j, shape = group_shape[p.shared_group]
                out.append(
                    doc.diagnostic(
                        codes.INCONSISTENT.code,
                        f"parameters tied in shared_group {p.shared_group!r} have different shapes: "
                        f"{list(shape)} (model.parameters[{j}]) and {list(p.shape)}",
                        (*path, "shape"),
                        hint="tied parameters are one tensor: give them the same shape",
                        extra_fields=(("model", "parameters", j, "shape"),),
                    )
                )
            group_shape.setdefault(p.shared_group, (i, tuple(p.shape)))
    experts = [(i, p) for i, p in enumerate(model.parameters) if p.role == "expert"]
    if experts:
        i0, p0 = experts[0]
        for i, p in experts[1:]:
            if p.shape[0] != p0.shape[0]:
                out.append(
                    doc.diagnostic(
                        codes.INCONSISTENT.code,
                        f"expert parameters disagree on the number of experts (their first dimension): "
                        f"{p0.shape[0]} ({p0.name}) and {p.shape[0]} ({p.name})",
                        ("model", "parameters", i, "shape"),
                        hint="the first dimension of every `role: expert` parameter indexes the experts",
                        extra_fields=(("model", "parameters", i0, "shape"),),
                    )
                )
    return out


def _distribution_diagnostics(model: DistributionModel, doc: SourceDocument) -> list[Diagnostic]:
    out: list[Diagnostic] = []
    shared = model.shared
    names = sorted(shared)
    edges: dict[str, list[str]] = {name: [] for name in names}

    def visit(node: Any, path: Path_, owner: str | None) -> None:
        if isinstance(node, Ref):
            if node.ref not in shared:
                close = closest(node.ref, names, n=1, cutoff=0.4)
                hint = f"did you mean {close[0]!r}? " if close else ""
                hint += f"defined in model.shared: {', '.join(names)}" if names else "define it under `model.shared`"
                out.append(
                    doc.diagnostic(
                        codes.UNKNOWN_REF.code,
                        f"`ref: {node.ref}` names no entry of model.shared",
                        (*path, "ref"),
                        hint=hint,
                    )
                )
            elif owner is not None:
                edges[owner].append(node.ref)
            return
        if isinstance(node, HMM) and node.transitions is not None:
            _check_transitions(node, path, resolve(node.transitions))
        for key, child in _children(node):
            visit(child, (*path, *key), owner)

    def resolve(node: Any) -> Any:
        seen = 0
        while isinstance(node, Ref) and node.ref in shared and seen <= len(shared):
            node, seen = shared[node.ref], seen + 1
        return node

    def _check_transitions(node: HMM, path: Path_, target: Any) -> None:
        if isinstance(target, Ref):
            return  # unknown ref: reported where the ref is
        if getattr(target, "type", None) != "transitions":
            out.append(
                doc.diagnostic(
                    codes.INCONSISTENT.code,
                    f"an hmm's `transitions` must be a `transitions` node, got a {getattr(target, 'type', '?')} node",
                    (*path, "transitions"),
                    hint="use {type: transitions, num_states: S} or a ref to one",
                )
            )
        elif target.num_states != node.num_states:
            out.append(
                doc.diagnostic(
                    codes.INCONSISTENT.code,
                    f"the hmm has num_states={node.num_states} but its transitions have num_states={target.num_states}",
                    (*path, "transitions"),
                    hint="an HMM's transition matrix is num_states x num_states: make them equal",
                    extra_fields=((*path, "num_states"),),
                )
            )

    visit(model.root, ("model", "root"), None)
    for name in names:
        visit(shared[name], ("model", "shared", name), name)
    for cycle_start, cycle in _cycles(edges):
        out.append(
            doc.diagnostic(
                codes.REF_CYCLE.code,
                "shared nodes refer to each other in a cycle: " + " -> ".join(cycle),
                ("model", "shared", cycle_start),
                hint="a node cannot contain itself; break the cycle by removing one of these refs",
                prefer_key=True,
            )
        )
    return out


def _children(node: Any) -> list[tuple[Path_, Any]]:
    out: list[tuple[Path_, Any]] = []
    if isinstance(node, Mixture):
        if node.components is not None:
            out += [(("components", i), c) for i, c in enumerate(node.components)]
        if node.component is not None:
            out.append((("component",), node.component))
    for attr in ("factors", "emissions"):
        for i, c in enumerate(getattr(node, attr, None) or []):
            out.append(((attr, i), c))
    for attr in ("emission", "transitions", "base", "length"):
        child = getattr(node, attr, None)
        if isinstance(child, BaseModel):
            out.append(((attr,), child))
    return out


def _cycles(edges: dict[str, list[str]]) -> list[tuple[str, list[str]]]:
    """Each elementary cycle reachable in the ref graph, reported once (iterative DFS)."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(edges, WHITE)
    found: list[tuple[str, list[str]]] = []
    reported: set[frozenset] = set()
    for start in sorted(edges):
        if colour[start] != WHITE:
            continue
        stack: list[tuple[str, int]] = [(start, 0)]
        trail: list[str] = [start]
        colour[start] = GREY
        while stack:
            name, i = stack[-1]
            targets = edges[name]
            if i < len(targets):
                stack[-1] = (name, i + 1)
                nxt = targets[i]
                if colour.get(nxt) == GREY:
                    cycle = trail[trail.index(nxt) :] + [nxt]
                    key = frozenset(cycle)
                    if key not in reported:
                        reported.add(key)
                        found.append((nxt, cycle))
                elif colour.get(nxt) == WHITE:
                    colour[nxt] = GREY
                    stack.append((nxt, 0))
                    trail.append(nxt)
            else:
                colour[name] = BLACK
                stack.pop()
                trail.pop()
    return found

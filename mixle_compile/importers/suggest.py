"""A suggested fix said in the engine's own keys, at their places in the file the user wrote.

``check --suggest`` finds the nearest valid plan as a change of spec fields
(:mod:`mixle_compile.verify.suggest`). For a file read by an importer, those fields are not what the
user edits: a torchtitan job TOML has ``[parallelism] tensor_parallel_degree``, a Megatron-LM launch
``--tensor-model-parallel-size``, a DeepSpeed JSON ``zero_optimization.stage``. Spec fields and
engine keys are not one to one (torchtitan's micro-batches are ``local_batch_size`` over
``pipeline_parallel_microbatch_size``; DeepSpeed's sharding is the ZeRO stage; Megatron's recompute is
a granularity and a method), so the translation is the exporters' (:mod:`mixle_compile.export`), which
already write every spec field as the engine's keys: the spec before and after the fix are both
written as the engine's config and the keys whose values differ are the fix. Each is placed where the
importer found that key in the user's file (``SourceDocument.engine_keys``), or said to be added.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass

from mixle_compile.spec.source import Position, SourceDocument

ENGINE_FORMATS = ("torchtitan", "torchtitan-python", "megatron", "deepspeed")
# Where the older torchtitan layouts keep a [parallelism] key (see importers/torchtitan.py).
_TT_TABLES = ("parallelism", "training", "experimental")
_TT_ALIASES = {"training.local_batch_size": ("training.batch_size",)}
# Keys whose default is another key's value: not written, they follow it (Megatron-LM's validate_args,
# megatron/training/arguments.py: expert_tensor_parallel_size defaults to tensor_model_parallel_size).
_FOLLOWS = {"megatron": {"--expert-tensor-parallel-size": "--tensor-model-parallel-size"}}
# Keys the exporter writes for the model's sizes, not the plan: the exporter keeps the spec's padded
# vocabulary with --make-vocab-size-divisible-by 1 when a new tp would pad it again; a fix never
# changes the model, so these are not part of it.
_MODEL_ONLY = {"megatron": {"--make-vocab-size-divisible-by"}}


@dataclass(frozen=True)
class EngineChange:
    key: str  # the engine's key: "parallelism.tensor_parallel_degree", "--sequence-parallel", "zero_optimization.stage"
    value: object  # the new value; None for a switch (Megatron's store_true flags) or a removal
    was: object  # the value the fix replaces; None when the key is added
    action: str  # "set", "add" or "remove"
    at: Position | None  # where the file writes the key, None when it does not
    text: str  # the edit as the engine writes it

    def as_dict(self) -> dict:
        return {
            "key": self.key,
            "action": self.action,
            "value": self.value,
            "was": self.was,
            "line": self.at.line if self.at else None,
            "column": self.at.column if self.at else None,
            "edit": self.text,
            **({"file": self.at.file} if self.at and self.at.file else {}),
        }


@dataclass(frozen=True)
class EnginePatch:
    format: str
    changes: tuple[EngineChange, ...]
    fields: tuple[str, ...]  # the spec fields the fix changes (for reference)

    def text(self, file: str) -> str:
        lines = []
        for c in self.changes:
            where = f"{c.at.file or file}:{c.at.line}:{c.at.column}: " if c.at else f"{file}: "
            lines.append(f"{where}{c.text}")
        lines.append(f"# (spec fields: {', '.join(self.fields)})")
        return "\n".join(lines) + "\n"


class NotExpressible(ValueError):
    """The fixed plan cannot be written in the engine's keys (the reason says why)."""


def engine_patch(spec, suggestion, document: SourceDocument) -> EnginePatch:
    """The suggestion as edits of the engine config ``document`` was read from (raises :class:`NotExpressible`)."""
    from mixle_compile.export import ExportRefused

    fixed = applied(spec, suggestion)
    fmt = document.source_format
    try:
        before, after = _keys(spec, fmt), _keys(_engine_consistent(spec, fixed, fmt), fmt)
    except ExportRefused as exc:
        raise NotExpressible(str(exc)) from None
    changes = []
    for key in list(dict.fromkeys([*before, *after])):
        old, new = before.get(key, _ABSENT), after.get(key, _ABSENT)
        if old == new or key in _MODEL_ONLY.get(fmt, ()):
            continue
        written, at = _position(document, key, fmt)
        follows = _FOLLOWS.get(fmt, {}).get(key)
        if at is None and follows is not None and after.get(follows, _ABSENT) == new:
            continue  # left out of the file, it takes the value it follows
        if new is _ABSENT:
            if fmt != "megatron" or at is None:
                continue  # a key the engine ignores once the fix is made (a pipeline key without a pipeline)
            changes.append(EngineChange(written, None, old, "remove", at, f"remove {_flag(written, old)}"))
            continue
        action = "set" if at is not None else "add"
        changes.append(
            EngineChange(
                written, new, None if old is _ABSENT else old, action, at, _edit(fmt, written, new, old, action)
            )
        )
    if not changes:
        raise NotExpressible("the engine's config reads the same before and after the fix")
    return EnginePatch(fmt, tuple(changes), tuple(c.field.dotted for c in suggestion.changes))


_ABSENT = object()


def applied(spec, suggestion):
    """``spec`` with the suggestion's changes made."""
    from mixle_compile.spec.models import Spec
    from mixle_compile.verify.facts import ENUMS

    data = spec.model_dump(mode="json", exclude_none=True)
    for change in suggestion.changes:
        cur = data
        *head, last = change.field.path
        for part in head:
            cur = cur.setdefault(part, {})
        value = change.value
        if change.field.kind == "bool":
            value = bool(value)
        elif change.field.kind in ENUMS:
            value = ENUMS[change.field.kind][int(value)]
        cur[last] = value
    return Spec.model_validate(data)


def _engine_consistent(spec, fixed, fmt: str):
    """The fixed plan as the engine says it.

    * torchtitan runs sequence parallelism whenever tp > 1 (its TP plan, models/llama3/infra/parallelize.py
      apply_tp): a fix that changes tp carries that along, as the engine would;
    * without a pipeline, micro-batches and accumulation steps are one thing under two names. Megatron-LM
      has only micro-batches (``global / (micro * dp)`` of them, megatron/core/num_microbatches_calculator.py);
      torchtitan only accumulation (``global / (local * dp)``, torchtitan/train.py).
    """
    from mixle_compile.spec.models import Spec

    data = fixed.model_dump(mode="json", exclude_none=True)
    mesh = data["mesh"]
    if fixed.mesh.pp == 1:
        steps = fixed.mesh.microbatches * fixed.mesh.gradient_accumulation_steps
        if fmt == "megatron":
            mesh["microbatches"], mesh["gradient_accumulation_steps"] = steps, 1
        elif fmt.startswith("torchtitan"):
            mesh["microbatches"], mesh["gradient_accumulation_steps"] = 1, steps
    if fmt.startswith("torchtitan") and spec.training.sequence_parallel == (spec.mesh.tp > 1):
        data["training"]["sequence_parallel"] = fixed.mesh.tp > 1
    return Spec.model_validate(data)


def _keys(spec, fmt: str) -> dict[str, object]:
    """The engine keys (flattened) the exporter writes for ``spec``."""
    if fmt.startswith("torchtitan"):
        from mixle_compile.export.torchtitan import torchtitan_files

        exported = torchtitan_files(spec, "fix")
        return _flatten(tomllib.loads(exported.files[exported.main]))
    if fmt == "megatron":
        from mixle_compile.export.megatron import megatron_arguments

        out: dict[str, object] = {}
        flag = None
        for word in megatron_arguments(spec):
            if word.startswith("--"):
                flag = word
                out[flag] = None
            else:
                out[flag] = word
        return out
    from mixle_compile.export.deepspeed import deepspeed_files

    exported = deepspeed_files(spec, "fix")
    return _flatten(json.loads(exported.files[exported.main]))


def _flatten(data: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in data.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _position(document: SourceDocument, key: str, fmt: str) -> tuple[str, Position | None]:
    """The key as the file writes it (an older torchtitan layout's table, ``batch_size``) and where."""
    keys = document.engine_keys
    if key in keys:
        return key, keys[key]
    if fmt.startswith("torchtitan"):
        table, _, name = key.partition(".")
        candidates = [f"{t}.{name}" for t in _TT_TABLES] if table == "parallelism" else []
        for other in (*candidates, *_TT_ALIASES.get(key, ())):
            if other in keys:
                return other, keys[other]
    return key, None


def _flag(key: str, value: object) -> str:
    return key if value is None else f"{key} {value}"


def _edit(fmt: str, key: str, new: object, old: object, action: str) -> str:
    was = "" if old is _ABSENT else f"  ({'now' if action == 'add' else 'was'} {_shown(fmt, old)})"
    if fmt == "megatron":
        return f"{action} {_flag(key, new)}{was}"
    if fmt == "torchtitan":
        from mixle_compile.export.torchtitan import _toml_value

        table, _, name = key.partition(".")
        if action == "add":
            return f"add {name} = {_toml_value(new)} to [{table}]{was.replace('now', 'default')}"
        return f"set [{table}] {name} = {_toml_value(new)}{was}"
    if fmt == "torchtitan-python":
        return f"{action} {key} = {new!r}{was}"
    return f'{action} "{key}": {json.dumps(new)}{was}'


def _shown(fmt: str, value: object) -> str:
    if fmt == "torchtitan":
        from mixle_compile.export.torchtitan import _toml_value

        return _toml_value(value)
    if fmt == "torchtitan-python":
        return repr(value)
    if fmt == "megatron":
        return "absent" if value is None else str(value)
    return json.dumps(value)

"""Writing the engines' own configs from a verified spec.

:func:`export_spec` turns a :class:`~mixle_compile.spec.models.Spec` into the files an engine runs:

* ``torchtitan``: a job TOML (the format the importers read back), with an HF ``config.json``
  beside it when the model is not one of torchtitan's published flavors;
* ``megatron``: a Megatron-LM launch script (``torchrun ... pretrain_gpt.py`` and its arguments);
* ``deepspeed``: a DeepSpeed JSON config and the model's HF ``config.json``.

The spec is first checked on that engine's backend (torchtitan 0.2, Megatron-LM arguments,
DeepSpeed); one that does not verify there, or that has settings the engine's config cannot say,
is refused with the reasons (:class:`ExportRefused`). Reading an exported config back
(:mod:`mixle_compile.importers`) gives the same spec: the round trip is tested.
"""

from __future__ import annotations

from dataclasses import dataclass

from mixle_compile.spec.models import Spec

TARGETS = ("torchtitan", "megatron", "deepspeed")
BACKENDS = {
    "torchtitan": {"name": "torchtitan", "version": "0.2"},
    "megatron": {"name": "megatron", "entry": "arguments"},
    "deepspeed": "deepspeed",
}


class ExportRefused(ValueError):
    """The spec cannot be written as that engine's config; ``reasons`` says why, each with its spec field."""

    def __init__(self, target: str, reasons: list[tuple[str, str]]):
        self.target, self.reasons = target, reasons
        super().__init__("; ".join(f"{f}: {r}" if f else r for f, r in reasons))


@dataclass(frozen=True)
class Exported:
    """The files of an engine config: the main one first, then the HF model config it names, if any."""

    target: str
    files: dict[str, str]  # relative file name -> text
    main: str


def on_backend(spec: Spec, target: str) -> Spec:
    return Spec.model_validate({**spec.model_dump(mode="json", exclude_none=True), "backend": BACKENDS[target]})


def verification_errors(spec: Spec) -> list[tuple[str, str]]:
    from mixle_compile.diagnostics import Severity
    from mixle_compile.spec.load import consistency_diagnostics
    from mixle_compile.spec.source import SourceDocument
    from mixle_compile.verify import verify_plan

    doc = SourceDocument(file="<spec>", data=spec.model_dump(mode="json"))
    errors = [(", ".join(d.fields), f"{d.code} {d.message}") for d in consistency_diagnostics(spec, doc)
              if d.severity is Severity.error]
    if errors:
        return errors
    from mixle_compile.spec.source import dotted

    return [(", ".join(dotted(p) for p in f.paths[:1]), f"{f.code} {f.message}")
            for f in verify_plan(spec).findings if f.severity is Severity.error]


def export_spec(spec: Spec, target: str, *, stem: str = "train") -> Exported:
    """The engine config of ``spec`` (raises :class:`ExportRefused`)."""
    if target not in TARGETS:
        raise ExportRefused(target, [("", f"no exporter for {target!r}; targets: {', '.join(TARGETS)}")])
    from mixle_compile.spec.models import TransformerModel

    if not isinstance(spec.model, TransformerModel):
        raise ExportRefused(target, [("model.family", f"a {spec.model.family} model: the engines train transformers")])
    reasons: list[tuple[str, str]] = []
    if spec.elastic is not None:
        reasons.append(("elastic", "an elastic range has no counterpart in an engine config; remove it to export"))
    if not isinstance(spec.resources.devices, int):
        reasons.append(("resources.devices", "a list of device groups: the engine configs run one kind of device"))
    if reasons:
        raise ExportRefused(target, reasons)
    spec = on_backend(spec, target)
    errors = verification_errors(spec)
    if errors:
        raise ExportRefused(target, [(f, f"does not verify on the {target} backend: {m}") for f, m in errors])
    if target == "torchtitan":
        from mixle_compile.export.torchtitan import torchtitan_files

        return torchtitan_files(spec, stem)
    if target == "megatron":
        from mixle_compile.export.megatron import megatron_files

        return megatron_files(spec, stem)
    from mixle_compile.export.deepspeed import deepspeed_files

    return deepspeed_files(spec, stem)


def memory_text(nbytes: int) -> str:
    """A spec memory size as the shortest exact text the spec reads back (``80GiB``, ``141GB``, bytes)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("TB", 10**12), ("GB", 10**9), ("MiB", 2**20), ("MB", 10**6), ("KiB", 2**10)):
        if nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return str(nbytes)

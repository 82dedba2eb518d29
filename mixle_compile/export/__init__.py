"""Writing the engines' own configs from a verified spec.

:func:`export_spec` turns a :class:`~mixle_compile.spec.models.Spec` into the files an engine runs:

* ``torchtitan``: a job TOML (the format the importers read back), with an HF ``config.json``
  beside it when the model is not one of torchtitan's published flavors; or, for torchtitan 0.3, a
  Python module with a config-registry function returning ``Trainer.Config``;
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


def on_backend(spec: Spec, target: str, version: str | None = None) -> Spec:
    backend = BACKENDS[target] if version is None else {**BACKENDS[target], "version": version}
    return Spec.model_validate({**spec.model_dump(mode="json", exclude_none=True), "backend": backend})


def verification_errors(spec: Spec) -> list[tuple[str, str]]:
    from mixle_compile.diagnostics import Severity
    from mixle_compile.spec.load import consistency_diagnostics
    from mixle_compile.spec.source import SourceDocument

    doc = SourceDocument(file="<spec>", data=spec.model_dump(mode="json"))
    errors = [
        (", ".join(d.fields), f"{d.code} {d.message}")
        for d in consistency_diagnostics(spec, doc)
        if d.severity is Severity.error
    ]
    if errors:
        return errors
    from mixle_compile.spec.source import dotted
    from mixle_compile.verify import verify_plan

    return [
        (", ".join(dotted(p) for p in f.paths[:1]), f"{f.code} {f.message}")
        for f in verify_plan(spec, errors_only=True).findings
    ]


def torchtitan_version_of(spec: Spec, asked: str | None) -> str:
    """The torchtitan config generation to write: the one asked for, else the spec's torchtitan backend version
    when it names 0.3 (Python config functions), else 0.2 (the job TOML)."""
    if asked is not None:
        return asked
    backend = spec.model_dump(mode="json").get("backend")
    version = backend.get("version") if isinstance(backend, dict) and backend.get("name") == "torchtitan" else None
    return "0.3" if version == "0.3" else "0.2"


def export_spec(spec: Spec, target: str, *, stem: str = "train", torchtitan_version: str | None = None) -> Exported:
    """The engine config of ``spec`` (raises :class:`ExportRefused`); ``torchtitan_version`` "0.2" writes
    the job TOML, "0.3" a config-registry Python function (default: from the spec's backend)."""
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
    if spec.model.mtp_num_layers:
        # not written yet: an exported config without them would train another model, silently
        reasons.append(
            (
                "model.mtp_num_layers",
                "multi-token prediction depths are not written by the exporters yet; set mtp_num_layers: 0 to export",
            )
        )
    if reasons:
        raise ExportRefused(target, reasons)
    version = torchtitan_version_of(spec, torchtitan_version) if target == "torchtitan" else None
    if version not in (None, "0.2", "0.3"):
        raise ExportRefused(
            target, [("backend.version", f"torchtitan {version}: written are 0.2 (job TOML) and 0.3 (Python)")]
        )
    spec = on_backend(_overlap_resolved(spec, target), target, version)
    errors = verification_errors(spec)
    if errors:
        raise ExportRefused(target, [(f, f"does not verify on the {target} backend: {m}") for f, m in errors])
    if target == "torchtitan" and version == "0.3":
        from mixle_compile.export.torchtitan_python import torchtitan_python_files

        return torchtitan_python_files(spec, stem)
    if target == "torchtitan":
        from mixle_compile.export.torchtitan import torchtitan_files

        return torchtitan_files(spec, stem)
    if target == "megatron":
        from mixle_compile.export.megatron import megatron_files

        return megatron_files(spec, stem)
    from mixle_compile.export.deepspeed import deepspeed_files

    return deepspeed_files(spec, stem)


def _overlap_resolved(spec: Spec, target: str) -> Spec:
    """A Megatron spec exported to Megatron-LM's arguments keeps whether its pipeline transfers overlap:
    Megatron-Core's default (entry: core) is off where Megatron-LM's is on, so it is written out. To
    another engine the field (Megatron's switch, which the others lack: P012) is left out."""
    from mixle_compile.engines import engine_profile

    t = spec.training
    if target != "megatron":
        value = None
    elif t.overlap_pipeline_transfers is not None:
        return spec
    else:
        # where Megatron-LM would overlap (asked: true) but this spec's engine does not by default
        profile, schedule, virtual = engine_profile(spec.backend), t.pipeline_schedule, t.virtual_pipeline_stages
        if not profile.overlaps_pipeline_transfers(schedule, virtual, True) or profile.overlaps_pipeline_transfers(
            schedule, virtual
        ):
            return spec
        value = False
    if t.overlap_pipeline_transfers == value:
        return spec
    return spec.model_copy(update={"training": t.model_copy(update={"overlap_pipeline_transfers": value})})


def memory_text(nbytes: int) -> str:
    """A spec memory size as the shortest exact text the spec reads back (``80GiB``, ``141GB``, bytes)."""
    for unit, size in (
        ("TiB", 2**40),
        ("GiB", 2**30),
        ("TB", 10**12),
        ("GB", 10**9),
        ("MiB", 2**20),
        ("MB", 10**6),
        ("KiB", 2**10),
    ):
        if nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return str(nbytes)

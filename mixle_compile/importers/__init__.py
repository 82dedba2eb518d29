"""Reading the configs users already have into a spec, with diagnostics at the original positions.

:func:`read_any` is what every verb's loader calls: it detects the file's format by content and
extension and returns a :class:`~mixle_compile.spec.source.SourceDocument` whose data is a spec
and whose positions point into the file the user wrote. Formats:

* spec files (YAML, JSON): read as before;
* torchtitan job TOML (the configs before torchtitan's Python config registry): :mod:`.torchtitan`;
* Megatron-LM launch scripts and argument files: :mod:`.megatron`;
* DeepSpeed JSON configs, the model from an HF config.json: :mod:`.deepspeed`;
* an HF config.json as the model of a spec (``model: {from: hf, path: ...}``): :mod:`.hf`;
* a mixle model's ``to_dict()`` JSON as the model of a spec (``model: {from: mixle, path: ...}``): :mod:`.mixle`.

Anything else is refused with what it looks like and what is read (I001), never a YAML error.
Nothing here imports torch or an engine.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from mixle_compile.importers import codes  # noqa: F401  (registers the I0xx codes)
from mixle_compile.importers.builder import ImportOptions, unreadable
from mixle_compile.importers.shell import RUNNERS
from mixle_compile.spec.source import MAX_INPUT_BYTES, SourceDocument, SourceError, parse_source, read_source

__all__ = ["ImportOptions", "detect_format", "provenance", "provenance_text", "read_any", "SUPPORTED"]

SUPPORTED = (
    "a spec (.yaml, .yml, .json), a torchtitan job config (.toml), a Megatron-LM launch script or "
    "argument file (.sh, .args), or a DeepSpeed config (.json, the model from `--model config.json`)"
)

SPEC_SECTIONS = {"model", "mesh", "training", "backend", "resources", "elastic"}
DEEPSPEED_KEYS = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "zero_optimization",
    "fp16",
    "bf16",
    "optimizer",
    "scheduler",
    "gradient_clipping",
    "steps_per_print",
    "wall_clock_breakdown",
}
# A line that reads another script: `source`/`.` or a runner the shell reader follows (shell.RUNNERS).
_FOLLOWS = re.compile(rf"^[ \t]*(?:source|\.|{'|'.join(RUNNERS)})[ \t]+(?:-\S+[ \t]+)*[^-\s]\S*", re.M)
_MEGATRON_TEST_CONFIG = re.compile(r"^MODEL_ARGS[ \t]*:", re.M)
_MEGATRON_FLAG = re.compile(
    r"--(tensor|pipeline)-model-parallel-size|--num-layers\b|--micro-batch-size|pretrain_\w+\.py"
    r"|--hybrid-(layer|override)-pattern\b"  # a hybrid Mamba model's arguments: read, to be refused by name
)
_TOML_TABLE = re.compile(r"^\s*\[[A-Za-z_][\w.\-]*\]\s*(#.*)?$", re.M)


def detect_format(path: str | Path, raw: bytes) -> str:
    """One of: spec, plan, torchtitan, megatron, deepspeed, hf, mixle, or ``unsupported:<what it looks like>``."""
    suffix = Path(path).suffix.lower()
    text = raw[:200_000].decode("utf-8", errors="replace")
    stripped = text.lstrip("\ufeff \t\r\n")
    if suffix == ".toml" or (
        _TOML_TABLE.search(text) and re.search(r"^\s*\w+\s*=", text, re.M) and suffix not in (".yaml", ".yml", ".json")
    ):
        if Path(path).name == "pyproject.toml" or re.search(r"^\s*\[(project|tool\.|build-system)", text, re.M):
            return "unsupported:a Python project file, not a training config"
        if re.search(r"^\s*\[(model|parallelism|training|job)\]", text, re.M):
            return "torchtitan"
        return "unsupported:a TOML file without torchtitan's [model], [parallelism] or [training] tables"
    if suffix == ".json" or stripped.startswith("{"):
        try:
            data = json.loads(text)
        except ValueError:
            return "spec"  # the strict JSON reader reports where it breaks
        if isinstance(data, dict):
            keys = set(data)
            if "format_version" in keys and "content_digest" in keys:
                return "plan"
            if keys & SPEC_SECTIONS:
                return "spec"
            if keys & DEEPSPEED_KEYS:
                return "deepspeed"
            if "model_type" in keys or "architectures" in keys:
                return "hf"
            if "__pysp_type__" in keys:
                return "mixle"
        return "spec"
    if suffix in (".yaml", ".yml"):
        # Megatron-LM's functional-test configs (tests/functional_tests/test_cases/*/*/model_config.yaml):
        # the training script's arguments as a MODEL_ARGS mapping of flags
        if _MEGATRON_TEST_CONFIG.search(text):
            return "megatron"
        return "spec"
    if suffix == ".py":
        return (
            "unsupported:a Python file (a torchtitan 0.3 config registry is read with `check --torchtitan "
            "module:function`)"
        )
    if suffix in (".sh", ".bash", ".args", ".txt") or stripped.startswith("#!") or _MEGATRON_FLAG.search(text):
        # A script whose launch is in the files it sources or submits (Megatron-LM's sc21 scripts:
        # `. CONFIG.sh`, `. SBATCH.sh` -> `sbatch SRUN.sh`) is read through them.
        if _MEGATRON_FLAG.search(text) or _FOLLOWS.search(text):
            return "megatron"
        return (
            "unsupported:a shell script or argument list without Megatron-LM arguments (no --num-layers, "
            "--micro-batch-size or --*-model-parallel-size, no pretrain_*.py)"
        )
    return "spec"


def read_any(path: str | Path, name: str, options: ImportOptions | None = None) -> tuple[SourceDocument, list]:
    """Read a spec or an engine config into a spec document (raises SourceError when nothing usable comes out)."""
    options = options or ImportOptions()
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError:
        return read_source(path, display_name=name)  # its messages for missing files and directories
    if len(raw) > MAX_INPUT_BYTES:
        return read_source(path, display_name=name)
    kind = detect_format(p, raw)
    if kind.startswith("unsupported:"):
        raise unreadable(
            name,
            f"{name} is {kind.split(':', 1)[1]}; `mixle-compile` reads {SUPPORTED}",
            "see docs/importers.md for what each format needs",
        )
    if kind == "hf":
        raise unreadable(
            name,
            f"{name} is an HF model config (config.json): it gives a model, not a training plan; "
            f"`mixle-compile` reads {SUPPORTED}",
            f"use it as the model of a spec (`model: {{from: hf, path: {p.name}}}`) or with a DeepSpeed "
            f"config (`--model {p.name}`)",
        )
    if kind == "mixle":
        raise unreadable(
            name,
            f"{name} is a mixle model (its to_dict() JSON): it gives a model, not a training plan; "
            f"`mixle-compile` reads {SUPPORTED}",
            f"use it as the model of a spec (`model: {{from: mixle, path: {p.name}}}`, see docs/mixle.md)",
        )
    if kind == "plan":
        raise unreadable(
            name,
            f"{name} is a compiled plan, not a spec",
            "`check` reads specs; `explain`, `diff` and `run` read plans",
        )
    if kind == "spec":
        doc, diags = parse_source(raw, name, json_syntax=p.suffix.lower() == ".json")
        if options.given:
            raise unreadable(
                name,
                f"{name} is a spec: --model, --devices, --device-memory and --seq-len are for engine configs",
                "write the model, devices and memory in the spec itself",
            )
        return doc, diags
    doc, diags = _import(kind, raw, name, p, options)
    if any(d.severity.value == "error" and d.code != codes.ENGINE_REFUSES.code for d in diags):
        # Nothing to validate: a config that cannot be expressed as a spec is unusable input.
        raise SourceError(diags, unreadable=True)
    return doc, diags


def _import(kind: str, raw: bytes, name: str, p: Path, options: ImportOptions) -> tuple[SourceDocument, list]:
    if kind == "torchtitan":
        from mixle_compile.importers.torchtitan import read_torchtitan_toml

        return read_torchtitan_toml(_text(raw, name), name, p.parent, options)
    if kind == "megatron":
        from mixle_compile.importers.megatron import read_megatron

        return read_megatron(_text(raw, name), name, options, path=p)
    from mixle_compile.importers.deepspeed import read_deepspeed

    return read_deepspeed(raw, name, options)


def provenance(doc: SourceDocument) -> list[dict]:
    """Which engine key gave each spec field of an imported document, in spec order."""
    from mixle_compile.spec.source import dotted

    rows = []
    for path, origin in sorted(doc.origins.items(), key=lambda item: [str(p) for p in item[0]]):
        pos = doc.values.get(path)
        rows.append(
            {
                "field": dotted(path),
                "from": origin,
                "line": pos.line if pos else None,
                "column": pos.column if pos else None,
                **({"file": pos.file} if pos and pos.file else {}),
            }
        )
    return rows


def provenance_text(doc: SourceDocument) -> str:
    rows = provenance(doc)
    if not rows:
        return ""
    width = max(len(r["field"]) for r in rows)
    out = [f"\nImported from {doc.file} ({doc.source_format}): spec field <- engine key"]
    for r in rows:
        where = f"  ({r['file'] + ':' if r.get('file') else ''}{r['line']}:{r['column']})" if r["line"] else ""
        out.append(f"  {r['field']:<{width}}  <- {r['from']}{where}")
    return "\n".join(out) + "\n"


def _text(raw: bytes, name: str) -> str:
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise unreadable(name, f"{name} is not valid UTF-8", "save the file as UTF-8") from None

"""Building, writing and loading the plan artifact.

The plan is canonical JSON (sorted keys, fixed separators, UTF-8), so the same spec gives the same
bytes on every run and machine. Its content digest covers everything but itself; loading checks
the format version, the schema (unknown fields refused) and the digest, in that order, so each
failure says exactly what is wrong.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import ValidationError

from mixle_compile import __version__
from mixle_compile.contracts import PayloadKind
from mixle_compile.diagnostics import Diagnostic, Severity
from mixle_compile.engines import engine_profile
from mixle_compile.lower.compact import program_dict
from mixle_compile.lower.lowering import Lowered
from mixle_compile.plan.document import FORMAT_VERSION, NOTES_SEPARATOR, PlanDocument
from mixle_compile.plan.layers import fold, fold_stated, unfold
from mixle_compile.schedules import bubble_fraction, pipelined
from mixle_compile.spec.models import Spec

DIGEST_FIELD = "content_digest"


class PlanError(ValueError):
    """A plan that cannot be trusted or read; the message says why and what to do."""


class PlanFormatError(PlanError):
    """A plan in another format version than this compiler writes: bad input (exit 2), recompile it."""


def canonical_json(data: Any) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def sha256_hex(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def spec_digest(spec: Spec) -> str:
    return sha256_hex(canonical_json(spec_data(spec)))


def spec_data(spec: Spec) -> dict:
    return spec.model_dump(mode="json")


def build_plan(spec: Spec, lowered: Lowered, diagnostics: list[Diagnostic]) -> dict:
    """The plan as a JSON-ready dict (with its content digest)."""
    return build_plan_text(spec, lowered, diagnostics)[0]


def build_plan_text(spec: Spec, lowered: Lowered, diagnostics: list[Diagnostic]) -> tuple[dict, str]:
    """The plan as a JSON-ready dict (with its content digest) and the text written of it
    (:func:`plan_text`), encoded once."""
    plan = lowered.plan
    names, shape = plan.plan_mesh
    diagnostics = [*diagnostics, *lowered.diagnostics]
    folding = _Folding(lowered)
    embedded = spec_data(spec)  # the spec as the plan embeds it, and what spec_digest covers
    errors = sum(d.severity is Severity.error for d in diagnostics)
    schedule = None
    if lowered.schedule is not None:
        t = spec.training
        check = lowered.schedule.check
        pipeline, virtual_stages = pipelined(t.pipeline_schedule, plan.pp, t.virtual_pipeline_stages)
        schedule = {  # keys in canonical order, as in every section of PRESORTED
            "bubble_fraction": bubble_fraction(plan.pp, plan.microbatches, virtual_stages),
            "check": {
                "note": check.note,
                "ok": check.ok,
                "problems": list(check.problems),
                "ranks_checked": check.ranks_checked,
                "representatives": check.representatives,
            },
            "collectives": lowered.schedule.collectives,
            "micro_steps": plan.microbatches * plan.gradient_accumulation_steps,
            "pipeline": pipeline,
            "sends": "buffered"
            if engine_profile(spec.backend).sends_buffered(plan.pp, spec.training.microbatch_group_size)
            else "rendezvous",
            "stages": [program_dict(program) for program in lowered.schedule.stages],
            "virtual_stages": virtual_stages,
        }
    doc = {
        "format_version": FORMAT_VERSION,
        "compiler_version": __version__,
        "spec_digest": sha256_hex(canonical_json(embedded)),
        "spec": embedded,
        "mesh": {"degrees": plan.as_dict(), "names": list(names), "shape": list(shape), "order": lowered.grid.order},
        "groups": lowered.grid.as_dict(),
        "parameters": [_parameter_entry(p) for p in lowered.parameters],
        "updates": [_update_entry(u) for u in lowered.updates],
        "schedule": schedule,
        "decomposition": lowered.decomposition,
        "memory": [m.as_dict() for m in lowered.memory],
        "traffic": [t.as_dict() for t in lowered.traffic],
        "verdict": {
            "ok": errors == 0
            and not lowered.reduction_problems
            and (lowered.schedule is None or lowered.schedule.check.ok),
            "errors": errors,
            "warnings": len(diagnostics) - errors,
            "diagnostics": [
                # no machine paths in the artifact; every finding listed on its own (none grouped)
                {k: v for k, v in d.as_dict().items() if k not in ("file", "related")}
                for d in diagnostics
            ],
            "reductions_exactly_once": not lowered.reduction_problems,
            "reduction_problems": [p.message for p in lowered.reduction_problems],
        },
    }
    doc = folding.folded(doc, ("parameters", "updates"))
    # Built in the schema's own JSON form (tests/test_plan.py checks that the schema's dump of every
    # example's plan is this dict), so it is encoded once, for its digest and its text, and not
    # validated again here.
    return sealed(doc, presorted=PRESORTED)


def _parameter_entry(p) -> dict:
    """A placed parameter as the plan writes it (``ParameterLayout.as_dict()`` and where it lives),
    its keys in canonical order (see :data:`PRESORTED`)."""
    layout = p.layout
    return {
        "chunk": p.chunk,
        "dtype": p.parameter.dtype,
        "global_shape": list(layout.global_shape),
        "layer": p.parameter.layer,
        "local_shape": list(p.local_shape),
        "logical_id": layout.logical_id,
        "optimizer_state": layout.optimizer_state._value_,
        "owner": p.owner,
        "placements": [list(pair) for pair in layout.placements],  # the plan keeps pairs
        "role": p.parameter.role,
        "shared_group": layout.shared_group,
        "stage": p.stage,
    }


def _update_entry(u) -> dict:
    """A planned update as the plan writes it (``DistributedUpdate.as_dict()``, its notes one
    string, and where it runs), its keys in canonical order (see :data:`PRESORTED`)."""
    d = u.update
    return {
        "collective": d.collective._value_,
        "contract_exact": d.contract_exact,
        "determinism_observed": d.determinism_observed,
        "exact": d.exact,
        "gradient_divisor": u.gradient_divisor,
        "group_size": u.group_size,
        "maximum_absolute_error": d.maximum_absolute_error,
        "maximum_relative_error": d.maximum_relative_error,
        "mesh_axes": [str(axis) for axis in d.mesh_axes],
        "node_id": d.node_id,
        "notes": NOTES_SEPARATOR.join(d.notes),
        "numerics_evidence_id": d.numerics_evidence_id,
        "numerics_sample_count": d.numerics_sample_count,
        "occurrences_per_step": u.occurrences_per_step,
        "payload": d.payload._value_,
        "payload_bytes": u.payload_bytes,
        "phase": u.phase,
        "stage": u.stage,
        "state_layout": d.state_layout._value_,
        "tensor": u.tensor,
    }


#: The plan's large sections, which :func:`build_plan_text` builds with every object's keys already
#: in canonical (sorted) order, so that their text is written without sorting the keys again (the
#: larger part of encoding a large plan). Loading re-encodes every section with sorted keys and
#: refuses a text that differs, so a section built out of order could not be written unnoticed.
PRESORTED = frozenset({"parameters", "updates", "schedule"})


def _folded(data: dict, keys: tuple[str, ...]) -> dict:
    """``data`` with the per-layer lists under ``keys`` folded (every block listed)."""
    return {**data, **{key: fold(data[key]) for key in keys}}


class _Folding:
    """How a lowering's per-layer lists are folded: by comparing layers when every block is listed,
    else from the runs the lowering lowered once (lower/runs.py), with each entry's block and pass
    read from the lowering (the names need not be parsed again)."""

    def __init__(self, lowered: Lowered) -> None:
        self.lowered = lowered
        self.runs = lowered.layer_runs

    def folded(self, data: dict, keys: tuple[str, ...]) -> dict:
        if self.runs is None:
            return _folded(data, keys)
        return {
            **data,
            **{
                key: fold_stated(data[key], self._keys(key, data[key]), self.runs.count, self.runs.stages)
                for key in keys
            },
        }

    def _keys(self, name: str, entries: list[dict]) -> list[tuple[int | None, object]]:
        if name == "parameters":
            return [(p.parameter.layer, None) for p in self.lowered.parameters]
        return [(u.layer, _own(u)) for u in self.lowered.updates]


def _own(u) -> bool:
    """Whether an update is a parameter's own (its gradient reduction or gather) rather than an
    activation's: the lowering lists the two passes one after the other (lower/lowering.py)."""
    return u.update.payload in (PayloadKind.GRADIENT, PayloadKind.PARAMETER)


def expanded(doc: dict) -> dict:
    """A plan's JSON with its folded layers (plan/layers.py) unfolded: what loading reads."""
    return {**doc, "parameters": unfold(doc["parameters"]), "updates": unfold(doc["updates"])}


def content_digest(doc: dict) -> str:
    return _digest(_entries(doc))


def plan_text(doc: dict) -> str:
    """The bytes written to disk: canonical JSON and a final newline."""
    return canonical_json(doc) + "\n"


def sealed(doc: dict, presorted: frozenset[str] = frozenset()) -> tuple[dict, str]:
    """``doc`` with its content digest, and the text :func:`plan_text` writes of it, from one
    encoding of its content (a plan of a large model is megabytes of JSON). The entries named in
    ``presorted`` hold every object's keys in sorted order already and are encoded as they are."""
    entries = {
        key: _entry(key, value)
        if key not in presorted
        else json.dumps(key, ensure_ascii=False) + ":" + _in_order(value)
        for key, value in doc.items()
    }
    digest = _digest(entries)
    entries[DIGEST_FIELD] = _entry(DIGEST_FIELD, digest)
    return {**doc, DIGEST_FIELD: digest}, _joined(entries)


def _entries(doc: dict) -> dict[str, str]:
    """Each top-level entry of ``doc`` as canonical JSON writes it (``"key":value``): canonical JSON
    sorts the keys, so a document's text is its entries joined in key order."""
    return {key: _entry(key, value) for key, value in doc.items()}


def _in_order(data: Any) -> str:
    """Canonical JSON of ``data`` whose objects' keys are in sorted order already."""
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _entry(key: str, value: Any) -> str:
    return json.dumps(key, ensure_ascii=False) + ":" + canonical_json(value)


def _joined(entries: dict[str, str]) -> str:
    """The written text of the document of ``entries`` (:func:`plan_text`)."""
    return "{" + ",".join(entries[key] for key in sorted(entries)) + "}\n"


def _digest(entries: dict[str, str]) -> str:
    """The content digest: the canonical JSON of every entry but the digest itself."""
    return sha256_hex("{" + ",".join(entries[key] for key in sorted(entries) if key != DIGEST_FIELD) + "}")


def load_plan_text(text: str | bytes, name: str = "plan.json") -> PlanDocument:
    """Parse and verify a plan; raises PlanError naming what is wrong."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise PlanError(f"{name} is not UTF-8 text; a plan is JSON written by `mixle-compile compile`") from None

    def refuse_duplicates(pairs: list) -> dict:
        out = {}
        for key, value in pairs:
            if key in out:
                raise PlanError(
                    f"{name} has the key {key!r} twice; a compiled plan never does, so it was edited or corrupted"
                )
            out[key] = value
        return out

    def refuse_constant(token: str):
        raise PlanError(f"{name} contains {token}, which is not JSON")

    try:
        data = json.loads(text, object_pairs_hook=refuse_duplicates, parse_constant=refuse_constant)
    except json.JSONDecodeError as exc:
        raise PlanError(
            f"{name} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); recompile the plan"
        ) from None
    if not isinstance(data, dict) or "format_version" not in data:
        raise PlanError(
            f"{name} is not a mixle-compile plan (no format_version); produce one with `mixle-compile compile "
            f"SPEC -o {name}`"
        )
    version = data["format_version"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise PlanError(f"{name}: format_version must be an integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise PlanFormatError(
            f"{name} is in plan format {version}, newer than this compiler reads (format {FORMAT_VERSION}, "
            f"mixle-compile {__version__}); upgrade mixle-compile or recompile the spec with this version"
        )
    if version < FORMAT_VERSION:
        raise PlanFormatError(
            f"{name} is in the old plan format {version} (this compiler reads format {FORMAT_VERSION}, which states "
            f"each collective once, as an update, and stages that repeat once); recompile its spec with "
            f"mixle-compile {__version__}: "
            f"`mixle-compile compile SPEC -o {name}` (the spec is embedded in the plan as `spec`)"
        )
    try:
        doc = PlanDocument.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "the plan"
        if first["type"] == "extra_forbidden":
            raise PlanError(
                f"{name}: unknown field `{where}`; this compiler does not know it (a newer or edited plan), so "
                "it refuses the plan"
            ) from None
        raise PlanError(
            f"{name}: `{where}`: {first['msg']} ({exc.error_count()} problem(s) in all); recompile the plan"
        ) from None
    entries = _entries(data)
    expected = _digest(entries)
    if data.get(DIGEST_FIELD) != expected:
        raise PlanError(
            f"{name}: content digest mismatch (the file says {data.get(DIGEST_FIELD)!r}, its content hashes to "
            f"{expected!r}); "
            "the plan was modified after compiling: recompile it instead of editing it"
        )
    if _joined(entries) != text:
        raise PlanError(
            f"{name} is not in the canonical form the compiler writes (it was reformatted or modified after "
            "compiling); "
            "recompile it instead of editing it"
        )
    try:
        spec = Spec.model_validate(doc.spec)
    except ValidationError as exc:
        raise PlanError(
            f"{name}: the embedded spec does not validate ({exc.error_count()} problem(s)); recompile the plan"
        ) from None
    if spec_digest(spec) != doc.spec_digest:
        raise PlanError(f"{name}: spec digest mismatch; the embedded spec was modified after compiling")
    doc._text = text
    return doc


def written_text(doc: PlanDocument) -> str:
    """The plan's bytes as written: those it was loaded from, else its model folded again as
    build_plan folds (the digest covers the folded form, not the unfolded model)."""
    if doc._text is not None:
        return doc._text
    data = doc.model_dump(mode="json")
    return plan_text(_folded(data, ("parameters", "updates")))


def plan_spec(doc: PlanDocument) -> Spec:
    return Spec.model_validate(doc.spec)


def plan_schema() -> dict:
    schema = PlanDocument.model_json_schema()
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://mixle-compile.dev/schemas/plan.schema.json",
        "title": "mixle-compile plan",
        **{k: v for k, v in schema.items() if k != "title"},
    }


def plan_schema_text() -> str:
    return json.dumps(plan_schema(), indent=2, sort_keys=True) + "\n"

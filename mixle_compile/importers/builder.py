"""Building a spec's plain data from an engine config, keeping where each field came from.

A :class:`SpecBuilder` collects the spec's data, the position in the engine file of the key that
gave each field (so that every later diagnostic points into the file the user wrote) and the name
of that key (so that ``explain`` can say which engine key produced which spec field).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mixle_compile.diagnostics import Diagnostic, Severity
from mixle_compile.importers import codes
from mixle_compile.spec.source import Path_, Position, SourceDocument, SourceError, dotted

TOP = Position(1, 1)


@dataclass(frozen=True)
class ImportOptions:
    """What the command line adds to an engine config that does not say it."""

    devices: int | None = None
    device_memory: str | None = None
    model: str | None = None  # an HF config.json giving the model
    seq_len: int | None = None

    @property
    def given(self) -> bool:
        return any(v is not None for v in (self.devices, self.device_memory, self.model, self.seq_len))


class SpecBuilder:
    def __init__(self, file: str, source_format: str, *, top: Position = TOP):
        """``top``: where a finding that names no key of the file is placed (the file's first line; a
        torchtitan config function's ``def``), and every spec field without a key of its own."""
        self.doc = SourceDocument(file=file, data={}, source_format=source_format)
        self.diagnostics: list[Diagnostic] = []
        self.top = top
        if top != TOP:
            self.doc.values[()] = top

    def set(self, path: Path_, value: Any, *, at: Position | None = None, origin: str | None = None) -> None:
        """Set the spec field ``path`` (e.g. ``("mesh", "tp")``) to ``value``, read from ``origin`` at ``at``."""
        cur = self.doc.data
        for i, part in enumerate(path[:-1]):
            cur = cur.setdefault(part, {})
            self.doc.values.setdefault(tuple(path[: i + 1]), at or self.top)
        cur[path[-1]] = value
        if at is not None:
            self.doc.values[tuple(path)] = at
            self.doc.keys[tuple(path)] = at
        if origin is not None:
            self.doc.origins[tuple(path)] = origin

    def get(self, path: Path_, default: Any = None) -> Any:
        cur: Any = self.doc.data
        for part in path:
            if not isinstance(cur, dict) or part not in cur:
                return default
            cur = cur[part]
        return cur

    def diagnostic(
        self,
        code: str,
        message: str,
        at: Position | None,
        *,
        hint: str = "",
        field: Path_ = (),
        severity: Severity = Severity.error,
    ) -> None:
        pos = at or self.top
        self.diagnostics.append(
            Diagnostic(
                code=code,
                severity=severity,
                message=message,
                hint=hint,
                file=pos.file or self.doc.file,
                line=pos.line,
                column=pos.column,
                fields=(dotted(field),) if field else (),
            )
        )

    def unmodelled(self, key: str, at: Position | None, why: str = "the spec does not model it") -> None:
        self.diagnostic(
            codes.UNMODELLED_KEY.code,
            f"`{key}` is ignored: {why}",
            at,
            hint="see docs/importers.md for the keys that are read",
            severity=Severity.warning,
        )

    def assumed(self, message: str, at: Position | None, hint: str, field: Path_ = ()) -> None:
        self.diagnostic(codes.ASSUMED_VALUE.code, message, at, hint=hint, field=field, severity=Severity.warning)

    def refuse(self, message: str, at: Position | None, hint: str = "", field: Path_ = ()) -> None:
        self.diagnostic(codes.CANNOT_IMPORT.code, message, at, hint=hint, field=field)

    @property
    def failed(self) -> bool:
        """Whether the config cannot be read as a spec (an engine's own refusal, I005, still is one)."""
        return any(d.severity is Severity.error and d.code != codes.ENGINE_REFUSES.code for d in self.diagnostics)

    def result(self) -> tuple[SourceDocument, list[Diagnostic]]:
        return self.doc, self.diagnostics


def resources(
    builder: SpecBuilder,
    options: ImportOptions,
    devices: int | None,
    devices_at: Position | None,
    devices_origin: str | None,
    *,
    what: str,
    memory: str | None = None,
    memory_origin: str | None = None,
    divisor: int = 1,
    admits=None,
    admits_why: str = "",
) -> int:
    """Fill ``resources`` from the config's device count or the command line; assume (and say so) otherwise.

    The assumption is one node of 8, or the fewest nodes of 8 that the config's fixed degrees
    (``divisor``) divide. ``admits(n)``, when given, says whether the config can run on ``n``
    devices at all (a DeepSpeed config's batch sizes): when the usual assumption is one it rules
    out, the most devices below it that it admits are assumed instead (``admits_why`` says why), so
    that an assumption never makes an error the config does not have."""
    if options.devices is not None:
        devices, devices_at, devices_origin = options.devices, None, "--devices"
    if devices is None:
        devices = math.lcm(8, divisor)
        shown = f"{'one node' if devices == 8 else f'{devices // 8} nodes'} of 8"
        if admits is not None and not admits(devices):
            fitting = [n for n in range(devices - 1, 0, -1) if n % divisor == 0 and admits(n)]
            if fitting:
                devices, shown = fitting[0], f"the most up to {shown} that {admits_why} allows"
        builder.assumed(
            f"{what} does not say how many devices run it; assumed {devices} ({shown})",
            None,
            "pass `--devices N` to check the real world size",
            ("resources", "devices"),
        )
        devices_origin = "assumed"
    builder.set(("resources", "devices"), devices, at=devices_at, origin=devices_origin)
    if options.device_memory is not None:
        memory, memory_origin = options.device_memory, "--device-memory"
    if memory is None:
        memory, memory_origin = "80GiB", "assumed"
        builder.assumed(
            f"{what} does not say how much memory each device has; assumed 80GiB",
            None,
            "pass `--device-memory 80GiB` (or the real size)",
            ("resources", "memory"),
        )
    builder.set(("resources", "memory"), memory, origin=memory_origin)
    return devices


def read_json_document(path, display: str | None, what: str, hint: str) -> SourceDocument:
    """A JSON file an importer reads (an HF config.json, a mixle model), with positions; a file that
    cannot be read or parsed is refused naming ``what`` it should be and ``hint``."""
    from pathlib import Path

    from mixle_compile.spec.source import parse_source

    name = display or str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise unreadable(name, f"cannot read the {what} {name}: {exc.strerror or exc}", hint) from exc
    doc, diags = parse_source(raw, name, json_syntax=True)
    if diags:
        raise SourceError(diags, unreadable=True)
    return doc


def unreadable(file: str, message: str, hint: str, at: Position = TOP) -> SourceError:
    return SourceError(
        [
            Diagnostic(
                code=codes.UNSUPPORTED_FORMAT.code,
                severity=Severity.error,
                message=message,
                hint=hint,
                file=file,
                line=at.line,
                column=at.column,
                fields=(),
            )
        ],
        unreadable=True,
    )

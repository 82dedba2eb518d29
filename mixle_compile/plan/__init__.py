"""The plan artifact: canonical JSON, digests, loading with integrity checks.

The names below load on first use (PEP 562): the lowering imports the plan's vocabulary
(:mod:`mixle_compile.plan.vocabulary`) while the artifact layer imports the lowering, so importing
one submodule must not load the whole package with it.
"""

from __future__ import annotations

import importlib
from typing import Any

_SOURCES = {
    "FORMAT_VERSION": "document",
    "PlanDocument": "document",
    "PlanError": "artifact",
    "build_plan": "artifact",
    "canonical_json": "artifact",
    "content_digest": "artifact",
    "load_plan_text": "artifact",
    "plan_schema_text": "artifact",
    "plan_spec": "artifact",
    "plan_text": "artifact",
    "spec_digest": "artifact",
}

__all__ = list(_SOURCES)


def __getattr__(name: str) -> Any:
    module = _SOURCES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_SOURCES})

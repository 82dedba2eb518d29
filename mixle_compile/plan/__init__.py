"""The plan artifact: canonical JSON, digests, loading with integrity checks."""

from mixle_compile.plan.artifact import (
    PlanError,
    build_plan,
    canonical_json,
    content_digest,
    load_plan_text,
    plan_schema_text,
    plan_spec,
    plan_text,
    spec_digest,
)
from mixle_compile.plan.document import FORMAT_VERSION, PlanDocument

__all__ = [
    "FORMAT_VERSION",
    "PlanDocument",
    "PlanError",
    "build_plan",
    "canonical_json",
    "content_digest",
    "load_plan_text",
    "plan_schema_text",
    "plan_spec",
    "plan_text",
    "spec_digest",
]

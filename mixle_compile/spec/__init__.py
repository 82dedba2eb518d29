"""The declarative spec: pydantic models, loading with source positions, the spec's own checks."""

from mixle_compile.spec.load import LoadedSpec, load_spec, load_spec_text
from mixle_compile.spec.models import Spec, parallel_plan

__all__ = ["LoadedSpec", "Spec", "load_spec", "load_spec_text", "parallel_plan"]

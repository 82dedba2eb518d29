"""mixle-compile: a declarative config compiler with static verification for distributed training plans.

The package exports the training contracts under the names ``mixle.utils.parallel`` gives them, so
code written against mixle's contracts runs unchanged with ``from mixle_compile import ...``;
:func:`from_mixle` reads a live mixle model into the spec's distribution model, :func:`to_mixle` and
:func:`to_mixle_dict` write fitted parameters back into it.
"""

__version__ = "0.1.0"

from mixle_compile.contracts import (  # noqa: E402  (stdlib only: cheap on the lint path)
    BackendCapabilities,
    CollectiveKind,
    DistributedUpdate,
    ParallelAxis,
    ParallelPlan,
    ParameterLayout,
    PayloadKind,
    StateLayout,
    StepReceipt,
    available_training_backends,
    get_training_backend,
    register_training_backend,
)

__all__ = [
    "BackendCapabilities",
    "CollectiveKind",
    "DistributedUpdate",
    "ParallelAxis",
    "ParallelPlan",
    "ParameterLayout",
    "PayloadKind",
    "StateLayout",
    "StepReceipt",
    "__version__",
    "available_training_backends",
    "from_mixle",
    "get_training_backend",
    "register_training_backend",
]


def __getattr__(name: str):
    # Loaded on first use: it imports the spec models (pydantic), which `import mixle_compile` does not need.
    if name in ("from_mixle", "MixleModelError", "to_mixle", "to_mixle_dict", "FittedParametersError"):
        from mixle_compile import mixle_models

        return getattr(mixle_models, name)
    raise AttributeError(f"module 'mixle_compile' has no attribute {name!r}")

"""mixle-compile: a declarative config compiler with static verification for distributed training plans.

The package exports the training contracts under the names ``mixle.utils.parallel`` gives them, so
code written against mixle's contracts runs unchanged with ``from mixle_compile import ...``.
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
    "get_training_backend",
    "register_training_backend",
]

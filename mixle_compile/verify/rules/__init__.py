"""The rule catalogue: importing this package defines every verifier rule, in code order.

Each module holds the rules of one topic; codes are grouped by letter:

* D: devices, world size and elastic ranges
* E: expert parallelism
* T: tensor-parallel shapes
* P: pipeline parallelism
* B: batch arithmetic
* Q: sequence length (context and sequence parallelism)
* C: backend capabilities
* R: device memory
"""

from mixle_compile.verify.rule import RULES

# Imported in catalogue order (the order `mixle-compile rules` lists them).
from mixle_compile.verify.rules import (
    backend,  # noqa: F401
    batch,  # noqa: F401
    experts,  # noqa: F401
    memory,  # noqa: F401
    mesh,  # noqa: F401, I001
    pipeline,  # noqa: F401
    sequence,  # noqa: F401
    shapes,  # noqa: F401
)

__all__ = ["RULES"]

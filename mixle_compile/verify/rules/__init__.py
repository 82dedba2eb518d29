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
from mixle_compile.verify.rules import mesh  # noqa: F401, I001
from mixle_compile.verify.rules import experts  # noqa: F401
from mixle_compile.verify.rules import shapes  # noqa: F401
from mixle_compile.verify.rules import pipeline  # noqa: F401
from mixle_compile.verify.rules import batch  # noqa: F401
from mixle_compile.verify.rules import sequence  # noqa: F401
from mixle_compile.verify.rules import backend  # noqa: F401
from mixle_compile.verify.rules import memory  # noqa: F401

__all__ = ["RULES"]

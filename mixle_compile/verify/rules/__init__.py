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

from importlib import import_module

from mixle_compile.verify.rule import RULES

#: The rule modules in catalogue order: the order `mixle-compile rules` lists the rules in and the
#: verifier runs them in. Imported by name, so that no import sorting can change it.
CATALOGUE_ORDER = ("mesh", "experts", "shapes", "pipeline", "batch", "sequence", "backend", "memory")
for _module in CATALOGUE_ORDER:
    import_module(f"{__name__}.{_module}")

__all__ = ["CATALOGUE_ORDER", "RULES"]

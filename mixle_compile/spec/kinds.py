"""The names of the model families a spec may describe and of the engines with a rule set of their own.

Both are plain string enumerations: a member equals, hashes and prints as its name, so a spec's
``family`` or ``backend`` string compares equal to them. The loader, the verifier and its
documentation read the names from here (this module imports nothing, so any of them may).
"""

from __future__ import annotations

from enum import StrEnum


class Family(StrEnum):
    """``model.family``: what the spec's model is."""

    TRANSFORMER = "transformer"
    MODULES = "modules"
    DISTRIBUTION = "distribution"


class Engine(StrEnum):
    """Engines with a verifier rule set of their own (any other backend is checked with the rules
    every engine shares, the ``common`` set, plus its declared capabilities)."""

    TORCH = "torch"
    TORCHTITAN = "torchtitan"
    MEGATRON = "megatron"


#: The model families that train a neural network (by gradients), as opposed to distributions
#: fitted by EM.
NEURAL = frozenset({Family.TRANSFORMER, Family.MODULES})

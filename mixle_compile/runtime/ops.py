"""What the model code calls on a distributed rank: weights from the parameter store, activations
across the tensor-parallel group (see model.Ops)."""

from __future__ import annotations

import torch

from mixle_compile.runtime.parameters import ParamStore
from mixle_compile.runtime.tensor_parallel import TensorParallel, VocabParallelCrossEntropy


class ParallelOps:
    def __init__(self, store: ParamStore, tp: TensorParallel) -> None:
        self.store = store
        self.tp = tp
        self.tp_size = tp.size
        self.tp_rank = tp.rank

    def weight(self, use: str) -> torch.Tensor:
        return self.store.weight(use)

    def unit_begin(self, unit: str, x):
        return self.store.unit_begin(unit, x)

    def unit_end(self, unit: str, y):
        return self.store.unit_end(unit, y)

    def copy(self, site: str, x):
        return self.tp.copy(site, x)

    def reduce(self, site: str, y):
        return self.tp.reduce(site, y)

    def cross_entropy(self, logits, targets, vocab_start: int):
        return VocabParallelCrossEntropy.apply(logits, targets, self.tp, vocab_start)

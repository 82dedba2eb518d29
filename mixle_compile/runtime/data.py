"""Deterministic token data, sharded by data-parallel coordinates.

Sample ``g`` of the run (a sequence of ``seq_len + 1`` tokens: inputs and next-token targets) is a
function of the seed (or the file) and ``g`` alone, so every plan of a spec, and the single-process
reference, sees the same global batches. The global batch of a step is laid out as
``(accumulation step, data rank, micro-batch, sample)``, outermost first: data rank ``d`` of
accumulation step ``a`` of step ``t`` reads samples
``((t * accumulation_steps + a) * dp + d) * per_rank + i`` for ``i < per_rank``, with
``per_rank = microbatches * micro_batch_size``.

Synthetic samples are a seeded random walk over the vocabulary (each token is the previous one
plus 1, 2 or 3, modulo the vocabulary): learnable, so the loss falls. A token file is read as a
flat stream of token ids: ``.npy`` (any integer dtype), ``.bin`` (uint16, little-endian), or text
with whitespace-separated integers; sample ``g`` is the window starting at
``(g * seq_len) mod (length - seq_len)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mixle_compile.runtime.errors import RuntimeRefusal
from mixle_compile.runtime.parameters import parameter_seed


class TokenSource:
    vocab_size: int
    seq_len: int

    def sample(self, index: int) -> torch.Tensor:
        raise NotImplementedError


class SyntheticTokens(TokenSource):
    def __init__(self, vocab_size: int, seq_len: int, seed: int) -> None:
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def sample(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(parameter_seed(self.seed, f"sample:{index}"))
        start = torch.randint(self.vocab_size, (1,), generator=g)
        steps = torch.randint(1, 4, (self.seq_len,), generator=g)
        return torch.cat([start, start + torch.cumsum(steps, 0)]) % self.vocab_size


class FileTokens(TokenSource):
    def __init__(self, path: str | Path, vocab_size: int, seq_len: int) -> None:
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.tokens = read_tokens(path)
        if self.tokens.numel() < seq_len + 2:
            raise RuntimeRefusal(
                f"{path} holds {self.tokens.numel()} tokens; a sample needs seq_len + 1 = {seq_len + 1}"
            )
        top = int(self.tokens.max())
        if top >= vocab_size or int(self.tokens.min()) < 0:
            raise RuntimeRefusal(
                f"{path} holds token id {top}, outside the model's vocabulary of {vocab_size}; tokenise with a "
                "matching vocabulary"
            )

    def sample(self, index: int) -> torch.Tensor:
        span = self.tokens.numel() - self.seq_len
        start = (index * self.seq_len) % span
        return self.tokens[start : start + self.seq_len + 1]

    @property
    def distinct_samples(self) -> int:
        """Samples before :meth:`sample` wraps around to the start of the file."""
        return -(-(self.tokens.numel() - self.seq_len) // self.seq_len)


def read_tokens(path: str | Path) -> torch.Tensor:
    path = Path(path)
    if not path.is_file():
        raise RuntimeRefusal(f"token file {path} does not exist")
    if path.suffix == ".npy":
        import numpy as np

        array = np.load(path, allow_pickle=False)
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise RuntimeRefusal(
                f"{path} must hold a one-dimensional integer array of token ids, got {array.dtype} of shape "
                f"{array.shape}"
            )
        return torch.from_numpy(array.astype("int64"))
    if path.suffix == ".bin":
        import numpy as np

        if path.stat().st_size % 2:
            raise RuntimeRefusal(
                f"{path} holds {path.stat().st_size} bytes, an odd number: a .bin token file is uint16 token ids, "
                f"2 bytes each (truncated or not a token file?)"
            )
        return torch.from_numpy(np.fromfile(path, dtype="<u2").astype("int64"))
    try:
        return torch.tensor([int(tok) for tok in path.read_text(encoding="utf-8").split()], dtype=torch.int64)
    except ValueError:
        raise RuntimeRefusal(
            f"{path} is not a token file: write whitespace-separated integer token ids, or use .npy / .bin"
        ) from None


@dataclass(frozen=True)
class BatchLayout:
    micro_batch_size: int
    microbatches: int
    accumulation_steps: int
    data_parallel_size: int

    @property
    def per_rank(self) -> int:
        return self.microbatches * self.micro_batch_size

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step, over every data rank and accumulation step."""
        return self.per_rank * self.data_parallel_size * self.accumulation_steps

    def first_sample(self, step: int, accumulation: int, data_rank: int) -> int:
        return ((step * self.accumulation_steps + accumulation) * self.data_parallel_size + data_rank) * self.per_rank

    def samples_before(self, step: int) -> int:
        """The data position after ``step`` optimizer steps, in global samples (what a checkpoint records)."""
        return step * self.global_batch

    def step_at(self, samples: int) -> int:
        """The step that starts at global sample ``samples``: any layout with the same global batch
        resumes a data position exactly, whatever its data-parallel size, micro-batches or accumulation."""
        step, rest = divmod(samples, self.global_batch)
        if rest:
            raise RuntimeRefusal(
                f"data position {samples} falls inside a global batch of {self.global_batch} samples; resume "
                "with the global batch size it was saved with"
            )
        return step


def local_batch(
    source: TokenSource, layout: BatchLayout, step: int, accumulation: int, data_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` of one accumulation step on one data rank: ``[per_rank, seq_len]`` each."""
    first = layout.first_sample(step, accumulation, data_rank)
    rows = torch.stack([source.sample(first + i) for i in range(layout.per_rank)])
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

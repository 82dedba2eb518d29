from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run and keep no example database: a run on a clean
# clone (CI) then repeats a local run exactly, and the solver calls that follow them see the same
# history (the nearest-fix search's effort under its resource limit depends on it).
settings.register_profile("repeatable", derandomize=True, database=None)
settings.load_profile("repeatable")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

TINY = """\
model: {family: transformer, vocab_size: 256, hidden_size: 64, num_layers: 2, num_heads: 4, ffn_hidden_size: 128}
mesh: {dp_shard: 2, tp: 2}
training: {global_batch_size: 8, micro_batch_size: 4, seq_len: 32}
backend: torch
resources: {devices: 4, memory: 2GiB}
"""


@pytest.fixture
def write(tmp_path):
    """Write a spec file (dedented) and return its path."""

    def _write(text: str, name: str = "spec.yaml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text), encoding="utf-8")
        return path

    return _write

"""Reading, checking and compiling a spec run without full garbage collections, and leave the settings as they were."""

from __future__ import annotations

import gc
import json

import pytest

from mixle_compile.check import check_file
from mixle_compile.compile import compile_file
from mixle_compile.heap import full_collections_paused


def test_the_pause_covers_the_block_only_and_survives_an_exception():
    before = gc.get_threshold()
    with full_collections_paused():
        inside = gc.get_threshold()
    assert inside[:2] == before[:2] and inside[2] >= 1 << 30
    assert gc.get_threshold() == before
    with pytest.raises(ZeroDivisionError):
        with full_collections_paused():
            _ = 1 / 0
    assert gc.get_threshold() == before


def test_a_large_check_and_compile_make_no_full_collection(tmp_path):
    parameters = [
        {"name": f"layers.{i // 4}.w{i % 4}", "shape": [64, 64], "role": "column" if i % 2 else "row", "layer": i // 4}
        for i in range(1500)
    ]
    spec = {
        "model": {"family": "modules", "parameters": parameters},
        "mesh": {"dp_shard": 2},
        "training": {"global_batch_size": 2},
        "backend": "torch",
        "resources": {"devices": 2, "memory": "80GiB"},
    }
    path = tmp_path / "big.json"
    path.write_text(json.dumps(spec))
    full = []

    def count(phase, info):
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    gc.collect()
    gc.callbacks.append(count)
    try:
        assert check_file(path).errors == 0
        assert compile_file(path).plan is not None
    finally:
        gc.callbacks.remove(count)
    assert full == []

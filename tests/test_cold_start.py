"""What a cold `check` and `compile` load: the lint path must never import torch (nor numpy or networkx)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import json, sys
from mixle_compile.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as exc:
    status = exc.code
print(json.dumps({"status": status, "modules": sorted(sys.modules)}))
"""


def loaded(*argv: str, modules: bool = False) -> tuple[int, set[str]]:
    """The exit status and the top-level packages loaded (every module loaded, with ``modules``)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    last = done.stdout.strip().splitlines()[-1]
    report = json.loads(last)
    return report["status"], set(report["modules"]) if modules else {m.split(".")[0] for m in report["modules"]}


@pytest.mark.parametrize("spec", ["tiny-transformer.yaml", "gaussian-mixture.yaml", "modules-mlp.yaml"])
def test_check_imports_neither_torch_nor_the_graph_libraries(spec):
    status, every = loaded("check", str(ROOT / "examples" / spec), modules=True)
    roots = {m.split(".")[0] for m in every}
    assert status == 0
    assert not roots & {"torch", "numpy", "networkx", "jsonschema", "matplotlib"}, roots & {
        "torch",
        "numpy",
        "networkx",
    }
    assert "mixle_compile.verify.symbols" in every  # the verifier did run ...
    assert "z3" not in roots  # ... and a valid plan's verdict is its rules read with its values: no solver


def test_check_of_a_broken_plan_starts_the_solver():
    status, roots = loaded(
        "check", str(ROOT / "tests" / "corpus" / "failing" / "megatron_bridge_pr5551_glm45_air_layers_pp.yaml")
    )
    assert status == 1
    assert "z3" in roots  # the minimal conflicts come from the solver


def test_compile_of_a_transformer_does_not_import_torch(tmp_path):
    status, roots = loaded(
        "compile", str(ROOT / "examples" / "tiny-transformer.yaml"), "-o", str(tmp_path / "plan.json")
    )
    assert status == 0 and (tmp_path / "plan.json").exists()
    assert "torch" not in roots

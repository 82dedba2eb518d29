"""Input is data, never code: no eval, exec or pickle of input anywhere in the package."""

from __future__ import annotations

import ast

from tests.conftest import ROOT

PACKAGE = ROOT / "mixle_compile"


def calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            # "" for a bare call such as eval(...); "." for a method of an expression (z3's model.eval)
            owner = (
                ""
                if isinstance(f, ast.Name)
                else f.value.id
                if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                else "."
            )
            yield node, owner, name


def test_no_eval_exec_or_pickle_of_input():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + (
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
                )
                if any(n.split(".")[0] in ("pickle", "marshal", "shelve", "dill", "cloudpickle") for n in names):
                    found.append(f"{where}:{node.lineno} imports a pickle-like module")
        for node, owner, name in calls(tree):
            line = f"{where}:{node.lineno}"
            if owner == "" and name in ("eval", "exec", "compile", "__import__"):
                found.append(f"{line} calls {name}()")
            if owner == "yaml" and name in ("load", "load_all", "unsafe_load", "full_load"):
                found.append(f"{line} uses yaml.{name} (use the safe loader)")
            if owner == "torch" and name == "load":
                weights_only = [k for k in node.keywords if k.arg == "weights_only"]
                if not weights_only or not (
                    isinstance(weights_only[0].value, ast.Constant) and weights_only[0].value.value is True
                ):
                    found.append(f"{line} calls torch.load without weights_only=True")
            if owner in ("np", "numpy") and name == "load":
                allow = [k for k in node.keywords if k.arg == "allow_pickle"]
                if not allow or not (isinstance(allow[0].value, ast.Constant) and allow[0].value.value is False):
                    found.append(f"{line} calls numpy.load without allow_pickle=False")
    assert found == []


def test_the_scan_would_catch_an_unsafe_load(tmp_path):
    bad = ast.parse("import torch\nx = torch.load('f')\ny = eval('1')\nz = solver.model().eval(t)\n")
    names = [(owner, name) for _, owner, name in calls(bad)]
    assert ("torch", "load") in names and ("", "eval") in names and (".", "eval") in names

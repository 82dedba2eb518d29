"""docs/configuration.md says what `check` does: its TOML examples are valid configurations, and
its console examples are what the commands print."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mixle_compile import cli
from mixle_compile.config import read_config, suppressions
from tests.conftest import EXAMPLES, ROOT

DOC = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC, flags=re.S)


def console(first_command: str) -> tuple[list[str], str]:
    """The console block whose first command starts so: (commands, the output after the first)."""
    for block in blocks("console"):
        if block.startswith(f"$ {first_command}"):
            lines = block.splitlines(keepends=True)
            commands = [line[2:].strip() for line in lines if line.startswith("$ ")]
            output = "".join(lines[1:])
            return commands, output
    raise AssertionError(f"no console block starting with {first_command!r}")


def test_the_toml_examples_are_valid_configurations(tmp_path):
    examples = blocks("toml")
    assert len(examples) == 2
    for text in examples:
        name = "pyproject.toml" if text.startswith("# pyproject.toml") else "mixle-compile.toml"
        path = tmp_path / name
        path.write_text(text)
        config = read_config(path)
        assert config.path == path
    pyproject = read_config(tmp_path / "pyproject.toml")
    assert pyproject.backend == "torch" and pyproject.warnings_as_errors and pyproject.ignore == ("C007",)
    assert pyproject.enabled("P008", str(tmp_path / "configs" / "a.yaml"))
    assert not pyproject.enabled("P008", str(tmp_path / "configs" / "legacy" / "x" / "a.yaml"))


def test_the_suppression_example(tmp_path):
    (text,) = [b for b in blocks("yaml") if "mixle: ignore" in b]
    found = suppressions(text)
    assert [(s.line, s.applies_to, s.codes) for s in found] == [(3, 3, ("P008",)), (4, 5, ("T001", "T005"))]


def test_the_grouped_finding_and_the_diff_are_what_check_prints(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    spec = tmp_path / "configs" / "tiny.yaml"
    spec.write_text((EXAMPLES / "tiny-transformer.yaml").read_text().replace("  tp: 2\n", "  tp: 3\n"))
    (command,), shown = console("mixle-compile check configs/tiny.yaml")
    assert cli.main(command.split()[1:]) == 1
    assert capsys.readouterr().out == shown
    (diff, fix), shown = console("mixle-compile check --diff")
    assert cli.main(diff.split()[1:]) == 1
    out = capsys.readouterr().out
    printed = shown.split("$ ")[0]
    assert printed.startswith("...\n")
    assert out.endswith(printed[len("...\n") :])
    assert cli.main(fix.split()[1:]) == 0
    assert capsys.readouterr().out == "All checks passed: 1 file.\n"


def test_the_unknown_key_message(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text("[tool.mixle-compile]\nwarnings_as_errors = true\n")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "a.yaml").write_text((EXAMPLES / "tiny-transformer.yaml").read_text())
    (command,), shown = console("mixle-compile check configs/")
    assert cli.main(command.split()[1:]) == 2
    err = capsys.readouterr().err
    assert err == shown.replace("/repo/pyproject.toml", str((tmp_path / "pyproject.toml").resolve()))


def reader_project(root: Path) -> None:
    """The project the page's commands run in: its pyproject.toml is the page's, and its configs/
    hold a spec with a pipeline-bubble warning (P008), the same under configs/legacy/ (which the
    page's per-file-ignores silence) and a clean one."""
    (root / "pyproject.toml").write_text(blocks("toml")[0])
    (root / "configs" / "legacy").mkdir(parents=True)
    shutil.copy(EXAMPLES / "mixtral-moe-ep.yaml", root / "configs" / "a.yaml")
    shutil.copy(EXAMPLES / "mixtral-moe-ep.yaml", root / "configs" / "legacy" / "old.yaml")
    shutil.copy(EXAMPLES / "llama3-8b-hsdp-tp.yaml", root / "configs" / "llama.yaml")


#: What each command of "On the command line" and of standard input does in that project, as the
#: page describes it: (exit status, codes printed, codes not printed).
IN_THE_PROJECT = {
    "mixle-compile check --select T,D configs/": (0, set(), {"P008"}),
    "mixle-compile check --ignore P008 configs/a.yaml": (0, set(), {"P008"}),
    "mixle-compile check --warnings-as-errors configs/": (1, {"configs/a.yaml:"}, {"legacy/old.yaml:"}),
    "mixle-compile check - --stdin-filename configs/llama.yaml < configs/llama.yaml": (0, {"All checks passed"}, set()),
}
#: The commands the other tests of this file run as the page writes them.
RUN_ELSEWHERE = {
    "mixle-compile check configs/",
    "mixle-compile check configs/tiny.yaml",
    "mixle-compile check --diff configs/tiny.yaml",
    "mixle-compile check --fix configs/tiny.yaml",
}


def page_commands() -> list[str]:
    return [
        re.sub(r"\s+#.*$", "", line[2:]).strip()
        for block in blocks("console")
        for line in block.splitlines()
        if line.startswith("$ ")
    ]


def test_every_command_of_the_page_runs_in_a_test():
    assert set(page_commands()) == set(IN_THE_PROJECT) | RUN_ELSEWHERE


@pytest.mark.parametrize("command", sorted(IN_THE_PROJECT))
def test_the_command_runs_as_written_in_the_readers_project(command, tmp_path):
    reader_project(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "mixle-compile"
    tool.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m mixle_compile "$@"\n')
    tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    status, shown, hidden = IN_THE_PROJECT[command]
    out = result.stdout + result.stderr
    assert result.returncode == status, out
    assert all(s in out for s in shown) and not any(h in out for h in hidden), out

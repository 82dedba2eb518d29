"""docs/configuration.md says what `check` does: its TOML examples are valid configurations, and
its console examples are what the commands print."""

from __future__ import annotations

import re

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
    assert out.endswith(printed[len("...\n"):])
    assert cli.main(fix.split()[1:]) == 0
    assert capsys.readouterr().out == "All checks passed: 1 file.\n"


def test_the_unknown_key_message(capsys, tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.mixle-compile]\nwarnings_as_errors = true\n")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "a.yaml").write_text((EXAMPLES / "tiny-transformer.yaml").read_text())
    _, shown = console("mixle-compile check configs/")
    assert cli.main(["check", str(tmp_path / "configs")]) == 2
    err = capsys.readouterr().err
    assert err == shown.replace("/repo/pyproject.toml", str((tmp_path / "pyproject.toml").resolve()))

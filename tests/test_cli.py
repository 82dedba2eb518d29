"""The `mixle-compile` command: output formats, exit statuses, the examples, and the lint path."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from mixle_compile import cli
from tests.conftest import EXAMPLES, ROOT, TINY

VALID = sorted(EXAMPLES.glob("*.yaml"))
INVALID = sorted((EXAMPLES / "invalid").glob("*.yaml"))


def run_cli(capsys, *argv):
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_there_are_examples_of_every_family():
    names = {p.name for p in VALID}
    assert {
        "llama3-8b-hsdp-tp.yaml",
        "mixtral-moe-ep.yaml",
        "tiny-transformer.yaml",
        "gaussian-mixture.yaml",
        "hmm-shared-transitions.yaml",
        "composite-nested-mixture.yaml",
    } <= names
    assert len(INVALID) >= 10


def test_every_example_starts_with_the_schema_comment():
    for path in VALID + INVALID:
        first = path.read_text().splitlines()[0]
        assert first.startswith("# yaml-language-server: $schema=") and first.endswith("schemas/spec.schema.json"), path


def test_valid_examples_pass(capsys):
    status, out, _ = run_cli(capsys, "check", *map(str, VALID))
    assert status == 0, out
    # Warnings (e.g. a pipeline bubble) are reported but do not fail the check.
    assert re.fullmatch(rf"All checks passed: {len(VALID)} files( \(\d+ warnings?\))?\.", out.strip().splitlines()[-1])
    assert "error" not in out.lower()


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_each_invalid_example_fails_with_its_code(capsys, path):
    expected = re.search(r"#\s*expect:\s*(\S+)", path.read_text()).group(1)
    status, out, _ = run_cli(capsys, "check", "--format", "json", str(path))
    assert status == 1
    found = json.loads(out)
    # A finding grouped under another at the same field is one of its related notes.
    assert expected in [c for d in found for c in [d["code"], *(r["code"] for r in d["related"])]], found
    for d in found:
        assert d["file"] == str(path) and d["line"] >= 1 and d["column"] >= 1


def test_text_format_is_file_line_col_code(capsys, write):
    path = write(TINY.replace("tp: 2}", "tp: 0}"))
    status, out, _ = run_cli(capsys, "check", str(path))
    assert status == 1
    lines = out.splitlines()
    assert lines[0] == f"{path}:2:25: S005 `mesh.tp` must be >= 1, got 0"
    assert lines[1] == "  hint: use a value >= 1"
    assert lines[-1] == "Found 1 error in 1 of 1 file."


def test_json_format_fields(capsys, write):
    path = write(TINY.replace("mesh: {dp_shard: 2, tp: 2}", "mesh: {dp_shard: 2, tp: 2, tpp: 1}"))
    status, out, _ = run_cli(capsys, "check", "--format", "json", str(path))
    assert status == 1
    (d,) = json.loads(out)
    assert set(d) == {"code", "severity", "message", "hint", "file", "line", "column", "fields", "related", "fix"}
    assert (d["related"], d["fix"]) == ([], None)
    assert (d["code"], d["severity"], d["line"], d["column"], d["fields"]) == ("S003", "error", 2, 28, ["mesh.tpp"])


def test_clean_json_is_an_empty_list(capsys, write):
    status, out, _ = run_cli(capsys, "check", "--format", "json", str(write(TINY)))
    assert (status, json.loads(out)) == (0, [])


def test_unreadable_input_and_usage_errors_exit_2(capsys, tmp_path, write):
    status, out, _ = run_cli(capsys, "check", str(tmp_path / "missing.yaml"), str(write(TINY)))
    assert status == 2 and "S011" in out and "file not found" in out
    status, _, err = run_cli(capsys, "check")
    assert status == 2 and "error:" in err
    status, _, err = run_cli(capsys, "frobnicate")
    assert status == 2
    status, _, _ = run_cli(capsys, "check", "--format", "xml", str(write(TINY)))
    assert status == 2


def test_internal_error_is_one_line_and_exit_3(capsys, monkeypatch, write):
    import mixle_compile.check as check

    def boom(path, **options):
        raise RuntimeError("simulated failure\nsecond line")

    monkeypatch.setattr(check, "check_file", boom)
    status, out, err = run_cli(capsys, "check", str(write(TINY)))
    assert status == 3
    assert err.count("\n") == 1 and "internal error: RuntimeError: simulated failure" in err
    assert "Traceback" not in err + out


def test_check_subprocess_imports_no_torch(write):
    """The lint path must start fast: `check` never imports torch."""
    pytest.importorskip("torch")  # only meaningful where torch is installed
    code = (
        "import sys; from mixle_compile.cli import main; "
        f"status = main(['check', {str(EXAMPLES / 'llama3-8b-hsdp-tp.yaml')!r}, {str(write(TINY))!r}]); "
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', status)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.splitlines()[-1] == "NO-TORCH 0"


def test_python_dash_m_entry_point(write):
    proc = subprocess.run(
        [sys.executable, "-m", "mixle_compile", "check", str(write(TINY.replace("tp: 2}", "tp: 2.5}")))],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 1 and "S004" in proc.stdout and proc.stderr == ""


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = [line for line in readme.splitlines() if line.startswith("python3.11 -m venv")]
    assert len(commands) == 2, "the README has exactly two set-up commands"
    test_command = next(c for c in commands if "pytest" in c)
    assert test_command in (ROOT / ".ci" / "run").read_text()


def test_ci_and_the_pre_commit_configuration_run_the_pinned_ruff():
    pinned = re.search(r"^ruff==(\S+)$", (ROOT / ".ci" / "constraints.txt").read_text(), flags=re.M)
    assert pinned, "ruff is pinned in .ci/constraints.txt"
    hooks = (ROOT / ".pre-commit-config.yaml").read_text()
    assert hooks.count(f'"ruff=={pinned[1]}"') == 2 and "ruff check" in hooks and "ruff format --check" in hooks
    ci = (ROOT / ".ci" / "run").read_text()
    assert "ruff check ." in ci and "ruff format --check ." in ci

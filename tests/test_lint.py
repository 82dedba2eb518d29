"""The linter's conventions: configuration found upward from each file, --select/--ignore,
warnings as errors, per-file ignores, suppression comments (and the unused ones, M001),
directories, globs and standard input as arguments, --fix and --diff."""

from __future__ import annotations

import io
import json
import sys

import pytest

from mixle_compile import cli
from mixle_compile.config import ConfigError, glob_matches, read_config, suppressions
from tests.conftest import EXAMPLES, TINY

# 2 micro-batches over pp=2 stages: a P008 warning (a large pipeline bubble), nothing else.
BUBBLE = """\
model: {family: transformer, vocab_size: 256, hidden_size: 64, num_layers: 2, num_heads: 4, ffn_hidden_size: 128}
mesh: {dp_shard: 2, pp: 2, microbatches: 2}
training: {global_batch_size: 8, micro_batch_size: 2, seq_len: 32}
backend: torch
resources: {devices: 4, memory: 2GiB}
"""
# tp 3 over 4 heads on 4 devices: D001, T001, T004 and T005 at `tp`, and nothing else.
TP3 = TINY.replace("mesh: {dp_shard: 2, tp: 2}", "mesh:\n  dp_shard: 2\n  tp: 3\n")


def run_cli(capsys, *argv, stdin: str | None = None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin.encode())))
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def codes(out: str) -> list[str]:
    return [d["code"] for d in json.loads(out)]


# --- configuration -----------------------------------------------------------------------------


def test_the_nearest_configuration_wins(capsys, tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\n\n[tool.mixle-compile]\nwarnings-as-errors = true\n'
    )
    nested = tmp_path / "configs" / "legacy"
    nested.mkdir(parents=True)
    (nested / "mixle-compile.toml").write_text('ignore = ["P008"]\n')
    top, deep = tmp_path / "configs" / "bubble.yaml", nested / "bubble.yaml"
    top.write_text(BUBBLE)
    deep.write_text(BUBBLE)
    status, out, _ = run_cli(capsys, "check", "--format", "json", top)
    assert status == 1 and json.loads(out)[0]["severity"] == "error"  # the pyproject.toml above: warnings are errors
    status, out, _ = run_cli(capsys, "check", "--format", "json", deep)
    assert (status, codes(out)) == (0, [])  # its own folder's file, which says nothing of warnings


def test_mixle_compile_toml_wins_over_pyproject_in_one_folder_and_a_pyproject_without_our_table_is_passed_over(
    capsys, tmp_path
):
    (tmp_path / "mixle-compile.toml").write_text('ignore = ["P"]\n')
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "pyproject.toml").write_text('[project]\nname = "inner"\n')  # no [tool.mixle-compile]: not a configuration
    (inner / "bubble.yaml").write_text(BUBBLE)
    assert codes(run_cli(capsys, "check", "--format", "json", inner / "bubble.yaml")[1]) == []
    (tmp_path / "pyproject.toml").write_text("[tool.mixle-compile]\nselect = []\n")
    assert (
        codes(run_cli(capsys, "check", "--format", "json", inner / "bubble.yaml")[1]) == []
    )  # still mixle-compile.toml


def test_unknown_keys_and_codes_are_named_with_the_closest_valid_one(capsys, tmp_path):
    config = tmp_path / "pyproject.toml"
    config.write_text("[tool.mixle-compile]\nwarnings_as_errors = true\n")
    (tmp_path / "spec.yaml").write_text(TINY)
    status, out, err = run_cli(capsys, "check", tmp_path / "spec.yaml")
    assert status == 2 and out == ""
    assert str(config) in err and "unknown key `tool.mixle-compile.warnings_as_errors`" in err
    assert "did you mean `tool.mixle-compile.warnings-as-errors`?" in err
    config.write_text('[tool.mixle-compile]\nignore = ["P0088"]\n')
    status, _, err = run_cli(capsys, "check", tmp_path / "spec.yaml")
    assert (
        status == 2
        and "`tool.mixle-compile.ignore`: 'P0088' is not a diagnostic code" in err
        and "did you mean P008?" in err
    )
    status, _, err = run_cli(capsys, "check", "--select", "X9", tmp_path / "spec.yaml")
    assert status == 2 and "--select: 'X9' is not a diagnostic code" in err


def test_configuration_values_are_checked(tmp_path):
    config = tmp_path / "mixle-compile.toml"
    for text, said in [
        ("backend = 'pytorch-lightning'", "is not a registered backend"),
        ("warnings-as-errors = 'yes'", "must be true or false"),
        ("select = 'T001'", "must be a list of codes"),
        ("files = []", "non-empty list of glob patterns"),
        ("per-file-ignores = ['x']", "must be a table"),
        ("select = [", "invalid TOML"),
    ]:
        config.write_text(text + "\n")
        with pytest.raises(ConfigError, match=said):
            read_config(config)


def test_select_ignore_and_warnings_as_errors_on_the_command_line(capsys, tmp_path):
    spec = tmp_path / "tp3.yaml"
    spec.write_text(TP3)
    status, out, _ = run_cli(capsys, "check", "--format", "json", "--select", "T", spec)
    assert status == 1 and codes(out) == ["T001"]  # T004 and T005 are grouped under it; D001 not selected
    assert [r["code"] for r in json.loads(out)[0]["related"]] == ["T004", "T005"]
    status, out, _ = run_cli(capsys, "check", "--format", "json", "--ignore", "D001,T", spec)
    assert (status, codes(out)) == (0, [])
    bubble = tmp_path / "bubble.yaml"
    bubble.write_text(BUBBLE)
    assert run_cli(capsys, "check", bubble)[0] == 0
    status, out, _ = run_cli(capsys, "check", "--warnings-as-errors", bubble)
    assert status == 1 and "P008 mesh.microbatches=2" in out and "(warning)" not in out


def test_select_on_the_command_line_replaces_the_configuration_and_ignore_adds_to_it(capsys, tmp_path):
    (tmp_path / "mixle-compile.toml").write_text('select = ["D"]\nignore = ["T004", "T005"]\n')
    spec = tmp_path / "tp3.yaml"
    spec.write_text(TP3)
    assert codes(run_cli(capsys, "check", "--format", "json", spec)[1]) == ["D001"]
    out = run_cli(capsys, "check", "--format", "json", "--select", "T", spec)[1]
    assert codes(out) == ["T001"] and json.loads(out)[0]["related"] == []  # T004 and T005 still ignored by the file
    assert codes(run_cli(capsys, "check", "--format", "json", "--ignore", "D", spec)[1]) == []


def test_per_file_ignores_match_paths_relative_to_the_configuration(capsys, tmp_path):
    (tmp_path / "mixle-compile.toml").write_text(
        'warnings-as-errors = true\n[per-file-ignores]\n"legacy/**/*.yaml" = ["P008"]\n'
    )
    (tmp_path / "legacy" / "old").mkdir(parents=True)
    old, new = tmp_path / "legacy" / "old" / "a.yaml", tmp_path / "a.yaml"
    old.write_text(BUBBLE)
    new.write_text(BUBBLE)
    assert run_cli(capsys, "check", old)[0] == 0
    assert run_cli(capsys, "check", new)[0] == 1


def test_default_backend_applies_to_a_spec_that_names_none(capsys, tmp_path):
    spec = tmp_path / "spec.yaml"  # training.compile: what torchtitan applies and torch does not (C007)
    spec.write_text(TINY.replace("backend: torch\n", "").replace("seq_len: 32}", "seq_len: 32, compile: true}"))
    status, out, _ = run_cli(capsys, "check", spec)
    assert status == 1 and "S006 missing required section `backend`" in out
    (tmp_path / "mixle-compile.toml").write_text('backend = "torch"\n')
    assert "C007" in run_cli(capsys, "check", spec)[1]
    (tmp_path / "mixle-compile.toml").write_text('backend = "torchtitan"\n')
    assert run_cli(capsys, "check", spec)[1] == "All checks passed: 1 file.\n"
    spec.write_text(spec.read_text() + "backend: torch\n")  # a spec's own backend wins
    assert "C007" in run_cli(capsys, "check", spec)[1]


def test_glob_patterns():
    assert glob_matches("*.yaml", "a/b/c.yaml") and glob_matches("configs/**/*.yaml", "configs/c.yaml")
    assert glob_matches("configs/**/*.yaml", "configs/x/y/c.yaml") and not glob_matches(
        "configs/*.yaml", "configs/x/c.yaml"
    )
    assert not glob_matches("*.yaml", "a/b/c.yml") and glob_matches("**/train_configs/*.toml", "m/train_configs/x.toml")
    assert not glob_matches("train_configs/*.toml", "m/train_configs/x.toml")  # a pattern with a / starts at the root


# --- suppression comments --------------------------------------------------------------------


def test_a_comment_on_the_line_or_alone_above_it_suppresses_and_an_unused_one_is_reported(capsys, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(TP3.replace("  tp: 3\n", "  tp: 3  # mixle: ignore[D001, T001, T004, T005]\n"))
    status, out, _ = run_cli(capsys, "check", "--format", "json", spec)
    assert (status, codes(out)) == (0, [])
    spec.write_text(TP3.replace("  tp: 3\n", "  # mixle: ignore[D001,T001,T005]\n  tp: 3\n"))
    status, out, _ = run_cli(capsys, "check", "--format", "json", spec)
    assert status == 1 and codes(out) == ["T004"]
    spec.write_text(
        TP3.replace("  tp: 3\n", "  tp: 3  # mixle: ignore[D001, T001, T004, T005, T002]\n").replace(
            "tp: 2}", "tp: 2}  # mixle: ignore[B001]"
        )
    )
    status, out, _ = run_cli(capsys, "check", spec)
    assert status == 0
    assert "M001 (warning) unused suppression: no T002 finding on this line" in out
    line = next(i for i, t in enumerate(spec.read_text().splitlines(), 1) if "tp: 3" in t)
    assert f"{spec}:{line}:" in out and out.count("M001") == 1
    assert run_cli(capsys, "check", "--ignore", "M001", spec)[1].count("M001") == 0


def test_a_suppression_of_no_code_at_all_is_reported(capsys, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(TINY.replace("backend: torch", "backend: torch  # mixle: ignore[Z999]"))
    status, out, _ = run_cli(capsys, "check", spec)
    assert status == 0 and "M001 (warning) `# mixle: ignore[Z999]`: Z999 is not a diagnostic code" in out


def test_suppressions_are_read_from_comments_only():
    found = suppressions(
        "a: 'x # mixle: ignore[T001]'\n# mixle: ignore[P008]\n"
        "b: 1 # mixle: ignore[t002 , D001]\nc: 2#mixle: ignore[S003]\n"
    )
    assert [(s.line, s.applies_to, s.codes) for s in found] == [(2, 3, ("P008",)), (3, 3, ("T002", "D001"))]


def test_a_file_that_does_not_load_keeps_its_errors(capsys, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        (EXAMPLES / "invalid" / "s003-unknown-key.yaml")
        .read_text()
        .replace("dp_shards: 2", "dp_shards: 2  # mixle: ignore[S003]")
    )
    status, out, _ = run_cli(capsys, "check", "--ignore", "S", spec)
    assert status == 1 and "S003" in out and "M001" not in out


# --- what the arguments stand for ------------------------------------------------------------


def test_a_directory_is_its_files_patterns_and_hidden_folders_are_skipped(capsys, tmp_path):
    (tmp_path / "configs" / "deep").mkdir(parents=True)
    (tmp_path / ".github" / "workflows").mkdir(parents=True)
    (tmp_path / ".github" / "workflows" / "ci.yml").write_text("on: push\njobs: {}\n")
    (tmp_path / "configs" / "a.yaml").write_text(TINY)
    (tmp_path / "configs" / "deep" / "b.yml").write_text(TP3)
    (tmp_path / "configs" / "notes.txt").write_text("not a spec")
    status, out, _ = run_cli(capsys, "check", tmp_path)
    assert status == 1 and "Found 1 error in 1 of 2 files." in out and "ci.yml" not in out
    (tmp_path / "mixle-compile.toml").write_text('files = ["configs/*.yaml"]\n')
    status, out, _ = run_cli(capsys, "check", tmp_path)
    assert status == 0 and "All checks passed: 1 file." in out
    (tmp_path / "mixle-compile.toml").write_text('files = ["specs/*.yaml"]\n')
    status, _, err = run_cli(capsys, "check", tmp_path)
    assert status == 2 and "match the `files` patterns (specs/*.yaml)" in err


def test_a_glob_argument_is_expanded(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.yaml").write_text(TINY)
    (tmp_path / "b.yaml").write_text(TINY)
    status, out, _ = run_cli(capsys, "check", "*.yaml")
    assert status == 0 and "All checks passed: 2 files." in out
    status, _, err = run_cli(capsys, "check", "none/*.yaml")
    assert status == 2 and "no files match none/*.yaml" in err


def test_standard_input_with_a_filename(capsys, tmp_path, monkeypatch):
    (tmp_path / "mixle-compile.toml").write_text('ignore = ["D001"]\n')
    name = tmp_path / "configs" / "from-editor.yaml"
    status, out, _ = run_cli(
        capsys, "check", "--format", "json", "-", "--stdin-filename", name, stdin=TP3, monkeypatch=monkeypatch
    )
    found = json.loads(out)
    assert status == 1 and [d["code"] for d in found] == [
        "T001"
    ]  # D001 ignored by the configuration found from the name
    assert found[0]["file"] == str(name)
    status, out, _ = run_cli(capsys, "check", "-", stdin=TINY, monkeypatch=monkeypatch)
    assert status == 0 and "All checks passed: 1 file." in out
    status, _, err = run_cli(capsys, "check", "--stdin-filename", name, EXAMPLES / "tiny-transformer.yaml")
    assert status == 2 and "give - as the PATH" in err


# --- --fix and --diff --------------------------------------------------------------------------


def test_fix_writes_the_suggestion_keeping_comments_and_layout(capsys, tmp_path):
    original = (EXAMPLES / "tiny-transformer.yaml").read_text()
    spec = tmp_path / "quickstart.yaml"
    spec.write_text(original.replace("  tp: 2\n", "  tp: 3   # more tensor parallelism\n"))
    status, out, err = run_cli(capsys, "check", "--diff", spec)
    assert status == 1 and "-  tp: 3   # more tensor parallelism\n+  tp: 2   # more tensor parallelism\n" in out
    assert "tp: 3" in spec.read_text()  # --diff writes nothing
    status, out, err = run_cli(capsys, "check", "--fix", spec)
    assert status == 0 and "All checks passed: 1 file." in out and f"fixed {spec}: 1 field changed" in err
    assert spec.read_text() == original.replace("  tp: 2\n", "  tp: 2   # more tensor parallelism\n")


def test_fix_adds_a_key_the_file_does_not_write(capsys, tmp_path):
    spec = tmp_path / "bubble.yaml"  # B001: 8 != 1*8*2; the nearest clean plan adds cp
    text = (
        BUBBLE.replace("microbatches: 2", "microbatches: 8")
        .replace("micro_batch_size: 2", "micro_batch_size: 1")
        .replace("num_layers: 2", "num_layers: 4")
    )
    spec.write_text(text)
    status, out, err = run_cli(capsys, "check", "--fix", spec)
    assert status == 0, out
    # tp: 2 and cp: 2 are equally near; the earlier field in the search's order is kept (tp), every time
    for _ in range(2):
        assert spec.read_text().splitlines()[1] == "mesh: {dp_shard: 1, pp: 2, microbatches: 8, cp: 2}"
        spec.write_text(text)
        assert run_cli(capsys, "check", "--fix", spec)[0] == 0


def test_fix_refuses_what_it_cannot_edit(capsys, tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "model": {
                    "family": "transformer",
                    "vocab_size": 256,
                    "hidden_size": 64,
                    "num_layers": 2,
                    "num_heads": 4,
                    "ffn_hidden_size": 128,
                },
                "mesh": {"dp_shard": 2, "tp": 3},
                "training": {"global_batch_size": 8, "micro_batch_size": 4, "seq_len": 32},
                "backend": "torch",
                "resources": {"devices": 4, "memory": "2GiB"},
            }
        )
    )
    before = spec.read_text()
    status, out, err = run_cli(capsys, "check", "--fix", spec)
    assert status == 1 and "is not a YAML spec: --fix edits .yaml and .yml files" in err and spec.read_text() == before
    status, _, err = run_cli(capsys, "check", "--fix", "--format", "json", spec)
    assert status == 2 and "--fix and --diff print text" in err


def test_an_explicit_config_is_used_for_every_file(capsys, tmp_path):
    (tmp_path / "mixle-compile.toml").write_text('ignore = ["P008"]\n')  # would apply, but --config wins
    other = tmp_path / "ci.toml"
    other.write_text("warnings-as-errors = true\n")
    bubble = tmp_path / "bubble.yaml"
    bubble.write_text(BUBBLE)
    assert run_cli(capsys, "check", bubble)[0] == 0
    status, out, _ = run_cli(capsys, "check", "--config", other, bubble)
    assert status == 1 and "P008" in out
    status, _, err = run_cli(capsys, "check", "--config", tmp_path / "none.toml", bubble)
    assert status == 2 and "none.toml: no such file" in err


def test_diff_of_standard_input(capsys, monkeypatch):
    text = (EXAMPLES / "tiny-transformer.yaml").read_text().replace("  tp: 2\n", "  tp: 3\n")
    status, out, _ = run_cli(
        capsys, "check", "--diff", "-", "--stdin-filename", "configs/tiny.yaml", stdin=text, monkeypatch=monkeypatch
    )
    assert status == 1 and "--- a/configs/tiny.yaml\n+++ b/configs/tiny.yaml\n" in out and "+  tp: 2\n" in out
    status, _, err = run_cli(capsys, "check", "--fix", "-", stdin=text, monkeypatch=monkeypatch)
    assert status == 2 and "use --diff" in err

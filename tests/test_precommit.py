"""The pre-commit hooks, run the way users run them: a repository whose `.pre-commit-config.yaml` names this
one at a commit, and `pre-commit run`."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import EXAMPLES, ROOT


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
        env={
            "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@example.com",
            "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@example.com",
            "PATH": "/usr/bin:/bin",
            "HOME": str(repo),
        },
    ).stdout


@pytest.fixture(scope="module")
def hooks(tmp_path_factory):
    """Runs this repository's hooks in a user's repository as its `.pre-commit-config.yaml` names
    them (this checkout at its HEAD commit), with one pre-commit cache for the module, so that the
    hook's environment is built once."""
    pytest.importorskip("pre_commit")
    if shutil.which("git") is None:
        pytest.skip("needs git")
    if subprocess.run(
        ["git", "ls-files", "--error-unmatch", ".pre-commit-hooks.yaml"], cwd=ROOT, capture_output=True
    ).returncode:
        pytest.skip("pre-commit only sees committed hook manifests")
    rev = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    home = tmp_path_factory.mktemp("pre-commit-home")

    def run(repo: Path, hook: str, *args: str) -> subprocess.CompletedProcess:
        (repo / ".pre-commit-config.yaml").write_text(
            f"repos:\n  - repo: {ROOT}\n    rev: {rev}\n    hooks:\n      - id: {hook}\n"
        )
        git(repo, "add", ".pre-commit-config.yaml")
        env = {"PRE_COMMIT_HOME": str(home), "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(home)}
        return subprocess.run(
            [sys.executable, "-m", "pre_commit", "run", hook, *args],
            cwd=repo,
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )

    return run


def test_the_hook_passes_a_good_spec_and_fails_a_bad_one(tmp_path, hooks):
    repo = tmp_path / "user-repo"
    (repo / "configs").mkdir(parents=True)
    (repo / ".github" / "workflows").mkdir(parents=True)
    shutil.copy(EXAMPLES / "tiny-transformer.yaml", repo / "configs" / "good.yaml")
    shutil.copy(EXAMPLES / "invalid" / "s003-unknown-key.yaml", repo / "configs" / "bad.yaml")
    # Not specs: the default `files:` pattern leaves them alone.
    (repo / ".github" / "workflows" / "ci.yml").write_text(
        "on: [push]\njobs: {test: {runs-on: ubuntu-latest, steps: []}}\n"
    )
    (repo / "docker-compose.yml").write_text("services: {db: {image: postgres}}\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "specs")

    good = hooks(
        repo, "mixle-compile-check", "--files", "configs/good.yaml", ".github/workflows/ci.yml", "docker-compose.yml"
    )
    assert good.returncode == 0, good.stdout + good.stderr
    assert "Passed" in good.stdout
    both = hooks(
        repo,
        "mixle-compile-check",
        "--files",
        "configs/good.yaml",
        "configs/bad.yaml",
        ".github/workflows/ci.yml",
        "docker-compose.yml",
    )
    assert both.returncode == 1, both.stdout + both.stderr
    assert "configs/bad.yaml:5:3: S003 unknown key `mesh.dp_shards`" in both.stdout
    assert "good.yaml:" not in both.stdout and "ci.yml" not in both.stdout and "docker-compose" not in both.stdout


def test_the_torchtitan_hook_on_a_torchtitan_style_repository(tmp_path, hooks):
    """A repository laid out like torchtitan before its config refactor: the hook checks its train configs."""
    corpus = ROOT / "tests" / "corpus" / "importers" / "torchtitan"
    repo = tmp_path / "torchtitan"
    configs = repo / "torchtitan" / "models" / "llama3" / "train_configs"
    configs.mkdir(parents=True)
    shutil.copy(corpus / "llama3_8b.toml", configs / "llama3_8b.toml")
    shutil.copy(corpus / "llama3_debug_model.toml", configs / "debug_model.toml")
    (repo / "pyproject.toml").write_text('[project]\nname = "torchtitan"\n')
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "configs")

    good = hooks(repo, "mixle-compile-check-torchtitan", "--all-files")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "pyproject.toml" not in good.stdout  # only train configs are checked
    config = configs / "llama3_8b.toml"
    config.write_text(config.read_text().replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 16"))
    git(repo, "add", ".")
    bad = hooks(repo, "mixle-compile-check-torchtitan", "--all-files")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    line = next(
        i for i, text in enumerate(config.read_text().splitlines(), 1) if text.startswith("tensor_parallel_degree")
    )
    assert f"torchtitan/models/llama3/train_configs/llama3_8b.toml:{line}:" in bad.stdout and "mesh.tp=16" in bad.stdout

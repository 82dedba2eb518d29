"""Every `mixle-compile ...` (or `python -m mixle_compile...`) command in a fenced block of README.md
and docs/*.md runs as written.

The commands are found when the tests are collected, so a page added to docs/ is covered without
touching this file. Each page runs in its own copy of the repository, its commands in page order
(a page's `compile -o tiny.plan.json` is what its `explain tiny.plan.json` reads), with
`mixle-compile` on PATH running this checkout.

What a command must do: exit 0, or exit 1 where the page shows it failing (its output, up to the
next prompt, says "Found N error(s)" or "the run failed"). Never 2 (bad input: a missing file, a
wrong option) and never 3.

Not run, and listed as skipped with the reason: installs (pip, git clone), CI workflow and
pre-commit steps (YAML blocks: they run in the user's repository, on its configs), torchrun
launches, commands for a world larger than 4 ranks, and ones that need what this machine lacks
(torchtitan's model code and triton for `--torchtitan`, a GPU). `run` commands train on CPU
ranks and are marked slow.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Fences whose lines are commands: console blocks (`$ ` prompts) and shell scripts.
PROMPTED = {"console", "shell-session"}
SCRIPTS = {"sh", "bash", "shell", "zsh", ""}
MAX_WORLD = 4
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<lang>[\w+-]*)")
_ENV = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*")
_FAILING = re.compile(r"Found \d+ errors?|the run failed")


@dataclass(frozen=True)
class Command:
    page: Path
    line: int
    text: str
    expect: int  # exit status the page shows
    skip: str = ""  # why it is not run here
    runtime: bool = False

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


_LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s")


def _blocks(page: Path):
    """(language, [(line number, text)]) of every fenced block, and of every indented code block
    (four spaces after a blank line, outside a list item), which has no language."""
    lines = page.read_text(encoding="utf-8").splitlines()
    block, lang, fence = None, "", ""
    indented: list[tuple[int, str]] = []
    in_list = False  # the last paragraph was a list item, whose indented lines continue it
    for number, line in enumerate(lines, 1):
        m = _FENCE.match(line)
        if block is None and indented and (line.strip() and not line.startswith("    ") or m):
            yield "", indented
            indented = []
        if block is None and m:
            block, lang, fence = [], m["lang"].lower(), m["fence"]
        elif block is not None and line.strip().startswith(fence) and not line.strip()[len(fence) :].strip():
            yield lang, block
            block = None
        elif block is not None:
            block.append((number, line))
        elif (
            line.startswith("    ")
            and line.strip()
            and (indented or (number > 1 and not lines[number - 2].strip() and not in_list))
        ):
            indented.append((number, line[4:]))
        elif line.strip() and not line.startswith("    "):
            in_list = bool(_LIST_ITEM.match(line)) or (in_list and line.startswith("  "))
    if indented:
        yield "", indented


def _joined(entries: list[tuple[int, str]]):
    """Lines with their backslash continuations joined."""
    i = 0
    while i < len(entries):
        number, text = entries[i]
        while text.rstrip().endswith("\\") and i + 1 < len(entries):
            i += 1
            text = text.rstrip()[:-1] + " " + entries[i][1].strip()
        yield number, text
        i += 1


def _install(text: str) -> str:
    if re.search(r"\bpip3? install\b|\buv pip\b|\bgit clone\b", text):
        return "an install (pip / git clone): it changes the environment the tests run in"
    return ""


def _world_size(workdir: Path, argument: str) -> int | None:
    """The world size of a plan or spec argument, as the page's earlier commands left it."""
    path = workdir / argument
    if not path.is_file():
        return None
    from mixle_compile.plan import load_plan_text
    from mixle_compile.spec import load_spec

    if path.suffix == ".json" and b'"format_version"' in path.read_bytes()[:4096]:
        return load_plan_text(path.read_bytes()).mesh.degrees["world_size"]
    loaded = load_spec(path)
    devices = loaded.spec.resources.devices if loaded.ok else None
    return devices if isinstance(devices, int) else sum(g.count for g in devices) if devices else None


def _needs(text: str) -> str:
    if "--torchtitan" in text and not (importlib.util.find_spec("torchtitan") and importlib.util.find_spec("triton")):
        return (
            "--torchtitan imports torchtitan's model code, which needs torchtitan and triton (the `torchtitan` extra)"
        )
    if re.search(r"--device(?:s)?[ =]cuda|\bnccl\b", text):
        return "needs a GPU"
    return ""


def collect() -> list[Command]:
    found = []
    for page in PAGES:
        for lang, entries in _blocks(page):
            joined = list(_joined(entries))
            if lang in PROMPTED:
                for k, (number, text) in enumerate(joined):
                    if not text.startswith("$ "):
                        continue
                    command = text[2:].strip()
                    output = []
                    for _, after in joined[k + 1 :]:
                        if after.startswith("$ "):
                            break
                        output.append(after)
                    found += _classify(page, number, command, "\n".join(output))
            elif lang in SCRIPTS:
                # a script that writes its own inputs (a heredoc, a script it runs) is one piece: its
                # commands cannot run alone on files only the rest of it makes
                writes = any(re.search(r"<<-?\s*'?\w+'?\s*$", text) for _, text in joined)
                for number, text in joined:
                    if text.strip() and not text.lstrip().startswith("#"):
                        for c in _classify(page, number, text.strip(), ""):
                            if writes and not c.skip:
                                c = Command(
                                    c.page,
                                    c.line,
                                    c.text,
                                    c.expect,
                                    "the script writes its own inputs first "
                                    "(a heredoc), which the docs test does not run",
                                    c.runtime,
                                )
                            found.append(c)
            else:  # YAML, TOML, text: CI steps and configs, not commands for this shell
                for number, text in joined:
                    step = re.match(r"^\s*(?:-\s*)?run:\s*(?P<cmd>.*mixle-compile.*)$", text)
                    if step:
                        found.append(
                            Command(
                                page,
                                number,
                                step["cmd"],
                                0,
                                skip=_install(step["cmd"])
                                or "a CI workflow step: it runs in the user's repository, on its configs",
                            )
                        )
    return found


def _classify(page: Path, number: int, command: str, output: str) -> list[Command]:
    bare = _ENV.sub("", command)
    install = _install(command)
    if install:
        return [Command(page, number, command, 0, skip=install)]
    if bare.startswith("torchrun "):
        return [
            Command(
                page, number, command, 0, skip="a torchrun launch (several machines or processes started by torchrun)"
            )
        ]
    module = re.match(r"^python3? -m mixle_compile(?P<sub>\.runtime)?\s", bare)
    if not bare.startswith("mixle-compile ") and not module:
        return []  # `. .venv/bin/activate`, `dot -Tsvg ...`: not this tool's commands
    words = bare.split()
    verb = (
        "run"
        if module and module["sub"]
        else (words[3] if module else words[1])
        if len(words) > (3 if module else 1)
        else ""
    )
    expect = 1 if _FAILING.search(output) else 0
    if page.name == "configuration.md" and "configs/" in command:
        # the page's commands run in the reader's own project, whose specs live in configs/:
        # tests/test_configuration_doc.py builds that project and runs each of them there
        return [
            Command(
                page,
                number,
                command,
                expect,
                skip="runs in the reader's project with its configs/ folder, "
                "which tests/test_configuration_doc.py builds and runs it in",
            )
        ]
    return [Command(page, number, command, expect, skip=_needs(command), runtime=verb == "run")]


def _after_runs(commands: list[Command]) -> list[Command]:
    """A command that reads what a page's `run` wrote (its --out or --checkpoint-dir) runs with the runs."""
    out, written = [], {}
    for c in commands:
        places = written.setdefault(c.page, set())
        if not c.runtime and any(place in c.text for place in places):
            c = Command(c.page, c.line, c.text, c.expect, c.skip, runtime=True)
        if c.runtime:
            places.update(m.group(1).rstrip("/") for m in re.finditer(r"--(?:out|checkpoint-dir)[ =](\S+)", c.text))
        out.append(c)
    return out


COMMANDS = _after_runs(collect())


def _params():
    for c in COMMANDS:
        marks = [pytest.mark.slow] if c.runtime else []
        if c.skip:
            marks.append(pytest.mark.skip(reason=c.skip))
        yield pytest.param(c, id=c.id, marks=marks)


class _Pages:
    """One copy of the repository per page, and the page's commands already run in it."""

    def __init__(self, base: Path):
        self.base = base
        self.bin = base / "bin"
        self.bin.mkdir()
        tool = self.bin / "mixle-compile"
        tool.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m mixle_compile "$@"\n')
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
        for name in ("python", "python3"):  # `python -m mixle_compile...` as the pages write it
            shim = self.bin / name
            shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
            shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
        self.copies: dict[Path, Path] = {}
        self.done: dict[Path, set[int]] = {}

    def workdir(self, page: Path) -> Path:
        if page not in self.copies:
            target = self.base / page.stem
            shutil.copytree(
                ROOT, target, ignore=shutil.ignore_patterns(".git", "__pycache__", ".pytest_cache", ".venv", "runs")
            )
            self.copies[page] = target
            self.done[page] = set()
        return self.copies[page]

    def run(self, command: Command) -> subprocess.CompletedProcess:
        workdir = self.workdir(command.page)
        env = {
            **os.environ,
            "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(workdir),
            "MPLBACKEND": "Agg",
        }
        self.done[command.page].add(command.line)
        return subprocess.run(
            ["bash", "-c", command.text],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=900 if command.runtime else 300,
        )

    def prepare(self, command: Command) -> None:
        """Run the page's earlier commands first (once), so that a command finds what they wrote."""
        for earlier in COMMANDS:
            if earlier.page != command.page or earlier.line >= command.line:
                continue
            if (
                earlier.skip
                or (earlier.runtime and not command.runtime)
                or earlier.line in self.done.setdefault(command.page, set())
            ):
                continue
            self.run(earlier)


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    return _Pages(tmp_path_factory.mktemp("docs"))


def test_the_pages_have_commands():
    ids = {c.id.split(":")[0] for c in COMMANDS if not c.skip}
    assert {"README.md", "docs/quickstart.md", "docs/pictures.md"} <= ids
    assert any(c.skip.startswith("an install") for c in COMMANDS)  # the README's installs are listed, not run


def test_indented_code_blocks_are_found_and_list_continuations_are_not(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Text.\n\n    mixle-compile check a.yaml\n    mixle-compile check b.yaml\nAfter.\n\n"
        "- a list item\n\n    its continuation, mixle-compile check c.yaml\n\n```sh\nmixle-compile check d.yaml\n```\n"
    )
    blocks = list(_blocks(page))
    assert blocks == [
        ("", [(3, "mixle-compile check a.yaml"), (4, "mixle-compile check b.yaml")]),
        ("sh", [(12, "mixle-compile check d.yaml")]),
    ]


@pytest.mark.parametrize("command", list(_params()))
def test_documented_command_runs_as_written(pages, command):
    pages.prepare(command)
    if command.runtime:
        words = _ENV.sub("", command.text).split()
        verb_args = words[3:] if words[0].startswith("python") else words[2:]
        argument = next((a for a in verb_args if not a.startswith("-")), None)
        world = _world_size(pages.workdir(command.page), argument) if argument else None
        if world is not None and world > MAX_WORLD:
            pytest.skip(f"a world of {world} ranks (the docs test runs at most {MAX_WORLD})")
    result = pages.run(command)
    tail = (result.stdout + result.stderr)[-3000:]
    assert result.returncode == command.expect, (
        f"{command.id}: `{command.text}` exited {result.returncode}, the page shows {command.expect}:\n{tail}"
    )

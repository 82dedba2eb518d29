"""Real configurations, judged as their engines judge them.

``tests/corpus/production/`` holds configurations that torchtitan, Megatron-LM, Megatron-Bridge and
NeMo publish and run (their configs, example scripts, recipes and benchmark tables), each translated
into a spec with its source (repository, path, commit) in its header; every one must pass `check`
on its engine's backend (warnings allowed). ``tests/corpus/failing/`` holds configurations that
users ran and the engines refused (from the engines' issue trackers and examples), each with the
engine's error in its header and an ``# expect: CODE field ...`` line: `check` must reject it with
that code, naming only fields of that list (the fields in conflict; a minimal conflict may name any
two or more of them). The SOURCES.md beside each set lists every file's origin.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mixle_compile.check import check_file
from mixle_compile.diagnostics import Severity

CORPUS = Path(__file__).parent / "corpus"
PRODUCTION = sorted((CORPUS / "production").glob("*/*.yaml"))
FAILING = sorted((CORPUS / "failing").glob("*.yaml"))
SOURCE = re.compile(r"^# source: .*(@ [0-9a-f]{40}|https://github\.com/\S+/(issues|pull)/\d+|issue #\d+|PR #\d+)", re.M)


def test_the_corpus_is_large_enough_and_every_file_names_its_source():
    assert len(PRODUCTION) >= 40 and len(FAILING) >= 12
    engines = {p.parent.name for p in PRODUCTION}
    assert engines == {"torchtitan", "megatron_lm", "bridge_nemo"}
    for path in PRODUCTION + FAILING:
        assert SOURCE.search(path.read_text()), f"{path.name} names no source (repository, path and commit, or issue)"


@pytest.mark.parametrize("path", PRODUCTION, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_production_config_passes_check_on_its_engine(path):
    result = check_file(path)
    errors = [d.text() for d in result.diagnostics if d.severity is Severity.error]
    assert not result.unreadable and not errors, errors


@pytest.mark.parametrize("path", FAILING, ids=lambda p: p.stem)
def test_every_failing_config_is_rejected_naming_its_fields(path):
    code, *fields = re.search(r"^# expect: (.+)$", path.read_text(), re.M).group(1).split()
    result = check_file(path)
    found = [d for d in result.diagnostics if d.code == code and d.severity is Severity.error]
    assert found, f"{path.name}: expected {code}, got {[d.code for d in result.diagnostics]}"
    named = set(found[0].fields)
    assert named <= set(fields) and len(named) >= min(2, len(fields)), (
        f"{path.name}: {code} names {sorted(named)}, expected among {fields}"
    )

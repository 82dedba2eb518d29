"""One mistake, one finding: findings at one field are grouped, and every hint offers only values
that pass every error rule; --suggest from `dp_shard: auto`, without trading an error for a new
warning, saying when nothing is found, with progress when it is slow."""

from __future__ import annotations

import json
import re

import pytest

import mixle_compile.check as check
from mixle_compile import cli
from mixle_compile.check import check_file
from tests.conftest import EXAMPLES

QUICKSTART = (EXAMPLES / "tiny-transformer.yaml").read_text()
LLAMA = (EXAMPLES / "llama3-8b-hsdp-tp.yaml").read_text()


def run_cli(capsys, *argv):
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def spec(tmp_path, text, name="spec.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_tp_3_in_the_quickstart_is_one_finding(capsys, tmp_path):
    path = spec(tmp_path, QUICKSTART.replace("  tp: 2\n", "  tp: 3\n"))
    status, out, _ = run_cli(capsys, "check", path)
    assert status == 1 and out.count(f"{path}:") == 1 and "Found 1 error in 1 of 1 file." in out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("  also:")] == [
        "T001",
        "T002",
        "T004",
        "T005",
    ]
    assert "hint: set mesh.tp to 2: the one value that passes every rule" in out
    status, out, _ = run_cli(capsys, "check", "--format", "json", path)
    (finding,) = json.loads(out)
    assert finding["code"] == "D001" and [r["code"] for r in finding["related"]] == ["T001", "T002", "T004", "T005"]
    assert all(r["line"] == finding["line"] and r["fields"][0] == "mesh.tp" for r in finding["related"])


def test_findings_at_different_fields_stay_apart(capsys, tmp_path):
    path = spec(
        tmp_path, QUICKSTART.replace("  tp: 2\n", "  tp: 3\n").replace("global_batch_size: 8", "global_batch_size: 12")
    )
    found = json.loads(run_cli(capsys, "check", "--format", "json", path)[1])
    assert [d["fields"][0] for d in found] == ["mesh.tp", "training.global_batch_size"]


def offered(hint: str) -> list[int]:
    match = re.match(r"set mesh\.(\w+) to ([0-9, or]+):", hint)
    assert match, hint
    return [int(v) for v in re.findall(r"\d+", match.group(2))]


@pytest.mark.parametrize("tp", [3, 6])
def test_every_value_a_hint_offers_passes_every_rule(tmp_path, tp):
    """For tp 6, T004 alone would offer any divisor of the FFN size; the hint offers what also
    divides the heads and fits the devices, and the spec with it checks clean."""
    text = re.sub(r"  dp_shard: auto[^\n]*\n", "  dp_shard: 4\n", LLAMA).replace("  tp: 8\n", f"  tp: {tp}\n")
    result = check_file(spec(tmp_path, text))
    tp_findings = [d for d in result.diagnostics if d.fields and d.fields[0] == "mesh.tp"]
    (finding,) = tp_findings  # one finding for the field, however many rules it breaks
    values = offered(finding.hint)
    assert values == [8]  # 64 devices = 2 * 4 * tp: only 8, which divides the 32 heads
    for value in values:
        fixed = check_file(spec(tmp_path, text.replace(f"  tp: {tp}\n", f"  tp: {value}\n"), f"fixed-{value}.yaml"))
        assert fixed.errors == 0, [d.text() for d in fixed.diagnostics]


def test_suggest_works_from_dp_shard_auto(capsys, tmp_path):
    text = LLAMA.replace("  tp: 8\n", "  tp: 6\n")  # S012: 64 devices are no multiple of 2*6
    path = spec(tmp_path, text)
    status, out, _ = run_cli(capsys, "check", "--suggest", path)
    assert status == 1 and "S012" in out
    assert "hint: what passes every rule, the other fields as they are: mesh.tp: 8" in out
    assert "mesh:\n  tp: 8  # was 6\n# mesh.dp_shard: auto now resolves to 4" in out
    status, out, _ = run_cli(capsys, "check", "--fix", path)
    assert status == 0 and path.read_text() == LLAMA


def test_suggest_says_when_nothing_is_found_and_why(capsys):
    status, out, _ = run_cli(capsys, "check", "--suggest", EXAMPLES / "invalid" / "s012-auto-unresolvable.yaml")
    assert status == 1 and "no valid plan on the same devices changes at most 4" in out
    assert "hint: what passes every rule, the other fields as they are: 8 devices" in out  # not 4: B001 would fail
    status, out, _ = run_cli(capsys, "check", "--suggest", EXAMPLES / "invalid" / "s003-unknown-key.yaml")
    assert status == 1 and "no suggestion: the spec did not load" in out
    status, out, _ = run_cli(
        capsys, "check", "--format", "json", "--suggest", EXAMPLES / "invalid" / "s012-auto-unresolvable.yaml"
    )
    (finding,) = json.loads(out)
    assert finding["fix"] == {"file": str(EXAMPLES / "invalid" / "s012-auto-unresolvable.yaml"), "found": False}


def test_suggest_does_not_trade_an_error_for_a_new_warning(tmp_path):
    """B001 (8 != 1*8*2): microbatches 4 would fix it in one change but leave a 4-microbatch, 2-stage
    pipeline idle a large part of each step (P008); a two-change plan without the warning exists."""
    text = (
        "model: {family: transformer, vocab_size: 256, hidden_size: 64, num_layers: 4, num_heads: 4, "
        "ffn_hidden_size: 128}\n"
        "mesh: {dp_shard: 2, pp: 2, microbatches: 8}\n"
        "training: {global_batch_size: 8, micro_batch_size: 1, seq_len: 32}\n"
        "backend: torch\nresources: {devices: 4, memory: 2GiB}\n"
    )
    result = check_file(spec(tmp_path, text), suggest=True)
    assert [d.code for d in result.diagnostics] == ["B001"]
    s = result.suggestion
    assert s is not None and s.new_warnings == () and len(s.changes) == 2
    assert "microbatches" not in {c.field.symbol for c in s.changes}
    from mixle_compile.spec import load_spec
    from mixle_compile.verify import plan_facts
    from mixle_compile.verify.suggest import _fix_rules, _search

    facts = plan_facts(load_spec(tmp_path / "spec.yaml").spec)
    errors_only = _search(facts, _fix_rules(facts))  # what the search gave before: one change, a new P008
    assert [(c.field.symbol, c.value) for c in errors_only.changes] == [("microbatches", 4)]


def test_a_search_past_its_deadline_returns_undecided_at_once(tmp_path, monkeypatch):
    """Every solver call of a search shares one deadline: once it has passed, the calls answer
    unknown, and the search ends with what it has, marked as not proved nearest."""
    import time

    from mixle_compile.spec import load_spec
    from mixle_compile.verify import plan_facts
    from mixle_compile.verify import suggest as search

    spec(tmp_path, QUICKSTART.replace("  tp: 2\n", "  tp: 3\n"))
    facts = plan_facts(load_spec(tmp_path / "spec.yaml").spec)
    assert search.nearest_valid_plan(facts).proved_nearest
    started = time.monotonic()
    assert search._search(facts, search._fix_rules(facts), search._Clock(0.0)).out_of_time
    assert time.monotonic() - started < 5
    # A deadline that passes at the first plan found: that plan is offered, not claimed nearest.
    real_check = search._Clock.check

    def expire_at_first_plan(self, solver):
        result = real_check(self, solver)
        if result == search.z3.sat:
            self.deadline = 0.0
        return result

    monkeypatch.setattr(search._Clock, "check", expire_at_first_plan)
    late = search.nearest_valid_plan(facts)
    assert late is not None and not late.proved_nearest
    monkeypatch.setattr(search._Clock, "check", real_check)
    monkeypatch.setattr(search, "SEARCH_DEADLINE_S", 0.0)
    assert search.passing_values(facts, "tp") == []  # no value could be shown to pass, so none is offered
    late = search.nearest_valid_plan(facts)
    assert late.out_of_time and late.changes == () and not late.proved_nearest
    result = check_file(tmp_path / "spec.yaml", suggest=True)
    assert "ran out of time before it found one (10 s a solver call, 0 s in all)" in cli._suggestion_text(result)
    assert cli._suggestion_dict(result) == {"file": result.file, "found": False, "out_of_time": True}


def test_a_slow_search_says_so_on_standard_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(check, "PROGRESS_AFTER", 0.0)
    path = spec(tmp_path, QUICKSTART.replace("  tp: 2\n", "  tp: 3\n"))
    status, out, err = run_cli(capsys, "check", "--suggest", path)
    assert status == 1 and "tp: 2  # was 3" in out
    assert f"{path}: searching for the nearest valid plan...\n" in err and re.search(r"done in \d+\.\d s", err)
    monkeypatch.setattr(check, "PROGRESS_AFTER", 600.0)
    assert run_cli(capsys, "check", "--suggest", path)[2] == ""

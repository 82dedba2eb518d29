"""The same condition exits the same in every verb: a spec with errors 1, a missing file 2, a
tampered plan 2 (0 clean, 1 findings, 2 unusable input, 3 internal error; see mixle_compile/cli.py)."""

from __future__ import annotations

import pytest

from mixle_compile.cli import main
from tests.conftest import EXAMPLES

GOOD = EXAMPLES / "tiny-transformer.yaml"
REJECTED = EXAMPLES / "invalid" / "t001-heads-split-by-tp.yaml"  # loads; the verifier finds T001
UNLOADABLE = EXAMPLES / "invalid" / "s003-unknown-key.yaml"  # does not load: an unknown key
EXPORTABLE = EXAMPLES / "llama3-8b-hsdp-tp.yaml"  # a spec torchtitan's config can say


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("exit-codes")
    plan = folder / "good.plan.json"
    assert main(["compile", str(GOOD), "-o", str(plan)]) == 0
    raw = bytearray(plan.read_bytes())
    raw[200] ^= 0x01  # one flipped bit: the content digest no longer matches
    tampered = folder / "tampered.plan.json"
    tampered.write_bytes(bytes(raw))
    return {
        "valid spec": str(GOOD),
        "plan": str(plan),
        "rejected spec": str(REJECTED),
        "unloadable spec": str(UNLOADABLE),
        "missing file": str(folder / "missing.yaml"),
        "tampered plan": str(tampered),
    }


# Each verb with the input in the {} place (diff compares it with a valid spec).
VERBS = {
    "check": ["check", "{}"],
    "compile": ["compile", "{}", "-o", "{out}"],
    "explain": ["explain", "{}"],
    "diff": ["diff", "{}", str(GOOD)],
    "export": ["export", "{}", "--to", "torchtitan"],
    "graph": ["graph", "{}"],
}
EXPECTED = {  # condition -> status, for every verb
    "rejected spec": 1,
    "unloadable spec": 1,
    "missing file": 2,
    "tampered plan": 2,
}


@pytest.mark.parametrize("condition", sorted(EXPECTED))
@pytest.mark.parametrize("verb", sorted(VERBS))
def test_the_same_condition_exits_the_same_in_every_verb(capsys, inputs, tmp_path, verb, condition):
    argv = [a.format(inputs[condition], out=tmp_path / "out.json") for a in VERBS[verb]]
    status = main(argv)
    _, err = capsys.readouterr()
    assert status == EXPECTED[condition], (argv, err)
    assert "Traceback" not in err and "internal error" not in err


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_a_valid_input_exits_0(capsys, inputs, tmp_path, verb):
    given = {"explain": inputs["plan"], "export": str(EXPORTABLE)}.get(verb, inputs["valid spec"])
    argv = [a.format(given, out=tmp_path / "out.json") for a in VERBS[verb]]
    assert main(argv) == 0, capsys.readouterr().err


@pytest.mark.parametrize("condition", sorted(EXPECTED))
def test_run_refuses_with_the_same_status(capsys, inputs, tmp_path, condition):
    """`run` refuses before any rank starts, with the status the other verbs give."""
    status = main(["run", inputs[condition], "--out", str(tmp_path / "run"), "--quiet"])
    _, err = capsys.readouterr()
    assert status == EXPECTED[condition], err
    assert "Traceback" not in err


def test_graph_of_a_rejected_spec_draws_the_model_and_exits_as_check_does(capsys, tmp_path):
    """The model is drawn whatever the verdict; the status and the findings are check's."""
    out = tmp_path / "graph.dot"
    assert main(["check", str(REJECTED)]) == 1
    checked = capsys.readouterr().out
    assert main(["graph", str(REJECTED), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert out.read_text(encoding="utf-8").startswith("digraph")
    assert "T001" in err and "T001" in checked
    assert main(["graph", str(GOOD)]) == 0
    assert "T001" not in capsys.readouterr().err


# Every verb that writes a file, with the file in the {out} place.
WRITERS = {
    "compile": ["compile", str(GOOD), "-o", "{out}"],
    "graph": ["graph", str(GOOD), "-o", "{out}"],
    "schema": ["schema", "-o", "{out}"],
    "schema --plan": ["schema", "--plan", "-o", "{out}"],
    "export": ["export", str(EXPORTABLE), "--to", "torchtitan", "-o", "{out}"],
}


@pytest.mark.parametrize("verb", sorted(WRITERS))
def test_an_output_that_cannot_be_written_exits_2_with_the_reason(capsys, tmp_path, verb):
    blocker = tmp_path / "a-file"
    blocker.write_text("", encoding="utf-8")
    out = blocker / "out.txt"  # under a file, not a folder: no one can write it
    status = main([a.format(out=out) for a in WRITERS[verb]])
    _, err = capsys.readouterr()
    assert status == 2, err
    assert f"error: cannot write {out}" in err, err
    assert "Traceback" not in err and "internal error" not in err


@pytest.mark.parametrize("verb", sorted(WRITERS))
def test_an_output_that_can_be_written_is(capsys, tmp_path, verb):
    out = tmp_path / "out.txt"
    assert main([a.format(out=out) for a in WRITERS[verb]]) == 0, capsys.readouterr().err
    assert out.stat().st_size > 0

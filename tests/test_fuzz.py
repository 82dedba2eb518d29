"""Fuzzing `mixle-compile check`: bad input never crashes and never lies.

Random well-formed specs and mutated ones (wrong types, negatives, zero, 10**30, floats and bools
for integers, missing and unknown keys, duplicate keys, deep nesting, `ref:` cycles, non-UTF-8
bytes, empty files, YAML alias bombs, very large files) go through the real command. It must
never print a traceback, must exit 0, 1 or 2, and every finding must carry a code and a location.

The quick subset runs in CI; the full run (10,000 cases) is marked slow and also runs as a script:

    python tests/test_fuzz.py [CASES] [SEED]

which prints the number of cases, internal errors (tracebacks) and the slowest case.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mixle_compile import cli  # noqa: E402

EXAMPLES = ROOT / "examples"
SEEDS = [yaml.safe_load(p.read_text()) for p in sorted(EXAMPLES.glob("*.yaml"))]

WEIRD_VALUES = [
    0,
    -1,
    -(10**30),
    10**30,
    2**63,
    1.5,
    8.0,
    float("inf"),
    True,
    False,
    None,
    "",
    "8",
    "auto",
    "x" * 300,
    "80 gigs",
    "80GiB",
    [],
    {},
    [1, 2],
    {"a": 1},
    "\u0000",
    "\u202e",
    "ÿ",
    -0.0,
]
KEYS = [
    "model",
    "mesh",
    "training",
    "backend",
    "resources",
    "elastic",
    "family",
    "tp",
    "dp_shard",
    "dp_replicate",
    "pp",
    "cp",
    "ep",
    "etp",
    "type",
    "ref",
    "shared",
    "root",
    "devices",
    "memory",
    "components",
    "repeat",
    "num_heads",
    "seq_len",
    "global_batch_size",
    "dp_shards",
    "unknown",
    "<<",
    "on",
]


@dataclass(frozen=True)
class Case:
    name: str
    data: bytes
    suffix: str


#: How deep the mutations reach: nesting grows documents by up to 80 levels a mutation, and listing
#: every path of a document thousands of levels deep takes memory quadratic in its depth.
MUTATION_DEPTH = 64


def _paths(node, prefix=()):
    """The paths of the document down to MUTATION_DEPTH, in pre-order; iterative, since the fuzzer
    nests values deeper than Python's recursion limit."""
    stack = [(node, prefix)]
    while stack:
        node, prefix = stack.pop()
        yield prefix
        if len(prefix) >= MUTATION_DEPTH:
            continue
        if isinstance(node, dict):
            stack.extend(((v, (*prefix, k)) for k, v in reversed(list(node.items()))))
        elif isinstance(node, list):
            stack.extend(((v, (*prefix, i)) for i, v in reversed(list(enumerate(node)))))


def _get(node, path):
    for p in path:
        node = node[p]
    return node


def _mutate_tree(rng: random.Random, doc):
    doc = copy.deepcopy(doc)
    for _ in range(rng.randint(1, 4)):
        paths = [p for p in _paths(doc) if p]
        if not paths:
            break
        path = rng.choice(paths)
        parent = _get(doc, path[:-1])
        key = path[-1]
        action = rng.choice(["replace", "replace", "delete", "unknown", "nest", "ref"])
        if action == "replace":
            parent[key] = copy.deepcopy(rng.choice(WEIRD_VALUES))
        elif action == "delete":
            del parent[key]
        elif action == "unknown" and isinstance(parent, dict):
            parent[rng.choice(KEYS) + rng.choice(["", "s", "_x"])] = rng.choice(WEIRD_VALUES)
        elif action == "nest":
            value = parent[key]
            for _ in range(rng.randint(1, 80)):
                value = rng.choice([[value], {"type": "mixture", "components": [value]}])
            parent[key] = value
        elif action == "ref":
            parent[key] = {"ref": rng.choice(["a", "b", "missing"])}
    if rng.random() < 0.2 and isinstance(doc.get("model"), dict):  # a ref cycle
        doc["model"]["shared"] = {"a": {"type": "mixture", "components": [{"ref": "b"}]}, "b": {"ref": "a"}}
    return doc


def _dump(rng: random.Random, doc) -> tuple[bytes, str]:
    if rng.random() < 0.3:
        try:
            return json.dumps(doc, allow_nan=True).encode(), ".json"
        except (TypeError, ValueError):
            pass
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=rng.random() < 0.5).encode(), ".yaml"


def _mutate_bytes(rng: random.Random, raw: bytes) -> bytes:
    raw = bytearray(raw)
    for _ in range(rng.randint(1, 6)):
        if not raw:
            break
        at = rng.randrange(len(raw))
        action = rng.choice(["flip", "insert", "delete", "truncate", "duplicate_line"])
        if action == "flip":
            raw[at] ^= 1 << rng.randrange(8)
        elif action == "insert":
            raw[at:at] = rng.choice(
                [
                    b"{",
                    b"]",
                    b":",
                    b"\t",
                    b"&a ",
                    b"*a",
                    b"- ",
                    b"!!python/object:os.system ",
                    b"'",
                    b"\xff\xfe",
                    b"\x00",
                    b"<<: *a\n",
                ]
            )
        elif action == "delete":
            del raw[at : at + rng.randint(1, 20)]
        elif action == "truncate":
            del raw[at:]
        else:
            lines = bytes(raw).split(b"\n")
            i = rng.randrange(len(lines))
            lines.insert(i, lines[i])
            raw = bytearray(b"\n".join(lines))
    return bytes(raw)


def _special(rng: random.Random, i: int) -> Case:
    kind = i % 7
    if kind == 0:
        return Case("empty", b"", ".yaml")
    if kind == 1:
        levels = ["a: &a [" + ", ".join(["x"] * 9) + "]"]
        for p, c in zip("abcdefgh", "bcdefghi", strict=True):
            levels.append(f"{c}: &{c} [" + ", ".join([f"*{p}"] * 9) + "]")
        return Case("alias-bomb", "\n".join(levels).encode(), ".yaml")
    if kind == 2:
        depth = rng.randint(60, 3000)
        return Case("deep-nesting", ("a: " + "[" * depth + "]" * depth).encode(), rng.choice([".yaml", ".json"]))
    if kind == 3:
        return Case("very-large", b"model: {family: transformer}\n" + b"# " + b"x" * (9 * 1024 * 1024), ".yaml")
    if kind == 4:
        return Case("non-utf8", bytes(rng.randrange(256) for _ in range(rng.randint(1, 400))), ".yaml")
    if kind == 5:
        return Case("many-keys", ("\n".join(f"k{j}: {j}" for j in range(50_000))).encode(), ".yaml")
    return Case("json-garbage", b'{"model": ' * rng.randint(1, 500), ".json")


def generate(cases: int, seed: int = 0):
    rng = random.Random(seed)
    for i in range(cases):
        roll = rng.random()
        if roll < 0.04:
            yield _special(rng, i)
            continue
        doc = rng.choice(SEEDS)
        if roll < 0.15:
            raw, suffix = _dump(rng, doc)  # well-formed
            yield Case("valid", raw, suffix)
            continue
        raw, suffix = _dump(rng, _mutate_tree(rng, doc))
        if rng.random() < 0.35:
            raw = _mutate_bytes(rng, raw)
        yield Case("mutated", raw, suffix)


@dataclass
class Outcome:
    cases: int = 0
    internal_errors: int = 0
    bad_exit: int = 0
    unlocated: int = 0
    slowest: float = 0.0
    slowest_case: str = ""
    failures: list | None = None


def run_case(case: Case, directory: Path) -> tuple[int, str, str, float]:
    path = directory / f"spec{case.suffix}"
    path.write_bytes(case.data)
    out, err = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(["check", "--format", "json", str(path)])
    return status, out.getvalue(), err.getvalue(), time.perf_counter() - start


def fuzz(cases: int, seed: int, directory: Path) -> Outcome:
    outcome = Outcome(failures=[])
    for case in generate(cases, seed):
        status, out, err, seconds = run_case(case, directory)
        outcome.cases += 1
        if seconds > outcome.slowest:
            outcome.slowest, outcome.slowest_case = seconds, f"{case.name} ({len(case.data):,} bytes)"
        problem = None
        if status == 3 or "Traceback" in out + err:
            outcome.internal_errors += 1
            problem = f"internal error: {err.strip()[:300]}"
        elif status not in (0, 1, 2):
            outcome.bad_exit += 1
            problem = f"exit {status}"
        else:
            findings = json.loads(out)
            if status in (1, 2) and not findings:
                problem = "a failing exit without a finding"
            for f in findings:
                if not (f["code"] and f["file"] and f["line"] >= 1 and f["column"] >= 1 and f["message"]):
                    problem = f"finding without code or location: {f}"
            if problem:
                outcome.unlocated += 1
        if problem:
            outcome.failures.append((case.name, problem, case.data[:500]))
    return outcome


def test_fuzz_quick(tmp_path):
    outcome = fuzz(300, seed=1, directory=tmp_path)
    assert outcome.failures == [], outcome.failures[:3]
    assert outcome.cases == 300


@pytest.mark.slow
def test_fuzz_full(tmp_path):
    outcome = fuzz(10_000, seed=2, directory=tmp_path)
    assert outcome.failures == [], outcome.failures[:3]


def test_cli_subprocess_prints_no_traceback_on_hostile_input(tmp_path):
    import subprocess

    for i, case in enumerate([_special(random.Random(i), i) for i in range(7)]):
        path = tmp_path / f"s{i}{case.suffix}"
        path.write_bytes(case.data)
        proc = subprocess.run(
            [sys.executable, "-m", "mixle_compile", "check", str(path)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
        assert proc.returncode in (1, 2), (case.name, proc.returncode, proc.stderr)
        assert "Traceback" not in proc.stdout + proc.stderr, case.name


if __name__ == "__main__":
    import tempfile

    count = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = fuzz(count, seed, Path(tmp))
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    print(f"cases: {result.cases}")
    print(f"internal errors (tracebacks): {result.internal_errors}")
    print(f"bad exit statuses: {result.bad_exit}; findings without code or location: {result.unlocated}")
    print(f"slowest case: {result.slowest * 1e3:.0f} ms ({result.slowest_case})")
    print(f"total: {time.perf_counter() - started:.0f} s; peak resident memory: {peak / 2**20:.0f} MiB")
    for name, problem, data in (result.failures or [])[:5]:
        print(f"FAILED {name}: {problem}\n  input: {data[:200]!r}")
    sys.exit(1 if result.failures else 0)

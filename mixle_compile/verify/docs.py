"""Rendering the code catalogue: `mixle-compile rules`, `mixle-compile explain`, docs/rules.md.

Everything here reads the catalogue (the spec's S codes and the verifier's rules); nothing builds a
constraint, so none of it imports z3.
"""

from __future__ import annotations

import importlib
import json
import pkgutil

from mixle_compile.diagnostics import CATALOGUE, Code, Severity
from mixle_compile.spec import codes as _spec_codes  # noqa: F401  (registers the S codes)
from mixle_compile.spec.kinds import Engine, Family
from mixle_compile.verify.rule import RULE_SETS, RULES, Rule
from mixle_compile.verify.rules import RULES as _RULES  # noqa: F401  (defines every rule)

TOPICS = {
    "D": "Devices, world size and elastic ranges",
    "E": "Expert parallelism",
    "T": "Tensor-parallel shapes",
    "P": "Pipeline parallelism",
    "B": "Batch arithmetic",
    "Q": "Sequence length: context and sequence parallelism",
    "C": "Backend capabilities",
    "R": "Device memory",
}


PASSES = {
    "G": "Decomposition graph and model cut",
    "L": "Lowering",
    "M": "Suppression comments",
}
PASS_LABELS = {"G": "decompose", "L": "lower", "M": "suppression"}  # the pass, in the `rules` listing


def load_catalogue() -> None:
    """Import every pass so that each code it registers is in the catalogue (not the torch runtime)."""
    import mixle_compile

    for module in pkgutil.walk_packages(mixle_compile.__path__, "mixle_compile."):
        if module.name.startswith("mixle_compile.runtime") or module.name.endswith("__main__"):
            continue
        importlib.import_module(module.name)


def spec_codes() -> list[Code]:
    return [c for code, c in sorted(CATALOGUE.items()) if code.startswith("S")]


def pass_codes() -> list[Code]:
    """Codes of the other passes (neither spec checks nor verifier rules)."""
    return [c for code, c in sorted(CATALOGUE.items()) if not code.startswith("S") and code not in RULES]


def rules_in(rule_set: str | None) -> list[Rule]:
    return [r for r in RULES.values() if rule_set is None or r.in_rule_set(rule_set)]


def _families(rule: Rule) -> str:
    return ", ".join(f for f in Family if f in rule.families)


def rules_text(rule_set: str | None = None) -> str:
    load_catalogue()
    lines = []
    rules = rules_in(rule_set)
    width = max([15, *(len(r.engines_text) for r in rules)])
    for c in spec_codes():
        lines.append(f"{c.code}  {'error':7}  {'spec':{width}}  {c.title}: {c.summary}")
    for c in pass_codes():
        lines.append(
            f"{c.code}  {c.severity.value:7}  {PASS_LABELS.get(c.code[0], 'pass'):{width}}  {c.title}: {c.summary}"
        )
    for r in rules:
        lines.append(f"{r.code}  {r.severity.value:7}  {r.engines_text:{width}}  {r.name}: {r.title}")
    return "\n".join(lines) + "\n"


def rules_json(rule_set: str | None = None) -> str:
    load_catalogue()
    entries = [
        {
            "code": c.code,
            "name": c.title,
            "severity": c.severity.value,
            "kind": kind,
            "title": c.summary,
            "docs": c.docs,
        }
        for kind, group in (("spec", spec_codes()), ("pass", pass_codes()))
        for c in group
    ]
    for r in rules_in(rule_set):
        entries.append(
            {
                "code": r.code,
                "name": r.name,
                "severity": r.severity.value,
                "kind": "rule",
                "rule_sets": [e for e in RULE_SETS if r.in_rule_set(e)],
                "versions": {name: bound for name, bound in r.versions},
                "entries": sorted(r.entries) if r.entries is not None else None,
                "families": sorted(r.families),
                "title": r.title,
                "docs": r.docs,
                "engine_reference": r.engine_reference,
            }
        )
    return json.dumps(entries, indent=2) + "\n"


def explain_text(code: str) -> str | None:
    """The documentation of one code, or None when no such code exists."""
    rule = RULES.get(code)
    if rule is not None:
        sets = _sets_text(rule)
        return (
            f"{rule.code} {rule.name} ({rule.severity.value}; rule sets: {sets}; models: {_families(rule)})\n\n"
            f"{rule.title}\n\n{rule.docs}\n\nSource: {rule.engine_reference}\n"
        )
    if code not in CATALOGUE:
        load_catalogue()
    entry = CATALOGUE.get(code)
    if entry is None:
        return None
    kind = "spec check" if code.startswith("S") else PASSES.get(code[0], "pass").lower()
    return f"{entry.code} {entry.title} ({entry.severity.value}; {kind})\n\n{entry.summary}\n\n{entry.docs}\n"


def _mark(rule: Rule, rule_set: str) -> str:
    if not rule.in_rule_set(rule_set):
        return ""
    bounds = [b for n, b in rule.versions if n == rule_set]
    text = " ".join(["yes", *bounds])
    if rule_set == Engine.MEGATRON and rule.entries is not None:
        text += " (" + "/".join(sorted(rule.entries)) + ")"
    return text


def _sets_text(rule: Rule) -> str:
    """The rule sets a rule is in, with the versions and front ends it holds for."""
    out = []
    for name in RULE_SETS:
        mark = _mark(rule, name)
        if mark:
            out.append(name + mark[3:])
    return ", ".join(out)


def rules_markdown() -> str:
    load_catalogue()
    out = [
        "# Diagnostic codes",
        "",
        "<!-- Generated by `mixle-compile rules --format markdown`; edit the rules, not this file. -->",
        "",
        "Every code `mixle-compile check` can report, with what it checks and why. Codes are stable: "
        "once published, a code keeps its meaning. `mixle-compile explain CODE` prints one entry.",
        "",
        "**Errors and warnings.** An error means the plan cannot run as written (or not on the chosen "
        "backend); any error makes `check` exit with status 1. A warning means the plan runs but "
        "something deserves a look (P008, the pipeline bubble, and Q004, a setting Megatron-LM turns "
        "off); warnings are printed but do "
        "not change the exit status.",
        "",
        "**Rule sets.** Engines differ, so each backend is checked with its own rule set: `torch` (the "
        "in-tree runtime), `torchtitan` (torchtitan 0.2, the TOML-era releases, and 0.3) and `megatron` "
        "(Megatron-Core 0.12 to 0.16, through Megatron-LM's arguments or its config classes). A rule may "
        "hold for some versions of an engine only (`megatron <0.16`) or for one front end (`megatron "
        '(arguments)`); `backend: {name: megatron, version: "0.15", entry: core}` picks them, and a bare '
        "name means the newest version. A backend registered under another name is checked with the "
        "`common` set: the rules every engine shares, plus its declared capabilities (C0xx).",
        "",
        "**Conflicts.** A rule's message names a minimal set of conflicting fields: the solver's unsat core "
        "over one pin per field, shrunk until no field can be dropped, so every field named is part of the "
        "problem. (Should the solver fail to decide a drop within its resource limit, the field stays: the "
        "set still conflicts, it may just not be the smallest.) The position is the first field's.",
        "",
        "**Suggestions.** `check --suggest` prints the nearest valid plan on the same devices as a YAML "
        "patch: fewest fields changed, then the smallest total change. It changes only how to train (mesh "
        "degrees, micro-batching, schedule, checkpointing, sequence parallelism, the distributed optimizer, "
        "precision), never the model, the devices, the backend, the global batch size or the sequence "
        "length, and offers no plan that needs more than four changes. Errors about the elastic section "
        "(D002, D003, D004, C005) are left to their hints.",
        "",
        "| code | name | severity | torch | torchtitan | megatron | common |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in RULES.values():
        marks = " | ".join(_mark(r, s) for s in RULE_SETS)
        out.append(f"| [{r.code}](#{r.code.lower()}-{r.name}) | {r.name} | {r.severity.value} | {marks} |")
    out += ["", "## Spec checks (S)", "", "Reading and schema validation of the spec file itself.", ""]
    for c in spec_codes():
        out += [f"### {c.code} {c.title}", "", f"*{c.summary}*", "", c.docs, ""]
    topic = None
    for r in RULES.values():
        if r.code[0] != topic:
            topic = r.code[0]
            out += [f"## {topic}: {TOPICS[topic]}", ""]
        severity = "Error" if r.severity is Severity.error else "Warning"
        sets = _sets_text(r)
        out += [
            f"### {r.code} {r.name}",
            "",
            f"{severity} · rule sets: {sets} · models: {_families(r)}",
            "",
            f"*{r.title}*",
            "",
            r.docs,
            "",
            f"Source: {r.engine_reference}",
            "",
        ]
    out += [
        "## Other passes",
        "",
        "Codes the compiler's later passes report (`compile`), listed here so that every code is documented.",
        "",
    ]
    letter = None
    for c in pass_codes():
        if c.code[0] != letter:
            letter = c.code[0]
            out += [f"### {letter}: {PASSES.get(letter, 'Other')}", ""]
        out += [f"#### {c.code} {c.title}", "", f"*{c.summary}*", "", c.docs, ""]
    return "\n".join(out).rstrip() + "\n"

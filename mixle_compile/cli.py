"""Command line: parse arguments, call one pass per verb, print, return an exit status.

Exit statuses: 0 clean, 1 violations found, 2 usage error or unreadable input, 3 internal error
(reported in one line, never as a traceback). The same condition exits the same in every verb
(tests/test_exit_codes.py): a spec with errors 1, a file that cannot be read 2, a plan that fails
its digest or schema (tampered, truncated) 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from mixle_compile import __version__

EXIT_CLEAN, EXIT_VIOLATIONS, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # usage errors: one line and exit 2, as argparse does
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mixle-compile", description="Compile and statically verify distributed training plans.")
    parser.add_argument("--version", action="version", version=f"mixle-compile {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    check = sub.add_parser("check", help="validate spec files and report diagnostics")
    check.add_argument(
        "files",
        nargs="*",
        metavar="PATH",
        help="spec files (.yaml, .yml or .json), engine configs (torchtitan .toml, Megatron-LM .sh, DeepSpeed .json), "
        "directories (the files their configuration's `files` patterns select), globs, or - for standard input",
    )
    check.add_argument(
        "--format", choices=("text", "json", "sarif"), default="text", help="output format (default: text)"
    )
    check.add_argument(
        "--suggest",
        action="store_true",
        help="for a file with errors, print the nearest valid settings on the same devices as a YAML patch",
    )
    check.add_argument(
        "--fix",
        action="store_true",
        help="write the suggested settings into each YAML spec (comments and layout kept), then check again",
    )
    check.add_argument(
        "--diff", action="store_true", help="print the --fix edit of each file as a unified diff instead of writing it"
    )
    check.add_argument(
        "--select",
        action="append",
        metavar="CODES",
        help="report only these codes or prefixes, comma-separated (T001,P or ALL); replaces the "
        "configuration's select",
    )
    check.add_argument(
        "--ignore",
        action="append",
        metavar="CODES",
        help="never report these codes or prefixes; adds to the configuration's ignore",
    )
    check.add_argument(
        "--warnings-as-errors", action="store_true", help="count warnings as errors (exit 1 on any finding)"
    )
    check.add_argument(
        "--config",
        type=Path,
        metavar="TOML",
        help="use this mixle-compile.toml or pyproject.toml instead of the one found upward from each file",
    )
    check.add_argument(
        "--stdin-filename",
        metavar="NAME",
        help="the name a spec read from standard input (-) is reported under, and where its configuration is "
        "found from",
    )
    _import_arguments(check)
    check.set_defaults(run=_cmd_check)

    rules = sub.add_parser("rules", help="list every diagnostic code and verifier rule")
    rules.add_argument("--backend", metavar="NAME", help="only the rules of this backend's rule set")
    rules.add_argument(
        "--format", choices=("text", "markdown", "json"), default="text", help="output format (default: text)"
    )
    rules.set_defaults(run=_cmd_rules)

    explain = sub.add_parser(
        "explain",
        help="explain a diagnostic code, a spec's or plan's memory, traffic, pipeline and model cut, or a checkpoint",
    )
    explain.add_argument(
        "target",
        metavar="CODE|FILE|CHECKPOINT",
        help="a diagnostic code such as T002, a spec file, a compiled plan, or a checkpoint directory (a "
        "run's checkpoint root or one step-NNNNNNNN)",
    )
    explain.add_argument(
        "--format", choices=("text", "json"), default="text", help="output format for files (default: text)"
    )
    explain.add_argument(
        "--plot",
        type=Path,
        metavar="OUT.png|svg",
        help="also draw memory per rank, traffic per axis and the pipeline timeline (needs the `plot` extra)",
    )
    explain.add_argument(
        "--ranks",
        type=int,
        nargs="?",
        const=8,
        metavar="N",
        help="also list the concrete ranks of the first N groups of every group rule (default 8); plans keep "
        "groups symbolic otherwise",
    )
    _import_arguments(explain)
    explain.set_defaults(run=_cmd_explain)

    compile_ = sub.add_parser("compile", help="verify a spec and write its executable plan")
    compile_.add_argument("spec", metavar="SPEC", help="spec file (.yaml, .yml or .json)")
    compile_.add_argument(
        "-o", "--output", type=Path, metavar="PLAN", help="where to write the plan (default: standard output)"
    )
    compile_.add_argument(
        "--format", choices=("text", "json"), default="text", help="format of the diagnostics (default: text)"
    )
    _import_arguments(compile_)
    compile_.set_defaults(run=_cmd_compile)

    from mixle_compile.runtime.cli import add_run_arguments  # argument handling only: no torch

    run = sub.add_parser("run", help="replay a compiled plan (or a spec, compiled first) on real process groups")
    add_run_arguments(run)
    run.set_defaults(run=_cmd_run)

    diff = sub.add_parser("diff", help="what changed between two plans (or specs, compiled on the fly)")
    diff.add_argument("old", metavar="A", help="plan or spec before the change")
    diff.add_argument("new", metavar="B", help="plan or spec after the change")
    diff.add_argument("--format", choices=("text", "json"), default="text", help="output format (default: text)")
    diff.add_argument(
        "--exit-code",
        action="store_true",
        help="exit 1 when the plans differ (like git diff --exit-code); without it a difference exits 0",
    )
    _import_arguments(diff)
    diff.set_defaults(run=_cmd_diff)

    export = sub.add_parser(
        "export",
        help="write the engine's own config (torchtitan TOML, Megatron-LM launch script, DeepSpeed JSON) for "
        "a spec that verifies on it",
    )
    export.add_argument("spec", metavar="SPEC|PLAN", help="a spec, a compiled plan, or an engine config")
    export.add_argument("--to", required=True, choices=("torchtitan", "megatron", "deepspeed"), help="the engine")
    export.add_argument(
        "--torchtitan-version",
        choices=("0.2", "0.3"),
        default=None,
        help="torchtitan 0.2 writes a job TOML, 0.3 a Python config function returning Trainer.Config "
        "(default: the spec's torchtitan backend version, else 0.2)",
    )
    export.add_argument(
        "-o",
        "--output",
        type=Path,
        metavar="FILE",
        help="where to write the config (an HF config.json it needs is written beside it); default: standard output",
    )
    _import_arguments(export)
    export.set_defaults(run=_cmd_export)

    plan = sub.add_parser(
        "plan", help="search the fastest verified mesh for a spec's open (auto) settings on its devices"
    )
    plan.add_argument(
        "spec", metavar="SPEC", help="spec file whose mesh fields are `auto` or left out (see docs/search.md)"
    )
    plan.add_argument(
        "--devices", type=_device_count, metavar="N", help="the device budget (mesh fields left out are then searched)"
    )
    plan.add_argument(
        "--top", type=_positive, default=5, metavar="K", help="how many meshes (plans) to print (default: 5)"
    )
    plan.add_argument(
        "--variants",
        action="store_true",
        help="rank every plan, so that settings variants of one mesh may fill the list "
        "(default: one plan per mesh, with that mesh's fastest settings)",
    )
    plan.add_argument(
        "--tight",
        action="store_true",
        help="admit plans that fit only if the caching allocator gives up its usual reserve (R002 warns); "
        "by default every plan keeps it",
    )
    plan.add_argument("--write", type=Path, metavar="OUT", help="write the best plan as a complete spec (YAML)")
    plan.add_argument("--format", choices=("text", "json"), default="text", help="output format (default: text)")
    plan.set_defaults(run=_cmd_plan)

    graph = sub.add_parser(
        "graph",
        help="print the decomposition graph of a spec",
        epilog="The graph is drawn for any spec that loads; the exit status is check's for the "
        "same spec (1 when it breaks a rule, its findings on standard error).",
    )
    graph.add_argument("spec", metavar="SPEC", help="spec file")
    graph.add_argument(
        "--format",
        choices=("dot", "mermaid", "text"),
        default="dot",
        help="graph language, or text for an indented tree (default: dot)",
    )
    graph.add_argument(
        "--expand",
        action="store_true",
        help="one node per layer; by default runs of identical layers are one node (layers.0..31 ×32)",
    )
    graph.add_argument("-o", "--output", type=Path, help="write to this file instead of standard output")
    graph.set_defaults(run=_cmd_graph)

    schema = sub.add_parser("schema", help="print the JSON Schema of spec files (or, with --plan, of plans)")
    schema.add_argument("--plan", action="store_true", help="the schema of compiled plans")
    schema.add_argument("-o", "--output", type=Path, help="write to this file instead of standard output")
    schema.set_defaults(run=_cmd_schema)
    return parser


def _import_arguments(parser: argparse.ArgumentParser) -> None:
    """What an engine config (torchtitan TOML, Megatron-LM script, DeepSpeed JSON) may not say."""
    group = parser.add_argument_group(
        "engine configs", "for a torchtitan, Megatron-LM or DeepSpeed config (see docs/importers.md)"
    )
    group.add_argument(
        "--model",
        metavar="CONFIG_JSON",
        help="an HF config.json giving the model (DeepSpeed; overrides the others' model)",
    )
    group.add_argument("--devices", type=_device_count, metavar="N", help="how many devices run the config")
    group.add_argument("--device-memory", metavar="SIZE", help="memory per device, e.g. 80GiB")
    group.add_argument(
        "--seq-len", type=_positive, metavar="N", help="tokens per sample, where the config does not say"
    )
    if parser.prog.endswith("check"):
        group.add_argument(
            "--torchtitan",
            metavar="MODULE:FUNCTION",
            help="check a torchtitan 0.3 config-registry function (needs torchtitan installed)",
        )


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _device_count(text: str) -> int:
    """A device count: a whole number from 1 to the largest a spec's ``resources.devices`` takes."""
    from mixle_compile.spec.models import MAX_DEGREE

    value = _positive(text)
    if value > MAX_DEGREE:
        raise argparse.ArgumentTypeError(
            f"must be at most {MAX_DEGREE:,} (the most devices a spec takes), got {value:,}"
        )
    return value


def _write_output(path: Path, text: str, verb: str) -> int | None:
    """Write a verb's output file (creating no folders): None when written, else the exit status
    of input that cannot be used (2), with the reason on standard error."""
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        print(f"mixle-compile {verb}: error: cannot write {path}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    return None


def _import_options(args: argparse.Namespace):
    from mixle_compile.importers import ImportOptions

    memory = getattr(args, "device_memory", None)
    if memory is not None:
        from mixle_compile.spec.models import parse_memory

        try:
            parse_memory(memory)
        except ValueError as exc:
            print(f"mixle-compile: error: --device-memory {exc}", file=sys.stderr)
            raise SystemExit(EXIT_USAGE) from None
    return ImportOptions(
        devices=getattr(args, "devices", None),
        device_memory=memory,
        model=getattr(args, "model", None),
        seq_len=getattr(args, "seq_len", None),
    )


def _cmd_check(args: argparse.Namespace) -> int:
    from mixle_compile.check import check_file, check_text, exit_status
    from mixle_compile.config import ConfigError, check_selector, config_for

    if not args.files and not args.torchtitan:
        print(
            "mixle-compile check: error: give at least one PATH (or - for standard input, or "
            "--torchtitan MODULE:FUNCTION)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if (args.fix or args.diff) and args.format != "text":
        print("mixle-compile check: error: --fix and --diff print text; drop --format", file=sys.stderr)
        return EXIT_USAGE
    if args.fix and "-" in args.files:
        print("mixle-compile check: error: --fix cannot write standard input back; use --diff", file=sys.stderr)
        return EXIT_USAGE
    try:
        chosen = _selectors(args.select, "--select", check_selector)
        ignored = _selectors(args.ignore, "--ignore", check_selector) or ()
        targets = _check_targets(args)
        if args.config is not None and not args.config.is_file():
            raise ConfigError(f"--config {args.config}: no such file")
    except ConfigError as exc:
        print(f"mixle-compile check: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    options = _import_options(args)
    extra = {"options": options} if options.given else {}
    suggest = args.suggest or args.fix or args.diff
    results = []
    stdin_text = None
    for target in targets:
        start = Path(args.stdin_filename or ".") if target == "-" else Path(target)
        try:
            config = config_for(start, args.config).with_cli(chosen, ignored, args.warnings_as_errors)
        except ConfigError as exc:
            print(f"mixle-compile check: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        if target == "-":
            raw = sys.stdin.buffer.read()
            stdin_text = raw.decode("utf-8", errors="replace")
            results.append(check_text(raw, args.stdin_filename or "-", suggest=suggest, config=config))
        else:
            results.append(check_file(target, suggest=suggest, config=config, **extra))
    if args.torchtitan:
        from mixle_compile.importers.torchtitan_registry import check_registry_function

        try:  # a function has no file: its configuration is the working directory's
            config = config_for(Path("."), args.config).with_cli(chosen, ignored, args.warnings_as_errors)
        except ConfigError as exc:
            print(f"mixle-compile check: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        results.append(check_registry_function(args.torchtitan, options, suggest=suggest, lint=config))
    edits = _fix_edits(results, targets, stdin_text)
    if args.fix:
        results = _write_fixes(results, targets, edits, args, extra, chosen, ignored)
    diagnostics = [d for r in results for d in r.diagnostics]
    if args.format == "sarif":
        from mixle_compile.sarif import sarif_log
        from mixle_compile.verify.docs import load_catalogue

        load_catalogue()  # every rule, not only those whose modules this run happened to import
        print(json.dumps(sarif_log(diagnostics, fixes=edits), indent=2))
    elif args.format == "json":
        # One shape with or without --suggest: a list of findings, each with its `fix` (null unless
        # a suggestion was sought for its file; then the search's outcome, found or not).
        found = []
        for r in results:
            fix = _suggestion_dict(r) if r.suggestion_sought else None
            for d in r.diagnostics:
                entry = d.as_dict()
                entry["fix"] = fix if d.severity.value == "error" else None
                found.append(entry)
        print(json.dumps(found, indent=2))
    else:
        for d in diagnostics:
            print(d.text())
        for r in results:
            for note in r.notes:
                print(f"{r.file}: {note}")
            if r.suggestion_sought and not args.fix and not (args.diff and r.file in edits):
                print(_suggestion_text(r))
            elif suggest and r.errors and not r.suggestion_sought and not r.unreadable and r.file not in edits:
                print(
                    f"# {r.file}: no suggestion: the spec did not load, so there are no settings to "
                    "search from; fix its S-codes first"
                )
        if args.diff:
            for r in results:
                if r.file in edits:
                    sys.stdout.write(edits[r.file][2])
        errors = sum(r.errors for r in results)
        warnings = sum(len(r.diagnostics) for r in results) - errors
        files = len(results)
        if errors:
            print(
                f"Found {errors} error{'s' * (errors != 1)} in {sum(1 for r in results if r.errors)} of "
                f"{files} file{'s' * (files != 1)}."
            )
        else:
            tail = f" ({warnings} warning{'s' * (warnings != 1)})" if warnings else ""
            print(f"All checks passed: {files} file{'s' * (files != 1)}{tail}.")
    return exit_status(results)


def _selectors(values: list[str] | None, option: str, check) -> tuple[str, ...] | None:
    if values is None:
        return None
    return tuple(check(code, option) for value in values for code in value.split(",") if code.strip())


def _check_targets(args: argparse.Namespace) -> list[str]:
    """The files to check: each PATH as given, a directory's selected files, a glob's matches."""
    import glob

    from mixle_compile.config import ConfigError, config_for, files_in

    out: list[str] = []
    for item in args.files:
        path = Path(item)
        if item == "-":
            out.append(item)
        elif path.is_dir():
            found = files_in(path, args.config)
            if not found:
                patterns = ", ".join(config_for(path, args.config).files)
                raise ConfigError(
                    f"no files under {item} match the `files` patterns ({patterns}); "
                    "set `files` in [tool.mixle-compile] or mixle-compile.toml"
                )
            out.extend(str(p) for p in found)
        elif not path.exists() and glob.has_magic(item):
            found = sorted(p for p in glob.glob(item, recursive=True) if Path(p).is_file())
            if not found:
                raise ConfigError(f"no files match {item}")
            out.extend(found)
        else:
            out.append(item)
    if args.stdin_filename is not None and "-" not in out:
        raise ConfigError("--stdin-filename names standard input: give - as the PATH")
    return list(dict.fromkeys(out))


def _fix_edits(results, targets: list[str], stdin_text: str | None) -> dict[str, tuple[str, str, str]]:
    """For each file whose suggestion changes something and which --fix can edit: (before, after, diff)."""
    from mixle_compile.fix import FixRefused, fixable, fixed_text, unified_diff

    edits = {}
    # a --torchtitan result comes after the targets' and has no file to edit
    paths = dict(zip((r.file for r in results), targets, strict=False))
    for r in results:
        if r.suggestion is None or not r.suggestion.changes or r.file not in paths:
            continue
        target = paths[r.file]
        try:
            fixable(Path(r.file), r.source_format)
            before = stdin_text if target == "-" else Path(target).read_text(encoding="utf-8")
            after = fixed_text(before, r.suggestion)
        except (FixRefused, OSError) as exc:
            print(f"mixle-compile check: {exc}", file=sys.stderr)
            continue
        edits[r.file] = (before, after, unified_diff(r.file, before, after))
    return edits


def _write_fixes(results, targets, edits, args, extra, chosen, ignored) -> list:
    """Write each edit and check the file again: what is left is what --fix could not fix."""
    from mixle_compile.check import check_file
    from mixle_compile.config import config_for

    out = []
    for r, target in zip(results, targets + [None] * (len(results) - len(targets)), strict=True):
        if r.file not in edits or target is None:
            out.append(r)
            continue
        if _write_output(Path(target), edits[r.file][1], "check") is not None:
            out.append(r)  # reported; the file keeps its findings
            continue
        count = len(r.suggestion.changes)
        print(f"fixed {target}: {count} field{'s' * (count != 1)} changed", file=sys.stderr)
        config = config_for(Path(target), args.config).with_cli(chosen, ignored, args.warnings_as_errors)
        out.append(check_file(target, config=config, **extra))
    return out


def _suggestion_text(result) -> str:
    from mixle_compile.verify.suggest import MAX_CHANGES, SEARCH_DEADLINE_S, SEARCH_TIMEOUT_MS

    s = result.suggestion
    if s is None:
        return (
            f"# {result.file}: no valid plan on the same devices changes at most {MAX_CHANGES} of the mesh and "
            "training settings; the conflict involves the model, the devices, the backend, the global batch size "
            "or the sequence length"
        )
    if s.out_of_time:
        return (
            f"# {result.file}: the search for a valid plan on the same {s.devices} devices ran out of time "
            f"before it found one ({SEARCH_TIMEOUT_MS / 1000:.0f} s a solver call, {SEARCH_DEADLINE_S:.0f} s in all); "
            "the settings in conflict are named above"
        )
    if not s.changes:
        return (
            f"# {result.file}: the plan is valid on its own devices; the errors left concern the elastic "
            "section (see their hints)"
        )
    nearest = "nearest" if s.proved_nearest else "a"
    count = len(s.changes)
    head = (
        f"# {result.file}: {nearest} valid plan on the same {s.devices} devices ({count} "
        f"field{'s' * (count != 1)} changed)"
    )
    if result.engine_patch is not None:
        return head + ", in the config's own keys:\n" + result.engine_patch.text(result.file)
    if result.engine_patch_refused is not None:
        head += f"\n# (not expressible in the engine config's keys: {result.engine_patch_refused}; as spec fields:)"
    return head + "\n" + s.yaml_patch()


def _suggestion_dict(result) -> dict:
    s = result.suggestion
    if s is None:
        return {"file": result.file, "found": False}
    if s.out_of_time:
        return {"file": result.file, "found": False, "out_of_time": True}
    return {
        "file": result.file,
        "found": True,
        "nearest": s.proved_nearest,
        "changes": {c.field.dotted: c.display() for c in s.changes},
        "patch": s.yaml_patch() if result.engine_patch is None else result.engine_patch.text(result.file),
        "new_warnings": list(s.new_warnings),
        **({"engine_changes": [c.as_dict() for c in result.engine_patch.changes]} if result.engine_patch else {}),
        **({"engine_changes_refused": result.engine_patch_refused} if result.engine_patch_refused else {}),
    }


_CODE = re.compile(r"^[A-Za-z][0-9]{3}$")


def _cmd_rules(args: argparse.Namespace) -> int:
    from mixle_compile.verify.docs import rules_json, rules_markdown, rules_text

    rule_set = None
    if args.backend is not None:
        from mixle_compile.contracts import available_training_backends, normalize_backend_name
        from mixle_compile.verify.rule import rule_set_name

        name = normalize_backend_name(args.backend)
        if name not in available_training_backends():
            known = ", ".join(available_training_backends())
            print(
                f"mixle-compile rules: error: no backend named {args.backend!r}; registered backends: {known}",
                file=sys.stderr,
            )
            return EXIT_USAGE
        rule_set = rule_set_name(name)
    if args.format == "markdown":
        if rule_set is not None:
            print("mixle-compile rules: error: --format markdown documents every rule; drop --backend", file=sys.stderr)
            return EXIT_USAGE
        sys.stdout.write(rules_markdown())
    elif args.format == "json":
        sys.stdout.write(rules_json(rule_set))
    else:
        sys.stdout.write(rules_text(rule_set))
    return EXIT_CLEAN


def _cmd_explain(args: argparse.Namespace) -> int:
    target = args.target.strip()
    if _CODE.match(target) and not Path(target).exists():
        from mixle_compile.verify.docs import explain_text

        text = explain_text(target.upper())
        if text is None:
            print(
                f"mixle-compile explain: error: no diagnostic code {target.upper()}; run `mixle-compile "
                "rules` to list them",
                file=sys.stderr,
            )
            return EXIT_USAGE
        sys.stdout.write(text)
        return EXIT_CLEAN
    if Path(target).is_dir():
        return _explain_checkpoint(target, args)
    doc, status = _plan_of(target, "explain", _import_options(args))
    if doc is None:
        return status
    from mixle_compile.report import explain_data, explain_text, rank_groups, rank_groups_text

    if args.ranks is not None and args.ranks < 0:
        print("mixle-compile explain: error: --ranks takes a number of groups >= 0", file=sys.stderr)
        return EXIT_USAGE
    imported = _imported_document(target, args)
    if args.format == "json":
        data = explain_data(doc)
        if args.ranks is not None:
            data["rank_groups"] = rank_groups(doc, args.ranks)
        if imported is not None:
            from mixle_compile.importers import provenance

            data["imported_from"] = {
                "file": imported.file,
                "format": imported.source_format,
                "fields": provenance(imported),
            }
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        sys.stdout.write(explain_text(doc))
        if args.ranks is not None:
            sys.stdout.write(rank_groups_text(doc, args.ranks))
        if imported is not None:
            from mixle_compile.importers import provenance_text

            sys.stdout.write(provenance_text(imported))
    if args.plot:
        from mixle_compile.plot import PlotError, plot_plan

        try:
            plot_plan(doc, str(args.plot))
        except PlotError as exc:
            print(f"mixle-compile explain: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        print(f"wrote {args.plot}", file=sys.stderr)
    return EXIT_CLEAN


def _imported_document(target: str, args: argparse.Namespace):
    """The document of an engine config (which engine key gave which spec field); None for a spec or plan."""
    from mixle_compile.spec import load_spec

    loaded = load_spec(target, options=_import_options(args))
    doc = loaded.document
    return doc if doc is not None and doc.source_format is not None else None


def _explain_checkpoint(target: str, args: argparse.Namespace) -> int:
    """A checkpoint's manifest: step, mesh, plan digest, data position, parameters (reads JSON only)."""
    from mixle_compile.report import checkpoint_text
    from mixle_compile.runtime.checkpoint import CheckpointError, checkpoint_view

    if args.plot or args.ranks is not None:
        print(
            "mixle-compile explain: error: --plot and --ranks explain a plan; a checkpoint has no such view",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        view = checkpoint_view(target)
    except CheckpointError as exc:
        print(f"mixle-compile explain: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.format == "json":
        print(json.dumps(view, indent=2, sort_keys=True))
    else:
        sys.stdout.write(checkpoint_text(view))
    return EXIT_CLEAN


def _print_findings(result, fmt: str) -> None:
    """Diagnostics of a compile, on standard error (standard output may carry the plan)."""
    if fmt == "json":
        print(json.dumps([d.as_dict() for d in result.diagnostics], indent=2), file=sys.stderr)
        return
    for d in result.diagnostics:
        print(d.text(), file=sys.stderr)


def _compile_or_report(path: str, progress, options=None, *, fmt: str = "text", every_finding: bool = False):
    """Compile a spec, reporting on standard error what stops it: (result, exit status), the
    result None unless a plan was built. The findings are printed when no plan is built (and
    always with ``every_finding``, as `compile` does); a spec with errors exits 1, input that
    cannot be read 2, a lowering that fails its own checks 3."""
    from mixle_compile.compile import CompilerBug, compile_file

    try:
        result = compile_file(path, options=options, progress=progress)
    except CompilerBug as exc:
        print(f"mixle-compile: internal error: {exc} (please report this)", file=sys.stderr)
        return None, EXIT_INTERNAL
    finally:
        progress.close()  # a phase that ended before its announcement stays quiet
    if every_finding or result.plan is None:
        _print_findings(result.check, fmt)
    if result.plan is not None:
        return result, EXIT_CLEAN
    if result.check.unreadable:
        return None, EXIT_USAGE
    errors = result.check.errors
    print(f"no plan written: {errors} error{'s' * (errors != 1)} in {path}.", file=sys.stderr)
    return None, EXIT_VIOLATIONS


def _cmd_compile(args: argparse.Namespace) -> int:
    from mixle_compile.progress import Progress

    progress = Progress("compile", 4)
    result, status = _compile_or_report(args.spec, progress, _import_options(args), fmt=args.format, every_finding=True)
    if result is None:
        return status
    progress.step("writing the plan")
    text = result.text
    progress.close()
    if args.output is None:
        sys.stdout.write(text)
        return EXIT_CLEAN
    failed = _write_output(args.output, text, "compile")
    if failed is not None:
        return failed
    print(f"wrote {args.output} ({result.plan['content_digest'][:19]}, {len(text):,} bytes)", file=sys.stderr)
    return EXIT_CLEAN


def _cmd_run(args: argparse.Namespace) -> int:
    from mixle_compile.runtime.cli import run_command

    return run_command(args)


def _plan_of(path: str, verb: str, options=None):
    """A verified plan from a plan file, or from a spec compiled on the fly: (plan, exit status)."""
    from mixle_compile.plan import PlanError, load_plan_text

    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        print(f"mixle-compile {verb}: error: cannot read {path}: {exc.strerror or exc}", file=sys.stderr)
        return None, EXIT_USAGE
    if p.suffix.lower() == ".json" and b'"format_version"' in raw[:4096]:
        from mixle_compile.progress import Progress

        progress = Progress(f"{verb}: {path}", 1)
        progress.step("checking the plan against its spec and digests")
        try:
            return load_plan_text(raw, str(path)), EXIT_CLEAN
        except PlanError as exc:  # a tampered or malformed plan is input that cannot be used, in every verb
            print(f"mixle-compile {verb}: error: {exc}", file=sys.stderr)
            return None, EXIT_USAGE
        finally:
            progress.close()
    from mixle_compile.progress import Progress

    progress = Progress(f"{verb}: {path}", 4)  # compiling, then reading the plan back as a plan file is read
    result, status = _compile_or_report(path, progress, options)
    if result is None:
        return None, status
    progress.step("reading the plan back and checking its digests")
    try:
        return load_plan_text(result.text, str(path)), EXIT_CLEAN
    finally:
        progress.close()


def _cmd_diff(args: argparse.Namespace) -> int:
    from mixle_compile.report import diff_data, diff_text

    a, status = _plan_of(args.old, "diff", _import_options(args))
    if a is None:
        return status
    b, status = _plan_of(args.new, "diff", _import_options(args))
    if b is None:
        return status
    if args.format == "json":
        data = diff_data(a, b)
        print(json.dumps(data, indent=2, sort_keys=True))
        same = data["same"]
    else:
        sys.stdout.write(diff_text(a, b, args.old, args.new))
        same = a.content_digest == b.content_digest
    return EXIT_VIOLATIONS if args.exit_code and not same else EXIT_CLEAN


def _cmd_export(args: argparse.Namespace) -> int:
    from mixle_compile.export import ExportRefused, export_spec

    spec, status = _spec_of(args.spec, _import_options(args))
    if spec is None:
        return status
    stem = args.output.stem if args.output else "train"
    try:
        exported = export_spec(spec, args.to, stem=stem, torchtitan_version=args.torchtitan_version)
    except ExportRefused as exc:
        for field_name, reason in exc.reasons:
            where = f" `{field_name}`" if field_name else ""
            print(f"{args.spec}: cannot export to {args.to}:{where} {reason}", file=sys.stderr)
        return EXIT_VIOLATIONS
    others = [name for name in exported.files if name != exported.main]
    if isinstance(spec.resources.devices, int) and spec.resources.throughput is not None:
        print(
            f"{args.spec}: note: resources.throughput is not written (no {args.to} key says a device's speed)",
            file=sys.stderr,
        )
    if args.to == "deepspeed":
        print(
            f"{args.spec}: note: training.steps and training.seed are not DeepSpeed config keys (the "
            "training script sets them)",
            file=sys.stderr,
        )
    if args.output is None:
        if others:
            print(
                f"mixle-compile export: error: the {args.to} config names a model file ({others[0]}); "
                "give -o FILE to write both",
                file=sys.stderr,
            )
            return EXIT_USAGE
        sys.stdout.write(exported.files[exported.main])
        return EXIT_CLEAN
    folder = args.output.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"mixle-compile export: error: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    for name, text in exported.files.items():
        path = args.output if name == exported.main else folder / name
        try:  # a file the config names may sit in a folder of its own (torchtitan's <stem>.hf/config.json)
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            print(f"mixle-compile export: error: cannot write {path}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_USAGE
        failed = _write_output(path, text, "export")
        if failed is not None:
            return failed
        print(f"wrote {path}", file=sys.stderr)
    if args.to == "deepspeed":
        print(
            f"check it with: mixle-compile check {args.output} --model {folder / others[0]} --seq-len "
            f"{spec.training.seq_len}",
            file=sys.stderr,
        )
    return EXIT_CLEAN


def _spec_of(path: str, options):
    """A valid spec from a spec file, an engine config or a plan's embedded spec: (spec, exit status)."""
    p = Path(path)
    if p.suffix.lower() == ".json" and p.is_file() and b'"format_version"' in p.read_bytes()[:4096]:
        from mixle_compile.plan import PlanError, load_plan_text
        from mixle_compile.plan.artifact import plan_spec

        try:
            return plan_spec(load_plan_text(p.read_bytes(), path)), EXIT_CLEAN
        except PlanError as exc:
            print(f"mixle-compile export: error: {exc}", file=sys.stderr)
            return None, EXIT_USAGE
    from mixle_compile.spec import load_spec

    loaded = load_spec(path, options=options)
    if not loaded.ok:
        for d in loaded.diagnostics:
            print(d.text(), file=sys.stderr)
        return None, EXIT_USAGE if loaded.unreadable else EXIT_VIOLATIONS
    return loaded.spec, EXIT_CLEAN


def _cmd_plan(args: argparse.Namespace) -> int:
    from mixle_compile.search import SearchInputError, outcome_data, outcome_text, read_request, search, spec_yaml

    try:
        request = read_request(args.spec, devices=args.devices)
    except SearchInputError as exc:
        for line in exc.lines:
            print(line, file=sys.stderr)
        return EXIT_USAGE
    outcome = search(request, top=args.top, variants=args.variants, tight=args.tight)
    if args.format == "json":
        print(json.dumps(outcome_data(outcome), indent=2, sort_keys=True))
    else:
        sys.stdout.write(outcome_text(outcome))
    if not outcome.plans:
        print(f"mixle-compile plan: no valid plan for {args.spec}: {outcome.reason}", file=sys.stderr)
        return EXIT_VIOLATIONS
    if args.write is not None:
        failed = _write_output(args.write, spec_yaml(outcome.plans[0], args.spec), "plan")
        if failed is not None:
            return failed
        print(f"wrote {args.write}", file=sys.stderr)
    return EXIT_CLEAN


def _cmd_graph(args: argparse.Namespace) -> int:
    from mixle_compile.check import check_loaded_file, exit_status
    from mixle_compile.config import ConfigError, config_for
    from mixle_compile.spec import load_spec

    try:
        config = config_for(Path(args.spec))
    except ConfigError as exc:
        print(f"mixle-compile graph: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    loaded = load_spec(args.spec, default_backend=config.backend)
    if not loaded.ok:
        for d in loaded.diagnostics:
            print(d.text(), file=sys.stderr)
        return EXIT_USAGE if loaded.unreadable else EXIT_VIOLATIONS
    from mixle_compile.graph import build_model_graph
    from mixle_compile.graph.export import to_dot, to_mermaid, to_text

    graph = build_model_graph(loaded.spec, loaded.document)
    for d in graph.diagnostics:
        print(d.text(), file=sys.stderr)
    render = {"dot": to_dot, "mermaid": to_mermaid, "text": to_text}[args.format]
    text = render(graph, collapse=not args.expand)
    if args.output:
        failed = _write_output(args.output, text, "graph")
        if failed is not None:
            return failed
    else:
        sys.stdout.write(text)
    # The model is drawn whatever the plan's verdict; the status is check's for the same spec.
    checked = check_loaded_file(loaded, args.spec, config=config)
    if checked.errors:
        for d in checked.diagnostics:
            print(d.text(), file=sys.stderr)
    return max(exit_status([checked]), EXIT_CLEAN if graph.ok else EXIT_VIOLATIONS)


def _cmd_schema(args: argparse.Namespace) -> int:
    if args.plan:
        from mixle_compile.plan import plan_schema_text

        text = plan_schema_text()
    else:
        from mixle_compile.schema import spec_schema_text

        text = spec_schema_text()
    if args.output:
        return _write_output(args.output, text, "schema") or EXIT_CLEAN
    sys.stdout.write(text)
    return EXIT_CLEAN


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return args.run(args)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except KeyboardInterrupt:
        print("mixle-compile: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_CLEAN
    except Exception as exc:  # the promise: never a traceback
        detail = str(exc).splitlines()[0] if str(exc) else ""
        print(f"mixle-compile: internal error: {type(exc).__name__}: {detail} (please report this)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())

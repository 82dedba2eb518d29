"""Command line: parse arguments, call one pass per verb, print, return an exit status.

Exit statuses: 0 clean, 1 violations found, 2 usage error or unreadable input, 3 internal error
(reported in one line, never as a traceback).
"""

from __future__ import annotations

import argparse
import json
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
    check.add_argument("files", nargs="+", metavar="FILE", help="spec files (.yaml, .yml or .json)")
    check.add_argument("--format", choices=("text", "json"), default="text", help="output format (default: text)")
    check.set_defaults(run=_cmd_check)

    schema = sub.add_parser("schema", help="print the JSON Schema of spec files")
    schema.add_argument("-o", "--output", type=Path, help="write to this file instead of standard output")
    schema.set_defaults(run=_cmd_schema)
    return parser


def _cmd_check(args: argparse.Namespace) -> int:
    from mixle_compile.check import check_file, exit_status

    results = [check_file(f) for f in args.files]
    diagnostics = [d for r in results for d in r.diagnostics]
    if args.format == "json":
        print(json.dumps([d.as_dict() for d in diagnostics], indent=2))
    else:
        for d in diagnostics:
            print(d.text())
        errors = sum(r.errors for r in results)
        warnings = len(diagnostics) - errors
        files = len(results)
        if errors:
            print(f"Found {errors} error{'s' * (errors != 1)} in {sum(1 for r in results if r.errors)} of {files} file{'s' * (files != 1)}.")
        else:
            tail = f" ({warnings} warning{'s' * (warnings != 1)})" if warnings else ""
            print(f"All checks passed: {files} file{'s' * (files != 1)}{tail}.")
    return exit_status(results)


def _cmd_schema(args: argparse.Namespace) -> int:
    from mixle_compile.schema import spec_schema_text

    text = spec_schema_text()
    if args.output:
        args.output.write_text(text, encoding="utf-8")
    else:
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

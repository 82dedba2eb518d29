"""Lint configuration: `[tool.mixle-compile]` in pyproject.toml or a `mixle-compile.toml`, found
upward from each checked file (the nearest wins, as ruff finds its configuration), rule selection,
inline suppression comments and the files a directory argument stands for.

Precedence, lowest first: the built-in defaults, the nearest configuration file, the command line
(``--select`` replaces the file's ``select``; ``--ignore`` adds to its ``ignore``;
``--warnings-as-errors`` turns it on). In one directory ``mixle-compile.toml`` wins over
``pyproject.toml``; a pyproject.toml without a ``[tool.mixle-compile]`` table is passed over.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from mixle_compile.diagnostics import CATALOGUE, Code, Diagnostic, Severity, register_code

UNUSED_SUPPRESSION = register_code(
    Code(
        "M001",
        "unused-suppression",
        "A `# mixle: ignore[CODE]` comment that suppresses nothing.",
        "A suppression comment names the codes it silences: `# mixle: ignore[T001]` at the end of the line "
        "a finding points at, or alone on the line above it (several codes: `# mixle: ignore[T001, D001]`). "
        "A code that no finding on that line carries, or that is not a diagnostic code at all, is reported "
        "here so that stale suppressions do not outlive the finding they were written for. It is reported "
        "only for a file that loaded and was verified (before that, the verifier's findings are unknown). "
        "Ignore it like any other code (`--ignore M001`).",
        severity=Severity.warning,
    )
)

CONFIG_FILE = "mixle-compile.toml"
PYPROJECT = "pyproject.toml"
TABLE = "mixle-compile"
# What a directory argument stands for when no configuration says `files`: spec files. Hidden
# directories (.git, .github, .venv) and the usual build folders are never entered.
DEFAULT_FILES = ("*.yaml", "*.yml")
SKIPPED_DIRECTORIES = frozenset({"node_modules", "__pycache__", "venv", "build", "dist"})
KEYS = ("backend", "select", "extend-select", "ignore", "per-file-ignores", "warnings-as-errors", "files")


class ConfigError(Exception):
    """A configuration that cannot be used: the message names the file, the key and the fix."""


@dataclass(frozen=True)
class LintConfig:
    path: Path | None = None  # the file it was read from; None: the defaults
    backend: str | None = None
    select: tuple[str, ...] | None = None  # None: every code
    extend_select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    per_file_ignores: tuple[tuple[str, tuple[str, ...]], ...] = ()
    warnings_as_errors: bool = False
    files: tuple[str, ...] = DEFAULT_FILES

    @property
    def root(self) -> Path:
        """Where the file's patterns are relative to."""
        return self.path.parent if self.path is not None else Path.cwd()

    def enabled(self, code: str, file: str | None = None) -> bool:
        chosen = self.select is None or _matches(code, self.select) or _matches(code, self.extend_select)
        if not chosen or _matches(code, self.ignore):
            return False
        if file is not None and self.per_file_ignores:
            relative = _relative(Path(file), self.root)
            for pattern, codes in self.per_file_ignores:
                if relative is not None and glob_matches(pattern, relative) and _matches(code, codes):
                    return False
        return True

    def with_cli(self, select: tuple[str, ...] | None, ignore: tuple[str, ...], warnings_as_errors: bool) -> LintConfig:
        return replace(
            self,
            select=select if select is not None else self.select,
            extend_select=() if select is not None else self.extend_select,
            ignore=self.ignore + ignore,
            warnings_as_errors=self.warnings_as_errors or warnings_as_errors,
        )


def _matches(code: str, selectors: tuple[str, ...]) -> bool:
    """A selector is a code (``T001``), a prefix of codes (``T``, ``T00``) or ``ALL``."""
    return any(s == "ALL" or code.startswith(s) for s in selectors)


# --- discovery -------------------------------------------------------------------------------


def find_config(start: Path) -> Path | None:
    """The nearest configuration file at or above ``start`` (a file's directory, or a directory)."""
    here = start.resolve()
    if not here.is_dir():
        here = here.parent
    for folder in (here, *here.parents):
        own = folder / CONFIG_FILE
        if own.is_file():
            return own
        pyproject = folder / PYPROJECT
        if pyproject.is_file() and _has_table(pyproject):
            return pyproject
    return None


def _has_table(pyproject: Path) -> bool:
    try:
        data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False  # not ours to judge: a pyproject.toml we cannot read holds no table of ours
    return isinstance(data.get("tool"), dict) and TABLE in data["tool"]


_CACHE: dict[tuple, LintConfig] = {}


def config_for(start: Path, explicit: Path | None = None) -> LintConfig:
    """The configuration that governs ``start``: ``explicit`` when given, else the nearest file."""
    path = explicit if explicit is not None else find_config(start)
    if path is None:
        return LintConfig()
    path = path.resolve()
    try:
        stat = path.stat()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the configuration: {exc.strerror or exc}") from exc
    key = (path, stat.st_mtime_ns, stat.st_size)  # an edited file is read again
    if key not in _CACHE:
        _CACHE[key] = read_config(path)
    return _CACHE[key]


def read_config(path: Path) -> LintConfig:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the configuration: {exc.strerror or exc}") from exc
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: is not UTF-8 text") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    if path.name == PYPROJECT:
        table = data.get("tool", {}).get(TABLE)
        prefix = f"tool.{TABLE}."
        if table is None:
            raise ConfigError(f"{path}: has no [tool.{TABLE}] table")
    else:
        table, prefix = data, ""
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: `{prefix.rstrip('.') or TABLE}` must be a table")
    return _parse(table, path, prefix)


def _parse(table: dict, path: Path, prefix: str) -> LintConfig:
    from mixle_compile.spec.load import closest

    for key in table:
        if key not in KEYS:
            close = closest(key.replace("_", "-"), KEYS)
            hint = f"; did you mean `{prefix}{close[0]}`?" if close else ""
            raise ConfigError(f"{path}: unknown key `{prefix}{key}`{hint} (valid keys: {', '.join(KEYS)})")

    def codes(key: str, value) -> tuple[str, ...]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f'{path}: `{prefix}{key}` must be a list of codes, e.g. ["T001", "P"]')
        return tuple(check_selector(v, f"{path}: `{prefix}{key}`") for v in value)

    def patterns(key: str, value) -> tuple[str, ...]:
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(
                f'{path}: `{prefix}{key}` must be a non-empty list of glob patterns, e.g. ["configs/**/*.yaml"]'
            )
        return tuple(value)

    out = LintConfig(path=path)
    if "backend" in table:
        backend = table["backend"]
        if not isinstance(backend, str) or not backend:
            raise ConfigError(f'{path}: `{prefix}backend` must be a backend name such as "torch"')
        from mixle_compile.contracts import available_training_backends, normalize_backend_name

        names = available_training_backends()
        if normalize_backend_name(backend) not in names:
            close = closest(backend, names)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"{path}: `{prefix}backend` {backend!r} is not a registered backend{hint} (registered: "
                f"{', '.join(names)})"
            )
        out = replace(out, backend=backend)
    if "select" in table:
        out = replace(out, select=codes("select", table["select"]))
    if "extend-select" in table:
        out = replace(out, extend_select=codes("extend-select", table["extend-select"]))
    if "ignore" in table:
        out = replace(out, ignore=codes("ignore", table["ignore"]))
    if "warnings-as-errors" in table:
        if not isinstance(table["warnings-as-errors"], bool):
            raise ConfigError(f"{path}: `{prefix}warnings-as-errors` must be true or false")
        out = replace(out, warnings_as_errors=table["warnings-as-errors"])
    if "per-file-ignores" in table:
        value = table["per-file-ignores"]
        if not isinstance(value, dict):
            raise ConfigError(
                f"{path}: `{prefix}per-file-ignores` must be a table of glob = [codes], e.g. "
                '"configs/legacy/*.yaml" = ["P008"]'
            )
        out = replace(
            out,
            per_file_ignores=tuple(
                (pattern, codes(f'per-file-ignores."{pattern}"', c)) for pattern, c in value.items()
            ),
        )
    if "files" in table:
        out = replace(out, files=patterns("files", table["files"]))
    return out


def check_selector(value: str, where: str) -> str:
    """A code, a prefix of known codes or ALL; anything else is refused naming the closest code."""
    from mixle_compile.spec.load import closest
    from mixle_compile.verify.docs import load_catalogue

    load_catalogue()
    selector = value.strip().upper()
    if selector == "ALL" or any(code.startswith(selector) for code in CATALOGUE) and selector:
        return selector
    close = closest(selector, sorted(CATALOGUE))
    hint = f"; did you mean {close[0]}?" if close else ""
    raise ConfigError(
        f"{where}: {value!r} is not a diagnostic code or a prefix of one{hint} (`mixle-compile rules` lists them)"
    )


# --- paths and patterns ----------------------------------------------------------------------


def _relative(path: Path, root: Path) -> str | None:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return None


def glob_regex(pattern: str) -> re.Pattern:
    """A gitignore-like glob: ``*`` and ``?`` stay within a directory, ``**/`` spans any number of
    them; a pattern without ``/`` matches a file's name in any directory."""
    if "/" not in pattern:
        pattern = "**/" + pattern
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:[^/]+/)*"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out + r"\Z")


def glob_matches(pattern: str, relative: str) -> bool:
    return glob_regex(pattern.lstrip("./") if pattern.startswith("./") else pattern).match(relative) is not None


def files_in(directory: Path, explicit: Path | None = None) -> list[Path]:
    """The files under ``directory`` that its configuration's ``files`` patterns select, sorted."""
    config = config_for(directory, explicit)
    root = config.root
    compiled = [glob_regex(p) for p in config.files]
    found = []
    for path in sorted(directory.rglob("*")):
        parts = path.relative_to(directory).parts
        if any(p.startswith(".") or p in SKIPPED_DIRECTORIES for p in parts[:-1]) or parts[-1].startswith("."):
            continue
        if not path.is_file():
            continue
        relative = _relative(path, root)
        if relative is None:  # a directory outside the configuration's folder: match from the directory
            relative = path.relative_to(directory).as_posix()
        if any(r.match(relative) for r in compiled):
            found.append(path)
    return found


# --- suppression comments --------------------------------------------------------------------

_DIRECTIVE = re.compile(r"#\s*mixle:\s*ignore\[([^\]]*)\]")


def comment_start(line: str) -> int | None:
    """Where a line's `#` comment starts (YAML, TOML and shell agree: a `#` at the start of the
    line or after whitespace, outside quotes); None when it has none."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == "\\" and quote == '"':
                continue
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return i
    return None


@dataclass
class Suppression:
    line: int  # the line the directive is on
    column: int
    applies_to: int  # the line whose findings it silences
    codes: tuple[str, ...]
    used: set[str] = field(default_factory=set)


def suppressions(text: str) -> list[Suppression]:
    """Every ``# mixle: ignore[CODE, ...]`` in a file with ``#`` comments (YAML, TOML, shell).

    At the end of a line it silences that line's findings; alone on a line (only a comment) it
    silences the next line's.
    """
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        start = comment_start(line)
        if start is None:
            continue
        match = _DIRECTIVE.search(line, start)
        if match is None:
            continue
        codes = tuple(c.strip().upper() for c in match.group(1).split(",") if c.strip())
        alone = line[:start].strip() == ""
        out.append(Suppression(number, match.start() + 1, number + 1 if alone else number, codes))
    return out


def apply_suppressions(
    diagnostics: list[Diagnostic], text: str | None, file: str, *, report_unused: bool
) -> list[Diagnostic]:
    """Drop the suppressed findings; add an M001 for every code a directive names without effect."""
    if not text:
        return diagnostics
    directives = suppressions(text)
    if not directives:
        return diagnostics
    by_line: dict[int, list[Suppression]] = {}
    for s in directives:
        by_line.setdefault(s.applies_to, []).append(s)
    kept = []
    for d in diagnostics:
        silenced = False
        for s in by_line.get(d.line, ()):
            if d.code in s.codes:
                s.used.add(d.code)
                silenced = True
        if not silenced:
            kept.append(d)
    if report_unused:
        if any(code not in CATALOGUE for s in directives for code in s.codes):
            from mixle_compile.verify.docs import load_catalogue

            load_catalogue()  # a code is known once the pass that registers it is imported
        for s in directives:
            for code in s.codes:
                if code in s.used:
                    continue
                where = "this line" if s.applies_to == s.line else f"line {s.applies_to}"
                if code not in CATALOGUE:
                    message = f"`# mixle: ignore[{code}]`: {code} is not a diagnostic code"
                else:
                    message = f"unused suppression: no {code} finding on {where}"
                kept.append(
                    Diagnostic(
                        UNUSED_SUPPRESSION.code,
                        Severity.warning,
                        message,
                        f"remove {code} from the comment",
                        file,
                        s.line,
                        s.column,
                    )
                )
    return kept


def select(diagnostics: list[Diagnostic], config: LintConfig, file: str) -> list[Diagnostic]:
    """The diagnostics the configuration enables, with warnings raised to errors when asked."""
    out = []
    for d in diagnostics:
        if not config.enabled(d.code, file):
            continue
        if config.warnings_as_errors and d.severity is Severity.warning:
            d = replace(d, severity=Severity.error)
        out.append(d)
    return out

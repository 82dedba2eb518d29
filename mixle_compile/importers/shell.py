"""Just enough of bash to read a launch script's arguments, with the position of every word.

Launch scripts (Megatron-LM's ``examples/**/*.sh``) set variables, build argument arrays over
line continuations, append to them under simple ``if`` tests and end in ``torchrun ...
pretrain_gpt.py ${ARGS[@]}``. This reader runs exactly that subset: assignments (scalars,
``NAME=( ... )``, ``NAME+=( ... )``), ``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${ARR[@]}``,
``$((arithmetic))``, and ``if``/``elif``/``else``/``fi`` over ``[ ... ]``/``[[ ... ]]`` tests with
``-z``, ``-n``, ``==``, ``=``, ``!=``, ``-eq``..``-ge`` joined by ``||``/``&&``. Nothing is executed;
a command substitution ``$(...)`` expands to nothing, and what cannot be decided is reported.

``source FILE`` and ``. FILE`` read FILE with the same reader (its variables and arrays join the
script's, its words keep their positions in FILE): a relative FILE is looked for next to the file that
sources it, then in the working directory (where bash looks for a name with a slash; one without is
searched on PATH first, which the reader does not do). ``$(dirname "$0")``, ``$(dirname
"${BASH_SOURCE[0]}")`` and the idioms around them (:data:`_SCRIPT_DIR`) are that file's directory,
`` `pwd` `` the working directory; ``sbatch job.sh``, ``bash job.sh`` and ``sh job.sh`` read job.sh
the same way. A FILE that is missing, that is computed (a
command substitution, a variable the script does not set), that sources a file already being read (a
cycle) or that is nested more than :data:`MAX_SOURCE_DEPTH` deep is not read, and said so.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass, field
from pathlib import Path

from mixle_compile.spec.source import Position


@dataclass(frozen=True)
class Word:
    text: str
    pos: Position


@dataclass
class _Raw:
    """A word as written: its segments (quote kind, text) and where it starts."""

    segments: list[tuple[str, str]]
    pos: Position

    @property
    def literal(self) -> str:
        return "".join(t for _, t in self.segments)


#: Commands that run a script file given as an argument (a batch job, a child shell).
RUNNERS = ("sbatch", "bash", "sh")
OPERATORS = {"\n", ";", "(", ")", "&&", "||", "|", "&"}


@dataclass
class ShellRun:
    commands: list[list[Word]] = field(default_factory=list)  # expanded, in the order run
    scalars: dict[str, Word] = field(default_factory=dict)
    arrays: dict[str, list[Word]] = field(default_factory=dict)
    undecided: list[tuple[str, Position]] = field(default_factory=list)  # tests that could not be decided
    skipped: list[tuple[str, Position]] = field(default_factory=list)  # loops and case blocks, not run
    unsourced: list[tuple[str, Position, str]] = field(default_factory=list)  # `source` not followed, and why
    sourced: list[str] = field(default_factory=list)  # the files read through `source`, in order


MAX_SOURCE_DEPTH = 8
MAX_SOURCE_BYTES = 1 << 20
# The directory of the script being read, as launch scripts spell it: $(dirname $0), around
# $(readlink -f $0) or $(realpath $0), and the idioms $(cd $(dirname $0) && pwd) and
# $(realpath $(dirname $0)) that make it absolute; ``$0`` is also ${0}, ${BASH_SOURCE} or
# ${BASH_SOURCE[0]}, and any part may be in double quotes (a word's literal keeps the quotes the
# tokenizer leaves inside a command substitution and drops the others).
_SELF = r'"?\$(?:0|\{0\}|\{BASH_SOURCE(?:\[0\])?\})"?'
_RESOLVED = rf'(?:{_SELF}|"?\$\(\s*(?:readlink\s+-f|realpath)\s+{_SELF}\s*\)"?)'
_DIR = rf'"?\$\(\s*dirname\s+{_RESOLVED}\s*\)"?'
_SCRIPT_DIR = re.compile(
    rf"{_DIR}"
    rf"|\$\(\s*cd\s+(?:-P\s+)?{_DIR}\s*(?:>\s*/dev/null\s*)?(?:2>&1\s*)?(?:&&|;)\s*pwd(?:\s+-P)?\s*\)"
    rf"|\$\(\s*(?:readlink\s+-f|realpath)\s+{_DIR}\s*\)"
)
# The working directory: `pwd` and $(pwd).
_PWD = re.compile(r"`\s*pwd\s*`|\$\(\s*pwd\s*\)")


def tokenize(text: str, file: str | None = None) -> list[_Raw | tuple[str, Position]]:
    out: list = []
    i, line, col = 0, 1, 1
    n = len(text)

    def advance(k: int = 1) -> None:
        nonlocal i, line, col
        for _ in range(k):
            if i < n and text[i] == "\n":
                line, col = line + 1, 1
            else:
                col += 1
            i += 1

    while i < n:
        ch = text[i]
        if ch == "\\" and i + 1 < n and text[i + 1] == "\n":
            advance(2)
            continue
        if ch in " \t\r":
            advance()
            continue
        if ch == "#":
            while i < n and text[i] != "\n":
                advance()
            continue
        if ch == "\n" or ch == ";":
            out.append((ch if ch == ";" else "\n", Position(line, col, file)))
            advance()
            continue
        if text.startswith("&&", i) or text.startswith("||", i):
            out.append((text[i : i + 2], Position(line, col, file)))
            advance(2)
            continue
        if ch in "()|&":
            out.append((ch, Position(line, col, file)))
            advance()
            continue
        start = Position(line, col, file)
        segments: list[tuple[str, str]] = []
        plain = ""
        while i < n:
            ch = text[i]
            if ch == "\\" and i + 1 < n:
                if text[i + 1] == "\n":
                    advance(2)
                    break
                plain += text[i + 1]
                advance(2)
                continue
            if ch in " \t\r\n;|&()" and not (ch == "(" and plain.endswith(("$", "$("))):
                break
            if ch == "'":
                if plain:
                    segments.append(("plain", plain))
                    plain = ""
                advance()
                buf = ""
                while i < n and text[i] != "'":
                    buf += text[i]
                    advance()
                advance()
                segments.append(("single", buf))
                continue
            if ch == '"':
                if plain:
                    segments.append(("plain", plain))
                    plain = ""
                advance()
                buf = ""
                while i < n and text[i] != '"':
                    if text[i] == "\\" and i + 1 < n and text[i + 1] in '"\\$`\n':
                        if text[i + 1] != "\n":
                            buf += text[i + 1]
                        advance(2)
                        continue
                    buf += text[i]
                    advance()
                advance()
                segments.append(("double", buf))
                continue
            if ch == "$" and i + 1 < n and text[i + 1] in "({":
                close = ")" if text[i + 1] == "(" else "}"
                opener = text[i + 1]
                depth, j = 0, i + 1
                while j < n:
                    if text[j] == opener:
                        depth += 1
                    elif text[j] == close:
                        depth -= 1
                        if depth == 0:
                            break
                    j += 1
                plain += text[i : j + 1]
                advance(j + 1 - i)
                continue
            plain += ch
            advance()
        if plain:
            segments.append(("plain", plain))
        if segments:
            out.append(_Raw(segments, start))
    return out


_VAR = re.compile(r"\$(?:\{([^}]*)\}|\(\((.*?)\)\)|\(([^)]*)\)|([A-Za-z_]\w*|[0-9@*#?]))", re.S)
_ARITH_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Div: operator.floordiv,
    ast.Mod: operator.mod,
}


class Shell:
    def __init__(self, env: dict[str, str] | None = None, cwd: Path | None = None):
        self.run = ShellRun()
        self.env = dict(env or {})
        self.cwd = cwd or Path.cwd()
        self._files: list[Path] = []  # the files being read, outermost first (a cycle is one already here)

    # -- expansion
    def _lookup(self, name: str) -> str:
        if name in self.run.scalars:
            return self.run.scalars[name].text
        if name in self.run.arrays:
            words = self.run.arrays[name]
            return words[0].text if words else ""
        return self.env.get(name, "")

    def _origin(self, name: str) -> Position | None:
        w = self.run.scalars.get(name)
        return w.pos if w else None

    def _arith(self, expr: str) -> str:
        expr = re.sub(r"\$?\{?([A-Za-z_]\w*)\}?", lambda m: self._lookup(m.group(1)) or "0", expr)
        try:
            return str(self._eval(ast.parse(expr.strip(), mode="eval").body))
        except (SyntaxError, ValueError, ZeroDivisionError, KeyError, TypeError):
            return ""

    def _eval(self, node) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH_OPS:
            return _ARITH_OPS[type(node.op)](self._eval(node.left), self._eval(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -self._eval(node.operand)
        raise ValueError("unsupported arithmetic")

    def _param(self, body: str) -> tuple[list[str], Position | None]:
        m = re.fullmatch(r"([A-Za-z_]\w*)\[[@*]\]", body)
        if m:
            return [w.text for w in self.run.arrays.get(m.group(1), [])], None
        m = re.fullmatch(r"#([A-Za-z_]\w*)(\[[@*]\])?", body)
        if m:
            return [str(len(self.run.arrays.get(m.group(1), [])))], None
        m = re.fullmatch(r"([A-Za-z_]\w*|\d+)(:?[-=+])(.*)", body, re.S)
        if m:
            name, op, default = m.groups()
            value = self._lookup(name)
            if op.endswith("+"):
                return [self._expand_text(default)[0] if value else ""], None
            if value or (not op.startswith(":") and (name in self.run.scalars or name in self.env)):
                return [value], self._origin(name)
            text = self._expand_text(_unquote(default))[0]
            if op.endswith("="):
                self.run.scalars[name] = Word(text, Position(1, 1))
            return [text], None
        return [self._lookup(body)], self._origin(body)

    def _expand_text(self, text: str) -> tuple[str, Position | None]:
        origin: list[Position | None] = [None]

        def sub(m: re.Match) -> str:
            if m.group(1) is not None:
                values, pos = self._param(m.group(1))
            elif m.group(2) is not None:
                values, pos = [self._arith(m.group(2))], None
            elif m.group(3) is not None:
                values, pos = [""], None  # command substitution: not run
            else:
                values, pos = [self._lookup(m.group(4))], self._origin(m.group(4))
            if pos is not None and origin[0] is None:
                origin[0] = pos
            return " ".join(values)

        return _VAR.sub(sub, text), origin[0]

    def _known_dirs(self, raw: _Raw) -> _Raw:
        """``raw`` with the script's own directory and the working directory written out where it
        spells them with a command substitution (:data:`_SCRIPT_DIR`, :data:`_PWD`), which the
        reader does not run but knows."""
        literal = raw.literal
        here = self._files[-1].parent if self._files else None
        if "pwd" not in literal and "dirname" not in literal:
            return raw
        written = _SCRIPT_DIR.sub(lambda _: str(here), literal) if here is not None else literal
        written = _PWD.sub(lambda _: str(self.cwd), written)
        return raw if written == literal else _Raw([("double", written)], raw.pos)

    def expand(self, raw: _Raw, *, split: bool = True) -> list[Word]:
        """A written word as the words it becomes (unquoted expansions are split on whitespace)."""
        raw = self._known_dirs(raw)
        # A lone unquoted or quoted ${ARR[@]} keeps each element's own position.
        if len(raw.segments) == 1:
            kind, text = raw.segments[0]
            m = re.fullmatch(r"\$\{([A-Za-z_]\w*)\[[@*]\]\}", text)
            if kind in ("plain", "double") and m:
                words = self.run.arrays.get(m.group(1), [])
                if kind == "plain" and split:
                    return [Word(part, w.pos) for w in words for part in w.text.split()]
                return list(words)
        text, origin, quoted = "", None, False
        for kind, seg in raw.segments:
            if kind == "single":
                text += seg
                quoted = True
            else:
                value, pos = self._expand_text(seg)
                origin = origin or pos
                text += value
                quoted = quoted or kind == "double"
        pos = origin or raw.pos
        if quoted or not split:
            return [Word(text, pos)]
        return [Word(part, pos) for part in text.split()]

    # -- execution
    def execute(self, text: str, path: str | Path | None = None, *, file: str | None = None) -> ShellRun:
        """Read ``text`` (the file at ``path``, whose positions name ``file`` when it is not the document's)."""
        if path is not None:
            self._files.append(Path(path).resolve())
        try:
            return self._execute(tokenize(text, file))
        finally:
            if path is not None:
                self._files.pop()

    def _execute(self, tokens: list) -> ShellRun:
        statements: list[list] = [[]]
        depth = 0  # inside NAME=( ... ) newlines do not end the statement
        for tok in tokens:
            if isinstance(tok, tuple) and tok[0] in ("\n", ";") and depth == 0:
                statements.append([])
                continue
            if isinstance(tok, tuple) and tok[0] == "(":
                depth += 1
            if isinstance(tok, tuple) and tok[0] == ")":
                depth = max(0, depth - 1)
            if isinstance(tok, tuple) and tok[0] == "\n":
                continue
            statements[-1].append(tok)
        stack: list[list[bool]] = []  # per if: [this branch active, some branch taken, parent active]
        skipping: list[str] = []  # inside a loop or case, whose body is not run
        for st in statements:
            if not st:
                continue
            first = st[0].literal if isinstance(st[0], _Raw) else st[0][0]
            words = [t.literal for t in st if isinstance(t, _Raw)]
            if first in ("for", "while", "until", "case", "select"):
                skipping.append("esac" if first == "case" else "done")
                if len(skipping) == 1 and isinstance(st[0], _Raw):
                    self.run.skipped.append((first, st[0].pos))
            if skipping:
                closing = skipping[-1]
                if closing in words:
                    skipping.pop()
                continue
            active = all(frame[0] for frame in stack)
            if first == "if":
                parent = active
                value = self._test(st[1:], parent)
                stack.append([parent and value, parent and value, parent])
                continue
            if first == "elif" and stack:
                frame = stack[-1]
                value = (not frame[1]) and frame[2] and self._test(st[1:], frame[2])
                frame[0], frame[1] = value, frame[1] or value
                continue
            if first == "else" and stack:
                frame = stack[-1]
                frame[0] = frame[2] and not frame[1]
                frame[1] = True
                rest = st[1:]
                if rest and active is not None:
                    st = rest
                    first = st[0].literal if isinstance(st[0], _Raw) else st[0][0]
                else:
                    continue
            if first == "fi" and stack:
                stack.pop()
                continue
            if first == "then":
                st = st[1:]
                if not st:
                    continue
            if not all(frame[0] for frame in stack):
                continue
            self._statement(st)
        return self.run

    def _test(self, toks: list, active: bool) -> bool:
        words = []
        for tok in toks:
            if isinstance(tok, tuple):
                words.append(tok[0])
            elif tok.literal == "then":
                break
            else:
                words.append(tok)
        if not active:
            return False
        groups: list[list] = [[]]
        joins: list[str] = []
        for w in words:
            if w in ("&&", "||"):
                joins.append(w)
                groups.append([])
            else:
                groups[-1].append(w)
        values = [self._one_test(g) for g in groups]
        result = values[0]
        for join, v in zip(joins, values[1:], strict=True):
            result = (result and v) if join == "&&" else (result or v)
        return bool(result)

    def _one_test(self, group: list) -> bool:
        raw = [w for w in group if not (isinstance(w, _Raw) and w.literal in ("[", "[[", "]", "]]"))]
        negate = False
        if raw and isinstance(raw[0], _Raw) and raw[0].literal == "!":
            negate, raw = True, raw[1:]
        args = [" ".join(x.text for x in self.expand(w, split=False)) if isinstance(w, _Raw) else w for w in raw]
        ops = {"==": operator.eq, "=": operator.eq, "!=": operator.ne}
        nums = {
            "-eq": operator.eq,
            "-ne": operator.ne,
            "-lt": operator.lt,
            "-le": operator.le,
            "-gt": operator.gt,
            "-ge": operator.ge,
        }
        value: bool | None = None
        if len(args) == 2 and args[0] in ("-z", "-n"):
            value = (args[1] == "") == (args[0] == "-z")
        elif len(args) == 1 and args[0] in ("-z", "-n"):
            value = args[0] == "-z"
        elif len(args) == 3 and args[1] in ops:
            value = ops[args[1]](args[0], args[2])
        elif len(args) == 3 and args[1] in nums:
            try:
                value = nums[args[1]](int(args[0] or 0), int(args[2] or 0))
            except ValueError:
                value = None
        if value is None:
            pos = group[0].pos if group and isinstance(group[0], _Raw) else Position(1, 1)
            self.run.undecided.append((" ".join(str(a) for a in args), pos))
            return False
        return value != negate

    def _statement(self, st: list) -> None:
        while st and isinstance(st[0], _Raw) and st[0].literal in ("export", "local", "declare", "readonly"):
            st = st[1:]
        if len(st) >= 2 and isinstance(st[0], _Raw) and st[0].literal in ("source", ".") and isinstance(st[1], _Raw):
            self._source(st[0].literal, st[1], st[0].pos)
            return
        if len(st) >= 2 and isinstance(st[0], _Raw) and st[0].literal in RUNNERS:
            # `sbatch [options] job.sh`, `bash job.sh`: the launch is in that script, run with this one's
            # variables (sbatch --export, a child shell's environment); read it as if sourced.
            words = [t for t in st[1:] if isinstance(t, _Raw)]
            if "-c" not in (w.literal for w in words):
                script = next((w for w in words if w.literal.endswith(".sh") and not w.literal.startswith("-")), None)
                if script is not None:
                    self._source(st[0].literal, script, st[0].pos)
                    return
        i = 0
        while i < len(st) and isinstance(st[i], _Raw):
            m = re.match(r"^([A-Za-z_]\w*)(\+?)=", st[i].literal)
            if not m or st[i].segments[0][0] != "plain":
                break
            name, append = m.group(1), m.group(2) == "+"
            rest = _Raw(_drop_prefix(st[i].segments, len(m.group(0))), st[i].pos)
            if (
                not rest.segments
                and i + 1 < len(st)
                and st[i + 1] == "("
                or (not rest.segments and i + 1 < len(st) and isinstance(st[i + 1], tuple) and st[i + 1][0] == "(")
            ):
                j = i + 2
                items: list[Word] = []
                while j < len(st) and not (isinstance(st[j], tuple) and st[j][0] == ")"):
                    if isinstance(st[j], _Raw):
                        items.extend(self.expand(st[j]))
                    j += 1
                self.run.arrays[name] = (self.run.arrays.get(name, []) if append else []) + items
                i = j + 1
                continue
            value = self.expand(rest, split=False)[0] if rest.segments else Word("", rest.pos)
            if not rest.segments:
                value = Word("", st[i].pos)
            elif value.pos == rest.pos:
                value = Word(value.text, _value_pos(st[i].pos, len(m.group(0))))
            if append and name in self.run.scalars:
                value = Word(self.run.scalars[name].text + value.text, value.pos)
            self.run.scalars[name] = value
            self.run.arrays.pop(name, None)
            i += 1
        words: list[Word] = []
        for tok in st[i:]:
            if isinstance(tok, tuple):
                if tok[0] in ("&&", "||", "|", "&"):
                    break
                continue
            words.extend(self.expand(tok))
        if words:
            self.run.commands.append(words)

    # -- source
    def _source(self, command: str, raw: _Raw, pos: Position) -> None:
        what = f"{command} {raw.literal}"
        raw = self._known_dirs(raw)
        written = raw.literal
        here = self._files[-1].parent if self._files else None
        unknown = [f"the command substitution {m.group(0)}" for m in re.finditer(r"`[^`]*`?", written)]
        for m in _VAR.finditer(written):
            if m.group(3) is not None:
                unknown.append(f"the command substitution $({m.group(3)})")
                continue
            if m.group(2) is not None:
                continue
            body = m.group(1) if m.group(1) is not None else m.group(4)
            name = re.match(r"[A-Za-z_]\w*|\d+|[@*#?]", body)
            if not name or (
                ":-" not in body
                and not self._lookup(name.group(0))
                and name.group(0) not in self.run.scalars
                and name.group(0) not in self.env
            ):
                unknown.append(f"${name.group(0) if name else body}, which the script does not set")
        if unknown:
            self.run.unsourced.append(
                (
                    what,
                    pos,
                    f"the path is computed from {', '.join(unknown)}; the reader does not "
                    "run the script, so the variables and arguments that file sets are not read",
                )
            )
            return
        target = self.expand(raw, split=False)[0].text
        given = Path(target).expanduser()
        bases = [] if given.is_absolute() else [b for b in (here, self.cwd) if b is not None]
        candidates = list(dict.fromkeys([given] if given.is_absolute() else [b / given for b in bases]))
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            places = " or ".join(str(c) for c in candidates)
            self.run.unsourced.append(
                (
                    what,
                    pos,
                    f"{target} is not found (looked for {places}); the variables and arguments it sets are not read",
                )
            )
            return
        resolved = found.resolve()
        if resolved in self._files:
            chain = " -> ".join(f.name for f in (*self._files[self._files.index(resolved) :], resolved))
            self.run.unsourced.append((what, pos, f"a cycle ({chain}): {target} is already being read; not read again"))
            return
        if len(self._files) >= MAX_SOURCE_DEPTH:
            self.run.unsourced.append(
                (what, pos, f"sourced files nest more than {MAX_SOURCE_DEPTH} deep; {target} is not read")
            )
            return
        try:
            if resolved.stat().st_size > MAX_SOURCE_BYTES:
                raise ValueError(f"larger than {MAX_SOURCE_BYTES} bytes")
            text = resolved.read_text(encoding="utf-8-sig")
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            self.run.unsourced.append(
                (what, pos, f"{target} cannot be read ({exc}); the variables and arguments it sets are not read")
            )
            return
        try:
            display = str(resolved.relative_to(self.cwd.resolve()))
        except ValueError:
            display = str(resolved)
        self.run.sourced.append(display)
        self.execute(text, resolved, file=display)


def _drop_prefix(segments: list[tuple[str, str]], k: int) -> list[tuple[str, str]]:
    out = []
    for kind, text in segments:
        if k >= len(text):
            k -= len(text)
            continue
        out.append((kind, text[k:]))
        k = 0
    return out


def _value_pos(pos: Position, offset: int) -> Position:
    return Position(pos.line, pos.column + offset, pos.file)


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text

"""Just enough of bash to read a launch script's arguments, with the position of every word.

Launch scripts (Megatron-LM's ``examples/**/*.sh``) set variables, build argument arrays over
line continuations, append to them under simple ``if`` tests and end in ``torchrun ...
pretrain_gpt.py ${ARGS[@]}``. This reader runs exactly that subset: assignments (scalars,
``NAME=( ... )``, ``NAME+=( ... )``), ``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${ARR[@]}``,
``$((arithmetic))``, and ``if``/``elif``/``else``/``fi`` over ``[ ... ]``/``[[ ... ]]`` tests with
``-z``, ``-n``, ``==``, ``=``, ``!=``, ``-eq``..``-ge`` joined by ``||``/``&&``. Nothing is executed;
a command substitution ``$(...)`` expands to nothing, and what cannot be decided is reported.
Every character of an expanded word keeps where its text is written (:class:`Span`): the words a
string splits into are each at their own line, a variable's value is where the assignment writes it
(the ``4`` of ``MBS=${MBS:-4}``), and a value the reader computes (arithmetic, the environment's) is
at the expression that computes it.

``source FILE`` and ``. FILE`` read FILE with the same reader (its variables and arrays join the
script's, its words keep their positions in FILE): a relative FILE is looked for next to the file that
sources it, then in the working directory (where bash looks for a name with a slash; one without is
searched on PATH first, which the reader does not do). ``$(dirname "$0")``, ``$(dirname
"${BASH_SOURCE[0]}")`` and the idioms around them (:data:`_SCRIPT_DIR`) are that file's directory,
`` `pwd` `` the working directory; ``sbatch job.sh``, ``bash job.sh`` and ``sh job.sh`` read job.sh
the same way. A batch script (the document, a file ``sbatch`` runs, a ``sbatch <<EOF`` here-document)
has its job-sizing ``#SBATCH`` directives read (:func:`sbatch_directives`) and sees the ``SLURM_*``
variables they set. A FILE that is missing, that is computed (a
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
class Span:
    """From index ``start`` of a text on, where its characters are written: ``pos`` and one column
    further for each next character where ``exact`` (text copied from the file, up to the next span),
    all at ``pos`` where not (a value the reader computed, placed at what computed it)."""

    start: int
    pos: Position
    exact: bool = True


Spans = tuple[Span, ...]


def _pos_at(spans: Spans, k: int) -> Position | None:
    """Where character ``k`` of a text with these spans is written (None where no span covers it)."""
    for span in reversed(spans):
        if span.start <= k:
            if not span.exact:
                return span.pos
            return Position(span.pos.line, span.pos.column + (k - span.start), span.pos.file)
    return None


def _slice(spans: Spans, a: int, b: int) -> Spans:
    """The spans of ``text[a:b]``, counted from ``a``."""
    out: list[Span] = []
    first = _pos_at(spans, a)
    if first is not None and a < b:
        covering = next(sp for sp in reversed(spans) if sp.start <= a)
        out.append(Span(0, first, covering.exact))
    out.extend(Span(sp.start - a, sp.pos, sp.exact) for sp in spans if a < sp.start < b)
    return tuple(out)


def _join(pieces: list[tuple[str, Spans]]) -> tuple[str, Spans]:
    """Texts with their spans, one after the other."""
    text, spans = "", []
    for piece, piece_spans in pieces:
        spans.extend(Span(sp.start + len(text), sp.pos, sp.exact) for sp in piece_spans)
        text += piece
    return text, tuple(spans)


@dataclass(frozen=True)
class Word:
    """A word of a command after expansion; ``pos`` is where its first character is written, and
    ``spans`` where each of its characters is (a flag and its value expanded from one string, a
    value from a variable assigned elsewhere)."""

    text: str
    pos: Position
    spans: Spans = field(default=(), compare=False, repr=False)

    def at(self, k: int) -> Position:
        """Where character ``k`` of the word is written (the word's position where unknown)."""
        return _pos_at(self.spans, k) or self.pos

    def tail(self, k: int) -> Word:
        """``text[k:]``, at its own position (the value of ``--flag=value``)."""
        return Word(self.text[k:], self.at(k), _slice(self.spans, k, len(self.text)))

    def split(self) -> list[Word]:
        """The word split on whitespace, as an unquoted expansion is, each part where its text is written."""
        return [
            Word(m.group(0), self.at(m.start()), _slice(self.spans, m.start(), m.end()))
            for m in re.finditer(r"\S+", self.text)
        ]


@dataclass
class _Raw:
    """A word as written: its segments (quote kind, text, where each character is) and where it starts."""

    segments: list[tuple[str, str, Spans]]
    pos: Position

    @property
    def literal(self) -> str:
        return "".join(t for _, t, _ in self.segments)


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
    # the job's size as sbatch is asked for it (#SBATCH directives, `sbatch` options): name -> value
    slurm: dict[str, Word] = field(default_factory=dict)


MAX_SOURCE_DEPTH = 8
#: The sbatch/srun options that size a job (sbatch(1), srun(1)): each spelling -> its long name.
SLURM_SIZE = {
    "-N": "nodes",
    "--nodes": "nodes",
    "-n": "ntasks",
    "--ntasks": "ntasks",
    "--ntasks-per-node": "ntasks-per-node",
    "--gpus-per-node": "gpus-per-node",
}
#: The variables Slurm sets in a batch job from those options (sbatch(1), OUTPUT ENVIRONMENT VARIABLES:
#: SLURM_JOB_NUM_NODES and SLURM_NNODES, the nodes; SLURM_NTASKS_PER_NODE "only set if the
#: --ntasks-per-node option is specified"; SLURM_NTASKS and SLURM_NPROCS, -n; SLURM_GPUS_PER_NODE "only set
#: if the --gpus-per-node option is specified").
SLURM_VARIABLES = {
    "nodes": ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"),
    "ntasks-per-node": ("SLURM_NTASKS_PER_NODE",),
    "ntasks": ("SLURM_NTASKS", "SLURM_NPROCS"),
    "gpus-per-node": ("SLURM_GPUS_PER_NODE",),
}
# A line that feeds the batch script to sbatch on its standard input (`sbatch <<EOF`): the here-document is
# a batch script, whose #SBATCH directives are those at its start.
_SBATCH_HEREDOC = re.compile(r"\bsbatch\b[^#\n]*<<-?\s*['\"]?\w+")


def slurm_options(words: list[Word]) -> dict[str, Word]:
    """The job-sizing options among ``words`` (``--nodes=4``, ``--nodes 4``, ``-N 4``, ``-N4``), by long
    name, each value where it is written; the last of an option given twice wins."""
    found: dict[str, Word] = {}
    for k, w in enumerate(words):
        flag, eq, _ = w.text.partition("=")
        if eq and flag in SLURM_SIZE and flag.startswith("--"):
            found[SLURM_SIZE[flag]] = w.tail(len(flag) + 1)
        elif w.text in SLURM_SIZE and k + 1 < len(words):
            found[SLURM_SIZE[w.text]] = words[k + 1]
        elif w.text[:2] in ("-N", "-n") and w.text[2:].isdigit():
            found[SLURM_SIZE[w.text[:2]]] = w.tail(2)
    return found


def sbatch_directives(text: str, file: str | None = None) -> dict[str, Word]:
    """The job-sizing #SBATCH directives of a batch script (and of a here-document fed to ``sbatch``):
    sbatch(1), "Once the first non-comment, non-whitespace line has been reached in the script, no more
    #SBATCH directives will be processed"; they are read as literal text (no variables)."""
    words: list[Word] = []
    reading = True
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if reading and stripped.startswith("#SBATCH"):
            for m in re.finditer(r"\S+", line[line.index("#SBATCH") + len("#SBATCH") :]):
                column = line.index("#SBATCH") + len("#SBATCH") + m.start() + 1
                start = Position(number, column, file)
                words.append(Word(m.group(0), start, (Span(0, start),)))
        elif reading and stripped and not stripped.startswith("#"):
            reading = False
        if _SBATCH_HEREDOC.search(line):
            reading = True  # the here-document's first lines are its batch script's start
    return slurm_options(words)


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

    last: list[tuple[int, int] | None] = [None]  # (line, column) of the last character a word kept

    def keep(buf: str, spans: list[Span]) -> str:
        """``buf`` with the character at ``i`` appended, and where it is written in ``spans`` (a new
        span where it does not follow the last character kept)."""
        if last[0] != (line, col - 1) or not spans:
            spans.append(Span(len(buf), Position(line, col, file)))
        last[0] = (line, col)
        return buf + text[i]

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
        segments: list[tuple[str, str, Spans]] = []
        plain = ""
        plain_spans: list[Span] = []
        last[0] = None
        while i < n:
            ch = text[i]
            if ch == "\\" and i + 1 < n:
                if text[i + 1] == "\n":
                    advance(2)
                    break
                advance()
                plain = keep(plain, plain_spans)
                advance()
                continue
            if ch in " \t\r\n;|&()" and not (ch == "(" and plain.endswith(("$", "$("))):
                break
            if ch in "'\"":
                if plain:
                    segments.append(("plain", plain, tuple(plain_spans)))
                plain, plain_spans = "", []
                advance()
                buf, buf_spans = "", []
                last[0] = None
                while i < n and text[i] != ch:
                    if ch == '"' and text[i] == "\\" and i + 1 < n and text[i + 1] in '"\\$`\n':
                        advance()
                        if text[i] != "\n":
                            buf = keep(buf, buf_spans)
                        advance()
                        continue
                    buf = keep(buf, buf_spans)
                    advance()
                advance()
                last[0] = None
                segments.append(("single" if ch == "'" else "double", buf, tuple(buf_spans)))
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
                for _ in range(min(j, n - 1) + 1 - i):
                    plain = keep(plain, plain_spans)
                    advance()
                continue
            plain = keep(plain, plain_spans)
            advance()
        if plain:
            segments.append(("plain", plain, tuple(plain_spans)))
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

    def _value(self, name: str, at: Position | None) -> tuple[str, Spans]:
        """``$name``: a variable's value where the script assigns it, else the environment's at ``at``."""
        if name in self.run.scalars:
            w = self.run.scalars[name]
            return w.text, w.spans or ((Span(0, w.pos, False),) if w.text else ())
        if name in self.run.arrays:
            words = self.run.arrays[name]
            return (words[0].text, words[0].spans or (Span(0, words[0].pos, False),)) if words else ("", ())
        value = self.env.get(name, "")
        return value, ((Span(0, at, False),) if value and at is not None else ())

    def _param(self, body: str, spans: Spans, at: Position | None) -> tuple[str, Spans]:
        """``${body}`` (``spans``: where body's characters are written, ``at``: where its ``$`` is)."""

        def computed(text: str) -> tuple[str, Spans]:
            return text, ((Span(0, at, False),) if text and at is not None else ())

        m = re.fullmatch(r"([A-Za-z_]\w*)\[[@*]\]", body)
        if m:
            pieces: list[tuple[str, Spans]] = []
            for k, w in enumerate(self.run.arrays.get(m.group(1), [])):
                if k:
                    pieces.append(computed(" "))
                pieces.append((w.text, w.spans or (Span(0, w.pos, False),)))
            return _join(pieces)
        m = re.fullmatch(r"#([A-Za-z_]\w*)(\[[@*]\])?", body)
        if m:
            return computed(str(len(self.run.arrays.get(m.group(1), []))))
        m = re.fullmatch(r"([A-Za-z_]\w*|\d+)(:?[-=+])(.*)", body, re.S)
        if m:
            name, op, default = m.groups()
            begin = m.start(3)
            if len(default) >= 2 and default[0] == default[-1] and default[0] in "'\"":  # _unquote
                default, begin = default[1:-1], begin + 1
            written = _slice(spans, begin, begin + len(default))
            value = self._lookup(name)
            if op.endswith("+"):
                return self._expand_located(default, written) if value else ("", ())
            if value or (not op.startswith(":") and (name in self.run.scalars or name in self.env)):
                return self._value(name, at)
            text, text_spans = self._expand_located(default, written)
            if op.endswith("="):
                self.run.scalars[name] = Word(text, _pos_at(text_spans, 0) or at or Position(1, 1), text_spans)
            return text, text_spans
        return self._value(body, at)

    def _expand_located(self, text: str, spans: Spans) -> tuple[str, Spans]:
        """``text`` (written where ``spans`` say) with its expansions done, each character's position kept:
        a variable's value where the variable is assigned, a computed one where it is computed."""
        pieces: list[tuple[str, Spans]] = []
        last = 0
        for m in _VAR.finditer(text):
            pieces.append((text[last : m.start()], _slice(spans, last, m.start())))
            at = _pos_at(spans, m.start())
            if m.group(1) is not None:
                pieces.append(self._param(m.group(1), _slice(spans, m.start(1), m.end(1)), at))
            elif m.group(2) is not None:
                value = self._arith(m.group(2))
                pieces.append((value, (Span(0, at, False),) if value and at is not None else ()))
            elif m.group(3) is None:  # $name ($(...), a command substitution, is not run: nothing)
                pieces.append(self._value(m.group(4), at))
            last = m.end()
        pieces.append((text[last:], _slice(spans, last, len(text))))
        return _join(pieces)

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
        return raw if written == literal else _Raw([("double", written, (Span(0, raw.pos, False),))], raw.pos)

    def expand(self, raw: _Raw, *, split: bool = True) -> list[Word]:
        """A written word as the words it becomes (unquoted expansions are split on whitespace), each
        at the position of its first character's text."""
        raw = self._known_dirs(raw)
        # A lone unquoted or quoted ${ARR[@]} in a command is its elements, each a word (an assignment's or a
        # test's, not split, is them joined by spaces, as below).
        if len(raw.segments) == 1 and split:
            kind, text, _ = raw.segments[0]
            m = re.fullmatch(r"\$\{([A-Za-z_]\w*)\[[@*]\]\}", text)
            if kind in ("plain", "double") and m:
                words = self.run.arrays.get(m.group(1), [])
                if kind == "plain":
                    return [part for w in words for part in w.split()]
                return list(words)
        pieces: list[tuple[str, Spans]] = []
        quoted = False
        for kind, seg, spans in raw.segments:
            if kind == "single":
                pieces.append((seg, spans))
                quoted = True
            else:
                pieces.append(self._expand_located(seg, spans))
                quoted = quoted or kind == "double"
        text, spans = _join(pieces)
        word = Word(text, _pos_at(spans, 0) or raw.pos, spans)
        if quoted or not split:
            return [word]
        return word.split()

    # -- execution
    def execute(
        self,
        text: str,
        path: str | Path | None = None,
        *,
        file: str | None = None,
        batch: bool = True,
        submitted: dict[str, Word] | None = None,
    ) -> ShellRun:
        """Read ``text`` (the file at ``path``, whose positions name ``file`` when it is not the document's).
        ``batch``: the text is a batch script (the document itself, or one run by ``sbatch``), whose
        #SBATCH directives size the job, overridden by the options ``sbatch`` was ``submitted`` with (sbatch(1):
        "command line options take precedence"). A batch job sees the SLURM_* variables of its size, which
        are set here (where the script does not set them itself) at the directive that asks for them."""
        if batch:
            options = {**sbatch_directives(text, file), **(submitted or {})}
            self.run.slurm.update(options)
            for name, value in options.items():
                if value.text.isdigit():
                    for variable in SLURM_VARIABLES[name]:
                        self.run.scalars[variable] = value
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
                    submitted = None
                    if st[0].literal == "sbatch":
                        before = words[: words.index(script)]
                        submitted = slurm_options([x for w in before for x in self.expand(w)])
                    self._source(st[0].literal, script, st[0].pos, submitted)
                    return
        i = 0
        while i < len(st) and isinstance(st[i], _Raw):
            m = re.match(r"^([A-Za-z_]\w*)(\+?)=", st[i].literal)
            if not m or st[i].segments[0][0] != "plain":
                break
            name, append = m.group(1), m.group(2) == "+"
            rest = _Raw(_drop_prefix(st[i].segments, len(m.group(0))), _value_pos(st[i].pos, len(m.group(0))))
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
            # the value's characters keep where they are written (a literal after `NAME=`, a variable's
            # value where that variable is assigned); an empty one is at the assignment
            value = self.expand(rest, split=False)[0] if rest.segments else Word("", st[i].pos)
            if append and name in self.run.scalars:
                old = self.run.scalars[name]
                text, spans = _join([(old.text, old.spans), (value.text, value.spans)])
                value = Word(text, old.pos if old.text else value.pos, spans)
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
    def _source(self, command: str, raw: _Raw, pos: Position, submitted: dict[str, Word] | None = None) -> None:
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
        self.execute(text, resolved, file=display, batch=command == "sbatch", submitted=submitted)


def _drop_prefix(segments: list[tuple[str, str, Spans]], k: int) -> list[tuple[str, str, Spans]]:
    out = []
    for kind, text, spans in segments:
        if k >= len(text):
            k -= len(text)
            continue
        out.append((kind, text[k:], _slice(spans, k, len(text))))
        k = 0
    return out


def _value_pos(pos: Position, offset: int) -> Position:
    return Position(pos.line, pos.column + offset, pos.file)

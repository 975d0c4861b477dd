"""The messages check: what the docs quote Ferry as printing must be what
its sources can print.

A message is cut into segments at ": " (where one layer of code prefixes
another's status) and each segment into runs of words (a quoted name, a
<placeholder>, "...", a token with digits or '_', an ALL-CAPS word and
punctuation stand for values or end a phrase). Every run of a segment,
one-word runs included, must occur in order within one statement's string
literals, crossing from one literal to the next as StrCat, a format call
or a ternary builds a message (a gap may hold one value-like word: a
transport's name, a camelCase symbol).
"""

import glob
import io
import os
import re
import tokenize

SOURCE_DIRS = ["engine", "transport", "descriptor", "metadata", "common",
               "tools", "bench", "devtools", "testing", "gpu", "python"]
# Messages the docs quote that other software prints (no literal of
# Ferry's holds them): gRPC's connection errors inside Ferry's statuses,
# and perftest's and ibv_rc_pingpong's lines in quickstart.md.
EXTERNAL_MESSAGES = [
    "failed to connect to all addresses",
    "Failed to connect to remote host",
    "Couldn't read/write remote address",
    "Couldn't connect to remote QP",
    "Failed to modify QP to RTR",
    # The kernel's transparent hugepage setting, as sysfs gives it.
    "always [madvise] never",
]
# One-word values a gap between two literals may hold in a quoted message.
VALUE_WORDS = {"rdma", "tcp", "softrnic", "softgpu", "read", "write", "cpu",
               "cuda", "roce", "infiniband", "ethernet",
               # units a value carries ("2048 kB")
               "b", "kb", "mb", "gb", "kib", "mib", "gib", "ms", "us", "ns"}
QUOTED = re.compile(r"(?<![A-Za-z])'[^'\s][^']*?'(?![A-Za-z])")
VARIABLE = re.compile(
    r"<[^<>]*>|\.\.\.|…|\{[^{}]*\}|%[-+ #0-9.]*(?:l|ll|z|h)?[a-zA-Z]")
WORD = r"[A-Za-z]+(?:['/-][A-Za-z]+)*"
TOKEN = re.compile(r"([^A-Za-z0-9_\x00]*)(" + WORD + r")([^A-Za-z0-9_\x00]*)")
GAP, BREAK = ("gap",), ("break",)


def _norm(w):
    w = w.lower()
    if w.endswith("'s"):
        return w
    return w[:-1] if len(w) > 3 and w.endswith("s") else w


def word_runs(s):
    """The runs of adjacent words of `s`, each a tuple of normalized words."""
    s = VARIABLE.sub(" \x00 ", QUOTED.sub(" \x00 ", s))
    s = re.sub(r"\((e?s)\)", r"\1", s)  # "request(s)" reads "requests"
    runs, cur = [], []

    def end():
        if cur:
            runs.append(tuple(cur))
        cur.clear()

    for tok in re.findall(r"\S+|\s+", s):
        if tok.isspace():
            if tok != " ":
                end()
            continue
        m = TOKEN.fullmatch(tok)
        # ALL-CAPS words and camelCase symbols (cuInit) are values.
        if not m or re.fullmatch(r"[A-Z]+", m.group(2)) or \
                re.search(r"[a-z][A-Z]", m.group(2)):
            end()
            continue
        if m.group(1):
            end()
        cur.append(_norm(m.group(2)))
        if m.group(3):
            end()
    end()
    return runs


def _cpp_literals(text):
    """The statements of C or C++ source, each a list of its string
    literals (adjacent ones joined), comments and char literals skipped."""
    out, lits, i, n = [], [], 0, len(text)
    joined = False  # The last token was a literal: "a" "b" is "ab".
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            i = text.find("\n", i)
            i = n if i < 0 else i
        elif text.startswith("/*", i):
            i = text.find("*/", i + 2)
            i = n if i < 0 else i + 2
        elif c == "'":
            j = i + 1
            while j < n and text[j] != "'" and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            joined = False
        elif text.startswith('R"', i) and (i == 0 or not
                                           text[i - 1].isalnum()):
            m = re.match(r'R"([^(\s]{0,16})\(', text[i:])
            if not m:
                i += 1
                continue
            end = text.find(")" + m.group(1) + '"', i + m.end())
            body = text[i + m.end():end if end >= 0 else n]
            lits.append(body)
            i = n if end < 0 else end + len(m.group(1)) + 2
        elif c == '"':
            j, buf = i + 1, []
            while j < n and text[j] != '"' and text[j] != "\n":
                if text[j] == "\\" and j + 1 < n:
                    e = text[j + 1]
                    buf.append({"n": " ", "t": " ", '"': '"', "\\": "\\",
                                "'": "'"}.get(e, ""))
                    j += 2
                else:
                    buf.append(text[j])
                    j += 1
            s = "".join(buf)
            if joined and lits:
                lits[-1] += s
            else:
                lits.append(s)
            joined = True
            i = j + 1
            continue
        elif c in ";{}":
            if lits:
                out.append(lits)
            lits = []
            i += 1
        else:
            i += 1
        if not c.isspace():
            joined = joined and c in ('"',)
    if lits:
        out.append(lits)
    return out


def _python_literals(text):
    """Each string literal of Python source as a statement of its own
    (implicit concatenation joined; comments are not strings)."""
    out, cur, last_line = [], None, None
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.STRING:
                try:
                    import ast
                    value = ast.literal_eval(tok.string)
                except (ValueError, SyntaxError):
                    value = tok.string
                if isinstance(value, bytes):
                    value = value.decode("latin-1")
                if cur is not None:
                    cur += value
                else:
                    cur = value
            elif tok.type in (tokenize.NL, tokenize.COMMENT) and \
                    cur is not None:
                continue  # A literal may go on after a line break.
            else:
                if cur is not None:
                    out.append([cur])
                cur = None
            last_line = tok.start[0]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    if cur is not None:
        out.append([cur])
    del last_line
    return out


def _shell_literals(text):
    """Quoted strings and echoed text of a shell script, each a statement;
    comment lines are not."""
    out = []
    for line in text.split("\n"):
        if line.lstrip().startswith("#"):
            continue
        for m in re.finditer(r'"((?:[^"\\]|\\.)*)"|\'([^\']*)\'', line):
            out.append([m.group(1) if m.group(1) is not None
                        else m.group(2)])
    return out


class Corpus:
    """What Ferry's sources can print: every statement's literals as one
    sequence of words, with a BREAK where a literal's own punctuation or
    placeholder ends a phrase and a GAP between two literals."""

    def __init__(self, root):
        self.statements = []
        for d in SOURCE_DIRS:
            for path in sorted(glob.glob(os.path.join(root, d, "**", "*"),
                                         recursive=True)):
                if os.path.isfile(path) and "_test" not in path:
                    self._add_file(path)
        for e in range(1, 134):
            self._add([os.strerror(e)])
        for m in EXTERNAL_MESSAGES:
            self._add([m])
        self.index = {}  # word -> [(statement, position)]
        for i, toks in enumerate(self.statements):
            for j, t in enumerate(toks):
                if t not in (GAP, BREAK):
                    self.index.setdefault(t, []).append((i, j))

    def _add(self, lits):
        toks = []
        for lit in lits:
            if toks:
                toks.append(GAP)
            for k, run in enumerate(word_runs(lit)):
                if k:
                    toks.append(BREAK)
                toks.extend(run)
        if toks:
            self.statements.append(toks)

    def _add_file(self, path):
        try:
            text = open(path, encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            return
        if path.endswith((".cc", ".h", ".c")):
            stmts = _cpp_literals(text)
        elif path.endswith(".py") or text.startswith("#!/usr/bin/env python"):
            stmts = _python_literals(text)
        elif path.endswith(".sh") or text.startswith("#!"):
            stmts = _shell_literals(text)
        else:
            return
        for lits in stmts:
            self._add(lits)

    @staticmethod
    def is_value(w):
        return w in VALUE_WORDS

    def _follows(self, toks, q, run, k):
        """The positions where run[k:] can end, continuing a match whose
        last word is toks[q]."""
        if k == len(run):
            return [q]
        w, n, ends = run[k], len(toks), []
        if q + 1 < n and toks[q + 1] == w:
            ends += self._follows(toks, q + 1, run, k + 1)
        if q + 1 < n and toks[q + 1] == GAP:
            # The next literal goes on with the phrase ...
            if q + 2 < n and toks[q + 2] == w:
                ends += self._follows(toks, q + 2, run, k + 1)
            # ... or a one-word value sits in the gap ...
            if self.is_value(w):
                if k + 1 == len(run):
                    ends.append(q + 1)
                elif q + 2 < n and toks[q + 2] == run[k + 1]:
                    ends += self._follows(toks, q + 2, run, k + 2)
            # ... or the next literal is a ternary's other arm.
            nxt = next((j for j in range(q + 2, n) if toks[j] == GAP), None)
            if nxt is not None and nxt + 1 < n and toks[nxt + 1] == w:
                ends += self._follows(toks, nxt + 1, run, k + 1)
        return ends

    def _matches_from(self, toks, runs, i, start):
        """Whether runs[i:] occur in order in toks from position start."""
        if i == len(runs):
            return True
        run = runs[i]
        for p in range(start, len(toks)):
            if toks[p] != run[0]:
                continue
            for end in self._follows(toks, p, run, 1):
                if self._matches_from(toks, runs, i + 1, end + 1):
                    return True
        return False

    def prints(self, runs):
        """Whether one statement holds `runs`, in order (a run that is only
        a value, a transport's name say, may be anywhere)."""
        runs = [r for r in runs if not (len(r) == 1 and self.is_value(r[0]))]
        if not runs:
            return True
        seen = set()
        for i, _ in self.index.get(runs[0][0], ()):
            if i in seen:
                continue
            seen.add(i)
            if self._matches_from(self.statements[i], runs, 0, 0):
                return True
        return False

    def unknown(self, message):
        """The segments of `message` no statement prints."""
        bad = []
        # Where one layer of code wraps another's words: "context: inner",
        # "what; consequence", "what (why)".
        for seg in re.split(r"[:;,]\s+|\s*[()]\s*", message):
            runs = word_runs(seg)
            if runs and not self.prints(runs):
                bad.append(" ".join(" ".join(r) for r in runs))
        return bad


LOG_LINE = re.compile(r"^\s*(\[[\d:. -]+\] )?\[[a-z]+\] \[(info|warning|"
                      r"error|debug)\]( |$)")
# A span that starts so is a command or code, not a message.
COMMAND_SPAN = re.compile(
    r"^(\$ |[\w.-]*/|--|-\w|[a-z_]+\(|[A-Z]\w+::|[A-Za-z_]+=|"
    r"(nc|ip|ping|ibv_\w+|ib_\w+|rdma|dmesg|ulimit|sudo|bash|sh|python3?|"
    r"pip|git|apt|apt-get|dpkg|export|cat|ls|grep|numactl|docker|etcd\w*|"
    r"ss|lsof|tc|ethtool|mlxconfig|nvidia-smi|cd|bazel|make|cluster_exec|"
    r"transfer_bench|metadata_server|doctor|verbs_bench|engine_bench) )")


def quoted_messages(page):
    """(line, message) of what `page` quotes Ferry as printing: log lines,
    doctor lines and their fix: lines, a block marked `messages` (one
    message, wrapped), and inline code that reads as a message."""
    for b in page.blocks:
        if b.lang not in ("text", "console", "") or b.mark == "skip":
            continue
        if b.mark == "messages":
            # One message, wrapped for the page.
            yield b.start + 1, " ".join(l.strip() for l in b.lines)
            continue
        for i, line in enumerate(b.lines):
            n = b.start + 1 + i
            if LOG_LINE.match(line):
                yield n, LOG_LINE.sub("", line)
            elif re.match(r"^\s*(OK|WARN|FAIL)  ", line):
                parts = re.split(r"\s{2,}", line.strip(), maxsplit=2)
                if len(parts) == 3:
                    yield n, parts[2]  # Not the check's name column.
            elif re.match(r"^\s+fix: ", line):
                yield n, line.strip()
    for n, span in page.code_spans():
        span = LOG_LINE.sub("", span)
        # A doctor line written inline: its check name's length is unknown
        # (the full lines, in blocks, are checked).
        if COMMAND_SPAN.match(span) or re.match(r"^(OK|WARN|FAIL) ", span):
            continue
        if re.search(r"[A-Za-z]+ [A-Za-z]+ [A-Za-z]+", span):
            yield n, span


def check(root, pages, problems):
    corpus = Corpus(root)
    count = 0
    for page in pages:
        for n, msg in quoted_messages(page):
            count += 1
            missing = corpus.unknown(msg)
            if missing:
                problems.append(
                    f"{os.path.relpath(page.path, root)}:{n}: quoted message "
                    f"{msg[:100]!r}: no source prints "
                    f"{', '.join(repr(p) for p in missing[:3])}")
    return count

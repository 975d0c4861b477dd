#!/usr/bin/env python3
"""Keeps docs/ true to the code: the checks //docs:docs_test runs.

  messages  every message the docs quote (log lines, doctor lines, error
            text in inline code) is made of the words the code prints:
            each pair of adjacent words must be adjacent in a string
            literal of the sources (or across the literals of one
            statement, as StrCat and a ternary build a message);
  flags     every --flag a command block passes to a Ferry program is one
            of that program's flags (its --helpfull), and every --flag
            the prose names is a flag of a Ferry program, of a script in
            the repository, or of an outside tool listed in EXTERNAL_FLAGS;
  zh        every page of the Chinese edition (docs/zh/) has the English
            page's code blocks, byte for byte and in order, and its
            headings carry the English page's anchors;
  run       console blocks marked `<!-- docs-test: output -->` are run and
            must print what the page shows; `<!-- docs-test: run -->`
            blocks must exit 0.

A block marked `<!-- docs-test: skip -->` is left out of `messages` (its
variable parts hold words: a list of provider names, a device's name).

  docs_check.py --root REPO [--helpfull NAME=FILE ...] [--runfiles DIR]
                [--only messages,flags,zh,run]

Prints one line per problem and ends with "N passed, N failed" (a check
passes when it finds no problem; each run block is a check).
"""

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
import unicodedata

# Where Ferry's messages come from.
SOURCE_DIRS = ["engine", "transport", "metadata", "common", "tools", "gpu",
               "python"]
SOURCE_EXTS = (".cc", ".h", ".c", ".py", ".sh")
# Messages the docs quote that other software prints, so no literal of
# Ferry's holds them: gRPC's connection errors (inside Ferry's statuses),
# and the perftest and ibv_rc_pingpong lines of quickstart.md.
EXTERNAL_MESSAGES = [
    "failed to connect to all addresses",
    "Failed to connect to remote host",
    "Couldn't read/write remote address",
    "Couldn't connect to remote QP",
    "Failed to modify QP to RTR",
]
# Flags the prose names that belong to other programs.
EXTERNAL_FLAGS = {
    # Bazel
    "config", "jobs", "local_test_jobs", "define", "runs_per_test",
    "test_output", "test_env", "test_filter", "output_base", "copt",
    "nocache_test_results", "compilation_mode", "spawn_strategy",
    "build_tests_only", "disk_cache",
    # docker
    "cap-add", "gpus", "ulimit", "network", "device", "privileged",
    # numactl
    "membind", "cpunodebind",
    # etcd
    "max-txn-ops", "quota-backend-bytes",
    # Mooncake's transfer_engine_bench
    "backend", "init_mem",
    # pip
    "force", "force-reinstall", "user",
    # perftest (ib_write_bw --mtu); the linker (-Wl,--as-needed)
    "mtu", "as-needed",
}
MARK = re.compile(r'^<!--\s*docs-test:\s*(skip|run|output)'
                  r'(?:\s+mask="([^"]*)")?\s*-->\s*$')
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^\s{]*)")


class Block:
    def __init__(self, lang, start, lines, mark):
        self.lang, self.start, self.lines = lang, start, lines
        self.mark, self.mask = mark if mark else (None, None)


class Page:
    """A Markdown page: its fenced blocks and its prose lines."""

    def __init__(self, path):
        self.path = path
        self.blocks = []
        self.prose = []  # (line number, text)
        self.headings = []  # (line number, level, text)
        lines = open(path, encoding="utf-8").read().split("\n")
        fence, buf, mark, pending = None, [], None, None
        for n, line in enumerate(lines, 1):
            m = FENCE.match(line)
            if fence is None and m:
                fence = (m.group(2), m.group(3) or "", n)
                buf, mark, pending = [], pending, None
                continue
            if fence is not None:
                if m and line.strip().startswith(fence[0]) and \
                        not line.strip()[len(fence[0]):].strip():
                    self.blocks.append(Block(fence[1], fence[2], buf, mark))
                    fence = None
                else:
                    buf.append(line)
                continue
            mk = MARK.match(line.strip())
            if mk:
                pending = (mk.group(1), mk.group(2))
                continue
            if line.strip():
                pending = pending if line.strip().startswith("<!--") \
                    else None
            h = re.match(r"^(#{1,6}) (.*?)\s*$", line)
            if h:
                self.headings.append((n, len(h.group(1)), h.group(2)))
            self.prose.append((n, line))

    def code_spans(self):
        """(line, text) of every inline code span, spans across line
        breaks joined."""
        text = "\n".join(t for _, t in self.prose)
        starts = [n for n, _ in self.prose]
        for m in re.finditer(r"(`+)(.+?)\1", text, re.S):
            n = starts[text.count("\n", 0, m.start())]
            yield n, " ".join(m.group(2).split())


# ---------------------------------------------------------------- messages

LITERAL = re.compile(r'"((?:[^"\\\n]|\\.)*)"')
QUOTED = re.compile(r"(?<![A-Za-z])'[^'\s][^']*?'(?![A-Za-z])")
VARIABLE = re.compile(
    r"<[^<>]*>|\.\.\.|…|\{[^{}]*\}|%[-+ #0-9.]*(?:l|ll|z|h)?[a-zA-Z]")
WORD = re.compile(r"[A-Za-z]+(?:'[a-z]+)?")
TOKEN = re.compile(r"([^A-Za-z0-9_\x00]*)([A-Za-z]+(?:'[a-z]+)?)"
                   r"([^A-Za-z0-9_\x00]*)")


def _stem(w):
    w = w.lower()
    return w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("'s") else w


def word_runs(s):
    """The runs of adjacent words of `s`, each a tuple of lowercased,
    singular words. A quoted name, a placeholder, a format directive, a
    token with digits or '_' (softrnic0, PORT_DOWN), an ALL-CAPS word and
    punctuation stand for values or end a phrase: they end the run."""
    s = VARIABLE.sub(" \x00 ", QUOTED.sub(" \x00 ", s))
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
        if not m or re.fullmatch(r"[A-Z]+", m.group(2)):
            end()
            continue
        if m.group(1):
            end()
        cur.append(_stem(m.group(2)))
        if m.group(3):
            end()
    end()
    return runs


GAP, BREAK = ("gap",), ("break",)


class Corpus:
    """What Ferry's sources can print: every statement's string literals
    as a sequence of words, with a BREAK where a literal's own
    punctuation or placeholder ends a phrase and a GAP between two
    literals of one statement (where StrCat puts a value, or a ternary
    its other arm)."""

    def __init__(self, root):
        self.statements = []
        self.singles = set()  # literals that are one word (a value)
        for d in SOURCE_DIRS:
            for path in sorted(glob.glob(os.path.join(root, d, "**", "*"),
                                         recursive=True)):
                if path.endswith(SOURCE_EXTS) and "_test" not in path:
                    self._add_file(path)
        for e in range(1, 134):
            self._add_statement([os.strerror(e)])
        for m in EXTERNAL_MESSAGES:
            self._add_statement([m])
        self.index = {}  # word -> [(statement, position)]
        for i, toks in enumerate(self.statements):
            for j, t in enumerate(toks):
                if t not in (GAP, BREAK):
                    self.index.setdefault(t, []).append((i, j))

    def _add_statement(self, lits):
        toks = []
        for lit in lits:
            if toks:
                toks.append(GAP)
            for k, run in enumerate(word_runs(lit)):
                if k:
                    toks.append(BREAK)
                toks.extend(run)
            if re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", lit):
                self.singles.add(_stem(lit))
        if toks:
            self.statements.append(toks)

    def _add_file(self, path):
        text = open(path, encoding="utf-8", errors="replace").read()
        if path.endswith((".cc", ".h", ".c")):
            text = re.sub(r'"\s*\n\s*"', "", text)  # "a" "b" is "ab"
            text = re.sub(r'//[^\n"]*\n', "\n", text)
            # Statements end at ; { } outside literals ("; it is ...").
            lits = []
            for m in re.finditer(r'"(?:[^"\\\n]|\\.)*"|[;{}]', text):
                if m.group(0) in (";", "{", "}"):
                    if lits:
                        self._add_statement(lits)
                    lits = []
                else:
                    lits.append(m.group(0)[1:-1].replace('\\"', '"')
                                .replace("\\n", " "))
            if lits:
                self._add_statement(lits)
        else:
            for m in LITERAL.finditer(text):
                self._add_statement([m.group(1)])
            for lit in re.findall(r"'([^'\n]*)'", text):
                self._add_statement([lit])

    def _follows(self, toks, q, run, k):
        """Whether run[k:] continues a match whose last word is toks[q]."""
        if k == len(run):
            return True
        w = run[k]
        n = len(toks)
        if q + 1 < n and toks[q + 1] == w:
            return self._follows(toks, q + 1, run, k + 1)
        if q + 1 < n and toks[q + 1] == GAP:
            # The next literal goes on with the phrase ...
            if q + 2 < n and toks[q + 2] == w and \
                    self._follows(toks, q + 2, run, k + 1):
                return True
            # ... or a one-word value sits in the gap ...
            if w in self.singles and (
                    k + 1 == len(run) or
                    (q + 2 < n and toks[q + 2] == run[k + 1] and
                     self._follows(toks, q + 2, run, k + 2))):
                return True
            # ... or the next literal is a ternary's other arm.
            nxt = next((j for j in range(q + 2, n) if toks[j] == GAP), None)
            if nxt is not None and nxt + 1 < n and toks[nxt + 1] == w and \
                    self._follows(toks, nxt + 1, run, k + 1):
                return True
        return False

    def prints(self, run):
        return any(self._follows(self.statements[i], j, run, 1)
                   for i, j in self.index.get(run[0], ()))

    def unknown(self, message):
        """The phrases of `message` no source prints."""
        return [" ".join(r) for r in word_runs(message)
                if len(r) > 1 and not self.prints(r)]


LOG_LINE = re.compile(r"^\s*(\[[\d:. -]+\] )?\[[a-z]+\] \[(info|warning|"
                      r"error|debug)\] ")
COMMAND_SPAN = re.compile(
    r"^(\$ |[\w.-]*/|--|-\w|[a-z_]+\(|[A-Z]\w+::|\w*_\w* |"
    r"(nc|ip|ping|ibv_\w+|ib_\w+|rdma|dmesg|ulimit|sudo|bash|sh|python3?|"
    r"pip|git|apt|apt-get|dpkg|export|cat|ls|grep|numactl|docker|etcd\w*|"
    r"ss|lsof|tc|ethtool|mlxconfig|nvidia-smi|cd|bazel|make) )")


def quoted_messages(page):
    """(line, message) of what `page` quotes Ferry as printing."""
    for b in page.blocks:
        if b.lang not in ("text", "console", "") or b.mark == "skip":
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
        if COMMAND_SPAN.match(span) or "=" in span:
            continue
        if re.search(r"[A-Za-z]+ [A-Za-z]+ [A-Za-z]+", span):
            yield n, span


def check_messages(root, pages, problems):
    corpus = Corpus(root)
    count = 0
    for page in pages:
        for n, msg in quoted_messages(page):
            count += 1
            missing = corpus.unknown(msg)
            if missing:
                problems.append(
                    f"{rel(root, page.path)}:{n}: quoted message {msg[:100]!r}"
                    f": no source prints {', '.join(repr(p) for p in missing[:3])}")
    return count


# ------------------------------------------------------------------- flags

FERRY_PROGRAMS = ("transfer_bench", "metadata_server", "doctor",
                  "verbs_bench")


def program_flags(helpfull_text):
    return set(re.findall(r"^\s+--([A-Za-z0-9_]+) ", helpfull_text, re.M))


def repository_flags(root):
    """Flags that the repository's scripts and programs take or pass."""
    found = set()
    for d in ("tools", "tests", "python", "docs/examples", ".ci", "bazel"):
        for path in glob.glob(os.path.join(root, d, "**", "*"),
                              recursive=True):
            if os.path.isfile(path) and not path.endswith(".md"):
                text = open(path, encoding="utf-8", errors="replace").read()
                found |= set(re.findall(r"--([a-z][a-z0-9_-]*)", text))
    return found


def commands(block):
    """The commands of a sh/console block, continuation lines joined."""
    text = "\n".join(l[2:] if l.startswith("$ ") else
                     ("" if block.lang == "console" else l)
                     for l in block.lines)
    text = re.sub(r"\\\n\s*", " ", text)
    for line in text.split("\n"):
        for cmd in re.split(r"\|\||&&|[|;]", line.split("  #")[0]):
            if cmd.strip():
                yield cmd.strip()


def check_flags(root, pages, helpfull, problems):
    flags = {name: program_flags(text) for name, text in helpfull.items()}
    every = set().union(*flags.values()) if flags else set()
    known = every | repository_flags(root) | EXTERNAL_FLAGS
    count = 0

    def ok(flag, allowed):
        return flag in allowed or (flag.startswith("no") and
                                   flag[2:] in allowed)

    for page in pages:
        for b in page.blocks:
            if b.lang not in ("sh", "console", "bash"):
                continue
            for cmd in commands(b):
                words = cmd.split()
                prog = next((os.path.basename(w) for w in words
                             if os.path.basename(w) in flags), None)
                if prog is None:
                    continue
                for flag in re.findall(r"(?:^|\s)--([A-Za-z0-9_-]+)", cmd):
                    count += 1
                    if not ok(flag, flags[prog]):
                        problems.append(
                            f"{rel(root, page.path)}:{b.start}: {prog} has "
                            f"no flag --{flag} (`{cmd[:80]}`)")
        for n, span in page.code_spans():
            for flag in re.findall(r"(?:^|\s)--([a-z][a-z0-9_-]*)", span):
                count += 1
                if not ok(flag, known) and not any(
                        k.startswith(flag.rstrip("_-")) and
                        flag.endswith(("_", "-")) for k in known):
                    problems.append(
                        f"{rel(root, page.path)}:{n}: no program or script "
                        f"of Ferry's takes --{flag}")
    return count


# ---------------------------------------------------------------------- zh

def slug(text):
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text).replace("`", "")
    text = re.sub(r"<[^>]+>", "", text)
    text = unicodedata.normalize("NFKD", text).encode(
        "ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def check_zh(root, problems):
    count = 0
    for zh_path in sorted(glob.glob(os.path.join(root, "docs", "zh", "*.md"))):
        en_path = os.path.join(root, "docs", os.path.basename(zh_path))
        if not os.path.isfile(en_path):
            problems.append(f"{rel(root, zh_path)}: no English page "
                            f"{rel(root, en_path)}")
            continue
        count += 1
        en, zh = Page(en_path), Page(zh_path)
        eb = [(b.lang, b.lines) for b in en.blocks]
        zb = [(b.lang, b.lines) for b in zh.blocks]
        if eb != zb:
            i = next((i for i, (x, y) in enumerate(zip(eb, zb)) if x != y),
                     min(len(eb), len(zb)))
            where = zh.blocks[i].start if i < len(zh.blocks) else "end"
            problems.append(
                f"{rel(root, zh_path)}:{where}: code block {i + 1} differs "
                f"from {rel(root, en_path)}'s ({len(eb)} blocks there, "
                f"{len(zb)} here): the edition must follow its English page")
        seen = {}
        anchors = []
        for _, level, text in en.headings:
            s = slug(text)
            seen[s] = seen.get(s, -1) + 1
            anchors.append((level, f"{s}_{seen[s]}" if seen[s] else s))
        got = []
        for _, level, text in zh.headings:
            m = re.search(r"\{#([^}]+)\}\s*$", text)
            got.append((level, m.group(1) if m else None))
        # The H1 carries no anchor.
        want = [(l, a if l > 1 else None) for l, a in anchors]
        if want != got:
            i = next((i for i, (x, y) in enumerate(zip(want, got))
                      if x != y), min(len(want), len(got)))
            line = zh.headings[i][0] if i < len(zh.headings) else "end"
            problems.append(
                f"{rel(root, zh_path)}:{line}: heading {i + 1} should be "
                f"level {want[i][0] if i < len(want) else '-'} with "
                f"{{#{want[i][1] if i < len(want) else '-'}}}, as "
                f"{rel(root, en_path)}'s")
    return count


# --------------------------------------------------------------------- run

def runnable_blocks(pages):
    for page in pages:
        for b in page.blocks:
            if b.mark in ("run", "output") and b.lang == "console":
                yield page, b


def localize(cmd, runfiles):
    """Paths as a checkout writes them, mapped to the built files."""
    if not runfiles:
        return cmd
    cmd = re.sub(r"(^|\s)tools/softrnic-run ",
                 rf"\1FERRY_SOFTRNIC_LIB_DIR={runfiles}/transport/softrnic "
                 rf"{runfiles}/tools/softrnic-run ", cmd)
    return re.sub(r"(^|\s)bazel-bin/", rf"\1{runfiles}/", cmd)


def exports_before(page, block):
    """The page's `$ export X=...` lines above `block`: the page tells the
    reader to run them first."""
    out = []
    for b in page.blocks:
        if b is block:
            break
        if b.lang in ("console", "sh"):
            out += [l[2:] if l.startswith("$ ") else l for l in b.lines
                    if re.match(r"^(\$ )?export \w+=", l)]
    return out


def run_block(root, page, block, runfiles, problems):
    steps, cur = [], None
    for line in block.lines:
        if line.startswith("$ "):
            cur = [line[2:].split("  #")[0].rstrip(), []]
            steps.append(cur)
        elif cur is not None:
            cur[1].append(line.rstrip())
    script = exports_before(page, block)
    for i, (cmd, _) in enumerate(steps):
        script.append(f"echo '@@step {i}'")
        script.append(localize(cmd, runfiles) + " 2>&1")
        script.append(f"echo \"@@status {i} $?\"")
    where = f"{rel(root, page.path)}:{block.start}"
    # With the runfiles, in a scratch directory: a command the page shows
    # may write where it runs.
    with tempfile.TemporaryDirectory() as scratch:
        try:
            out = subprocess.run(["bash", "-c", "\n".join(script)],
                                 capture_output=True, text=True, timeout=60,
                                 cwd=scratch if runfiles else root).stdout
        except subprocess.TimeoutExpired:
            problems.append(f"{where}: the block ran past 60 s")
            return
    for i, (cmd, want) in enumerate(steps):
        m = re.search(rf"@@step {i}\n(.*?)@@status {i} (\d+)\n", out, re.S)
        if not m:
            problems.append(f"{where}: `{cmd}` did not finish")
            return
        got = [l.rstrip() for l in m.group(1).split("\n")][:-1]
        norm = [l.expandtabs(8).rstrip() for l in want]
        got = [l.expandtabs(8).rstrip() for l in got]
        if block.mask:
            norm = [re.sub(block.mask, "<masked>", l) for l in norm]
            got = [re.sub(block.mask, "<masked>", l) for l in got]
        want = norm
        while got and not got[-1]:
            got.pop()
        while want and not want[-1]:
            want.pop()
        if block.mark == "run" and m.group(2) != "0":
            problems.append(f"{where}: `{cmd}` exited {m.group(2)}")
        if block.mark == "output" and got != want:
            diff = next((j for j, (x, y) in enumerate(zip(want, got))
                         if x != y), min(len(want), len(got)))
            problems.append(
                f"{where}: `{cmd}` printed something else than the page "
                f"shows; line {diff + 1}: page "
                f"{want[diff] if diff < len(want) else '(nothing)'!r}, "
                f"printed {got[diff] if diff < len(got) else '(nothing)'!r}")


def rel(root, path):
    return os.path.relpath(path, root)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True)
    ap.add_argument("--helpfull", action="append", default=[],
                    metavar="NAME=FILE")
    ap.add_argument("--runfiles", default="")
    ap.add_argument("--only", default="messages,flags,zh,run")
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    only = set(args.only.split(","))
    pages = [Page(p) for p in sorted(
        glob.glob(os.path.join(root, "docs", "*.md")) +
        glob.glob(os.path.join(root, "docs", "zh", "*.md")))]
    helpfull = {}
    for spec in args.helpfull:
        name, path = spec.split("=", 1)
        helpfull[name] = open(path, encoding="utf-8").read()
    passed = failed = 0

    def record(name, problems, detail):
        nonlocal passed, failed
        for p in problems:
            print(f"docs_check: {p}")
        ok = not problems
        print(f"{'PASS' if ok else 'FAIL'}: {name} ({detail}"
              f"{'' if ok else f', {len(problems)} problems'})")
        passed += ok
        failed += not ok

    if "messages" in only:
        problems = []
        n = check_messages(root, pages, problems)
        record("quoted messages", problems, f"{n} checked")
    if "flags" in only:
        problems = []
        n = check_flags(root, pages, helpfull, problems)
        if not helpfull:
            problems.append("no --helpfull given: the programs' flags are "
                            "unknown")
        record("flags", problems, f"{n} checked against "
               f"{', '.join(sorted(helpfull))}")
    if "zh" in only:
        problems = []
        n = check_zh(root, problems)
        record("Chinese edition", problems, f"{n} pages")
    if "run" in only:
        for page, block in runnable_blocks(pages):
            problems = []
            run_block(root, page, block, args.runfiles, problems)
            record(f"{rel(root, page.path)}:{block.start} "
                   f"({block.mark})", problems,
                   f"{sum(l.startswith('$ ') for l in block.lines)} commands")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

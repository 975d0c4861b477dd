"""A docs page as the checks see it: fenced blocks (with their
`<!-- docs-test: ... -->` marks), prose lines and headings."""

import re
import textwrap

MARK = re.compile(r'^<!--\s*docs-test:\s*(\w+)(?:\s+mask="([^"]*)")?\s*-->$')
MARK_LIKE = re.compile(r"^<!--\s*docs-test")
KINDS = ("skip", "run", "output", "messages")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^\s{`]*)")
RUNNABLE_LANGS = ("console",)
SHELL_LANGS = ("sh", "bash", "shell", "console")


class Block:
    """A fenced block: its language, first line, lines (dedented: a block
    inside a list item reads like any other) and mark."""

    def __init__(self, lang, start, lines, mark, mask):
        self.lang, self.start, self.mark, self.mask = lang, start, mark, mask
        self.lines = textwrap.dedent("\n".join(lines)).split("\n") \
            if lines else []


class Page:
    def __init__(self, path):
        self.path = path
        self.blocks = []
        self.prose = []  # (line number, text) outside fences
        self.headings = []  # (line number, level, text)
        self.problems = []  # marks that mean nothing, or mark nothing
        lines = open(path, encoding="utf-8").read().split("\n")
        fence = None  # (marker, lang, start line, indent)
        buf = []
        pending = None  # (kind, mask, line) of a mark waiting for its fence
        for n, line in enumerate(lines, 1):
            m = FENCE.match(line)
            if fence is None and m:
                mark = pending
                pending = None
                fence = (m.group(2), m.group(3), n, mark)
                buf = []
                continue
            if fence is not None:
                stripped = line.strip()
                if stripped.startswith(fence[0][0] * len(fence[0])) and \
                        not stripped.lstrip(fence[0][0]).strip():
                    mark = fence[3]
                    self.blocks.append(Block(
                        fence[1], fence[2], buf, mark[0] if mark else None,
                        mark[1] if mark else None))
                    if mark and mark[0] in ("run", "output") and \
                            fence[1] not in RUNNABLE_LANGS:
                        self.problems.append(
                            (mark[2], f"a `{mark[0]}` mark on a "
                             f"```{fence[1] or '(no language)'} block: only "
                             "console blocks run"))
                    fence = None
                else:
                    buf.append(line)
                continue
            stripped = line.strip()
            if MARK_LIKE.match(stripped):
                mk = MARK.match(stripped)
                if not mk or mk.group(1) not in KINDS:
                    self.problems.append(
                        (n, f"a docs-test mark this check does not know: "
                         f"{stripped!r} (kinds: {', '.join(KINDS)}; "
                         'mask="REGEX" in double quotes)'))
                elif pending:
                    self.problems.append(
                        (pending[2], "a docs-test mark with no block after "
                         "it"))
                if mk and mk.group(1) in KINDS:
                    pending = (mk.group(1), mk.group(2), n)
                    if mk.group(2) is not None:
                        try:
                            re.compile(mk.group(2))
                        except re.error as e:
                            self.problems.append(
                                (n, f"the mask {mk.group(2)!r} is no regular "
                                 f"expression: {e}"))
                            pending = ("skip", None, n)  # Reported above.
                continue
            if stripped and pending:
                self.problems.append(
                    (pending[2], "a docs-test mark not followed by a fenced "
                     "block (it must be the line right above the fence)"))
                pending = None
            h = re.match(r"^(#{1,6}) (.*?)\s*$", line)
            if h:
                self.headings.append((n, len(h.group(1)), h.group(2)))
            self.prose.append((n, line))
        if pending:
            self.problems.append(
                (pending[2], "a docs-test mark with no block after it"))

    def code_spans(self):
        """(line, text) of every inline code span; a span across a line
        break is joined."""
        text = "\n".join(t for _, t in self.prose)
        starts = [n for n, _ in self.prose]
        for m in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", text, re.S):
            n = starts[text.count("\n", 0, m.start())]
            yield n, " ".join(m.group(2).split())

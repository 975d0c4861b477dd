"""The run check: console blocks marked `<!-- docs-test: output -->` run
and must print what the page shows (after `mask="REGEX"` replaces what
varies from run to run); blocks marked `<!-- docs-test: run -->` must exit
0. Each runs in a scratch directory with its page's earlier `$ export`
lines first, paths as a checkout writes them mapped to the built files,
stdin from /dev/null, and at most STEP_SECONDS; every process it started
is killed after it."""

import os
import re
import signal
import subprocess
import tempfile

BLOCK_SECONDS = 20


def runnable(pages):
    for page in pages:
        for b in page.blocks:
            if b.mark in ("run", "output") and b.lang == "console":
                yield page, b


def localize(cmd, runfiles):
    """Paths as a checkout writes them, mapped to the built files."""
    if not runfiles:
        return cmd
    cmd = re.sub(r"(^|[\s;&|(`$])(\./)?tools/softrnic-run ",
                 rf"\1FERRY_SOFTRNIC_LIB_DIR={runfiles}/transport/softrnic "
                 rf"{runfiles}/tools/softrnic-run ", cmd)
    return re.sub(r"(^|[\s;&|(`$])(\./)?bazel-bin/", rf"\1{runfiles}/", cmd)


def steps(block):
    """[(command, [expected output lines])]: `$ ` lines, with `> ` and
    backslash continuations joined, and the lines after them."""
    out, cont = [], False
    for line in block.lines:
        if line.startswith("$ ") and not cont:
            out.append([line[2:], []])
        elif out and (cont or line.startswith("> ")) and not out[-1][1]:
            out[-1][0] += "\n" + (line[2:] if line.startswith("> ")
                                  else line)
        elif out:
            out[-1][1].append(line.rstrip())
        cont = bool(out) and not out[-1][1] and \
            out[-1][0].rstrip().endswith("\\")
    return [(c, w) for c, w in out]


def exports_before(page, block, runfiles):
    """The page's `$ export X=...` commands above `block` (the page tells
    the reader to run them first)."""
    out = []
    for b in page.blocks:
        if b is block:
            break
        if b.lang == "console":
            out += [localize(l[2:], runfiles) for l in b.lines
                    if re.match(r"^\$ export \w+=", l)]
    return out


def run_block(root, page, block, runfiles, problems):
    where = f"{os.path.relpath(page.path, root)}:{block.start}"
    todo = steps(block)
    if not todo:
        problems.append(f"{where}: a {block.mark} mark on a block with no "
                        "`$ ` command")
        return
    with tempfile.TemporaryDirectory() as scratch:
        script = exports_before(page, block, runfiles)
        for i, (cmd, _) in enumerate(todo):
            # Each step's output to a file of its own: a command that ends
            # without a newline, or leaves a child behind, still reads right.
            script.append(f"{{\n{localize(cmd, runfiles)}\n}} "
                          f"> {scratch}/out.{i} 2>&1")
            script.append(f"echo $? > {scratch}/status.{i}")
        proc = subprocess.Popen(
            ["bash", "-c", "\n".join(script)], cwd=scratch if runfiles
            else root, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.wait(timeout=BLOCK_SECONDS)
        except subprocess.TimeoutExpired:
            problems.append(f"{where}: the block ran past {BLOCK_SECONDS} s")
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        for i, (cmd, want) in enumerate(todo):
            try:
                status = open(f"{scratch}/status.{i}").read().strip()
                got = open(f"{scratch}/out.{i}", encoding="utf-8",
                           errors="replace").read().split("\n")
            except OSError:
                problems.append(f"{where}: `{cmd}` did not finish")
                return
            if block.mark == "run" and status != "0":
                problems.append(f"{where}: `{cmd}` exited {status}")
            if block.mark != "output":
                continue
            norm = lambda ls: [re.sub(block.mask, "<masked>", l)
                               if block.mask else l
                               for l in (x.expandtabs(8).rstrip()
                                         for x in ls)]
            w, g = norm(want), norm(got)
            while w and not w[-1]:
                w.pop()
            while g and not g[-1]:
                g.pop()
            if w != g:
                d = next((j for j, (x, y) in enumerate(zip(w, g)) if x != y),
                         min(len(w), len(g)))
                problems.append(
                    f"{where}: `{cmd}` printed something else than the "
                    f"page shows; line {d + 1}: page "
                    f"{w[d] if d < len(w) else '(nothing)'!r}, printed "
                    f"{g[d] if d < len(g) else '(nothing)'!r}")

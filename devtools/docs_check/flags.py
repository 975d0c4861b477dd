"""The flags check: every flag a command block passes to a Ferry program
is one of that program's flags (its --helpfull); every flag the prose
names after a Ferry program is that program's; any other flag the prose
names belongs to a Ferry program, a script of the repository, or an
outside tool listed in EXTERNAL_FLAGS."""

import glob
import os
import re
import shlex

from pages import SHELL_LANGS

# Flags the prose names that belong to other programs.
EXTERNAL_FLAGS = {
    # Bazel
    "config", "jobs", "local_test_jobs", "define", "runs_per_test",
    "test_output", "test_env", "test_filter", "output_base", "copt",
    "nocache_test_results", "compilation_mode", "spawn_strategy",
    "build_tests_only", "disk_cache", "symlink_prefix",
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
    # perf report
    "no-children", "sort",
    # absl's own, which every Ferry program takes and --helpfull omits
    "help", "helpfull", "helpshort", "helpon", "helpmatch", "helppackage",
    "version", "only_check_args",
}
OPERATORS = {"|", "||", "&&", ";", "&", "(", ")", ">", ">>", "<", "2>&1"}
FLAG = re.compile(r"^--([A-Za-z][A-Za-z0-9_-]*)(=.*)?$")


class Program:
    def __init__(self, helpfull):
        self.flags, self.bools = set(), set()
        for m in re.finditer(r"^\s+--([A-Za-z0-9_]+) \((.*?)\); default: "
                             r"(.*?);", helpfull, re.M | re.S):
            self.flags.add(m.group(1))
            if m.group(3) in ("true", "false"):
                self.bools.add(m.group(1))
        # Flags whose help spans lines match the first form only in part.
        self.flags |= set(re.findall(r"^\s+--([A-Za-z0-9_]+) ", helpfull,
                                     re.M))

    def takes(self, flag):
        return flag in self.flags or flag in EXTERNAL_FLAGS or (
            flag.startswith("no") and flag[2:] in self.bools)


def repository_flags(root):
    """Flags that the repository's scripts and programs take or pass."""
    found = set()
    for d in ("tools", "bench", "devtools", "testing", "tests", "python",
              "docs/examples", ".ci", "bazel"):
        for path in glob.glob(os.path.join(root, d, "**", "*"),
                              recursive=True):
            if os.path.isfile(path) and not path.endswith(".md") and \
                    "docs_check" not in path:
                text = open(path, encoding="utf-8", errors="replace").read()
                found |= set(re.findall(r"--([a-z][a-z0-9_-]*[a-z0-9])",
                                        text))
    return found


def _words(cmd):
    try:
        lex = shlex.shlex(cmd, posix=True, punctuation_chars="|&;()<>")
        lex.whitespace_split = True
        return list(lex)
    except ValueError:  # Unbalanced quotes: take it as it is written.
        return cmd.split()


def _open_quote(text):
    try:
        shlex.split(text)
        return False
    except ValueError:
        return True


def commands(block):
    """The commands of a shell block, continuation lines joined: in a
    console block the `$ ` and `# ` lines and what continues them."""
    lines, out, cont = block.lines, [], False
    for line in lines:
        if block.lang == "console":
            if re.match(r"^[$#] ", line):
                out.append(line[2:])
            elif cont or line.startswith("> "):
                out[-1] += " " + (line[2:] if line.startswith("> ")
                                  else line.strip())
            else:
                cont = False
                continue
        else:
            if cont and out:
                out[-1] += " " + line.strip()
            elif out and _open_quote(out[-1]):
                out[-1] += "\n" + line  # A quoted script goes on.
            else:
                out.append(line)
        cont = out[-1].rstrip().endswith("\\") if out else False
        if cont:
            out[-1] = out[-1].rstrip()[:-1]
    for cmd in out:
        cmd = re.sub(r"(^|\s)#[^\n'\"]*$", "", cmd)  # A comment.
        if cmd.strip():
            yield cmd.strip()


def invocations(cmd, programs):
    """(program, [its arguments]) for each Ferry program `cmd` runs: the
    words after the program, up to an operator or a bare `--`; for `bazel
    run //tools:P -- ARGS`, the words after the `--`; and what a `bash -c`
    or `sh -c` script among its words runs."""
    words = _words(cmd)
    i = 0
    while i < len(words):
        w = words[i]
        if w == "-c" and i > 0 and os.path.basename(words[i - 1]) in (
                "bash", "sh") and i + 1 < len(words):
            for line in re.sub(r"\\\n\s*", " ", words[i + 1]).split("\n"):
                yield from invocations(line, programs)
            i += 2
            continue
        label = re.match(r"^//tools:(\w+)$", w)
        name = label.group(1) if label else os.path.basename(w)
        if name in programs:
            args = []
            j = i + 1
            if label:
                while j < len(words) and words[j] != "--" and \
                        words[j] not in OPERATORS:
                    j += 1
                j += 1
            while j < len(words) and words[j] not in OPERATORS and \
                    words[j] != "--":
                args.append(words[j])
                j += 1
            yield name, args
            i = j
        else:
            i += 1


def check(root, pages, helpfull, problems):
    programs = {name: Program(text) for name, text in helpfull.items()}
    every = set().union(*(p.flags for p in programs.values())) \
        if programs else set()
    known = every | repository_flags(root) | EXTERNAL_FLAGS
    count = 0
    for page in pages:
        where = os.path.relpath(page.path, root)
        for b in page.blocks:
            if b.lang not in SHELL_LANGS:
                continue
            for cmd in commands(b):
                for prog, args in invocations(cmd, programs):
                    for a in args:
                        m = FLAG.match(a)
                        if not m:
                            continue
                        count += 1
                        if not programs[prog].takes(m.group(1)):
                            problems.append(
                                f"{where}:{b.start}: {prog} has no flag "
                                f"--{m.group(1)} (`{cmd[:80]}`)")
        for n, span in page.code_spans():
            invoked = list(invocations(span, programs))
            if invoked:
                for prog, args in invoked:
                    for a in args:
                        m = FLAG.match(a)
                        if m:
                            count += 1
                            if not programs[prog].takes(m.group(1)):
                                problems.append(
                                    f"{where}:{n}: {prog} has no flag "
                                    f"--{m.group(1)} (`{span[:80]}`)")
                continue
            # A flag named alone, or in a command of another program.
            for flag in re.findall(r"(?:^|\s)--([a-z][a-z0-9_-]*[a-z0-9])"
                                   r"(?=$|[\s=,.)])", span):
                if re.search(r"--\w+\s*(==|!=|\)|;)", span):
                    continue  # C++ (--n == 0), not a flag.
                count += 1
                if flag not in known and not (flag.startswith("no") and
                                              flag[2:] in known):
                    problems.append(
                        f"{where}:{n}: no program or script of Ferry's "
                        f"takes --{flag}")
    return count

"""Keeps docs/ true to the code: the checks //docs:docs_test runs.

  messages  what the docs quote Ferry as printing (log lines, doctor lines
            and their fix: lines, blocks marked `messages`, error text in
            inline code) is what its sources print (messages.py);
  flags     the flags the docs pass or name exist (flags.py);
  zh        the Chinese edition follows its English pages (zh.py);
  run       console blocks marked `output` print what the page shows, and
            blocks marked `run` exit 0 (run.py);
  marks     every `<!-- docs-test: ... -->` mark is one of skip, run,
            output, messages, right above a fenced block;
  diagrams  every docs/diagrams/*.svg is made from its .dot
            (diagrams.py).

  python3 devtools/docs_check --root REPO [--helpfull NAME=FILE ...]
          [--runfiles DIR] [--only messages,flags,zh,run,marks,diagrams]

Prints one line per problem and ends with "N passed, N failed" (a check
passes when it finds no problem; each run block is a check of its own).
"""

import argparse
import glob
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import diagrams  # noqa: E402
import flags  # noqa: E402
import messages  # noqa: E402
import run  # noqa: E402
import zh  # noqa: E402
from pages import Page  # noqa: E402

CHECKS = ("messages", "flags", "zh", "run", "marks", "diagrams")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True)
    ap.add_argument("--helpfull", action="append", default=[],
                    metavar="NAME=FILE")
    ap.add_argument("--runfiles", default="")
    ap.add_argument("--only", default=",".join(CHECKS))
    args = ap.parse_args()
    only = set(args.only.split(","))
    if only - set(CHECKS):
        ap.error(f"--only: no check {sorted(only - set(CHECKS))}; the checks "
                 f"are {', '.join(CHECKS)}")
    root = os.path.abspath(args.root)
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

    if "marks" in only:
        problems = [f"{os.path.relpath(p.path, root)}:{n}: {why}"
                    for p in pages for n, why in p.problems]
        record("docs-test marks", problems, f"{len(pages)} pages")
    if "messages" in only:
        problems = []
        n = messages.check(root, pages, problems)
        record("quoted messages", problems, f"{n} checked")
    if "flags" in only:
        problems = []
        if not helpfull:
            problems.append("no --helpfull given: the programs' flags are "
                            "unknown")
        n = flags.check(root, pages, helpfull, problems)
        record("flags", problems,
               f"{n} checked against {', '.join(sorted(helpfull))}")
    if "zh" in only:
        problems = []
        n = zh.check(root, problems)
        record("Chinese edition", problems, f"{n} pages")
    if "diagrams" in only:
        problems = []
        n = diagrams.check(root, problems)
        record("diagrams", problems, f"{n} sources")
    if "run" in only:
        for page, block in run.runnable(pages):
            problems = []
            run.run_block(root, page, block, args.runfiles, problems)
            record(f"{os.path.relpath(page.path, root)}:{block.start} "
                   f"({block.mark})", problems,
                   f"{len(run.steps(block))} commands")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The diagrams check: every docs/diagrams/NAME.dot has NAME.svg beside
it, made from it: the SVG's `<!-- source: NAME.dot sha256 HEX -->` line
(devtools/diagrams writes it) names the .dot's sha256, so a stale picture is
found without graphviz."""

import glob
import hashlib
import os
import re


def check(root, problems):
    count = 0
    for dot in sorted(glob.glob(os.path.join(root, "docs", "diagrams",
                                             "*.dot"))):
        count += 1
        name = os.path.basename(dot)
        svg = dot[:-4] + ".svg"
        rel = os.path.relpath(svg, root)
        want = hashlib.sha256(open(dot, "rb").read()).hexdigest()
        try:
            head = open(svg, encoding="utf-8").read(4096)
        except OSError:
            problems.append(f"{rel}: missing (run devtools/diagrams)")
            continue
        m = re.search(r"<!-- source: (\S+) sha256 ([0-9a-f]{64}) -->", head)
        if not m or m.group(1) != name or m.group(2) != want:
            problems.append(f"{rel}: not made from the {name} of this tree "
                            "(run devtools/diagrams)")
    return count

"""The Chinese edition's check: each page of docs/zh/ has its English
page's code blocks, byte for byte and in order, and its headings carry the
anchors the English page's headings get (rendered as the site renders
them, so that a link into either edition names the same section)."""

import glob
import os
import re

from pages import Page

# The extensions that shape headings and fences on the site (mkdocs.yml).
EXTENSIONS = ["toc", "attr_list", "admonition", "tables",
              "pymdownx.superfences", "pymdownx.details"]


def heading_ids(path):
    """(level, id) of every heading of the page at `path`, as Python-
    Markdown with the site's extensions gives them."""
    import markdown  # Debian's python3-markdown, as MkDocs uses.
    md = markdown.Markdown(extensions=EXTENSIONS)
    md.convert(open(path, encoding="utf-8").read())
    out = []

    def walk(tokens):
        for t in tokens:
            out.append((t["level"], t["id"]))
            walk(t["children"])

    walk(md.toc_tokens)
    return out


def check(root, problems):
    count = 0
    for zh_path in sorted(glob.glob(os.path.join(root, "docs", "zh",
                                                 "*.md"))):
        en_path = os.path.join(root, "docs", os.path.basename(zh_path))
        rel_zh = os.path.relpath(zh_path, root)
        rel_en = os.path.relpath(en_path, root)
        if not os.path.isfile(en_path):
            problems.append(f"{rel_zh}: no English page {rel_en}")
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
                f"{rel_zh}:{where}: code block {i + 1} differs from "
                f"{rel_en}'s ({len(eb)} blocks there, {len(zb)} here): the "
                "edition must follow its English page")
        want = heading_ids(en_path)
        got = heading_ids(zh_path)
        # The H1 is the page's title: its anchor is never linked.
        want = [(l, a if l > 1 else None) for l, a in want]
        got = [(l, a if l > 1 else None) for l, a in got]
        if want != got:
            i = next((i for i, (x, y) in enumerate(zip(want, got))
                      if x != y), min(len(want), len(got)))
            line = zh.headings[i][0] if i < len(zh.headings) else "end"
            w = want[i] if i < len(want) else ("-", "-")
            problems.append(
                f"{rel_zh}:{line}: heading {i + 1} should be level {w[0]} "
                f"with {{#{w[1]}}}, as {rel_en}'s "
                f"({len(want)} headings there, {len(got)} here)")
    return count

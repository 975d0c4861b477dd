"""MkDocs hooks for Ferry's site (mkdocs.yml: hooks).

The docs link to the code they explain as files of the repository, relative
to docs/ (`[rail_router.h](../transport/rdma/rail_router.h)`), so the links
work where the markdown is read as files (an editor, a forge). Outside
docs/ such a link would be broken in the site, and `mkdocs build --strict`
fails on it; inside (docs/examples) it would be a raw download. These hooks
give every source file a docs page links to a page of its own in the site
(`src/<path>/`, the file as a highlighted code block) and point the links
there. A link to a file that does not exist is
left alone, and --strict reports it.
"""

import logging
import os
import posixpath
import re
import tempfile

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# [text](target) with a relative target; not images, not URLs.
LINK = re.compile(
    r"(?<!!)\[([^\]]*)\]\(((?![a-z]+:|#|/)[^)\s#]+)(#[^)\s]*)?\)")
LANG = {".cc": "cpp", ".h": "cpp", ".c": "c", ".py": "python", ".sh": "sh",
        ".proto": "protobuf", ".bzl": "python", ".yml": "yaml",
        ".json": "json", ".md": "markdown", ".pyi": "python"}
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*(\S*)")
# Under "mkdocs" so that --strict counts its warnings.
log = logging.getLogger("mkdocs.hooks.ferry_site")
_gen_dir = None
_sources = {}  # repository path -> generated page path (under src/)


def _repo_path(page_src, target):
    """The repository path of the source file a link from docs/<page_src>
    names, or None: pages, images and other site files stay themselves."""
    docs = os.path.join(ROOT, "docs")
    full = os.path.normpath(
        os.path.join(docs, os.path.dirname(page_src), target))
    if not full.startswith(ROOT + os.sep):
        return None
    ext = os.path.splitext(full)[1]
    if full.startswith(docs + os.sep) and (ext == ".md" or not (
            ext in LANG or os.path.basename(full) == "BUILD")):
        return None
    if not os.path.isfile(full):
        return None
    return os.path.relpath(full, ROOT)


def _page_for(rel):
    # A README.md outside docs/ becomes a code page too: its own links are
    # the forge's, not the site's.
    return "src/" + rel.replace(os.sep, "/") + ".md"


def on_files(files, config):
    """Adds a generated page for every repository file a docs page links."""
    global _gen_dir
    _gen_dir = tempfile.mkdtemp(prefix="ferry-site-src-")
    docs = config["docs_dir"]
    for f in list(files):
        if not f.src_path.endswith(".md"):
            continue
        with open(os.path.join(docs, f.src_path), encoding="utf-8") as fh:
            text = fh.read()
        for m in LINK.finditer(text):
            rel = _repo_path(f.src_path, m.group(2))
            if rel is None or rel in _sources:
                continue
            page = _page_for(rel)
            _sources[rel] = page
            with open(os.path.join(ROOT, rel), encoding="utf-8",
                      errors="replace") as src:
                code = src.read()
            fence = "````" if "```" in code else "```"
            lang = LANG.get(os.path.splitext(rel)[1], "text")
            if os.path.basename(rel) in ("BUILD", "WORKSPACE"):
                lang = "python"
            out = os.path.join(_gen_dir, page)
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with open(out, "w", encoding="utf-8") as o:
                o.write(f"# {rel}\n\nFerry's `{rel}`, as of this build of "
                        f"the site.\n\n{fence}{lang}\n{code}"
                        f"{'' if code.endswith(chr(10)) else chr(10)}"
                        f"{fence}\n")
            files.append(File(page, _gen_dir, config["site_dir"],
                              config["use_directory_urls"]))
    return files


def _check_fences(markdown, src_path):
    """Warns of a fenced block without a language: the reader gets no
    highlighting, and the site check cannot tell code from output."""
    open_fence = None
    for n, line in enumerate(markdown.splitlines(), 1):
        m = FENCE.match(line)
        if not m:
            continue
        if open_fence is None:
            open_fence = m.group(1)
            if not m.group(2):
                log.warning(f"{src_path}:{n}: a code block without a "
                            "language (```sh, ```cpp, ```text ...)")
        elif m.group(1).startswith(open_fence) and not m.group(2):
            open_fence = None


def _with_translation_link(markdown, page, config):
    """An English page with a Chinese edition (docs/zh/<page>) says so
    under its title; the header's language switch only leads to a home."""
    src = page.file.src_path
    if src.startswith(("zh/", "src/")) or not os.path.isfile(
            os.path.join(config["docs_dir"], "zh", src)):
        return markdown
    link = posixpath.relpath("zh/" + src, posixpath.dirname(src) or ".")
    lines = markdown.split("\n")
    fence = None
    for i, line in enumerate(lines):
        m = FENCE.match(line)
        if m:
            if fence is None:
                fence = m.group(1)
            elif m.group(1).startswith(fence) and not m.group(2):
                fence = None
            continue
        if fence is None and line.startswith("# "):
            lines[i + 1:i + 1] = ["", f"[中文版]({link})", ""]
            break
    return "\n".join(lines)


def on_page_markdown(markdown, page, config, files):
    """Points links to repository files at their generated pages, and
    checks every code block names its language."""
    if not page.file.src_path.startswith("src/"):
        _check_fences(markdown, page.file.src_path)
        markdown = _with_translation_link(markdown, page, config)

    def sub(m):
        rel = _repo_path(page.file.src_path, m.group(2))
        if rel is None or rel not in _sources:
            return m.group(0)
        target = os.path.relpath(_sources[rel],
                                 os.path.dirname(page.file.src_path) or ".")
        return f"[{m.group(1)}]({target}{m.group(3) or ''})"

    return LINK.sub(sub, markdown)


def on_post_page(output, page, config):
    """The Chinese edition's pages say their language (screen readers,
    search engines, the browser's font choice)."""
    if page.file.src_path.startswith("zh/"):
        output = output.replace('<html lang="en"', '<html lang="zh"', 1)
    return output


def _nav_pages(items, section=""):
    for item in items:
        if item.is_page:
            yield section, item
        elif item.children:
            yield from _nav_pages(item.children, item.title)


def _first_paragraph(text):
    """The page's first paragraph of prose (not a heading, quote, table,
    list, comment or code), as one line with links reduced to their
    text."""
    fence = None
    para = []
    for line in text.split("\n") + [""]:
        m = FENCE.match(line)
        if m:
            fence = None if fence else m.group(1)
            para = []
            continue
        if fence:
            continue
        if not line.strip():
            if para:
                break
            continue
        if not para and re.match(r"^\s*([#>|!<\[]|[-*+] |\d+\. )", line):
            continue
        para.append(line.strip())
    first = " ".join(para)
    first = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", first)
    if len(first) > 240:
        first = first[:237].rsplit(" ", 1)[0] + "..."
    return first


def on_post_build(config):
    """Publishes llms.txt (llmstxt.org: the site's map for language
    models, each page with its first paragraph, by the nav's sections)
    and llms-full.txt (every page's Markdown, in the nav's order)."""
    from mkdocs.structure.files import get_files
    from mkdocs.structure.nav import get_navigation
    files = get_files(config)
    nav = get_navigation(files, config)
    docs = config["docs_dir"]
    sections = {}  # title -> entries, in the nav's order
    full = []
    for section, page in _nav_pages(nav.items):
        src = page.file.src_path
        with open(os.path.join(docs, src), encoding="utf-8") as fh:
            text = fh.read()
        title = page.title or src
        sections.setdefault(section or "Pages", []).append(
            f"- [{title}]({page.file.url}): {_first_paragraph(text)}")
        full += [f"<!-- {src} -->", text.rstrip(), ""]
    index = [f"# {config['site_name']}", "",
             f"> {' '.join(config['site_description'].split())}", "",
             "The site is also an RDMA tutorial in five parts, in English "
             "and in Chinese (zh/); glossary/ maps the terms between them. "
             "llms-full.txt holds every page's Markdown."]
    for title, entries in sections.items():
        index += ["", f"## {title}", ""] + entries
    site = config["site_dir"]
    with open(os.path.join(site, "llms.txt"), "w", encoding="utf-8") as o:
        o.write("\n".join(index) + "\n")
    with open(os.path.join(site, "llms-full.txt"), "w",
              encoding="utf-8") as o:
        o.write("\n".join(full) + "\n")

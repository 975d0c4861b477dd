"""Opens the pages of a built Ferry site in headless Chromium and checks
what a reader would see: the page rendered (Material's header and content),
the site navigation is there with every part of the tutorial, code blocks
in a language are highlighted, and no link inside the site is broken (its page exists,
and so does its #fragment). Prints one line per failure and a summary;
exits non-zero on any failure.

    python3 devtools/site_check.py SITE_DIR
"""

import html
import html.parser
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.parse

# Every page's navigation lists these (mkdocs.yml's nav): the five parts.
PARTS = ["Quick start", "Programming model", "Internals", "Optimisation",
         "Case studies", "Troubleshooting"]
CHROMIUM_SECONDS = 120
SOURCE_PAGES_RENDERED = 3


class Dom(html.parser.HTMLParser):
    """What the checks need from one rendered page."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids = set()
        self.links = []  # href values of <a>
        self.assets = []  # stylesheets, scripts, images
        self.bare_pre = 0  # <pre> outside any highlight block
        self._hl_depth = 0
        self.classes = []  # class lists of every element
        self.nav_text = []
        self._nav_depth = 0
        self._code_depth = 0
        self.code_blocks = 0  # <pre> blocks with code in them
        self.highlighted = 0  # ... of which have syntax-token spans

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a and a["id"]:
            self.ids.add(a["id"])
        if tag == "a" and a.get("name"):
            self.ids.add(a["name"])
        cls = (a.get("class") or "").split()
        self.classes.append(cls)
        if tag == "a" and a.get("href") is not None:
            self.links.append(a["href"])
        # What the page loads: the theme's styles and scripts, images.
        if tag == "link" and "stylesheet" in (a.get("rel") or "") and \
                a.get("href"):
            self.assets.append(a["href"])
        if tag in ("script", "img") and a.get("src"):
            self.assets.append(a["src"])
        if tag == "div" and "highlight" in cls:
            self._hl_depth = 1
        elif self._hl_depth and tag == "div":
            self._hl_depth += 1
        if tag == "pre" and not self._hl_depth:
            self.bare_pre += 1  # A fence the highlighter never saw.
        if tag == "nav" and "md-nav--primary" in cls:
            self._nav_depth = 1
        elif self._nav_depth and tag == "nav":
            self._nav_depth += 1
        if tag == "div" and "highlight" in cls:
            # language-text is output or a diagram: nothing to highlight
            # (the build refuses a block that names no language).
            lang = [c for c in cls if c.startswith("language-")]
            if lang and lang[0] != "language-text":
                self.code_blocks += 1
                self._code_depth = 1
                self._tokens = False
        elif self._code_depth and tag == "div":
            self._code_depth += 1
        elif self._code_depth and tag == "span" and cls and not self._tokens:
            # Pygments wraps tokens in <span class="k|n|s|...">.
            self._tokens = True
            self.highlighted += 1

    def handle_endtag(self, tag):
        if self._hl_depth and tag == "div":
            self._hl_depth -= 1
        if self._nav_depth and tag == "nav":
            self._nav_depth -= 1
        if self._code_depth and tag == "div":
            self._code_depth -= 1

    def handle_data(self, data):
        if self._nav_depth and data.strip():
            self.nav_text.append(data.strip())


# One browser for every page: a harness page loads each into an iframe and
# copies its DOM, once the page has loaded and run its scripts, into the
# harness, which Chromium dumps once its own load event has fired (iframes
# delay it). A launch per page cost about 5 s each on two cores, the bulk
# of this check. Reading the frames' DOMs from a file:// page needs
# --disable-web-security (file URLs are opaque origins), harmless here:
# only the site's own files are opened. No --virtual-time-budget: with
# many frames it was seen to hang Chromium.
HARNESS = """<!doctype html><html><body><script>
for (const p of %s) {
  const f = document.createElement("iframe");
  f.onload = () => {
    const out = document.createElement("textarea");
    out.setAttribute("data-page", p);
    out.textContent = f.contentDocument.documentElement.outerHTML;
    document.body.appendChild(out);
  };
  f.src = "file://" + p;
  document.body.appendChild(f);
}
</script></body></html>
"""


def render_all(paths):
    """{path: the DOM of the page after Chromium loaded it and ran its
    scripts}; a page missing from it did not load."""
    with tempfile.TemporaryDirectory() as tmp:
        harness = os.path.join(tmp, "harness.html")
        with open(harness, "w", encoding="utf-8") as f:
            f.write(HARNESS % json.dumps(paths))
        p = subprocess.run(
            ["chromium", "--headless", "--no-sandbox", "--disable-gpu",
             "--disable-dev-shm-usage", "--no-first-run",
             "--disable-web-security", "--allow-file-access-from-files",
             f"--user-data-dir={tmp}/profile", "--dump-dom",
             "file://" + harness],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            timeout=CHROMIUM_SECONDS)
    if p.returncode != 0:
        raise RuntimeError(f"chromium exit {p.returncode}")
    return {html.unescape(m.group(1)): html.unescape(m.group(2))
            for m in re.finditer(
                r'<textarea data-page="([^"]*)">(.*?)</textarea>', p.stdout,
                re.S)}


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    site = os.path.realpath(sys.argv[1])
    pages = sorted(
        os.path.join(d, f) for d, _, fs in os.walk(site) for f in fs
        if f == "index.html" or f == "404.html")
    if not pages:
        sys.exit(f"site_check: no pages under {site}")
    doms = {}
    failures = []

    def fail(page, what):
        failures.append(f"{os.path.relpath(page, site)}: {what}")

    # The generated pages of source files (src/) share one template:
    # Chromium renders a few of them; the rest are checked as built.
    sources = [p for p in pages
               if os.path.relpath(p, site).startswith("src" + os.sep)]
    unrendered = set(sources[SOURCE_PAGES_RENDERED:])
    try:
        dumps = render_all([p for p in pages if p not in unrendered])
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        sys.exit(f"site_check: Chromium did not run ({e})")
    rendered = len(dumps)
    for page in pages:
        if page in unrendered:
            with open(page, encoding="utf-8") as f:
                text = f.read()
        elif page in dumps:
            text = dumps[page]
        else:
            fail(page, "Chromium did not render it")
            continue
        dom = Dom()
        dom.feed(text)
        doms[page] = dom
        flat = {c for cls in dom.classes for c in cls}
        if "md-header" not in flat or "md-content" not in flat:
            fail(page, "no Material header or content: the theme did not "
                 "render")
        if os.path.basename(page) == "404.html":
            continue  # Its assets are from the server's root, by design.
        # The focus-visible polyfill in Material's bundle marks <html>: the
        # theme's scripts ran in the browser.
        if page in dumps and "js-focus-visible" not in flat:
            fail(page, "Material's scripts did not run in Chromium")
        nav = " ".join(dom.nav_text)
        missing = [p for p in PARTS if p not in nav]
        if missing:
            fail(page, f"navigation lacks {missing}")
        if dom.bare_pre:
            fail(page, f"{dom.bare_pre} code blocks outside the highlighter "
                 "(a fence Markdown did not parse)")
        if dom.code_blocks and dom.highlighted < dom.code_blocks:
            fail(page, f"{dom.code_blocks - dom.highlighted} of "
                 f"{dom.code_blocks} code blocks not highlighted")

    checked = 0
    for page, dom in doms.items():
        if os.path.basename(page) == "404.html":
            continue  # Its links are from the server's root, by design.
        for src in dom.assets:
            u = urllib.parse.urlsplit(src)
            if u.scheme:
                fail(page, f"loads {src} from outside the site (offline "
                     "readers and CI have no internet)")
                continue
            target = os.path.normpath(os.path.join(
                os.path.dirname(page), urllib.parse.unquote(u.path)))
            if not os.path.isfile(target):
                fail(page, f"loads {src}, which is not in the site")
        for href in dom.links:
            u = urllib.parse.urlsplit(href)
            if u.scheme in ("http", "https", "mailto") or href.startswith(
                    "javascript:"):
                continue
            if u.scheme not in ("", "file"):
                fail(page, f"link {href}: scheme {u.scheme}")
                continue
            checked += 1
            if u.scheme == "file":
                target = urllib.parse.unquote(u.path)
            elif u.path:
                target = os.path.normpath(os.path.join(
                    os.path.dirname(page), urllib.parse.unquote(u.path)))
            else:
                target = page
            if os.path.isdir(target):
                target = os.path.join(target, "index.html")
            if not target.startswith(site + os.sep):
                fail(page, f"link {href} leaves the site")
                continue
            if not os.path.exists(target):
                fail(page, f"broken link {href}")
                continue
            frag = urllib.parse.unquote(u.fragment)
            if frag and target.endswith(".html"):
                tdom = doms.get(target)
                if tdom is not None and frag not in tdom.ids:
                    fail(page, f"link {href}: no #{frag} in its page")

    for f in failures:
        print(f"site_check: {f}")
    code = sum(d.code_blocks for d in doms.values())
    print(f"site_check: {len(pages)} pages ({rendered} rendered in Chromium), "
          f"{checked} links and "
          f"{code} code blocks checked, {len(failures)} problems")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

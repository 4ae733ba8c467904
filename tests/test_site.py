"""A real browser reads the site: every page opens without errors, with its images, its math and its examples,
and nothing on it is wider than the column it is read in.

The site is built strictly into a temporary folder (once: the build is tested here too, with or without a
browser), served on 127.0.0.1 and opened page by page in Debian's headless Chromium, driven by playwright
(which never downloads a browser of its own here). Nothing is saved: no screenshots, no profile.

What "wider than the column" means, checked at a laptop's 1280 px and a phone's 390 px:

- The column is the article's box. Material itself lets code blocks (on a phone) and tables' scrolling
  wrappers bleed 0.8rem into the margin on each side, so a box may reach that far, and never past the
  window's edge.
- Every code block (`pre`), table (its scrolling wrapper) and figure (`img`, `svg`) must have its box within
  the column, at both widths: a box that runs past the column's edge is cut off or pushes the page sideways.
- At 1280 px nothing may need scrolling either: a code block or a table whose content is wider than its
  box (scrollWidth > clientWidth) hides its end behind a scroll bar, which a reader takes for the end of the
  line (the review of issue 43 found a code block 142 px too wide and a cut-off table, which the earlier
  check, of Python and text blocks at 1366 px only, missed). The exceptions: the API reference's source
  listings (.doc), which show reference/ at the project's 120 columns, and shell or JSON blocks outside
  the tutorial (commands copied rather than read). Inside the tutorial every block counts, the code
  included from reference/ too.
- At 390 px a code block or table may scroll sideways inside its own box: no legible font fits 88
  columns in a phone's 358 px, and wrapping would change what the code says. The box itself must fit.
- Every figure's text is at least 12 CSS px (9 pt) as displayed at 1280 px: its size in the SVG times
  the scale the browser draws the SVG at (displayed width / viewBox width).
"""

import functools
import http.server
import os
import pathlib
import re
import subprocess
import sys
import threading

import pytest

ROOT = pathlib.Path(__file__).parents[1]
CHROMIUM = pathlib.Path("/usr/bin/chromium")
# Flags that keep Chromium quiet on a machine with no network; playwright adds --headless and a fresh,
# temporary --user-data-dir of its own to every launch.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# A laptop's window and a phone's (the width of an iPhone 12 to 15). At 1280 px the column is 748 px wide:
# docs/stylesheets/extra.css sizes code so that the tutorial's 88-column examples (tests/test_docs.py) fit.
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
# 9 pt, the smallest figure text a reader should have to read, in CSS px (1 pt = 4/3 px).
MIN_FIGURE_TEXT_PX = 12

# Run in the page after it loaded; returns a list of problems, each a sentence.
CHECK_PAGE = r"""() => {
  const problems = [];
  const content = document.querySelector("article") || document.body;

  for (const img of document.images) {
    if (!img.complete || img.naturalWidth === 0) problems.push(`image did not load: ${img.getAttribute("src")}`);
  }

  // pymdownx.arithmatex wraps each formula in .arithmatex; KaTeX puts a .katex element inside it.
  for (const math of content.querySelectorAll(".arithmatex")) {
    if (!math.querySelector(".katex")) problems.push(`math not rendered: ${math.textContent.slice(0, 60)}`);
  }
  // Delimiters left in the text mean math that nothing rendered (code may show them legitimately).
  const walker = document.createTreeWalker(content, NodeFilter.SHOW_TEXT, {
    acceptNode: (node) => node.parentElement.closest("pre, code, script, style, .katex")
      ? NodeFilter.FILTER_REJECT : NodeFilter.FILTER_ACCEPT,
  });
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    for (const delimiter of ["\\(", "\\[", "$$"]) {
      if (node.textContent.includes(delimiter)) {
        problems.push(`math left as text (${delimiter}): ${node.textContent.trim().slice(0, 60)}`);
      }
    }
  }

  return problems;
}"""

# Run in the page after it loaded, at each width; returns a list of problems, each a sentence. `desktop`:
# whether nothing may scroll (1280 px) or only the boxes must fit (390 px); see the module's docstring.
CHECK_LAYOUT = r"""async ({desktop, minFigureTextPx}) => {
  const problems = [];
  const article = document.querySelector("article") || document.body;
  const tutorial = location.pathname.includes("/tutorial/");
  const rem = parseFloat(getComputedStyle(document.documentElement).fontSize);
  const box = article.getBoundingClientRect();
  const style = getComputedStyle(article);
  // Material's own bleed: .md-typeset__scrollwrap (and a phone's code blocks) reach 0.8rem into the margin.
  const left = Math.max(box.left + parseFloat(style.paddingLeft) - 0.8 * rem, 0);
  const right = Math.min(box.right - parseFloat(style.paddingRight) + 0.8 * rem,
                         document.documentElement.clientWidth);
  const name = (el) => (el.getAttribute("src") || el.textContent || "").trim().split("\n")[0].slice(0, 60);
  const fits = (el, what) => {
    const r = el.getBoundingClientRect();
    if (r.width > 0 && (r.left < left - 0.5 || r.right > right + 0.5)) {
      problems.push(`${what} runs ${Math.round(Math.max(left - r.left, r.right - right))} px past the column `
                    + `(${Math.round(r.left)}-${Math.round(r.right)} px, column ${Math.round(left)}-`
                    + `${Math.round(right)} px): ${name(el)}`);
    }
  };

  if (document.documentElement.scrollWidth > document.documentElement.clientWidth) {
    problems.push(`the page scrolls sideways (${document.documentElement.scrollWidth} px wide)`);
  }
  for (const code of article.querySelectorAll("pre > code")) {
    if (code.closest(".doc")) continue;  // the API reference's source listings, at 120 columns
    fits(code.parentElement, "code block");
    const language = (code.closest("[class*=language-]")?.className.match(/language-(\w+)/) || [])[1];
    const read = tutorial || ["python", "text"].includes(language);
    if (desktop && read && code.scrollWidth > code.clientWidth) {
      const longest = Math.max(...code.textContent.split("\n").map((line) => line.length));
      problems.push(`code block scrolls: ${code.scrollWidth - code.clientWidth} px wider than its box `
                    + `(${code.clientWidth} px; longest line ${longest} columns, ${language}): ${name(code)}`);
    }
  }
  for (const table of article.querySelectorAll("table")) {
    if (table.closest(".doc, .highlighttable")) continue;
    const scroller = table.closest(".md-typeset__scrollwrap") || table;
    fits(scroller, "table");
    if (desktop && scroller.scrollWidth > scroller.clientWidth) {
      problems.push(`table cut off: ${scroller.scrollWidth - scroller.clientWidth} px scroll out of its box `
                    + `(${scroller.clientWidth} px): ${name(table.querySelector("th, td") || table)}`);
    }
  }
  for (const svg of article.querySelectorAll("svg")) {
    if (!svg.closest(".katex, .md-icon, .twemoji, button, .md-clipboard, .headerlink")) fits(svg, "figure");
  }
  for (const img of article.querySelectorAll("img")) {
    fits(img, "figure");
    if (!desktop || !img.currentSrc.endsWith(".svg")) continue;
    // The smallest text in the SVG, in its own units, times the scale it is drawn at.
    const doc = new DOMParser().parseFromString(await (await fetch(img.currentSrc)).text(), "image/svg+xml");
    const root = doc.documentElement;
    const units = root.viewBox.baseVal && root.viewBox.baseVal.width ? root.viewBox.baseVal.width
                                                                       : root.width.baseVal.value;
    const scale = img.getBoundingClientRect().width / units;
    let smallest = Infinity, example = "";
    for (const el of doc.querySelectorAll("[style*=font], [font-size]")) {
      const match = (el.getAttribute("style") || "").match(/font(?:-size)?:[^;]*?([\d.]+)px/)
                    || [null, el.getAttribute("font-size")];
      const size = parseFloat(match[1]);
      if (size > 0 && el.textContent.trim() && size < smallest) {
        smallest = size;
        example = el.textContent.trim().slice(0, 30);
      }
    }
    // Layout rounds a width to 1/64 px: 9 pt drawn at the SVG's own size comes out at 11.9998 px.
    if (smallest * scale < minFigureTextPx - 0.01) {
      problems.push(`figure text too small: ${(smallest * scale).toFixed(1)} px as displayed (${smallest} in `
                    + `the SVG x ${scale.toFixed(2)}, "${example}"), under ${minFigureTextPx} px: ${name(img)}`);
    }
  }
  return problems;
}"""


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        pass


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> pathlib.Path:
    """The site built with --strict (a warning, such as a broken link, fails the build): its folder."""
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_mkdocs_build_strict(built_site):
    assert (built_site / "api" / "reference" / "index.html").exists()
    # The API reference has a page for every module of the oracle.
    for module in sorted((ROOT / "reference").glob("[!_]*.py")):
        assert (built_site / "api" / "reference" / module.stem / "index.html").exists(), module.name


@pytest.fixture(scope="module")
def site(built_site):
    """The built site served on 127.0.0.1: (base URL, every page's path under it)."""
    # Every page is a folder's index.html (use_directory_urls); the sitemap is empty without a site_url.
    folders = sorted(p.parent.relative_to(built_site).as_posix() for p in built_site.glob("**/index.html"))
    pages = ["" if folder == "." else f"{folder}/" for folder in folders]
    handler = functools.partial(QuietHandler, directory=built_site)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/", pages
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip(f"Debian's chromium is not installed ({CHROMIUM} is missing): "
                    "`apt-get install chromium`, as .ci/run does")
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def read_every_page(site, browser, viewport: dict, desktop: bool) -> list[str]:
    """Open every page at `viewport`; return its problems, each naming its page and the width."""
    base, pages = site
    assert len(pages) > 10, pages
    problems: list[str] = []
    page = browser.new_page(viewport=viewport)
    path = ""  # the page being checked: the loop below sets it, every problem names it

    def report(problem: str) -> None:
        problems.append(f"/{path} at {viewport['width']} px: {problem}")

    def on_console(message) -> None:
        if message.type == "error":
            report(f"console error: {message.text}")

    def on_response(response) -> None:
        if response.status >= 400:
            report(f"HTTP {response.status} for {response.url}")

    # The site must render offline: nothing may be fetched from anywhere but the site itself. Only
    # requests elsewhere are routed through Python (the pattern), so the site's own stay fast.
    def elsewhere(route) -> None:
        report(f"fetches {route.request.url[:100]}")
        route.abort()

    page.route(re.compile(rf"^(?!{re.escape(base)}|data:)"), elsewhere)
    page.on("console", on_console)
    page.on("pageerror", lambda error: report(f"uncaught error: {error}"))
    page.on("response", on_response)
    for path in pages:  # noqa: B007 (report reads it)
        page.goto(base + path, wait_until="load")
        for problem in page.evaluate(CHECK_PAGE):
            report(problem)
        for problem in page.evaluate(CHECK_LAYOUT, {"desktop": desktop, "minFigureTextPx": MIN_FIGURE_TEXT_PX}):
            report(problem)
    page.close()
    return problems


def test_every_page_renders_and_fits_at_1280_px(site, browser):
    """No errors; every code block, table and figure within the column, none scrolling; figure text legible."""
    problems = read_every_page(site, browser, DESKTOP, desktop=True)
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems)


def test_every_page_renders_and_fits_a_phone_at_390_px(site, browser):
    """No errors; every code block, table and figure within the column (scrolling inside its own box)."""
    problems = read_every_page(site, browser, PHONE, desktop=False)
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems)

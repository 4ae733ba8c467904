"""A real browser reads the site: every page opens without errors, with its images, its math and its examples.

The site is built strictly into a temporary folder, served on 127.0.0.1 and opened page by page in Debian's
headless Chromium, driven by playwright (which never downloads a browser of its own here). Nothing is
saved: no screenshots, no profile.
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

sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright

ROOT = pathlib.Path(__file__).parents[1]
CHROMIUM = pathlib.Path("/usr/bin/chromium")
# Flags that keep Chromium quiet on a machine with no network; playwright adds --headless and a fresh,
# temporary --user-data-dir of its own to every launch.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# A common laptop window. The tutorial's examples are at most 88 columns (tests/test_docs.py); from this
# width up, docs/stylesheets/extra.css makes the content column wide enough to show them whole.
VIEWPORT = {"width": 1366, "height": 768}

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(),
                                reason=f"Debian's chromium is not installed ({CHROMIUM} is missing): "
                                       "`apt-get install chromium`, as .ci/run does")

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

  // Which code blocks must fit: Python and text blocks, i.e. the tutorial's example files and their
  // outputs (the FastAPI-style includes; 88 columns, see tests/test_docs.py) and text diagrams, which are
  // read line by line. Not: shell commands (copied rather than read, and some benchmark commands are
  // long), and the API reference's source listings (.doc), which show reference/ as it is, at the
  // project's 120 columns.
  const blocks = content.querySelectorAll(
    "div.language-python.highlight pre > code, div.language-text.highlight pre > code");
  for (const code of blocks) {
    if (code.closest(".doc")) continue;
    if (code.scrollWidth > code.clientWidth) {
      const longest = Math.max(...code.textContent.split("\n").map((line) => line.length));
      problems.push(`code block wider than its container (${code.scrollWidth} > ${code.clientWidth} px, `
                    + `longest line ${longest} columns): ${code.textContent.split("\n")[0].slice(0, 60)}`);
    }
  }
  return problems;
}"""


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        pass


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The strictly built site, served on 127.0.0.1: (base URL, every page's path under it)."""
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    # Every page is a folder's index.html (use_directory_urls); the sitemap is empty without a site_url.
    folders = sorted(p.parent.relative_to(out).as_posix() for p in out.glob("**/index.html"))
    pages = ["" if folder == "." else f"{folder}/" for folder in folders]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=out))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/", pages
    server.shutdown()
    server.server_close()


def test_every_page_renders_in_chromium(site):
    base, pages = site
    assert len(pages) > 10, pages
    problems: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport=VIEWPORT)
        path = ""  # the page being checked: the loop below sets it, every problem names it

        def report(problem: str) -> None:
            problems.append(f"/{path}: {problem}")

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
        browser.close()
    assert not problems, f"{len(problems)} problems on {len(pages)} pages:\n" + "\n".join(problems)

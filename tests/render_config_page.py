"""Render the configuration page in headless Chromium and check that no config key breaks inside its name.

    apt-get install chromium && python tests/render_config_page.py [--width 700] [--screenshot page.png]

It builds the site (mkdocs build --strict), adds a script to a copy of configuration/index.html that counts the line
boxes of every key cell's code (one box: the name is on one line) and whether the page scrolls sideways, lets
Chromium run it (--dump-dom), and prints the result; exit 1 if a key breaks. tests/test_docs_layout.py checks the
same property on the built HTML and CSS without a browser (CI has none).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from test_docs_layout import ROOT, build

PROBE = """<script>
window.addEventListener("load", () => {
  const cells = [...document.querySelectorAll("article table tr td:first-child code")];
  const broken = cells.filter(c => c.getClientRects().length > 1).map(c => c.textContent);
  const boxes = [...document.querySelectorAll(
    "article .md-typeset__scrollwrap, article .md-typeset__table, article pre > code")];
  const wide = boxes.filter(e => e.scrollWidth > e.clientWidth + 1)
                    .map(e => e.tagName.toLowerCase() + ": " + e.textContent.trim().slice(0, 40));
  const out = document.createElement("pre");
  out.id = "render-result";
  out.textContent = JSON.stringify({cells: cells.length, broken, scrolls_sideways: wide});
  document.body.appendChild(out);
});
</script>"""


def render(site: Path, width: int, screenshot: str | None, name: str = "configuration") -> dict:
    page = site / name / "index.html" if name else site / "index.html"
    probe = page.with_name("probe.html")
    probe.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        sys.exit("no Chromium found: apt-get install chromium")
    base = [browser, "--headless", "--no-sandbox", "--disable-gpu", f"--window-size={width},1000",
            "--virtual-time-budget=5000"]
    dom = subprocess.run(base + ["--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120).stdout
    if screenshot:
        subprocess.run(base + [f"--screenshot={Path(screenshot).resolve()}", page.as_uri()], capture_output=True,
                       timeout=120)
    found = re.search(r'<pre id="render-result">(.*?)</pre>', dom, re.DOTALL)
    if not found:
        sys.exit("Chromium ran no probe (see its stderr with --enable-logging=stderr)")
    return json.loads(found.group(1).replace("&quot;", '"'))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, nargs="+", default=[700, 1000, 1400], help="window widths in CSS pixels")
    ap.add_argument("--screenshot", help="also save a screenshot of the page at the first width")
    ap.add_argument("--page", default="configuration", help="another page's directory (benchmarks, '' for home): "
                                                           "its first-column names and sideways scrolling")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        site = build(ROOT, Path(tmp) / "site")
        bad = 0
        for i, w in enumerate(args.width):
            r = render(site, w, args.screenshot if i == 0 else None, args.page)
            print(f"width {w}px: {r['cells']} key cells, {len(r['broken'])} broken inside a name "
                  f"{r['broken'][:5]}; {len(r['scrolls_sideways'])} tables or code blocks scroll sideways "
                  f"{r['scrolls_sideways'][:3]}")
            bad += bool(r["broken"]) or (r["cells"] == 0 and args.page == "configuration")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

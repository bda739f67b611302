"""What the first screen of a run's report.html holds, read by a headless browser.

    python benchmarks/report_screen.py RUN_DIR [--width 1400] [--height 900] [--png out.png]

prints, as JSON, where the verdict, the per-workload table and the kernels table end (pixels
from the top of the page) and whether each ends within the first screen, and with --png
writes a screenshot of that screen. It needs Chromium's headless shell (Debian:
`apt-get install chromium-headless-shell`; `chromium` works too); `browser()` is None
without one, and tests/pipeline/test_optimize.py's check of the README's main run skips then.
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

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")
# the blocks the first screen must hold: (report.html's h2 heading, the element after it)
BLOCKS = {"verdict": ("Verdict", "ul"), "workloads": ("Whole-model speedup per workload", "table"),
          "kernels": ("Kernels", "table")}
# measured in the page once it has loaded, written into it for --dump-dom to print
PROBE = """<script>
window.addEventListener("load", () => {
  const heads = [...document.querySelectorAll("h2")];
  const bottom = ([title, tag]) => {
    const h = heads.find(x => x.textContent.trim() === title);
    for (let e = h && h.nextElementSibling; e && e.tagName !== "H2"; e = e.nextElementSibling)
      if (e.matches(tag)) return Math.ceil(e.getBoundingClientRect().bottom + window.scrollY);
    return null;
  };
  const out = {viewport: [window.innerWidth, window.innerHeight]};
  for (const [name, spec] of Object.entries(BLOCKS)) out[name] = bottom(spec);
  const pre = document.createElement("pre");
  pre.id = "screen-probe";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def browser() -> str | None:
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


def _run(exe: str, page: Path, width: int, height: int, *args: str) -> str:
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           f"--window-size={width},{height}", "--virtual-time-budget=10000", *args,
           page.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout


def first_screen(run_dir: Path, width: int = 1400, height: int = 900,
                 png: Path | None = None) -> dict:
    """{block: bottom in px}, the viewport, and `fits`: every block ends within `height`."""
    exe = browser()
    if exe is None:
        raise RuntimeError(f"no headless browser found (tried {', '.join(BROWSERS)})")
    html = (Path(run_dir) / "report.html").read_text()
    probe = PROBE.replace("BLOCKS", json.dumps(BLOCKS))
    # beside the report, so its plots load as they would for a reader
    with tempfile.NamedTemporaryFile("w", suffix=".html", dir=run_dir) as page:
        page.write(html.replace("</body>", probe + "</body>"))
        page.flush()
        dom = _run(exe, Path(page.name), width, height, "--dump-dom")
        if png is not None:
            _run(exe, Path(page.name), width, height, f"--screenshot={Path(png).resolve()}")
    found = re.search(r'<pre id="screen-probe">(.*?)</pre>', dom, flags=re.S)
    if not found:
        raise RuntimeError("the page did not report its layout")
    out = json.loads(found.group(1))
    out["fits"] = all(out[k] is not None and out[k] <= height for k in BLOCKS)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--height", type=int, default=900)
    ap.add_argument("--png", type=Path, default=None)
    a = ap.parse_args()
    out = first_screen(a.run_dir, a.width, a.height, a.png)
    print(json.dumps(out))
    sys.exit(0 if out["fits"] else 1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Open every page of the built site (scripts/build_site.py) in a real browser, headless Chromium, and
check what a reader would see: each page loads with its title, every image on it is drawn (a figure
that failed to load has no width), a notebook's page shows every figure its executed notebook holds, and every link from one page of the site to another leads to a page
that exists, anchors included. Prints a table; exits 1 when a page fails.

    python scripts/check_site.py runs/site/html
    python scripts/check_site.py runs/site/html --screenshots runs/site/shots   # a PNG of each page too

Needs Chromium (Debian: apt-get install chromium) and websocket-client (in the course's environment).
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

# What each page reports, read in the page itself once it has loaded
PROBE = """(() => {
  const imgs = [...document.images].filter(i => !i.closest('.sidebar-drawer, .toc-drawer'));
  const links = [...document.querySelectorAll('article a[href]')].map(a => a.href);
  return JSON.stringify({title: document.title, ready: document.readyState,
    images: imgs.length, drawn: imgs.filter(i => i.complete && i.naturalWidth > 0).length,
    broken: imgs.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src).slice(0, 5),
    ids: [...document.querySelectorAll('[id]')].map(e => e.id), links});
})()"""


class Browser:
    """Headless Chromium driven over the DevTools protocol (one tab)."""

    def __init__(self) -> None:
        import websocket

        exe = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)),
                   None)
        if exe is None:
            raise SystemExit("error: no Chromium here: apt-get install chromium (Debian), then run this again")
        self.profile = tempfile.mkdtemp(prefix="course-site-check-")
        self.proc = subprocess.Popen([exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                      "--remote-debugging-port=0", f"--user-data-dir={self.profile}",
                                      "--window-size=1280,900", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.exists() or len(port_file.read_text().splitlines()) < 2:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit("error: Chromium did not start its DevTools port within 30 s")
            time.sleep(0.1)
        port = port_file.read_text().splitlines()[0]
        import urllib.request

        targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
        page = next(t for t in targets if t["type"] == "page")
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=60)
        self.next_id = 0
        self.call("Page.enable")

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def open(self, url: str, timeout_s: float = 30) -> dict:
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.call("Runtime.evaluate", expression=PROBE, returnByValue=True)["result"].get("value")
            report = json.loads(value) if value else {}
            pending = report.get("images", 0) - report.get("drawn", 0)
            if report.get("ready") == "complete" and (pending == 0 or time.monotonic() > deadline):
                return report
            if time.monotonic() > deadline:
                return report
            time.sleep(0.2)

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            shutil.rmtree(self.profile, ignore_errors=True)


def figures_in(notebook: Path) -> int:
    """The image outputs (a plot each) of an executed notebook."""
    cells = json.loads(notebook.read_text())["cells"]
    return sum(any(k.startswith("image/") for k in out.get("data", {}))
               for cell in cells if cell["cell_type"] == "code" for out in cell.get("outputs", []))


def check(html: Path, shots: Path | None = None) -> list[dict]:
    pages = sorted(p for p in html.rglob("*.html") if not p.name.startswith(("genindex", "search"))
                   and "_static" not in p.parts)
    browser = Browser()
    rows, ids = [], {}
    try:
        for page in pages:
            report = browser.open(page.resolve().as_uri())
            ids[page.resolve()] = set(report.get("ids", []))
            rows.append({"page": page.relative_to(html).as_posix(), **report})
            if shots is not None:
                shots.mkdir(parents=True, exist_ok=True)
                browser.screenshot(shots / (page.relative_to(html).as_posix().replace("/", "_") + ".png"))
    finally:
        browser.close()
    for row in rows:  # a notebook's page draws at least as many figures as its executed notebook holds
        source = html / "_sources" / (row["page"].removesuffix(".html") + ".ipynb.txt")
        row["figures"] = figures_in(source) if source.exists() else 0
    for row in rows:  # links inside the site: the page exists, and so does the anchor
        bad = []
        for link in row.pop("links"):
            parts = urlsplit(link)
            if parts.scheme != "file":
                continue
            target = Path(unquote(parts.path)).resolve()
            if not target.is_relative_to(html.resolve()):
                continue
            if not target.exists() or (parts.fragment and target in ids and parts.fragment not in ids[target]):
                bad.append(link.split(html.resolve().as_posix(), 1)[-1])
        row["bad_links"] = sorted(set(bad))
        row.pop("ids")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("html", type=Path, nargs="?", default=Path("runs/site/html"))
    parser.add_argument("--screenshots", type=Path)
    args = parser.parse_args(argv)
    if not (args.html / "index.html").exists():
        print(f"error: {args.html}/index.html not found: build the site first (make site)", file=sys.stderr)
        return 2
    rows = check(args.html, args.screenshots)
    failed = 0
    print(f"{'page':55s} {'loads':>5s} {'images drawn':>13s} {'figures':>7s} {'bad links':>9s}")
    for r in rows:
        ok = (r.get("ready") == "complete" and bool(r.get("title")) and r["drawn"] == r["images"]
              and r["drawn"] >= r["figures"] and not r["bad_links"])
        failed += not ok
        print(f"{r['page']:55s} {'yes' if r.get('ready') == 'complete' else 'NO':>5s} "
              f"{r['drawn']:>6d} of {r['images']:<4d} {r['figures']:>7d} {len(r['bad_links']):>9d}" + ("" if ok else "  FAIL"))
        for src in r.get("broken", []):
            print(f"    image not drawn: {src}")
        for link in r["bad_links"][:5]:
            print(f"    link to nothing: {link}")
    print(f"{len(rows) - failed} of {len(rows)} pages pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

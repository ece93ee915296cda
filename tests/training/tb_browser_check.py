"""The browser check of a run's TensorBoard logs: the installed TensorBoard serves LOGDIR on 127.0.0.1 (a
free port), Debian's headless Chromium loads the scalars page and takes a screenshot, and the loss chart
is found on it.

Usage: python tb_browser_check.py LOGDIR OUTDIR [TAG]   (TAG: the scalar whose chart must be drawn,
train/loss by default; OUTDIR receives screenshot.png and the logs)

Found means: (1) TensorBoard's HTTP data API lists TAG (/data/plugin/scalars/tags) and returns its points
(/data/plugin/scalars/scalars); (2) the screenshot of /#scalars, taken after Chromium's virtual time budget
let the page render, is 1400 x 1000 and holds TAG's chart line: the page is opened with the tag filter
^TAG$, so the first card is TAG's chart; at least 100 pixels of the first run's line colour (#ff7043) lie
in that card (a page without the chart has none there; Chromium's --dump-dom cannot show the card, which
lives in shadow roots). Prints one JSON line with the
timings; exits non-zero with the reason otherwise. The server and the browser run in their own process
groups and are killed in every case, so nothing is left behind.
"""

import json
import re
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

from PIL import Image

LINE_RGB = (255, 112, 67)  # #ff7043, the first run's colour in TensorBoard's scalars dashboard


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read().decode("utf-8"))


def kill_group(proc):
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def line_pixels(path):
    img = Image.open(path).convert("RGB")
    w, h = img.size
    px = img.load()
    count = 0
    # The first card: the page opens with the tag filter ^TAG$, whose "Tags matching" card comes first,
    # right of the sidebar (whose checkboxes share the orange) and below the header and the filter box; the
    # next card (another tag's chart) starts below y = 470.
    for y in range(160, min(h, 470)):
        for x in range(340, min(w, 800)):
            r, g, b = px[x, y]
            if abs(r - LINE_RGB[0]) <= 8 and abs(g - LINE_RGB[1]) <= 16 and abs(b - LINE_RGB[2]) <= 16:
                count += 1
    return (w, h), count


def main():
    logdir, outdir = sys.argv[1], sys.argv[2]
    tag = sys.argv[3] if len(sys.argv) > 3 else "train/loss"
    os.makedirs(outdir, exist_ok=True)
    chromium = shutil.which("chromium")
    if chromium is None:
        sys.exit("tb_browser_check: no chromium on PATH (scripts/setup installs Debian's chromium)")
    t0 = time.monotonic()
    server = browser = None
    try:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        with open(os.path.join(outdir, "tensorboard.log"), "w") as log:
            server = subprocess.Popen(
                [sys.executable, "-m", "tensorboard.main", "--logdir", logdir, "--host", "127.0.0.1",
                 "--port", str(port), "--load_fast", "false"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        tags = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if server.poll() is not None:
                sys.exit("tb_browser_check: TensorBoard exited with " + str(server.returncode) + ":\n"
                         + open(os.path.join(outdir, "tensorboard.log")).read())
            try:
                tags = get_json(base + "/data/plugin/scalars/tags")
                if any(tag in run_tags for run_tags in tags.values()):
                    break
            except OSError:
                pass
            time.sleep(0.3)
        served = time.monotonic()
        runs = [run for run, run_tags in (tags or {}).items() if tag in run_tags]
        if not runs:
            sys.exit(f"tb_browser_check: TensorBoard does not list {tag} within 60 s; tags: {json.dumps(tags)}")
        query = urllib.parse.urlencode({"run": runs[0], "tag": tag})
        points = get_json(base + "/data/plugin/scalars/scalars?" + query)
        if not points:
            sys.exit(f"tb_browser_check: no points for {tag}")

        shot = os.path.join(outdir, "screenshot.png")
        page = base + "/#scalars&tagFilter=" + urllib.parse.quote("^" + re.escape(tag) + "$", safe="")
        with open(os.path.join(outdir, "chromium.log"), "w") as log:
            browser = subprocess.Popen(
                [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000",
                 "--virtual-time-budget=15000", "--screenshot=" + shot, page],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                browser.wait(timeout=90)
            except subprocess.TimeoutExpired:
                sys.exit("tb_browser_check: chromium took over 90 s")
        if not os.path.exists(shot):
            sys.exit("tb_browser_check: chromium wrote no screenshot:\n"
                     + open(os.path.join(outdir, "chromium.log")).read())
        size, pixels = line_pixels(shot)
        result = {"tag": tag, "run": runs[0], "points": len(points), "screenshot": shot, "size": size,
                  "line_pixels": pixels, "serve_s": round(served - t0, 1),
                  "total_s": round(time.monotonic() - t0, 1)}
        print(json.dumps(result))
        if size != (1400, 1000) or pixels < 100:
            sys.exit(f"tb_browser_check: no chart of {tag} on the screenshot ({pixels} pixels of the line colour in its card)")
    finally:
        kill_group(browser)
        kill_group(server)


if __name__ == "__main__":
    main()

"""The pack in a real browser: ComfyUI's page in Debian's chromium, driven by Playwright.

Starts a ComfyUI with the pack (tests/comfyui_harness.py), opens its page, loads the template
``workflows/sjd_text_to_image_reference.json`` from its file, queues it, waits for the saved image
and the sampler's chart, queues it again (a cached re-run, which sends no progress), checks what
the page shows, and saves a screenshot.

One-time setup (no browser download: Playwright drives the system chromium):
    apt-get install chromium
    python3 -m pip install -r tests/requirements.txt playwright
    python3 tests/comfyui_harness.py install

Run:
    python3 tests/browser_check.py --out /tmp/sjd_browser.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from comfyui_harness import REPO, ComfyServer  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
WORKFLOW = REPO / "workflows" / "sjd_text_to_image_reference.json"


def open_page(playwright, url: str, height: int):
    """Chromium on the ComfyUI page, once its graph exists; returns (browser, page, errors)."""
    browser = playwright.chromium.launch(executable_path=CHROMIUM,
                                         args=["--no-sandbox", "--disable-gpu"])
    page = browser.new_page(viewport={"width": 1600, "height": height})
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(url)
    page.wait_for_function("window.app && window.app.graph && window.app.graph._nodes",
                           timeout=60_000)
    return browser, page, errors


def run_twice(page, chart, save_id: int, timeout: float) -> tuple[float, str, str, dict]:
    """Queue the loaded workflow, wait for the saved image and the chart's summary, then queue it
    again: ComfyUI serves it from its cache and the chart must say so while keeping the run that
    made the result. Returns (seconds of the first run, chart text, chart text after the cached
    re-run, the saved image's entry)."""
    started = time.monotonic()
    page.evaluate("async () => { await window.app.queuePrompt(0, 1); }")
    page.wait_for_function(f"(window.app.nodeOutputs['{save_id}']?.images?.length ?? 0) > 0",
                           timeout=timeout * 1000)
    elapsed = time.monotonic() - started
    page.wait_for_function(
        "document.querySelector('.sjd-chart')?.textContent.includes('forward passes')",
        timeout=30_000)
    chart_text = chart.inner_text()
    page.evaluate("async () => { await window.app.queuePrompt(0, 1); }")
    page.wait_for_function("document.querySelector('.sjd-chart')?.textContent.includes('cached')",
                           timeout=60_000)
    cached_text = chart.inner_text()
    assert "forward passes" in cached_text, cached_text
    return elapsed, chart_text, cached_text, page.evaluate(
        f"window.app.nodeOutputs['{save_id}'].images[0]")


def check(out: Path, workflow: Path = WORKFLOW, timeout: float = 240.0) -> dict:
    """Run the browser check; returns what was seen (raises AssertionError when something is off)."""
    from playwright.sync_api import sync_playwright

    graph = json.loads(workflow.read_text())
    save_id = next(n["id"] for n in graph["nodes"] if n["type"] == "SaveImage")
    sampler_id = next(n["id"] for n in graph["nodes"] if n["type"] == "SJDSampler")
    with ComfyServer() as server, sync_playwright() as playwright:
        browser, page, errors = open_page(playwright, server.url, height=1000)
        # Loaded from the file's text, exactly as dropping the file on the page does.
        page.evaluate("async (text) => { await window.app.loadGraphData(JSON.parse(text)); }",
                      workflow.read_text())
        assert page.locator(".sjd-chart").count() == 1, "the sampler's chart widget is missing"
        elapsed, chart_text, cached_text, image = run_twice(page, page.locator(".sjd-chart"),
                                                            save_id, timeout)
        # Frame the graph so that every node is in the picture.
        page.evaluate("() => { const c = window.app.canvas; c.ds.scale = 0.75; "
                      "c.ds.offset = [10, 10]; c.setDirty(true, true); }")
        page.wait_for_timeout(500)
        out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(out))
        browser.close()
    assert not errors, f"page errors: {errors}"
    return {"screenshot": str(out), "image": image, "seconds": round(elapsed, 1),
            "chart": chart_text, "chart_after_cached_rerun": cached_text,
            "sampler_node": sampler_id}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/sjd_browser.png"))
    parser.add_argument("--workflow", type=Path, default=WORKFLOW,
                        help="a UI-format workflow with one SJD Sampler and one Save Image")
    args = parser.parse_args()
    print(json.dumps(check(args.out, args.workflow), indent=1))


if __name__ == "__main__":
    main()

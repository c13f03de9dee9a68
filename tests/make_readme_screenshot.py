"""Write the README's screenshot, ``web/docs/images/template_text_to_image.png``: the template
*SJD text to image (reference)* in the 2024 ComfyUI of ``comfyui_harness.py``, after one run, in
Chromium at the template's saved view.

    python3 tests/make_readme_screenshot.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from playwright.sync_api import sync_playwright

sys.path.insert(0, str(Path(__file__).resolve().parent))
from browser_check import TEMPLATES, load, node_of, open_page, queue, show_saved_view, \
    wait_for_image  # noqa: E402
from comfyui_harness import REPO, ComfyServer  # noqa: E402

TEMPLATE = TEMPLATES / "SJD text to image (reference).json"
OUT = REPO / "web" / "docs" / "images" / "template_text_to_image.png"
VIEW = {"x": 70, "y": 80, "width": 850, "height": 660}  # the part of the page the nodes fill


def main() -> None:
    graph = json.loads(TEMPLATE.read_text())
    with ComfyServer() as server, sync_playwright() as playwright:
        browser, page, errors = open_page(playwright, server.url)
        try:
            load(page, graph)
            show_saved_view(page, graph)
            queue(page)
            wait_for_image(page, node_of(graph, "SaveImage"), timeout=240)
            page.wait_for_timeout(1500)  # the chart and the summary are drawn
            page.screenshot(path=str(OUT), clip=VIEW)
        finally:
            browser.close()
    if errors:
        raise RuntimeError(f"the page reported errors: {errors}")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

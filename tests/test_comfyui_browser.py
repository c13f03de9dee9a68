"""The reference template in a real browser (Debian's chromium driven by Playwright).

See tests/browser_check.py; .ci/run installs chromium and Playwright's Python package.
"""

from __future__ import annotations

import sys
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from browser_check import check  # noqa: E402


def test_reference_workflow_in_the_browser(tmp_path):
    seen = check(tmp_path / "comfyui.png")
    assert seen["image"]["type"] == "output" and seen["image"]["filename"].endswith(".png")
    assert "forward passes for 256 codes" in seen["chart"]
    assert seen["chart_after_cached_rerun"].startswith("cached (inputs unchanged)")
    with Image.open(seen["screenshot"]) as shot:
        assert shot.size == (1600, 1000)

"""The samplers' resolution list follows the loader's model, in a real browser (chromium, Playwright).

A loader and both samplers (SJD Sampler and the first release's, hidden) are placed on the page
and wired as a user would; each list must narrow to every size of the model, change with the
loader's choice, and come back whole when the wire is removed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from browser_check import open_page  # noqa: E402
from comfyui_harness import ComfyServer  # noqa: E402
from sjd_core.models.registry import resolutions_on_disk  # noqa: E402

SAMPLERS = ("SJDSamplerV2", "SJDSampler")
OPTIONS = ("() => window.sjdSamplers.map((s) => s.widgets.find((w) => w.name === 'resolution')"
           ".options.values.join(','))")


def wait_for_options(page, expected: str) -> None:
    """Until every sampler on the page offers ``expected`` (comma-separated)."""
    want = json.dumps([expected] * len(SAMPLERS))
    page.wait_for_function(f"JSON.stringify(({OPTIONS})()) === JSON.stringify({want})",
                           timeout=30_000)


def test_resolution_list_follows_the_loaded_model(tmp_path, monkeypatch):
    from playwright.sync_api import sync_playwright

    lumina = tmp_path / "models" / "Lumina-mGPT-7B-512"
    lumina.mkdir(parents=True)
    (lumina / "config.json").write_text(json.dumps(
        {"model_type": "chameleon", "vocab_size": 65536, "z_loss_weight": 1e-5}))
    _, sizes = resolutions_on_disk(lumina)
    lumina_sizes = ",".join(["default", *(f"{w}x{h}" for w, h in sizes)])
    assert len(sizes) == 49 and "1024x256" in lumina_sizes
    monkeypatch.setenv("SJD_MODELS_DIR", str(tmp_path / "models"))
    with ComfyServer() as server, sync_playwright() as playwright:
        browser, page, errors = open_page(playwright, server.url)
        full = page.evaluate(f"""() => {{
            const graph = window.app.graph;
            graph.clear();
            const loader = LiteGraph.createNode('SJDModelLoader');
            graph.add(loader);
            window.sjdLoader = loader;
            window.sjdSamplers = {json.dumps(list(SAMPLERS))}.map((type) => {{
                const sampler = LiteGraph.createNode(type);
                graph.add(sampler);
                return sampler;
            }});
            return ({OPTIONS})();
        }}""")
        assert full[0] == full[1] and full[0].startswith("default,32x32,")
        assert "1024x256" not in full[0].split(",")[:5]  # the full list, not yet narrowed
        page.evaluate("""() => {
            const choice = window.sjdLoader.widgets.find((w) => w.name === 'model');
            choice.value = 'Lumina-mGPT-7B-512';
            for (const sampler of window.sjdSamplers) window.sjdLoader.connect(0, sampler, 0);
        }""")
        # every one of the 49 sizes the 512 checkpoint offers, in its order, default first
        wait_for_options(page, lumina_sizes)
        page.evaluate("""() => {
            const choice = window.sjdLoader.widgets.find((w) => w.name === 'model');
            choice.value = 'reference (embedded)';
            choice.callback?.(choice.value);
        }""")
        wait_for_options(page, "default,32x32")
        page.evaluate("() => { for (const sampler of window.sjdSamplers) sampler.disconnectInput(0); }")
        wait_for_options(page, full[0])
        browser.close()
    assert not errors, f"page errors: {errors}"

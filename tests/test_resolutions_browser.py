"""The sampler's resolution list follows the loader's model, in a real browser (chromium, Playwright).

A loader and a sampler are placed on the page and wired as a user would; the list must narrow to
the model's sizes that the sampler accepts, change with the loader's choice, and come back whole
when the wire is removed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from browser_check import open_page  # noqa: E402
from comfyui_harness import ComfyServer  # noqa: E402

OPTIONS = "() => window.sjdSampler.widgets.find((w) => w.name === 'resolution').options.values.join(',')"


def wait_for_options(page, expected: str) -> None:
    page.wait_for_function(f"({OPTIONS})() === {json.dumps(expected)}", timeout=30_000)


def test_resolution_list_follows_the_loaded_model(tmp_path, monkeypatch):
    from playwright.sync_api import sync_playwright

    lumina = tmp_path / "models" / "Lumina-mGPT-7B-512"
    lumina.mkdir(parents=True)
    (lumina / "config.json").write_text(json.dumps(
        {"model_type": "chameleon", "vocab_size": 65536, "z_loss_weight": 1e-5}))
    monkeypatch.setenv("SJD_MODELS_DIR", str(tmp_path / "models"))
    with ComfyServer() as server, sync_playwright() as playwright:
        browser, page, errors = open_page(playwright, server.url, height=800)
        full = page.evaluate("""() => {
            const graph = window.app.graph;
            graph.clear();
            const loader = LiteGraph.createNode('SJDModelLoader');
            const sampler = LiteGraph.createNode('SJDSampler');
            graph.add(loader);
            graph.add(sampler);
            window.sjdLoader = loader;
            window.sjdSampler = sampler;
            return sampler.widgets.find((w) => w.name === 'resolution').options.values.join(',');
        }""")
        assert full.startswith("default,32x32,") and "512x512" in full
        page.evaluate("""() => {
            const choice = window.sjdLoader.widgets.find((w) => w.name === 'model');
            choice.value = 'Lumina-mGPT-7B-512';
            window.sjdLoader.connect(0, window.sjdSampler, 0);
        }""")
        # of the 49 sizes the 512 checkpoint offers, the sampler's list holds only 512x512
        wait_for_options(page, "default,512x512")
        page.evaluate("""() => {
            const choice = window.sjdLoader.widgets.find((w) => w.name === 'model');
            choice.value = 'reference (embedded)';
            choice.callback?.(choice.value);
        }""")
        wait_for_options(page, "default,32x32")
        page.evaluate("() => window.sjdSampler.disconnectInput(0)")
        wait_for_options(page, full)
        browser.close()
    assert not errors, f"page errors: {errors}"

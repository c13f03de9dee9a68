"""The samplers' resolution list follows the loader's model, in a real browser (Playwright).

A loader and both samplers (SJD Sampler and the first release's, hidden) are placed on the page
and wired as a user would; each list must narrow to every size of the model, change with the
loader's choice, and come back whole when the wire is removed. The sampler's dropdown is opened as
a person opens it, and its entries are counted on the page: the LiteGraph menu of the classic
canvas, the Vue dropdown of "Nodes 2.0" (which keeps its own copy of the widget's options). Then
"Refresh Node Definitions" (key R), which puts the server's full lists back on every combo, and
the dropdown must still offer the model's sizes only. Last, a saved workflow is loaded and its
sampler's dropdown offers its model's sizes.

Setups, each one server for all its checks: the 2024 ComfyUI (canvas), and ComfyUI 0.3.75 with the
newest frontend (1.58.1) and with the one it pins (1.32.9), each in both renderers. No deprecation
warning may come from the pack's scripts (1.58 marks input.link deprecated and warns in the
console when it is read).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from browser_check import TEXT_TO_IMAGE, load, node_of, open_page, show_node  # noqa: E402
from comfyui_harness import PACK_DIR_NAME, ComfyServer  # noqa: E402
from sjd_core.models.registry import resolutions_on_disk  # noqa: E402

# Real ComfyUI servers (and a browser): outside the fast loop, `pytest -m "not slow"`.
pytestmark = pytest.mark.slow

SAMPLERS = ("SJDSamplerV2", "SJDSampler")
MODEL = "Lumina-mGPT-7B-512"
OPTIONS = ("() => window.sjdSamplers.map((s) => s.widgets.find((w) => w.name === 'resolution')"
           ".options.values.join(','))")
# (setup, Vue nodes): the 2024 frontend has no Vue nodes
CHECKS = [("2024", False), ("newest", False), ("newest", True), ("pinned", False), ("pinned", True)]

# Every entry of the open Vue dropdown. The newest frontend draws only the entries in view
# (a virtual list), so the list is scrolled from top to bottom and the entries seen are collected.
VUE_ENTRIES = """async () => {
    const seen = [];
    const collect = () => {
        for (const option of document.querySelectorAll('[role=option]')) {
            const text = option.textContent.trim();
            if (!seen.includes(text)) seen.push(text);
        }
    };
    const frame = () => new Promise(
        (done) => requestAnimationFrame(() => requestAnimationFrame(done)));
    let box = document.querySelector('[role=option]')?.parentElement;
    while (box && box.scrollHeight <= box.clientHeight + 1) box = box.parentElement;
    collect();
    if (box) {
        box.scrollTop = 0;
        for (let step = 0; step < 500; step += 1) {
            await frame();
            collect();
            if (box.scrollTop + box.clientHeight >= box.scrollHeight - 1) break;
            box.scrollTop += Math.max(24, box.clientHeight - 40); // a view on, an entry overlapping
        }
        await frame();
        collect();
    }
    return seen;
}"""

# Every deprecation warning of LiteGraph (1.32 and later), also one the frontend has already given
# once, with the calls that led to it.
RECORD_DEPRECATIONS = """() => {
    window.sjdDeprecations = [];
    if (!Array.isArray(LiteGraph.onDeprecationWarning)) return;
    LiteGraph.alwaysRepeatWarnings = true;
    LiteGraph.onDeprecationWarning.push(
        (message) => window.sjdDeprecations.push(`${message}\\n${new Error().stack}`));
}"""

# Where the canvas draws a node's widget, in page coordinates (the middle of its value, clear of
# the arrows at both ends).
CANVAS_WIDGET_POINT = """([id, name]) => {
    const node = window.app.graph.getNodeById(id);
    const widget = node.widgets.find((w) => w.name === name);
    const y = widget.y ?? widget.last_y;
    const height = widget.computedHeight ?? LiteGraph.NODE_WIDGET_HEIGHT;
    const [x, top] = window.app.canvas.ds.convertOffsetToCanvas(
        [node.pos[0] + node.size[0] / 2, node.pos[1] + y + height / 2]);
    const box = window.app.canvas.canvas.getBoundingClientRect();
    return [box.left + x, box.top + top];
}"""


@pytest.fixture(scope="module")
def lumina_sizes(tmp_path_factory) -> tuple[Path, list[str]]:
    """A models folder with one checkpoint (its config only); its sizes, "default" first."""
    models = tmp_path_factory.mktemp("sjd-models")
    lumina = models / MODEL
    lumina.mkdir()
    (lumina / "config.json").write_text(json.dumps(
        {"model_type": "chameleon", "vocab_size": 65536, "z_loss_weight": 1e-5}))
    _, sizes = resolutions_on_disk(lumina)
    return models, ["default", *(f"{w}x{h}" for w, h in sizes)]


@pytest.fixture(scope="module")
def server(request, lumina_sizes):
    """One running ComfyUI per setup (``request.param``), for every check of that setup."""
    if request.param == "2024":
        running = ComfyServer()
    else:
        from comfyui_current import CurrentComfyServer

        running = CurrentComfyServer(use_newest_frontend=request.param == "newest")
    running.setup = request.param
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SJD_MODELS_DIR", str(lumina_sizes[0]))
        with running:
            yield running


def wait_for_options(page, expected: str) -> None:
    """Until every sampler on the page offers ``expected`` (comma-separated)."""
    want = json.dumps([expected] * len(SAMPLERS))
    page.wait_for_function(f"JSON.stringify(({OPTIONS})()) === JSON.stringify({want})",
                           timeout=30_000)


def dropdown_entries(page, vue: bool, node_id) -> list[str]:
    """Open the sampler's resolution dropdown as a person does; its entries, then close it."""
    if vue:
        page.locator(f"[data-node-id='{node_id}'] [role=combobox][aria-label=resolution]").click()
        page.locator("[role=option]").first.wait_for(timeout=30_000)
        entries = page.evaluate(VUE_ENTRIES)
        page.keyboard.press("Escape")
        page.locator("[role=option]").first.wait_for(state="detached", timeout=30_000)
        return entries
    page.evaluate("() => window.app.canvas.setDirty(true, true)")
    page.wait_for_timeout(300)  # a frame, which lays out the widgets
    x, y = page.evaluate(CANVAS_WIDGET_POINT, [node_id, "resolution"])
    page.mouse.click(x, y)
    page.locator(".litecontextmenu .litemenu-entry").first.wait_for(timeout=30_000)
    entries = page.evaluate("() => Array.from(document.querySelectorAll("
                            "'.litecontextmenu .litemenu-entry'), (e) => e.textContent.trim())")
    page.evaluate("() => LiteGraph.closeAllContextMenus(window)")
    page.locator(".litecontextmenu").first.wait_for(state="detached", timeout=30_000)
    return entries


def refresh_node_definitions(page) -> int:
    """What key R does: the command "Comfy.RefreshNodeDefinitions" on the frontends that have
    commands, app.refreshComboInNodes() (the Refresh button) on the 2024 one; returns how often
    the page asked the server for the node definitions meanwhile."""
    asked: list[str] = []

    def listener(request) -> None:
        if "/object_info" in request.url:
            asked.append(request.url)

    page.on("request", listener)
    page.evaluate("""async () => {
        const commands = window.app.extensionManager?.command;
        if (commands?.execute) await commands.execute('Comfy.RefreshNodeDefinitions');
        else await window.app.refreshComboInNodes();
    }""")
    page.remove_listener("request", listener)
    return len(asked)


@pytest.mark.parametrize(("server", "vue"), CHECKS, indirect=["server"],
                         ids=[f"{setup}-{'vue' if vue else 'canvas'}" for setup, vue in CHECKS])
def test_resolution_list_follows_the_loaded_model(server, vue, lumina_sizes):
    from playwright.sync_api import sync_playwright

    sizes = lumina_sizes[1]
    assert len(sizes) == 50 and "1024x256" in sizes
    if hasattr(server, "set_setting"):
        server.set_setting("Comfy.VueNodes.Enabled", vue)
        server.set_setting("Comfy.TutorialCompleted", True)
    with sync_playwright() as playwright:
        browser, page, errors = open_page(playwright, server.url)
        console: list[str] = []
        page.on("console", lambda message: console.append(f"{message.type}: {message.text}"))
        page.evaluate(RECORD_DEPRECATIONS)
        full = page.evaluate(f"""() => {{
            const graph = window.app.graph;
            graph.clear();
            const ds = window.app.canvas.ds;
            ds.scale = 1;
            ds.offset = [0, 0];
            const loader = LiteGraph.createNode('SJDModelLoader');
            loader.pos = [800, 150];
            graph.add(loader);
            window.sjdLoader = loader;
            window.sjdSamplers = {json.dumps(list(SAMPLERS))}.map((type, row) => {{
                const sampler = LiteGraph.createNode(type);
                sampler.pos = [100 + 450 * row, 150];
                graph.add(sampler);
                return sampler;
            }});
            window.app.canvas.setDirty(true, true);
            return ({OPTIONS})();
        }}""")
        sampler_id = page.evaluate("window.sjdSamplers[0].id")
        assert full[0] == full[1] and full[0].startswith("default,32x32,")
        assert "1024x256" not in full[0].split(",")[:5]  # the full list, not yet narrowed
        if vue:  # the Vue nodes have made their copies of the widgets' options
            page.locator(f"[data-node-id='{sampler_id}'] [role=combobox][aria-label=resolution]"
                         ).wait_for(timeout=30_000)
        page.evaluate(f"""() => {{
            const choice = window.sjdLoader.widgets.find((w) => w.name === 'model');
            choice.value = {json.dumps(MODEL)};
            for (const sampler of window.sjdSamplers) window.sjdLoader.connect(0, sampler, 0);
        }}""")
        # every one of the 49 sizes the 512 checkpoint offers, in its order, default first
        wait_for_options(page, ",".join(sizes))
        seen = {"narrowed": dropdown_entries(page, vue, sampler_id)}
        seen["object_info_requests"] = refresh_node_definitions(page)
        wait_for_options(page, ",".join(sizes))
        seen["after_refresh"] = dropdown_entries(page, vue, sampler_id)
        page.evaluate("""() => {
            const choice = window.sjdLoader.widgets.find((w) => w.name === 'model');
            choice.value = 'reference (embedded)';
            choice.callback?.(choice.value);
        }""")
        wait_for_options(page, "default,32x32")
        seen["reference"] = dropdown_entries(page, vue, sampler_id)
        page.evaluate("() => { for (const s of window.sjdSamplers) s.disconnectInput(0); }")
        wait_for_options(page, full[0])
        seen["console_deprecations"] = [line for line in console if "deprecat" in line.lower()]
        # a saved workflow, loaded: its loader picks the reference model (one size)
        workflow = json.loads(TEXT_TO_IMAGE.read_text())
        load(page, workflow)
        loaded_id = node_of(workflow, *SAMPLERS)
        page.wait_for_function(
            f"window.app.graph.getNodeById({loaded_id}).widgets.find((w) => w.name === "
            "'resolution').options.values.join(',') === 'default,32x32'", timeout=30_000)
        show_node(page, loaded_id)
        seen["loaded_workflow"] = dropdown_entries(page, vue, loaded_id)
        seen["pack_deprecations"] = page.evaluate(
            f"window.sjdDeprecations.filter((w) => w.includes('/extensions/{PACK_DIR_NAME}/'))")
        browser.close()
    print(server.setup, "vue" if vue else "canvas", {key: len(value) if isinstance(value, list)
                                                     else value for key, value in seen.items()})
    assert seen["narrowed"] == sizes, f"the dropdown offers {len(seen['narrowed'])} entries"
    assert seen["object_info_requests"] >= 1  # the refresh did ask the server again
    assert seen["after_refresh"] == sizes, f"after a refresh: {len(seen['after_refresh'])} entries"
    assert seen["reference"] == ["default", "32x32"]
    assert seen["loaded_workflow"] == ["default", "32x32"]
    assert not errors, f"page errors: {errors}"
    # The frontend warns itself when it loads a workflow (LGraphNode.configure reads input.link),
    # so the console is read up to then; after it, each warning's calls tell whose it is.
    assert not seen["console_deprecations"], seen["console_deprecations"]
    assert not seen["pack_deprecations"], seen["pack_deprecations"]

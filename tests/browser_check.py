"""The pack in a real browser: ComfyUI's page in Debian's chromium, driven by Playwright.

``check(server, vue, out_dir)`` runs on a started ComfyUI (the 2024 one of
tests/comfyui_harness.py or the current one of tests/comfyui_current.py) and checks what a person
sees, in the classic canvas or (``vue=True``) in the "Vue nodes" mode:

* the text-to-image template loads, runs, and the sampler's chart counts steps from 1, each step
  once, receives the finished run exactly once, and keeps the run on a cached re-run; the summary
  under the chart shows whole;
* a run that fails shows the pack's message in red on the sampler node itself;
* inputs that ComfyUI's validation refuses (a size no model draws on the sampler, a family
  template's checkpoint that is not installed on the loader) show the pack's message in red on
  that node without a click, and the next run clears it;
* the same AR run takes no longer from the page than over the API (the page's chart hears at
  most 4 messages a second, ComfyUI's progress bar 2);
* removing the sampler disconnects the chart's ResizeObserver;
* a workflow saved with the first release's sampler loads and runs;
* every template fits a 1600 x 1000 screen at 75% zoom, with its notes beside the nodes;
* every template that runs on the embedded model, once its run has finished (previews, charts and
  summaries shown), seen at the zoom it opens with: no two nodes overlap, and the comparison's
  measured speed-up is drawn large enough to read on screen;
* on the current ComfyUI, the template browser shows the pack's category, every template's title
  and thumbnail, and loads a template from its card.

Screenshots go to ``out_dir`` (tests/screenshots/ by default, ignored by git).

One-time setup (no browser download: Playwright drives the system chromium):
    apt-get install chromium
    python3 -m pip install -r tests/requirements.txt
    python3 tests/comfyui_harness.py install && python3 tests/comfyui_current.py install

By hand:
    python3 tests/browser_check.py --comfyui 2024
    python3 tests/browser_check.py --comfyui current --vue
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from comfyui_harness import REPO, ComfyServer  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
TEMPLATES = REPO / "workflows"
TEXT_TO_IMAGE = TEMPLATES / "SJD text to image (reference).json"
COMPARISON = TEMPLATES / "SJD AR vs AUTO (reference).json"
# The templates that run on the embedded model (the others need a family's checkpoint).
RUNNABLE = (TEXT_TO_IMAGE, COMPARISON)
SPEED_UP_PX = 12  # the least height on screen of the comparison's measured speed-up
OLD_WORKFLOW = REPO / "tests" / "old_workflows" / "first_release_text_to_image.json"
SCREENSHOTS = REPO / "tests" / "screenshots"
SCREEN = (1600, 1000)
ZOOM = 0.75
SAMPLER_TYPES = ("SJDSamplerV2", "SJDSampler")
BAD_PROMPT = "a red sports car"  # the reference model knows Fashion-MNIST classes only
STALE_RESOLUTION = "1000x1000"  # a size no family draws (a workflow from elsewhere)
PAGE_OVER_API = 1.3  # the most a run queued from the page may take over the same job queued
# over the API (the fastest of each in api_versus_page, the medians in page_and_api_runs)
# A family template: its checkpoint is not installed where the tests run.
MISSING_CHECKPOINT = TEMPLATES / "SJD Lumina-mGPT text to image.json"


# Before the page's own scripts: note every console warning about something deprecated, with the
# scripts it came through (``window.sjdDeprecations``: [message, stack]).
WATCH_DEPRECATIONS = """
window.sjdDeprecations = [];
const warn = console.warn.bind(console);
console.warn = (...args) => {
  const text = args.map(String).join(" ");
  if (text.includes("deprecated")) window.sjdDeprecations.push([text, new Error().stack]);
  warn(...args);
};
"""


def open_page(playwright, url: str):
    """Chromium on the ComfyUI page, once its graph exists; returns (browser, page, errors).
    ``page.sjd_failed`` lists the pack's requests (its routes and scripts) that failed."""
    browser = playwright.chromium.launch(executable_path=CHROMIUM,
                                         args=["--no-sandbox", "--disable-gpu"])
    page = browser.new_page(viewport={"width": SCREEN[0], "height": SCREEN[1]})
    page.add_init_script(WATCH_DEPRECATIONS)
    errors: list[str] = []
    page.sjd_failed = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("response", lambda answer: page.sjd_failed.append([answer.status, answer.url])
            if answer.status >= 400 and ("/sjd/" in answer.url or "sjd-autoregressive" in answer.url)
            else None)
    page.goto(url)
    page.wait_for_function("window.app && window.app.graph && window.app.graph._nodes",
                           timeout=60_000)
    return browser, page, errors


def load(page, graph: dict) -> None:
    """Load a UI-format workflow, as dropping its file on the page does."""
    page.evaluate("async (text) => { await window.app.loadGraphData(JSON.parse(text)); }",
                  json.dumps(graph))
    page.wait_for_timeout(500)


def node_of(graph: dict, *types: str) -> int:
    return next(n["id"] for n in graph["nodes"] if n["type"] in types)


def queue(page) -> None:
    page.evaluate("async () => { await window.app.queuePrompt(0, 1); }")


def shown_image(page, node_id: int) -> str | None:
    """The file name of the first image a node shows, or None."""
    return page.evaluate(f"window.app.nodeOutputs['{node_id}']?.images?.[0]?.filename ?? null")


def wait_for_image(page, node_id: int, timeout: float, before: str | None = None) -> dict:
    """Wait until the node shows an image other than ``before``; returns its entry."""
    page.wait_for_function(
        f"(window.app.nodeOutputs['{node_id}']?.images?.[0]?.filename ?? null) !== null && "
        f"window.app.nodeOutputs['{node_id}'].images[0].filename !== {json.dumps(before)}",
        timeout=timeout * 1000)
    return page.evaluate(f"window.app.nodeOutputs['{node_id}'].images[0]")


def chart_text(page, sampler_id: int) -> str:
    return page.evaluate(f"window.app.graph.getNodeById({sampler_id}).sjdChart.box.innerText")


def set_widget(page, node_id: int, name: str, value) -> None:
    """Set a widget's value as picking it in the page does."""
    page.evaluate(f"""() => {{
        const node = window.app.graph.getNodeById({node_id});
        const widget = node.widgets.find((w) => w.name === {json.dumps(name)});
        widget.value = {json.dumps(value)};
        widget.callback?.(widget.value);
    }}""")


def run_with_chart(page, sampler_id: int, save_id: int, timeout: float) -> dict:
    """Queue the loaded workflow while recording the chart's status lines, the steps each
    progress message brings and its finish calls; then queue it again with the seed kept (served
    from ComfyUI's cache, no progress messages)."""
    set_widget(page, sampler_id, "control_after_generate", "fixed")  # the templates randomise it
    page.evaluate(f"""() => {{
        const chart = window.app.graph.getNodeById({sampler_id}).sjdChart;
        window.sjdSeen = {{ statuses: [], finishes: 0, messages: [], before_finish: null }};
        const setStatus = chart.setStatus.bind(chart);
        chart.setStatus = (text, ...rest) => {{
            window.sjdSeen.statuses.push(text);
            setStatus(text, ...rest);
        }};
        const progress = chart.progress.bind(chart);
        chart.progress = (detail) => {{
            window.sjdSeen.messages.push([detail.iteration, (detail.steps ?? []).length]);
            progress(detail);
            if (chart.live !== null) window.sjdSeen.statuses.push(chart.live);  // its next frame's
        }};
        // What the chart's line shows, frame by frame, while the run lasts.
        window.sjdSeen.painted = new Set();
        const watch = () => {{
            window.sjdSeen.painted.add(chart.status.textContent);
            if (!window.sjdSeen.finishes) requestAnimationFrame(watch);
        }};
        requestAnimationFrame(watch);
        const finish = chart.finish.bind(chart);
        chart.finish = (...args) => {{
            window.sjdSeen.finishes += 1;
            window.sjdSeen.before_finish ??= chart.accepted.length;
            finish(...args);
        }};
    }}""")
    started = time.monotonic()
    queue(page)
    image = wait_for_image(page, save_id, timeout)
    seconds = time.monotonic() - started
    page.wait_for_function(f"window.app.graph.getNodeById({sampler_id}).sjdChart.box.innerText"
                           ".includes('forward passes')", timeout=30_000)
    page.wait_for_timeout(1000)  # a second finish, if one came, would arrive by now
    seen = page.evaluate("({ ...window.sjdSeen, painted: [...window.sjdSeen.painted] })")
    text = chart_text(page, sampler_id)
    queue(page)
    page.wait_for_function(f"window.app.graph.getNodeById({sampler_id}).sjdChart.box.innerText"
                           ".includes('cached')", timeout=60_000)
    steps = [s for s in seen["statuses"] if ": step " in s]
    return {"image": image, "seconds": round(seconds, 1), "chart": text,
            "chart_after_cached_rerun": chart_text(page, sampler_id),
            "finishes": seen["finishes"], "first_step": steps[0] if steps else None,
            "last_step": steps[-1] if steps else None,
            "painted_steps": [line for line in seen["painted"] if ": step " in line],
            # (last step named, steps brought) per progress message; the chart's bars when the
            # finished run's own series arrived
            "messages": seen["messages"], "bars_before_finish": seen["before_finish"]}


def record_sheet_draws(page) -> None:
    """From now on, note where the classic canvas draws each diagnostics sheet on screen
    (``window.sjdDrawn``: image address -> natural size and screen box, in CSS pixels)."""
    page.evaluate("""() => {
        if (window.sjdDrawn) return;
        window.sjdDrawn = {};
        const drawImage = CanvasRenderingContext2D.prototype.drawImage;
        CanvasRenderingContext2D.prototype.drawImage = function (image, ...args) {
            if (image?.src?.includes("sjd_diagnostics") && args.length >= 4) {
                const [x, y, w, h] = args.length === 4 ? args : args.slice(4);
                const m = this.getTransform();
                const canvas = this.canvas.getBoundingClientRect();
                const ratio = window.devicePixelRatio || 1;
                window.sjdDrawn[image.src] = {
                    natural: [image.naturalWidth, image.naturalHeight],
                    screen: [canvas.left + (m.a * x + m.e) / ratio, canvas.top + (m.d * y + m.f) / ratio,
                             (m.a * w) / ratio, (m.d * h) / ratio],
                };
            }
            return drawImage.call(this, image, ...args);
        };
    }""")


def wait_until_idle(server, timeout: float) -> None:
    """Wait until ComfyUI's queue is empty: the last run's messages have all been sent."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{server.url}/queue", timeout=30) as answer:
            queue_now = json.loads(answer.read())
        if not queue_now["queue_running"] and not queue_now["queue_pending"]:
            return
        time.sleep(0.5)
    raise TimeoutError(f"ComfyUI's queue was not empty after {timeout} s")


def show_saved_view(page, graph: dict) -> None:
    """Zoom and pan the canvas as the workflow ``graph`` was saved (its ``extra.ds``)."""
    view = graph["extra"]["ds"]
    page.evaluate(f"""() => {{
        const ds = window.app.canvas.ds;
        ds.scale = {view['scale']};
        ds.offset = {json.dumps(view['offset'])};
        window.app.canvas.setDirty(true, true);
    }}""")


def overlap(a: list[float], b: list[float]) -> bool:
    """Whether boxes ``a`` and ``b`` (left, top, width, height) overlap."""
    return a[0] < b[0] + b[2] and b[0] < a[0] + a[2] and a[1] < b[1] + b[3] and b[1] < a[1] + a[3]


def after_run(page, server, graph: dict, vue: bool, out: Path, timeout: float) -> dict:
    """A template's run has been queued and its images shown: once the queue is empty, view the
    graph at the template's saved zoom and offset. Returns the nodes' boxes (graph units; in the
    Vue-nodes mode also their DOM boxes on screen), the pairs that overlap, and for each
    Diagnostics sheet that shows a speed-up, that text's height and box on screen."""
    wait_until_idle(server, timeout)
    show_saved_view(page, graph)
    page.wait_for_timeout(2000)
    diagnostics = [n["id"] for n in graph["nodes"] if n["type"] == "SJDDiagnostics"]
    seen = page.evaluate(f"""() => {{
        const graphBoxes = window.app.graph._nodes.map((n) => [n.id, n.type, [...n.getBounding()]]);
        const domBoxes = Array.from(document.querySelectorAll("[data-node-id]")).map((e) => {{
            const b = e.getBoundingClientRect();
            return [e.dataset.nodeId, [b.left, b.top, b.width, b.height]];
        }});
        const sheets = {json.dumps(diagnostics)}.map((id) => {{
            const layout = window.app.nodeOutputs[String(id)]?.sjd_sheet?.[0] ?? null;
            const file = window.app.nodeOutputs[String(id)]?.images?.[0]?.filename ?? "";
            const image = Array.from(document.querySelectorAll(`[data-node-id="${{id}}"] img`))
                .find((img) => img.src.includes(file) && img.naturalWidth > 0);
            let shown = null;
            if (image) {{  // drawn inside its box at the largest size that fits (contain)
                const b = image.getBoundingClientRect();
                const scale = Math.min(b.width / image.naturalWidth, b.height / image.naturalHeight);
                const [w, h] = [image.naturalWidth * scale, image.naturalHeight * scale];
                shown = [b.left + (b.width - w) / 2, b.top + (b.height - h) / 2, w, h];
            }} else {{
                const drawn = Object.entries(window.sjdDrawn ?? {{}})
                    .filter(([src]) => file && src.includes(file)).map(([, d]) => d);
                if (drawn.length) shown = drawn[drawn.length - 1].screen;
            }}
            return {{ id, layout, shown }};
        }});
        return {{ scale: window.app.canvas.ds.scale, graphBoxes, domBoxes, sheets }};
    }}""")
    page.screenshot(path=str(out))
    pairs = lambda boxes: [(a[0], b[0]) for i, a in enumerate(boxes)  # noqa: E731
                           for b in boxes[i + 1:] if overlap(a[-1], b[-1])]
    result = {"scale": seen["scale"], "boxes": seen["graphBoxes"],
              "overlapping": pairs(seen["graphBoxes"]), "speed_up": []}
    if vue:
        result["dom_boxes"] = seen["domBoxes"]
        result["dom_overlapping"] = pairs(seen["domBoxes"])
    for sheet in seen["sheets"]:
        layout, shown = sheet["layout"], sheet["shown"]
        if not layout or not layout.get("speed_up_box"):
            continue
        if shown is None:
            result["speed_up"].append({"node": sheet["id"], "shown": None})
            continue
        scale = shown[2] / layout["width"]
        x, y, w, h = layout["speed_up_box"]
        result["speed_up"].append({
            "node": sheet["id"], "shown": shown, "text_px": round(layout["speed_up_px"] * scale, 1),
            "box": [shown[0] + x * scale, shown[1] + y * scale, w * scale, h * scale]})
    return result


def show_node(page, node_id: int) -> None:
    """Put a node at the top left of the screen at 100% zoom."""
    page.evaluate(f"""() => {{
        const node = window.app.graph.getNodeById({node_id});
        const ds = window.app.canvas.ds;
        ds.scale = 1;
        ds.offset = [120 - node.pos[0], 140 - node.pos[1]];
        window.app.canvas.setDirty(true, true);
    }}""")
    page.wait_for_timeout(800)


def error_on_node(page, sampler_id: int, timeout: float, out: Path) -> dict:
    """Queue with a prompt the reference model refuses; the sampler itself must show the pack's
    message in red, on screen."""
    page.evaluate(f"""() => {{
        const node = window.app.graph.getNodeById({sampler_id});
        node.widgets.find((w) => w.name === 'prompt').value = {json.dumps(BAD_PROMPT)};
    }}""")
    queue(page)
    page.wait_for_function(f"!window.app.graph.getNodeById({sampler_id}).sjdChart.error.hidden",
                           timeout=timeout * 1000)
    page.keyboard.press("Escape")  # close the frontend's own error dialog, if it opened one
    show_node(page, sampler_id)
    shown = page.evaluate(f"""() => {{
        const line = window.app.graph.getNodeById({sampler_id}).sjdChart.error;
        const box = line.getBoundingClientRect();
        return {{ text: line.textContent, colour: getComputedStyle(line).color,
                 box: [box.left, box.top, box.width, box.height],
                 visible: line.checkVisibility ? line.checkVisibility() : line.offsetParent !== null }};
    }}""")
    page.screenshot(path=str(out))
    return shown


def summary_shown(page, sampler_id: int) -> dict:
    """The sampler's summary line under its chart: its text, whether all of it shows (its box is
    as tall as its text) and its box on the screen."""
    return page.evaluate(f"""() => {{
        const status = window.app.graph.getNodeById({sampler_id}).sjdChart.status;
        const box = status.getBoundingClientRect();
        const chart = status.parentElement.getBoundingClientRect();
        // what the page shows at the summary's last line: the summary itself, not what covers
        // or clips it
        const shown = document.elementFromPoint(box.left + 4, box.bottom - 4);
        return {{ text: status.textContent, scroll_height: status.scrollHeight,
                 client_height: status.clientHeight,
                 box: [box.left, box.top, box.width, box.height],
                 inside_widget: box.bottom <= chart.bottom + 1,
                 last_line_shown: status === shown || status.contains(shown),
                 visible: status.checkVisibility ? status.checkVisibility()
                                                 : status.offsetParent !== null }};
    }}""")


def error_line(page, node_id: int) -> dict:
    """A pack node's red error line: its text, colour, screen box and whether it shows."""
    return page.evaluate(f"""() => {{
        const view = window.app.graph.getNodeById({node_id}).sjdView;
        const line = view.errorLine?.line ?? view.error.line;
        const box = line.getBoundingClientRect();
        return {{ text: line.textContent, hidden: line.hidden, colour: getComputedStyle(line).color,
                 box: [box.left, box.top, box.width, box.height],
                 scroll_height: line.scrollHeight, client_height: line.clientHeight,
                 visible: line.checkVisibility ? line.checkVisibility()
                                               : line.offsetParent !== null }};
    }}""")


def wait_for_error_line(page, node_id: int, about: str, timeout: float = 60.0) -> None:
    """Wait until the node's error line shows a message that names ``about``."""
    page.wait_for_function(f"""(() => {{
        const view = window.app.graph.getNodeById({node_id})?.sjdView;
        const line = view && (view.errorLine?.line ?? view.error.line);
        return line && !line.hidden && line.textContent.includes({json.dumps(about)});
    }})()""", timeout=timeout * 1000)


def refused_on_node(page, server, node_id: int, about: str, out: Path) -> dict:
    """Queue the loaded workflow, which ComfyUI's input validation refuses because of the node's
    input ``about``: the node's error line must show the message ComfyUI answers for it (the
    pack's own, from its VALIDATE_INPUTS) without a click. Returns the line and that answer's
    details for the node."""
    prompt = page.evaluate("async () => (await window.app.graphToPrompt()).output")
    answer = server.post("/prompt", {"prompt": prompt, "client_id": "sjd-browser-check"})
    queue(page)
    wait_for_error_line(page, node_id, about)
    page.keyboard.press("Escape")  # close the frontend's own dialog, if it opened one
    show_node(page, node_id)
    shown = error_line(page, node_id)
    page.screenshot(path=str(out))
    details = [e.get("details", "") for e in answer.get("node_errors", {}).get(str(node_id), {})
               .get("errors", [])]
    return {**shown, "answer": details}


def history_entry(server, prompt_id: str, timeout: float) -> dict:
    """Poll /history every 20 ms until the prompt has finished; returns its entry."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entry = server.get(f"/history/{prompt_id}").get(prompt_id)
        if entry:
            return entry
        time.sleep(0.02)
    raise TimeoutError(f"prompt {prompt_id} did not finish in {timeout}s")


def queued_prompt_id(server, finished: set) -> str:
    """The id of the prompt the page has just queued: the one in ComfyUI's queue (running or
    pending), or, if it already finished, the one /history holds that ``finished`` (the ids it
    held before) does not. Read once, so that the run is then polled as an API run is."""
    queue = server.get("/queue")
    queued = queue["queue_running"] + queue["queue_pending"]
    if queued:
        return max(queued, key=lambda item: item[0])[1]
    return next(prompt_id for prompt_id in server.get("/history") if prompt_id not in finished)


def api_versus_page(page, server, sampler_id: int, save_id: int, pairs: int = 3,
                    extra_pairs: int = 2, limit: float = PAGE_OVER_API, timeout: float = 120.0,
                    first_seed: int = 1000) -> dict:
    """The loaded text-to-image workflow in mode AR (one step per code: the most messages a run
    sends), queued over the API (POST /prompt) and from the page, which shows the sampler and
    hears its messages, in ``pairs`` pairs run back to back; every run has a new seed, so none is
    served from the cache. Each run is timed from the server's answer to the queueing until
    /history has it (polled the same way), so the page's time is the run's, not how long the
    page takes to build the prompt or to paint the image after it (``shown``: those seconds
    after each page run); both poll the run's own entry, since polling the whole history
    would cost the server more with every run it holds. Returns the times and the ratio of the
    fastest page run to the fastest API run: a machine busy with other work (the browser
    painting, the test polling) can only slow a run, now and then, while a page that slowed the
    run would slow every one. When that ratio is over ``limit``, ``extra_pairs`` more pairs are
    measured. Also counts the sampler's chart messages and ComfyUI's progress bar updates the
    page hears in each run from the page (``heard``: [seconds from queueing to the image shown,
    chart messages, bar updates])."""
    for name, value in (("mode", "AR"), ("control_after_generate", "fixed"),
                        ("resolution", "default")):
        set_widget(page, sampler_id, name, value)
    show_node(page, sampler_id)
    page.evaluate(f"""async () => {{
        const {{ api }} = await import("/scripts/api.js");
        window.sjdHeard = {{ chart: 0, bar: 0 }};
        api.addEventListener("sjd.progress", ({{ detail }}) => {{
            if (String(detail?.node) === "{sampler_id}") window.sjdHeard.chart += 1;
        }});
        api.addEventListener("progress", ({{ detail }}) => {{
            if (String(detail?.node) === "{sampler_id}") window.sjdHeard.bar += 1;
        }});
    }}""")
    prompt = page.evaluate("async () => (await window.app.graphToPrompt()).output")
    times: dict = {"api": [], "page": [], "shown": [], "heard": []}
    ratio = lambda: min(times["page"]) / min(times["api"])  # noqa: E731
    seeds = iter(range(first_seed, first_seed + 2 * (pairs + extra_pairs), 2))
    for pair in range(pairs + extra_pairs):
        if pair == pairs and ratio() <= limit:
            break
        seed = next(seeds)
        prompt[str(sampler_id)]["inputs"]["seed"] = seed
        answer = server.post("/prompt", {"prompt": prompt, "client_id": "sjd-api-timing"})
        started = time.monotonic()
        entry = history_entry(server, answer["prompt_id"], timeout)
        times["api"].append(time.monotonic() - started)
        assert entry["status"]["status_str"] == "success", entry["status"]
        set_widget(page, sampler_id, "seed", seed + 1)
        before = shown_image(page, save_id)
        finished = set(server.get("/history"))
        page.evaluate("() => { window.sjdHeard.chart = 0; window.sjdHeard.bar = 0; }")
        hearing = time.monotonic()
        queue(page)
        started = time.monotonic()
        entry = history_entry(server, queued_prompt_id(server, finished), timeout)
        times["page"].append(time.monotonic() - started)
        assert entry["status"]["status_str"] == "success", entry["status"]
        wait_for_image(page, save_id, timeout, before)
        times["shown"].append(round(time.monotonic() - started - times["page"][-1], 2))
        heard = page.evaluate("window.sjdHeard")
        times["heard"].append([time.monotonic() - hearing, heard["chart"], heard["bar"]])
    return {"api": [round(t, 2) for t in times["api"]],
            "page": [round(t, 2) for t in times["page"]], "shown": times["shown"],
            "heard": times["heard"],
            "ratio_fastest": round(ratio(), 2)}


def switch_nodes_2(page, on: bool) -> None:
    """Turn Nodes 2.0 on or off as a person does: open the settings, search for it, flip its
    switch, close the settings; returns once the graph is drawn the new way."""
    page.evaluate("async () => { await window.app.extensionManager.command"
                  ".execute('Comfy.ShowSettingsDialog'); }")
    dialog = page.locator("[role=dialog]")
    dialog.get_by_placeholder("Search", exact=False).first.fill("Nodes 2.0")
    row = dialog.locator(".setting-item, .setting-box", has_text="Modern Node Design").first
    switch = row.locator("[role=switch], input[type=checkbox]").first
    if page.evaluate(VUE_SETTING) != on:
        switch.click()
    page.wait_for_function(f"({VUE_SETTING}) === {json.dumps(on)}", timeout=30_000)
    page.keyboard.press("Escape")
    dialog.wait_for(state="hidden", timeout=30_000)
    if on:
        page.locator("[data-node-id]").first.wait_for(timeout=30_000)
    page.wait_for_timeout(1000)


VUE_SETTING = "window.app.extensionManager.setting.get('Comfy.VueNodes.Enabled')"


def with_new_seeds(prompt: dict, seed: int) -> dict:
    """``prompt`` (API format) with every node's seed set to ``seed``: never served from cache."""
    for node in prompt.values():
        if "seed" in node["inputs"]:
            node["inputs"]["seed"] = seed
    return prompt


# Notes when the page sends a prompt (``window.sjdPostedAt``, ms since the epoch, the clock
# time.time() reads too): the page's run is timed from there, as the API's from its POST.
NOTE_POSTS = """() => {
    if (window.sjdPostsNoted) return;
    window.sjdPostsNoted = true;
    const send = window.fetch;
    window.fetch = function (address, options, ...rest) {
        if (String(address).endsWith("/prompt") && options?.method === "POST") {
            window.sjdPostedAt = Date.now();
        }
        return send.call(this, address, options, ...rest);
    };
}"""


def page_and_api_runs(page, server, template: Path, pairs: int = 3, timeout: float = 240.0,
                      first_seed: int = 5000) -> dict:
    """The shipped ``template`` as a person runs it: loaded, seen at its own zoom, queued with
    the Run button (its seeds are randomised after each run, so none is served from cache); and the
    same job queued over the API (POST /prompt) with a new seed, in ``pairs`` pairs run back to
    back. Each run is timed from the moment its prompt is sent (POST /prompt: by the test, or by
    the page after the click on Run has built it) until /history has it (both polled the same
    way), so both time the same job; the page's next run waits until its images are shown. Returns the times and the ratio of
    the page's median to the API's."""
    graph = json.loads(template.read_text())
    load(page, graph)
    show_saved_view(page, graph)
    saves = [n["id"] for n in graph["nodes"] if n["type"] == "SaveImage"]
    prompt = page.evaluate("async () => (await window.app.graphToPrompt()).output")
    page.evaluate(NOTE_POSTS)
    times: dict = {"api": [], "page": []}
    for pair in range(pairs):
        started = time.time()
        answer = server.post("/prompt", {"prompt": with_new_seeds(prompt, first_seed + pair),
                                         "client_id": "sjd-api-timing"})
        entry = history_entry(server, answer["prompt_id"], timeout)
        times["api"].append(time.time() - started)
        assert entry["status"]["status_str"] == "success", entry["status"]
        before = {node_id: shown_image(page, node_id) for node_id in saves}
        finished = set(server.get("/history"))
        page.evaluate("() => { window.sjdPostedAt = null; }")
        page.get_by_test_id("queue-button").first.click()  # the frontend's Run button
        entry = history_entry(server, queued_prompt_id(server, finished), timeout)
        times["page"].append(time.time() - page.evaluate("window.sjdPostedAt") / 1000)
        assert entry["status"]["status_str"] == "success", entry["status"]
        for node_id in saves:
            wait_for_image(page, node_id, timeout, before[node_id])
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    return {"api": [round(t, 2) for t in times["api"]],
            "page": [round(t, 2) for t in times["page"]],
            "ratio_median": round(median(times["page"]) / median(times["api"]), 2)}


def renderer_timings(server: ComfyServer, timeout: float = 240.0) -> dict:
    """Both runnable templates from the page and over the API, first in the classic canvas,
    then with Nodes 2.0 switched on in the settings ({renderer: {template: times}}); every
    template is loaded in each renderer, and the table also lists the page's errors, the pack's
    requests that failed and the deprecation warnings raised through the pack's scripts."""
    from playwright.sync_api import sync_playwright

    server.set_setting("Comfy.VueNodes.Enabled", False)
    server.set_setting("Comfy.TutorialCompleted", True)
    table: dict = {}
    with sync_playwright() as playwright:
        browser, page, errors = open_page(playwright, server.url)
        for renderer in ("canvas", "nodes 2.0"):
            if renderer == "nodes 2.0":
                switch_nodes_2(page, True)
            table[renderer] = {path.stem: page_and_api_runs(page, server, path, timeout=timeout)
                               for path in RUNNABLE}
            for path in sorted(TEMPLATES.glob("*.json")):  # the others too: nothing may fail
                load(page, json.loads(path.read_text()))
                page.wait_for_timeout(1000)
        deprecations = page.evaluate("window.sjdDeprecations")
        browser.close()
    table["page_errors"] = errors
    table["failed_requests"] = page.sjd_failed
    # The pack's script among the callers (frontends serve extension scripts under
    # /extensions/<pack folder>/).
    table["deprecations_from_the_pack"] = [text for text, stack in deprecations
                                           if "/extensions/sjd-autoregressive/" in stack]
    return table


def observer_disconnects(page, sampler_id: int) -> int:
    """Remove the sampler from the graph; returns how often its ResizeObserver was disconnected."""
    return page.evaluate(f"""() => {{
        const node = window.app.graph.getNodeById({sampler_id});
        const observer = node.sjdChart.observer;
        let calls = 0;
        const disconnect = observer.disconnect.bind(observer);
        observer.disconnect = () => {{ calls += 1; disconnect(); }};
        window.app.graph.remove(node);
        return calls;
    }}""")


def template_layout(page, graph: dict, out: Path) -> dict:
    """Load a template at its saved 75% view; returns each node's screen box, the visible canvas
    and the pairs of nodes (notes included) that overlap."""
    load(page, graph)
    show_saved_view(page, graph)
    page.wait_for_timeout(1500)
    layout = page.evaluate("""() => {
        const ds = window.app.canvas.ds;
        const canvas = window.app.canvas.canvas.getBoundingClientRect();
        const boxes = window.app.graph._nodes.map((n) => {
            const [x, y, w, h] = n.getBounding();
            return { type: n.type, graph: [x, y, w, h],
                     screen: [(x + ds.offset[0]) * ds.scale + canvas.left,
                              (y + ds.offset[1]) * ds.scale + canvas.top, w * ds.scale,
                              h * ds.scale] };
        });
        return { scale: ds.scale, canvas: [canvas.left, canvas.top, canvas.width, canvas.height],
                 boxes };
    }""")
    page.screenshot(path=str(out))
    boxes = layout["boxes"]
    layout["overlapping"] = [(a["type"], b["type"]) for i, a in enumerate(boxes)
                             for b in boxes[i + 1:] if overlap(a["graph"], b["graph"])]
    return layout


def template_browser(page, out: Path) -> dict:
    """Open Workflow -> Browse Templates, pick the pack's category; returns the titles shown and
    whether each card's thumbnail loaded, then loads the text-to-image template from its card."""
    from comfyui_current import category_title

    page.evaluate("async () => { await window.app.extensionManager.command"
                  ".execute('Comfy.BrowseTemplates'); }")
    dialog = page.locator("[role=dialog]")
    dialog.get_by_text(category_title(), exact=True).first.click()
    names = sorted(path.stem for path in TEMPLATES.glob("*.json"))
    for name in names:
        dialog.get_by_text(name, exact=True).first.wait_for(timeout=30_000)
    page.wait_for_timeout(1500)
    thumbnails = page.evaluate("""() => Object.fromEntries(
        Array.from(document.querySelectorAll('[role=dialog] img'))
             .map((img) => [img.alt, img.complete && img.naturalWidth > 0]))""")
    page.screenshot(path=str(out))
    dialog.get_by_text(TEXT_TO_IMAGE.stem, exact=True).first.click()
    dialog.wait_for(state="hidden", timeout=30_000)
    page.wait_for_timeout(500)
    loaded = page.evaluate("window.app.graph._nodes.map((n) => n.type).sort()")
    return {"titles": names, "thumbnails": thumbnails, "loaded": loaded}


def check(server: ComfyServer, vue: bool, out_dir: Path = SCREENSHOTS, timeout: float = 240.0,
          browse_templates: bool = False) -> dict:
    """Run every check above on ``server``; returns what was seen (the test asserts on it)."""
    from playwright.sync_api import sync_playwright

    out_dir.mkdir(parents=True, exist_ok=True)
    tag = f"{'vue' if vue else 'canvas'}"
    seen: dict = {}
    if hasattr(server, "set_setting"):
        server.set_setting("Comfy.VueNodes.Enabled", vue)
        # Without it a first visit opens the template dialog over the graph.
        server.set_setting("Comfy.TutorialCompleted", True)
    graph = json.loads(TEXT_TO_IMAGE.read_text())
    sampler_id, save_id = node_of(graph, *SAMPLER_TYPES), node_of(graph, "SaveImage")
    with sync_playwright() as playwright:
        browser, page, errors = open_page(playwright, server.url)
        if browse_templates:
            seen["template_browser"] = template_browser(page, out_dir / f"{tag}_templates.png")
        else:
            load(page, graph)
        if vue:
            page.locator(f"[data-node-id='{sampler_id}'] .sjd-chart").wait_for(timeout=30_000)
            seen["vue_nodes"] = page.locator("[data-node-id]").count()
        seen["run"] = run_with_chart(page, sampler_id, save_id, timeout)
        seen["after_run"] = {TEXT_TO_IMAGE.stem: after_run(
            page, server, graph, vue, out_dir / f"{tag}_after_run_{TEXT_TO_IMAGE.stem}.png",
            timeout)}
        show_node(page, sampler_id)
        page.screenshot(path=str(out_dir / f"{tag}_sampler.png"))
        seen["summary"] = summary_shown(page, sampler_id)
        seen["error"] = error_on_node(page, sampler_id, timeout, out_dir / f"{tag}_error.png")
        set_widget(page, sampler_id, "prompt", "sneaker")
        set_widget(page, sampler_id, "resolution", STALE_RESOLUTION)
        seen["stale_resolution"] = refused_on_node(page, server, sampler_id, "resolution",
                                                   out_dir / f"{tag}_stale_resolution.png")
        # Its first run from the page clears the sampler's error line.
        seen["timing"] = api_versus_page(page, server, sampler_id, save_id, timeout=timeout)
        seen["error_after_the_next_run"] = error_line(page, sampler_id)
        seen["observer_disconnects"] = observer_disconnects(page, sampler_id)

        old = json.loads(OLD_WORKFLOW.read_text())
        load(page, old)
        old_save = node_of(old, "SaveImage")
        before = shown_image(page, old_save)
        queue(page)
        seen["old_workflow_image"] = wait_for_image(page, old_save, timeout, before)
        seen["old_workflow_nodes"] = page.evaluate("window.app.graph._nodes.map((n) => n.type)"
                                                   ".sort()")

        diagnostics = json.loads(COMPARISON.read_text())
        load(page, diagnostics)
        diagnostics_id = [n["id"] for n in diagnostics["nodes"] if n["type"] == "SJDDiagnostics"]
        before = {node_id: shown_image(page, node_id) for node_id in diagnostics_id}
        record_sheet_draws(page)
        queue(page)
        for node_id in diagnostics_id:
            wait_for_image(page, node_id, timeout, before[node_id])
        seen["after_run"][COMPARISON.stem] = after_run(
            page, server, diagnostics, vue, out_dir / f"{tag}_after_run_{COMPARISON.stem}.png",
            timeout)
        show_node(page, diagnostics_id[-1])
        page.screenshot(path=str(out_dir / f"{tag}_diagnostics.png"))
        seen["diagnostics_text"] = page.evaluate(
            f"window.app.graph.getNodeById({diagnostics_id[-1]}).sjdSummary.pre.textContent")

        family = json.loads(MISSING_CHECKPOINT.read_text())
        load(page, family)
        loader_id = node_of(family, "SJDModelLoader")
        seen["missing_checkpoint"] = refused_on_node(page, server, loader_id, "model=",
                                                     out_dir / f"{tag}_missing_checkpoint.png")

        seen["templates"] = {}
        for path in sorted(TEMPLATES.glob("*.json")):
            layout = template_layout(page, json.loads(path.read_text()),
                                     out_dir / f"{tag}_template_{path.stem}.png")
            seen["templates"][path.stem] = layout
        browser.close()
    seen["page_errors"] = errors
    (out_dir / "seen.json").write_text(json.dumps(seen, indent=1))  # for a look after a failure
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--comfyui", choices=("2024", "current"), default="2024")
    parser.add_argument("--vue", action="store_true", help="the Vue-nodes mode (current only)")
    parser.add_argument("--shipped-frontend", action="store_true",
                        help="the current ComfyUI with the frontend it ships, not the newest")
    parser.add_argument("--out", type=Path, default=SCREENSHOTS)
    parser.add_argument("--timing", action="store_true",
                        help="only the page/API timing table, canvas and Nodes 2.0 (current only)")
    args = parser.parse_args()
    if args.timing:
        from comfyui_current import CurrentComfyServer

        with CurrentComfyServer(use_newest_frontend=not args.shipped_frontend) as server:
            print(json.dumps(renderer_timings(server), indent=1))
        return
    if args.comfyui == "2024":
        server = ComfyServer()
    else:
        from comfyui_current import CurrentComfyServer

        server = CurrentComfyServer(use_newest_frontend=not args.shipped_frontend)
    with server:
        seen = check(server, args.vue, args.out, browse_templates=args.comfyui == "current")
    print(json.dumps(seen, indent=1)[:20000])


if __name__ == "__main__":
    main()

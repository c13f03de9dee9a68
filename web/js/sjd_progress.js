// Live chart of codes accepted per step on the SJD Sampler node, the run summary on both the
// sampler and the diagnostics node, and the pack's error message, in red, on the node that
// failed. Fed by the sampler's "sjd.progress" messages and the node's own output when it
// finishes. Drawn in DOM widgets, so it shows in the classic canvas and in the Vue-nodes mode
// alike.
import { app } from "../../../scripts/app.js";
import { api } from "../../../scripts/api.js";

// The sampler and the first release's all-in-one sampler, which old workflows still use.
const SAMPLERS = new Set(["SJDSamplerV2", "SJDSampler"]);
const DIAGNOSTICS = "SJDDiagnostics";
const CHART_HEIGHT = 90;
const ERROR_COLOUR = "#ff4d4d";
const ERROR_HEIGHT = 100; // room for about seven lines of an error message

// Node ids arrive as strings: "5" in the root graph, "5:3" for node 3 inside subgraph node 5.
function findNode(id) {
  if (id === null || id === undefined) return null;
  const path = String(id).split(":");
  let graph = app.graph;
  let node = null;
  for (const part of path) {
    node = graph?.getNodeById?.(Number(part)) ?? graph?.getNodeById?.(part) ?? null;
    if (!node) return null;
    graph = node.subgraph ?? graph;
  }
  return node;
}

// A DOM widget of ``height`` pixels, plus room for the error line while it shows one.
function makeBox(node, name, height) {
  const box = document.createElement("div");
  box.className = name.replace("_", "-");
  box.style.cssText =
    "display:flex;flex-direction:column;gap:2px;width:100%;box-sizing:border-box;" +
    "font:11px monospace;color:var(--input-text,#ddd);";
  const total = () => height + (box.querySelector(".sjd-error:not([hidden])") ? ERROR_HEIGHT : 0);
  node.addDOMWidget(name, "sjd-" + name, box, {
    serialize: false,
    getMinHeight: total,
    getHeight: total,
  });
  return box;
}

// The message of a failed run, in red, inside a node's own box; empty (and taking no room)
// otherwise.
function makeErrorLine(box) {
  const line = document.createElement("div");
  line.className = "sjd-error";
  line.style.cssText =
    `color:${ERROR_COLOUR};font-weight:bold;white-space:pre-wrap;overflow:auto;` +
    `height:${ERROR_HEIGHT - 4}px;flex:none;`;
  line.hidden = true;
  box.prepend(line);
  return line;
}

// Show (or, with an empty message, hide) the error line; the canvas node grows to hold it.
function showError(node, line, message) {
  line.textContent = message ? `Error: ${message}` : "";
  line.hidden = !message;
  const needed = node.computeSize?.();
  if (needed && node.size && needed[1] > node.size[1]) node.setSize([node.size[0], needed[1]]);
  node.setDirtyCanvas?.(true, true);
}

class SamplerChart {
  constructor(node) {
    this.node = node;
    this.box = makeBox(node, "sjd_chart", CHART_HEIGHT + 36);
    this.canvas = document.createElement("canvas");
    this.canvas.style.cssText = `width:100%;height:${CHART_HEIGHT}px;background:#1b1b1b;border-radius:4px;`;
    this.status = document.createElement("div");
    this.status.style.cssText = "white-space:pre-wrap;overflow:hidden;";
    this.box.append(this.canvas, this.status);
    this.error = makeErrorLine(this.box);
    this.reset();
    const last = node.properties?.sjd_last;
    if (last) this.restore(last, "last run");
    this.observer = new ResizeObserver(() => this.draw());
    this.observer.observe(this.canvas);
  }

  // The node was removed from the graph: stop watching its canvas.
  dispose() {
    this.observer?.disconnect();
    this.observer = null;
  }

  reset() {
    this.accepted = [];
    this.committed = 0;
    this.total = 0;
    this.text = "";
  }

  start() {
    this.reset();
    showError(this.node, this.error, "");
    this.setStatus("running...");
  }

  fail(message) {
    showError(this.node, this.error, message);
    this.setStatus(`stopped (error) after ${this.accepted.length} steps`);
  }

  progress(detail) {
    const active = detail.accepted.filter((a) => a > 0);
    this.accepted.push(active.length ? active.reduce((a, b) => a + b, 0) / active.length : 0);
    this.committed = detail.committed.reduce((a, b) => a + b, 0);
    this.total = detail.total * detail.committed.length;
    const mean = this.accepted.reduce((a, b) => a + b, 0) / this.accepted.length;
    this.setStatus(
      `${detail.mode}: step ${detail.iteration}, ${this.committed}/${this.total} codes, ` +
        `mean ${mean.toFixed(2)} per step`
    );
  }

  finish(text, accepted) {
    if (accepted?.length) this.accepted = accepted.slice();
    this.text = text;
    this.node.properties = this.node.properties ?? {};
    this.node.properties.sjd_last = { text, accepted: this.accepted };
    this.setStatus(text);
  }

  restore(last, label) {
    this.accepted = (last.accepted ?? []).slice();
    this.setStatus(`${label}: ${last.text ?? ""}`);
  }

  setStatus(text) {
    this.status.textContent = text;
    this.draw();
    this.node.setDirtyCanvas?.(true, true);
  }

  draw() {
    const canvas = this.canvas;
    const width = Math.max(canvas.clientWidth, 50);
    const height = CHART_HEIGHT;
    const scale = window.devicePixelRatio || 1;
    canvas.width = width * scale;
    canvas.height = height * scale;
    const ctx = canvas.getContext("2d");
    ctx.setTransform(scale, 0, 0, scale, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const values = this.accepted;
    ctx.fillStyle = "#888";
    ctx.fillText("codes accepted per step", 6, 12);
    if (!values.length) return;
    const peak = Math.max(...values, 1);
    const top = 18;
    const bar = (width - 8) / values.length;
    ctx.fillStyle = "#21918c";
    values.forEach((value, i) => {
      const h = ((height - top - 4) * value) / peak;
      ctx.fillRect(4 + i * bar, height - 4 - h, Math.max(bar - 1, 1), h);
    });
    ctx.fillStyle = "#bbb";
    ctx.fillText(`max ${peak.toFixed(1)}, ${values.length} steps`, width - 130, 12);
  }
}

class SummaryText {
  constructor(node) {
    this.node = node;
    this.box = makeBox(node, "sjd_summary", 120);
    this.pre = document.createElement("pre");
    this.pre.style.cssText = "margin:0;white-space:pre-wrap;overflow:auto;max-height:160px;";
    this.box.append(this.pre);
    this.error = makeErrorLine(this.box);
    this.show(node.properties?.sjd_last_text ?? "");
  }

  start() {
    showError(this.node, this.error, "");
  }

  fail(message) {
    showError(this.node, this.error, message);
  }

  show(text) {
    this.pre.textContent = text;
    this.node.properties = this.node.properties ?? {};
    this.node.properties.sjd_last_text = text;
    this.node.setDirtyCanvas?.(true, true);
  }
}

const chartOf = (id) => findNode(id)?.sjdChart ?? null;
// The part of a node that shows its run: the sampler's chart or the diagnostics' summary.
const viewOf = (id) => {
  const node = findNode(id);
  return node?.sjdChart ?? node?.sjdSummary ?? null;
};

app.registerExtension({
  name: "sjd.progress",

  async beforeRegisterNodeDef(nodeType, nodeData) {
    const sampler = SAMPLERS.has(nodeData.name);
    if (!sampler && nodeData.name !== DIAGNOSTICS) return;
    const created = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const result = created?.apply(this, arguments);
      if (sampler) this.sjdChart = new SamplerChart(this);
      else this.sjdSummary = new SummaryText(this);
      return result;
    };
    const removed = nodeType.prototype.onRemoved;
    nodeType.prototype.onRemoved = function () {
      this.sjdChart?.dispose();
      return removed?.apply(this, arguments);
    };
    const configured = nodeType.prototype.onConfigure;
    nodeType.prototype.onConfigure = function () {
      const result = configured?.apply(this, arguments);
      // Workflows saved after a run carry its summary: show it after loading.
      if (this.sjdChart && this.properties?.sjd_last) this.sjdChart.restore(this.properties.sjd_last, "last run");
      if (this.sjdSummary && this.properties?.sjd_last_text) this.sjdSummary.show(this.properties.sjd_last_text);
      return result;
    };
    const executed = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (output) {
      const result = executed?.apply(this, arguments);
      const text = output?.sjd_text?.[0];
      if (text && this.sjdChart) this.sjdChart.finish(text, output.sjd_accepted);
      if (text && this.sjdSummary) this.sjdSummary.show(text);
      return result;
    };
  },

  setup() {
    api.addEventListener("executing", ({ detail }) => {
      // Older ComfyUI sends the node id itself, newer ones an object with it.
      const id = detail && typeof detail === "object" ? detail.node : detail;
      viewOf(id)?.start();
    });
    api.addEventListener("sjd.progress", ({ detail }) => chartOf(detail.node)?.progress(detail));
    // The finished run reaches the node once, through onExecuted above.
    // A re-run with unchanged inputs is served from the cache and sends no progress: keep showing
    // the run that made the cached result.
    api.addEventListener("execution_cached", ({ detail }) => {
      for (const id of detail?.nodes ?? []) {
        const chart = chartOf(id);
        const last = chart?.node.properties?.sjd_last;
        if (chart) chart.restore(last ?? { text: "no run recorded in this workflow" }, "cached (inputs unchanged)");
      }
    });
    api.addEventListener("execution_interrupted", ({ detail }) => {
      const chart = chartOf(detail?.node_id);
      if (chart) chart.setStatus(`stopped (cancelled) after ${chart.accepted.length} steps`);
    });
    // The pack's message says what was wrong and what to do: show it on the node itself.
    api.addEventListener("execution_error", ({ detail }) => {
      viewOf(detail?.node_id)?.fail(detail?.exception_message ?? "the run failed");
    });
  },
});

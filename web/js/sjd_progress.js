// Live chart of codes accepted per step on the SJD Sampler node, the run summary on both the
// sampler and the diagnostics node, and the pack's error message, in red, on the node it is
// about: every node of the pack (the loader and the option nodes too) has an error line.
// Fed by the sampler's "sjd.progress" messages, the node's own output when it finishes, the
// "execution_error" of a run that failed, and the node_errors that ComfyUI's input validation
// answers to a queued prompt (a missing checkpoint, a size no model draws, a missing input).
// Drawn in DOM widgets, so it shows in the classic canvas and in the Vue-nodes mode alike.
import { app } from "../../../scripts/app.js";
import { api } from "../../../scripts/api.js";

// The sampler and the first release's all-in-one sampler, which old workflows still use.
const SAMPLERS = new Set(["SJDSamplerV2", "SJDSampler"]);
const DIAGNOSTICS = "SJDDiagnostics";
const PACK_NODES = new Set([
  ...SAMPLERS,
  DIAGNOSTICS,
  "SJDModelLoader",
  "SJDDecode",
  "SJDAccelerationOptions",
  "SJDDraftingOptions",
  "SJDLossyAcceptance",
  "SJDSpeedOptions",
  "SJDSamplingOptions",
]);
const CHART_HEIGHT = 90;
const SUMMARY_MAX_HEIGHT = 160; // about eleven lines of the diagnostics' summary
const ERROR_COLOUR = "#ff4d4d";
const ERROR_MAX_HEIGHT = 220; // about sixteen lines; a longer message scrolls
const GAP = 2; // between the parts of a box
// The classic canvas draws a DOM widget `MARGIN` pixels inside its slot on every side.
const MARGIN = 10;
const LINE = 14; // one line of the boxes' 11 px text
const CHAR = 6.7; // the width of one character of it, for estimates before it is laid out

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

// The height ``element`` needs to show all of its text: one line for a line that does not wrap,
// else measured once it is laid out (reading it makes the page lay itself out at once, which costs
// a frame's work in the Vue-nodes mode), else estimated from its text and the node's width.
function textHeight(element, node) {
  if (element.hidden) return 0;
  if (element.style.whiteSpace === "nowrap") return LINE;
  if (element.getClientRects().length) return element.scrollHeight;
  const width = Math.max((node.size?.[0] ?? 300) - 2 * MARGIN, 100);
  const perLine = Math.max(Math.floor(width / CHAR), 10);
  const lines = element.textContent
    .split("\n")
    .reduce((n, line) => n + Math.max(1, Math.ceil(line.length / perLine)), 0);
  return lines * LINE;
}

// A DOM widget as tall as its parts need (``parts()`` lists their heights), so no text is cut:
// the canvas places the element ``MARGIN`` inside a slot of the height asked for. The canvas asks
// that height every frame, so it is measured only when the content's height may change
// (``box.measure()``) or the box's width does (text wraps anew); ``onWidth`` is called then too.
function makeBox(node, name, parts, onWidth) {
  const box = document.createElement("div");
  box.className = name.replace("_", "-");
  box.style.cssText =
    "display:flex;flex-direction:column;gap:2px;width:100%;box-sizing:border-box;overflow:hidden;" +
    "font:11px monospace;color:var(--input-text,#ddd);";
  let height = 0;
  // Measure again; returns whether the height changed.
  box.measure = () => {
    const heights = parts().filter((h) => h > 0);
    const needed = heights.length // nothing to show: no room taken
      ? heights.reduce((a, b) => a + b, 0) + GAP * (heights.length - 1) + 2 * MARGIN
      : 0;
    const changed = needed !== height;
    height = needed;
    return changed;
  };
  node.addDOMWidget(name, "sjd-" + name, box, {
    serialize: false,
    getMinHeight: () => height,
    getHeight: () => height, // the 2024 frontend's preferred height (Vue nodes follow the content)
    getMaxHeight: () => height, // the newer canvas gives spare room to images, not to the box
  });
  let width = null;
  box.observer = new ResizeObserver(() => {
    if (box.clientWidth === width) return;
    width = box.clientWidth;
    if (box.measure()) fit(node);
    onWidth?.();
  });
  box.observer.observe(box);
  return box;
}

// Make the node tall enough for its boxes (the canvas does not grow a node by itself when a
// widget's height changes).
function fit(node) {
  if (!node.size) return;
  const needed = node.computeSize?.();
  if (needed && needed[1] > node.size[1]) node.setSize([node.size[0], needed[1]]);
  else node.onResize?.(node.size); // the 2024 frontend lays its DOM widgets out on resize
  node.setDirtyCanvas?.(true, true);
}

// The message of a failed run or of a refused input, in red, inside a node's own box; empty
// (and taking no room) otherwise.
class ErrorLine {
  constructor(node, box) {
    this.node = node;
    this.line = document.createElement("div");
    this.line.className = "sjd-error";
    this.line.style.cssText =
      `color:${ERROR_COLOUR};font-weight:bold;white-space:pre-wrap;overflow-wrap:anywhere;` +
      `overflow:auto;max-height:${ERROR_MAX_HEIGHT}px;flex:none;`;
    this.line.hidden = true;
    box.prepend(this.line);
    this.box = box;
    this.grown = null; // [height before, height after] when showing the error grew the node
  }

  height() {
    return Math.min(textHeight(this.line, this.node), ERROR_MAX_HEIGHT);
  }

  // Show ``message`` (or, empty, hide the line) and fit the node around it.
  show(message) {
    const text = message ? `Error: ${message}` : "";
    if (text === this.line.textContent && this.line.hidden === !message) return;
    this.line.textContent = text;
    this.line.hidden = !message;
    this.beforeShow?.(!!message);
    this.box.measure();
    const node = this.node;
    const before = node.size?.[1];
    if (message) {
      fit(node);
      if (node.size?.[1] > before) this.grown = [this.grown?.[0] ?? before, node.size[1]];
    } else {
      if (this.grown && node.size?.[1] === this.grown[1]) {
        const needed = node.computeSize?.()?.[1] ?? 0;
        node.setSize([node.size[0], Math.max(this.grown[0], needed)]);
      }
      this.grown = null;
      fit(node);
    }
  }
}

// The error line alone, for the nodes of the pack that show nothing else. Without a message it
// takes no room (a node keeps its size) and lets the pointer through.
class ErrorView {
  constructor(node) {
    this.node = node;
    this.box = makeBox(node, "sjd_error", () => [this.error?.height() ?? 0]);
    this.widget = node.widgets?.find((w) => w.element === this.box) ?? null;
    this.error = new ErrorLine(node, this.box);
    this.error.beforeShow = (shown) => this.takeRoom(shown);
    this.takeRoom(false);
  }

  // A widget that measures [0, -4] takes no row: the canvas adds 4 pixels between widgets.
  takeRoom(shown) {
    this.box.style.visibility = shown ? "" : "hidden";
    if (!this.widget) return;
    if (shown) {
      delete this.widget.computeSize;
      delete this.widget.computedHeight;
    } else {
      this.widget.computeSize = () => [0, -4];
      this.widget.computedHeight = 0;
    }
  }

  dispose() {
    this.box.observer.disconnect();
  }

  start() {
    this.clear();
  }

  clear() {
    this.error.show("");
  }

  fail(message) {
    this.error.show(message);
  }

  refuse(message) {
    this.error.show(message);
  }
}

class SamplerChart {
  constructor(node) {
    this.node = node;
    // (the frontend may ask the heights before the parts exist)
    this.box = makeBox(
      node,
      "sjd_chart",
      () => [
        this.errorLine?.height() ?? 0,
        CHART_HEIGHT,
        this.status ? Math.max(textHeight(this.status, node), LINE) : LINE,
      ],
      () => {
        this.width = Math.max(this.canvas.clientWidth, 50);
        this.draw();
      }
    );
    this.canvas = document.createElement("canvas");
    this.canvas.style.cssText = `width:100%;height:${CHART_HEIGHT}px;background:#1b1b1b;border-radius:4px;flex:none;`;
    this.status = document.createElement("div");
    this.status.className = "sjd-status";
    this.status.style.cssText = "white-space:pre-wrap;overflow-wrap:anywhere;overflow:hidden;flex:none;";
    this.box.append(this.canvas, this.status);
    this.errorLine = new ErrorLine(node, this.box);
    this.error = this.errorLine.line;
    this.frame = null;
    this.live = null; // the running step's line, shown at the next animation frame
    this.width = 300; // the chart's width in CSS pixels, kept by the box's ResizeObserver
    this.reset();
    const last = node.properties?.sjd_last;
    if (last) this.restore(last, "last run");
    this.observer = this.box.observer;
  }

  // The node was removed from the graph: stop watching its box.
  dispose() {
    this.observer?.disconnect();
    this.observer = null;
    if (this.frame !== null) cancelAnimationFrame(this.frame);
    this.frame = null;
  }

  reset() {
    this.accepted = [];
    this.committed = 0;
    this.total = 0;
    this.text = "";
    this.live = null;
  }

  start() {
    this.reset();
    this.clear();
    this.setStatus("running...", true);
  }

  clear() {
    this.errorLine.show("");
  }

  fail(message) {
    this.errorLine.show(message);
    this.setStatus(`stopped (error) after ${this.accepted.length} steps`);
  }

  // An input was refused before the run: the chart keeps what it showed.
  refuse(message) {
    this.errorLine.show(message);
  }

  // One message covers every step since the previous one: ``steps`` holds their mean accepted
  // lengths, oldest first, and ``iteration`` is the last one's number. The chart and the running
  // line are drawn at the next animation frame, once however many messages came before it; the
  // running line does not wrap, so the node keeps its size for the whole run. A message sent
  // before a step that may compile (``compiling``) says so until the next one.
  progress(detail) {
    for (const value of detail.steps ?? []) this.accepted.push(value);
    this.committed = detail.committed.reduce((a, b) => a + b, 0);
    this.total = detail.total * detail.committed.length;
    const mean = this.accepted.reduce((a, b) => a + b, 0) / Math.max(this.accepted.length, 1);
    this.live =
      `${detail.mode}: step ${detail.iteration}, ${this.committed}/${this.total} codes, ` +
      (detail.compiling ? "compiling a new shape (once per session)..."
                        : `mean ${mean.toFixed(2)} per step`);
    if (this.status.style.whiteSpace !== "nowrap") this.setStatus(this.live, true);
    this.scheduleDraw();
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

  // Show ``text`` under the chart (``running``: on one line that does not wrap); the node grows
  // when it needs more lines.
  setStatus(text, running = false) {
    this.live = null;
    this.status.style.whiteSpace = running ? "nowrap" : "pre-wrap";
    this.status.style.textOverflow = running ? "ellipsis" : "";
    this.status.textContent = text;
    this.scheduleDraw();
    if (this.box.measure()) fit(this.node);
  }

  // Draw (and show the running line) at the next animation frame, once however many messages
  // arrive before it.
  scheduleDraw() {
    if (this.frame !== null) return;
    this.frame = requestAnimationFrame(() => {
      this.frame = null;
      if (this.live !== null) this.status.textContent = this.live;
      this.draw();
    });
  }

  draw() {
    const canvas = this.canvas;
    const width = this.width;
    const height = CHART_HEIGHT;
    const scale = window.devicePixelRatio || 1;
    if (canvas.width !== width * scale) canvas.width = width * scale;
    if (canvas.height !== height * scale) canvas.height = height * scale;
    const ctx = canvas.getContext("2d");
    ctx.setTransform(scale, 0, 0, scale, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const values = this.accepted;
    ctx.fillStyle = "#888";
    ctx.fillText("codes accepted per step", 6, 12);
    if (!values.length) return;
    const peak = values.reduce((a, b) => Math.max(a, b), 1);
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
    // The whole summary, up to SUMMARY_MAX_HEIGHT (a longer one scrolls).
    this.box = makeBox(node, "sjd_summary", () => [
      this.errorLine?.height() ?? 0,
      this.pre ? Math.min(Math.max(textHeight(this.pre, node), LINE), SUMMARY_MAX_HEIGHT) : LINE,
    ]);
    this.pre = document.createElement("pre");
    this.pre.style.cssText =
      `margin:0;white-space:pre-wrap;overflow:auto;max-height:${SUMMARY_MAX_HEIGHT}px;flex:none;`;
    this.box.append(this.pre);
    this.errorLine = new ErrorLine(node, this.box);
    this.error = this.errorLine.line;
    this.show(node.properties?.sjd_last_text ?? "");
  }

  dispose() {
    this.box.observer.disconnect();
  }

  start() {
    this.clear();
  }

  clear() {
    this.errorLine.show("");
  }

  fail(message) {
    this.errorLine.show(message);
  }

  refuse(message) {
    this.errorLine.show(message);
  }

  show(text) {
    this.pre.textContent = text;
    this.node.properties = this.node.properties ?? {};
    this.node.properties.sjd_last_text = text;
    this.box.measure();
    fit(this.node);
  }
}

const chartOf = (id) => findNode(id)?.sjdChart ?? null;
// The part of a pack node that shows its run and its errors.
const viewOf = (id) => findNode(id)?.sjdView ?? null;

// Every pack node in the graph, subgraphs included.
function packViews() {
  const views = [];
  const visit = (graph, seen) => {
    if (!graph || seen.has(graph)) return;
    seen.add(graph);
    for (const node of graph._nodes ?? graph.nodes ?? []) {
      if (node.sjdView) views.push(node.sjdView);
      if (node.subgraph) visit(node.subgraph, seen);
    }
  };
  visit(app.graph, new Set());
  return views;
}

// What ComfyUI's input validation says about one node, as the pack words it. A check of the
// pack's own (VALIDATE_INPUTS) answers "<input> - <the pack's message>": the message is shown as
// it is. ComfyUI's own checks (a required input not connected, a value out of range) are named
// with the node's title and the input.
function validationMessage(node, entry) {
  const lines = (entry?.errors ?? []).map((error) => {
    const input = error.extra_info?.input_name;
    const details = String(error.details ?? "");
    if (error.type === "custom_validation_failed" && input && details.startsWith(`${input} - `)) {
      return details.slice(input.length + 3);
    }
    const title = node.title || entry.class_type || node.type;
    const about = input ? `${input}: ` : "";
    const more = details && details !== input ? ` (${details})` : "";
    return `${title}: ${about}${error.message ?? "refused"}${more}`;
  });
  return lines.length ? lines.join("\n") : "this node's inputs were refused";
}

// Show ComfyUI's answer to a queued prompt on the pack's nodes: node_errors maps an execution id
// to { errors: [{ type, message, details, extra_info }], class_type }.
function showNodeErrors(nodeErrors) {
  if (!nodeErrors || typeof nodeErrors !== "object") return;
  for (const [id, entry] of Object.entries(nodeErrors)) {
    const node = findNode(id);
    node?.sjdView?.refuse(validationMessage(node, entry));
  }
}

// A new prompt was queued: the messages of the previous one go.
function clearErrors() {
  for (const view of packViews()) view.clear();
}

// The frontend learns of refused inputs from the answer to POST /prompt: api.queuePrompt returns
// it (HTTP 200, node_errors of outputs left out) or throws it as `error.response` (HTTP 400); the
// 2024 frontend and 1.32 and 1.58 alike. Wrapping the call on the api object catches it before
// the frontend's own dialog. As a fallback, app.lastNodeErrors (where every one of them keeps
// the last answer) is read once app.queuePrompt has finished.
function hookValidation() {
  const post = api.queuePrompt;
  if (typeof post === "function" && !post.sjdWrapped) {
    const wrapped = async function (...args) {
      clearErrors();
      try {
        const answer = await post.apply(this, args);
        showNodeErrors(answer?.node_errors);
        return answer;
      } catch (error) {
        showNodeErrors(error?.response?.node_errors);
        throw error;
      }
    };
    wrapped.sjdWrapped = true;
    api.queuePrompt = wrapped;
  }
  const queue = app.queuePrompt;
  if (typeof queue === "function" && !queue.sjdWrapped) {
    const wrapped = async function (...args) {
      try {
        return await queue.apply(this, args);
      } finally {
        showNodeErrors(app.lastNodeErrors);
      }
    };
    wrapped.sjdWrapped = true;
    app.queuePrompt = wrapped;
  }
}

app.registerExtension({
  name: "sjd.progress",

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!PACK_NODES.has(nodeData.name)) return;
    const sampler = SAMPLERS.has(nodeData.name);
    const diagnostics = nodeData.name === DIAGNOSTICS;
    const created = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const result = created?.apply(this, arguments);
      if (sampler) this.sjdView = this.sjdChart = new SamplerChart(this);
      else if (diagnostics) this.sjdView = this.sjdSummary = new SummaryText(this);
      else this.sjdView = this.sjdError = new ErrorView(this);
      return result;
    };
    const removed = nodeType.prototype.onRemoved;
    nodeType.prototype.onRemoved = function () {
      this.sjdView?.dispose();
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
    hookValidation();
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

// Narrows the "resolution" list of SJD Sampler (and of the first release's sampler) to the sizes of
// the model its loader picks.
// Asks the pack's route GET /sjd/resolutions?model=NAME (sizes read from the checkpoint's config
// files, no weights loaded) whenever a sampler's model input is connected to an SJD Model Loader,
// the loader's model choice changes, a workflow is loaded, or the node definitions are refreshed
// ("Refresh Node Definitions", key R). Without a loader upstream the sampler shows its full list
// again. A saved choice the model does not support is left as it is: running it stops with the
// model's own list in the error.
//
// Each sampler's list is one array, given to the widget when the node is created and changed in
// place from then on. The frontend's Vue nodes ("Nodes 2.0") copy a widget's options (a shallow
// copy) when they build the node's data, and keep that copy: an array put in place of the list
// later never reaches the dropdown, but the same array, changed, does (the dropdown reads it when
// it opens). A function as the list, LiteGraph's old way to compute it, is no way out: frontends
// 1.32 and 1.58 warn that it is deprecated when the canvas combo is clicked, and the Vue dropdown
// of 1.32 shows no entries for it.
import { app } from "../../../scripts/app.js";
import { api } from "../../../scripts/api.js";

const SAMPLERS = ["SJDSamplerV2", "SJDSampler"]; // the sampler, and the first release's (hidden)
const LOADER = "SJDModelLoader";
const ROUTE = "/sjd/resolutions";
const KEEP = ["default"]; // always offered: the model's own default size

const lists = new WeakMap(); // sampler widget -> { shown: the array it offers, full, asked }
let answers = new Map(); // loader model name -> promise of its sizes (or null)

function widget(node, name) {
  return node?.widgets?.find((w) => w.name === name) ?? null;
}

// The list the widget offers, and the one the server declared. Something that puts another array
// on the widget (the frontend does, on "Refresh Node Definitions") gives the new full list; the
// widget gets its own array back, still narrowed as before, until the new answer arrives.
function listOf(resolution) {
  const current = resolution?.options?.values;
  let list = lists.get(resolution);
  if (list && current === list.shown) return list;
  if (!Array.isArray(current)) return null;
  if (!list) {
    list = { shown: [...current], full: [...current], asked: 0 };
    lists.set(resolution, list);
  } else {
    list.full = [...current];
  }
  resolution.options.values = list.shown;
  return list;
}

// The node at the other end of a sampler's model input, through node.getInputNode(slot): the
// 2024 LiteGraph, frontend 1.32 and 1.58 all have it, and on 1.58 it reads the graph's link store
// instead of input.link, which 1.58 marks deprecated (reading it warns in the console). input.link
// stays as the way for a frontend without it.
function upstreamOf(node, name) {
  const slot = node.findInputSlot?.(name) ?? node.inputs?.findIndex((i) => i.name === name) ?? -1;
  if (slot < 0 || !node.graph) return null;
  if (typeof node.getInputNode === "function") return node.getInputNode(slot);
  const link = node.graph.links?.[node.inputs[slot].link];
  return link ? node.graph.getNodeById(link.origin_id) : null;
}

function loaderOf(sampler) {
  const origin = upstreamOf(sampler, "model");
  return origin?.type === LOADER ? origin : null;
}

function sizesOf(modelName) {
  if (!answers.has(modelName)) {
    const query = `${ROUTE}?model=${encodeURIComponent(modelName)}`;
    answers.set(modelName, api.fetchApi(query)
      .then((response) => (response.ok ? response.json() : null))
      .then((body) => body?.resolutions ?? null)
      .catch(() => null));
  }
  return answers.get(modelName);
}

async function narrow(sampler) {
  const resolution = widget(sampler, "resolution");
  const list = listOf(resolution);
  if (!list) return;
  const asked = ++list.asked;
  const name = widget(loaderOf(sampler), "model")?.value;
  const sizes = name ? await sizesOf(name) : null;
  if (asked !== list.asked) return; // a later call decides
  listOf(resolution); // takes up a full list put there while the answer came
  // Only sizes the sampler accepts are offered, so every choice passes the server's check.
  const wanted = sizes ? [...KEEP, ...sizes.filter((s) => list.full.includes(s))] : list.full;
  list.shown.splice(0, list.shown.length, ...wanted);
  sampler.setDirtyCanvas?.(true, true);
}

function nodesOf(graph) {
  return graph?.nodes ?? graph?._nodes ?? [];
}

// The samplers of the whole workflow: the root graph and, on frontends with subgraphs, each
// subgraph.
function allSamplers() {
  const root = app.graph;
  const graphs = [root, ...(root?.subgraphs?.values?.() ?? [])];
  return graphs.flatMap((graph) => nodesOf(graph).filter((node) => SAMPLERS.includes(node.type)));
}

function narrowAll() {
  for (const sampler of allSamplers()) narrow(sampler);
}

app.registerExtension({
  name: "sjd.resolutions",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (SAMPLERS.includes(nodeData.name)) {
      const onNodeCreated = nodeType.prototype.onNodeCreated;
      nodeType.prototype.onNodeCreated = function (...args) {
        const result = onNodeCreated?.apply(this, args);
        // Before the node is added to the graph, so that the Vue node's copy holds this array.
        listOf(widget(this, "resolution"));
        return result;
      };
      const onConnectionsChange = nodeType.prototype.onConnectionsChange;
      nodeType.prototype.onConnectionsChange = function (...args) {
        const result = onConnectionsChange?.apply(this, args);
        narrow(this);
        return result;
      };
    }
    if (nodeData.name === LOADER) {
      const onNodeCreated = nodeType.prototype.onNodeCreated;
      nodeType.prototype.onNodeCreated = function (...args) {
        const result = onNodeCreated?.apply(this, args);
        const choice = widget(this, "model");
        if (choice) {
          const callback = choice.callback;
          choice.callback = function (...cbArgs) {
            const out = callback?.apply(this, cbArgs);
            narrowAll();
            return out;
          };
        }
        return result;
      };
    }
  },
  loadedGraphNode(node) {
    if (SAMPLERS.includes(node.type)) setTimeout(() => narrow(node), 0);
  },
  async afterConfigureGraph() {
    narrowAll();
  },
  // Called by "Refresh Node Definitions" after it has put the server's lists on every combo. The
  // checkpoints may have changed too, so their sizes are asked again.
  async refreshComboInNodes() {
    answers = new Map();
    narrowAll();
  },
});

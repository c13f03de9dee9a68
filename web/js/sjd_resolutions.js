// Narrows the "resolution" list of SJD Sampler (and of the first release's sampler) to the sizes of
// the model its loader picks.
// Asks the pack's route GET /sjd/resolutions?model=NAME (sizes read from the checkpoint's config
// files, no weights loaded) whenever a sampler's model input is connected to an SJD Model Loader,
// the loader's model choice changes, or a workflow is loaded. Without a loader upstream the
// sampler shows its full list again. A saved choice the model does not support is left as it is:
// running it stops with the model's own list in the error.
import { app } from "../../../scripts/app.js";
import { api } from "../../../scripts/api.js";

const SAMPLERS = ["SJDSamplerV2", "SJDSampler"]; // the sampler, and the first release's (hidden)
const LOADER = "SJDModelLoader";
const ROUTE = "/sjd/resolutions";
const KEEP = ["default"]; // always offered: the model's own default size

const fullLists = new WeakMap(); // sampler widget -> the list the server declared
const answers = new Map(); // loader model name -> promise of its sizes (or null)

function widget(node, name) {
  return node?.widgets?.find((w) => w.name === name) ?? null;
}

function loaderOf(sampler) {
  const input = sampler.inputs?.find((i) => i.name === "model");
  const link = input?.link != null ? sampler.graph?.links?.[input.link] ?? app.graph.links?.[input.link] : null;
  if (!link) return null;
  const origin = (sampler.graph ?? app.graph).getNodeById(link.origin_id);
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
  if (!resolution?.options?.values) return;
  if (!fullLists.has(resolution)) fullLists.set(resolution, [...resolution.options.values]);
  const full = fullLists.get(resolution);
  const loader = loaderOf(sampler);
  const name = widget(loader, "model")?.value;
  const sizes = name ? await sizesOf(name) : null;
  // Only sizes the sampler accepts are offered, so every choice passes the server's check.
  resolution.options.values = sizes ? [...KEEP, ...sizes.filter((s) => full.includes(s))] : full;
  sampler.setDirtyCanvas?.(true, true);
}

function narrowAll() {
  for (const node of app.graph?._nodes ?? []) {
    if (SAMPLERS.includes(node.type)) narrow(node);
  }
}

app.registerExtension({
  name: "sjd.resolutions",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (SAMPLERS.includes(nodeData.name)) {
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
});

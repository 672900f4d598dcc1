// The Models tab: what each service serves and its health, with live figures refreshed while the tab is open.

import { describe, json } from "./api.js";

const REFRESH_MS = 2000;
const TITLES = { text: "Text (chat)", gan: "GAN", vae: "VAE", diffusion: "Diffusion" };
const FACTS = {
  model_name: "model", model_path: "file", quantization: "quantization", architecture: "architecture",
  n_params: "parameters", max_context: "context", dtype: "dtype", runner: "runner", device: "device",
  block_size: "KV block size", max_running: "max running", prefix_caching: "prefix caching",
  image_size: "image size", downsample_factor: "downsampling",
};

let timer = null;
const listeners = [];

function row(list, name, value) {
  const dt = document.createElement("dt");
  dt.textContent = name;
  const dd = document.createElement("dd");
  dd.textContent = value;
  list.append(dt, dd);
}

function meter(used, total) {
  const m = document.createElement("meter");
  m.min = 0;
  m.max = total;
  m.value = used;
  m.setAttribute("aria-label", "KV cache used");
  return m;
}

function card(app, info) {
  const section = document.createElement("section");
  section.className = "card model";
  section.setAttribute("aria-label", TITLES[app]);
  const head = document.createElement("h2");
  head.textContent = TITLES[app];
  const badge = document.createElement("span");
  const health = info.deployed ? info.health : "not deployed";
  badge.className = `badge ${info.health === "SERVING" ? "ok" : "bad"}`;
  badge.textContent = health;
  head.append(" ", badge);
  const facts = document.createElement("dl");
  for (const [key, label] of Object.entries(FACTS)) {
    if (info[key] === undefined || info[key] === "") continue;
    const value = typeof info[key] === "number" && key === "n_params" ? info[key].toLocaleString("en") : info[key];
    row(facts, label, String(value));
  }
  const live = document.createElement("dl");
  live.className = "live";
  if (info.live) {
    row(live, "running", String(info.live.running));
    row(live, "waiting", String(info.live.waiting));
  }
  if (info.kv_blocks_total) {
    const used = info.kv_blocks_total - info.kv_blocks_free;
    row(live, "KV blocks used", `${used} of ${info.kv_blocks_total}`);
    live.lastElementChild.append(" ", meter(used, info.kv_blocks_total));
  }
  section.append(head, facts, live);
  return section;
}

export async function refresh() {
  try {
    const { services } = await json("GET", "/api/models");
    document.getElementById("models").replaceChildren(
      ...Object.entries(services).map(([app, info]) => card(app, info)));
    document.getElementById("models-updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    for (const listener of listeners) listener(services);
    return services;
  } catch (error) {
    document.getElementById("models-updated").textContent = `could not read the models: ${describe(error)}`;
    return null;
  }
}

/** Calls `listener(services)` after each refresh. */
export function onModels(listener) {
  listeners.push(listener);
}

/** Refreshes every REFRESH_MS while `visible` (the tab is open), and stops otherwise. */
export function live(visible) {
  clearInterval(timer);
  timer = null;
  if (visible) {
    refresh();
    timer = setInterval(refresh, REFRESH_MS);
  }
}

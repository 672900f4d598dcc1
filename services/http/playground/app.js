// The playground's entry point: tabs (arrow keys move between them), the API key dialog, the server's defaults.

import { describe, json, keys, onKeyNeeded } from "./api.js";
import * as chat from "./chat.js";
import * as images from "./images.js";
import * as models from "./models.js";

const $ = (id) => document.getElementById(id);
const TABS = ["chat", "images", "models"];

function select(name, focus = false) {
  for (const tab of TABS) {
    const on = tab === name;
    $(`tab-${tab}`).setAttribute("aria-selected", String(on));
    $(`tab-${tab}`).tabIndex = on ? 0 : -1;
    $(`panel-${tab}`).hidden = !on;
  }
  if (focus) $(`tab-${name}`).focus();
  models.live(name === "models");
  history.replaceState(null, "", `#${name}`);
}

function wireTabs() {
  for (const [i, tab] of TABS.entries()) {
    const button = $(`tab-${tab}`);
    button.addEventListener("click", () => select(tab));
    button.addEventListener("keydown", (e) => {
      const step = { ArrowRight: 1, ArrowLeft: -1 }[e.key];
      if (step) select(TABS[(i + step + TABS.length) % TABS.length], true);
      if (e.key === "Home") select(TABS[0], true);
      if (e.key === "End") select(TABS.at(-1), true);
    });
  }
}

/** Opens the key dialog; resolves true once a key is set, false on Cancel. */
function askForKey(reason) {
  const dialog = $("key-dialog");
  $("key-reason").textContent = reason || "";
  $("api-key").value = "";
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      const key = $("api-key").value.trim();
      if (dialog.returnValue === "use" && key) {
        keys.set(key, $("remember-key").checked);
        resolve(true);
      } else {
        resolve(false);
      }
    }, { once: true });
    if (!dialog.open) dialog.showModal();
  });
}

let pending = null;

/** One dialog for every request that got a 401 at the same time. */
function keyNeeded(reason) {
  pending ??= askForKey(reason).finally(() => {
    pending = null;
  });
  return pending;
}

async function start() {
  wireTabs();
  onKeyNeeded(keyNeeded);
  $("key-button").addEventListener("click", () => askForKey(keys.get() ? "Replace the key this page sends." : ""));
  chat.init();
  images.init();
  models.onModels(images.applyModels);
  const first = TABS.includes(location.hash.slice(1)) ? location.hash.slice(1) : "chat";
  select(first);
  try {
    const settings = await json("GET", "/api/settings");
    chat.applyDefaults(settings.text);
    images.applyDefaults(settings.diffusion);
    document.body.dataset.ready = "true";
    if (first !== "models") models.refresh(); // the image size for the Images tab
  } catch (error) {
    $("page-error").textContent = `could not read the server's settings: ${describe(error)}`;
  }
}

start();

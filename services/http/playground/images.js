// The Images tab: text-to-image with a live denoising preview (/api/images/stream), GAN samples and a seed walk,
// and the VAE round trip of a dropped image.

import { call, clearErrors, events, json, keys, showError } from "./api.js";
import { cli, curl, pythonImages, pythonPost, wireCopy } from "./snippets.js";

const $ = (id) => document.getElementById(id);
const DIFFUSION_FIELDS = {
  prompt: "prompt", negative_prompt: "negative-prompt", steps: "steps", guidance_scale: "guidance",
  scheduler: "scheduler", seed: "image-seed", size: "size", n: "count",
};
const GAN_FIELDS = { n: "gan-n", seed: "gan-seed", seed_start: "gan-seed", truncation: "gan-truncation",
  seed_end: "gan-seed-end", steps: "gan-steps" };
const VAE_FIELDS = { image: "vae-file" };
// How often the stream sends a preview: every step for short runs, about 12 frames for long ones.
const PREVIEW_FRAMES = 12;

let imageRun = null;
let vaeSize = 32;

function number(id) {
  const raw = $(id).value.trim();
  return raw === "" ? undefined : Number(raw);
}

function image(b64, alt) {
  const img = document.createElement("img");
  img.src = `data:image/png;base64,${b64}`;
  img.alt = alt;
  img.className = "pixel";
  return img;
}

function figure(img, caption) {
  const f = document.createElement("figure");
  const c = document.createElement("figcaption");
  c.textContent = caption;
  f.append(img, c);
  return f;
}

function compact(body) {
  for (const k of Object.keys(body)) if (body[k] === undefined || body[k] === "") delete body[k];
  return body;
}

// ---- text to image ----------------------------------------------------------------------------------------------
function diffusionBody() {
  const steps = number("steps");
  return compact({
    prompt: $("prompt").value, negative_prompt: $("negative-prompt").value || undefined, steps,
    guidance_scale: number("guidance"), scheduler: $("scheduler").value || undefined, seed: number("image-seed"),
    size: $("size").value || undefined, n: number("count"),
  });
}

async function generate() {
  clearErrors(DIFFUSION_FIELDS, "diffusion-error");
  const body = diffusionBody();
  const steps = body.steps ?? Number($("steps").placeholder || 20);
  body.preview_every = Number.isFinite(steps) && steps > 0 ? Math.max(1, Math.floor(steps / PREVIEW_FRAMES)) : 0;
  const preview = $("preview");
  const results = $("diffusion-results");
  const progress = $("diffusion-progress");
  imageRun = new AbortController();
  $("generate").disabled = true;
  $("cancel-image").disabled = false;
  $("diffusion-bar").value = 0;
  progress.textContent = "waiting for the denoising loop…";
  let frames = 0;
  try {
    const response = await call("POST", "/api/images/stream", body, { signal: imageRun.signal });
    for await (const batch of events(response)) {
      for (const event of batch) {
        if (event.type === "progress") {
          $("diffusion-bar").value = event.step / event.total_steps;
          progress.textContent = `step ${event.step} of ${event.total_steps} · ${event.elapsed_s.toFixed(1)} s`;
        } else if (event.type === "preview") {
          frames += 1;
          preview.hidden = false;
          preview.src = `data:image/png;base64,${event.images[0].b64_json}`;
          preview.alt = `Denoising preview of “${body.prompt}”, step ${event.step}`;
          preview.dataset.frames = String(frames);
        } else if (event.type === "result") {
          const count = event.images.length;
          results.replaceChildren(...event.images.map((img, i) => figure(
            image(img.b64_json, `Generated image ${i + 1} of ${count} for “${body.prompt}” (seed ${event.seed})`),
            `seed ${event.seed}${count > 1 ? ` · ${i + 1}/${count}` : ""}`,
          )));
          progress.textContent = `done: ${count} image${count > 1 ? "s" : ""}, seed ${event.seed}, `
            + `${frames} preview frame${frames === 1 ? "" : "s"}`;
          $("diffusion-bar").value = 1;
        }
      }
    }
  } catch (error) {
    progress.textContent = error.name === "AbortError" ? "cancelled" : "";
    if (error.name !== "AbortError") showError(error, DIFFUSION_FIELDS, "diffusion-error");
  } finally {
    imageRun = null;
    $("generate").disabled = false;
    $("cancel-image").disabled = true;
  }
}

function diffusionSnippet(kind) {
  const body = diffusionBody();
  const hasKey = Boolean(keys.get());
  if (kind === "curl") return curl("/v1/images/generations", { model: "diffusion", ...body }, hasKey);
  if (kind === "python") return pythonImages(body, hasKey);
  return cli(["diffuse", body.prompt], {
    "--negative": body.negative_prompt, "--steps": body.steps, "--guidance": body.guidance_scale,
    "--scheduler": body.scheduler, "--seed": body.seed, "--num-images": body.n, "--output": "images/",
  });
}

// ---- GAN --------------------------------------------------------------------------------------------------------
function ganBody(walk) {
  if (walk) {
    return compact({ seed_start: number("gan-seed") ?? 0, seed_end: number("gan-seed-end") ?? 0,
      steps: number("gan-steps"), truncation: number("gan-truncation") });
  }
  return compact({ n: number("gan-n"), seed: number("gan-seed"), truncation: number("gan-truncation") });
}

let lastGan = false;

async function gan(walk) {
  clearErrors(GAN_FIELDS, "gan-error");
  lastGan = walk;
  const body = ganBody(walk);
  const results = $("gan-results");
  results.classList.toggle("walk", walk);
  try {
    const reply = await json("POST", walk ? "/api/gan/walk" : "/api/gan/samples", body);
    const count = reply.images.length;
    results.replaceChildren(...reply.images.map((img, i) => figure(
      image(img.b64_json, walk
        ? `Seed walk from ${body.seed_start} to ${body.seed_end}, frame ${i + 1} of ${count}`
        : `GAN sample ${i + 1} of ${count} (seed ${reply.seed})`),
      walk ? `${i + 1}/${count}` : `#${i + 1}`,
    )));
    results.setAttribute("aria-label", walk ? `Seed walk, ${count} frames` : `GAN samples, ${count} images`);
  } catch (error) {
    showError(error, GAN_FIELDS, "gan-error");
  }
}

function ganSnippet(kind) {
  const walk = lastGan;
  const body = ganBody(walk);
  const path = walk ? "/api/gan/walk" : "/api/gan/samples";
  const hasKey = Boolean(keys.get());
  if (kind === "curl") return curl(path, body, hasKey);
  if (kind === "python") return pythonPost(path, body, hasKey);
  return walk
    ? cli(["gan"], { "--seed": body.seed_start, "--interpolate-to": body.seed_end, "-n": body.steps,
      "--truncation": body.truncation, "-o": "walk/" })
    : cli(["gan"], { "-n": body.n, "--seed": body.seed, "--truncation": body.truncation, "-o": "samples/" });
}

// ---- VAE --------------------------------------------------------------------------------------------------------
let vaePng = "";

/** The file as a PNG of the VAE's size (centre-cropped square), base64 without the data: prefix. */
async function asPng(file) {
  const bitmap = await createImageBitmap(file);
  const side = Math.min(bitmap.width, bitmap.height);
  const canvas = document.createElement("canvas");
  canvas.width = vaeSize;
  canvas.height = vaeSize;
  canvas.getContext("2d").drawImage(bitmap, (bitmap.width - side) / 2, (bitmap.height - side) / 2, side, side,
    0, 0, vaeSize, vaeSize);
  return canvas.toDataURL("image/png").split(",")[1];
}

async function reconstruct(file) {
  clearErrors(VAE_FIELDS, "vae-file-error");
  const results = $("vae-results");
  try {
    vaePng = await asPng(file);
  } catch (error) {
    $("vae-file-error").textContent = `cannot read ${file.name} as an image: ${error.message}`;
    return;
  }
  results.replaceChildren(figure(image(vaePng, `Original: ${file.name}, resized to ${vaeSize}×${vaeSize}`), "original"));
  try {
    const reply = await json("POST", "/api/vae/reconstruct", { image: vaePng });
    results.append(figure(image(reply.images[0].b64_json, `VAE reconstruction of ${file.name}`), "reconstruction"));
  } catch (error) {
    showError(error, VAE_FIELDS, "vae-file-error");
  }
}

function vaeSnippet(kind) {
  const body = { image: vaePng || "<base64 PNG>" };
  const hasKey = Boolean(keys.get());
  if (kind === "curl") return curl("/api/vae/reconstruct", body, hasKey);
  if (kind === "python") return pythonPost("/api/vae/reconstruct", body, hasKey);
  return cli(["vae", "reconstruct", "image.png"], { "-o": "recon.png" });
}

// ---- set-up -----------------------------------------------------------------------------------------------------
/** The server's defaults and limits (`settings.diffusion` from /api/settings). */
export function applyDefaults(diffusion) {
  $("steps").placeholder = diffusion.steps.default;
  $("steps").value ||= diffusion.steps.default;
  $("steps-help").textContent = `${diffusion.steps.ge}–${diffusion.steps.le}`;
  $("guidance").value ||= diffusion.guidance_scale.default;
  $("guidance-help").textContent = `${diffusion.guidance_scale.ge}–${diffusion.guidance_scale.le}`;
  for (const name of diffusion.schedulers) {
    const option = document.createElement("option");
    option.value = name;
    option.textContent = name;
    $("scheduler").append(option);
  }
}

/** What the models panel learnt: the diffusion model's one size, the VAE's. */
export function applyModels(services) {
  const size = services.diffusion && services.diffusion.image_size;
  if (size && !$("size").options.length) {
    const option = document.createElement("option");
    option.value = size;
    option.textContent = size;
    $("size").append(option);
    vaeSize = Number(size.split("x")[0]) || vaeSize;
  }
}

export function init() {
  $("diffusion-form").addEventListener("submit", (e) => {
    e.preventDefault();
    generate();
  });
  $("cancel-image").addEventListener("click", () => imageRun?.abort());
  $("gan-form").addEventListener("submit", (e) => {
    e.preventDefault();
    gan(false);
  });
  $("gan-walk").addEventListener("click", () => gan(true));
  $("vae-file").addEventListener("change", () => {
    const [file] = $("vae-file").files;
    if (file) reconstruct(file);
  });
  const drop = $("vae-form");
  drop.addEventListener("dragover", (e) => {
    e.preventDefault();
    drop.classList.add("dragging");
  });
  drop.addEventListener("dragleave", () => drop.classList.remove("dragging"));
  drop.addEventListener("drop", (e) => {
    e.preventDefault();
    drop.classList.remove("dragging");
    const [file] = e.dataTransfer.files;
    if (file) reconstruct(file);
  });
  wireCopy($("diffusion-form"), diffusionSnippet);
  wireCopy($("gan-form"), ganSnippet);
  wireCopy($("vae-form"), vaeSnippet);
}

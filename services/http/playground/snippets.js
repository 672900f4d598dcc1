// Any request of the page as a curl command, an `openai` Python SDK call or a `genserve` CLI command.

const shell = (s) => `'${String(s).replaceAll("'", "'\\''")}'`;

/** `value` as a Python literal (JSON with True/False/None). */
export function python(value, indent = "") {
  if (value === null || value === undefined) return "None";
  if (value === true) return "True";
  if (value === false) return "False";
  if (typeof value === "number" || typeof value === "string") return JSON.stringify(value);
  const inner = `${indent}    `;
  if (Array.isArray(value)) {
    if (!value.length) return "[]";
    return `[\n${value.map((v) => inner + python(v, inner)).join(",\n")},\n${indent}]`;
  }
  const entries = Object.entries(value);
  if (!entries.length) return "{}";
  return `{\n${entries.map(([k, v]) => `${inner}${JSON.stringify(k)}: ${python(v, inner)}`).join(",\n")},\n${indent}}`;
}

function origin() {
  return window.location.origin;
}

export function curl(path, body, hasKey) {
  const auth = hasKey ? ` \\\n  -H "Authorization: Bearer $GENSERVE_API_KEY"` : "";
  return `curl ${origin()}${path} \\\n  -H 'Content-Type: application/json'${auth} \\\n  -d ${shell(JSON.stringify(body))}`;
}

function client(hasKey) {
  const key = hasKey ? 'os.environ["GENSERVE_API_KEY"]' : '"none"';
  return `import os\n\nfrom openai import OpenAI\n\nclient = OpenAI(base_url="${origin()}/v1", api_key=${key})\n`;
}

/** The chat body as client.chat.completions.create(...), streamed. */
export function pythonChat(body, hasKey) {
  const { messages, model, stream, stream_options: _, ...rest } = body;
  const args = Object.entries(rest).map(([k, v]) => `    ${k}=${python(v, "    ")},\n`).join("");
  return `${client(hasKey)}stream = client.chat.completions.create(\n    model=${python(model)},\n`
    + `    messages=${python(messages, "    ")},\n${args}    stream=True,\n)\n`
    + "for chunk in stream:\n    if chunk.choices:\n        print(chunk.choices[0].delta.content or \"\", end=\"\", flush=True)\nprint()\n";
}

/** The image body as client.images.generate(...), genserve's extras in extra_body. */
export function pythonImages(body, hasKey) {
  const { prompt, n, size, ...extra } = body;
  const args = Object.entries({ n, size }).filter(([, v]) => v !== undefined).map(([k, v]) => `    ${k}=${python(v)},\n`);
  if (Object.keys(extra).length) args.push(`    extra_body=${python(extra, "    ")},\n`);
  return `import base64\n${client(hasKey)}result = client.images.generate(\n    model="diffusion",\n`
    + `    prompt=${python(prompt)},\n${args.join("")})\n`
    + "for i, image in enumerate(result.data):\n"
    + "    open(f\"image-{i}.png\", \"wb\").write(base64.b64decode(image.b64_json))\n";
}

/** A playground route (the GAN, the VAE): not an OpenAI one, so plain httpx (what the openai SDK runs on). */
export function pythonPost(path, body, hasKey) {
  const auth = hasKey ? ', headers={"Authorization": f"Bearer {os.environ[\'GENSERVE_API_KEY\']}"}' : "";
  return `import base64\nimport os\n\nimport httpx\n\n`
    + `result = httpx.post(${python(origin() + path)}, json=${python(body)}${auth}, timeout=60).json()\n`
    + "for i, image in enumerate(result[\"images\"]):\n"
    + "    open(f\"image-{i}.png\", \"wb\").write(base64.b64decode(image[\"b64_json\"]))\n";
}

/** `genserve` with its flags; `words` are positional, `flags` maps flag -> value (skipped when empty). */
export function cli(words, flags) {
  const parts = ["genserve", ...words.map((w) => (/^[\w./-]+$/.test(w) ? w : shell(w)))];
  for (const [flag, value] of Object.entries(flags)) {
    if (value === undefined || value === null || value === "") continue;
    parts.push(value === true ? flag : `${flag} ${/^[\w.-]+$/.test(String(value)) ? value : shell(value)}`);
  }
  return parts.join(" ");
}

/** Wires a panel's "Copy request as" buttons: `build(kind)` gives the text, shown and put on the clipboard. */
export function wireCopy(scope, build) {
  const out = scope.querySelector("pre.snippet");
  for (const button of scope.querySelectorAll("[data-copy]")) {
    button.addEventListener("click", async () => {
      const text = build(button.dataset.copy);
      out.hidden = false;
      out.textContent = text;
      try {
        await navigator.clipboard.writeText(text);
        out.dataset.copied = "copied to the clipboard";
      } catch {
        out.dataset.copied = "select and copy";
      }
    });
  }
}

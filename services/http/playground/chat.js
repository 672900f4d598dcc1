// The Chat tab: answers streamed over /v1/chat/completions (SSE), Stop aborts the request (the server cancels it
// and frees its KV blocks), the conversation kept in localStorage, regenerate and copy, TTFT and tokens per second.

import { call, clearErrors, events, keys, showError } from "./api.js";
import { render } from "./markdown.js";
import { cli, curl, pythonChat, wireCopy } from "./snippets.js";

const STORE = "genserve.chat";
const $ = (id) => document.getElementById(id);
// The body's fields (an error's `param`) -> the control they come from.
const FIELDS = {
  temperature: "temperature", top_p: "top-p", max_tokens: "max-tokens", max_completion_tokens: "max-tokens",
  seed: "seed", response_format: "json-schema", messages: "message",
};

let conversation = [];
let running = null; // the AbortController of the answer being streamed

function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE) || "{}");
    conversation = Array.isArray(saved.messages) ? saved.messages : [];
    if (typeof saved.system === "string") $("system").value = saved.system;
  } catch {
    conversation = [];
  }
}

function save() {
  localStorage.setItem(STORE, JSON.stringify({ messages: conversation, system: $("system").value }));
}

function number(id) {
  const raw = $(id).value.trim();
  return raw === "" ? undefined : Number(raw);
}

/** The body Send would post for `messages`, or throws a local error naming the control. */
function body(messages) {
  const system = $("system").value.trim();
  const out = {
    model: "text",
    messages: [...(system ? [{ role: "system", content: system }] : []), ...messages],
    temperature: number("temperature"), top_p: number("top-p"), max_tokens: number("max-tokens"), seed: number("seed"),
    stream: true, stream_options: { include_usage: true },
  };
  for (const k of Object.keys(out)) if (out[k] === undefined) delete out[k];
  if ($("json-mode").checked) {
    let schema;
    try {
      schema = JSON.parse($("json-schema").value);
    } catch (e) {
      const error = new Error(`not valid JSON: ${e.message}`);
      error.param = "response_format";
      throw error;
    }
    out.response_format = { type: "json_schema", json_schema: { name: "output", schema } };
  }
  return out;
}

function history() {
  return conversation.map(({ role, content }) => ({ role, content }));
}

function messageView(message, index) {
  const item = document.createElement("article");
  item.className = `message ${message.role}`;
  item.setAttribute("aria-label", message.role === "user" ? "You" : "Assistant");
  const who = document.createElement("h3");
  who.textContent = message.role === "user" ? "You" : "Assistant";
  const content = document.createElement("div");
  content.className = "content";
  if (message.role === "user") content.textContent = message.content; // the user's words, as typed
  else render(content, message.content);
  const foot = document.createElement("div");
  foot.className = "message-foot";
  const note = document.createElement("span");
  note.className = "stats";
  note.textContent = message.note || "";
  const copy = document.createElement("button");
  copy.type = "button";
  copy.className = "quiet";
  copy.textContent = "Copy";
  copy.setAttribute("aria-label", `Copy message ${index + 1}`);
  copy.addEventListener("click", () => navigator.clipboard?.writeText(message.content));
  foot.append(note, copy);
  item.append(who, content, foot);
  return item;
}

function show() {
  $("conversation").replaceChildren(...conversation.map(messageView));
  $("conversation").lastElementChild?.scrollIntoView({ block: "end" });
}

function busy(on) {
  $("send").disabled = on;
  $("regenerate").disabled = on;
  $("stop").disabled = !on;
}

function stats(started, firstAt, endedAt, tokens) {
  const ttft = firstAt ? `TTFT ${Math.round(firstAt - started)} ms` : "no tokens";
  const seconds = (endedAt - (firstAt || started)) / 1000;
  const rate = tokens > 1 && seconds > 0 ? ` · ${((tokens - 1) / seconds).toFixed(1)} tok/s` : "";
  return `${ttft}${rate}${tokens ? ` · ${tokens} tokens` : ""}`; // a stopped answer has no usage chunk
}

/** Streams the answer to the conversation as it is into a new assistant message. */
async function answer(fromBox = false) {
  clearErrors(FIELDS, "message-error");
  let request;
  try {
    request = body(history());
  } catch (error) {
    showError(error, FIELDS, "message-error");
    return;
  }
  const reply = { role: "assistant", content: "" };
  conversation.push(reply);
  show();
  const view = $("conversation").lastElementChild;
  const content = view.querySelector(".content");
  const note = view.querySelector(".message-foot .stats");
  view.dataset.state = "streaming";
  running = new AbortController();
  busy(true);
  const started = performance.now();
  let firstAt = 0;
  let tokens = 0;
  let finish = "";
  try {
    const response = await call("POST", "/v1/chat/completions", request, { signal: running.signal });
    for await (const batch of events(response)) {
      for (const chunk of batch) {
        if (chunk.usage) tokens = chunk.usage.completion_tokens;
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) continue;
        if (choice.delta && choice.delta.content) {
          if (!firstAt) firstAt = performance.now();
          reply.content += choice.delta.content;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      render(content, reply.content);
      note.textContent = `${firstAt ? `TTFT ${Math.round(firstAt - started)} ms · ` : ""}streaming…`;
    }
    reply.note = `${stats(started, firstAt, performance.now(), tokens)} · ${finish || "done"}`;
    view.dataset.state = "done";
  } catch (error) {
    if (error.name === "AbortError") {
      reply.note = `stopped · ${stats(started, firstAt, performance.now(), tokens)}`;
      view.dataset.state = "stopped";
    } else {
      reply.note = "failed";
      view.dataset.state = "failed";
      if (!reply.content) {
        conversation.pop();
        // A refused question goes back into the box, to be sent again once the setting is fixed.
        if (fromBox && conversation.at(-1)?.role === "user") $("message").value = conversation.pop().content;
      }
      showError(error, FIELDS, "message-error");
    }
  } finally {
    running = null;
    busy(false);
    note.textContent = reply.note || "";
    $("chat-stats").textContent = reply.note || "";
    save();
    if (!conversation.includes(reply)) show();
  }
}

async function send() {
  const text = $("message").value.trim();
  if (!text || running) return;
  conversation.push({ role: "user", content: text });
  $("message").value = "";
  save();
  show();
  await answer(true);
}

async function regenerate() {
  if (running) return;
  while (conversation.length && conversation.at(-1).role === "assistant") conversation.pop();
  if (!conversation.length) return;
  show();
  await answer();
}

function snippet(kind) {
  const draft = $("message").value.trim();
  const messages = [...history(), ...(draft ? [{ role: "user", content: draft }] : [])];
  let request;
  try {
    request = body(messages.length ? messages : [{ role: "user", content: "Hello" }]);
  } catch (error) {
    return `# ${error.message}`;
  }
  const hasKey = Boolean(keys.get());
  if (kind === "curl") return curl("/v1/chat/completions", request, hasKey);
  if (kind === "python") return pythonChat(request, hasKey);
  const last = request.messages.filter((m) => m.role === "user").at(-1);
  const note = request.messages.length > (request.messages[0].role === "system" ? 2 : 1)
    ? "# the CLI sends one question; start `genserve chat` without one for a conversation\n" : "";
  const schema = request.response_format
    ? `\n# JSON-schema mode: genserve text PROMPT --json-schema ${JSON.stringify(JSON.stringify(request.response_format.json_schema.schema))}`
    : "";
  return note + cli(["chat", last.content], {
    "--system": request.messages[0].role === "system" ? request.messages[0].content : "",
    "--temperature": request.temperature ?? 1, "--top-p": request.top_p, "--max-tokens": request.max_tokens,
    "--seed": request.seed, "--api-key": hasKey ? "$GENSERVE_API_KEY" : "",
  }).replace("'$GENSERVE_API_KEY'", '"$GENSERVE_API_KEY"') + schema;
}

/** Puts the server's defaults and limits into the controls (`settings.text` from /api/settings). */
export function applyDefaults(text) {
  const help = (field) => {
    const f = text[field];
    const low = f.ge ?? f.gt;
    const range = low !== undefined && f.le !== undefined ? `${low}–${f.le}` : "";
    const def = f.default === null ? "server default: to the end of the context" : `default ${f.default}`;
    return [range, def].filter(Boolean).join(", ");
  };
  for (const [field, id] of [["temperature", "temperature"], ["top_p", "top-p"], ["max_tokens", "max-tokens"]]) {
    if (text[field].default !== null && $(id).value === "") $(id).value = text[field].default;
    $(`${id}-help`).textContent = help(field);
  }
}

export function init() {
  load();
  show();
  $("chat-form").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("message").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", () => running?.abort());
  $("regenerate").addEventListener("click", regenerate);
  $("clear").addEventListener("click", () => {
    conversation = [];
    save();
    show();
    $("chat-stats").textContent = "";
  });
  $("system").addEventListener("change", save);
  $("json-mode").addEventListener("change", () => {
    $("json-schema").disabled = !$("json-mode").checked;
  });
  wireCopy($("chat-form"), snippet);
}

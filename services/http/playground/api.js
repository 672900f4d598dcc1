// Calls to genserve's HTTP API from the page: the API key, OpenAI error objects and server-sent events.

const KEY = "genserve.apiKey";

/** An error the API answered with: its HTTP status and OpenAI error object (`param` names the field). */
export class ApiError extends Error {
  constructor(status, error, retryAfter = null) {
    super(error.message || `HTTP ${status}`);
    this.status = status;
    this.param = error.param || null;
    this.code = error.code || null;
    this.retryAfter = retryAfter;
  }
}

/** The key lives in sessionStorage (this tab), and in localStorage only when asked to remember it. */
export const keys = {
  get: () => sessionStorage.getItem(KEY) || localStorage.getItem(KEY) || "",
  set(key, remember) {
    sessionStorage.setItem(KEY, key);
    if (remember) localStorage.setItem(KEY, key);
    else localStorage.removeItem(KEY);
  },
  clear() {
    sessionStorage.removeItem(KEY);
    localStorage.removeItem(KEY);
  },
};

let askForKey = async () => false;

/** `ask(message)` resolves to true once the user gave a key (retry), false if they declined. */
export function onKeyNeeded(ask) {
  askForKey = ask;
}

function headers() {
  const out = { "Content-Type": "application/json" };
  const key = keys.get();
  if (key) out.Authorization = `Bearer ${key}`;
  return out;
}

async function errorOf(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    body = null;
  }
  const error = body && body.error ? body.error : { message: `HTTP ${response.status} ${response.statusText}` };
  return new ApiError(response.status, error, response.headers.get("Retry-After"));
}

/** The response to `method path` with a JSON body; a 401 asks for a key and tries again; other errors throw. */
export async function call(method, path, body, { signal } = {}) {
  for (;;) {
    const response = await fetch(path, {
      method, headers: headers(), signal, body: body === undefined ? undefined : JSON.stringify(body),
    });
    if (response.ok) return response;
    const error = await errorOf(response);
    if (response.status === 401 && await askForKey(error.message)) continue;
    throw error;
  }
}

export async function json(method, path, body, options) {
  return (await call(method, path, body, options)).json();
}

/** The `data:` payloads of a server-sent-event response, parsed, until [DONE]; an error event throws ApiError. */
export async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      const batch = [];
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of block.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") {
            if (batch.length) yield batch;
            return;
          }
          const parsed = JSON.parse(data);
          if (parsed.error) throw new ApiError(0, parsed.error);
          batch.push(parsed);
        }
      }
      if (batch.length) yield batch; // what arrived together is one update of the page
    }
  } finally {
    reader.releaseLock();
  }
}

/** The message to show for `error`: the server's own, with what a 429 says about retrying. */
export function describe(error) {
  if (error.name === "AbortError") return "stopped";
  if (!(error instanceof ApiError)) return `the request failed: ${error.message}`;
  const retry = error.status === 429 && error.retryAfter ? ` (retry in ${error.retryAfter} s)` : "";
  const status = error.status ? `${error.status}: ` : "";
  return `${status}${error.message}${retry}`;
}

/** Shows `error` next to the control its `param` names (`fields` maps params to element ids), else at `fallback`. */
export function showError(error, fields, fallback) {
  clearErrors(fields, fallback);
  const param = error instanceof ApiError && error.param ? error.param : "";
  const head = param.split(/[.[]/)[0];
  const id = fields[param] || fields[head];
  const target = id && document.getElementById(`${id}-error`) ? id : null;
  const slot = document.getElementById(target ? `${target}-error` : fallback);
  slot.textContent = describe(error);
  if (target) document.getElementById(target).setAttribute("aria-invalid", "true");
  return target;
}

export function clearErrors(fields, fallback) {
  for (const id of new Set(Object.values(fields))) {
    const slot = document.getElementById(`${id}-error`);
    if (slot) slot.textContent = "";
    document.getElementById(id)?.removeAttribute("aria-invalid");
  }
  document.getElementById(fallback).textContent = "";
}

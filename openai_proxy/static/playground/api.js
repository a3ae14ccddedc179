// Talking to this proxy's own API (same origin only; the page's CSP allows nothing else).
// URLs are relative to /playground/ so the page also works behind a path prefix.

const KEY_STORE = "dlm-playground-key";

export function apiKey() {
  return sessionStorage.getItem(KEY_STORE) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_STORE, key);
  else sessionStorage.removeItem(KEY_STORE);
}

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = apiKey();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

// The API's error object as given: {status, message, type, param, code}.
export class ApiError extends Error {
  constructor(status, error) {
    super(error.message || "request failed");
    this.status = status;
    this.type = error.type || null;
    this.param = error.param ?? null;
    this.code = error.code ?? null;
  }
}

async function errorOf(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    body = null;
  }
  const error = body && typeof body.error === "object" && body.error !== null
    ? body.error
    : { message: `HTTP ${response.status} ${response.statusText}` };
  return new ApiError(response.status, error);
}

export async function getJSON(path) {
  const response = await fetch(path, { headers: headers(false), credentials: "omit" });
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

// POST a streaming request and call onChunk(chunk) for every SSE data object until [DONE].
// An error object inside the stream (sent after the headers) is thrown as ApiError.
export async function streamJSON(path, body, onChunk, signal) {
  const response = await fetch(path, {
    method: "POST",
    headers: headers(true),
    body: JSON.stringify(body),
    credentials: "omit",
    signal,
  });
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(response.status, chunk.error);
        onChunk(chunk);
      }
    }
  }
  throw new ApiError(response.status, { message: "the stream ended without [DONE]" });
}

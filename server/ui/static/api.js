// Calls to the server this page came from. The API key (when the server has one) lives in
// sessionStorage, goes only in the Authorization header (never in a URL), and is asked for on a 401.

const KEY = "cellserve.apiKey";

export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

let askKey = null;     // async (reason) -> key | null, set by the page
let asking = null;     // one prompt at a time, shared by every request that got a 401

export function onKeyNeeded(fn) { askKey = fn; }
export function hasKey() { return Boolean(sessionStorage.getItem(KEY)); }
export function setKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
}

async function errorOf(res) {
  let message = `${res.status} ${res.statusText}`;
  let code = null;
  try {
    const body = await res.json();
    message = body.error?.message ?? message;
    code = body.error?.code ?? null;
  } catch { /* not JSON */ }
  return new ApiError(res.status, message, code);
}

async function keyAfter401(res) {
  const error = await errorOf(res);
  if (!askKey) throw error;
  asking = asking || askKey(error.message).finally(() => { asking = null; });
  const key = await asking;
  if (!key) throw error;
  setKey(key);
}

/** fetch(path) with the key; on a 401 ask for the key and retry; a non-2xx answer throws ApiError. */
export async function request(method, path, body, { signal } = {}) {
  for (;;) {
    const headers = { "Content-Type": "application/json" };
    const key = sessionStorage.getItem(KEY);
    if (key) headers.Authorization = `Bearer ${key}`;
    const res = await fetch(path, { method, headers, signal,
                                    body: body === undefined ? undefined : JSON.stringify(body) });
    if (res.status === 401) {
      await keyAfter401(res);
      continue;
    }
    if (!res.ok) throw await errorOf(res);
    return res;
  }
}

export async function json(method, path, body) {
  return (await request(method, path, body)).json();
}

/** The `data:` payloads of a server-sent event stream, parsed as JSON, until `[DONE]`. */
export async function* events(res) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

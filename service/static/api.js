/* Halfway dashboard: the API client. The token (kept in localStorage), GET of JSON resources
 * with If-None-Match (one remembered ETag per polled resource) and any other request with the
 * token. */
// A refused token (401) brings up the token prompt: poll.js's, through the hook app.js sets.
import { hooks } from "./state.js";

// ---- Token ---------------------------------------------------------------------------------

export const TOKEN_KEY = "halfway.token";

/** `halfway serve` prints /?token=...; keep it in localStorage and out of the address bar,
 * the history and bookmarks. A #token= fragment works too (it never reaches server logs). */
export function takeTokenFromUrl() {
  const url = new URL(location.href);
  const fragment = new URLSearchParams(url.hash.slice(1));
  const token = url.searchParams.get("token") || fragment.get("token");
  if (!token) return;
  localStorage.setItem(TOKEN_KEY, token.trim());
  url.searchParams.delete("token");
  fragment.delete("token");
  const rest = fragment.toString();
  history.replaceState(null, "", url.pathname + url.search + (rest ? "#" + rest : ""));
}

export function storedToken() {
  return localStorage.getItem(TOKEN_KEY);
}
// ---- API -----------------------------------------------------------------------------------

export class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// slot -> {url, etag, body}: one remembered response per polled resource, so the map stays
// small while cursors advance.
export const etags = new Map();

export async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.message || response.statusText;
  } catch {
    return response.statusText;
  }
}

/** GET a JSON resource. With a slot, send If-None-Match for the slot's last ETag and
 * answer a 304 from memory. Returns {body, changed}. */
export async function api(url, slot) {
  const headers = { Accept: "application/json" };
  const token = storedToken();
  if (token) headers.Authorization = "Bearer " + token;
  const cached = slot ? etags.get(slot) : undefined;
  if (cached && cached.url === url) headers["If-None-Match"] = cached.etag;
  // no-store: we make the conditional requests ourselves and want to see the 304.
  const response = await fetch(url, { headers, cache: "no-store" });
  if (response.status === 304 && cached) return { body: cached.body, changed: false };
  if (!response.ok) throw new HttpError(response.status, await errorMessage(response));
  const body = await response.json();
  const etag = response.headers.get("ETag");
  if (slot && etag) etags.set(slot, { url, etag, body });
  else if (slot) etags.delete(slot);
  return { body, changed: true };
}

/** Any request with the token (the panels' log and artifacts, cancel, priority): the
 * Response, or an HttpError carrying the server's message. */
export async function request(method, url, body) {
  const headers = {};
  const token = storedToken();
  if (token) headers.Authorization = "Bearer " + token;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(url, { method, headers, cache: "no-store",
    body: body === undefined ? undefined : JSON.stringify(body) });
  if (!response.ok) {
    const err = new HttpError(response.status, await errorMessage(response));
    if (response.status === 401) hooks.tokenRefused(err);
    throw err;
  }
  return response;
}

/** One read at a time for the selected job (``state.id``): a call while a read runs asks for
 * one more right after it, since two at once would move a cursor twice. A 404 (the job went
 * away) and a failure for a job no longer selected are dropped; any other goes to onError. */
export function oneAtATime(state, read, onError) {
  async function run() {
    if (state.busy) {
      state.again = true;
      return;
    }
    state.busy = true;
    const id = state.id;
    try {
      await read(id);
    } catch (err) {
      if (id !== state.id) return;
      if (err instanceof HttpError && err.status === 404) return;
      onError(err);
    } finally {
      state.busy = false;
      if (state.again && id === state.id) {
        state.again = false;
        run();
      }
    }
  }
  return run;
}

/* Halfway dashboard: the refresh loop (one refresh at a time, paused while the tab is hidden),
 * the token prompt and the live indicator. Below the views: what a tick refreshes (the list,
 * the selected job, the comparison) is app.js's refresh, and the prompt pauses the event
 * stream, both through hooks (state.js). */
import { CONFIG } from "./config.js";
import { $, setText } from "./format.js";
import { etags, HttpError, storedToken, TOKEN_KEY } from "./api.js";
import { hooks, selection, stream, streamServes } from "./state.js";

// ---- The token prompt ----------------------------------------------------------------------

function askForToken(message) {
  stopPolling();
  hooks.pauseStream();
  $("#app").hidden = true;
  $("#forget-token").hidden = true;
  $("#auth").hidden = false;
  setText($("#auth-message"), message);
  setLive("auth", "waiting for a token");
  const input = $("#auth-token");
  input.value = "";
  input.focus();
}

export function onTokenSubmit(event) {
  event.preventDefault();
  const token = $("#auth-token").value.trim();
  if (!token) return;
  localStorage.setItem(TOKEN_KEY, token);
  etags.clear();
  $("#auth").hidden = true;
  startPolling();
}

export function forgetToken() {
  localStorage.removeItem(TOKEN_KEY);
  etags.clear();
  askForToken("Token forgotten. Paste a token to continue.");
}

// ---- Polling -------------------------------------------------------------------------------

export const poll = { on: false, timer: null, busy: false, again: false };

export function startPolling() {
  poll.on = true;
  kick();
}

function stopPolling() {
  poll.on = false;
  clearTimeout(poll.timer);
  poll.timer = null;
}

/** Refresh now (a click, the tab becoming visible) without ever running two refreshes at
 * once: an overlapping one would move the history cursor twice. */
export function kick() {
  if (!poll.on) return;
  if (poll.busy) {
    poll.again = true;
    return;
  }
  clearTimeout(poll.timer);
  tick();
}

async function tick() {
  poll.timer = null;
  if (document.hidden) {
    setLive("paused", "paused while the tab is hidden");
    return; // visibilitychange kicks us again
  }
  poll.busy = true;
  try {
    await hooks.refresh();
    setLive("live", `${liveDetail()} · updated ${new Date().toLocaleTimeString()}`);
  } catch (err) {
    if (err instanceof HttpError && err.status === 401) {
      tokenRefused(err);
    } else {
      setLive("error", String(err.message || err));
      console.warn("refresh failed", err);
    }
  } finally {
    poll.busy = false;
  }
  if (!poll.on) return;
  if (poll.again) {
    poll.again = false;
    kick();
  } else {
    poll.timer = setTimeout(tick, CONFIG.pollMs);
  }
}

export function tokenRefused(err) {
  askForToken(storedToken()
    ? `The server refused the token (${err.message}). Paste a valid token.`
    : "This server needs an API token.");
}

/** How the selected job is kept current: "streaming" or "polling". */
function transport() {
  return streamServes(selection.hist) ? "streaming" : "polling";
}

/** The live indicator's tooltip: how, and when polling instead of listening, why. */
export function liveDetail() {
  if (stream.hist !== selection.hist) return transport();
  if (stream.state === "ended") return "streamed until the job ended";
  if (stream.state !== "fallback") return transport();
  const retry = new Date(stream.retryAt).toLocaleTimeString();
  return `polling (the event stream failed: ${stream.why}; trying it again at ${retry})`;
}

export function setLive(state, detail) {
  const live = $("#live");
  live.dataset.state = state;
  live.dataset.transport = transport() === "streaming" ? "stream" : "poll";
  setText(live, { live: "live", paused: "paused", error: "error", auth: "no token" }[state]);
  live.title = detail || "";
}

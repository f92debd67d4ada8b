/* Halfway dashboard: the selected job's event stream (GET /v1/jobs/{id}/events), read with
 * fetch() as text/event-stream, with reconnects, backoff and the fall back to polling; and
 * refreshSelection, which keeps the selected job current through one or the other. The
 * stream's state is in state.js (the live indicator reads it). */
import { CONFIG } from "./config.js";
import { errorMessage, HttpError, storedToken } from "./api.js";
import { selection, stream, streamServes } from "./state.js";
import { kick, liveDetail, poll, setLive, tokenRefused } from "./poll.js";
import { drawRaw, dropFrom, followJob, followRewrite, pollSelected, pullBuckets,
  toBuckets } from "./jobpage.js";
import { renderJob } from "./jobsummary.js";

// ---- Keeping the selected job current: the stream, or polling ------------------------------

/** Keep the selected job current: through its stream when that works, else by polling.
 * Runs inside a tick, so a poll and the opening of a stream never overlap. */
export async function refreshSelection(hist) {
  if (streamServes(hist)) {
    // The stream brings the job and its rows; a zoom still needs its buckets read.
    if (hist.mode === "buckets" && hist.stale) await pullBuckets(hist, hist.steps);
    return;
  }
  if (stream.hist === hist && stream.state === "paused") {
    // Back from a hidden tab or a token prompt: go on from the last event. Not while the
    // prompt is still up: a refresh already under way when the stream's 401 came would
    // reconnect with the refused token.
    if (poll.on) connect(hist);
    return;
  }
  await pollSelected(hist);
  if (hist === selection.hist && streamWanted(hist)) openStream(hist);
}

// ---- The selected job's event stream -------------------------------------------------------
//
// GET /v1/jobs/{id}/events sends `steps` (new rows), `status` (the whole job, whenever it
// changes), `reset` (a resume replaced the rows from a step on) and a final `end`. One
// listener costs the server far less than a page polling the job and its rows, so while the
// stream serves the selected job the ticks leave it alone. It is read with fetch(), not
// EventSource, which cannot send the Authorization header.

function streamWanted(hist) {
  // A queued job is polled: its place in the queue (job.queue) is in the polled answer
  // only, and moves without the job changing. Its stream opens once it runs.
  if (!CONFIG.stream || !hist.loaded || hist.queued) return false;
  if (stream.hist !== hist) return true;
  return stream.state === "fallback" && Date.now() >= stream.retryAt;
}

/** Listen from where the page's own rows end. The position goes as Last-Event-ID even on
 * the first request, so the server compares history versions: a rewrite since the page's
 * read arrives as a `reset`, never as new rows stacked onto replaced ones. */
function openStream(hist) {
  const step = hist.mode === "raw" ? hist.cursor : hist.lastStep;
  // A retry after falling back keeps its failure count: one more failure, back to polling.
  if (stream.hist !== hist) stream.failures = 0;
  stream.hist = hist;
  stream.lastId = `${hist.version}:${step}`;
  connect(hist);
}

/** Stop for now (a hidden tab, the token prompt); refreshSelection reconnects from lastId. */
export function pauseStream() {
  if (!["connecting", "open", "waiting"].includes(stream.state)) return;
  closeConnection();
  stream.state = "paused";
}

/** Forget the stream altogether (another job was selected). */
export function dropStream() {
  closeConnection();
  Object.assign(stream, { hist: null, state: "off", lastId: "", failures: 0, retryAt: 0 });
}

function closeConnection() {
  clearTimeout(stream.timer);
  clearTimeout(stream.watchdog);
  const controller = stream.controller;
  stream.controller = null; // before aborting: connect() then knows the abort was meant
  if (controller) controller.abort();
}

/** One connection, from fetch to the end of its body; a failure leads to streamFailed. */
async function connect(hist) {
  clearTimeout(stream.timer);
  if (document.hidden) {
    // A hidden tab holds no stream open. A refresh that began before the tab was hidden
    // (awaiting the job list) or a backoff timer ends here; being shown again reconnects.
    stream.state = "paused";
    return;
  }
  const controller = new AbortController();
  stream.controller = controller;
  stream.state = "connecting";
  const headers = { Accept: "text/event-stream", "Last-Event-ID": stream.lastId };
  const token = storedToken();
  if (token) headers.Authorization = "Bearer " + token;
  const url = `/v1/jobs/${hist.jobId}/events?after_step=${stream.lastId.split(":")[1]}`;
  let failure;
  try {
    watch(controller, CONFIG.streamFirstEventMs);
    const response = await fetch(url, { headers, cache: "no-store", signal: controller.signal });
    if (!response.ok) throw new HttpError(response.status, await errorMessage(response));
    const type = response.headers.get("Content-Type") || "";
    // A proxy or a login page may answer 200 with something else altogether.
    if (!type.startsWith("text/event-stream")) throw new Error(`not an event stream: ${type}`);
    stream.state = "open";
    setLive("live", "streaming");
    await readEvents(response.body, () => watch(controller, CONFIG.streamQuietMs),
      (event) => onStreamEvent(hist, event));
    failure = new Error("the stream closed before the job ended");
  } catch (err) {
    failure = err;
  }
  if (stream.controller !== controller) return; // closed on purpose, or by onEnd
  stream.controller = null;
  clearTimeout(stream.watchdog);
  if (failure instanceof HttpError && failure.status === 401) tokenRefused(failure);
  else streamFailed(hist, failure);
}

/** Abort a connection that stays silent too long: a stream held back by something between
 * (a buffering proxy) or a network gone away without a word. */
function watch(controller, ms) {
  clearTimeout(stream.watchdog);
  stream.watchdog = setTimeout(
    () => controller.abort(new Error(`nothing received for ${ms / 1000} s`)), ms);
}

/** Reconnect with backoff; after a few failures in a row poll instead (the ticks do, once
 * the state is "fallback") and try the stream again later. */
function streamFailed(hist, err) {
  stream.failures++;
  stream.why = String((err && err.message) || err);
  console.warn("event stream failed", err);
  if (stream.failures >= CONFIG.streamFailures) {
    stream.state = "fallback";
    stream.retryAt = Date.now() + CONFIG.streamRetryMs;
    setLive("live", liveDetail());
    kick();
    return;
  }
  stream.state = "waiting";
  const delay = CONFIG.streamBackoffMs * 2 ** (stream.failures - 1);
  setLive("live", `reconnecting the event stream in ${delay / 1000} s (${stream.why})`);
  stream.timer = setTimeout(() => connect(hist), delay);
}

/** Handle one event. Awaited by readEvents, so events are handled one at a time, in order. */
async function onStreamEvent(hist, { name, id, data }) {
  if (hist !== selection.hist || stream.hist !== hist) return;
  const body = JSON.parse(data);
  if (name === "steps") await onSteps(hist, body, id);
  else if (name === "status") await onStatus(hist, body);
  else if (name === "reset") onReset(hist, body);
  else if (name === "end") await onEnd(hist, body);
  if (id) stream.lastId = id; // only once handled: a reconnect must not skip it
  stream.failures = 0; // it works
  setLive("live", `streaming · updated ${new Date().toLocaleTimeString()}`);
}

/** New rows, appended as a polled page's are. In bucket mode they are not kept: the
 * status events say when the buckets are outdated, as a polled job does. */
async function onSteps(hist, { items }, id) {
  if (hist.mode !== "raw") return;
  // The server sends a newer version's rows only after the `reset` that dropped what they
  // replace, or when none of the rows held were replaced: those held stay valid under it.
  hist.version = Math.max(hist.version, Number(id.split(":")[0]));
  const raw = hist.raw;
  for (const row of items) {
    if (row.step <= hist.cursor) continue; // held already
    raw.steps.push(row.step);
    raw.loss.push(row.loss); // null for NaN/inf: a gap in the line
    raw.scale.push(row.loss_scale);
    raw.finite.push(row.finite);
    hist.cursor = row.step;
  }
  if (raw.steps.length > CONFIG.bucketThreshold) {
    toBuckets(hist);
    await pullBuckets(hist, hist.cursor + 1);
    return;
  }
  scheduleDraw();
}

/** The job changed: handled as a polled job that changed. */
async function onStatus(hist, job) {
  renderJob(job);
  followRewrite(hist, job.history_version, job.history_reset_step);
  await followJob(hist, job, true);
}

/** A resume replaced the rows from from_step on; the rows that replace them follow. */
function onReset(hist, { history_version: version, from_step: from }) {
  hist.version = Math.max(hist.version, version);
  dropFrom(hist, from);
  if (hist.mode === "raw") scheduleDraw();
  // In bucket mode the job's next status (its history_version moved) re-reads the buckets.
}

/** The job finished and every row was sent: stop listening, the page shows its end. */
async function onEnd(hist, { last_step: lastStep }) {
  stream.state = "ended";
  closeConnection();
  // Buckets read a few steps before the end miss the last ones: read them once more.
  if (hist.mode === "buckets" && hist.drawn.step <= lastStep) {
    await pullBuckets(hist, lastStep + 1);
  }
}

let drawQueued = false;

/** Rows may arrive several times a second; the chart is redrawn at most once a frame. */
function scheduleDraw() {
  if (drawQueued) return;
  drawQueued = true;
  requestAnimationFrame(() => {
    drawQueued = false;
    const hist = selection.hist;
    if (hist && hist.mode === "raw") drawRaw(hist);
  });
}

/** Read a text/event-stream body (the WHATWG format). onBytes() is called for whatever
 * arrives, keepalive comments included; onEvent({name, id, data}) for each event, awaited. */
async function readEvents(body, onBytes, onEvent) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let pending = ""; // the start of a line whose end has not arrived yet
  let event = newEvent();
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    onBytes();
    const text = pending + decoder.decode(value, { stream: true });
    // A chunk may end between the "\r" and "\n" of one line break: keep the "\r" for later.
    const cut = text.endsWith("\r") ? text.length - 1 : text.length;
    const lines = text.slice(0, cut).split(/\r\n|\r|\n/);
    pending = lines.pop() + text.slice(cut);
    for (const line of lines) {
      if (line === "") { // a blank line ends the event
        if (event.data.length) {
          await onEvent({ name: event.name || "message", id: event.id,
            data: event.data.join("\n") });
        }
        event = newEvent();
      } else if (!line.startsWith(":")) { // ":" starts a comment: the server's keepalive
        addField(event, line);
      }
    }
  }
}

function newEvent() {
  return { name: "", id: "", data: [] };
}

function addField(event, line) {
  const colon = line.indexOf(":");
  const field = colon < 0 ? line : line.slice(0, colon);
  let value = colon < 0 ? "" : line.slice(colon + 1);
  if (value.startsWith(" ")) value = value.slice(1);
  if (field === "event") event.name = value;
  else if (field === "data") event.data.push(value);
  else if (field === "id") event.id = value;
}

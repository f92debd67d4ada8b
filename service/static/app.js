/* Halfway dashboard: the entry point. Plain JavaScript as ES modules, served as they are (no
 * bundler, no build step); charts are uPlot (vendored, loaded as a classic script before this).
 *
 * The modules, each importing only modules listed above it (no import circle;
 * tests/test_static_modules.py checks):
 * - config.js: the settings (query parameters) and the chart colours;
 * - format.js: small DOM helpers and the formatting of numbers, scales and times;
 * - state.js: what the views share (the selection, the job list's rows, the comparison's set,
 *   the stream's state) and the hooks: calls up the import order, which this file wires;
 * - address.js: the address's fragment (setHash);
 * - api.js: the API client: the token, GET with If-None-Match, any request with the token;
 * - charts.js: the chart pair (loss, loss scale), its series and columns;
 * - poll.js: the refresh loop, the token prompt and the live indicator;
 * - compare.js: the comparison of several jobs;
 * - joblist.js: the job list;
 * - jobsummary.js: the selected job's summary, problems and metrics;
 * - jobpage.js: the selected job's charts, kept current by polling;
 * - stream.js: the selected job's event stream, and the fall back to polling;
 * - gradients.js, metrics.js, panels.js: the gradient band, the metrics per epoch and the panels
 *   (log, artifacts, spec, ...), each handed its helpers here (they import nothing);
 * - app.js (this file): makes those three, sets the hooks, selects from the address, starts.
 *
 * Rules these modules keep:
 * - Job names, owners, errors, warnings and metrics are user-controlled: they only ever reach
 *   the page through textContent / createTextNode, never innerHTML.
 * - The selected job is followed through its event stream (GET /v1/jobs/{id}/events): the
 *   server sends new rows and each change of the job, so the page need not ask. When the
 *   stream cannot be used (a proxy that blocks it, ?stream=0) the page polls instead.
 * - A polled resource is re-read with If-None-Match, and raw history only with an after_step
 *   cursor, so an idle dashboard costs a few empty 304s every couple of seconds.
 * - Long runs are drawn from buckets (min/max/last per bucket), never from a million raw rows.
 * - A resume rewrites history from its checkpoint on: when the job's history_version moves,
 *   the rows held from the cut on are dropped and read again, so two attempts never mix.
 */
import { CONFIG } from "./config.js";
import { $, el, fmtInt, fmtNumber, fmtScale, fmtTime, setText } from "./format.js";
import { comparison, hooks, jobRows, selection } from "./state.js";
import { hashParams, setHash } from "./address.js";
import { api, oneAtATime, request, storedToken, takeTokenFromUrl } from "./api.js";
import { chartWidth } from "./charts.js";
import { forgetToken, kick, onTokenSubmit, startPolling, tokenRefused } from "./poll.js";
import { compareFromHash, refreshCompare } from "./compare.js";
import { refreshJobs } from "./joblist.js";
import { renderJob } from "./jobsummary.js";
import { newHistory } from "./jobpage.js";
import { dropStream, pauseStream, refreshSelection } from "./stream.js";
import { HalfwayGradients } from "./gradients.js";
import { HalfwayMetrics } from "./metrics.js";
import { HalfwayPanels } from "./panels.js";

// ---- The gradient band, the metrics per epoch, the panels ----------------------------------

// The selected job's gradient band, per-layer table and precision decision (gradients.js):
// told of each selection, each change of the job and each zoom.
const gradients = HalfwayGradients({ api, oneAtATime, el, setText, fmtInt, fmtNumber, fmtScale,
  chartWidth });

// The selected job's metrics per epoch (metrics.js): read only when an epoch ended.
const epochMetrics = HalfwayMetrics({ api, oneAtATime, el, setText, fmtInt, fmtNumber });

const panels = HalfwayPanels({ el, setText, fmtInt, fmtTime, fmtScale, request,
  pollMs: CONFIG.pollMs, token: storedToken,
  setTab: (tab) => setHash({ tab }, true),
  // A cancel or a priority change answered with the job: show it at once; the next poll
  // (or the stream's status event) confirms it.
  jobChanged: (job) => {
    if (job.id === selection.id) renderJob(job);
    kick();
  } });

// ---- The hooks: calls up the import order (state.js) ---------------------------------------

hooks.tokenRefused = tokenRefused;
hooks.refresh = refresh;
hooks.pauseStream = pauseStream;
hooks.jobShown = (job) => {
  if (gradients) gradients.job(job);
  if (epochMetrics) epochMetrics.job(job);
  if (panels) panels.job(job);
};
hooks.jobZoomed = (view) => {
  if (gradients) gradients.zoom(view);
};
hooks.queueText = (queue) => (panels ? panels.queueText(queue) : "");

/** One tick of poll.js's loop. */
async function refresh() {
  // The list and the comparison are polled even while the selected job streams: they are
  // cheap for the server (cached, 304s) and cover jobs nobody streams.
  await refreshJobs();
  if (selection.hist) await refreshSelection(selection.hist);
  if (comparison.ids.length >= 2) await refreshCompare();
}

// ---- The selection, from the address (address.js writes it) --------------------------------

function selectFromHash() {
  const p = hashParams();
  compareFromHash(p);
  const raw = p.get("job");
  const id = raw && /^\d+$/.test(raw) ? Number(raw) : null;
  if (id !== selection.id) selectJobNow(id);
  if (panels) panels.tab(p.get("tab") || "");
}

function selectJobNow(id) {
  dropStream(); // the old job's stream, if any
  selection.id = id;
  selection.hist = id === null ? null : newHistory(id);
  selection.layout = null;
  if (selection.pair) selection.pair.destroy();
  if (gradients) gradients.select(id);
  if (epochMetrics) epochMetrics.select(id);
  if (panels) panels.select(id);
  $("#job").hidden = id === null;
  $("#app").classList.toggle("with-job", id !== null);
  for (const [rowId, row] of jobRows) row.classList.toggle("selected", rowId === id);
  kick();
}

// ---- Start ---------------------------------------------------------------------------------

function main() {
  takeTokenFromUrl();
  $("#auth-form").addEventListener("submit", onTokenSubmit);
  $("#forget-token").addEventListener("click", forgetToken);
  $("#reset-zoom").addEventListener("click", () => selection.pair && selection.pair.zoom(null));
  window.addEventListener("hashchange", selectFromHash);
  // A hidden tab neither polls nor holds a stream open; becoming visible resumes both.
  document.addEventListener("visibilitychange", () => (document.hidden ? pauseStream() : kick()));
  selectFromHash();
  // Try even without a token: a server started with --no-auth needs none, and one that does
  // answers 401, which brings up the token form.
  startPolling();
}

main();

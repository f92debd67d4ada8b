/* Halfway dashboard: the entry point. Plain JavaScript as ES modules, served as they are (no
 * bundler, no build step); charts are uPlot (vendored, loaded as a classic script before this).
 *
 * The modules, each importing what it uses:
 * - config.js: the settings (query parameters) and the chart colours;
 * - format.js: small DOM helpers and the formatting of numbers, scales and times;
 * - api.js: the API client: the token, GET with If-None-Match, any request with the token;
 * - poll.js: the refresh loop, the token prompt and the live indicator;
 * - joblist.js: the job list;
 * - charts.js: the chart pair (loss, loss scale), its series and columns;
 * - jobpage.js: the selected job, the address's fragment, its charts kept current by polling;
 * - stream.js: the selected job's event stream, and the fall back to polling;
 * - jobsummary.js: the selected job's summary, problems and metrics;
 * - compare.js: the comparison of several jobs;
 * - gradients.js, metrics.js, panels.js: the gradient band, the metrics per epoch and the panels
 *   (log, artifacts, spec, ...), each handed its helpers here.
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
import { api, HttpError, request, storedToken, takeTokenFromUrl } from "./api.js";
import { chartWidth } from "./charts.js";
import { forgetToken, kick, onTokenSubmit, startPolling } from "./poll.js";
import { selectFromHash, selection, setHash } from "./jobpage.js";
import { renderJob } from "./jobsummary.js";
import { pauseStream } from "./stream.js";
import { HalfwayGradients } from "./gradients.js";
import { HalfwayMetrics } from "./metrics.js";
import { HalfwayPanels } from "./panels.js";

// ---- Start -----------------------------------------------------------------------------------

// The selected job's gradient band, per-layer table and precision decision (gradients.js):
// told of each selection, each change of the job and each zoom.
export const gradients = HalfwayGradients({ api, el, setText, fmtInt, fmtNumber, fmtScale,
  chartWidth, HttpError });

// The selected job's metrics per epoch (metrics.js): read only when an epoch ended.
export const epochMetrics = HalfwayMetrics({ api, el, setText, fmtInt, fmtNumber, HttpError });

export const panels = HalfwayPanels({ el, setText, fmtInt, fmtTime, fmtScale, request,
  pollMs: CONFIG.pollMs, token: storedToken,
  setTab: (tab) => setHash({ tab }, true),
  // A cancel or a priority change answered with the job: show it at once; the next poll
  // (or the stream's status event) confirms it.
  jobChanged: (job) => {
    if (job.id === selection.id) renderJob(job);
    kick();
  } });

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

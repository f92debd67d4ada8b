/* Halfway dashboard: what the views share, and the hooks a lower module calls but a higher one
 * provides. A leaf: it imports nothing, so any module may import it. It holds data, not
 * behaviour: the selected job, the job list's rows, the comparison's set, the event stream's
 * state; app.js fills in the hooks before the page starts. */

// ---- The selected job (jobpage.js draws it, app.js selects it) -----------------------------

export const selection = { id: null, hist: null, pair: null, layout: null };

// ---- The job list (joblist.js fills these; compare.js and app.js read them) ----------------

export const jobRows = new Map(); // job id -> <tr>, updated in place so checkboxes keep their state
export let jobsById = new Map();

/** The list as last read (joblist.js): a new map each time, read through the live binding. */
export function setJobsById(map) {
  jobsById = map;
}

// ---- The comparison (compare.js) -----------------------------------------------------------

export const comparison = { ids: [], pair: null, key: "", builtFor: "", wantView: null };

// ---- The selected job's event stream (stream.js; poll.js's live indicator reads it) --------

export const stream = {
  hist: null, // the selection it follows; null: none
  // off | connecting | open | waiting (to reconnect) | paused (a hidden tab, the token
  // prompt) | ended (the job finished) | fallback (polling until retryAt)
  state: "off",
  controller: null, // aborts the connection's request
  lastId: "", // VERSION:STEP of the last event handled: where a reconnect goes on from
  failures: 0, // in a row
  why: "", // the last failure, for the live indicator
  retryAt: 0,
  timer: null, // the reconnect's
  watchdog: null,
};

/** True while the stream, not polling, keeps this history current. */
export function streamServes(hist) {
  return !!hist && stream.hist === hist &&
    ["connecting", "open", "waiting", "ended"].includes(stream.state);
}

// ---- Hooks ---------------------------------------------------------------------------------
//
// Calls that go up the import order: the lower module calls the hook, app.js (which imports
// everything) sets it to the higher module's function before main() runs. Each does nothing
// until then.

export const hooks = {
  // api.js's request() on a 401: bring up the token prompt (poll.js's tokenRefused).
  tokenRefused: (err) => {},
  // poll.js's tick: one refresh of the list, the selected job and the comparison (app.js).
  refresh: async () => {},
  // poll.js's token prompt: stop the event stream for now (stream.js's pauseStream).
  pauseStream: () => {},
  // jobsummary.js's renderJob: the selected job as just read; the gradient band, the metrics
  // per epoch and the panels follow it (their .job).
  jobShown: (job) => {},
  // jobpage.js: the selected job's charts were zoomed (the gradient band's .zoom).
  jobZoomed: (view) => {},
  // joblist.js: a queued job's place in the queue, as text (the panels' queueText).
  queueText: (queue) => "",
};

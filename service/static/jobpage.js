/* Halfway dashboard: the selected job's charts, kept current by polling (its event stream is
 * in stream.js, which also decides between the two): raw rows past a cursor, or buckets past
 * the threshold, and the rewrite a resume makes followed through history_version. Which job is
 * selected (state.js's selection) is app.js's to set, from the address. */
import { BLUE, CONFIG } from "./config.js";
import { $, fmtInt, setText, stepsEach } from "./format.js";
import { api, HttpError } from "./api.js";
import { bucketColumns, bucketLayout, bucketPoints, ChartPair, countMarkers, rawColumns,
  rawLayout } from "./charts.js";
import { hooks, selection } from "./state.js";
import { kick } from "./poll.js";
import { renderJob } from "./jobsummary.js";

// ---- The selected job ----------------------------------------------------------------------

/** What is held of a newly selected job's history: nothing yet. */
export function newHistory(jobId) {
  return {
    jobId,
    mode: "raw",
    raw: { steps: [], loss: [], scale: [], finite: [] },
    cursor: -1,
    hasMore: true, // nothing read yet
    version: null, // the history_version the rows held belong to
    stale: true, // buckets must be (re)read even if the job did not change
    drawn: { at: 0, step: 0, width: 1 }, // when and at which step buckets were last read
    steps: 0, // the job's progress.step (steps done) as last seen
    lastStep: -1, // the job's summary.last_step as last seen: where a bucket-mode stream starts
    loaded: false, // read and drawn once: the stream can take over from here
    queued: false, // the job waits in the queue: polled, not streamed (streamWanted)
  };
}

/** The polling path: the job (If-None-Match), then its new rows or its buckets. */
export async function pollSelected(hist) {
  let result;
  try {
    result = await api(`/v1/jobs/${hist.jobId}`, "job");
  } catch (err) {
    if (err instanceof HttpError && err.status === 404) {
      setText($("#job-title"), `Job ${hist.jobId} not found`);
      return;
    }
    throw err;
  }
  if (hist !== selection.hist) return; // another job was selected meanwhile
  const job = result.body;
  if (result.changed) renderJob(job);
  followRewrite(hist, job.history_version, job.history_reset_step);
  await followJob(hist, job, result.changed);
  if (hist.mode === "raw") await pullRows(hist, result.changed);
  hist.loaded = true;
}

/** What a (changed) job means for the chart, polled or streamed alike: past the threshold
 * the job is drawn from buckets, and buckets are read again once they are outdated. */
export async function followJob(hist, job, changed) {
  hist.steps = job.progress.step || 0;
  hist.queued = job.status === "queued";
  hist.lastStep = job.summary.last_step ?? -1;
  if (hist.mode === "raw" && hist.steps > CONFIG.bucketThreshold) toBuckets(hist);
  const outdated = changed && bucketsOutdated(hist, hist.steps);
  if (hist.mode === "buckets" && (hist.stale || outdated)) await pullBuckets(hist, hist.steps);
}

/** A resume replaced the history from some step on (history_version moved): drop what is
 * held from that step on, or everything when more than one rewrite was missed (only the
 * latest cut is known), and read on from there. */
export function followRewrite(hist, version, resetStep) {
  if (hist.version === null) hist.version = version;
  if (version <= hist.version) return; // an older answer (another API replica's cache)
  const from = version === hist.version + 1 && resetStep !== null ? resetStep : 0;
  hist.version = version;
  dropFrom(hist, from);
}

/** Forget the rows held from a step on (they were replaced); buckets are read again. */
export function dropFrom(hist, from) {
  if (hist.raw) {
    const keep = hist.raw.steps.findIndex((step) => step >= from);
    if (keep >= 0) for (const column of Object.values(hist.raw)) column.length = keep;
    hist.cursor = Math.min(hist.cursor, from - 1);
    hist.hasMore = true;
  }
  hist.stale = true; // buckets are read again whole
}

export function toBuckets(hist) {
  hist.mode = "buckets";
  hist.raw = null; // a long run's rows are not kept in the browser
  hist.stale = true;
}

function ensureLayout(mode) {
  if (selection.layout === mode) return;
  selection.layout = mode;
  if (!selection.pair) {
    selection.pair = new ChartPair($("#loss-chart"), $("#scale-chart"), "job", onJobZoom);
  }
  selection.pair.view = null;
  $("#reset-zoom").hidden = true;
  const layout = mode === "raw" ? rawLayout() : bucketLayout([{ label: "", color: BLUE }]);
  selection.pair.build(layout.loss, layout.scale);
}

function onJobZoom(view) {
  const hist = selection.hist;
  $("#reset-zoom").hidden = view === null;
  hooks.jobZoomed(view); // the gradient band (app.js)
  if (!hist) return;
  if (hist.mode === "raw") {
    drawRaw(hist); // every row is here already: zoom in the browser
  } else {
    hist.stale = true; // a narrower range gets narrower buckets, down to single steps
    kick();
  }
}

/** Raw rows past the cursor. When the job summary has not changed no row was written, so
 * the request is skipped altogether. */
async function pullRows(hist, jobChanged) {
  if (!jobChanged && !hist.hasMore) return;
  // At most a few pages per refresh, so one poll never blocks the page for long.
  for (let page = 0; page < 5; page++) {
    const url = `/v1/jobs/${hist.jobId}/history?format=columns&after_step=${hist.cursor}` +
      `&limit=${CONFIG.rawPageLimit}`;
    const { body } = await api(url, "history");
    if (hist !== selection.hist) return;
    if (body.history_version < hist.version) return; // a lagging answer: ask again later
    if (body.history_version !== hist.version) {
      followRewrite(hist, body.history_version, body.history_reset_step);
      continue; // read again from the cut
    }
    appendColumns(hist.raw, body);
    hist.cursor = body.next_after_step;
    hist.hasMore = body.has_more;
    if (hist.raw.steps.length > CONFIG.bucketThreshold) {
      toBuckets(hist);
      await pullBuckets(hist, hist.cursor + 1);
      return;
    }
    if (!hist.hasMore) break;
  }
  drawRaw(hist);
}

function appendColumns(raw, page) {
  // null loss (NaN/inf) stays null: a gap in the line
  for (let i = 0; i < page.step.length; i++) {
    raw.steps.push(page.step[i]);
    raw.loss.push(page.loss[i]);
    raw.scale.push(page.loss_scale[i]);
    raw.finite.push(page.finite[i]);
  }
}

export function drawRaw(hist) {
  ensureLayout("raw");
  const cols = rawColumns(hist.raw);
  selection.pair.setData(cols.loss, cols.scale);
  const n = hist.raw.steps.length;
  describeChart({
    mode: "raw",
    points: n,
    width: 1,
    markers: cols.markers,
    overflowSteps: cols.overflowSteps,
    distinctSteps: new Set(hist.raw.steps).size,
    text: `${fmtInt(n)} steps, one point each (raw rows) · ` +
      `${fmtInt(cols.markers)} overflow steps marked`,
  });
}

function bucketsOutdated(hist, steps) {
  const { at, step, width } = hist.drawn;
  return steps - step >= width || Date.now() - at >= CONFIG.bucketRefreshMs;
}

export async function pullBuckets(hist, steps) {
  const view = selection.layout === "buckets" ? selection.pair.view : null;
  let url = `/v1/jobs/${hist.jobId}/history?points=${bucketPoints($("#loss-chart"))}`;
  if (view) url += `&from_step=${view.from}&to_step=${view.to}`;
  const { body, changed } = await api(url, "buckets");
  if (hist !== selection.hist) return;
  const wasStale = hist.stale;
  hist.stale = false;
  hist.drawn = { at: Date.now(), step: steps, width: body.width };
  if (changed || wasStale) drawBuckets(body);
}

function drawBuckets(page) {
  ensureLayout("buckets");
  const xs = page.buckets.map((b) => b.first_step);
  const byX = new Map(page.buckets.map((b) => [b.first_step, b]));
  const cols = bucketColumns(xs, [byX]);
  selection.pair.setData(cols.loss, cols.scale);
  const what = page.width === 1 ? "one step each (exact)"
    : `${fmtInt(page.width)} steps each; the band spans each bucket's min–max`;
  describeChart({
    mode: "buckets",
    points: xs.length,
    width: page.width,
    markers: cols.markers,
    overflowSteps: cols.overflowSteps,
    text: `steps ${fmtInt(page.from_step)}–${fmtInt(page.to_step)} in ` +
      `${fmtInt(xs.length)} buckets of ${what} · ${fmtInt(cols.markers)} buckets with ` +
      `overflows marked (${fmtInt(cols.overflowSteps)} overflow steps)`,
  });
}

/** Caption and data-* attributes (what the charts show, counted from the very columns
 * handed to uPlot; the tests read them). */
function describeChart(info) {
  const [lossChart, scaleChart] = selection.pair.charts;
  const markerColumn = (chart) => chart.data[chart.series.findIndex((s) => s.class === "marker")];
  Object.assign($("#loss-chart").dataset, {
    mode: info.mode,
    points: String(info.points),
    bucketWidth: String(info.width),
    overflowMarkers: String(countMarkers(markerColumn(lossChart))),
    overflowSteps: String(info.overflowSteps),
    distinctSteps: String(info.distinctSteps ?? ""),
    historyVersion: String(selection.hist ? selection.hist.version : ""),
  });
  $("#scale-chart").dataset.overflowMarkers = String(countMarkers(markerColumn(scaleChart)));
  setText($("#job-mode"), info.mode === "raw" ? "raw steps"
    : `${stepsEach(info.width)} per bucket`);
  setText($("#chart-caption"), info.text);
}

/* Halfway dashboard: the selected job's summary beside its charts: title, status, progress,
 * problems (error, warnings) and metrics, all of it as text. */
import { $, el, fmtHuman, fmtInt, fmtLoss, fmtScale, fmtSeconds, fmtTime, NBSP } from "./format.js";
import { hooks } from "./state.js";
import { renderStatus } from "./joblist.js";

// ---- The selected job's summary -------------------------------------------------------------

export function renderJob(job) {
  const title = $("#job-title");
  title.replaceChildren(el("span", { text: job.name }),
    el("span", { className: "muted", text: ` #${job.id} · ${job.owner}` }));
  renderStatus($("#job-status"), job.status);
  renderSummary(job);
  renderProblems(job);
  renderMetrics(job.summary.metrics || {});
  // A job with no step recorded that is not training says so instead of two empty charts.
  $("#job-charts").hidden = job.summary.last_step === null && job.status !== "running";
  hooks.jobShown(job); // the gradient band, the metrics per epoch, the panels (app.js)
}

function renderSummary(job) {
  const s = job.summary;
  const p = job.progress;
  const pct = p.fraction === null ? "" : ` (${Math.round(p.fraction * 100)}%)`;
  const rows = [
    ["Progress", `${fmtInt(p.step ?? 0)} / ${fmtInt(p.total_steps)} steps${pct}`],
    // progress.epoch counts from 0, as Keras does; people (and the metrics' last epoch)
    // count from 1.
    ["Epoch", p.epoch === null ? "–" : `${fmtInt(p.epoch + 1)}` +
      (epochsPlanned(job) ? ` of ${fmtInt(epochsPlanned(job))}` : "")],
    ["Last loss", fmtLoss(s.last_loss, s.last_loss_nonfinite)],
    ["Loss scale", fmtScale(s.loss_scale)],
    ["Lowest scale", fmtScale(s.min_loss_scale)],
    ["Overflow steps", fmtInt(s.overflow_count)],
    ["Back-offs / growths", `${fmtInt(s.backoff_count)} / ${fmtInt(s.growth_count)}`],
    ["Non-finite losses", fmtInt(s.nonfinite_loss_count)],
    ["Steps/s", fmtHuman(s.steps_per_second)],
    ["Attempt", `${job.attempt} of ${job.max_attempts}`],
    ["Created", fmtTime(job.created_at)],
    ["Finished", fmtTime(job.finished_at)],
  ];
  $("#job-summary").replaceChildren(...rows.flatMap(([term, value]) =>
    [el("dt", { text: term }), el("dd", { text: value })]));
}

function epochsPlanned(job) {
  const training = job.spec && job.spec.training;
  return training && Number.isInteger(training.epochs) ? training.epochs : null;
}

function renderProblems(job) {
  const parts = [];
  if (job.error) {
    parts.push(el("h3", { text: "Error" }), el("pre", { className: "error", text: job.error }));
  }
  if (job.summary.guard_warning) {
    parts.push(el("h3", { text: "Guard warning" }),
      el("p", { className: "warning", text: job.summary.guard_warning }));
  }
  if (job.warnings && job.warnings.length) {
    parts.push(el("h3", { text: "Warnings" }),
      el("ul", { className: "warnings" }, ...job.warnings.map((w) => el("li", { text: w }))));
  }
  $("#job-problems").replaceChildren(...parts);
}

function renderMetrics(metrics) {
  const entries = metricEntries(metrics);
  const dl = $("#job-metrics");
  if (!entries.length) {
    dl.replaceChildren(el("dd", { className: "muted", text: "none yet" }));
    return;
  }
  dl.replaceChildren(...entries.flatMap(([label, value, key]) => (value === null
    ? [el("dt", { className: "group", text: label })]
    : [el("dt", { text: label, title: key }), el("dd", { text: value })])));
}

// Labels for the names Keras, the worker and the user give; others are spelled out from the
// key ("val_top_k" -> "Validation top k"). The raw key stays in the label's tooltip.
const METRIC_LABELS = {
  last_epoch: "Last epoch",
  timing: "Timing",
  epoch: "Epoch",
  loss: "Loss",
  accuracy: "Accuracy",
  median_step_seconds: "Median step",
  examples_per_second: "Examples/s",
  peak_memory_bytes: "Peak memory",
  compile_seconds: "Compile time",
  first_step_seconds: "First step",
};

function metricLabel(key) {
  if (Object.hasOwn(METRIC_LABELS, key)) return METRIC_LABELS[key];
  if (!/^[a-z][a-z0-9_]*$/.test(key)) return key; // not an identifier: the user's own words
  if (key.startsWith("val_")) return "Validation " + metricLabel(key.slice(4)).toLowerCase();
  const bare = key.replace(/_(seconds|bytes|per_second)$/, "");
  const text = bare.replace(/_/g, " ");
  return text.charAt(0).toUpperCase() + text.slice(1) +
    (key.endsWith("_per_second") ? "/s" : "");
}

/** The summary's metrics as [label, text, key] rows; a group (last_epoch, timing) is a
 * heading row ([label, null]) followed by its members. */
function metricEntries(metrics) {
  return Object.entries(metrics || {}).flatMap(([key, value]) => {
    if (value !== null && typeof value === "object" && !Array.isArray(value)) {
      const members = Object.entries(value).map(([k, v]) =>
        [metricLabel(k), fmtMetric(k, v), `${key}.${k}`]);
      return [[metricLabel(key), null, key], ...members];
    }
    return [[metricLabel(key), fmtMetric(key, value), key]];
  });
}

function fmtMetric(key, value) {
  if (typeof value !== "number") return value === null ? "–" : String(value);
  if (key.endsWith("_bytes")) return (value / 2 ** 20).toFixed(1) + NBSP + "MiB";
  if (key.endsWith("_per_second")) return fmtHuman(value) + NBSP + "/s";
  if (key.endsWith("_seconds")) return fmtSeconds(value);
  if (key === "epoch") return fmtInt(value + 1); // Keras counts epochs from 0
  return fmtHuman(value);
}

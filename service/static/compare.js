/* Halfway dashboard: the comparison of several jobs on one chart pair, bucketed on one step
 * grid; the set and its zoom live in the address's fragment. The set itself (comparison) is in
 * state.js, which the job list reads for its checkboxes. */
import { COLORS, CONFIG } from "./config.js";
import { $, fmtInt, setText, stepsEach } from "./format.js";
import { api } from "./api.js";
import { bucketColumns, bucketLayout, bucketPoints, ChartPair } from "./charts.js";
import { comparison, jobRows, jobsById } from "./state.js";
import { setHash } from "./address.js";
import { kick } from "./poll.js";

// ---- Comparison -----------------------------------------------------------------------------

export function toggleCompare(id, on) {
  const ids = comparison.ids.filter((x) => x !== id);
  if (on) ids.push(id);
  comparison.wantView = comparison.pair ? comparison.pair.view : null;
  setCompare(ids.slice(-CONFIG.maxCompare));
  setHash({ compare: comparison.ids.length ? comparison.ids.join(",") : null,
    compare_steps: compareSteps() }, false);
}

function compareSteps() {
  const view = comparison.pair && comparison.pair.view;
  return view ? `${view.from}-${view.to}` : null;
}

/** A link opened cold (or back/forward) sets the comparison and its zoom. */
export function compareFromHash(p) {
  const ids = (p.get("compare") || "").split(",").filter((x) => /^\d+$/.test(x))
    .map(Number).filter((x, i, all) => all.indexOf(x) === i).slice(-CONFIG.maxCompare);
  const steps = /^(\d+)-(\d+)$/.exec(p.get("compare_steps") || "");
  const view = steps && Number(steps[2]) > Number(steps[1])
    ? { from: Number(steps[1]), to: Number(steps[2]) } : null;
  if (ids.join(",") !== comparison.ids.join(",")) setCompare(ids);
  comparison.wantView = view;
  if (comparison.pair && JSON.stringify(view) !== JSON.stringify(comparison.pair.view)) {
    comparison.pair.view = view;
    comparison.key = "";
    kick();
  }
}

function setCompare(ids) {
  comparison.ids = ids;
  for (const [rowId, row] of jobRows) {
    const index = comparison.ids.indexOf(rowId);
    row.querySelector(".compare-box").checked = index >= 0;
    row.querySelector(".swatch").style.background = index >= 0 ? COLORS[index] : "";
  }
  comparison.key = ""; // new set of jobs: re-read
  $("#compare").hidden = comparison.ids.length < 2;
  if (comparison.ids.length < 2 && comparison.pair) {
    comparison.pair.destroy();
    comparison.pair = null;
    comparison.builtFor = "";
  }
  kick();
}

/** What the comparison depends on; when none of the jobs moved, skip the request. */
function comparisonKey() {
  const view = comparison.pair ? JSON.stringify(comparison.pair.view) : "";
  return comparison.ids.map((id) => {
    const job = jobsById.get(id);
    return job ? `${id}:${job.status}:${job.summary.last_step}:${job.history_version}`
      : `${id}:?`;
  }).join(",") + view;
}

export async function refreshCompare() {
  const key = comparisonKey();
  if (key === comparison.key) return;
  if (!comparison.pair) {
    comparison.pair = new ChartPair($("#compare-loss-chart"), $("#compare-scale-chart"),
      "compare", () => {
        comparison.key = "";
        setHash({ compare_steps: compareSteps() }, false);
        kick();
      });
    comparison.pair.view = comparison.wantView;
  }
  const ids = comparison.ids.slice();
  const view = comparison.pair.view;
  let url = `/v1/history?job_ids=${ids.join(",")}` +
    `&points=${bucketPoints($("#compare-loss-chart"))}`;
  if (view) url += `&from_step=${view.from}&to_step=${view.to}`;
  const { body } = await api(url, "compare");
  if (ids.join(",") !== comparison.ids.join(",")) return; // the set changed meanwhile
  comparison.key = key;
  drawCompare(body);
}

function drawCompare(page) {
  // Every job is on the same grid: bucket i starts at origin + i * width for all of them.
  const start = (b) => Math.max(page.from_step, page.origin + b.index * page.width);
  const xs = [...new Set(page.jobs.flatMap((j) => j.buckets.map(start)))].sort((a, b) => a - b);
  const perJob = page.jobs.map((j) => new Map(j.buckets.map((b) => [start(b), b])));
  const layout = bucketLayout(page.jobs.map((j, i) => ({
    label: `${j.name} #${j.job_id}`, color: COLORS[i % COLORS.length],
  })));
  const pair = comparison.pair;
  const builtFor = page.jobs.map((j) => j.job_id).join(",");
  if (pair.charts.length === 0 || comparison.builtFor !== builtFor) {
    pair.build(layout.loss, layout.scale); // legends and colours follow the set of jobs
    comparison.builtFor = builtFor;
  }
  const cols = bucketColumns(xs, perJob);
  pair.setData(cols.loss, cols.scale);
  $("#compare-loss-chart").dataset.jobs = page.jobs.map((j) => j.job_id).join(",");
  setText($("#compare-note"), `${page.jobs.length} jobs · steps ${fmtInt(page.from_step)}–` +
    `${fmtInt(page.to_step)} · ${stepsEach(page.width)} per bucket · ` +
    `${fmtInt(cols.markers)} buckets with overflows`);
}

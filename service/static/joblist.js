/* Halfway dashboard: the job list, its rows updated in place (so the comparison checkboxes keep
 * their state). The rows and the jobs as last read are in state.js, which compare.js reads. */
import { COLORS, CONFIG } from "./config.js";
import { $, el, fmtInt, fmtScale, setText } from "./format.js";
import { api, storedToken } from "./api.js";
import { comparison, hooks, jobRows, jobsById, selection, setJobsById } from "./state.js";
import { selectJob } from "./address.js";
import { toggleCompare } from "./compare.js";

// ---- Job list ------------------------------------------------------------------------------

// Job statuses come from the server (GET /v1/vocabulary), defined once in service/vocabulary.py.
let STATUSES = [];

export async function refreshJobs() {
  if (!STATUSES.length) STATUSES = (await api("/v1/vocabulary")).body.job_statuses;
  const { body, changed } = await api(`/v1/jobs?limit=${CONFIG.jobListLimit}`, "jobs");
  $("#app").hidden = false;
  $("#forget-token").hidden = !storedToken();
  if (!changed) return;
  setJobsById(new Map(body.items.map((job) => [job.id, job])));
  renderJobs(body.items);
  setText($("#jobs-note"), body.next_cursor ? `newest ${body.items.length} shown` : "");
}

function renderJobs(jobs) {
  const tbody = $("#jobs tbody");
  for (const [id, row] of jobRows) {
    if (!jobsById.has(id)) {
      row.remove();
      jobRows.delete(id);
    }
  }
  for (const job of jobs) {
    let row = jobRows.get(job.id);
    if (!row) {
      row = createJobRow(job.id);
      jobRows.set(job.id, row);
    }
    updateJobRow(row, job);
    tbody.append(row); // moves an existing row into list order
  }
  $("#jobs-empty").hidden = jobs.length > 0;
}

function createJobRow(id) {
  const box = el("input", { type: "checkbox", className: "compare-box" });
  box.setAttribute("aria-label", `compare job ${id}`);
  box.addEventListener("change", () => toggleCompare(id, box.checked));
  // A button so the keyboard can select too; its click bubbles to the row's handler.
  const name = el("button", { type: "button", className: "link job-name" });
  const row = el("tr", { dataset: { jobId: String(id) } },
    el("td", { className: "pick" }, box, el("span", { className: "swatch" })),
    el("td", { className: "name" }, name),
    el("td", { className: "id num" }),
    el("td", { className: "owner" }),
    el("td", { className: "status-cell" }, el("span", { className: "status" }),
      el("span", { className: "queue-spot" })),
    el("td", { className: "progress num" },
      el("progress", { max: 1, value: 0 }), el("span", { className: "progress-text" })),
    el("td", { className: "scale num" }),
    el("td", { className: "overflows num" }));
  // The whole row selects, except the checkbox (which only toggles comparison).
  row.addEventListener("click", (event) => {
    if (!event.target.closest("input")) selectJob(id);
  });
  return row;
}

function updateJobRow(row, job) {
  const cell = (cls) => row.querySelector("." + cls);
  setText(cell("job-name"), job.name);
  setText(cell("id"), String(job.id));
  setText(cell("owner"), job.owner);
  renderStatus(cell("status"), job.status);
  const spot = job.status === "queued" ? hooks.queueText(job.queue) : "";
  setText(cell("queue-spot"), spot ? `queued: ${spot}` : "");
  const { step, total_steps: total, fraction } = job.progress;
  const bar = row.querySelector("progress");
  bar.value = fraction || 0;
  setText(cell("progress-text"), `${fmtInt(step ?? 0)} / ${fmtInt(total)}`);
  setText(cell("scale"), fmtScale(job.summary.loss_scale));
  setText(cell("overflows"), fmtInt(job.summary.overflow_count));
  cell("overflows").classList.toggle("warn", job.summary.overflow_count > 0);
  row.classList.toggle("selected", job.id === selection.id);
  const index = comparison.ids.indexOf(job.id);
  row.querySelector(".compare-box").checked = index >= 0;
  row.querySelector(".swatch").style.background = index >= 0 ? COLORS[index] : "";
}

export function renderStatus(node, status) {
  setText(node, status);
  // Only known statuses become class names; the text itself is set as text.
  node.className = "status" + (STATUSES.includes(status) ? " status-" + status : "");
}

/* Halfway dashboard: the selected job's state line (in the chart area), its actions (cancel,
 * priority) and its panels (log, artifacts, spec, forensics, precision, attempts). An ES
 * module, no build step; app.js hands it its helpers.
 *
 * Rules this file keeps (as the other modules do):
 * - Everything a job carries is user-controlled: it only reaches the page as text.
 * - Panels are closed by default and cost nothing then. The spec, forensics, precision and
 *   attempts panels are drawn from the job JSON the page already holds; only the log and the
 *   artifacts panels ask the server anything, and only while open: the log by its byte offset
 *   (X-Log-Offset), so each poll carries only what was appended, and not at all once the job
 *   has ended and its last bytes were read.
 */
const TABS = [
  ["log", "Log"],
  ["artifacts", "Artifacts"],
  ["spec", "Spec"],
  ["forensics", "Forensics"],
  ["precision", "Precision"],
  ["attempts", "Attempts"],
];
const FINAL = ["succeeded", "failed", "cancelled"];
const REASONS = { // why a queued job waits (docs/scheduling.md)
  next: "next to start",
  priority: "higher-priority jobs ahead",
  share: "owners further below their share ahead",
  age: "older jobs ahead",
  "per-user cap": "the owner runs as many jobs as a user may",
  budget: "the owner has used this window's budget",
  "no slot": "no worker's slot holds the GPUs it needs",
};
const LOG_TAIL = 256 * 1024; // what opening the log shows of a long one
const LOG_KEEP = 1024 * 1024; // characters kept in the page; older ones are dropped

export function HalfwayPanels(h) {
  const { el, setText, fmtInt, fmtTime, request, pollMs, setTab, token } = h;
  const $ = (selector) => document.querySelector(selector);

  const state = {
    id: null,
    job: null,
    tab: "",
    log: null, // {id, offset, timer, busy, done}
    artifactsKey: "",
    confirming: false,
    // Who the token is (GET /v1/me), asked once per token: {token, me} with me null while
    // the answer is out, or {name, role}; "unknown" if it could not be read.
    viewer: { token: undefined, me: null },
  };

  // ---- The tab bar ------------------------------------------------------------------------

  function buildTabs() {
    const bar = $("#job-tabs");
    bar.replaceChildren(...TABS.map(([key, label]) => {
      const button = el("button", { type: "button", className: "tab", text: label,
        dataset: { tab: key } });
      button.setAttribute("role", "tab");
      // A click on the open tab closes it: a closed panel costs nothing.
      button.addEventListener("click", () => setTab(state.tab === key ? "" : key));
      return button;
    }));
  }

  /** Show one panel (or none): the hash says which, so a link opens it. */
  function showTab(tab) {
    const known = TABS.some(([key]) => key === tab);
    state.tab = known ? tab : "";
    for (const button of document.querySelectorAll("#job-tabs .tab")) {
      const on = button.dataset.tab === state.tab;
      button.classList.toggle("open", on);
      button.setAttribute("aria-selected", on ? "true" : "false");
    }
    const panel = $("#job-panel");
    panel.hidden = !state.tab;
    panel.dataset.tab = state.tab;
    if (state.tab !== "log") stopLog();
    if (state.tab !== "artifacts") state.artifactsKey = "";
    render();
  }

  function render() {
    const job = state.job;
    const panel = $("#job-panel");
    if (!state.tab || !job) return;
    if (state.tab === "log") return openLog(job);
    if (state.tab === "artifacts") return loadArtifacts(job);
    if (state.tab === "spec") {
      return panel.replaceChildren(el("pre", { className: "json",
        text: JSON.stringify(job.spec, null, 2) }));
    }
    if (state.tab === "forensics") return panel.replaceChildren(...forensics(job));
    if (state.tab === "precision") return panel.replaceChildren(...precision(job));
    if (state.tab === "attempts") return panel.replaceChildren(...attempts(job));
  }

  // ---- Log --------------------------------------------------------------------------------

  function openLog(job) {
    if (state.log && state.log.id === job.id) {
      // Already following: a job that just ended gets one more read for its last bytes.
      if (state.log.done && !FINAL.includes(job.status)) state.log.done = false;
      if (!state.log.timer && !state.log.busy && !state.log.done) readLog(state.log);
      return;
    }
    stopLog();
    const pre = el("pre", { className: "log", id: "job-log" });
    pre.dataset.offset = "";
    $("#job-panel").replaceChildren(
      el("p", { className: "hint", id: "job-log-note", text: "reading the log…" }), pre);
    state.log = { id: job.id, offset: null, timer: null, busy: false, done: false };
    readLog(state.log);
  }

  function stopLog() {
    if (state.log) clearTimeout(state.log.timer);
    state.log = null;
  }

  async function readLog(log) {
    log.timer = null;
    if (state.log !== log) return;
    if (document.hidden) { // a hidden tab asks nothing; look again later
      log.timer = setTimeout(() => readLog(log), pollMs);
      return;
    }
    const ended = state.job && FINAL.includes(state.job.status);
    log.busy = true;
    const query = log.offset === null ? `tail=${LOG_TAIL}` : `offset=${log.offset}`;
    try {
      const response = await request("GET", `/v1/jobs/${log.id}/logs?${query}`);
      const text = await response.text();
      if (state.log !== log) return;
      const size = Number(response.headers.get("X-Log-Size") || 0);
      const first = log.offset === null;
      log.offset = Number(response.headers.get("X-Log-Offset") || 0);
      append(text, first && size > LOG_TAIL);
      const pre = $("#job-log");
      pre.dataset.offset = String(log.offset);
      const note = size === 0 ? "no log yet" : `${fmtBytes(size)}` +
        (ended ? "" : " · following the log as it grows");
      setText($("#job-log-note"), note);
      // More is waiting (a chunk is at most 4 MiB): read on at once.
      if (log.offset < size) {
        log.busy = false;
        return readLog(log);
      }
      log.done = ended;
    } catch (err) {
      if (state.log !== log) return;
      setText($("#job-log-note"), `could not read the log: ${err.message || err}`);
    } finally {
      log.busy = false;
    }
    if (state.log === log && !log.done) log.timer = setTimeout(() => readLog(log), pollMs);
  }

  function append(text, cut) {
    const pre = $("#job-log");
    if (!pre) return;
    const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
    if (cut && !pre.textContent) pre.textContent = "… (earlier lines left out)\n";
    if (text) pre.append(document.createTextNode(text));
    if (pre.textContent.length > LOG_KEEP) {
      pre.textContent = "… " + pre.textContent.slice(-LOG_KEEP);
    }
    if (atEnd) pre.scrollTop = pre.scrollHeight;
  }

  function fmtBytes(n) {
    if (n < 1024) return `${fmtInt(n)} bytes`;
    if (n < 2 ** 20) return `${(n / 1024).toFixed(1)} KiB`;
    if (n < 2 ** 30) return `${(n / 2 ** 20).toFixed(1)} MiB`;
    return `${(n / 2 ** 30).toFixed(2)} GiB`;
  }

  // ---- Artifacts --------------------------------------------------------------------------

  /** Listed when the panel opens and again when the job's status moves (a job writes its
   * artifacts as it ends), never on every poll. */
  async function loadArtifacts(job) {
    const key = `${job.id}:${job.status}`;
    if (state.artifactsKey === key) return;
    state.artifactsKey = key;
    const panel = $("#job-panel");
    if (!panel.querySelector("#job-artifacts")) {
      panel.replaceChildren(el("p", { className: "hint", text: "listing the artifacts…" }));
    }
    let items;
    try {
      items = await (await request("GET", `/v1/jobs/${job.id}/artifacts`)).json();
    } catch (err) {
      if (state.artifactsKey === key) {
        panel.replaceChildren(el("p", { className: "error-text",
          text: `could not list the artifacts: ${err.message || err}` }));
      }
      return;
    }
    if (state.artifactsKey !== key || state.tab !== "artifacts") return;
    if (!items.length) {
      panel.replaceChildren(el("p", { className: "muted", id: "job-artifacts",
        text: FINAL.includes(job.status) ? "This job left no artifacts."
          : "No artifacts yet: a job writes them as it ends." }));
      return;
    }
    panel.replaceChildren(el("ul", { id: "job-artifacts", className: "artifacts" },
      ...items.map((a) => {
        const link = el("a", { href: a.url, text: a.name, className: "artifact" });
        // The API wants the token in a header, which a plain link cannot send.
        link.addEventListener("click", (event) => {
          event.preventDefault();
          download(a.url, `job-${job.id}-${a.name}`);
        });
        return el("li", {}, link, el("span", { className: "muted", text: ` ${fmtBytes(a.bytes)}` }));
      })));
  }

  async function download(url, filename) {
    try {
      const blob = await (await request("GET", url)).blob();
      const href = URL.createObjectURL(blob);
      const a = el("a", { href, download: filename });
      document.body.append(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(href), 60000);
    } catch (err) {
      setText($("#job-action-note"), `download failed: ${err.message || err}`);
    }
  }

  // ---- Forensics, precision, attempts -----------------------------------------------------

  function forensics(job) {
    const reports = job.forensics || [];
    if (!reports.length) {
      return [el("p", { className: "muted", text: "No non-finite step recorded." })];
    }
    return reports.map((r) => el("div", { className: "forensic" },
      el("h4", { text: `Step ${fmtInt(r.step)}` +
        (r.loss_scale !== undefined ? ` · loss scale ${h.fmtScale(r.loss_scale)}` : "") }),
      el("pre", { className: "json", text: JSON.stringify(r, null, 2) })));
  }

  function precision(job) {
    const out = [];
    const d = job.precision_decision;
    if (d) {
      out.push(el("h4", { text: "Decision" }),
        el("pre", { className: "json", text: JSON.stringify(d, null, 2) }));
    }
    const rows = job.precision_report || [];
    if (rows.length) {
      const columns = [...new Set(rows.flatMap((r) => Object.keys(r)))];
      out.push(el("h4", { text: "Per layer" }), el("div", { className: "table-wrap" },
        el("table", { className: "report" },
          el("thead", {}, el("tr", {}, ...columns.map((c) => el("th", { text: humanKey(c) })))),
          el("tbody", {}, ...rows.map((r) => el("tr", {}, ...columns.map((c) => el("td", {
            text: r[c] === null || r[c] === undefined ? "–"
              : typeof r[c] === "number" ? fmtInt(r[c]) : String(r[c]),
          }))))))));
    }
    if (!out.length) out.push(el("p", { className: "muted", text: "No precision report yet." }));
    return out;
  }

  function attempts(job) {
    const out = [el("p", {}, `Attempt ${job.attempt} of ${job.max_attempts}` +
      (job.worker_id ? ` · worker ${job.worker_id}` : ""))];
    const errors = job.attempt_errors || [];
    if (!errors.length) {
      out.push(el("p", { className: "muted", text: "No earlier attempt failed." }));
    }
    errors.forEach((e, i) => {
      const text = typeof e === "string" ? e : JSON.stringify(e, null, 2);
      const n = e && typeof e === "object" && e.attempt ? e.attempt : i + 1;
      out.push(el("h4", { text: `Attempt ${n}` }), el("pre", { className: "error", text }));
    });
    return out;
  }

  function humanKey(key) {
    const s = String(key).replace(/_/g, " ");
    return s.charAt(0).toUpperCase() + s.slice(1);
  }

  // ---- State line and actions -------------------------------------------------------------

  /** In the chart area: what a job that is not (or no longer) training is doing. */
  function renderState(job) {
    const box = $("#job-state");
    const parts = [];
    let detail = null;
    if (job.status === "queued") {
      const spot = queueText(job.queue);
      parts.push(el("strong", { text: "Queued" }),
        el("span", { className: "queue-place", text: spot ? `: ${spot}` : "" }),
        ` · waiting for a worker · priority ${job.priority}`);
    } else if (job.status === "failed") {
      // Above charts (steps were recorded) the error keeps to one line, so both charts
      // still fit the screen; the side panel and the log have all of it.
      const brief = job.summary.last_step !== null;
      parts.push(el("strong", { text: "Failed" }),
        ` after attempt ${job.attempt} of ${job.max_attempts}${when(job.finished_at)}`);
      detail = el("pre", { className: "error" + (brief ? " brief" : ""),
        text: job.error || "no error recorded" });
    } else if (job.status === "cancelled") {
      parts.push(el("strong", { text: "Cancelled" }), when(job.finished_at));
    } else if (job.status === "running" && job.cancel_requested) {
      parts.push(el("strong", { text: "Cancelling" }),
        " · the worker was asked to stop this job");
    }
    if (parts.length && job.status !== "queued") {
      const link = el("a", { href: `#job=${job.id}&tab=log`, className: "open-log",
        text: "Open the log" });
      parts.push(" · ", link);
    }
    if (detail) parts.push(detail);
    box.replaceChildren(...parts);
    box.hidden = !parts.length;
    box.className = "job-state" + (parts.length ? ` state-${job.status}` : "");
  }

  /** A queued job's place: "#3, 2 ahead — higher-priority jobs ahead" (the words of the
   * CLI's, service/client/tables.py); "" when it has none (not queued). */
  function queueText(q) {
    if (!q) return "";
    const place = q.position === null || q.position === undefined ? "held back"
      : `#${fmtInt(q.position)}`;
    const why = Object.hasOwn(REASONS, q.reason) ? REASONS[q.reason] : String(q.reason || "");
    return `${place}, ${fmtInt(q.ahead)} ahead` + (why ? ` — ${why}` : "");
  }

  function when(iso) {
    return iso ? ` · ${fmtTime(iso)}` : "";
  }

  /** Whether the viewer may cancel or reprioritize the job: its owner or an admin (the
   * server decides; this only spares others buttons that would be refused). Until /v1/me
   * answers, no; if it cannot answer, yes, and a refusal says why. */
  function mayChange(job) {
    const current = token();
    if (state.viewer.token !== current) {
      state.viewer = { token: current, me: null };
      readViewer(state.viewer);
    }
    const me = state.viewer.me;
    if (me === null) return false;
    return me === "unknown" || me.role === "admin" || me.name === job.owner;
  }

  async function readViewer(viewer) {
    try {
      const me = await (await request("GET", "/v1/me")).json();
      viewer.me = { name: String(me.name), role: String(me.role) };
    } catch (err) {
      if (err && err.status === 401) { // the token prompt is up: ask again with the next
        viewer.token = undefined;
        return;
      }
      viewer.me = "unknown";
    }
    if (state.viewer === viewer && state.job) renderActions(state.job);
  }

  function renderActions(job) {
    const live = !FINAL.includes(job.status);
    const allowed = mayChange(job);
    const cancel = $("#job-cancel");
    cancel.hidden = !allowed || !live || job.cancel_requested;
    const priority = $("#job-priority");
    priority.hidden = !allowed || job.status !== "queued";
    const input = $("#job-priority-value");
    if (document.activeElement !== input && !state.confirming) input.value = job.priority;
    if (!live) hideConfirm();
  }

  function askConfirm(text, onYes) {
    state.confirming = true;
    setText($("#job-confirm-text"), text);
    $("#job-confirm").hidden = false;
    const yes = $("#job-confirm-yes");
    const fresh = yes.cloneNode(true); // drop an earlier question's handler
    yes.replaceWith(fresh);
    fresh.addEventListener("click", async () => {
      hideConfirm();
      await onYes();
    });
    fresh.focus();
  }

  function hideConfirm() {
    state.confirming = false;
    $("#job-confirm").hidden = true;
  }

  async function act(what, method, url, body) {
    const id = state.id;
    setText($("#job-action-note"), `${what}…`);
    try {
      const response = await request(method, url, body);
      const job = await response.json();
      if (state.id !== id) return;
      setText($("#job-action-note"), job.status === "cancelled" ? "Cancelled."
        : what === "cancelling" ? "Cancel requested: the worker stops the job."
          : `Priority is now ${job.priority}.`);
      h.jobChanged(job);
    } catch (err) {
      if (state.id === id) setText($("#job-action-note"), `Not done: ${err.message || err}`);
    }
  }

  function bindActions() {
    $("#job-cancel").addEventListener("click", () => {
      const job = state.job;
      if (!job) return;
      askConfirm(`Cancel job #${job.id} (${job.name})? This cannot be undone.`,
        () => act("cancelling", "POST", `/v1/jobs/${job.id}/cancel`));
    });
    $("#job-priority").addEventListener("submit", (event) => {
      event.preventDefault();
      const job = state.job;
      const value = Number.parseInt($("#job-priority-value").value, 10);
      if (!job || !Number.isInteger(value)) return;
      askConfirm(`Change the priority of job #${job.id} from ${job.priority} to ${value}?`,
        () => act("changing the priority", "PATCH", `/v1/jobs/${job.id}`, { priority: value }));
    });
    $("#job-confirm-no").addEventListener("click", hideConfirm);
  }

  buildTabs();
  bindActions();

  return {
    /** Another job (or none) was selected. */
    select(id) {
      if (id === state.id) return;
      state.id = id;
      state.job = null;
      state.artifactsKey = "";
      stopLog();
      hideConfirm();
      setText($("#job-action-note"), "");
      $("#job-state").hidden = true;
      $("#job-panel").replaceChildren();
    },
    tab: showTab,
    queueText,
    /** The selected job as last read (polled or streamed). */
    job(job) {
      if (job.id !== state.id) return;
      state.job = job;
      renderState(job);
      renderActions(job);
      render();
    },
  };
}

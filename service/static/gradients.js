/* Halfway dashboard: the selected job's gradient samples and its precision decision. An ES
 * module, no build step; app.js calls HalfwayGradients(helpers) once and then tells the
 * returned object of each selection (select), each change of the selected job (job) and each
 * zoom of its charts (zoom).
 *
 * - The band: underflow share and lost share (from the float32 shadow, so only at shadow
 *   samples) and headroom (every sample), beside the loss-scale chart and on its x axis.
 * - Clicking a sample in the band (or stepping with the arrows) shows each variable's figures
 *   at that sample: that one sample is read with its variables, never the whole run's.
 * - Cheap for pollers: only the selected job's samples are read, only when the job says it has
 *   newer ones than held (its gradients.latest), model level only (format=columns) and after a
 *   cursor (after_step). When history_version moves (a resume rewrote the run from its
 *   checkpoint on) everything held is dropped and read again.
 * - As in the other modules, names and reasons reach the page only as text, never as markup.
 */
const PAGE_LIMIT = 5000; // samples per request of the band's columns (model level only)
const MAX_PAGES = 20; // per update, so one update never holds the page for long
const ORANGE = "#d4750b";
const RED = "#d1242f";
const TEAL = "#0f7b8a";
const INK = "#1f2328";
const FIGURES = ["zero_share", "log2_max", "log2_min_nonzero", "headroom", "subnormal_share",
  "underflow_share", "lost_share", "relative_error"];
const MODEL = "(model)";

// ---- Formatting (the same rules as the CLI's service/client/gradient_tables.py) ----------

function fmtShare(v) {
  if (v === null || v === undefined || !Number.isFinite(v)) return "–";
  if (v === 0 || v === 1) return `${v * 100}%`;
  const pct = v * 100;
  if (pct < 0.01) return "<0.01%";
  if (pct > 99.99) return ">99.99%";
  return `${Number(pct.toPrecision(3))}%`;
}

function fmtHeadroom(v) {
  if (v === null || v === undefined || !Number.isFinite(v)) return "–";
  const text = v.toFixed(1);
  return `${text} doubling${text === "1.0" ? "" : "s"}`;
}

function fmtError(v) {
  if (v === null || v === undefined || !Number.isFinite(v)) return "–";
  return String(Number(v.toPrecision(3)));
}

export function HalfwayGradients(h) {
  const { api, oneAtATime, el, setText, fmtInt, fmtNumber, fmtScale, chartWidth } = h;
  const $ = (selector) => document.querySelector(selector);

  /** 2 with the exponent raised: a log2 magnitude as the power of two it is. */
  function log2Node(v) {
    if (v === null || v === undefined || !Number.isFinite(v)) return "–";
    // toFixed rounds half away from zero, as the CLI does: both print the same power.
    const k = Number(v.toFixed(1));
    return el("span", { className: "pow2" }, "2", el("sup", { text: String(k) }));
  }

  // ---- State of the selected job's samples ------------------------------------------------

  const state = {
    id: null,
    version: null, // the history_version the samples held belong to
    cursor: -1, // the last sampled step held
    cols: null,
    wanted: -1, // the newest sample the job has told of
    lastStep: 0, // the job's last recorded step: the band spans what the loss chart does
    busy: false,
    again: false,
    charts: [], // the shares' and the headroom's, once there is a sample to draw
    view: null, // the charts' zoom {from, to}, or null
    picked: null, // the step whose variables are shown
    decision: "", // the decision last drawn, as JSON
  };

  function emptyColumns() {
    const cols = { step: [], loss_scale: [], shadow: [], finite: [] };
    for (const name of FIGURES) cols[name] = [];
    return cols;
  }

  /** Another job was selected. None (the job panel is hidden), or the same one again: what
   * is held stays, since the page redraws a job it polls only once it changes. */
  function select(id) {
    if (id === null || id === state.id) return;
    for (const chart of state.charts) chart.destroy();
    Object.assign(state, { id, version: null, cursor: -1, cols: emptyColumns(), wanted: -1,
      lastStep: 0, charts: [], view: null, picked: null, decision: "" });
    $("#gradients").hidden = true;
    $("#job-decision").hidden = true;
    $("#gradient-chart").replaceChildren();
    $("#headroom-chart").replaceChildren();
    $("#gradient-layers").replaceChildren();
    delete $("#gradient-chart").dataset.points;
  }

  /** The selected job changed (polled or streamed): its decision, and new samples if it
   * has some the band lacks. */
  function job(j) {
    if (j.id !== state.id) return;
    renderDecision(j.precision_decision);
    state.lastStep = Math.max(0, j.summary.last_step ?? 0);
    if (state.version !== null && j.history_version !== state.version) startOver(j.history_version);
    if (state.version === null) state.version = j.history_version;
    const latest = j.gradients && j.gradients.latest;
    state.wanted = latest ? latest.step : -1;
    if (state.wanted > state.cursor) update();
    else if (state.cols.step.length) draw(); // the x range follows the run
  }

  function zoom(view) {
    state.view = view;
    if (state.charts.length) draw();
  }

  /** A resume rewrote the run from its checkpoint on: drop every sample held. */
  function startOver(version) {
    state.version = version;
    state.cursor = -1;
    state.cols = emptyColumns();
    state.picked = null;
    $("#gradient-layers").replaceChildren();
  }

  /** Read the samples after the cursor (one read at a time, see oneAtATime). */
  const update = oneAtATime(
    state,
    async (id) => {
      await pull(id);
      if (id === state.id) draw();
    },
    (err) => {
      setText($("#gradient-caption"), `gradient samples could not be read: ${err.message}`);
      console.warn("gradient samples", err);
    },
  );

  async function pull(id) {
    for (let page = 0; page < MAX_PAGES && state.cursor < state.wanted; page++) {
      const url = `/v1/jobs/${id}/gradients?format=columns&after_step=${state.cursor}` +
        `&limit=${PAGE_LIMIT}`;
      const { body } = await api(url, "gradients");
      if (id !== state.id) return;
      if (body.history_version < state.version) return; // a lagging answer: ask again later
      if (body.history_version !== state.version) {
        startOver(body.history_version);
        continue; // read again from the start
      }
      const cols = body.columns;
      const n = cols.step.length;
      for (const [name, column] of Object.entries(state.cols)) {
        const got = cols[name] || [];
        for (let i = 0; i < n; i++) column.push(got[i] ?? null);
      }
      if (n) state.cursor = cols.step[n - 1];
      const next = body.next_after_step;
      if (next !== undefined ? next === null : n < PAGE_LIMIT) return;
      if (next !== undefined && next !== null) state.cursor = Math.max(state.cursor, next);
      if (!n) return;
    }
  }

  // ---- The band ----------------------------------------------------------------------------
  //
  // Two charts, each with one left axis as wide as the loss charts' (64 px), so that a step
  // sits at the same x in all four: shares (0-100 %) and headroom (doublings) have no common
  // axis, and a right-hand axis would narrow this plot against the ones above.

  function chartOptions(node, height, yScale, yValues, series) {
    return {
      width: chartWidth(node),
      height,
      scales: { x: { time: false, range: () => xRange() }, [yScale.key]: yScale.opts },
      axes: [
        { values: (u, splits) => splits.map((v) => (Number.isInteger(v) ? fmtInt(v) : "")) },
        { scale: yScale.key, size: 64, values: (u, splits) => splits.map(yValues) },
      ],
      series: [{ label: "step", value: (u, v) => fmtInt(v) },
        ...series.map((one) => ({ scale: yScale.key, width: 1.5, spanGaps: true, ...one }))],
      legend: { live: true },
      // The same cursor as the loss and loss-scale charts; no drag here: a click picks.
      cursor: { sync: { key: "job" }, drag: { x: false, y: false } },
    };
  }

  function build() {
    const shares = $("#gradient-chart");
    const headroom = $("#headroom-chart");
    const shadowPoints = (color) => ({ show: true, size: 5, fill: color });
    const share = { key: "share",
      opts: { range: (u, min, max) => [0, Math.min(1, Math.max(0.01, (max || 0) * 1.15))] } };
    const doublings = { key: "doublings", opts: { auto: true } };
    shares.replaceChildren();
    headroom.replaceChildren();
    state.charts = [
      new uPlot(chartOptions(shares, 140, share, fmtShare, [
        { label: "underflow share", stroke: ORANGE, value: (u, v) => fmtShare(v),
          points: shadowPoints(ORANGE) },
        { label: "lost share", stroke: RED, value: (u, v) => fmtShare(v),
          points: shadowPoints(RED) },
      ]), [[], [], []], shares),
      new uPlot(chartOptions(headroom, 120, doublings, fmtNumber, [
        { label: "headroom", stroke: TEAL, value: (u, v) => fmtHeadroom(v),
          points: { show: false } },
        // A ring, no line: the sample whose variables the table shows.
        { label: "picked", stroke: INK, paths: () => null, spanGaps: false,
          points: { show: true, space: 0, size: 11, width: 2, stroke: INK, fill: "#0000" },
          value: (u, v) => (v === null || v === undefined ? "" : "the table's sample") },
      ]), [[], [], []], headroom),
    ];
    for (const chart of state.charts) {
      chart.over.addEventListener("click", () => {
        const idx = chart.cursor.idx;
        if (idx !== null && idx !== undefined) pick(state.cols.step[idx]);
      });
    }
  }

  new ResizeObserver(() => {
    for (const chart of state.charts) {
      const width = chartWidth(chart.root.parentNode);
      if (Math.abs(chart.width - width) > 2) chart.setSize({ width, height: chart.height });
    }
  }).observe($("#gradient-chart"));

  /** The loss chart's span: from the first step to the job's last (or the zoom). */
  function xRange() {
    if (state.view) return [state.view.from, state.view.to];
    const steps = state.cols.step;
    const last = Math.max(state.lastStep, steps.length ? steps[steps.length - 1] : 0);
    return [0, Math.max(last, 1)];
  }

  function draw() {
    const cols = state.cols;
    const n = cols.step.length;
    $("#gradients").hidden = n === 0;
    if (!n) return;
    if (!state.charts.length) build();
    // A share where the shadow did not run is a gap; spanGaps joins the shadow's points.
    const shadowOnly = (name) => cols[name].map((v, i) => (cols.shadow[i] ? v : null));
    const [shares, headroom] = state.charts;
    shares.setData([cols.step, shadowOnly("underflow_share"), shadowOnly("lost_share")]);
    const picked = cols.step.map((step, i) => (step === state.picked ? cols.headroom[i] ?? 0
      : null));
    headroom.setData([cols.step, cols.headroom, picked]);
    const shadows = cols.shadow.filter(Boolean).length;
    Object.assign($("#gradient-chart").dataset, {
      points: String(n),
      shadowPoints: String(shadows),
      lastStep: String(cols.step[n - 1]),
      historyVersion: String(state.version),
      picked: state.picked === null ? "" : String(state.picked),
    });
    const last = n - 1;
    setText($("#gradient-caption"), `${fmtInt(n)} samples (${fmtInt(shadows)} with the ` +
      `float32 shadow) · latest at step ${fmtInt(cols.step[last])}: headroom ` +
      `${fmtHeadroom(cols.headroom[last])}` +
      (state.picked === null ? " · click a sample for each layer's figures" : ""));
  }

  // ---- One sample, per variable --------------------------------------------------------------

  /** Show each variable's figures at `step`: that one sample is read with its variables. */
  async function pick(step) {
    if (step === undefined || step === null) return;
    state.picked = step;
    const id = state.id;
    const version = state.version;
    const holder = $("#gradient-layers");
    holder.dataset.loading = String(step);
    let sample;
    try {
      const url = `/v1/jobs/${id}/gradients?after_step=${step - 1}&limit=1`;
      const { body } = await api(url, "gradient-sample");
      sample = body.samples.find((s) => s.step === step);
    } catch (err) {
      if (id === state.id) setText(holder, `could not read the sample: ${err.message}`);
      return;
    }
    if (id !== state.id || version !== state.version || state.picked !== step) return;
    delete holder.dataset.loading;
    if (!sample) {
      holder.replaceChildren(el("p", { className: "hint",
        text: `No sample at step ${fmtInt(step)} any more (the run was rewritten).` }));
      return;
    }
    holder.replaceChildren(pickerBar(step), layerTable(sample));
    draw();
  }

  /** The picked step with buttons to the samples before and after it. */
  function pickerBar(step) {
    const steps = state.cols.step;
    const i = steps.indexOf(step);
    const prev = el("button", { type: "button", className: "prev", text: "‹ earlier",
      disabled: i <= 0 });
    const next = el("button", { type: "button", className: "next", text: "later ›",
      disabled: i < 0 || i >= steps.length - 1 });
    prev.addEventListener("click", () => pick(steps[i - 1]));
    next.addEventListener("click", () => pick(steps[i + 1]));
    return el("div", { className: "gradient-picker" }, prev,
      el("span", { text: ` step ${fmtInt(step)} ` }), next);
  }

  function layerTable(sample) {
    const shadow = !!sample.shadow;
    const columns = [
      ["zero", "zero_share", fmtShare],
      ["max |G|", "log2_max", log2Node],
      ["min nonzero", "log2_min_nonzero", log2Node],
      ["headroom", "headroom", fmtHeadroom],
      ["subnormal", "subnormal_share", fmtShare],
      ...(shadow ? [["underflow", "underflow_share", fmtShare], ["lost", "lost_share", fmtShare],
        ["rel. error", "relative_error", fmtError]] : []),
    ];
    const head = el("tr", {}, el("th", { scope: "col", text: "variable" }),
      ...columns.map(([label]) => el("th", { scope: "col", className: "num", text: label })));
    const rows = [{ ...sample, name: MODEL }, ...(sample.variables || [])].map((v) => {
      const row = el("tr", { className: v.finite === false ? "overflow" : "" },
        el("td", { className: "variable", text: v.name }),
        ...columns.map(([, key, fmt]) => el("td", { className: "num " + key }, fmt(v[key]))));
      row.dataset.variable = v.name;
      return row;
    });
    const kind = shadow ? "with the float32 shadow" : "no float32 shadow at this step";
    const caption = el("caption", {
      text: `Each variable at step ${fmtInt(sample.step)} · loss scale ` +
        `${fmtScale(sample.loss_scale)} · ${kind}`,
    });
    const table = el("table", { className: "layers" }, caption, el("thead", {}, head),
      el("tbody", {}, ...rows));
    table.dataset.step = String(sample.step);
    return el("div", { className: "table-wrap" }, table);
  }

  // ---- The precision decision ------------------------------------------------------------------

  function renderDecision(decision) {
    const key = JSON.stringify(decision || null);
    if (key === state.decision) return;
    state.decision = key;
    const holder = $("#job-decision");
    holder.hidden = !decision;
    if (!decision) {
      holder.replaceChildren();
      return;
    }
    const head = el("tr", {}, ...["policy", "ms/step", "mean loss", "loss gap", "overflows",
      "underflow", "lost", "eligible", "why"].map((label) =>
      el("th", { scope: "col", className: label === "policy" || label === "why" ? "" : "num",
        text: label })));
    const rows = (decision.probes || []).map((p) => {
      const row = el("tr", { className: p.policy === decision.policy ? "chosen" : "" },
        el("td", { className: "policy", text: p.policy }),
        el("td", { className: "num", text: p.median_step_seconds === null ||
          p.median_step_seconds === undefined ? "–" : (p.median_step_seconds * 1000).toFixed(2) }),
        el("td", { className: "num", text: fmtNumber(p.mean_loss) }),
        el("td", { className: "num", text: fmtError(p.loss_gap) }),
        el("td", { className: "num",
          text: `${fmtInt(p.overflow_steps)}${p.steps === undefined ? "" : " / " + fmtInt(p.steps)}` }),
        el("td", { className: "num", text: fmtShare(p.underflow_share) }),
        el("td", { className: "num", text: fmtShare(p.lost_share) }),
        el("td", { className: "eligible", text: p.eligible ? "yes" : "no" }),
        el("td", { className: "why", text: p.why || "" }));
      row.dataset.policy = p.policy;
      return row;
    });
    holder.replaceChildren(
      el("h3", { text: "Precision decision" }),
      el("p", { className: "decision" }, "policy auto chose ",
        el("strong", { className: "chosen-policy", text: decision.policy }), ": ",
        el("span", { className: "reason", text: decision.reason || "" })),
      el("div", { className: "table-wrap" }, el("table", { className: "probes" },
        el("thead", {}, head), el("tbody", {}, ...rows))));
  }

  return { select, job, zoom };
}

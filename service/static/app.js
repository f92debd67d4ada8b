/* Halfway dashboard. Plain JavaScript, no build step; charts are uPlot (vendored).
 *
 * Rules this file keeps:
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
(function () {
  "use strict";

  // ---- Settings. Query parameters exist so tests (and the curious) can tune them. ----------

  const params = new URLSearchParams(location.search);
  const CONFIG = {
    pollMs: intParam("poll_ms", 2000, 100, 60000),
    // Beyond this many steps a job is drawn from buckets: raw rows would be megabytes of JSON
    // and far more points than the chart has pixels.
    bucketThreshold: intParam("bucket_threshold", 20000, 1, 100000000),
    // A running long job's buckets are re-read once it has advanced by a bucket's width (until
    // then only the last bucket moved), and at least this often.
    bucketRefreshMs: 10000,
    // Raw rows come as columns (history?format=columns, the shape uPlot takes): one page
    // holds every row a raw chart ever shows.
    rawPageLimit: 50000,
    jobListLimit: 100,
    maxCompare: 10,
    // ?stream=0 polls the selected job as the page did before it listened (and keeps that
    // path testable).
    stream: params.get("stream") !== "0",
    // After falling back to polling, try the stream again this much later.
    streamRetryMs: intParam("stream_retry_ms", 60000, 1000, 3600000),
    streamFailures: 3, // failures in a row before falling back to polling
    streamBackoffMs: 1000, // before the first reconnect; doubles for each failure after it
    // The server sends the job as soon as a stream opens and a keepalive every 15 s; silence
    // beyond these means something in between holds the stream back (a buffering proxy).
    streamFirstEventMs: 10000,
    streamQuietMs: 45000,
  };
  const TOKEN_KEY = "halfway.token";
  // Job statuses come from the server (GET /v1/vocabulary), defined once in service/vocabulary.py.
  let STATUSES = [];
  const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b",
    "#e377c2", "#17becf", "#bcbd22", "#7f7f7f", "#d62728"];
  const BLUE = "#1f6feb";
  const GREEN = "#2da44e";
  const RED = "#d1242f";

  function intParam(name, fallback, min, max) {
    const value = Number.parseInt(params.get(name) || "", 10);
    return Number.isFinite(value) ? Math.min(max, Math.max(min, value)) : fallback;
  }

  // ---- Small DOM helpers --------------------------------------------------------------------

  const $ = (selector) => document.querySelector(selector);

  /** Create an element. Strings among the children become text nodes, never markup. */
  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (key === "text") node.textContent = value;
      else if (key === "dataset") Object.assign(node.dataset, value);
      else node[key] = value;
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(typeof child === "string" ? document.createTextNode(child) : child);
    }
    return node;
  }

  function setText(node, text) {
    if (node.textContent !== text) node.textContent = text;
  }

  // ---- Formatting ---------------------------------------------------------------------------

  const intFormat = new Intl.NumberFormat("en-US");
  // Four significant digits, so neighbouring ticks of a zoomed axis (30.5K, 31K) stay distinct.
  const compactFormat = new Intl.NumberFormat("en-US",
    { notation: "compact", maximumSignificantDigits: 4 });
  const SUPERSCRIPT = { "-": "⁻", 0: "⁰", 1: "¹", 2: "²", 3: "³", 4: "⁴",
    5: "⁵", 6: "⁶", 7: "⁷", 8: "⁸", 9: "⁹" };

  function fmtInt(n) {
    return n === null || n === undefined ? "–" : intFormat.format(n);
  }

  function fmtNumber(v) {
    if (v === null || v === undefined || !Number.isFinite(v)) return "–";
    return String(Number(v.toPrecision(5)));
  }

  const humanFormat = new Intl.NumberFormat("en-US", { maximumSignificantDigits: 5 });
  const NBSP = "\u00a0"; // between a number and its unit: the two never part at a line end

  /** A number for people: five significant digits with thousands separators (21,000.25 ->
   * "21,000"), tiny ones in exponent form. */
  function fmtHuman(v) {
    if (v === null || v === undefined || !Number.isFinite(v)) return "–";
    if (v !== 0 && Math.abs(v) < 1e-4) return v.toExponential(3);
    return humanFormat.format(v);
  }

  function fmtSeconds(v) {
    if (v === null || v === undefined || !Number.isFinite(v)) return "–";
    if (Math.abs(v) < 1) return fmtHuman(v * 1000) + NBSP + "ms";
    if (Math.abs(v) < 120) return fmtHuman(v) + NBSP + "s";
    if (Math.abs(v) < 7200) return fmtHuman(v / 60) + NBSP + "min";
    return fmtHuman(v / 3600) + NBSP + "h";
  }

  function powerOfTwo(v) {
    if (!(v > 0)) return null;
    const k = Math.log2(v);
    return Number.isInteger(k) ? k : null;
  }

  function sup(k) {
    return String(k).split("").map((c) => SUPERSCRIPT[c] || c).join("");
  }

  /** Loss scales are powers of two almost always; 2¹⁵ reads better than 32768 alone. */
  function fmtScale(v) {
    if (v === null || v === undefined) return "–";
    const exact = Number.isInteger(v) ? String(v) : fmtNumber(v); // 524288, not 524290
    const k = powerOfTwo(v);
    return k === null ? exact : `${exact} (2${sup(k)})`;
  }

  // Axis labels: uPlot passes null for the ticks it leaves unlabelled.
  function fmtScaleTick(v) {
    if (v === null || v === undefined) return "";
    const k = powerOfTwo(v);
    return k === null ? fmtNumber(v) : `2${sup(k)}`;
  }

  function fmtLossTick(v) {
    return v === null || v === undefined ? "" : fmtNumber(v);
  }

  function fmtStepTick(v) {
    return Number.isInteger(v) ? compactFormat.format(v) : "";
  }

  function fmtLoss(value, flag) {
    if (flag) return flag; // "nan", "inf", "-inf": JSON has no non-finite numbers
    return fmtNumber(value);
  }

  function stepsEach(width) {
    return width === 1 ? "1 step" : `${fmtInt(width)} steps`;
  }

  function fmtTime(iso) {
    return iso ? new Date(iso).toLocaleString() : "–";
  }

  // ---- Token ---------------------------------------------------------------------------------

  /** `halfway serve` prints /?token=...; keep it in localStorage and out of the address bar,
   * the history and bookmarks. A #token= fragment works too (it never reaches server logs). */
  function takeTokenFromUrl() {
    const url = new URL(location.href);
    const fragment = new URLSearchParams(url.hash.slice(1));
    const token = url.searchParams.get("token") || fragment.get("token");
    if (!token) return;
    localStorage.setItem(TOKEN_KEY, token.trim());
    url.searchParams.delete("token");
    fragment.delete("token");
    const rest = fragment.toString();
    history.replaceState(null, "", url.pathname + url.search + (rest ? "#" + rest : ""));
  }

  function storedToken() {
    return localStorage.getItem(TOKEN_KEY);
  }

  function askForToken(message) {
    stopPolling();
    pauseStream();
    $("#app").hidden = true;
    $("#forget-token").hidden = true;
    $("#auth").hidden = false;
    setText($("#auth-message"), message);
    setLive("auth", "waiting for a token");
    const input = $("#auth-token");
    input.value = "";
    input.focus();
  }

  function onTokenSubmit(event) {
    event.preventDefault();
    const token = $("#auth-token").value.trim();
    if (!token) return;
    localStorage.setItem(TOKEN_KEY, token);
    etags.clear();
    $("#auth").hidden = true;
    startPolling();
  }

  function forgetToken() {
    localStorage.removeItem(TOKEN_KEY);
    etags.clear();
    askForToken("Token forgotten. Paste a token to continue.");
  }

  // ---- API -----------------------------------------------------------------------------------

  class HttpError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  // slot -> {url, etag, body}: one remembered response per polled resource, so the map stays
  // small while cursors advance.
  const etags = new Map();

  async function errorMessage(response) {
    try {
      const body = await response.json();
      return body.message || response.statusText;
    } catch {
      return response.statusText;
    }
  }

  /** GET a JSON resource. With a slot, send If-None-Match for the slot's last ETag and
   * answer a 304 from memory. Returns {body, changed}. */
  async function api(url, slot) {
    const headers = { Accept: "application/json" };
    const token = storedToken();
    if (token) headers.Authorization = "Bearer " + token;
    const cached = slot ? etags.get(slot) : undefined;
    if (cached && cached.url === url) headers["If-None-Match"] = cached.etag;
    // no-store: we make the conditional requests ourselves and want to see the 304.
    const response = await fetch(url, { headers, cache: "no-store" });
    if (response.status === 304 && cached) return { body: cached.body, changed: false };
    if (!response.ok) throw new HttpError(response.status, await errorMessage(response));
    const body = await response.json();
    const etag = response.headers.get("ETag");
    if (slot && etag) etags.set(slot, { url, etag, body });
    else if (slot) etags.delete(slot);
    return { body, changed: true };
  }

  /** Any request with the token (the panels' log and artifacts, cancel, priority): the
   * Response, or an HttpError carrying the server's message. */
  async function request(method, url, body) {
    const headers = {};
    const token = storedToken();
    if (token) headers.Authorization = "Bearer " + token;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const response = await fetch(url, { method, headers, cache: "no-store",
      body: body === undefined ? undefined : JSON.stringify(body) });
    if (!response.ok) {
      const err = new HttpError(response.status, await errorMessage(response));
      if (response.status === 401) tokenRefused(err);
      throw err;
    }
    return response;
  }

  // ---- Polling -------------------------------------------------------------------------------

  const poll = { on: false, timer: null, busy: false, again: false };

  function startPolling() {
    poll.on = true;
    kick();
  }

  function stopPolling() {
    poll.on = false;
    clearTimeout(poll.timer);
    poll.timer = null;
  }

  /** Refresh now (a click, the tab becoming visible) without ever running two refreshes at
   * once: an overlapping one would move the history cursor twice. */
  function kick() {
    if (!poll.on) return;
    if (poll.busy) {
      poll.again = true;
      return;
    }
    clearTimeout(poll.timer);
    tick();
  }

  async function tick() {
    poll.timer = null;
    if (document.hidden) {
      setLive("paused", "paused while the tab is hidden");
      return; // visibilitychange kicks us again
    }
    poll.busy = true;
    try {
      await refresh();
      setLive("live", `${liveDetail()} · updated ${new Date().toLocaleTimeString()}`);
    } catch (err) {
      if (err instanceof HttpError && err.status === 401) {
        tokenRefused(err);
      } else {
        setLive("error", String(err.message || err));
        console.warn("refresh failed", err);
      }
    } finally {
      poll.busy = false;
    }
    if (!poll.on) return;
    if (poll.again) {
      poll.again = false;
      kick();
    } else {
      poll.timer = setTimeout(tick, CONFIG.pollMs);
    }
  }

  function tokenRefused(err) {
    askForToken(storedToken()
      ? `The server refused the token (${err.message}). Paste a valid token.`
      : "This server needs an API token.");
  }

  async function refresh() {
    if (!STATUSES.length) STATUSES = (await api("/v1/vocabulary")).body.job_statuses;
    // The list and the comparison are polled even while the selected job streams: they are
    // cheap for the server (cached, 304s) and cover jobs nobody streams.
    await refreshJobs();
    if (selection.hist) await refreshSelection(selection.hist);
    if (comparison.ids.length >= 2) await refreshCompare();
  }

  /** How the selected job is kept current: "streaming" or "polling". */
  function transport() {
    return streamServes(selection.hist) ? "streaming" : "polling";
  }

  /** The live indicator's tooltip: how, and when polling instead of listening, why. */
  function liveDetail() {
    if (stream.hist !== selection.hist) return transport();
    if (stream.state === "ended") return "streamed until the job ended";
    if (stream.state !== "fallback") return transport();
    const retry = new Date(stream.retryAt).toLocaleTimeString();
    return `polling (the event stream failed: ${stream.why}; trying it again at ${retry})`;
  }

  function setLive(state, detail) {
    const live = $("#live");
    live.dataset.state = state;
    live.dataset.transport = transport() === "streaming" ? "stream" : "poll";
    setText(live, { live: "live", paused: "paused", error: "error", auth: "no token" }[state]);
    live.title = detail || "";
  }

  // ---- Job list ------------------------------------------------------------------------------

  const jobRows = new Map(); // job id -> <tr>, updated in place so checkboxes keep their state
  let jobsById = new Map();

  async function refreshJobs() {
    const { body, changed } = await api(`/v1/jobs?limit=${CONFIG.jobListLimit}`, "jobs");
    $("#app").hidden = false;
    $("#forget-token").hidden = !storedToken();
    if (!changed) return;
    jobsById = new Map(body.items.map((job) => [job.id, job]));
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
      el("td", { className: "status-cell" }, el("span", { className: "status" })),
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

  function renderStatus(node, status) {
    setText(node, status);
    // Only known statuses become class names; the text itself is set as text.
    node.className = "status" + (STATUSES.includes(status) ? " status-" + status : "");
  }

  // ---- Charts --------------------------------------------------------------------------------

  /** Only positive values can sit on a log axis; anything else is a gap. */
  function positive(v) {
    return v !== null && v !== undefined && v > 0 && Number.isFinite(v) ? v : null;
  }

  function chartWidth(node) {
    return Math.max(300, Math.floor(node.getBoundingClientRect().width) || 600);
  }

  /** Buckets to ask for: one per horizontal pixel of the chart. */
  function bucketPoints(node) {
    return Math.min(5000, Math.max(50, chartWidth(node) - 70));
  }

  const lossValue = (u, v) => fmtNumber(v);
  const scaleValue = (u, v) => fmtScale(v);

  function lineSeries(label, color, extra) {
    return { label, stroke: color, width: 1.5, points: { show: false }, value: lossValue,
      ...extra };
  }

  function edgeSeries(label, color, extra) {
    // min/max edges of a band: faint lines so a lone spike still shows as a line.
    return { label, stroke: color + "80", width: 1, points: { show: false }, class: "edge",
      value: lossValue, ...extra };
  }

  function markerSeries(label, valueText) {
    // No line, just red points: the steps (or buckets) with an overflow.
    return {
      label,
      stroke: RED,
      fill: RED,
      width: 0,
      paths: () => null,
      points: { show: true, space: 0, size: 7, width: 1, stroke: "#fff", fill: RED },
      value: (u, v) => (v === null || v === undefined ? "" : valueText),
      class: "marker",
    };
  }

  /** A loss chart and a loss-scale chart over the same steps, with one shared zoom. Dragging
   * across either calls onZoom({from, to}); a double-click calls onZoom(null). */
  class ChartPair {
    constructor(lossNode, scaleNode, syncKey, onZoom) {
      this.nodes = [lossNode, scaleNode];
      this.syncKey = syncKey;
      this.onZoom = onZoom;
      this.charts = [];
      this.view = null;
      this.pendingZoom = undefined;
      this.resize = new ResizeObserver(() => this.fit());
      this.resize.observe(lossNode);
    }

    build(loss, scale) {
      this.destroy();
      this.charts = [
        // Heights chosen so both charts fit a 1400x900 screen under the job list.
        this.make(this.nodes[0], loss, "loss", 10, fmtLossTick, 200),
        this.make(this.nodes[1], scale, "scale", 2, fmtScaleTick, 150),
      ];
    }

    make(node, { series, bands }, scaleKey, logBase, tick, height) {
      node.replaceChildren();
      const opts = {
        width: chartWidth(node),
        height,
        scales: { x: { time: false }, [scaleKey]: { distr: 3, log: logBase } },
        axes: [
          { label: "step", labelSize: 14, labelGap: 0, labelFont: "12px system-ui, sans-serif",
            size: 34, values: (u, splits) => splits.map(fmtStepTick) },
          { scale: scaleKey, size: 64, values: (u, splits) => splits.map(tick) },
        ],
        series: [{ label: "step", value: (u, v) => fmtInt(v) },
          ...series.map((s) => ({ scale: scaleKey, ...s }))],
        bands: bands || [],
        legend: { live: true },
        cursor: {
          sync: { key: this.syncKey },
          drag: { x: true, y: false, setScale: false },
          // Our own double-click handler resets the zoom, also when it must re-query.
          bind: { dblclick: () => null },
        },
        hooks: { setSelect: [(u) => this.selected(u)] },
      };
      node.dataset.xLabel = opts.axes[0].label; // drawn on the canvas; the tests read it here
      const empty = [[], ...series.map(() => [])];
      const chart = new uPlot(opts, empty, node);
      chart.over.addEventListener("dblclick", () => this.zoom(null));
      return chart;
    }

    selected(u) {
      if (u.select.width < 3) return;
      const from = Math.max(0, Math.floor(u.posToVal(u.select.left, "x")));
      const to = Math.ceil(u.posToVal(u.select.left + u.select.width, "x"));
      u.setSelect({ left: 0, top: 0, width: 0, height: 0 }, false);
      this.zoom(to > from ? { from, to } : null);
    }

    zoom(view) {
      // Both charts of a synced pair may report the same drag; apply it once.
      const first = this.pendingZoom === undefined;
      this.pendingZoom = view;
      if (!first) return;
      setTimeout(() => {
        const next = this.pendingZoom;
        this.pendingZoom = undefined;
        if (JSON.stringify(next) === JSON.stringify(this.view)) return;
        this.view = next;
        this.onZoom(next);
      }, 0);
    }

    setData(lossData, scaleData) {
      [lossData, scaleData].forEach((data, i) => {
        const chart = this.charts[i];
        if (!chart) return;
        chart.batch(() => {
          chart.setData(data, true);
          if (this.view) chart.setScale("x", { min: this.view.from, max: this.view.to });
        });
      });
    }

    fit() {
      this.charts.forEach((chart, i) => {
        const width = chartWidth(this.nodes[i]);
        if (Math.abs(chart.width - width) > 2) chart.setSize({ width, height: chart.height });
      });
    }

    destroy() {
      this.charts.forEach((chart) => chart.destroy());
      this.charts = [];
    }
  }

  /** Series for one job in raw mode (one point per step). */
  function rawLayout() {
    return {
      loss: { series: [lineSeries("loss", BLUE), markerSeries("overflow", "overflow")] },
      scale: {
        series: [
          lineSeries("loss scale", GREEN, { paths: uPlot.paths.stepped({ align: 1 }),
            value: scaleValue }),
          markerSeries("overflow", "overflow"),
        ],
      },
    };
  }

  /** Series for one job (or several, for the comparison) drawn from buckets: last value as the
   * line, a band between min and max so spikes are not averaged away, and red markers. */
  function bucketLayout(jobs) {
    const loss = { series: [], bands: [] };
    const scale = { series: [], bands: [] };
    const stepped = { paths: uPlot.paths.stepped({ align: 1 }), value: scaleValue };
    for (const { label, color } of jobs) {
      // One job: plain legend names. Several: each prefixed with its job.
      const name = (alone, suffix) => (label ? `${label} ${suffix}` : alone);
      const base = loss.series.length + 1; // +1: series 0 is x
      loss.series.push(lineSeries(name("loss (last)", "loss"), color),
        edgeSeries(name("min", "min"), color),
        edgeSeries(name("max", "max"), color),
        markerSeries(name("overflow", "overflow"), "overflow in bucket"));
      scale.series.push(lineSeries(name("loss scale (last)", "scale"), color, stepped),
        edgeSeries(name("min", "min"), color, stepped),
        edgeSeries(name("max", "max"), color, stepped),
        markerSeries(name("overflow", "overflow"), "overflow in bucket"));
      const band = { series: [base + 2, base + 1], fill: color + "33" }; // max over min
      loss.bands.push(band);
      scale.bands.push({ ...band });
    }
    return { loss, scale };
  }


  /** Chart columns from raw rows. An overflow step whose loss is NaN/inf still gets its
   * marker, drawn at the last finite loss before it. */
  function rawColumns(raw) {
    const n = raw.steps.length;
    const loss = new Array(n);
    const lossMarks = new Array(n);
    const scale = new Array(n);
    const scaleMarks = new Array(n);
    let lastLoss = null;
    let marks = 0;
    for (let i = 0; i < n; i++) {
      loss[i] = positive(raw.loss[i]);
      if (loss[i] !== null) lastLoss = loss[i];
      scale[i] = positive(raw.scale[i]);
      const overflow = !raw.finite[i];
      lossMarks[i] = overflow ? loss[i] ?? lastLoss ?? firstValue(raw.loss) : null;
      scaleMarks[i] = overflow ? scale[i] ?? 1 : null;
      if (overflow) marks++;
    }
    return {
      loss: [raw.steps, loss, lossMarks],
      scale: [raw.steps, scale, scaleMarks],
      markers: marks,
      overflowSteps: marks,
    };
  }

  function firstValue(values) {
    for (const v of values) if (positive(v) !== null) return v;
    return 1;
  }

  /** Columns for buckets of several jobs on one shared x grid (a comparison), or of one. */
  function bucketColumns(xs, perJob) {
    const loss = [xs];
    const scale = [xs];
    let markers = 0;
    let overflowSteps = 0;
    for (const byX of perJob) {
      const cols = [[], [], [], [], [], [], [], []];
      let lastLoss = null;
      for (const x of xs) {
        const b = byX.get(x);
        const last = b ? positive(b.loss_last) : null;
        const lo = b ? positive(b.loss_min) : null;
        const hi = b ? positive(b.loss_max) : null;
        lastLoss = hi ?? last ?? lastLoss;
        const overflow = b && b.overflow_count > 0;
        cols[0].push(last);
        cols[1].push(lo);
        cols[2].push(hi);
        cols[3].push(overflow ? hi ?? last ?? lastLoss ?? 1 : null);
        cols[4].push(b ? positive(b.scale_last) : null);
        cols[5].push(b ? positive(b.scale_min) : null);
        cols[6].push(b ? positive(b.scale_max) : null);
        cols[7].push(overflow ? positive(b.scale_max) ?? 1 : null);
        if (overflow) {
          markers++;
          overflowSteps += b.overflow_count;
        }
      }
      loss.push(cols[0], cols[1], cols[2], cols[3]);
      scale.push(cols[4], cols[5], cols[6], cols[7]);
    }
    return { loss, scale, markers, overflowSteps };
  }

  function countMarkers(column) {
    return column.reduce((n, v) => n + (v === null || v === undefined ? 0 : 1), 0);
  }

  // ---- The selected job ----------------------------------------------------------------------

  const selection = { id: null, hist: null, pair: null, layout: null };

  // The address's fragment holds what a link should open: job=ID, tab=log|artifacts|...,
  // compare=ID,ID,... and compare_steps=FROM-TO (the comparison's zoom). Selecting a job or a
  // panel adds a history entry (back/forward work); a comparison edit replaces the current one.

  function hashParams() {
    return new URLSearchParams(location.hash.slice(1));
  }

  function setHash(changes, push) {
    const p = hashParams();
    for (const [key, value] of Object.entries(changes)) {
      if (value === null || value === undefined || value === "") p.delete(key);
      else p.set(key, String(value));
    }
    const text = p.toString().replace(/%2C/gi, ",");
    if (push) {
      location.hash = text; // hashchange does the rest
    } else {
      history.replaceState(null, "", location.pathname + location.search + (text ? "#" + text : ""));
    }
  }

  function selectJob(id) {
    setHash({ job: id }, true);
  }

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
    if (panels) panels.select(id);
    $("#job").hidden = id === null;
    $("#app").classList.toggle("with-job", id !== null);
    for (const [rowId, row] of jobRows) row.classList.toggle("selected", rowId === id);
    kick();
  }

  function newHistory(jobId) {
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
    };
  }

  /** Keep the selected job current: through its stream when that works, else by polling.
   * Runs inside a tick, so a poll and the opening of a stream never overlap. */
  async function refreshSelection(hist) {
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

  /** The polling path: the job (If-None-Match), then its new rows or its buckets. */
  async function pollSelected(hist) {
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
  async function followJob(hist, job, changed) {
    hist.steps = job.progress.step || 0;
    hist.lastStep = job.summary.last_step ?? -1;
    if (hist.mode === "raw" && hist.steps > CONFIG.bucketThreshold) toBuckets(hist);
    const outdated = changed && bucketsOutdated(hist, hist.steps);
    if (hist.mode === "buckets" && (hist.stale || outdated)) await pullBuckets(hist, hist.steps);
  }

  /** A resume replaced the history from some step on (history_version moved): drop what is
   * held from that step on, or everything when more than one rewrite was missed (only the
   * latest cut is known), and read on from there. */
  function followRewrite(hist, version, resetStep) {
    if (hist.version === null) hist.version = version;
    if (version <= hist.version) return; // an older answer (another API replica's cache)
    const from = version === hist.version + 1 && resetStep !== null ? resetStep : 0;
    hist.version = version;
    dropFrom(hist, from);
  }

  /** Forget the rows held from a step on (they were replaced); buckets are read again. */
  function dropFrom(hist, from) {
    if (hist.raw) {
      const keep = hist.raw.steps.findIndex((step) => step >= from);
      if (keep >= 0) for (const column of Object.values(hist.raw)) column.length = keep;
      hist.cursor = Math.min(hist.cursor, from - 1);
      hist.hasMore = true;
    }
    hist.stale = true; // buckets are read again whole
  }

  function toBuckets(hist) {
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
    if (gradients) gradients.zoom(view);
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

  function drawRaw(hist) {
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

  async function pullBuckets(hist, steps) {
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

  // ---- The selected job's event stream -------------------------------------------------------
  //
  // GET /v1/jobs/{id}/events sends `steps` (new rows), `status` (the whole job, whenever it
  // changes), `reset` (a resume replaced the rows from a step on) and a final `end`. One
  // listener costs the server far less than a page polling the job and its rows, so while the
  // stream serves the selected job the ticks leave it alone. It is read with fetch(), not
  // EventSource, which cannot send the Authorization header.

  const stream = {
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
  function streamServes(hist) {
    return !!hist && stream.hist === hist &&
      ["connecting", "open", "waiting", "ended"].includes(stream.state);
  }

  function streamWanted(hist) {
    if (!CONFIG.stream || !hist.loaded) return false;
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
  function pauseStream() {
    if (!["connecting", "open", "waiting"].includes(stream.state)) return;
    closeConnection();
    stream.state = "paused";
  }

  /** Forget the stream altogether (another job was selected). */
  function dropStream() {
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

  // ---- The selected job's summary -------------------------------------------------------------

  function renderJob(job) {
    const title = $("#job-title");
    title.replaceChildren(el("span", { text: job.name }),
      el("span", { className: "muted", text: ` #${job.id} · ${job.owner}` }));
    renderStatus($("#job-status"), job.status);
    renderSummary(job);
    renderProblems(job);
    renderMetrics(job.summary.metrics || {});
    // A job with no step recorded that is not training says so instead of two empty charts.
    $("#job-charts").hidden = job.summary.last_step === null && job.status !== "running";
    if (gradients) gradients.job(job);
    if (panels) panels.job(job);
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

  // ---- Comparison -----------------------------------------------------------------------------

  const comparison = { ids: [], pair: null, key: "", builtFor: "", wantView: null };

  function toggleCompare(id, on) {
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
  function compareFromHash(p) {
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

  async function refreshCompare() {
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

  // ---- Start -----------------------------------------------------------------------------------

  // The selected job's gradient band, per-layer table and precision decision (gradients.js,
  // loaded before this file): told of each selection, each change of the job and each zoom.
  const gradients = window.HalfwayGradients ? window.HalfwayGradients({ api, el, setText,
    fmtInt, fmtNumber, fmtScale, chartWidth, HttpError }) : null;

  const panels = window.HalfwayPanels ? window.HalfwayPanels({ el, setText, fmtInt, fmtTime,
    fmtScale, request, pollMs: CONFIG.pollMs,
    setTab: (tab) => setHash({ tab }, true),
    // A cancel or a priority change answered with the job: show it at once; the next poll
    // (or the stream's status event) confirms it.
    jobChanged: (job) => {
      if (job.id === selection.id) renderJob(job);
      kick();
    } }) : null;

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
})();

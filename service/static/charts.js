/* Halfway dashboard: the uPlot charts (vendored, loaded as a classic script before the
 * modules: the global uPlot). A loss chart and a loss-scale chart with one shared zoom, their
 * series, and their columns from raw rows or from buckets. */
import { BLUE, GREEN, RED } from "./config.js";
import { fmtInt, fmtLossTick, fmtNumber, fmtScale, fmtScaleTick, fmtStepTick } from "./format.js";

// ---- Charts --------------------------------------------------------------------------------

/** Only positive values can sit on a log axis; anything else is a gap. */
function positive(v) {
  return v !== null && v !== undefined && v > 0 && Number.isFinite(v) ? v : null;
}

export function chartWidth(node) {
  return Math.max(300, Math.floor(node.getBoundingClientRect().width) || 600);
}

/** Buckets to ask for: one per horizontal pixel of the chart. */
export function bucketPoints(node) {
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
export class ChartPair {
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
export function rawLayout() {
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
export function bucketLayout(jobs) {
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
export function rawColumns(raw) {
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
export function bucketColumns(xs, perJob) {
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

export function countMarkers(column) {
  return column.reduce((n, v) => n + (v === null || v === undefined ? 0 : 1), 0);
}

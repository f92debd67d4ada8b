/* Halfway dashboard: the selected job's metrics per epoch (GET /v1/jobs/{id}/metrics), one
 * small chart per metric with its validation twin on it (loss with val_loss, accuracy with
 * val_accuracy, ...). An ES module, no build step; app.js calls HalfwayMetrics(helpers) once
 * and then tells the returned object of each selection (select) and each change of the
 * selected job (job).
 *
 * - Cheap for pollers: the metrics are read only when the job says an epoch ended or the run
 *   moved on (its last epoch's metrics, its epoch, its history_version), never on every poll,
 *   and then with If-None-Match.
 * - Epochs are drawn counted from 1, as the job's summary counts them (the API's from 0, as
 *   Keras does).
 * - Metric names are the user's (their own Keras metrics): they reach the page only as text.
 */
const BLUE = "#1f6feb";
const ORANGE = "#d4750b";
const HEIGHT = 150;

/** Each metric with its validation twin: [["loss", "val_loss"], ["accuracy"], ...], the
 * loss first, then in the order the names first appear; a val_ metric without its twin
 * stands alone. */
function groupNames(found) {
  const names = [...found].sort((a, b) => (b === "loss") - (a === "loss"));
  const have = new Set(names);
  const groups = [];
  for (const name of names) {
    if (name.startsWith("val_") && have.has(name.slice(4))) continue; // drawn with its twin
    const twin = "val_" + name;
    groups.push(have.has(twin) && !name.startsWith("val_") ? [name, twin] : [name]);
  }
  return groups;
}

export function HalfwayMetrics(h) {
  const { api, oneAtATime, el, setText, fmtInt, fmtNumber } = h;
  const $ = (selector) => document.querySelector(selector);

  const state = {
    id: null,
    key: "", // what the metrics were last read for (see job())
    busy: false,
    again: false,
    epochs: [], // [{epoch, metrics}] as the API answered
    charts: [], // uPlot instances, one per group
    layout: "", // the groups the charts were built for, as JSON
  };

  function select(id) {
    if (id === state.id) return;
    destroy();
    Object.assign(state, { id, key: "", epochs: [], layout: "" });
    $("#metric-charts").replaceChildren();
    $("#epoch-metrics").hidden = true;
  }

  /** The selected job changed: read its metrics again only if its epoch moved (an epoch
   * ended: the job's last epoch's metrics changed, or the next one began), a resume
   * rewrote the run (history_version), or the job's status moved (it ended). */
  function job(j) {
    if (j.id !== state.id) return;
    const last = j.summary.metrics ? j.summary.metrics.last_epoch : null;
    const key = JSON.stringify([last || null, j.progress.epoch, j.history_version, j.status]);
    if (key === state.key) return;
    state.key = key;
    if (!last) return; // no epoch has ended: nothing to read yet
    update();
  }

  const update = oneAtATime(
    state,
    async (id) => {
      const { body, changed } = await api(`/v1/jobs/${id}/metrics`, "epoch-metrics");
      if (id !== state.id) return;
      if (changed || !state.charts.length) {
        state.epochs = body.epochs;
        draw();
      }
    },
    (err) => {
      setText($("#epoch-metrics-caption"), `metrics could not be read: ${err.message}`);
      console.warn("epoch metrics", err);
    },
  );

  function destroy() {
    for (const chart of state.charts) chart.destroy();
    state.charts = [];
  }

  function width(node) {
    return Math.max(200, Math.floor(node.getBoundingClientRect().width) || 300);
  }

  function options(node, group) {
    return {
      width: width(node),
      height: HEIGHT,
      scales: {
        x: { time: false, range: (u, min, max) => [Math.min(min ?? 1, 1), Math.max(max ?? 2, 2)] },
        y: { auto: true },
      },
      axes: [
        { label: "epoch", labelSize: 14, labelGap: 0, labelFont: "12px system-ui, sans-serif",
          size: 34, values: (u, splits) => splits.map((v) => (Number.isInteger(v) ? fmtInt(v) : "")) },
        { size: 56, values: (u, splits) => splits.map(fmtNumber) },
      ],
      series: [{ label: "epoch", value: (u, v) => fmtInt(v) },
        ...group.map((name, i) => ({ label: name, stroke: i ? ORANGE : BLUE, width: 1.5,
          spanGaps: false, points: { show: true, size: 5, fill: i ? ORANGE : BLUE },
          value: (u, v) => fmtNumber(v) }))],
      legend: { live: true },
      cursor: { drag: { x: false, y: false } },
    };
  }

  function draw() {
    const epochs = state.epochs;
    const box = $("#epoch-metrics");
    box.hidden = epochs.length === 0;
    if (!epochs.length) {
      destroy();
      $("#metric-charts").replaceChildren();
      state.layout = "";
      return;
    }
    const names = [...new Set(epochs.flatMap((e) => Object.keys(e.metrics)))];
    const groups = groupNames(names);
    const layout = JSON.stringify(groups);
    const holder = $("#metric-charts");
    if (layout !== state.layout) {
      destroy();
      state.layout = layout;
      holder.replaceChildren(...groups.map((group) => {
        const node = el("div", { className: "metric-chart" });
        node.dataset.metric = group[0];
        return node;
      }));
      state.charts = groups.map((group, i) =>
        new uPlot(options(holder.children[i], group), [[], ...group.map(() => [])],
          holder.children[i]));
    }
    const xs = epochs.map((e) => e.epoch + 1);
    groups.forEach((group, i) => {
      const data = [xs, ...group.map((name) => epochs.map((e) => {
        const v = e.metrics[name];
        return v === null || v === undefined ? null : v;
      }))];
      const chart = state.charts[i];
      chart.setData(data);
      // What the chart holds, counted from the very columns it was handed (tests read it).
      Object.assign(holder.children[i].dataset, {
        points: String(chart.data[0].length),
        series: group.join(","),
        xLabel: "epoch",
      });
    });
    setText($("#epoch-metrics-caption"), `${fmtInt(epochs.length)} epoch` +
      `${epochs.length === 1 ? "" : "s"} ended · validation metrics in orange`);
  }

  new ResizeObserver(() => {
    for (const chart of state.charts) {
      const w = width(chart.root.parentNode);
      if (Math.abs(chart.width - w) > 2) chart.setSize({ width: w, height: chart.height });
    }
  }).observe($("#metric-charts"));

  return { select, job };
}

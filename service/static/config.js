/* Halfway dashboard: the settings and the colours the charts share. */

// ---- Settings. Query parameters exist so tests (and the curious) can tune them. ----------

const params = new URLSearchParams(location.search);
export const CONFIG = {
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
export const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b",
  "#e377c2", "#17becf", "#bcbd22", "#7f7f7f", "#d62728"];
export const BLUE = "#1f6feb";
export const GREEN = "#2da44e";
export const RED = "#d1242f";

function intParam(name, fallback, min, max) {
  const value = Number.parseInt(params.get(name) || "", 10);
  return Number.isFinite(value) ? Math.min(max, Math.max(min, value)) : fallback;
}

/* Halfway dashboard: small DOM helpers and the formatting of numbers, scales and times. User
 * text only ever reaches the page through these as text (textContent, text nodes). */

// ---- Small DOM helpers --------------------------------------------------------------------

export const $ = (selector) => document.querySelector(selector);

/** Create an element. Strings among the children become text nodes, never markup. */
export function el(tag, props, ...children) {
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

export function setText(node, text) {
  if (node.textContent !== text) node.textContent = text;
}

// ---- Formatting ---------------------------------------------------------------------------

const intFormat = new Intl.NumberFormat("en-US");
// Four significant digits, so neighbouring ticks of a zoomed axis (30.5K, 31K) stay distinct.
const compactFormat = new Intl.NumberFormat("en-US",
  { notation: "compact", maximumSignificantDigits: 4 });
const SUPERSCRIPT = { "-": "⁻", 0: "⁰", 1: "¹", 2: "²", 3: "³", 4: "⁴",
  5: "⁵", 6: "⁶", 7: "⁷", 8: "⁸", 9: "⁹" };

export function fmtInt(n) {
  return n === null || n === undefined ? "–" : intFormat.format(n);
}

export function fmtNumber(v) {
  if (v === null || v === undefined || !Number.isFinite(v)) return "–";
  return String(Number(v.toPrecision(5)));
}

const humanFormat = new Intl.NumberFormat("en-US", { maximumSignificantDigits: 5 });
export const NBSP = "\u00a0"; // between a number and its unit: the two never part at a line end

/** A number for people: five significant digits with thousands separators (21,000.25 ->
 * "21,000"), tiny ones in exponent form. */
export function fmtHuman(v) {
  if (v === null || v === undefined || !Number.isFinite(v)) return "–";
  if (v !== 0 && Math.abs(v) < 1e-4) return v.toExponential(3);
  return humanFormat.format(v);
}

export function fmtSeconds(v) {
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
export function fmtScale(v) {
  if (v === null || v === undefined) return "–";
  const exact = Number.isInteger(v) ? String(v) : fmtNumber(v); // 524288, not 524290
  const k = powerOfTwo(v);
  return k === null ? exact : `${exact} (2${sup(k)})`;
}

// Axis labels: uPlot passes null for the ticks it leaves unlabelled.
export function fmtScaleTick(v) {
  if (v === null || v === undefined) return "";
  const k = powerOfTwo(v);
  return k === null ? fmtNumber(v) : `2${sup(k)}`;
}

export function fmtLossTick(v) {
  return v === null || v === undefined ? "" : fmtNumber(v);
}

export function fmtStepTick(v) {
  return Number.isInteger(v) ? compactFormat.format(v) : "";
}

export function fmtLoss(value, flag) {
  if (flag) return flag; // "nan", "inf", "-inf": JSON has no non-finite numbers
  return fmtNumber(value);
}

export function stepsEach(width) {
  return width === 1 ? "1 step" : `${fmtInt(width)} steps`;
}

export function fmtTime(iso) {
  return iso ? new Date(iso).toLocaleString() : "–";
}

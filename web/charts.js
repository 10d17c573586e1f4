// Line charts drawn as SVG with no library, so the UI runs from `web/` as it is, with nothing to
// install: several series of [x, y] points, an optional shaded band (a mean ± std), titled axes
// with readable ticks, a legend whose values follow the pointer, and axis-less sparklines.

const SVG = 'http://www.w3.org/2000/svg';
/** The font of axis labels (style.css gives `.plot text` the same). */
const AXIS_FONT = '11px sans-serif';

export const COLORS = ['#2563eb', '#dc2626', '#16a34a', '#9333ea', '#ea580c', '#0891b2', '#ca8a04', '#db2777'];

function svg(tag, attrs = {}) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  return e;
}

/** The row's step: the default x of a point. */
const stepOf = (r) => r.step;

/**
 * Points [x, value] of `key` from metric rows, sorted by x: one per step (a resumed run logs
 * some steps again, and the later row wins), placed at `xOf(row)` (its step by default; the
 * tokens or the time of the row for the other x axes: metrics.js `xOf`). Rows whose x is
 * missing are left out.
 */
export function pointsOf(rows, key, xOf = stepOf) {
  const byStep = new Map();
  for (const r of rows) {
    const v = r[key];
    if (typeof r.step === 'number' && typeof v === 'number' && Number.isFinite(v)) byStep.set(r.step, r);
  }
  const pts = [];
  for (const r of byStep.values()) {
    const x = xOf(r);
    if (typeof x === 'number' && Number.isFinite(x)) pts.push([x, r[key]]);
  }
  return pts.sort((a, b) => a[0] - b[0]);
}

/**
 * TensorBoard's smoothing: an exponential moving average with weight `weight` (0: none, 0.99:
 * heavy), debiased as Adam's moments are (divided by 1 − weight^n), so the first points are not
 * pulled towards 0 as a plain EMA started at 0 pulls them. Like TensorBoard, a constant series is
 * returned as it is (the division would otherwise add rounding noise), and the average runs over
 * points, not over x (steps logged every N steps smooth as points 1 step apart would).
 */
export function smooth(points, weight) {
  if (!(weight > 0) || points.length < 2) return points;
  const w = Math.min(weight, 0.999);
  if (points.every(([, y]) => y === points[0][1])) return points;
  let last = 0;
  let n = 0;
  return points.map(([x, y]) => {
    last = last * w + (1 - w) * y;
    n += 1;
    return [x, last / (1 - w ** n)];
  });
}

/**
 * The [lo, hi] range drawn for values in [min, max]: 5% margins, widened to ±5% of the
 * magnitude when the values are (nearly) constant, so a learning rate that moves by 1e-9 per
 * step still gets an axis with distinct ticks.
 */
export function paddedRange(min, max) {
  if (!Number.isFinite(min) || !Number.isFinite(max)) return [0, 1];
  const magnitude = Math.max(Math.abs(min), Math.abs(max));
  const span = max - min;
  if (span <= magnitude * 1e-4) {
    const pad = magnitude ? magnitude * 0.05 : 1;
    return [min - pad, max + pad];
  }
  return [min - span * 0.05, max + span * 0.05];
}

/**
 * The [lo, hi] a y axis shows for values in [min, max]. A quantity that cannot be negative
 * (`nonNegative`: bytes, times, rates, norms; a `count` too) never gets an axis below zero, and
 * when it is all zero gets [0, 1], not a range around zero with negative ticks; a count's axis
 * always starts at 0 ("how many" reads from zero).
 */
export function axisRange(min, max, { count = false, nonNegative = false } = {}) {
  if (!Number.isFinite(min) || !Number.isFinite(max)) return [0, 1];
  let [lo, hi] = paddedRange(min, max);
  if ((count || nonNegative) && min >= 0) {
    if (max <= 0) return [0, 1];
    if (count || lo < 0) lo = 0;
  }
  return [lo, hi];
}

/**
 * About `count` round ticks in [lo, hi], 1, 2 or 5 times a power of ten of `unit` apart (a
 * byte axis passes its unit, so ticks fall on round numbers of what the labels show); with
 * `integer`, at least 1 apart.
 */
export function niceTicks(lo, hi, count = 5, unit = 1, integer = false) {
  const span = (hi - lo) / unit;
  if (!(span > 0) || !Number.isFinite(span)) return { values: [lo], step: unit };
  const raw = span / count;
  const power = 10 ** Math.floor(Math.log10(raw));
  let step = ([1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw) || 10 * power) * unit;
  // Counts (and bytes in B) have no halves.
  if (integer) step = Math.max(step, 1);
  const values = [];
  for (let k = Math.ceil(lo / step); k * step <= hi + step * 1e-9; k++) values.push(k * step);
  return { values, step };
}

/**
 * Tick labels for `splits` (multiples of `incr`): the fewest decimals (or, for magnitudes below
 * 0.01 or from 1e6 up, significant digits in exponent form) with which every label reads back
 * as its tick. Rounding to a fixed 3 decimals turned the ticks of a learning rate near
 * 1e-3 into "0.001, 0.001, 0".
 */
export function formatTicks(splits, incr) {
  const finite = splits.filter((v) => v !== null && Number.isFinite(v));
  const magnitude = Math.max(0, ...finite.map(Math.abs));
  const exp = magnitude !== 0 && (magnitude < 1e-2 || magnitude >= 1e6);
  const tolerance = Math.abs(incr || magnitude || 1) * 1e-3;
  const label = (v, d) => {
    if (v === null || !Number.isFinite(v)) return '';
    if (Math.abs(v) < tolerance) return '0';
    return exp ? v.toExponential(d).replace('e+', 'e') : v.toFixed(d);
  };
  for (let d = 0; d <= 15; d++) {
    const labels = splits.map((v) => label(v, d));
    if (splits.every((v, i) => v === null || !Number.isFinite(v) || Math.abs(Number(labels[i]) - v) <= tolerance)) return labels;
  }
  return splits.map((v) => label(v, 15));
}

const BYTE_UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];

/** The binary unit (an index into BYTE_UNITS) bytes of this magnitude read in. */
function byteUnit(magnitude) {
  let k = 0;
  while (k < BYTE_UNITS.length - 1 && magnitude >= 1024 ** (k + 1)) k++;
  return k;
}

/**
 * Byte tick labels in the axis' one unit, with the decimals that unit needs ("445 MiB, 446 MiB"
 * or "1.35 MiB, 1.40 MiB"), never a mix of units or digits lost to rounding.
 */
export function formatBytesTicks(splits, incr, k) {
  const scale = 1024 ** k;
  const numbers = formatTicks(splits.map((v) => (v === null ? null : v / scale)), incr / scale);
  return numbers.map((n) => (n === '' ? '' : `${n} ${BYTE_UNITS[k]}`));
}

/** A log tick's label: as short as it reads ("0.05", "200", "1e-4", "2e6"). */
function formatLogTick(v) {
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-2 || a >= 1e6)) return v.toExponential().replace('e+', 'e');
  return String(Number(v.toPrecision(12)));
}

/**
 * Ticks of a log axis over [lo, hi] (0 < lo < hi): the powers of ten inside it (every k-th
 * one over many decades), with 2 and 5 times them when fewer than three powers fall inside (a
 * range of a decade or two), and when the range is narrower still (a loss from 2.3 to 2.9, no
 * power of ten and at most one 2 or 5 inside) round linear ticks, placed on the log axis.
 * Returns `{ values, labels }`.
 */
export function logTicks(lo, hi, count = 4) {
  if (!(lo > 0) || !(hi > lo)) return { values: [lo], labels: [formatLogTick(lo)] };
  const inside = (mults, every = 1) => {
    const out = [];
    for (let e = Math.floor(Math.log10(lo)); e <= Math.ceil(Math.log10(hi)); e++) {
      if (e % every !== 0) continue;
      for (const m of mults) {
        const v = Number((m * 10 ** e).toPrecision(12));
        if (v >= lo && v <= hi) out.push(v);
      }
    }
    return out;
  };
  const decades = Math.log10(hi / lo);
  let values = inside([1], Math.max(1, Math.ceil(decades / (2 * count))));
  if (values.length < 3) values = inside([1, 2, 5]);
  if (values.length >= 2) return { values, labels: values.map(formatLogTick) };
  const t = niceTicks(lo, hi, count);
  values = t.values.filter((v) => v > 0);
  return { values, labels: formatTicks(values, t.step) };
}

const TOKEN_UNITS = ['', 'K', 'M', 'B', 'T'];

/**
 * Ticks of a tokens axis: round numbers of one decimal unit ("500K, 1.0M, 1.5M"; 1000-based as
 * token counts are quoted, unlike bytes). Returns `{ values, labels }`.
 */
export function tokenTicks(lo, hi, count = 5) {
  let k = 0;
  const magnitude = Math.max(Math.abs(lo), Math.abs(hi));
  while (k < TOKEN_UNITS.length - 1 && magnitude >= 1000 ** (k + 1)) k++;
  const scale = 1000 ** k;
  const t = niceTicks(lo, hi, count, scale, k === 0);
  const numbers = formatTicks(t.values.map((v) => v / scale), t.step / scale);
  return { values: t.values, labels: numbers.map((n) => (n === '' || n === '0' ? n : `${n}${TOKEN_UNITS[k]}`)) };
}

/** Seconds as elapsed time: "45s", "1m30s", "2h05m", "1d03h" (the unit below the largest). */
export function formatElapsed(seconds) {
  if (!Number.isFinite(seconds)) return '';
  const sign = seconds < 0 ? '-' : '';
  const s = Math.round(Math.abs(seconds));
  const pad = (n) => String(n).padStart(2, '0');
  if (s < 60) return `${sign}${s}s`;
  if (s < 3600) return `${sign}${Math.floor(s / 60)}m${s % 60 ? `${pad(s % 60)}s` : ''}`;
  if (s < 86400) {
    const m = Math.floor((s % 3600) / 60);
    return `${sign}${Math.floor(s / 3600)}h${m ? `${pad(m)}m` : ''}`;
  }
  const h = Math.floor((s % 86400) / 3600);
  return `${sign}${Math.floor(s / 86400)}d${h ? `${pad(h)}h` : ''}`;
}

/** Tick spacings of a time axis from a second up: what a clock reads in round numbers. */
const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400];

/**
 * Ticks of an elapsed-time axis (seconds) at round clock intervals (15 s, 5 min, 6 h, days),
 * labelled "1m30s" / "2h05m"; under a second apart (a run of a few seconds), decimal seconds.
 * Returns `{ values, labels }`.
 */
export function timeTicks(lo, hi, count = 5) {
  const raw = (hi - lo) / count;
  if (!(raw >= 1)) {
    const t = niceTicks(lo, hi, count);
    return { values: t.values, labels: formatTicks(t.values, t.step).map((l) => (l === '' ? l : `${l}s`)) };
  }
  let step = TIME_STEPS.find((s) => s >= raw);
  if (!step) {
    const days = raw / 86400;
    const power = 10 ** Math.floor(Math.log10(days));
    step = 86400 * [1, 2, 5, 10].map((m) => m * power).find((d) => d >= days);
  }
  const values = [];
  for (let k = Math.ceil(lo / step); k * step <= hi + step * 1e-9; k++) values.push(k * step);
  return { values, labels: values.map(formatElapsed) };
}

let measureCtx = null;
/** The width in CSS pixels of `text` in the canvas font `font`. */
function textWidth(text, font) {
  measureCtx ??= document.createElement('canvas').getContext('2d');
  measureCtx.font = font;
  return measureCtx.measureText(text).width;
}

/** The extent of the x and y values of every series (and of a band's [x, lo, hi] points). */
function extent(series, band = []) {
  let [x0, x1, y0, y1] = [Infinity, -Infinity, Infinity, -Infinity];
  for (const pts of series) {
    for (const [x, y] of pts) {
      x0 = Math.min(x0, x); x1 = Math.max(x1, x);
      y0 = Math.min(y0, y); y1 = Math.max(y1, y);
    }
  }
  for (const [x, lo, hi] of band) {
    x0 = Math.min(x0, x); x1 = Math.max(x1, x);
    y0 = Math.min(y0, lo); y1 = Math.max(y1, hi);
  }
  return { x0, x1, y0, y1, empty: x0 > x1 };
}

/** The index of the point of `pts` (sorted by x) nearest to `x`, or -1 when there is none. */
function nearest(pts, x) {
  if (!pts.length) return -1;
  let lo = 0;
  let hi = pts.length - 1;
  while (hi - lo > 1) {
    const mid = (lo + hi) >> 1;
    if (pts[mid][0] <= x) lo = mid; else hi = mid;
  }
  return Math.abs(pts[lo][0] - x) <= Math.abs(pts[hi][0] - x) ? lo : hi;
}

/**
 * The [lo, hi] of a log axis for positive values in [min, max]: 5% of the decades spanned as
 * margins (a tenth of a decade around a constant), [1, 10] when there is nothing to show.
 */
export function logRange(min, max) {
  if (!(min > 0) || !Number.isFinite(max) || max < min) return [1, 10];
  const [l0, l1] = [Math.log10(min), Math.log10(max)];
  const pad = l1 - l0 > 1e-6 ? (l1 - l0) * 0.05 : 0.1;
  return [10 ** (l0 - pad), 10 ** (l1 + pad)];
}

/** The x ticks of [lo, hi] for an axis of `kind` (step, tokens or time) and their labels. */
function xTicks(kind, lo, hi, count) {
  if (kind === 'time') return timeTicks(lo, hi, count);
  if (kind === 'tokens') return tokenTicks(lo, hi, count);
  const t = niceTicks(lo, hi, count);
  return { values: t.values, labels: formatTicks(t.values, t.step) };
}

/** An SVG path through points: `M x,y L x,y …` in pixels. */
const pathOf = (pts, sx, sy) => pts.map(([x, y], k) => `${k ? 'L' : 'M'}${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join('');

/** A legend entry: a swatch, the label and a value that follows the pointer. */
function legendItem(legend, label, color, swatchClass = '') {
  const item = document.createElement('span');
  const swatch = document.createElement('i');
  swatch.style.background = color;
  if (swatchClass) swatch.className = swatchClass;
  const value = document.createElement('b');
  item.append(swatch, document.createTextNode(` ${label} `), value);
  legend.append(item);
  return value;
}

/**
 * A line chart in `container`: `set(seriesPoints, band)` replaces its data (one array of [x, y]
 * points per label, sorted by x; `band`, with the `band` option, [x, lo, hi] points shaded
 * around the first series). Options: `yTitle` (the y axis' title, with its unit) and `xTitle`
 * (default "step"); `xKind` ("step", "tokens" or "time": x ticks as numbers, as "1.5M" or as
 * "1m30s"); `bytes` (binary-unit ticks), `count` (an axis from 0 with whole ticks),
 * `nonNegative` (never an axis below 0), `percent` (ticks and values read as "12.5%"),
 * `yFormat` (legend values); `smoothing` (TensorBoard's EMA weight in [0, 0.99]: above 0, the
 * smoothed line is drawn solid over the raw one drawn faint, and the legend reads "smoothed
 * (raw)"); `logY` (a log y axis: values ≤ 0 are left out) and `onLog` (puts a "log" toggle in
 * the chart's header and is called with its new state; byte charts get none, see below).
 * `configure` changes the x axis, smoothing and log scale of a chart already drawn.
 *
 * The container gets `data-points` (points of the first series), `data-series` (series with
 * points), `data-band` (band points), `data-y-title` / `data-x-title`, `data-x-kind`,
 * `data-x-extent` (JSON [first, last] x of the data), `data-smoothing`, `data-log`, and after
 * each draw `data-y-ticks` / `data-x-ticks` (the tick labels as drawn, JSON), `data-drawn`
 * (points of the first series drawn), `data-dropped` (values ≤ 0 a log axis left out, all
 * series), `data-y-axis` and `data-y-labels` (the y axis' width and its widest label's, in CSS
 * pixels), so that tests can see the chart fill up and read its axes. Raw lines are
 * `path.line.raw`, smoothed ones `path.line.smoothed`, each with `data-series`.
 */
export class LineChart {
  constructor(container, { title, labels, height = 216, yFormat, bytes = false, count = false, nonNegative = false, percent = false, yTitle = '', xTitle = 'step', xKind = 'step', smoothing = 0, logY = false, onLog = null, band = null } = {}) {
    this.container = container;
    this.labels = labels;
    this.height = height;
    this.bytes = bytes;
    this.count = count;
    this.nonNegative = nonNegative || bytes || count;
    this.percent = percent;
    this.yTitle = yTitle;
    const plain = percent ? formatPercent : formatValue;
    this.format = (v) => (v === null || v === undefined ? '–' : yFormat ? yFormat(v) : plain(v));
    this.series = labels.map(() => []);
    this.band = [];
    container.classList.add('chart');
    container.dataset.yTitle = yTitle;
    const head = Object.assign(document.createElement('div'), { className: 'chart-head' });
    head.append(Object.assign(document.createElement('h3'), { textContent: title }));
    // A byte axis reads in one binary unit ("445 MiB, 446 MiB"), which a log axis' decades
    // cannot keep, and memory is not what spans decades: byte charts stay linear.
    if (onLog && !bytes) {
      this.logBox = Object.assign(document.createElement('input'), { type: 'checkbox' });
      this.logBox.dataset.logToggle = '';
      this.logBox.addEventListener('change', () => {
        this.configure({ logY: this.logBox.checked });
        this.draw();
        onLog(this.logBox.checked);
      });
      const toggle = Object.assign(document.createElement('label'), { className: 'log-toggle', title: 'log scale for the y axis (values ≤ 0 are left out)' });
      toggle.append(this.logBox, document.createTextNode(' log'));
      head.append(toggle);
    }
    container.append(head);
    this.svg = svg('svg', { class: 'plot', height, role: 'img', 'aria-label': title });
    container.append(this.svg);
    const legend = Object.assign(document.createElement('div'), { className: 'legend' });
    this.values = labels.map((label, i) => legendItem(legend, label, COLORS[i % COLORS.length]));
    // The band's value is its half-width (the "± std"), next to its series' value.
    if (band) this.bandValue = legendItem(legend, band, COLORS[0], 'band');
    container.append(legend);
    this.svg.addEventListener('pointermove', (e) => this.hover(e));
    this.svg.addEventListener('pointerleave', () => this.hover(null));
    this.width = 0;
    this.configure({ xTitle, xKind, smoothing, logY });
    new ResizeObserver(() => {
      if (Math.abs(this.chartWidth() - this.width) > 4) this.draw();
    }).observe(container);
    this.set(this.series);
  }

  /**
   * Changes how the chart reads: any of `xTitle`, `xKind`, `smoothing` and `logY` (ignored on a
   * byte chart). The next `set` or `draw` shows it.
   */
  configure({ xTitle, xKind, smoothing, logY } = {}) {
    const d = this.container.dataset;
    if (xTitle !== undefined) this.xTitle = d.xTitle = xTitle;
    if (xKind !== undefined) this.xKind = d.xKind = xKind;
    if (smoothing !== undefined) {
      this.smoothing = Math.min(0.99, Math.max(0, Number(smoothing) || 0));
      d.smoothing = String(this.smoothing);
    }
    if (logY !== undefined) {
      this.logY = Boolean(logY) && !this.bytes;
      d.log = String(this.logY);
      if (this.logBox) this.logBox.checked = this.logY;
    }
  }

  chartWidth() {
    return Math.max(300, this.container.clientWidth - 24 || 400);
  }

  set(seriesPoints, band = []) {
    this.series = seriesPoints.map((pts) => pts.filter(([x, y]) => Number.isFinite(x) && Number.isFinite(y)));
    this.band = this.bandValue ? band.filter((p) => p.every(Number.isFinite)) : [];
    const d = this.container.dataset;
    d.points = String(this.series[0] ? this.series[0].length : 0);
    d.series = String(this.series.filter((p) => p.length > 0).length);
    d.band = String(this.band.length);
    const ext = extent(this.series, this.band);
    d.xExtent = JSON.stringify(ext.empty ? [] : [ext.x0, ext.x1]);
    this.draw();
  }

  /** The y ticks of [lo, hi] and their labels. */
  yTicks(lo, hi) {
    const percent = (labels) => (this.percent ? labels.map((l) => (l === '' ? l : `${l}%`)) : labels);
    if (this.logY) {
      const t = logTicks(lo, hi, 4);
      return { values: t.values, labels: percent(t.labels) };
    }
    if (this.bytes) {
      const k = byteUnit(Math.max(Math.abs(lo), Math.abs(hi)));
      const t = niceTicks(lo, hi, 4, 1024 ** k, k === 0);
      return { values: t.values, labels: formatBytesTicks(t.values, t.step, k) };
    }
    const t = niceTicks(lo, hi, 4, 1, this.count);
    return { values: t.values, labels: percent(formatTicks(t.values, t.step)) };
  }

  draw() {
    const width = this.chartWidth();
    const height = this.height;
    const log = this.logY;
    this.width = width;
    this.svg.setAttribute('width', width);
    this.svg.setAttribute('viewBox', `0 0 ${width} ${height}`);
    this.svg.replaceChildren();
    // A log axis has no place for 0 or below: such values are left out (and counted), never
    // drawn as NaN. Smoothing runs over what is drawn, so a smoothed log line stays positive.
    let dropped = 0;
    const shown = this.series.map((pts) => {
      if (!log) return pts;
      const kept = pts.filter(([, y]) => y > 0);
      dropped += pts.length - kept.length;
      return kept;
    });
    // A band reaching 0 or below on a log axis runs off its bottom (a band wholly below is left out).
    const band = log ? this.band.filter(([, , hi]) => hi > 0) : this.band;
    this.shown = shown;
    this.smoothed = this.smoothing > 0 ? shown.map((pts) => smooth(pts, this.smoothing)) : null;
    // The axes fit the raw values (the smoothed ones lie between them), so smoothing never moves
    // the raw line.
    const ext = extent(shown, log ? band.map(([x, lo, hi]) => [x, lo > 0 ? lo : hi, hi]) : band);
    const [xLo, xHi] = ext.empty ? [0, 1] : ext.x0 === ext.x1 ? [ext.x0 - 1, ext.x1 + 1] : [ext.x0, ext.x1];
    let yLo;
    let yHi;
    if (log) [yLo, yHi] = ext.empty ? [1, 10] : logRange(ext.y0, ext.y1);
    else [yLo, yHi] = ext.empty ? [0, 1] : axisRange(ext.y0, ext.y1, { count: this.count, nonNegative: this.nonNegative });
    const yt = this.yTicks(yLo, yHi);
    // As wide as the widest label: a fixed width cut "447.8 MiB" down to "7.8 MiB". The axis
    // titles take a line of their own (left, turned; below).
    const widest = Math.ceil(Math.max(0, ...yt.labels.map((l) => textWidth(l, AXIS_FONT))));
    const titleLine = 16;
    const box = { left: widest + 12 + (this.yTitle ? titleLine : 0), right: width - 10, top: 8, bottom: height - 22 - (this.xTitle ? titleLine - 2 : 0) };
    const sx = (x) => box.left + ((x - xLo) / (xHi - xLo)) * (box.right - box.left);
    const [lLo, lHi] = [Math.log10(yLo), Math.log10(yHi)];
    const sy = log
      ? (y) => (y > 0 ? box.bottom - ((Math.log10(y) - lLo) / (lHi - lLo)) * (box.bottom - box.top) : box.bottom)
      : (y) => box.bottom - ((y - yLo) / (yHi - yLo)) * (box.bottom - box.top);
    this.scale = { sx, xLo, xHi, box };

    const grid = svg('g', { class: 'grid' });
    yt.values.forEach((v, i) => {
      grid.append(svg('line', { x1: box.left, x2: box.right, y1: sy(v), y2: sy(v) }));
      const t = svg('text', { x: box.left - 6, y: sy(v) + 4, 'text-anchor': 'end' });
      t.textContent = yt.labels[i];
      grid.append(t);
    });
    const xt = xTicks(this.xKind, xLo, xHi, Math.max(2, Math.floor((box.right - box.left) / 80)));
    xt.values.forEach((v, i) => {
      const t = svg('text', { x: sx(v), y: box.bottom + 16, 'text-anchor': 'middle' });
      t.textContent = xt.labels[i];
      grid.append(t);
    });
    grid.append(svg('line', { class: 'axis', x1: box.left, x2: box.right, y1: box.bottom, y2: box.bottom }));
    if (this.yTitle) {
      const cy = (box.top + box.bottom) / 2;
      const t = svg('text', { class: 'axis-title y-title', x: 11, y: cy, 'text-anchor': 'middle', transform: `rotate(-90 11 ${cy})` });
      t.textContent = log ? `${this.yTitle} (log)` : this.yTitle;
      grid.append(t);
    }
    if (this.xTitle) {
      const t = svg('text', { class: 'axis-title x-title', x: (box.left + box.right) / 2, y: height - 3, 'text-anchor': 'middle' });
      t.textContent = this.xTitle;
      grid.append(t);
    }
    this.svg.append(grid);
    if (band.length) {
      const upper = band.map(([x, , hi], k) => `${k ? 'L' : 'M'}${sx(x).toFixed(1)},${sy(hi).toFixed(1)}`);
      const lower = band.slice().reverse().map(([x, lo]) => `L${sx(x).toFixed(1)},${sy(lo).toFixed(1)}`);
      this.svg.append(svg('path', { class: 'band', d: `${upper.join('')}${lower.join('')}Z`, fill: COLORS[0], 'fill-opacity': 0.18, stroke: 'none' }));
    }
    // With smoothing the raw line stays, faint, under the smoothed one: the noise is what tells
    // a real change from the average's lag.
    shown.forEach((pts, i) => {
      if (!pts.length) return;
      const color = COLORS[i % COLORS.length];
      this.svg.append(svg('path', { class: 'line raw', 'data-series': i, d: pathOf(pts, sx, sy), fill: 'none', stroke: color, 'stroke-width': this.smoothed ? 1 : 1.5, 'stroke-opacity': this.smoothed ? 0.3 : 1 }));
    });
    if (this.smoothed) {
      this.smoothed.forEach((pts, i) => {
        if (!pts.length) return;
        this.svg.append(svg('path', { class: 'line smoothed', 'data-series': i, d: pathOf(pts, sx, sy), fill: 'none', stroke: COLORS[i % COLORS.length], 'stroke-width': 1.75 }));
      });
    }
    this.cursor = svg('line', { class: 'cursor', y1: box.top, y2: box.bottom, visibility: 'hidden' });
    this.svg.append(this.cursor);
    const d = this.container.dataset;
    d.yTicks = JSON.stringify(yt.labels);
    d.xTicks = JSON.stringify(xt.labels);
    d.drawn = String(shown[0] ? shown[0].length : 0);
    d.dropped = String(dropped);
    d.yAxis = String(box.left);
    d.yLabels = String(widest);
    this.bandShown = band;
    this.hover(null);
  }

  /** Shows the values at the pointer's x in the legend (the last values when it leaves). */
  hover(event) {
    if (!this.scale) return;
    const { sx, xLo, xHi, box } = this.scale;
    let x = null;
    if (event) {
      const px = event.clientX - this.svg.getBoundingClientRect().left;
      if (px >= box.left && px <= box.right) x = xLo + ((px - box.left) / (box.right - box.left)) * (xHi - xLo);
    }
    this.cursor.setAttribute('visibility', x === null ? 'hidden' : 'visible');
    if (x !== null) {
      this.cursor.setAttribute('x1', sx(x));
      this.cursor.setAttribute('x2', sx(x));
    }
    this.shown.forEach((pts, i) => {
      const k = x === null ? pts.length - 1 : nearest(pts, x);
      const raw = k >= 0 ? this.format(pts[k][1]) : '–';
      this.values[i].textContent = k >= 0 && this.smoothed ? `${this.format(this.smoothed[i][k][1])} (${raw})` : raw;
      this.values[i].title = this.smoothed ? 'smoothed (raw)' : '';
    });
    if (this.bandValue) {
      const band = this.bandShown;
      const k = x === null ? band.length - 1 : nearest(band, x);
      this.bandValue.textContent = k >= 0 ? `±${this.format((band[k][2] - band[k][1]) / 2)}` : '–';
    }
  }
}

/**
 * A percent as the CLI prints it ("12.3%"), with more digits only where one decimal would show
 * a small value as 0.
 */
export function formatPercent(v) {
  if (!Number.isFinite(v)) return String(v);
  const fixed = v.toFixed(1);
  return `${Number(fixed) === 0 && v !== 0 ? String(Number(v.toPrecision(2))) : fixed}%`;
}

/** A legend value: four significant digits (three fixed decimals lose small values). */
export function formatValue(v) {
  if (!Number.isFinite(v)) return String(v);
  if (Number.isInteger(v) && Math.abs(v) < 1e6) return String(v);
  const a = Math.abs(v);
  return a !== 0 && (a < 1e-2 || a >= 1e6) ? v.toExponential(3) : String(Number(v.toPrecision(4)));
}

/** A tiny axis-less curve (the runs table's mini-curves). */
export class Sparkline {
  constructor(container, { width = 160, height = 36, color = COLORS[0] } = {}) {
    this.container = container;
    this.size = { width, height };
    this.svg = svg('svg', { class: 'spark', width, height, viewBox: `0 0 ${width} ${height}` });
    this.path = svg('path', { fill: 'none', stroke: color, 'stroke-width': 1.25 });
    this.svg.append(this.path);
    container.append(this.svg);
    this.set([]);
  }

  set(points) {
    const pts = points.filter(([x, y]) => Number.isFinite(x) && Number.isFinite(y));
    const ext = extent([pts]);
    const { width, height } = this.size;
    let d = '';
    if (!ext.empty) {
      const [yLo, yHi] = paddedRange(ext.y0, ext.y1);
      const xSpan = ext.x1 - ext.x0 || 1;
      d = pts.map(([x, y], k) => {
        const px = ((x - ext.x0) / xSpan) * (width - 2) + 1;
        const py = height - 1 - ((y - yLo) / (yHi - yLo)) * (height - 2);
        return `${k ? 'L' : 'M'}${px.toFixed(1)},${py.toFixed(1)}`;
      }).join('');
    }
    this.path.setAttribute('d', d);
    this.container.dataset.points = String(pts.length);
  }
}

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

/** Points [step, value] of `key` from metric rows (later rows win for a repeated step). */
export function pointsOf(rows, key) {
  const byStep = new Map();
  for (const r of rows) {
    const v = r[key];
    if (typeof r.step === 'number' && typeof v === 'number' && Number.isFinite(v)) byStep.set(r.step, v);
  }
  return [...byStep.entries()].sort((a, b) => a[0] - b[0]);
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

/** The point of `pts` (sorted by x) nearest to `x`. */
function nearest(pts, x) {
  if (!pts.length) return null;
  let lo = 0;
  let hi = pts.length - 1;
  while (hi - lo > 1) {
    const mid = (lo + hi) >> 1;
    if (pts[mid][0] <= x) lo = mid; else hi = mid;
  }
  return Math.abs(pts[lo][0] - x) <= Math.abs(pts[hi][0] - x) ? pts[lo] : pts[hi];
}

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
 * points per label; `band`, with the `band` option, [x, lo, hi] points shaded around the first
 * series). Options: `yTitle` (the y axis' title, with its unit) and `xTitle` (default "step");
 * `bytes` (binary-unit ticks), `count` (an axis from 0 with whole ticks), `nonNegative` (never
 * an axis below 0), `percent` (ticks and values read as "12.5%"), `yFormat` (legend values). The container gets `data-points` (points
 * of the first series), `data-series` (series with points), `data-band` (band points),
 * `data-y-title` / `data-x-title`, and after each draw `data-y-ticks` (the y tick labels as
 * drawn, JSON), `data-y-axis` and `data-y-labels` (the y axis' width and its widest label's, in
 * CSS pixels), so that tests can see the chart fill up and read its axes.
 */
export class LineChart {
  constructor(container, { title, labels, height = 216, yFormat, bytes = false, count = false, nonNegative = false, percent = false, yTitle = '', xTitle = 'step', band = null } = {}) {
    this.container = container;
    this.labels = labels;
    this.height = height;
    this.bytes = bytes;
    this.count = count;
    this.nonNegative = nonNegative || bytes || count;
    this.percent = percent;
    this.yTitle = yTitle;
    this.xTitle = xTitle;
    const plain = percent ? formatPercent : formatValue;
    this.format = (v) => (v === null || v === undefined ? '–' : yFormat ? yFormat(v) : plain(v));
    this.series = labels.map(() => []);
    this.band = [];
    container.classList.add('chart');
    container.dataset.yTitle = yTitle;
    container.dataset.xTitle = xTitle;
    container.append(Object.assign(document.createElement('h3'), { textContent: title }));
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
    new ResizeObserver(() => {
      if (Math.abs(this.chartWidth() - this.width) > 4) this.draw();
    }).observe(container);
    this.set(this.series);
  }

  chartWidth() {
    return Math.max(300, this.container.clientWidth - 24 || 400);
  }

  set(seriesPoints, band = []) {
    this.series = seriesPoints.map((pts) => pts.filter(([x, y]) => Number.isFinite(x) && Number.isFinite(y)));
    this.band = this.bandValue ? band.filter((p) => p.every(Number.isFinite)) : [];
    this.container.dataset.points = String(this.series[0] ? this.series[0].length : 0);
    this.container.dataset.series = String(this.series.filter((p) => p.length > 0).length);
    this.container.dataset.band = String(this.band.length);
    this.draw();
  }

  /** The y ticks of [lo, hi] and their labels. */
  yTicks(lo, hi) {
    if (this.bytes) {
      const k = byteUnit(Math.max(Math.abs(lo), Math.abs(hi)));
      const t = niceTicks(lo, hi, 4, 1024 ** k, k === 0);
      return { values: t.values, labels: formatBytesTicks(t.values, t.step, k) };
    }
    const t = niceTicks(lo, hi, 4, 1, this.count);
    const labels = formatTicks(t.values, t.step);
    return { values: t.values, labels: this.percent ? labels.map((l) => (l === '' ? l : `${l}%`)) : labels };
  }

  draw() {
    const width = this.chartWidth();
    const height = this.height;
    this.width = width;
    this.svg.setAttribute('width', width);
    this.svg.setAttribute('viewBox', `0 0 ${width} ${height}`);
    this.svg.replaceChildren();
    const ext = extent(this.series, this.band);
    const [xLo, xHi] = ext.empty ? [0, 1] : ext.x0 === ext.x1 ? [ext.x0 - 1, ext.x1 + 1] : [ext.x0, ext.x1];
    const [yLo, yHi] = ext.empty ? [0, 1] : axisRange(ext.y0, ext.y1, { count: this.count, nonNegative: this.nonNegative });
    const yt = this.yTicks(yLo, yHi);
    // As wide as the widest label: a fixed width cut "447.8 MiB" down to "7.8 MiB". The axis
    // titles take a line of their own (left, turned; below).
    const widest = Math.ceil(Math.max(0, ...yt.labels.map((l) => textWidth(l, AXIS_FONT))));
    const titleLine = 16;
    const box = { left: widest + 12 + (this.yTitle ? titleLine : 0), right: width - 10, top: 8, bottom: height - 22 - (this.xTitle ? titleLine - 2 : 0) };
    const sx = (x) => box.left + ((x - xLo) / (xHi - xLo)) * (box.right - box.left);
    const sy = (y) => box.bottom - ((y - yLo) / (yHi - yLo)) * (box.bottom - box.top);
    this.scale = { sx, xLo, xHi, box };

    const grid = svg('g', { class: 'grid' });
    yt.values.forEach((v, i) => {
      grid.append(svg('line', { x1: box.left, x2: box.right, y1: sy(v), y2: sy(v) }));
      const t = svg('text', { x: box.left - 6, y: sy(v) + 4, 'text-anchor': 'end' });
      t.textContent = yt.labels[i];
      grid.append(t);
    });
    const xt = niceTicks(xLo, xHi, Math.max(2, Math.floor((box.right - box.left) / 80)));
    const xLabels = formatTicks(xt.values, xt.step);
    xt.values.forEach((v, i) => {
      const t = svg('text', { x: sx(v), y: box.bottom + 16, 'text-anchor': 'middle' });
      t.textContent = xLabels[i];
      grid.append(t);
    });
    grid.append(svg('line', { class: 'axis', x1: box.left, x2: box.right, y1: box.bottom, y2: box.bottom }));
    if (this.yTitle) {
      const cy = (box.top + box.bottom) / 2;
      const t = svg('text', { class: 'axis-title y-title', x: 11, y: cy, 'text-anchor': 'middle', transform: `rotate(-90 11 ${cy})` });
      t.textContent = this.yTitle;
      grid.append(t);
    }
    if (this.xTitle) {
      const t = svg('text', { class: 'axis-title x-title', x: (box.left + box.right) / 2, y: height - 3, 'text-anchor': 'middle' });
      t.textContent = this.xTitle;
      grid.append(t);
    }
    this.svg.append(grid);
    if (this.band.length) {
      const upper = this.band.map(([x, , hi], k) => `${k ? 'L' : 'M'}${sx(x).toFixed(1)},${sy(hi).toFixed(1)}`);
      const lower = this.band.slice().reverse().map(([x, lo]) => `L${sx(x).toFixed(1)},${sy(lo).toFixed(1)}`);
      this.svg.append(svg('path', { class: 'band', d: `${upper.join('')}${lower.join('')}Z`, fill: COLORS[0], 'fill-opacity': 0.18, stroke: 'none' }));
    }
    this.series.forEach((pts, i) => {
      if (!pts.length) return;
      const d = pts.map(([x, y], k) => `${k ? 'L' : 'M'}${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join('');
      this.svg.append(svg('path', { d, fill: 'none', stroke: COLORS[i % COLORS.length], 'stroke-width': 1.5 }));
    });
    this.cursor = svg('line', { class: 'cursor', y1: box.top, y2: box.bottom, visibility: 'hidden' });
    this.svg.append(this.cursor);
    this.container.dataset.yTicks = JSON.stringify(yt.labels);
    this.container.dataset.yAxis = String(box.left);
    this.container.dataset.yLabels = String(widest);
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
    this.series.forEach((pts, i) => {
      const p = x === null ? pts[pts.length - 1] : nearest(pts, x);
      this.values[i].textContent = p ? this.format(p[1]) : '–';
    });
    if (this.bandValue) {
      const b = x === null ? this.band[this.band.length - 1] : nearest(this.band, x);
      this.bandValue.textContent = b ? `±${this.format((b[2] - b[1]) / 2)}` : '–';
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

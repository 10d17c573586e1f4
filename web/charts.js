// Charts on top of uPlot (npm `uplot`, served from node_modules: no build step).
import uPlot from '/node_modules/uplot/dist/uPlot.esm.js';

export const COLORS = ['#2563eb', '#dc2626', '#16a34a', '#9333ea', '#ea580c', '#0891b2', '#ca8a04', '#db2777'];

/** Aligns series of [x, y] points on the union of their x values (uPlot's data layout). */
export function align(seriesPoints) {
  const xs = [...new Set(seriesPoints.flatMap((pts) => pts.map((p) => p[0])))].sort((a, b) => a - b);
  const index = new Map(xs.map((x, i) => [x, i]));
  const ys = seriesPoints.map((pts) => {
    const y = new Array(xs.length).fill(null);
    for (const [x, v] of pts) y[index.get(x)] = v;
    return y;
  });
  return [xs, ...ys];
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
 * The y range: the data with 5% margins, widened to ±5% of the magnitude when the values are
 * (nearly) constant — uPlot finds no ticks in a span far below the values' precision (a learning
 * rate decaying by 1e-9 per step).
 */
function yRange(u, min, max) {
  if (min === null || max === null || !Number.isFinite(min) || !Number.isFinite(max)) return [0, 1];
  const magnitude = Math.max(Math.abs(min), Math.abs(max));
  const span = max - min;
  if (span <= magnitude * 1e-4) {
    const pad = magnitude ? magnitude * 0.05 : 1;
    return [min - pad, max + pad];
  }
  return [min - span * 0.05, max + span * 0.05];
}

/**
 * Tick labels for `splits` (multiples of `incr`): the fewest decimals (or, for magnitudes below
 * 0.01 or from 1e6 up, significant digits in exponent form) with which every label reads back
 * as its tick. uPlot's default formatter rounds to 3 decimals, which turns the ticks of a
 * learning rate near 1e-3 into "0.001, 0.001, 0".
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

/** The unit of a byte axis: that of its scale's larger end. */
function axisByteUnit(u) {
  const { min, max } = u.scales.y;
  return byteUnit(Math.max(Math.abs(min ?? 0), Math.abs(max ?? 0)));
}

/**
 * Tick steps of a byte axis: 1, 2 and 5 times powers of ten of the axis' unit (and at least a
 * byte), so that ticks fall on round numbers of what the labels show (0.05 MiB, 1 MiB, 2 GiB)
 * rather than on round numbers of bytes.
 */
export function byteIncrs(u) {
  const scale = 1024 ** axisByteUnit(u);
  const out = [];
  for (let e = -6; e <= 6; e++) for (const m of [1, 2, 5]) out.push(m * 10 ** e * scale);
  return out.filter((incr) => incr >= 1);
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

/**
 * A line chart in `container`: `set(seriesPoints)` replaces its data. The container gets
 * `data-points` (points of the first series), `data-series` (series with points), and after
 * each draw `data-y-ticks` (the y tick labels as drawn, JSON), `data-y-axis` and
 * `data-y-labels` (the y axis' width and its widest label's, in CSS pixels), so that tests can
 * see the chart fill up and read its axis.
 */
export class LineChart {
  constructor(container, { title, labels, height = 200, yFormat, bytes = false } = {}) {
    this.container = container;
    this.labels = labels;
    container.classList.add('chart');
    container.append(Object.assign(document.createElement('h3'), { textContent: title }));
    this.target = document.createElement('div');
    container.append(this.target);
    const width = Math.max(300, container.clientWidth - 24 || 400);
    const ticks = bytes ? (u, splits, incr) => formatBytesTicks(splits, incr, axisByteUnit(u)) : (u, splits, incr) => formatTicks(splits, incr);
    const value = (u, v) => (v === null || v === undefined ? '–' : yFormat ? yFormat(v) : formatValue(v));
    this.plot = new uPlot({
      width,
      height,
      scales: { x: { time: false }, y: { range: yRange } },
      axes: [
        { label: 'step' },
        {
          incrs: bytes ? byteIncrs : undefined,
          values: (u, splits, axisIdx, space, incr) => ticks(u, splits, incr),
          // As wide as the widest label: a fixed width cut "447.8 MiB" down to "7.8 MiB".
          size: (u, values, axisIdx) => {
            if (!values) return 50;
            const axis = u.axes[axisIdx];
            const font = axis.font ? axis.font[0].replace(/[\d.]+px/, `${axis.font[2]}px`) : '12px sans-serif';
            const widest = Math.max(0, ...values.map((v) => textWidth(String(v), font)));
            this.container.dataset.yLabels = String(Math.ceil(widest));
            return Math.ceil(widest + (axis.ticks?.size ?? 10) + (axis.gap ?? 5) + 6);
          },
        },
      ],
      series: [
        { label: 'step' },
        ...labels.map((label, i) => ({ label, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true, points: { show: false }, value })),
      ],
      legend: { live: true },
      hooks: {
        draw: [(u) => {
          const y = u.axes[1];
          this.container.dataset.yTicks = JSON.stringify(y._values || []);
          this.container.dataset.yAxis = String(Math.round(y._size || 0));
        }],
      },
    }, align(labels.map(() => [])), this.target);
    this.set(labels.map(() => []));
    new ResizeObserver(() => {
      const w = Math.max(300, container.clientWidth - 24);
      if (Math.abs(w - this.plot.width) > 4) this.plot.setSize({ width: w, height });
    }).observe(container);
  }

  set(seriesPoints) {
    this.plot.setData(align(seriesPoints));
    this.container.dataset.points = String(seriesPoints[0] ? seriesPoints[0].length : 0);
    this.container.dataset.series = String(seriesPoints.filter((p) => p.length > 0).length);
  }
}

/** A legend value: four significant digits (uPlot's default keeps only three decimals). */
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
    this.plot = new uPlot({
      width,
      height,
      class: 'spark',
      cursor: { show: false },
      legend: { show: false },
      select: { show: false },
      scales: { x: { time: false } },
      axes: [{ show: false }, { show: false }],
      series: [{}, { stroke: color, width: 1.25, points: { show: false }, spanGaps: true }],
    }, [[], []], container);
    this.set([]);
  }

  set(points) {
    this.plot.setData(align([points]));
    this.container.dataset.points = String(points.length);
  }
}

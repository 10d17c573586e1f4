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
 * A line chart in `container`: `set(seriesPoints)` replaces its data. The container gets
 * `data-points` (points of the first series) and `data-series` (series with points) so that
 * tests can see the chart fill up.
 */
export class LineChart {
  constructor(container, { title, labels, height = 200, yFormat } = {}) {
    this.container = container;
    this.labels = labels;
    container.classList.add('chart');
    container.append(Object.assign(document.createElement('h3'), { textContent: title }));
    this.target = document.createElement('div');
    container.append(this.target);
    const width = Math.max(300, container.clientWidth - 24 || 400);
    this.plot = new uPlot({
      width,
      height,
      scales: { x: { time: false }, y: { range: yRange } },
      axes: [
        { label: 'step' },
        { size: 60, values: yFormat ? (u, vals) => vals.map(yFormat) : undefined },
      ],
      series: [
        { label: 'step' },
        ...labels.map((label, i) => ({ label, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true, points: { show: false } })),
      ],
      legend: { live: true },
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

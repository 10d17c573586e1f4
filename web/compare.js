// Compare runs: pick runs and a metric; their curves are overlaid on one chart per metric.
import { api, el, layout, param, statusBadge, every, showError } from './app.js';
import { LineChart, pointsOf } from './charts.js';

const main = layout();
const METRICS = ['loss', 'val_loss', 'lr', 'grad_norm', 'tokens_per_s', 'mfu', 'mem_peak_bytes'];
const chosen = new Set((param('ids') || '').split(',').map(Number).filter((n) => n > 0));
const picks = el('div', { class: 'pill-list', id: 'run-picks' });
const metricPicks = el('div', { class: 'pill-list', id: 'metric-picks' });
const chartsBox = el('div', { class: 'charts', id: 'charts' });
const message = el('div');
const shownMetrics = new Set(['loss', 'val_loss']);

main.append(
  el('h1', {}, 'Compare runs'),
  message,
  el('div', { class: 'panel' }, el('h2', {}, 'Runs'), picks, el('h2', { style: 'margin-top:10px' }, 'Metrics'), metricPicks),
  chartsBox,
);

for (const m of METRICS) {
  metricPicks.append(el('label', {}, el('input', { type: 'checkbox', checked: shownMetrics.has(m), onchange: (e) => {
    if (e.target.checked) shownMetrics.add(m); else shownMetrics.delete(m);
    draw();
  } }), m));
}

let runs = [];
const data = new Map(); // run id -> metric rows

function syncUrl() {
  history.replaceState(null, '', `/compare.html?ids=${[...chosen].join(',')}`);
}

async function loadRuns() {
  runs = await api('/api/runs');
  picks.replaceChildren(...runs.map((r) => el('label', {},
    el('input', { type: 'checkbox', 'data-run': r.id, checked: chosen.has(r.id), onchange: (e) => {
      if (e.target.checked) chosen.add(r.id); else chosen.delete(r.id);
      syncUrl();
      refresh();
    } }), `${r.id} · ${r.name} `, statusBadge(r.status))));
}

async function refresh() {
  const ids = [...chosen];
  await Promise.all(ids.map(async (id) => {
    const run = runs.find((r) => r.id === id);
    if (data.has(id) && run && run.status !== 'running' && run.status !== 'queued') return;
    data.set(id, await api(`/api/runs/${id}/metrics?max_points=2000`));
  }));
  draw();
}

let drawn = '';
function draw() {
  const ids = [...chosen].filter((id) => data.has(id));
  const signature = JSON.stringify([ids, [...shownMetrics], ids.map((id) => data.get(id).length)]);
  if (signature === drawn) return;
  drawn = signature;
  const labels = ids.map((id) => `${id} · ${(runs.find((r) => r.id === id) || {}).name || ''}`);
  chartsBox.replaceChildren();
  for (const metric of METRICS.filter((m) => shownMetrics.has(m))) {
    const series = ids.map((id) => pointsOf(data.get(id), metric));
    if (!series.some((s) => s.length)) continue;
    const box = el('div', { 'data-chart': metric });
    chartsBox.append(box);
    new LineChart(box, { title: metric, labels }).set(series);
  }
  if (!chartsBox.children.length) {
    chartsBox.append(el('p', { class: 'muted' }, ids.length ? 'No data for these metrics yet.' : 'Pick runs above.'));
  }
}

every(3000, async () => {
  try {
    await loadRuns();
    await refresh();
  } catch (e) {
    showError(message, e);
  }
});

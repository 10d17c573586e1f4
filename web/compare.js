// Compare runs (training and RL): pick runs and metrics; their curves are overlaid on one chart
// per metric.
import { api, el, layout, param, statusBadge, every, showError } from './app.js';
import { LineChart } from './charts.js';
import { chartOptions, fieldInfo, fieldPoints } from './metrics.js';
import { ChartSettings, X_AXES, hasAxis, xOf } from './chart-settings.js';

const main = layout();
const TRAIN_METRICS = ['loss', 'val_loss', 'lr', 'grad_norm', 'tokens_per_s', 'mfu', 'mem_peak_bytes', 'state_bytes'];
const RL_METRICS = ['reward_mean', 'reward_std', 'accuracy', 'eval_accuracy', 'response_len_mean', 'entropy', 'kl_ref',
  'logprob_mismatch_max', 'staleness_mean', 't_rollout', 't_reward', 't_train', 'samples_per_s'];
const METRICS = [...TRAIN_METRICS, ...RL_METRICS.filter((m) => !TRAIN_METRICS.includes(m))];
// An RL run's row at step 0 carries only the held-out accuracy before training. `x` places a row
// on the x axis (chart-settings.js `xOf`, from all of the run's rows).
const pointsFor = (rows, metric, x) => fieldPoints(metric === 'eval_accuracy' ? rows : rows.filter((r) => r.step > 0 || !('reward_mean' in r)), metric, x);
const chosen = new Set((param('ids') || '').split(',').map(Number).filter((n) => n > 0));
const picks = el('div', { class: 'pill-list', id: 'run-picks' });
const metricPicks = el('div', { class: 'pill-list', id: 'metric-picks' });
const chartsBox = el('div', { class: 'charts', id: 'charts' });
const message = el('div');
// The same controls as a run's page; they redraw every chart (a log toggle only its own).
const settings = new ChartSettings(() => draw());
const xNote = el('p', { class: 'muted', id: 'x-axis-note', hidden: true });
const shownMetrics = new Set(['loss', 'val_loss']);
const metricBoxes = new Map();
let rlDefaults = false;

main.append(
  el('h1', {}, 'Compare runs'),
  message,
  el('div', { class: 'panel' }, el('h2', {}, 'Runs'), picks, el('h2', { style: 'margin-top:10px' }, 'Metrics'), metricPicks),
  settings.controls(),
  xNote,
  chartsBox,
);

for (const m of METRICS) {
  const box = el('input', { type: 'checkbox', 'data-metric': m, checked: shownMetrics.has(m), onchange: (e) => {
    if (e.target.checked) shownMetrics.add(m); else shownMetrics.delete(m);
    draw();
  } });
  metricBoxes.set(m, box);
  metricPicks.append(el('label', {}, box, m));
}

/** The first time an RL run is among the chosen, its headline metrics are shown too. */
function showRlDefaults() {
  if (rlDefaults || ![...chosen].some((id) => (runs.find((r) => r.id === id) || {}).kind === 'rl')) return;
  rlDefaults = true;
  for (const m of ['reward_mean', 'eval_accuracy']) {
    shownMetrics.add(m);
    metricBoxes.get(m).checked = true;
  }
}

let runs = [];
const data = new Map(); // run id -> metric rows

/** Puts the chosen runs in the URL, next to the chart settings' parameters. */
function syncUrl() {
  const q = new URLSearchParams(location.search);
  q.set('ids', [...chosen].join(','));
  history.replaceState(null, '', `/compare.html?${q.toString().replace(/%2C/g, ',')}`);
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
  showRlDefaults();
  draw();
}

let drawn = '';
function draw() {
  const ids = [...chosen].filter((id) => data.has(id));
  // The tokens axis needs a run with a token count; runs without one (RL runs) are left out of
  // it, and said so.
  const lacking = (axis) => ids.filter((id) => !hasAxis(axis, data.get(id)));
  if (ids.length) {
    settings.setAvailable('tokens', lacking('tokens').length < ids.length, 'none of these runs has a token count (anneal rl writes none)');
    settings.setAvailable('time', lacking('time').length < ids.length, 'none of these runs has a time');
  }
  const axis = settings.xAxis();
  const left = axis === 'step' ? [] : lacking(axis);
  xNote.hidden = !left.length;
  xNote.textContent = left.length ? `Not on the ${X_AXES[axis].label} axis (their rows lack it): run ${left.join(', ')}.` : '';
  const signature = JSON.stringify([ids, [...shownMetrics], ids.map((id) => data.get(id).length), axis, settings.smoothing]);
  if (signature === drawn) return;
  drawn = signature;
  const labels = ids.map((id) => `${id} · ${(runs.find((r) => r.id === id) || {}).name || ''}`);
  const xs = new Map(ids.map((id) => [id, xOf(axis, data.get(id))]));
  chartsBox.replaceChildren();
  for (const metric of METRICS.filter((m) => shownMetrics.has(m))) {
    const series = ids.map((id) => pointsFor(data.get(id), metric, xs.get(id)));
    if (!series.some((s) => s.length)) continue;
    const box = el('div', { 'data-chart': metric });
    chartsBox.append(box);
    new LineChart(box, {
      title: `${fieldInfo(metric).title} · ${metric}`, labels, ...chartOptions(metric),
      xKind: axis, xTitle: X_AXES[axis].title, smoothing: settings.smoothing,
      logY: settings.isLog(metric), onLog: (on) => settings.setLog(metric, on),
    }).set(series);
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

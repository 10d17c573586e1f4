// The runs table: kind, status, progress, the latest headline metrics (loss and validation loss
// of a training run; reward and held-out accuracy of an RL run) and a live mini-curve of the
// loss (or the mean reward) per run.
import { api, el, layout, statusBadge, fmt, fmtTime, every, showError } from './app.js';
import { Sparkline, pointsOf } from './charts.js';

const main = layout();
const message = el('div');
const tbody = el('tbody');
const compareButton = el('button', { id: 'compare-selected', disabled: true, onclick: compareSelected }, 'Compare selected');
main.append(
  el('h1', {}, 'Runs', el('a', { class: 'button primary', href: '/new.html', id: 'new-run' }, 'New run'), compareButton),
  message,
  el('div', { class: 'panel' }, el('table', { id: 'runs' },
    el('thead', {}, el('tr', {}, ['', 'id', 'name', 'kind', 'status', 'step', 'loss / reward', 'val loss / eval acc', 'curve', 'started', ''].map((h) => el('th', {}, h)))),
    tbody)),
);

const rows = new Map(); // id -> {tr, cells, spark, lastFetch, status}
const selected = new Set();

function compareSelected() {
  location.href = `/compare.html?ids=${[...selected].join(',')}`;
}

async function act(id, what) {
  try {
    if (what === 'delete') {
      if (!confirm(`Delete run ${id} and its directory?`)) return;
      await api(`/api/runs/${id}`, { method: 'DELETE' });
    } else {
      await api(`/api/runs/${id}/${what}`, { method: 'POST' });
    }
    await refresh();
  } catch (e) {
    showError(message, e);
  }
}

function rowFor(run) {
  let r = rows.get(run.id);
  if (r) return r;
  const check = el('input', { type: 'checkbox', 'aria-label': `select run ${run.id}`, onchange: (e) => {
    if (e.target.checked) selected.add(run.id); else selected.delete(run.id);
    compareButton.disabled = selected.size < 1;
  } });
  const spark = el('div', { class: 'spark-cell' });
  const cells = {
    status: el('td'), step: el('td', { class: 'num' }), loss: el('td', { class: 'num' }),
    val: el('td', { class: 'num' }), started: el('td', { class: 'muted' }), actions: el('td'),
  };
  const tr = el('tr', { 'data-run': run.id },
    el('td', {}, check), el('td', {}, el('a', { href: `/run.html?id=${run.id}` }, run.id)),
    el('td', {}, el('a', { href: `/run.html?id=${run.id}` }, run.name)),
    el('td', { class: 'muted', 'data-kind': run.kind }, run.kind),
    cells.status, cells.step, cells.loss, cells.val, el('td', {}, spark), cells.started, cells.actions);
  r = { tr, cells, spark: new Sparkline(spark), lastFetch: 0, status: null };
  rows.set(run.id, r);
  return r;
}

async function refresh() {
  const runs = await api('/api/runs');
  message.replaceChildren();
  if (runs.length === 0) {
    tbody.replaceChildren(el('tr', {}, el('td', { colspan: 11, class: 'muted' }, 'No runs yet. ', el('a', { href: '/new.html' }, 'Start one.'))));
    return;
  }
  const order = [];
  for (const run of runs) {
    const r = rowFor(run);
    const latest = run.latest || {};
    r.cells.status.replaceChildren(statusBadge(run.status));
    if (run.exit_reason) r.cells.status.title = run.exit_reason;
    r.cells.step.textContent = fmt(latest.step);
    const rl = run.kind === 'rl';
    r.cells.loss.textContent = fmt(rl ? latest.reward_mean : latest.loss);
    r.cells.val.textContent = fmt(rl ? latest.eval_accuracy : latest.val_loss);
    r.cells.started.textContent = fmtTime(run.started_at || run.created_at);
    const active = run.status === 'running' || run.status === 'queued';
    // Stop while active, resume once stopped or failed; a completed run has nothing to resume.
    r.cells.actions.replaceChildren(
      active
        ? el('button', { onclick: () => act(run.id, 'stop') }, 'Stop')
        : run.status === 'completed' ? ''
          : el('button', { 'data-resume': run.id, onclick: () => act(run.id, 'resume') }, 'Resume'),
      ' ',
      el('button', { class: 'danger', disabled: active, onclick: () => act(run.id, 'delete') }, 'Delete'),
    );
    // Mini-curves: refreshed every few seconds while running, once more after a change.
    const stale = Date.now() - r.lastFetch > 4000;
    if ((run.status === 'running' && stale) || r.status !== run.status) {
      r.lastFetch = Date.now();
      const key = rl ? 'reward_mean' : 'loss';
      api(`/api/runs/${run.id}/metrics?fields=${key}&max_points=80`)
        .then((m) => r.spark.set(pointsOf(rl ? m.filter((row) => row.step > 0) : m, key)))
        .catch(() => {});
    }
    r.status = run.status;
    order.push(r.tr);
  }
  for (const id of [...rows.keys()]) {
    if (!runs.some((run) => run.id === id)) rows.delete(id);
  }
  tbody.replaceChildren(...order);
}

every(2000, () => refresh().catch((e) => showError(message, e)));

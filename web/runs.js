// The runs table: status, progress, latest loss and a live mini-curve of the loss per run.
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
    el('thead', {}, el('tr', {}, ['', 'id', 'name', 'status', 'step', 'loss', 'val loss', 'curve', 'started', ''].map((h) => el('th', {}, h)))),
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
    cells.status, cells.step, cells.loss, cells.val, el('td', {}, spark), cells.started, cells.actions);
  r = { tr, cells, spark: new Sparkline(spark), lastFetch: 0, status: null };
  rows.set(run.id, r);
  return r;
}

async function refresh() {
  const runs = await api('/api/runs');
  message.replaceChildren();
  if (runs.length === 0) {
    tbody.replaceChildren(el('tr', {}, el('td', { colspan: 10, class: 'muted' }, 'No runs yet. ', el('a', { href: '/new.html' }, 'Start one.'))));
    return;
  }
  const order = [];
  for (const run of runs) {
    const r = rowFor(run);
    const latest = run.latest || {};
    r.cells.status.replaceChildren(statusBadge(run.status));
    if (run.exit_reason) r.cells.status.title = run.exit_reason;
    r.cells.step.textContent = fmt(latest.step);
    r.cells.loss.textContent = fmt(latest.loss);
    r.cells.val.textContent = fmt(latest.val_loss);
    r.cells.started.textContent = fmtTime(run.started_at || run.created_at);
    const active = run.status === 'running' || run.status === 'queued';
    r.cells.actions.replaceChildren(
      active
        ? el('button', { onclick: () => act(run.id, 'stop') }, 'Stop')
        : el('button', { onclick: () => act(run.id, 'resume') }, 'Resume'),
      ' ',
      el('button', { class: 'danger', disabled: active, onclick: () => act(run.id, 'delete') }, 'Delete'),
    );
    // Mini-curves: refreshed every few seconds while running, once more after a change.
    const stale = Date.now() - r.lastFetch > 4000;
    if ((run.status === 'running' && stale) || r.status !== run.status) {
      r.lastFetch = Date.now();
      api(`/api/runs/${run.id}/metrics?fields=loss&max_points=80`)
        .then((m) => r.spark.set(pointsOf(m, 'loss')))
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

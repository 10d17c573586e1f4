// One run: live charts (metric rows streamed over Server-Sent Events), status, stop/resume,
// logs, checkpoints, config, and a sampling box.
import { api, events, el, layout, param, statusBadge, fmt, fmtBytes, fmtTime, fmtDuration, every, showError } from './app.js';
import { LineChart, pointsOf } from './charts.js';

const main = layout();
const id = param('id');

// The charts every training run has; any other numeric metric (RL metrics, for instance) gets
// a chart of its own when it first appears.
const CHARTS = [
  { id: 'loss', title: 'Loss', keys: ['loss', 'val_loss'], labels: ['train', 'validation'] },
  { id: 'lr', title: 'Learning rate', keys: ['lr'] },
  { id: 'tokens_per_s', title: 'Tokens / s', keys: ['tokens_per_s'] },
  { id: 'mfu', title: 'MFU', keys: ['mfu'] },
  { id: 'mem', title: 'Peak memory', keys: ['mem_peak_bytes'], yFormat: fmtBytes },
  { id: 'grad_norm', title: 'Gradient norm', keys: ['grad_norm'] },
  { id: 'tflops', title: 'TFLOP/s', keys: ['tflops'] },
];
const NOT_CHARTED = new Set(['step', 'time', 'epoch', 'tokens', 'elapsed_s']);

const title = el('span', {}, `Run ${id}`);
const badge = el('span', { id: 'run-status' });
const stopBtn = el('button', { id: 'stop', onclick: () => act('stop') }, 'Stop');
const resumeBtn = el('button', { id: 'resume', onclick: () => act('resume') }, 'Resume');
const compareLink = el('a', { class: 'button', href: `/compare.html?ids=${id}` }, 'Compare…');
const message = el('div');
const facts = el('div', { class: 'muted', id: 'run-facts' });
const chartsBox = el('div', { class: 'charts', id: 'charts' });
const logs = el('pre', { class: 'logs', id: 'logs' });
const ckptBody = el('tbody');
const configText = el('pre', { class: 'toml', id: 'config' });

main.append(
  el('h1', {}, title, badge, stopBtn, resumeBtn, compareLink),
  message,
  el('div', { class: 'panel' }, facts),
  chartsBox,
  el('div', { class: 'row', style: 'margin-top:16px' },
    el('div', { class: 'panel grow' }, el('h2', {}, 'Log'), logs),
    el('div', { class: 'panel grow' },
      el('h2', {}, 'Checkpoints'),
      el('table', { id: 'checkpoints' }, el('thead', {}, el('tr', {}, ['step', 'size', 'written', 'files'].map((h) => el('th', {}, h)))), ckptBody),
      samplingBox())),
  el('div', { class: 'panel' }, el('details', {}, el('summary', {}, 'Config and overrides'), configText)),
);

const rows = [];
const charts = new Map();

function chartFor(spec) {
  let c = charts.get(spec.id);
  if (!c) {
    const box = el('div', { 'data-chart': spec.id });
    chartsBox.append(box);
    c = { spec, chart: new LineChart(box, { title: spec.title, labels: spec.labels || spec.keys, yFormat: spec.yFormat }) };
    charts.set(spec.id, c);
  }
  return c;
}

let drawPending = false;
function redraw() {
  if (drawPending) return;
  drawPending = true;
  setTimeout(() => {
    drawPending = false;
    const present = new Set(rows.flatMap((r) => Object.keys(r)));
    const known = new Set(CHARTS.flatMap((c) => c.keys));
    const specs = CHARTS.filter((c) => c.keys.some((k) => present.has(k)));
    for (const key of present) {
      if (!known.has(key) && !NOT_CHARTED.has(key) && rows.some((r) => typeof r[key] === 'number')) {
        specs.push({ id: key, title: key, keys: [key] });
      }
    }
    for (const spec of specs) chartFor(spec).chart.set(spec.keys.map((k) => pointsOf(rows, k)));
  }, 150);
}

let run = null;
function showRun(r) {
  run = r;
  title.textContent = `${r.name} · run ${r.id}`;
  document.title = `${r.name} · Anneal`;
  badge.replaceChildren(statusBadge(r.status));
  const active = r.status === 'running' || r.status === 'queued';
  stopBtn.disabled = !active;
  resumeBtn.disabled = active;
  const ran = r.started_at ? fmtDuration((r.finished_at || Date.now()) - r.started_at) : '–';
  facts.replaceChildren(...[
    el('div', {}, `config: ${r.config_path || 'inline TOML'}`, r.overrides.length ? ` · overrides: ${r.overrides.join(' ')}` : ''),
    el('div', {}, `created ${fmtTime(r.created_at)} · attempts ${r.attempts} · last attempt ${ran} · dir ${r.run_dir}`),
    r.exit_reason ? el('div', { class: r.status === 'failed' ? 'error' : '', id: 'exit-reason' }, r.exit_reason) : null,
  ].filter(Boolean));
}

async function act(what) {
  try {
    showRun(await api(`/api/runs/${id}/${what}`, { method: 'POST' }));
  } catch (e) {
    showError(message, e);
  }
}

let source = null;
function connect() {
  if (source) source.close();
  const since = rows.length ? Math.max(...rows.map((r) => r.step ?? -Infinity)) : undefined;
  source = events(`/api/runs/${id}/events${since !== undefined && Number.isFinite(since) ? `?since=${since}` : ''}`);
  source.addEventListener('status', (e) => showRun(JSON.parse(e.data)));
  source.addEventListener('metric', (e) => { rows.push(JSON.parse(e.data)); redraw(); });
  source.onerror = () => {
    // The browser reconnects by itself; rows already shown are skipped by `since`.
    source.close();
    setTimeout(connect, 2000);
  };
}

async function refreshSide() {
  const [now, log, ckpts] = await Promise.all([
    api(`/api/runs/${id}`),
    api(`/api/runs/${id}/logs?tail=300`),
    api(`/api/runs/${id}/checkpoints`),
  ]);
  // Status events are the fast path; this poll repairs a stop/resume answer that arrived after
  // the event of the change it caused.
  showRun(now);
  const atBottom = logs.scrollTop + logs.clientHeight >= logs.scrollHeight - 8;
  logs.textContent = log.lines.join('\n') || '(no output yet)';
  if (atBottom) logs.scrollTop = logs.scrollHeight;
  ckptBody.replaceChildren(...(ckpts.length ? ckpts.slice().reverse().map((c) =>
    el('tr', {}, el('td', { class: 'num' }, c.step), el('td', {}, fmtBytes(c.bytes)), el('td', {}, fmtTime(c.modified)), el('td', { class: 'muted' }, c.files.join(', '))))
    : [el('tr', {}, el('td', { colspan: 4, class: 'muted' }, 'none yet'))]));
}

function samplingBox() {
  const prompt = el('input', { id: 'sample-prompt', placeholder: 'prompt text, or token ids like 5,17,33', size: 40 });
  const maxNew = el('input', { id: 'sample-max', type: 'number', value: 32, min: 1, max: 4096, style: 'width:6em' });
  const temp = el('input', { id: 'sample-temp', type: 'number', value: 0.8, step: 0.1, min: 0, style: 'width:5em' });
  const out = el('div', { id: 'sample-output' });
  const go = async (e) => {
    e.preventDefault();
    out.replaceChildren(el('span', { class: 'muted' }, 'sampling…'));
    const p = prompt.value.trim();
    const asTokens = /^\d+(\s*,\s*\d+)*$/.test(p);
    try {
      const res = await api(`/api/runs/${id}/generate`, { method: 'POST', body: {
        ...(asTokens ? { prompt_tokens: p.split(',').map(Number) } : { prompt: p }),
        max_new_tokens: Number(maxNew.value), temperature: Number(temp.value),
      } });
      out.replaceChildren(el('div', { class: 'muted' }, `from ${res.checkpoint}`),
        el('pre', { class: 'toml' }, res.text ?? res.completion ?? JSON.stringify(res.tokens)));
    } catch (err) {
      showError(out, err);
    }
  };
  return el('form', { onsubmit: go, id: 'sampling' },
    el('h2', { style: 'margin-top:16px' }, 'Sample from the newest checkpoint'),
    prompt, ' max ', maxNew, ' temp ', temp, ' ', el('button', { type: 'submit' }, 'Generate'), out);
}

(async () => {
  try {
    const r = await api(`/api/runs/${id}`);
    showRun(r);
    configText.textContent = r.config + (r.overrides.length ? `\n# overrides\n${r.overrides.join('\n')}` : '');
    connect();
    every(2000, refreshSide);
    every(1000, () => { if (run && run.status === 'running') showRun(run); });
  } catch (e) {
    showError(message, e);
  }
})();

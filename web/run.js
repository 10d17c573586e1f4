// One run: live charts (metric rows streamed over Server-Sent Events; the RL set for RL runs),
// status, stop/resume, an RL run's samples, logs, checkpoints, config, and a sampling box.
import { api, events, el, layout, param, statusBadge, fmt, fmtBytes, fmtTime, fmtDuration, every, showError } from './app.js';
import { LineChart, pointsOf, formatValue } from './charts.js';
import { chartOptions, fieldInfo, fieldPoints } from './metrics.js';
import { SamplesView } from './samples.js';
import { ChartSettings, X_AXES, hasAxis, xOf } from './chart-settings.js';

const main = layout();
const id = param('id');

/**
 * A chart: `series` is [[label, field or rows => points], ...]; its axis reads as its first
 * field's (units, bytes, counts, percent: metrics.js) unless `options` say otherwise.
 */
const chart = (id, title, series, options = {}) => ({ id, title, series, ...chartOptions(series[0][1]), ...options });

// The charts of a training run; any other numeric metric gets a chart of its own when it
// first appears.
const TRAIN_CHARTS = [
  chart('loss', 'Loss', [['train', 'loss'], ['validation', 'val_loss']], { yTitle: 'cross-entropy (nats / token)' }),
  // Chat data only: held-out conversations whose replies greedy decoding writes exactly.
  chart('eval_accuracy', 'Held-out accuracy (greedy replies)', [['held-out', 'eval_accuracy']]),
  chart('lr', 'Learning rate', [['lr', 'lr']]),
  chart('tokens_per_s', 'Tokens / s', [['tokens/s', 'tokens_per_s']]),
  chart('mfu', 'MFU (model FLOPs utilization)', [['mfu', 'mfu']]),
  chart('mem', 'Peak memory', [['peak', 'mem_peak_bytes']]),
  chart('state_bytes', fieldInfo('state_bytes').title, [['rank 0', 'state_bytes']]),
  chart('comm_bytes', fieldInfo('comm_bytes').title, [['this rank', 'comm_bytes']]),
  chart('grad_norm', 'Gradient norm', [['norm', 'grad_norm']]),
  chart('tflops', 'TFLOP/s', [['TFLOP/s', 'tflops']]),
];

// An RL run's row at step 0 only carries the held-out accuracy before training: every other
// series starts at step 1.
const trained = (rows) => rows.filter((r) => r.step > 0);
/** The reward's mean ± std as one band: [x, mean − std, mean + std], x as `x(row)`. */
const rewardBand = (rows, x) => trained(rows)
  .filter((r) => typeof r.reward_mean === 'number' && typeof r.reward_std === 'number')
  .map((r) => [x(r), r.reward_mean - r.reward_std, r.reward_mean + r.reward_std])
  .filter(([at]) => Number.isFinite(at))
  .sort((a, b) => a[0] - b[0]);
const secondsFormat = (v) => `${formatValue(v)} s`;
const RL_CHARTS = [
  chart('reward', 'Reward (mean ± std)', [['mean', 'reward_mean']], { band: ['± std', rewardBand] }),
  chart('accuracy', 'Accuracy', [['samples', 'accuracy'], ['held-out (greedy)', (rows, x) => pointsOf(rows, 'eval_accuracy', x)]]),
  chart('response_len', 'Response length', [['mean', 'response_len_mean']], { yTitle: 'tokens (mean)' }),
  chart('entropy', 'Entropy', [['entropy', 'entropy']]),
  chart('kl', 'KL to the reference', [['k3', 'kl_ref']]),
  chart('mismatch', 'Logprob mismatch (max |rollout − trainer|)', [['max', 'logprob_mismatch_max']]),
  chart('staleness', 'Staleness', [['mean', 'staleness_mean']]),
  chart('timings', 'Time per step, by phase', [['rollout', 't_rollout'], ['reward', 't_reward'], ['train', 't_train'], ['wait', 't_wait']], { yTitle: 'seconds', yFormat: secondsFormat }),
  chart('loss', 'Loss', [['loss', 'loss']], { yTitle: 'policy loss' }),
  chart('grad_norm', 'Gradient norm', [['norm', 'grad_norm']]),
  chart('lr', 'Learning rate', [['lr', 'lr']]),
  chart('samples_per_s', 'Samples / s', [['samples/s', 'samples_per_s']]),
  chart('reward_errors', 'Reward errors', [['errors', 'reward_errors'], ['of which timeouts', 'reward_timeouts']], { yTitle: 'failed calls per step' }),
  chart('dropped', 'Dropped', [['groups (equal rewards)', 'dropped_groups'], ['stale rollouts', 'dropped_stale']], { yTitle: 'per step' }),
];
const MOE_CHARTS = {
  imbalance: { title: 'Expert load imbalance (max / mean tokens), by layer', yTitle: 'max / mean tokens per expert' },
  entropy: { title: 'Router entropy, by layer', yTitle: 'nats' },
};
const NOT_CHARTED = new Set(['step', 'time', 'wall_time', 'epoch', 'tokens', 'elapsed_s', 'reward_std']);

/** The points of each series of `spec` from the run's rows, placed at `x(row)` (default: step). */
function seriesPoints(spec, rows, x = xOf('step', rows)) {
  return spec.series.map(([, key]) => (typeof key === 'function' ? key(rows, x) : fieldPoints(spec.rl ? trained(rows) : rows, key, x)));
}

const title = el('span', {}, `Run ${id}`);
const badge = el('span', { id: 'run-status' });
const stopBtn = el('button', { id: 'stop', onclick: () => act('stop') }, 'Stop');
const resumeBtn = el('button', { id: 'resume', onclick: () => act('resume') }, 'Resume');
const compareLink = el('a', { class: 'button', href: `/compare.html?ids=${id}` }, 'Compare…');
const message = el('div');
const facts = el('div', { class: 'muted', id: 'run-facts' });
const chartsBox = el('div', { class: 'charts', id: 'charts' });
const samplesBox = el('div', { class: 'panel', id: 'samples', hidden: true, style: 'margin-top:16px' });
const logs = el('pre', { class: 'logs', id: 'logs' });
// A multi-process run: which rank's log to show (rank 0 writes the run's log).
const rankPick = el('select', { id: 'log-rank', hidden: true });
rankPick.addEventListener('change', () => refreshSide());
const ckptBody = el('tbody');
const configText = el('pre', { class: 'toml', id: 'config' });
// Smoothing and the x axis apply to every chart of the page (a log axis is each chart's own).
const settings = new ChartSettings(() => redraw());

main.append(
  el('h1', {}, title, badge, stopBtn, resumeBtn, compareLink),
  message,
  el('div', { class: 'panel' }, facts),
  settings.controls(),
  chartsBox,
  samplesBox,
  el('div', { class: 'row', style: 'margin-top:16px' },
    el('div', { class: 'panel grow' }, el('h2', {}, 'Log ', rankPick), logs),
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
    const labels = spec.series.map(([label]) => label);
    const { title, yTitle, yFormat, bytes, count, nonNegative, percent } = spec;
    c = { spec, chart: new LineChart(box, {
      title, labels, yTitle, yFormat, bytes, count, nonNegative, percent, band: spec.band ? spec.band[0] : null,
      logY: settings.isLog(spec.id), onLog: (on) => settings.setLog(spec.id, on),
    }) };
    charts.set(spec.id, c);
  }
  return c;
}

const isRl = () => run && run.kind === 'rl';

let drawPending = false;
function redraw() {
  if (drawPending || !run) return;
  drawPending = true;
  setTimeout(() => {
    drawPending = false;
    const chartSet = isRl() ? RL_CHARTS.map((c) => ({ ...c, rl: true })) : TRAIN_CHARTS;
    const present = new Set(rows.flatMap((r) => Object.keys(r)));
    const keysOf = (c) => c.series.map(([, k]) => k).filter((k) => typeof k === 'string');
    const known = new Set(chartSet.flatMap(keysOf));
    if (isRl()) ['reward_std', 'eval_accuracy'].forEach((k) => known.add(k));
    const specs = chartSet.filter((c) => seriesPoints(c, rows).some((p) => p.length));
    // A mixture of experts reports per layer (`moe.layer<i>.<name>`): one chart per name with a
    // series per layer.
    const perLayer = new Map();
    for (const key of present) {
      const m = /^moe\.layer(\d+)\.(.+)$/.exec(key);
      if (!m || !rows.some((r) => typeof r[key] === 'number')) continue;
      if (!perLayer.has(m[2])) perLayer.set(m[2], []);
      perLayer.get(m[2]).push([Number(m[1]), key]);
      known.add(key);
    }
    // The weighted auxiliary total and each named auxiliary loss, on one chart.
    const auxKeys = [...present].filter((k) => /^aux_loss\./.test(k)).sort();
    if (rows.some((r) => typeof r.aux_loss === 'number')) {
      specs.push({
        ...chart('aux_loss', 'Auxiliary loss (weighted total, and each)', [['total', 'aux_loss'], ...auxKeys.map((k) => [k.slice('aux_loss.'.length), k])]),
        rl: isRl(),
      });
      ['aux_loss', ...auxKeys].forEach((k) => known.add(k));
    }
    for (const [name, layers] of [...perLayer].sort()) {
      layers.sort((a, b) => a[0] - b[0]);
      const series = layers.map(([i, key]) => [`layer ${i}`, key]);
      // The run's summary over layers (`moe.imbalance`, `moe.imbalance_max`) joins its chart.
      for (const [label, key] of [['mean', `moe.${name}`], ['max', `moe.${name}_max`]]) {
        if (present.has(key)) {
          series.push([label, key]);
          known.add(key);
        }
      }
      const moe = MOE_CHARTS[name] || { title: `${name} by layer`, yTitle: name };
      specs.push({ ...chart(`moe.${name}`, moe.title, series), yTitle: moe.yTitle, rl: isRl() });
    }
    for (const key of present) {
      if (!known.has(key) && !NOT_CHARTED.has(key) && rows.some((r) => typeof r[key] === 'number')) {
        specs.push({ ...chart(key, fieldInfo(key).title, [[key, key]]), rl: isRl() });
      }
    }
    // An x axis the rows lack (tokens, for an RL run) falls back to step until they have it.
    if (rows.length) {
      settings.setAvailable('tokens', hasAxis('tokens', rows), 'these rows carry no token count (anneal rl writes none)');
      settings.setAvailable('time', hasAxis('time', rows), 'these rows carry no time');
    }
    const axis = settings.xAxis();
    const x = xOf(axis, rows);
    for (const spec of specs) {
      const { chart: c } = chartFor(spec);
      c.configure({ xKind: axis, xTitle: X_AXES[axis].title, smoothing: settings.smoothing });
      c.set(seriesPoints(spec, rows, x), spec.band ? spec.band[1](rows, x) : []);
    }
  }, 150);
}

let run = null;
let samplesView = null;
function showRun(r) {
  const first = !run;
  run = r;
  if (first) redraw();
  if (r.kind === 'rl' && !samplesView) {
    samplesView = new SamplesView(samplesBox, id);
    samplesBox.hidden = false;
  }
  if (samplesView) samplesView.refreshIfRunning(r.status);
  title.textContent = `${r.name} · ${r.kind === 'rl' ? 'RL run' : 'run'} ${r.id}`;
  document.title = `${r.name} · Anneal`;
  badge.replaceChildren(statusBadge(r.status));
  const active = r.status === 'running' || r.status === 'queued';
  stopBtn.disabled = !active;
  resumeBtn.disabled = active;
  // A completed run trained all its steps: there is nothing to resume (the API refuses it).
  resumeBtn.hidden = r.status === 'completed';
  const ran = r.started_at ? fmtDuration((r.finished_at || Date.now()) - r.started_at) : '–';
  facts.replaceChildren(...[
    el('div', {}, `config: ${r.config_path || 'inline TOML'}`, r.overrides.length ? ` · overrides: ${r.overrides.join(' ')}` : ''),
    el('div', {}, `created ${fmtTime(r.created_at)} · attempts ${r.attempts} · last attempt ${ran} · dir ${r.run_dir}`),
    progressLine(r),
    r.exit_reason ? el('div', { class: r.status === 'failed' ? 'error' : '', id: 'exit-reason' }, r.exit_reason) : null,
  ].filter(Boolean));
}

/** Seconds per step over the last rows (at most 20) of this process, or null. */
function secondsPerStep() {
  const timed = rows.filter((r) => typeof r.time === 'number' && r.step > 0).slice(-20);
  if (timed.length < 2) return null;
  const [a, b] = [timed[0], timed[timed.length - 1]];
  // A resumed process restarts neither `step` nor `time`, so the pair stays meaningful.
  return b.step > a.step && b.time > a.time ? (b.time - a.time) / (b.step - a.step) : null;
}

/** "step 120 / 500 · 3.1 s/step · ETA 19m 38s" while running; steps done of total otherwise. */
function progressLine(r) {
  const done = rows.length ? Math.max(...rows.map((x) => x.step ?? 0)) : 0;
  if (!r.total_steps) return null;
  const parts = [`step ${done} / ${r.total_steps}`];
  const rate = secondsPerStep();
  if (rate !== null) parts.push(`${rate < 1 ? rate.toPrecision(2) : rate.toFixed(1)} s/step`);
  if (rate !== null && r.status === 'running' && done < r.total_steps) {
    parts.push(`ETA ${fmtDuration((r.total_steps - done) * rate * 1000)}`);
  }
  return el('div', { id: 'run-progress' }, parts.join(' · '));
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
    api(`/api/runs/${id}/logs?tail=300&rank=${rankPick.value || 0}`),
    api(`/api/runs/${id}/checkpoints`),
  ]);
  // Status events are the fast path; this poll repairs a stop/resume answer that arrived after
  // the event of the change it caused.
  showRun(now);
  const atBottom = logs.scrollTop + logs.clientHeight >= logs.scrollHeight - 8;
  logs.textContent = log.lines.join('\n') || '(no output yet)';
  const ranks = log.ranks || [0];
  if (ranks.length > 1 && rankPick.options.length !== ranks.length) {
    const chosen = rankPick.value || '0';
    rankPick.replaceChildren(...ranks.map((r) => el('option', { value: String(r) }, `rank ${r}`)));
    rankPick.value = chosen;
    rankPick.hidden = false;
  }
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

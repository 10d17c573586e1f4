// The new-run form: pick a config file, edit its TOML, add overrides; the config is validated
// as you type and problems are shown by key path next to the form. A config with an [rl]
// section starts an RL run: pick its reward modules (with weights) from those uploaded and,
// optionally, its starting policy from another run's newest checkpoint.
import { api, el, layout, showError } from './app.js';

const main = layout();
const picker = el('select', { id: 'config-file' }, el('option', { value: '' }, '(inline TOML)'));
const name = el('input', { id: 'run-name', placeholder: 'defaults to the config name', size: 40 });
const text = el('textarea', { id: 'config-text', rows: 24, spellcheck: 'false' });
const overrides = el('textarea', { id: 'overrides', rows: 5, spellcheck: 'false', placeholder: 'one key.path=value per line, e.g.\ntraining.steps=100' });
const verdict = el('div', { id: 'validation', 'aria-live': 'polite' });
const resolved = el('pre', { class: 'toml', id: 'resolved' });
const submit = el('button', { class: 'primary', id: 'start-run', type: 'submit' }, 'Start run');
// RL jobs (a config with an [rl] section): reward modules picked from those uploaded, with
// weights, and optionally a starting policy from another run's checkpoint.
const rewardPicks = el('tbody');
const initFrom = el('select', { id: 'init-from' }, el('option', { value: '' }, '(as the config says: rl.init_from)'));
const kindNote = el('span', { id: 'run-kind', class: 'muted' });
const rlPanel = el('div', { id: 'rl-panel', hidden: true },
  el('label', {}, 'Reward modules'),
  el('p', { class: 'muted', style: 'margin:0 0 6px' }, 'Picked modules become rl.rewards: their rewards are summed by weight; a sample is correct when every module that reports "correct" agrees.'),
  el('table', { id: 'reward-picks' }, el('thead', {}, el('tr', {}, ['use', 'module', 'kind', 'weight'].map((h) => el('th', {}, h)))), rewardPicks),
  el('label', { for: 'init-from' }, 'Starting policy'), initFrom);
const message = el('div');

main.append(
  el('h1', {}, 'New run'),
  message,
  el('form', { id: 'new-run-form', onsubmit: start },
    el('div', { class: 'row' },
      el('div', { class: 'panel grow' },
        el('label', { for: 'config-file' }, 'Config'), picker,
        el('label', { for: 'run-name' }, 'Name'), name,
        el('label', { for: 'config-text' }, 'TOML'), text,
        el('label', { for: 'overrides' }, 'Overrides'), overrides,
        rlPanel,
        el('p', {}, submit, ' ', kindNote)),
      el('div', { class: 'panel grow' },
        el('h2', {}, 'Validation'), verdict,
        el('details', {}, el('summary', {}, 'Resolved config'), resolved)))),
);

// The file's text as loaded: when the text is unchanged, the run is created from the file
// (so the registry records which config it came from).
let loadedText = null;

function overrideLines() {
  return overrides.value.split('\n').map((l) => l.trim()).filter((l) => l && !l.startsWith('#'));
}

/** Whether the job is RL, by the server's rule: an [rl] table, or an rl.* override. */
function looksRl() {
  return /^\s*(\[rl\]|rl\.)/m.test(text.value) || overrideLines().some((l) => l.startsWith('rl.'));
}

function picked() {
  return [...rewardPicks.querySelectorAll('input[data-reward-id]')].filter((c) => c.checked).map((c) => ({
    id: Number(c.dataset.rewardId),
    weight: Number(rewardPicks.querySelector(`input[data-reward-weight="${c.dataset.rewardId}"]`).value),
  }));
}

function body() {
  const lines = overrideLines();
  const rl = !rlPanel.hidden;
  // JSON string syntax is TOML basic-string syntax.
  if (rl && initFrom.value) lines.push(`rl.init_from=${JSON.stringify(initFrom.value)}`);
  const extra = rl && picked().length ? { rewards: picked() } : {};
  const file = picker.value;
  if (file && text.value === loadedText) return { config_path: file, overrides: lines, ...extra };
  return { config: text.value, overrides: lines, ...extra };
}

function showKind() {
  const rl = looksRl();
  rlPanel.hidden = !rl;
  kindNote.textContent = rl ? 'an RL run (anneal rl)' : 'a training run (anneal train)';
  submit.textContent = rl ? 'Start RL run' : 'Start run';
}

async function loadRlChoices() {
  const [rewards, runs] = await Promise.all([api('/api/rewards'), api('/api/runs')]);
  rewardPicks.replaceChildren(...(rewards.length ? rewards.map((r) => el('tr', { 'data-reward': r.id },
    el('td', {}, el('input', { type: 'checkbox', 'data-reward-id': r.id, 'aria-label': `use ${r.name}`, onchange: scheduleValidation })),
    el('td', {}, r.name), el('td', { class: 'muted' }, r.kind),
    el('td', {}, el('input', { type: 'number', step: 'any', value: 1, 'data-reward-weight': r.id, style: 'width:6em', oninput: scheduleValidation }))))
    : [el('tr', {}, el('td', { colspan: 4, class: 'muted' }, 'No modules uploaded yet: ', el('a', { href: '/rewards.html' }, 'upload one'), '.'))]));
  // The newest checkpoint of each finished run can start the policy.
  const finished = runs.filter((r) => !['queued', 'running'].includes(r.status)).slice(0, 20);
  const options = await Promise.all(finished.map(async (r) => {
    const ckpts = await api(`/api/runs/${r.id}/checkpoints`).catch(() => []);
    const newest = ckpts[ckpts.length - 1];
    return newest && el('option', { value: `${r.run_dir}/checkpoints/${newest.name}`, 'data-run': r.id }, `run ${r.id} · ${r.name} · ${newest.name}`);
  }));
  initFrom.append(...options.filter(Boolean));
}
initFrom.addEventListener('change', scheduleValidation);

function showProblems(err) {
  const problems = (err.body && err.body.errors) || [{ key_path: null, message: err.message }];
  verdict.replaceChildren(el('ul', { class: 'errors' }, problems.map((p) =>
    el('li', { 'data-key-path': p.key_path || '' }, p.key_path ? el('code', {}, p.key_path) : null, p.key_path ? ' ' : null, p.message))));
  resolved.textContent = '';
}

let seq = 0;
async function validate() {
  const mine = ++seq;
  const badWeight = rlPanel.hidden ? null : picked().find((p) => !Number.isFinite(p.weight));
  if (badWeight) {
    showProblems({ body: { errors: [{ key_path: 'rl.rewards', message: `the weight of reward module ${badWeight.id} is not a number` }] } });
    submit.disabled = true;
    return false;
  }
  try {
    const res = await api('/api/configs/validate', { method: 'POST', body: body() });
    if (mine !== seq) return true;
    verdict.replaceChildren(el('span', { class: 'ok', 'data-valid': 'true', 'data-kind': res.kind }, `✓ valid (${res.kind === 'rl' ? 'RL' : 'training'})`));
    resolved.textContent = res.resolved;
    submit.disabled = false;
    return true;
  } catch (e) {
    if (mine !== seq) return false;
    showProblems(e);
    submit.disabled = e.status === 422;
    return false;
  }
}

let timer;
function scheduleValidation() {
  showKind();
  clearTimeout(timer);
  timer = setTimeout(validate, 350);
}
text.addEventListener('input', scheduleValidation);
overrides.addEventListener('input', scheduleValidation);

async function loadFile() {
  if (!picker.value) {
    loadedText = null;
    return scheduleValidation();
  }
  try {
    const file = await api(`/api/configs/${encodeURIComponent(picker.value.replace(/^configs\//, ''))}`);
    text.value = file.text;
    loadedText = file.text;
    showKind();
    validate();
  } catch (e) {
    showError(message, e);
  }
}
picker.addEventListener('change', loadFile);

async function start(event) {
  event.preventDefault();
  submit.disabled = true;
  try {
    const res = await api('/api/runs', { method: 'POST', body: { ...body(), name: name.value.trim() || undefined } });
    location.href = `/run.html?id=${res.id}`;
  } catch (e) {
    if (e.status === 422) showProblems(e); else showError(message, e);
    submit.disabled = false;
  }
}

(async () => {
  try {
    await loadRlChoices();
    const configs = await api('/api/configs');
    for (const c of configs) picker.append(el('option', { value: c.path }, c.name));
    if (configs.length) {
      picker.value = (configs.find((c) => c.name.includes('debug')) || configs.find((c) => !c.name.startsWith('rl_')) || configs[0]).path;
      await loadFile();
    }
  } catch (e) {
    showError(message, e);
  }
})();

// The new-run form: pick a config file, edit its TOML, add overrides; the config is validated
// as you type and problems are shown by key path next to the form.
import { api, el, layout, showError } from './app.js';

const main = layout();
const picker = el('select', { id: 'config-file' }, el('option', { value: '' }, '(inline TOML)'));
const name = el('input', { id: 'run-name', placeholder: 'defaults to the config name', size: 40 });
const text = el('textarea', { id: 'config-text', rows: 24, spellcheck: 'false' });
const overrides = el('textarea', { id: 'overrides', rows: 5, spellcheck: 'false', placeholder: 'one key.path=value per line, e.g.\ntraining.steps=100' });
const verdict = el('div', { id: 'validation', 'aria-live': 'polite' });
const resolved = el('pre', { class: 'toml', id: 'resolved' });
const submit = el('button', { class: 'primary', id: 'start-run', type: 'submit' }, 'Start run');
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
        el('p', {}, submit)),
      el('div', { class: 'panel grow' },
        el('h2', {}, 'Validation'), verdict,
        el('details', {}, el('summary', {}, 'Resolved config'), resolved)))),
);

// The file's text as loaded: when the text is unchanged, the run is created from the file
// (so the registry records which config it came from).
let loadedText = null;

function body() {
  const lines = overrides.value.split('\n').map((l) => l.trim()).filter((l) => l && !l.startsWith('#'));
  const file = picker.value;
  if (file && text.value === loadedText) return { config_path: file, overrides: lines };
  return { config: text.value, overrides: lines };
}

function showProblems(err) {
  const problems = (err.body && err.body.errors) || [{ key_path: null, message: err.message }];
  verdict.replaceChildren(el('ul', { class: 'errors' }, problems.map((p) =>
    el('li', { 'data-key-path': p.key_path || '' }, p.key_path ? el('code', {}, p.key_path) : null, p.key_path ? ' ' : null, p.message))));
  resolved.textContent = '';
}

let seq = 0;
async function validate() {
  const mine = ++seq;
  try {
    const res = await api('/api/configs/validate', { method: 'POST', body: body() });
    if (mine !== seq) return true;
    verdict.replaceChildren(el('span', { class: 'ok', 'data-valid': 'true' }, '✓ valid'));
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
    const configs = await api('/api/configs');
    for (const c of configs) picker.append(el('option', { value: c.path }, c.name));
    if (configs.length) {
      picker.value = configs.find((c) => c.name.includes('debug'))?.path || configs[0].path;
      await loadFile();
    }
  } catch (e) {
    showError(message, e);
  }
})();

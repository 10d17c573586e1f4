// Reward modules: upload a .wasm (checked by the server before it is stored), list them, and
// score sample inputs with one.
import { api, el, layout, fmt, fmtBytes, fmtTime, showError } from './app.js';

const main = layout();
const file = el('input', { type: 'file', id: 'reward-file', accept: '.wasm,.wat' });
const uploadMsg = el('div', { id: 'upload-result' });
const tbody = el('tbody');
const picker = el('select', { id: 'reward-pick' });
const inputs = el('textarea', { id: 'reward-inputs', rows: 6, spellcheck: 'false' });
inputs.value = [
  '{"prompt":"What is 6*7?","completion":"6*7 = 42. Answer: 42","metadata":{"answer":"42"}}',
  '{"prompt":"What is 6*7?","completion":"Answer: 41","metadata":{"answer":"42"}}',
].join('\n');
const results = el('div', { id: 'test-results' });

main.append(
  el('h1', {}, 'Reward modules'),
  el('div', { class: 'panel' },
    el('h2', {}, 'Upload'),
    el('form', { id: 'upload-form', onsubmit: upload }, file, ' ', el('button', { class: 'primary', type: 'submit' }, 'Upload')),
    uploadMsg),
  el('div', { class: 'panel' }, el('table', { id: 'rewards' },
    el('thead', {}, el('tr', {}, ['id', 'name', 'kind', 'size', 'sha256', 'uploaded', ''].map((h) => el('th', {}, h)))), tbody)),
  el('div', { class: 'panel' },
    el('h2', {}, 'Test on samples'),
    el('form', { id: 'test-form', onsubmit: test },
      el('label', { for: 'reward-pick' }, 'Module'), picker,
      el('label', { for: 'reward-inputs' }, 'Inputs (JSON lines: prompt, completion, metadata)'), inputs,
      el('p', {}, el('button', { class: 'primary', type: 'submit' }, 'Score'))),
    results),
);

async function refresh() {
  const list = await api('/api/rewards');
  tbody.replaceChildren(...(list.length ? list.map((r) => el('tr', { 'data-reward': r.id },
    el('td', {}, r.id), el('td', {}, r.name), el('td', {}, r.kind), el('td', {}, fmtBytes(r.size)),
    el('td', { class: 'muted' }, r.sha256.slice(0, 12)), el('td', {}, fmtTime(r.created_at)),
    el('td', {}, el('button', { class: 'danger', onclick: () => remove(r.id) }, 'Delete'))))
    : [el('tr', {}, el('td', { colspan: 7, class: 'muted' }, 'none uploaded'))]));
  const keep = picker.value;
  picker.replaceChildren(...list.map((r) => el('option', { value: r.id }, `${r.id} · ${r.name}`)));
  if (list.some((r) => String(r.id) === keep)) picker.value = keep;
}

async function upload(e) {
  e.preventDefault();
  const f = file.files[0];
  if (!f) return;
  uploadMsg.replaceChildren(el('span', { class: 'muted' }, 'checking…'));
  try {
    const r = await api(`/api/rewards?name=${encodeURIComponent(f.name)}`, { method: 'POST', raw: f });
    uploadMsg.replaceChildren(el('span', { class: 'ok' }, `stored ${r.name} (${r.kind}, ${fmtBytes(r.size)})`));
    await refresh();
    picker.value = r.id;
  } catch (err) {
    showError(uploadMsg, err);
  }
}

async function remove(id) {
  try {
    await api(`/api/rewards/${id}`, { method: 'DELETE' });
    await refresh();
  } catch (err) {
    showError(uploadMsg, err);
  }
}

async function test(e) {
  e.preventDefault();
  let parsed;
  try {
    parsed = inputs.value.split('\n').filter((l) => l.trim()).map((l, i) => {
      try { return JSON.parse(l); } catch { throw new Error(`line ${i + 1} is not JSON`); }
    });
    const res = await api(`/api/rewards/${picker.value}/test`, { method: 'POST', body: { inputs: parsed } });
    results.replaceChildren(el('table', {},
      el('thead', {}, el('tr', {}, ['#', 'completion', 'score', 'error', 'details', 'fuel', 'µs'].map((h) => el('th', {}, h)))),
      el('tbody', {}, res.results.map((r, i) => el('tr', { 'data-result': i },
        el('td', {}, i + 1), el('td', {}, parsed[i].completion), el('td', { class: 'num' }, fmt(r.score)),
        el('td', { class: 'error' }, r.error ? `${r.error}: ${r.message}` : ''),
        el('td', { class: 'muted' }, r.details ? JSON.stringify(r.details) : ''),
        el('td', { class: 'num' }, fmt(r.fuel)), el('td', { class: 'num' }, fmt(r.micros)))))));
  } catch (err) {
    showError(results, err);
  }
}

refresh().catch((err) => showError(uploadMsg, err));

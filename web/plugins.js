// The model and optimizer plugins the host finds (as `anneal plugins list`).
import { api, el, layout, showError } from './app.js';

const main = layout();
const box = el('div', { class: 'panel' });
main.append(el('h1', {}, 'Plugins'), box);

try {
  const res = await api('/api/plugins');
  box.replaceChildren(...[
    el('table', { id: 'plugins' },
      el('thead', {}, el('tr', {}, ['name', 'kind', 'API', 'flavors', 'description', 'file'].map((h) => el('th', {}, h)))),
      el('tbody', {}, res.plugins.map((p) => el('tr', {},
        el('td', {}, el('b', {}, p.name)), el('td', {}, p.kind), el('td', {}, p.api_version),
        el('td', {}, p.flavors.join(', ')), el('td', {}, p.description), el('td', { class: 'muted' }, p.file))))),
    res.plugins.length ? null : el('p', { class: 'muted' }, `No plugins found in ${res.searched.join(', ')}. Build them with cargo build --release --workspace.`),
    res.errors.length ? el('ul', { class: 'errors' }, res.errors.map((e) => el('li', {}, e))) : null,
  ].filter(Boolean));
} catch (e) {
  showError(box, e);
}

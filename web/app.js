// Shared pieces of every page: the header, API calls (with the optional bearer token), small
// DOM helpers and formatting.

const TOKEN_KEY = 'anneal-token';

export function token() {
  return localStorage.getItem(TOKEN_KEY) || '';
}

/** Calls the JSON API; throws an Error carrying `.status` and `.body` on a non-2xx answer. */
export async function api(path, { method = 'GET', body, raw } = {}) {
  const headers = {};
  if (token()) headers.Authorization = `Bearer ${token()}`;
  let payload;
  if (raw !== undefined) {
    // The server refuses the types a form can send cross-site (a File's own type may be
    // text/plain), so raw bytes always go as octet-stream.
    headers['Content-Type'] = 'application/octet-stream';
    payload = raw;
  } else if (body !== undefined) {
    headers['Content-Type'] = 'application/json';
    payload = JSON.stringify(body);
  }
  const res = await fetch(path, { method, headers, body: payload });
  if (res.status === 401) {
    const given = prompt('This server needs an access token:');
    if (given) {
      localStorage.setItem(TOKEN_KEY, given);
      return api(path, { method, body, raw });
    }
  }
  const text = await res.text();
  const data = text ? JSON.parse(text) : null;
  if (!res.ok) {
    const err = new Error((data && data.error) || `${res.status} ${res.statusText}`);
    err.status = res.status;
    err.body = data;
    throw err;
  }
  return data;
}

/** An EventSource on an API path (the token goes in the query: EventSource sends no headers). */
export function events(path) {
  const url = token() ? `${path}${path.includes('?') ? '&' : '?'}token=${encodeURIComponent(token())}` : path;
  return new EventSource(url);
}

/** Creates an element: el('td', {class: 'num'}, 'text', child, ...). */
export function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
    else if (k === 'class') e.className = v;
    else e.setAttribute(k, v === true ? '' : v);
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

export function statusBadge(status) {
  return el('span', { class: `status ${status}`, 'data-status': status }, status);
}

export function fmt(v, digits = 4) {
  if (v === undefined || v === null) return '–';
  if (typeof v !== 'number') return String(v);
  if (Number.isInteger(v)) return v.toLocaleString('en-US');
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(2);
  return v.toPrecision(digits);
}

export function fmtBytes(b) {
  if (b === undefined || b === null) return '–';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (b >= 1024 && i < units.length - 1) { b /= 1024; i++; }
  return `${b.toFixed(i ? 1 : 0)} ${units[i]}`;
}

export function fmtTime(ms) {
  if (!ms) return '–';
  return new Date(ms).toLocaleString();
}

export function fmtDuration(ms) {
  if (ms === undefined || ms === null || ms < 0) return '–';
  const s = Math.round(ms / 1000);
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
}

export function param(name) {
  return new URLSearchParams(location.search).get(name);
}

const PAGES = [
  ['index.html', 'Runs'],
  ['new.html', 'New run'],
  ['compare.html', 'Compare'],
  ['plugins.html', 'Plugins'],
  ['rewards.html', 'Rewards'],
];

/** Puts the header on the page and returns <main>. */
export function layout() {
  const here = location.pathname.split('/').pop() || 'index.html';
  const nav = el('nav', {}, PAGES.map(([href, label]) =>
    el('a', { href: `/${href}`, class: href === here || (here === 'run.html' && href === 'index.html') ? 'active' : '' }, label)));
  document.body.prepend(el('header', {}, el('span', { class: 'brand' }, 'Anneal'), nav));
  return document.querySelector('main');
}

/** Runs `fn` now and every `ms` while the page is visible; returns a stop function. */
export function every(ms, fn) {
  let stopped = false;
  let timer;
  const loop = async () => {
    if (stopped) return;
    try { await fn(); } catch (e) { console.error(e); }
    if (!stopped) timer = setTimeout(loop, ms);
  };
  loop();
  return () => { stopped = true; clearTimeout(timer); };
}

/** Shows an error in a container. */
export function showError(container, err) {
  container.replaceChildren(el('div', { class: 'error' }, err.message || String(err)));
}

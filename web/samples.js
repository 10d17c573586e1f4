// An RL run's samples (its samples.jsonl, through GET /api/runs/{id}/samples): newest step
// first, a page at a time ("‹ newer" / "older ›"; the server reads only the page's lines), filtered
// by step, by failed samples (not correct, or a reward below a threshold) and by erroring ones (a
// reward module's call failed). A multi-turn episode (a sample with `turns`) shows turn by turn:
// the prompt (collapsed: it holds the tools' system block), each policy turn with its tool calls
// set apart, each observation, the step rewards, and the turn where the episode failed.
import { api, el, showError } from './app.js';

/** A short number: at most four significant digits, no trailing zeros. */
const num = (v) => (typeof v === 'number' && Number.isFinite(v) ? String(Number(v.toPrecision(4))) : '–');

const PAGE = 20;

const TOOL_CALL_OPEN = '<tool_call>';
const TOOL_CALL_CLOSE = '</tool_call>';

/** A JSON value on one line, spaced as Python writes it: `{"expression": "347*86"}`. */
function oneLine(v) {
  if (Array.isArray(v)) return `[${v.map(oneLine).join(', ')}]`;
  if (v && typeof v === 'object') return `{${Object.entries(v).map(([k, x]) => `${JSON.stringify(k)}: ${oneLine(x)}`).join(', ')}}`;
  return JSON.stringify(v);
}

/** One tool call's body as `name(arguments)`, or null when it cannot be read (as the host's
 *  parser, host/data/src/chat/tools.rs: a JSON object with a non-empty `name`; `parameters` for
 *  `arguments`, arguments written as a JSON string parsed). */
function readCall(body) {
  let call;
  try { call = JSON.parse(body); } catch { return null; }
  if (!call || typeof call !== 'object' || Array.isArray(call) || typeof call.name !== 'string' || !call.name) return null;
  let args = call.arguments !== undefined ? call.arguments : call.parameters;
  if (typeof args === 'string') {
    try { args = JSON.parse(args); } catch { /* shown as the string it is */ }
  }
  return `${call.name}(${args === undefined ? '' : oneLine(args)})`;
}

/** A policy turn's text with its `<tool_call>{json}</tool_call>` blocks set apart. */
function policyText(text) {
  const parts = [];
  let rest = text;
  for (let open = rest.indexOf(TOOL_CALL_OPEN); open >= 0; open = rest.indexOf(TOOL_CALL_OPEN)) {
    if (rest.slice(0, open).trim()) parts.push(el('code', { class: 'completion' }, rest.slice(0, open).trim()));
    const start = open + TOOL_CALL_OPEN.length;
    const close = rest.indexOf(TOOL_CALL_CLOSE, start);
    if (close < 0) {
      parts.push(el('div', { class: 'tool-call bad' }, el('span', { class: 'tag' }, 'unclosed tool call'), ' ', el('code', {}, rest.slice(open))));
      rest = '';
      break;
    }
    const body = rest.slice(start, close);
    const call = readCall(body.trim());
    parts.push(call
      ? el('div', { class: 'tool-call' }, el('span', { class: 'tag' }, 'tool call'), ' ', el('code', {}, call))
      : el('div', { class: 'tool-call bad' }, el('span', { class: 'tag' }, 'unreadable tool call'), ' ', el('code', {}, rest.slice(open, close + TOOL_CALL_CLOSE.length))));
    rest = rest.slice(close + TOOL_CALL_CLOSE.length);
  }
  if (rest.trim()) parts.push(el('code', { class: 'completion' }, rest.trim()));
  return parts.length ? parts : [el('span', { class: 'muted' }, '(empty)')];
}

/** At most 80 characters of `text`, on one line. */
const short = (text) => {
  const line = text.replace(/\s+/g, ' ').trim();
  return line.length > 80 ? `${line.slice(0, 79)}…` : line;
};

/** One turn of an episode: its role, tokens, step reward, text, and the error that ended the
 *  episode here ("kind: message"). */
function turnItem(sample, turn, i) {
  const head = [
    el('span', { class: 'role' }, turn.role), ' ',
    el('span', { class: 'muted' }, `${turn.tokens} tokens`),
    typeof turn.reward === 'number' ? el('span', { class: 'turn-reward' }, ` · reward ${num(turn.reward)}`) : null,
  ];
  let body;
  if (turn.role === 'prompt') {
    body = el('details', {}, el('summary', {}, head, ' ', el('span', { class: 'muted' }, '· '), el('code', {}, short(sample.prompt ?? ''))),
      el('code', { class: 'completion' }, turn.text));
  } else if (turn.role === 'policy') {
    body = [el('div', { class: 'turn-head' }, head), ...policyText(turn.text)];
  } else {
    body = [el('div', { class: 'turn-head' }, head),
      turn.text ? el('code', { class: 'completion' }, turn.text) : el('span', { class: 'muted' }, '(empty)')];
  }
  let error = null;
  if (turn.error) {
    const at = turn.error.indexOf(': ');
    const kind = at > 0 ? turn.error.slice(0, at) : 'error';
    error = el('div', { class: 'turn-error', 'data-error-kind': kind },
      `✗ the episode ended here (${kind}): `, at > 0 ? turn.error.slice(at + 2) : turn.error);
  }
  return el('li', {
    class: `turn${turn.error ? ' failed' : ''}`,
    'data-role': turn.role,
    'data-turn': i,
    'data-error': turn.error ? 'true' : null,
  }, body, error);
}

/** A multi-turn episode, turn by turn. */
function episode(sample) {
  const policyTurns = sample.turns.filter((t) => t.role === 'policy').length;
  return el('ol', { class: 'turns', 'aria-label': `episode: ${policyTurns} policy turn${policyTurns === 1 ? '' : 's'}` },
    sample.turns.map((t, i) => turnItem(sample, t, i)));
}

export class SamplesView {
  constructor(box, runId) {
    this.box = box;
    this.runId = runId;
    this.offset = 0;
    // Where the pages before this one started (a page of long samples may hold fewer than PAGE).
    this.previous = [];
    this.shown = 0;
    this.seq = 0;
    this.lastLoad = 0;
    this.status = null;
    const reload = () => this.reload(true);
    this.step = el('select', { id: 'samples-step', onchange: reload }, el('option', { value: '' }, 'all steps'));
    this.failed = el('input', { type: 'checkbox', id: 'samples-failed', onchange: reload });
    this.threshold = el('input', { type: 'number', id: 'samples-threshold', step: 'any', placeholder: 'reward below…', style: 'width:9em', oninput: reload });
    this.erroring = el('input', { type: 'checkbox', id: 'samples-erroring', onchange: reload });
    this.failedCount = el('span', { class: 'muted', id: 'samples-failed-count' });
    this.erroringCount = el('span', { class: 'muted', id: 'samples-erroring-count' });
    this.summary = el('span', { class: 'muted', id: 'samples-summary' });
    this.newer = el('button', { id: 'samples-newer', onclick: () => this.turn(-1) }, '‹ newer');
    this.older = el('button', { id: 'samples-older', onclick: () => this.turn(1) }, 'older ›');
    this.tbody = el('tbody');
    this.message = el('div');
    box.append(
      el('h2', {}, 'Samples'),
      el('div', { class: 'filters' },
        el('label', { for: 'samples-step' }, 'step '), this.step,
        el('label', {}, this.failed, ' failed ', this.failedCount), this.threshold,
        el('label', {}, this.erroring, ' erroring ', this.erroringCount),
        this.newer, this.older, this.summary),
      this.message,
      el('table', { id: 'samples-table' },
        el('thead', {}, el('tr', {}, ['step', 'prompt', 'completion', 'reward', 'correct', 'reward modules'].map((h) => el('th', {}, h)))),
        this.tbody),
    );
    this.reload(true);
  }

  /** Reloads now and then while the run writes samples, and once more after it ends. */
  refreshIfRunning(status) {
    const changed = this.status !== null && this.status !== status;
    this.status = status;
    if (changed || (status === 'running' && Date.now() - this.lastLoad > 3000)) this.reload(false);
  }

  turn(direction) {
    if (direction > 0) {
      this.previous.push(this.offset);
      this.offset += Math.max(1, this.shown);
    } else {
      this.offset = this.previous.length ? this.previous.pop() : Math.max(0, this.offset - PAGE);
    }
    this.reload(false);
  }

  query() {
    const q = new URLSearchParams({ offset: String(this.offset), limit: String(PAGE) });
    if (this.step.value) q.set('step', this.step.value);
    if (this.failed.checked) q.set('failed', 'true');
    if (this.erroring.checked) q.set('erroring', 'true');
    const t = this.threshold.value.trim();
    if (t !== '' && Number.isFinite(Number(t))) q.set('threshold', t);
    return q;
  }

  async reload(fromStart) {
    if (fromStart) {
      this.offset = 0;
      this.previous = [];
    }
    const mine = ++this.seq;
    this.lastLoad = Date.now();
    try {
      const page = await api(`/api/runs/${this.runId}/samples?${this.query()}`);
      if (mine !== this.seq) return;
      this.message.replaceChildren();
      this.show(page);
    } catch (e) {
      if (mine === this.seq) showError(this.message, e);
    }
  }

  show(page) {
    const chosen = this.step.value;
    const known = [...this.step.options].slice(1).map((o) => o.value);
    if (known.join() !== page.steps.slice().reverse().join()) {
      this.step.replaceChildren(el('option', { value: '' }, 'all steps'),
        ...page.steps.slice().reverse().map((s) => el('option', { value: s }, `step ${s}`)));
      this.step.value = page.steps.map(String).includes(chosen) ? chosen : '';
    }
    this.failedCount.textContent = `(${page.counts.failed})`;
    this.erroringCount.textContent = `(${page.counts.erroring})`;
    this.box.dataset.total = String(page.total);
    this.box.dataset.offset = String(page.offset);
    this.shown = page.samples.length;
    const last = Math.min(page.offset + page.samples.length, page.total);
    this.summary.textContent = page.total ? `${page.offset + 1}–${last} of ${page.total}` : 'no samples';
    this.newer.disabled = page.offset === 0;
    this.older.disabled = last >= page.total;
    if (!page.samples.length) {
      const why = page.counts.all ? 'No sample matches these filters.' : 'No samples yet (the run writes them at step 1 and every rl.samples_every steps).';
      this.tbody.replaceChildren(el('tr', {}, el('td', { colspan: 6, class: 'muted' }, why)));
      return;
    }
    this.tbody.replaceChildren(...page.samples.map((s) => {
      const scores = s.scores || [];
      const errors = scores.filter((m) => m.error);
      return el('tr', {
        'data-sample': `${s.step}-${s.prompt_index}-${s.sample}`,
        'data-step': s.step,
        'data-reward': s.reward,
        'data-correct': String(s.correct),
        'data-errors': errors.length,
        'data-turns': Array.isArray(s.turns) ? s.turns.length : null,
      },
      el('td', { class: 'num' }, s.step),
      Array.isArray(s.turns) && s.turns.length
        ? el('td', { colspan: 2, class: 'episode' }, episode(s))
        : [el('td', {}, el('code', {}, s.prompt)),
          el('td', {}, s.completion ? el('code', { class: 'completion' }, s.completion) : el('span', { class: 'muted' }, '(empty)'))],
      el('td', { class: 'num' }, num(s.reward)),
      el('td', { class: s.correct === false ? 'error' : s.correct ? 'ok' : 'muted' }, s.correct === null || s.correct === undefined ? '–' : s.correct ? '✓' : '✗'),
      el('td', {}, scores.map((m) => el('div', { class: m.error ? 'error' : '', title: m.message || '' },
        `${m.name} (×${num(m.weight)}): `, m.error ? `${m.error} → ${num(m.reward)}` : num(m.score),
        m.correct === true ? ' ✓' : m.correct === false ? ' ✗' : ''))));
    }));
  }
}

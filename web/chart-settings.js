// The chart controls of the run and compare pages: smoothing, the x axis (step, tokens, time)
// and which charts have a log y axis. They live in the URL query (`smooth`, `x`, `log`), so a
// reload or a shared link shows the same view, and in localStorage, so a page opened without
// them starts from the last choice made on either page.
import { el } from './app.js';

const STORAGE_KEY = 'anneal-charts';

/**
 * The x axes a chart can take, with their titles. `tokens` is the row's `tokens` (trained on so
 * far, which `anneal train` writes and restores on resume); `time` the row's `wall_time` (Unix
 * seconds) less the run's first row's, so the axis shows wall-clock time elapsed, stops and
 * restarts of the run included.
 */
export const X_AXES = {
  step: { title: 'step', label: 'step' },
  tokens: { title: 'tokens trained', label: 'tokens' },
  time: { title: 'elapsed time (wall clock)', label: 'wall time' },
};

// Smoothing starts at 0: rows come every `metrics.log_freq` steps, so a short run has few points
// and an average lags them visibly, and by default the legend should read what metrics.jsonl and
// the CLI's line say. TensorBoard's 0.6 is one drag away.
const DEFAULTS = { smoothing: 0, x: 'step', log: [] };

/** The saved choice (localStorage), or the defaults. */
function stored() {
  try {
    return { ...DEFAULTS, ...JSON.parse(localStorage.getItem(STORAGE_KEY) || '{}') };
  } catch {
    return { ...DEFAULTS };
  }
}

const clampSmoothing = (v) => (Number.isFinite(v) ? Math.min(0.99, Math.max(0, Math.round(v * 100) / 100)) : 0);

/**
 * A page's chart settings. `onChange` is called (at most once a frame) after the smoothing or the
 * x axis changes; a chart's log toggle redraws that chart itself and only saves here.
 */
export class ChartSettings {
  constructor(onChange) {
    const q = new URLSearchParams(location.search);
    const saved = stored();
    this.smoothing = clampSmoothing(q.has('smooth') ? Number(q.get('smooth')) : Number(saved.smoothing));
    const x = q.get('x') ?? saved.x;
    this.x = X_AXES[x] ? x : 'step';
    const log = q.has('log') ? q.get('log').split(',') : saved.log;
    this.log = new Set((Array.isArray(log) ? log : []).filter(Boolean));
    this.onChange = onChange;
    this.unavailable = new Map();
    this.pending = false;
  }

  /** Whether chart `id` has a log y axis. */
  isLog(id) {
    return this.log.has(id);
  }

  /** Records chart `id`'s log toggle. */
  setLog(id, on) {
    if (on) this.log.add(id); else this.log.delete(id);
    this.save();
  }

  /**
   * The x axis to draw: the one chosen unless the data lacks it (an RL run has no token count),
   * then step. The choice itself is kept for the pages whose data has it.
   */
  xAxis() {
    return this.unavailable.has(this.x) ? 'step' : this.x;
  }

  /**
   * Marks x axis `axis` as available or not for the data shown (`why`: the reason shown on the
   * disabled option), and shows the axis in use in the picker.
   */
  setAvailable(axis, available, why = '') {
    if (available) this.unavailable.delete(axis); else this.unavailable.set(axis, why);
    this.refreshPicker();
  }

  /** Greys out the x axes the data lacks and shows the one in use. */
  refreshPicker() {
    if (!this.select) return;
    for (const o of this.select.options) {
      o.disabled = this.unavailable.has(o.value);
      o.title = this.unavailable.get(o.value) || '';
    }
    this.select.value = this.xAxis();
  }

  /** Writes the settings to the URL query (defaults left out) and to localStorage. */
  save() {
    const q = new URLSearchParams(location.search);
    const put = (k, v, def) => (v === def ? q.delete(k) : q.set(k, v));
    put('smooth', String(this.smoothing), String(DEFAULTS.smoothing));
    put('x', this.x, DEFAULTS.x);
    put('log', [...this.log].join(','), '');
    const query = q.toString().replace(/%2C/g, ',');
    history.replaceState(null, '', `${location.pathname}${query ? `?${query}` : ''}`);
    try {
      localStorage.setItem(STORAGE_KEY, JSON.stringify({ smoothing: this.smoothing, x: this.x, log: [...this.log] }));
    } catch {
      // Storage may be off (private windows); the URL still keeps the view.
    }
  }

  changed() {
    this.save();
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => {
      this.pending = false;
      this.onChange();
    });
  }

  /** The controls: a smoothing slider (with its value) and the x axis picker. */
  controls() {
    const value = el('output', { id: 'smoothing-value' }, this.smoothing.toFixed(2));
    const slider = el('input', {
      id: 'smoothing', type: 'range', min: 0, max: 0.99, step: 0.01, value: this.smoothing,
      title: 'exponential moving average, debiased as TensorBoard does (0: raw values)',
    });
    slider.addEventListener('input', () => {
      this.smoothing = clampSmoothing(Number(slider.value));
      value.textContent = this.smoothing.toFixed(2);
      this.changed();
    });
    this.select = el('select', { id: 'x-axis' },
      Object.entries(X_AXES).map(([k, a]) => el('option', { value: k }, a.label)));
    this.select.addEventListener('change', () => {
      this.x = this.select.value;
      this.changed();
    });
    this.refreshPicker();
    return el('div', { class: 'chart-controls', id: 'chart-controls' },
      el('label', {}, 'smoothing ', slider, ' ', value),
      el('label', {}, 'x axis ', this.select),
      el('span', { class: 'muted' }, 'log scale: the “log” box on each chart'));
  }
}

/** Whether some row has a numeric `field`. */
const hasField = (rows, field) => rows.some((r) => typeof r[field] === 'number');

/**
 * Whether rows can be placed along `axis`: always by step; by tokens where rows carry `tokens`
 * (`anneal train`'s rows do, `anneal rl`'s do not); by time where they carry `wall_time` (or,
 * rows of older runs, `time`).
 */
export function hasAxis(axis, rows) {
  if (axis === 'tokens') return hasField(rows, 'tokens');
  if (axis === 'time') return hasField(rows, 'wall_time') || hasField(rows, 'time');
  return true;
}

/**
 * Where a row of `rows` sits on `axis`: a function row => x (undefined when the row lacks it).
 * Time is counted from the earliest `wall_time` of `rows` (pass all of a run's rows, not a
 * filtered part, so every chart of the run starts its clock at the same row).
 */
export function xOf(axis, rows) {
  if (axis === 'tokens') return (r) => r.tokens;
  if (axis === 'time') {
    if (!hasField(rows, 'wall_time')) return (r) => r.time;
    let origin = Infinity;
    for (const r of rows) if (typeof r.wall_time === 'number' && r.wall_time < origin) origin = r.wall_time;
    return (r) => (typeof r.wall_time === 'number' ? r.wall_time - origin : undefined);
  }
  return (r) => r.step;
}

// What each field of metrics.jsonl is, for the charts of the run page and the compare page: a
// title, the y axis' title with its unit, and how its values read (bytes in binary units, counts
// from zero, quantities that cannot be negative never below zero, MFU as a percent like the CLI's
// log line). Fields of `anneal train` (MetricsRow) and
// `anneal rl` (RlRow); anything else a model reports gets its own name.
import { fmtBytes } from './app.js';
import { pointsOf } from './charts.js';

export const FIELDS = {
  // anneal train
  loss: { title: 'Loss', y: 'loss' },
  val_loss: { title: 'Validation loss', y: 'cross-entropy (nats / token)' },
  grad_norm: { title: 'Gradient norm', y: 'L2 norm (before clipping)', nonNegative: true },
  lr: { title: 'Learning rate', y: 'learning rate', nonNegative: true },
  tokens_per_s: { title: 'Tokens / s', y: 'tokens / s', nonNegative: true },
  tflops: { title: 'Achieved TFLOP/s', y: 'TFLOP/s (model FLOPs)', nonNegative: true },
  mfu: { title: 'MFU (model FLOPs utilization)', y: '% of peak', percent: true, nonNegative: true },
  mem_peak_bytes: { title: 'Peak memory', y: 'held by tensors', bytes: true },
  state_bytes: { title: 'State (parameters + gradients + optimizer)', y: 'held by rank 0', bytes: true },
  comm_bytes: { title: 'Communication per step', y: 'sent to collectives', bytes: true },
  aux_loss: { title: 'Auxiliary loss (weighted total)', y: 'loss' },
  // anneal rl
  reward_mean: { title: 'Reward (mean)', y: 'reward' },
  reward_std: { title: 'Reward (std)', y: 'reward', nonNegative: true },
  accuracy: { title: 'Accuracy (samples)', y: 'fraction correct', nonNegative: true },
  eval_accuracy: { title: 'Held-out accuracy (greedy)', y: 'fraction correct', nonNegative: true },
  response_len_mean: { title: 'Response length', y: 'tokens', nonNegative: true },
  entropy: { title: 'Entropy', y: 'nats / token', nonNegative: true },
  kl_ref: { title: 'KL to the reference', y: 'nats (k3 estimate)', nonNegative: true },
  logprob_mismatch_max: { title: 'Logprob mismatch (max |rollout − trainer|)', y: 'nats', nonNegative: true },
  staleness_mean: { title: 'Staleness', y: 'policy versions', nonNegative: true },
  reward_errors: { title: 'Reward errors', y: 'failed calls per step', count: true },
  reward_timeouts: { title: 'Reward timeouts', y: 'timed-out calls per step', count: true },
  t_rollout: { title: 'Rollout time', y: 'seconds per step', nonNegative: true },
  t_reward: { title: 'Reward time', y: 'seconds per step', nonNegative: true },
  t_train: { title: 'Train time', y: 'seconds per step', nonNegative: true },
  t_wait: { title: 'Wait for rollouts', y: 'seconds per step', nonNegative: true },
  dropped_groups: { title: 'Dropped groups (equal rewards)', y: 'groups per step', count: true },
  dropped_stale: { title: 'Dropped stale rollouts', y: 'rollouts per step', count: true },
  samples_per_s: { title: 'Samples / s', y: 'samples / s', nonNegative: true },
};

/** What is known of `key` (a field name, its own name for a title otherwise). */
export function fieldInfo(key) {
  if (FIELDS[key]) return FIELDS[key];
  if (key.startsWith('aux_loss.')) return { title: `Auxiliary loss ${key.slice(9)}`, y: 'loss' };
  // A byte field a model adds reads like the run's own.
  if (/(^|_)bytes$/.test(key)) return { title: key, y: key, bytes: true };
  return { title: key, y: key };
}

/** The chart options that make `key`'s values read right: units, ticks, legend values. */
export function chartOptions(key) {
  const f = fieldInfo(key);
  return {
    yTitle: f.y,
    bytes: Boolean(f.bytes),
    count: Boolean(f.count),
    nonNegative: Boolean(f.nonNegative),
    percent: Boolean(f.percent),
    yFormat: f.bytes ? fmtBytes : undefined,
  };
}

/**
 * Points [x, value] of `key` as charted: MFU (a fraction in metrics.jsonl) as a percent; x is
 * `x(row)` (the step by default; chart-settings.js `xOf` for the other axes).
 */
export function fieldPoints(rows, key, x) {
  const pts = pointsOf(rows, key, x);
  return fieldInfo(key).percent ? pts.map(([x, y]) => [x, y * 100]) : pts;
}

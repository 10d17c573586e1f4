// Browser test of the UI in headless Chromium (playwright-core driving Debian's chromium):
// create a run from the form (with an inline validation error first), watch its chart gain
// points, stop it, resume it, compare two runs, check the runs table's mini-curves, the plugins
// page, a reward module upload and test, and the sampling box. Then RL: start an RL run from an
// [rl] config with uploaded reward modules (weights) and the short run's checkpoint, watch its
// RL charts (axis titles, the reward's band, counters from 0), page and filter its samples
// (failed, erroring, a step), compare two RL runs; and check that the charts' y axes label every
// tick distinctly and fit their labels, MFU reads as a percent and the state in binary bytes, and
// that a completed run offers no Resume; the chart controls: smoothing (TensorBoard's EMA, the raw
// line kept), the x axis (step, tokens, wall time: title and extent follow), a log y axis per
// chart (values ≤ 0 left out), kept over a reload and carried to the compare page. Last, a multi-turn RL run's samples turn by turn: the
// prompt collapsed, policy turns with their tool calls, the tool's outputs, the turn an episode
// failed at.
// Saves screenshots of each stage.
//
//   node web/tests/browser.mjs http://127.0.0.1:PORT SCREENSHOT_DIR
//
// Environment: ANNEAL_LONG_OVERRIDES and ANNEAL_SHORT_OVERRIDES (newline-separated overrides of
// a run long enough to stop, and of a short one), ANNEAL_BAD_OVERRIDE (one the config rejects),
// ANNEAL_BAD_KEY (the key path the error must name), ANNEAL_REWARD_MODULE (a reward module file),
// ANNEAL_RL_REWARDS (newline-separated: position match, then the length-parity module that traps
// on odd lengths), ANNEAL_TOOLS_RUN (the id of a finished multi-turn RL run with tool calls and
// failed episodes), CHROMIUM (default /usr/bin/chromium). The configs folder must hold tiny.toml
// and rl_tiny.toml.
import { chromium } from 'playwright-core';
import { mkdirSync, readFileSync } from 'node:fs';
import { basename, join } from 'node:path';

const [base, shots] = process.argv.slice(2);
if (!base || !shots) {
  console.error('usage: node browser.mjs BASE_URL SCREENSHOT_DIR');
  process.exit(2);
}
mkdirSync(shots, { recursive: true });
const env = (k) => {
  if (!process.env[k]) throw new Error(`${k} is not set`);
  return process.env[k];
};
const longOverrides = env('ANNEAL_LONG_OVERRIDES');
const shortOverrides = env('ANNEAL_SHORT_OVERRIDES').split('\n').filter(Boolean);
const badOverride = env('ANNEAL_BAD_OVERRIDE');
const badKey = env('ANNEAL_BAD_KEY');
const rewardModule = env('ANNEAL_REWARD_MODULE');
const rlRewards = env('ANNEAL_RL_REWARDS').split('\n').filter(Boolean);
const toolsRun = Number(env('ANNEAL_TOOLS_RUN'));

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
  args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking',
    '--disable-component-update', '--disable-sync', '--no-first-run', '--disable-quic'],
});
const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
const consoleErrors = [];
page.on('pageerror', (e) => consoleErrors.push(String(e)));
// Expected 4xx answers (the invalid config's 422) show up as console errors too; uncaught
// exceptions, other console errors and server errors (5xx) fail the test.
page.on('console', (m) => {
  if (m.type() === 'error' && !m.text().startsWith('Failed to load resource')) consoleErrors.push(m.text());
});
page.on('response', (r) => { if (r.status() >= 500) consoleErrors.push(`${r.status()} from ${r.url()}`); });
page.on('requestfailed', (r) => {
  // Leaving a page cancels its event streams and the polls still in flight (net::ERR_ABORTED);
  // a refused, reset or empty answer from the server fails the test.
  const why = r.failure()?.errorText || 'unknown';
  if (!r.url().includes('/events') && why !== 'net::ERR_ABORTED') {
    consoleErrors.push(`request failed (${why}): ${r.url()}`);
  }
});

const step = (what) => console.log(`browser: ${what}`);
const shot = async (name) => {
  await page.screenshot({ path: join(shots, `${name}.png`), fullPage: true });
  step(`screenshot ${name}.png`);
};
const points = (chart) => page.$eval(`[data-chart="${chart}"]`, (e) => Number(e.dataset.points || 0)).catch(() => 0);
const waitStatus = (status, timeout = 90_000) =>
  page.waitForSelector(`#run-status [data-status="${status}"]`, { timeout });
/** Every chart on the page has a y axis title (with its unit) and "step" below, both drawn. */
const checkAxisTitles = async (where) => {
  const charts = await page.$$eval('[data-chart]', (es) => es.map((e) => ({
    chart: e.dataset.chart, y: e.dataset.yTitle, x: e.dataset.xTitle,
    drawn: [...e.querySelectorAll('text.axis-title')].map((t) => t.textContent),
  })));
  if (!charts.length) throw new Error(`${where}: no charts`);
  for (const c of charts) {
    if (!c.y || c.x !== 'step' || c.drawn.length !== 2 || !c.drawn.includes(c.y)) throw new Error(`${where}: chart ${c.chart} lacks axis titles: ${JSON.stringify(c)}`);
  }
  step(`${where}: ${charts.length} charts with axis titles (${charts.map((c) => `${c.chart}: ${c.y}`).join('; ')})`);
};
const waitPointsAbove = (chart, n, timeout = 90_000) =>
  page.waitForFunction(([c, k]) => Number(document.querySelector(`[data-chart="${c}"]`)?.dataset.points || 0) > k,
    [chart, n], { timeout });

try {
  // 1. The form: a bad override is flagged inline with its key path, then fixed.
  await page.goto(`${base}/new.html`);
  await page.waitForSelector('#validation [data-valid]', { timeout: 30_000 });
  await page.fill('#overrides', badOverride);
  const problem = await page.waitForSelector(`#validation li[data-key-path="${badKey}"]`, { timeout: 30_000 });
  step(`inline error: ${await problem.textContent()}`);
  if (!(await page.isDisabled('#start-run'))) throw new Error('the start button stays enabled for an invalid config');
  await shot('01-new-run-invalid');
  await page.fill('#overrides', longOverrides);
  await page.waitForSelector('#validation [data-valid]', { timeout: 30_000 });
  await page.fill('#run-name', 'browser-long');
  await Promise.all([page.waitForURL(/run\.html\?id=\d+/), page.click('#start-run')]);
  const longId = Number(new URL(page.url()).searchParams.get('id'));
  step(`created run ${longId}`);

  // 2. Its loss chart gains points while it runs.
  await waitStatus('running', 60_000);
  await waitPointsAbove('loss', 0);
  const first = await points('loss');
  await waitPointsAbove('loss', first);
  step(`loss chart: ${first} -> ${await points('loss')} points`);
  // The run's progress against its configured steps, with a time to go while it runs (the page
  // polls the run every few seconds).
  const progress = await page.waitForFunction(
    () => /^step \d+ \/ 1000000 · [\d.]+ s\/step · ETA \S/.test(document.querySelector('#run-progress')?.textContent || '') && document.querySelector('#run-progress').textContent,
    null, { timeout: 30_000 });
  step(`progress: ${await progress.jsonValue()}`);
  await shot('02-run-live');

  // 3. Stop (graceful), then resume: the chart keeps growing after the resume.
  await page.click('#stop');
  await waitStatus('stopped');
  const atStop = await points('loss');
  step(`stopped with ${atStop} points`);
  await shot('03-run-stopped');
  await page.click('#resume');
  await waitStatus('running', 60_000);
  await waitPointsAbove('loss', atStop);
  step(`resumed: ${await points('loss')} points`);
  await page.click('#stop');
  await waitStatus('stopped');

  // 4. A second, short run (through the API, as a script would) runs to completion.
  const created = await page.evaluate(async (overrides) => {
    const res = await fetch('/api/runs', {
      method: 'POST', headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ name: 'browser-short', config_path: 'configs/tiny.toml', overrides }),
    });
    return { status: res.status, body: await res.json() };
  }, shortOverrides);
  if (created.status !== 201) throw new Error(`creating the second run: ${JSON.stringify(created)}`);
  const shortId = created.body.id;
  await page.goto(`${base}/run.html?id=${shortId}`);
  await waitStatus('completed', 120_000);
  step(`run ${shortId} completed`);
  await page.waitForFunction(() => /^step \d+ \/ 30\b/.test(document.querySelector('#run-progress')?.textContent || '') && !/ETA/.test(document.querySelector('#run-progress').textContent),
    null, { timeout: 30_000 });
  // A completed run trained all its steps: no Resume, on its page or in the runs table (the
  // stopped run keeps its), and the API refuses it.
  await page.waitForSelector('#resume', { state: 'hidden', timeout: 10_000 });
  const refused = await page.evaluate(async (id) => {
    const res = await fetch(`/api/runs/${id}/resume`, { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: '{}' });
    return { status: res.status, body: await res.json() };
  }, shortId);
  if (refused.status !== 409 || !/completed/.test(refused.body.error)) throw new Error(`resuming a completed run answered ${JSON.stringify(refused)}, expected 409`);
  await page.goto(`${base}/`);
  await page.waitForSelector(`button[data-resume="${longId}"]`, { timeout: 30_000 });
  await page.waitForSelector(`tr[data-run="${shortId}"] [data-status="completed"]`, { timeout: 30_000 });
  if (await page.$(`button[data-resume="${shortId}"]`)) throw new Error('the runs table offers Resume on a completed run');
  step('completed run: no Resume (page, table), the API answers 409');

  // 4b. A mixture-of-experts run: its load imbalance (with the run's mean and max over layers) and
  //     router entropy are charted with a series per layer, its auxiliary loss on a chart of its own.
  const moe = await page.evaluate(async (overrides) => {
    const res = await fetch('/api/runs', {
      method: 'POST', headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ name: 'browser-moe', config_path: 'configs/tiny.toml', overrides }),
    });
    return { status: res.status, body: await res.json() };
  }, ['training.steps=6', 'model.flavor="debugmodel_qwen3_moe"', 'model.args.moe.n_experts=4', 'model.args.moe.expert_ffn_dim=16']);
  if (moe.status !== 201) throw new Error(`creating the MoE run: ${JSON.stringify(moe)}`);
  await page.goto(`${base}/run.html?id=${moe.body.id}`);
  await waitStatus('completed', 120_000);
  for (const [chart, series] of [['moe.imbalance', 4], ['moe.entropy', 2]]) {
    await page.waitForFunction(([c, n]) => Number(document.querySelector(`[data-chart="${c}"]`)?.dataset.series || 0) === n, [chart, series], { timeout: 30_000 });
  }
  await page.waitForFunction(() => Number(document.querySelector('[data-chart="aux_loss"]')?.dataset.series || 0) === 2, null, { timeout: 30_000 });
  for (const own of ['moe.layer0.imbalance', 'moe.imbalance_max', 'aux_loss.load_balance']) {
    if (await page.$(`[data-chart="${own}"]`)) throw new Error(`${own} has a chart of its own`);
  }
  step('MoE run: imbalance and entropy by layer, aux loss');
  await shot('04b-moe-run');

  // 4c. A run on two processes (its mesh asks for two replicas): the log panel picks a rank.
  const ddp = await page.evaluate(async (overrides) => {
    const res = await fetch('/api/runs', {
      method: 'POST', headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ name: 'browser-ddp', config_path: 'configs/tiny.toml', overrides }),
    });
    return { status: res.status, body: await res.json() };
  }, ['training.steps=2', 'parallelism.dp_replicate=2', 'training.micro_batch_size=2']);
  if (ddp.status !== 201) throw new Error(`creating the 2-process run: ${JSON.stringify(ddp)}`);
  await page.goto(`${base}/run.html?id=${ddp.body.id}`);
  await waitStatus('completed', 120_000);
  await page.waitForFunction(() => {
    const pick = document.querySelector('#log-rank');
    return pick && !pick.hidden && pick.options.length === 2;
  }, null, { timeout: 30_000 });
  await page.selectOption('#log-rank', '1');
  await page.waitForFunction(() => document.querySelector('#logs').textContent.includes('rank 1 of 2'), null, { timeout: 30_000 });
  step('2-process run: rank 1 log shown');

  // 5. Compare both: one loss chart with two series.
  await page.goto(`${base}/compare.html?ids=${longId},${shortId}`);
  await page.waitForFunction(() => Number(document.querySelector('[data-chart="loss"]')?.dataset.series || 0) === 2, null, { timeout: 30_000 });
  step('compare: two loss curves');
  await shot('04-compare');

  // 6. The runs table lists both with their mini-curves.
  await page.goto(`${base}/`);
  await page.waitForFunction((ids) => ids.every((id) => {
    const row = document.querySelector(`tr[data-run="${id}"]`);
    return row && Number(row.querySelector('.spark-cell')?.dataset.points || 0) > 1;
  }), [longId, shortId], { timeout: 30_000 });
  step('runs table: both runs with mini-curves');
  await shot('05-runs-table');

  // 7. Plugins page lists the model plugin; the rewards page uploads a module and scores samples.
  await page.goto(`${base}/plugins.html`);
  await page.waitForSelector('#plugins td >> text=llama', { timeout: 30_000 });
  await page.goto(`${base}/rewards.html`);
  await page.setInputFiles('#reward-file', rewardModule);
  await page.click('#upload-form button[type=submit]');
  await page.waitForSelector('#upload-result .ok', { timeout: 60_000 });
  await page.click('#test-form button[type=submit]');
  const score = await page.waitForSelector('#test-results tr[data-result="0"] td:nth-child(3)', { timeout: 30_000 });
  if ((await score.textContent()).trim() !== '1.100') throw new Error(`unexpected score ${await score.textContent()}`);
  step('rewards: uploaded and scored');
  await shot('06-rewards');

  // 8. The sampling box generates from the short run's final checkpoint.
  await page.goto(`${base}/run.html?id=${shortId}`);
  await page.waitForSelector('#checkpoints tbody td.num', { timeout: 30_000 });
  await page.fill('#sample-prompt', 'the king');
  await page.click('#sampling button[type=submit]');
  const sample = await page.waitForSelector('#sample-output pre, #sample-output .error', { timeout: 120_000 });
  if (await sample.evaluate((e) => e.classList.contains('error'))) throw new Error(`sampling failed: ${await sample.textContent()}`);
  step(`sampling: ${JSON.stringify(await sample.textContent())}`);
  await shot('07-sampling');

  // 9. An RL run from the form: the [rl] config, two uploaded reward modules (one weighted 0.5),
  //    the short run's checkpoint as the starting policy.
  const rewardIds = [];
  for (const file of rlRewards) {
    const res = await page.request.post(`${base}/api/rewards?name=${encodeURIComponent(basename(file).replace(/^reward\./, 'position_match.'))}`, { data: readFileSync(file) });
    if (res.status() !== 201) throw new Error(`uploading ${file}: ${res.status()} ${await res.text()}`);
    rewardIds.push((await res.json()).id);
  }
  await page.goto(`${base}/new.html`);
  await page.waitForSelector('#validation [data-valid]', { timeout: 30_000 });
  await page.selectOption('#config-file', 'configs/rl_tiny.toml');
  await page.waitForSelector('#rl-panel:not([hidden])', { timeout: 10_000 });
  await page.waitForSelector('#validation li[data-key-path="rl.rewards"]', { timeout: 30_000 });
  if (!(await page.isDisabled('#start-run'))) throw new Error('an RL config without reward modules can be started');
  const initOption = `#init-from option[data-run="${shortId}"]`;
  await page.waitForSelector(initOption, { state: 'attached', timeout: 30_000 });
  const initValue = await page.$eval(initOption, (o) => o.value);
  await page.selectOption('#init-from', initValue);
  await page.check(`input[data-reward-id="${rewardIds[0]}"]`);
  await page.check(`input[data-reward-id="${rewardIds[1]}"]`);
  await page.fill(`input[data-reward-weight="${rewardIds[1]}"]`, '0.5');
  await page.fill('#run-name', 'browser-rl');
  await page.waitForSelector('#validation [data-valid][data-kind="rl"]', { timeout: 30_000 });
  await page.$eval('#resolved', (e) => { e.closest('details').open = true; });
  const resolved = await page.textContent('#resolved');
  if (!resolved.includes('weight = 0.5') || !resolved.includes('init_from')) throw new Error(`the resolved config lacks the picks: ${resolved}`);
  await shot('08-new-rl-run');
  await Promise.all([page.waitForURL(/run\.html\?id=\d+/), page.click('#start-run')]);
  const rlId = Number(new URL(page.url()).searchParams.get('id'));
  step(`created RL run ${rlId}`);

  // 10. Its page: the RL charts (reward mean ± std, accuracy with the held-out series, response
  //     length, entropy, KL, mismatch, staleness, per-phase timings) as it runs to completion.
  await waitStatus('completed', 180_000);
  const series = (chart) => page.$eval(`[data-chart="${chart}"]`, (e) => Number(e.dataset.series || 0)).catch(() => 0);
  const rlCharts = { reward: 1, accuracy: 2, response_len: 1, entropy: 1, mismatch: 1, staleness: 1, timings: 4, reward_errors: 2, dropped: 2 };
  for (const [chart, n] of Object.entries(rlCharts)) {
    await page.waitForFunction(([c, k]) => Number(document.querySelector(`[data-chart="${c}"]`)?.dataset.series || 0) >= k,
      [chart, n], { timeout: 30_000 }).catch(async () => { throw new Error(`chart ${chart}: ${await series(chart)} series, expected ${n}`); });
  }
  if (await page.$('[data-chart="tokens_per_s"]')) throw new Error('an RL run shows the training charts');
  if (await points('reward') !== 6) throw new Error(`the reward chart has ${await points('reward')} points, expected steps 1-6`);
  // Reward ± std: the mean as a line, the std as one shaded band around it (not two more lines).
  const band = await page.$eval('[data-chart="reward"]', (e) => ({ points: Number(e.dataset.band), paths: e.querySelectorAll('path.band').length, legend: e.querySelector('.legend').textContent }));
  if (band.points !== 6 || band.paths !== 1 || !/± std ±/.test(band.legend)) throw new Error(`the reward band: ${JSON.stringify(band)}`);
  // Counters that stayed zero (nothing dropped by GRPO) read from 0 in whole numbers.
  const counters = await page.$$eval('[data-chart="dropped"], [data-chart="reward_errors"]', (es) => es.map((e) => [e.dataset.chart, JSON.parse(e.dataset.yTicks)]));
  for (const [chart, ticks] of counters) {
    if (ticks[0] !== '0' || !ticks.every((t) => /^\d+$/.test(t))) throw new Error(`chart ${chart}: counter ticks ${JSON.stringify(ticks)}`);
  }
  const dropped = counters.find(([c]) => c === 'dropped');
  if (!dropped || JSON.stringify(dropped[1]) !== '["0","1"]') throw new Error(`the all-zero dropped chart's ticks: ${JSON.stringify(dropped)}`);
  await checkAxisTitles('RL run');
  step('RL charts: reward (mean + band), accuracy (+ held-out), length, entropy, mismatch, staleness, timings, counters from 0');
  await shot('09-rl-run');

  // 11. The samples view: 6 steps x 8 samples; the erroring, failed (+ threshold) and step filters.
  await page.waitForSelector('#samples-table tr[data-sample]', { timeout: 30_000 });
  const samplesTotal = () => page.$eval('#samples', (e) => Number(e.dataset.total));
  const rowsSatisfy = (predicate, arg) => page.waitForFunction(([src, a]) => {
    const rows = [...document.querySelectorAll('#samples-table tr[data-sample]')];
    return rows.length > 0 && rows.every((r) => new Function('r', 'a', src)(r, a));
  }, [predicate, arg], { timeout: 30_000 });
  if ((await samplesTotal()) !== 48) throw new Error(`${await samplesTotal()} samples, expected 48`);
  // Single-turn samples: a prompt and a completion cell each, no episode.
  await rowsSatisfy('return r.cells.length === 6 && !r.querySelector("ol.turns") && r.cells[2].querySelector("code.completion, .muted")');
  // Pages of 20, newest first: older, older (the last 8, no older), then newer again.
  const summary = (text) => page.waitForFunction((t) => document.querySelector('#samples-summary').textContent === t, text, { timeout: 30_000 });
  await summary('1–20 of 48');
  for (const text of ['21–40 of 48', '41–48 of 48']) {
    await page.click('#samples-older');
    await summary(text);
  }
  if (!(await page.isDisabled('#samples-older'))) throw new Error('"older" stays enabled on the last page');
  await rowsSatisfy('return Number(r.dataset.step) <= 1');
  await page.click('#samples-newer');
  await summary('21–40 of 48');
  await page.click('#samples-newer');
  await summary('1–20 of 48');
  await rowsSatisfy('return Number(r.dataset.step) >= 4');
  step('samples: paged older and newer');
  await page.check('#samples-erroring');
  await rowsSatisfy('return Number(r.dataset.errors) > 0');
  const erroringLabel = Number((await page.textContent('#samples-erroring-count')).replace(/\D/g, ''));
  await page.waitForFunction((n) => Number(document.querySelector('#samples').dataset.total) === n, erroringLabel, { timeout: 30_000 });
  if (!(erroringLabel > 0 && erroringLabel < 48)) throw new Error(`${erroringLabel} erroring samples`);
  step(`samples: ${erroringLabel} erroring of 48`);
  await page.uncheck('#samples-erroring');
  await page.check('#samples-failed');
  await rowsSatisfy('return r.dataset.correct === "false"');
  await page.fill('#samples-threshold', '0.25');
  await page.waitForFunction(() => Number(document.querySelector('#samples-failed-count').textContent.replace(/\D/g, '')) === Number(document.querySelector('#samples').dataset.total), null, { timeout: 30_000 });
  await rowsSatisfy('return r.dataset.correct === "false" || Number(r.dataset.reward) < 0.25');
  const failedTotal = await samplesTotal();
  step(`samples: ${failedTotal} failed (not correct, or reward below 0.25)`);
  await shot('10-rl-samples');
  await page.selectOption('#samples-step', '3');
  await rowsSatisfy('return r.dataset.step === "3" && (r.dataset.correct === "false" || Number(r.dataset.reward) < 0.25)');
  await page.uncheck('#samples-failed');
  await page.waitForFunction(() => Number(document.querySelector('#samples').dataset.total) === 8, null, { timeout: 30_000 });
  await rowsSatisfy('return r.dataset.step === "3"');
  step('samples: step 3 has its 8');

  // 12. A second RL run (through the API), then both compared.
  const second = await page.evaluate(async ([init, reward]) => {
    const res = await fetch('/api/runs', {
      method: 'POST', headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ name: 'browser-rl-2', config_path: 'configs/rl_tiny.toml', overrides: [`rl.init_from=${JSON.stringify(init)}`, 'training.steps=4'], rewards: [{ id: reward, weight: 1 }] }),
    });
    return { status: res.status, body: await res.json() };
  }, [initValue, rewardIds[0]]);
  if (second.status !== 201) throw new Error(`creating the second RL run: ${JSON.stringify(second)}`);
  await page.goto(`${base}/run.html?id=${second.body.id}`);
  await waitStatus('completed', 180_000);
  await page.goto(`${base}/compare.html?ids=${rlId},${second.body.id}`);
  for (const chart of ['reward_mean', 'eval_accuracy']) {
    await page.waitForFunction((c) => Number(document.querySelector(`[data-chart="${c}"]`)?.dataset.series || 0) === 2, chart, { timeout: 30_000 });
  }
  step('compare: two RL runs, reward and held-out accuracy');
  await shot('11-rl-compare');
  await page.goto(`${base}/`);
  await page.waitForSelector(`tr[data-run="${rlId}"] td[data-kind="rl"]`, { timeout: 30_000 });
  await page.waitForFunction((id) => Number(document.querySelector(`tr[data-run="${id}"] .spark-cell`)?.dataset.points || 0) > 1, rlId, { timeout: 30_000 });

  // 13. Chart axes: every y tick label distinct and readable back as its tick, byte axes in one
  //     binary unit, the axis as wide as its widest label. On the long run's own charts, and on
  //     a warmup + cosine learning rate near 1e-3, a nearly constant one, and a peak memory near
  //     445 MiB (which read "0.001, 0.001, 0" and "7.8-8.7 MiB" before).
  await page.goto(`${base}/run.html?id=${longId}`);
  await waitPointsAbove('lr', 1);
  await waitPointsAbove('state_bytes', 1);
  await checkAxisTitles('training run');
  // MFU as a percent, as the CLI prints it ("mfu 12.3%"): ticks and legend, the newest row's.
  const mfu = await page.$eval('[data-chart="mfu"]', (e) => ({ ticks: JSON.parse(e.dataset.yTicks), value: e.querySelector('.legend b').textContent, title: e.dataset.yTitle }));
  const lastRows = await page.evaluate(async (id) => (await fetch(`/api/runs/${id}/metrics?fields=mfu,state_bytes`)).json(), longId);
  const lastMfu = lastRows.filter((r) => typeof r.mfu === 'number').pop().mfu;
  if (!mfu.ticks.filter((t) => t !== '').every((t) => /^-?[\d.]+%$/.test(t)) || !/%$/.test(mfu.value) || !(Math.abs(parseFloat(mfu.value) - lastMfu * 100) <= Math.max(0.05, lastMfu)) || mfu.title !== '% of peak') {
    throw new Error(`MFU does not read as a percent (${lastMfu} in metrics.jsonl): ${JSON.stringify(mfu)}`);
  }
  step(`MFU: ${mfu.value}, ticks ${mfu.ticks.join(', ')}`);
  // The state's bytes: a readable title, one binary unit on the axis.
  const state = await page.$eval('[data-chart="state_bytes"]', (e) => ({ title: e.querySelector('h3').textContent, ticks: JSON.parse(e.dataset.yTicks), value: e.querySelector('.legend b').textContent }));
  const stateTicks = state.ticks.filter((t) => t !== '');
  if (state.title !== 'State (parameters + gradients + optimizer)' || !stateTicks.every((t) => /^[\d.]+ (B|KiB|MiB|GiB)$/.test(t)) || new Set(stateTicks.map((t) => t.split(' ')[1])).size !== 1 || !/ (KiB|MiB|GiB)$/.test(state.value)) {
    throw new Error(`the state chart: ${JSON.stringify(state)}`);
  }
  step(`state: ${state.value}, ticks ${stateTicks.join(', ')}`);
  const axes = await page.evaluate(async () => {
    const { LineChart } = await import('/charts.js');
    const { fmtBytes } = await import('/app.js');
    const steps = [...Array(301).keys()];
    const lr = steps.map((s) => [s, s < 20 ? 1e-3 * s / 20 : 1e-3 * 0.5 * (1 + Math.cos(Math.PI * (s - 20) / 280))]);
    const flat = steps.map((s) => [s, 1e-3 - s * 1e-9]);
    const mem = steps.map((s) => [s, (445 + 3 * s / 300) * 2 ** 20]);
    const made = [['axis-lr', lr, {}], ['axis-flat', flat, {}], ['axis-mem', mem, { bytes: true, yFormat: fmtBytes }]];
    const boxes = document.createElement('div');
    boxes.className = 'charts';
    document.querySelector('main').prepend(boxes);
    for (const [name, pts, opts] of made) {
      const box = document.createElement('div');
      box.dataset.chart = name;
      boxes.append(box);
      new LineChart(box, { title: name, labels: [name], ...opts }).set([pts]);
    }
    await new Promise((r) => setTimeout(r, 300));
    return Object.fromEntries(['axis-lr', 'axis-flat', 'axis-mem', 'lr', 'mem'].map((c) => {
      const e = document.querySelector(`[data-chart="${c}"]`);
      return [c, e && { ticks: JSON.parse(e.dataset.yTicks || 'null'), axis: Number(e.dataset.yAxis), labels: Number(e.dataset.yLabels) }];
    }));
  });
  for (const [chart, a] of Object.entries(axes)) {
    if (!a || !Array.isArray(a.ticks) || a.ticks.length < 2) throw new Error(`chart ${chart}: no y ticks recorded: ${JSON.stringify(a)}`);
    const labels = a.ticks.filter((t) => t !== '');
    if (new Set(labels).size !== labels.length) throw new Error(`chart ${chart}: repeated y labels ${JSON.stringify(a.ticks)}`);
    if (!(a.axis >= a.labels && a.labels > 0)) throw new Error(`chart ${chart}: axis ${a.axis}px is narrower than its labels (${a.labels}px)`);
    step(`axis ${chart}: ${a.ticks.join(', ')}`);
  }
  const mib = axes['axis-mem'].ticks.filter((t) => t !== '');
  if (!mib.every((t) => / MiB$/.test(t) && Number(t.split(' ')[0]) >= 440 && Number(t.split(' ')[0]) <= 452)) {
    throw new Error(`the memory axis does not read ~445-448 MiB: ${JSON.stringify(mib)}`);
  }
  const unit = (t) => t.split(' ')[1];
  const memTicks = axes.mem.ticks.filter((t) => t !== '');
  if (new Set(memTicks.map(unit)).size !== 1) throw new Error(`the run's memory axis mixes units: ${JSON.stringify(memTicks)}`);
  await shot('12-chart-axes');

  // 13b. The chart controls: smoothing (a debiased EMA drawn over the faint raw line), the x axis
  //      (step, tokens, wall time: its title and the data's x extent follow), a log y axis per
  //      chart (values ≤ 0 left out, never NaN in a path), all kept over a reload (URL and
  //      localStorage), on the run page, the compare page and an RL run (no tokens axis).
  // The long run is stopped: its rows are final. Wait for all of them (they stream in over SSE).
  const apiRows = await page.evaluate(async (id) => (await fetch(`/api/runs/${id}/metrics`)).json(), longId);
  const lossRows = [...new Map(apiRows.filter((r) => typeof r.loss === 'number').map((r) => [r.step, r])).values()];
  await page.goto(`${base}/run.html?id=${longId}`);
  await page.waitForFunction((n) => Number(document.querySelector('[data-chart="loss"]')?.dataset.points || 0) === n, lossRows.length, { timeout: 30_000 });
  const lossChart = () => page.$eval('[data-chart="loss"]', (e) => ({
    points: Number(e.dataset.points), smoothing: e.dataset.smoothing, log: e.dataset.log, xTitle: e.dataset.xTitle,
    xKind: e.dataset.xKind, xExtent: JSON.parse(e.dataset.xExtent || '[]'), xTicks: JSON.parse(e.dataset.xTicks || '[]'),
    yTicks: JSON.parse(e.dataset.yTicks || '[]'), drawn: Number(e.dataset.drawn), dropped: Number(e.dataset.dropped),
    raw: e.querySelector('path.line.raw[data-series="0"]')?.getAttribute('d') || '',
    smoothed: e.querySelector('path.line.smoothed[data-series="0"]')?.getAttribute('d') || '',
    paths: [...e.querySelectorAll('path')].map((p) => p.getAttribute('d')),
    yTitle: e.querySelector('text.y-title')?.textContent, legend: e.querySelector('.legend b')?.textContent,
  }));
  const waitChart = (chart, src) => page.waitForFunction(([c, s]) => {
    const e = document.querySelector(`[data-chart="${c}"]`);
    return e && new Function('e', `return ${s}`)(e);
  }, [chart, src], { timeout: 30_000 });
  const noNaN = (c, where) => {
    if (c.paths.some((d) => /NaN|Infinity/.test(d))) throw new Error(`${where}: a path with NaN: ${JSON.stringify(c.paths)}`);
  };
  const before = await lossChart();
  if (before.smoothing !== '0' || before.smoothed || before.xTitle !== 'step' || before.log !== 'false') throw new Error(`the loss chart's defaults: ${JSON.stringify({ ...before, paths: undefined })}`);
  // The page's EMA is TensorBoard's: this one written out independently.
  const ema = await page.evaluate(async () => {
    const { smooth } = await import('/charts.js');
    const ys = [3, 1, 4, 1, 5, 9, 2, 6];
    const w = 0.6;
    let last = 0;
    const want = ys.map((y, i) => { last = last * w + (1 - w) * y; return last / (1 - w ** (i + 1)); });
    const got = smooth(ys.map((y, i) => [i * 10, y]), w);
    return { ok: got.every(([x, y], i) => x === i * 10 && Math.abs(y - want[i]) < 1e-12), got, want, flat: smooth([[0, 2], [1, 2]], 0.9) };
  });
  if (!ema.ok || JSON.stringify(ema.flat) !== '[[0,2],[1,2]]') throw new Error(`smoothing is not TensorBoard's EMA: ${JSON.stringify(ema)}`);
  // Smoothing 0.9: a smoothed line appears; the raw line (and the data) stay as they were.
  await page.$eval('#smoothing', (e) => { e.value = '0.9'; e.dispatchEvent(new Event('input', { bubbles: true })); });
  await waitChart('loss', 'e.dataset.smoothing === "0.9" && e.querySelector("path.line.smoothed")');
  const smoothed = await lossChart();
  if (smoothed.raw !== before.raw || smoothed.points !== before.points) throw new Error('smoothing moved the raw line or changed the data');
  if (!smoothed.smoothed || smoothed.smoothed === smoothed.raw) throw new Error(`the smoothed line: ${smoothed.smoothed.slice(0, 80)}`);
  if (!/^\S+ \(\S+\)$/.test(smoothed.legend)) throw new Error(`the legend does not read "smoothed (raw)": ${smoothed.legend}`);
  noNaN(smoothed, 'smoothed loss');
  step(`smoothing 0.9: raw line kept (${smoothed.points} points), smoothed line drawn, legend ${smoothed.legend}`);
  // The x axis: wall time from the run's first row, then tokens; the title and extent follow.
  const origin = Math.min(...apiRows.map((r) => r.wall_time));
  const span = (f) => { const xs = lossRows.map(f); return [Math.min(...xs), Math.max(...xs)]; };
  const near = (a, b) => a.length === 2 && b.every((v, i) => Math.abs(a[i] - v) <= 1e-6 * Math.max(1, Math.abs(v)));
  for (const [axis, title, want, ticks] of [
    ['time', 'elapsed time (wall clock)', span((r) => r.wall_time - origin), /^(\d+(\.\d+)?s|\d+m(\d\ds)?|\d+h(\d\dm)?)$/],
    ['tokens', 'tokens trained', span((r) => r.tokens), /^(0|\d+(\.\d+)?[KMBT]?)$/],
  ]) {
    await page.selectOption('#x-axis', axis);
    await waitChart('loss', `e.dataset.xKind === "${axis}"`);
    const c = await lossChart();
    const drawnTitle = await page.$eval('[data-chart="loss"] text.x-title', (t) => t.textContent);
    if (c.xTitle !== title || drawnTitle !== title) throw new Error(`x axis ${axis}: title ${c.xTitle} / ${drawnTitle}`);
    if (!near(c.xExtent, want) || !(c.xExtent[0] >= 0)) throw new Error(`x axis ${axis}: extent ${JSON.stringify(c.xExtent)}, the rows give ${JSON.stringify(want)}`);
    if (c.points !== before.points || !c.xTicks.length || !c.xTicks.every((t) => ticks.test(t))) throw new Error(`x axis ${axis}: ${c.points} points, ticks ${JSON.stringify(c.xTicks)}`);
    step(`x axis ${axis}: "${title}", extent ${c.xExtent.map((v) => v.toFixed(2)).join('–')}, ticks ${c.xTicks.join(', ')}`);
  }
  if (JSON.stringify(before.xExtent) === JSON.stringify((await lossChart()).xExtent)) throw new Error('the tokens axis has the step extent');
  // A log y axis on the loss chart (loss is positive: nothing left out).
  await page.check('[data-chart="loss"] input[data-log-toggle]');
  await waitChart('loss', 'e.dataset.log === "true"');
  const logged = await lossChart();
  if (logged.dropped !== 0 || logged.drawn !== logged.points || !/\(log\)$/.test(logged.yTitle)) throw new Error(`log loss: ${JSON.stringify({ ...logged, paths: undefined })}`);
  noNaN(logged, 'log loss');
  step(`log loss: y ticks ${logged.yTicks.join(', ')}`);
  // A reload keeps all three.
  if (!/smooth=0\.9/.test(page.url()) || !/x=tokens/.test(page.url()) || !/log=loss/.test(page.url())) throw new Error(`the URL lacks the settings: ${page.url()}`);
  await page.reload();
  await waitChart('loss', `Number(e.dataset.points) === ${lossRows.length} && e.dataset.smoothing === "0.9" && e.dataset.xKind === "tokens" && e.dataset.log === "true" && e.querySelector("path.line.smoothed")`);
  const kept = await page.evaluate(() => ({ slider: document.querySelector('#smoothing').value, x: document.querySelector('#x-axis').value }));
  const reloaded = await lossChart();
  if (kept.slider !== '0.9' || kept.x !== 'tokens' || reloaded.xTitle !== 'tokens trained' || reloaded.smoothed !== logged.smoothed) throw new Error(`after a reload: ${JSON.stringify(kept)}, ${reloaded.xTitle}`);
  step('settings survive a reload');
  await shot('14-chart-controls');

  // The compare page starts from the same settings (localStorage), for two training runs; with an
  // RL run (no token count) among them it says which run the tokens axis leaves out.
  await page.goto(`${base}/compare.html?ids=${longId},${shortId}`);
  await waitChart('loss', 'Number(e.dataset.series) === 2 && e.dataset.xKind === "tokens" && e.dataset.smoothing === "0.9" && e.dataset.log === "true"');
  if ((await page.$$('[data-chart="loss"] path.line.smoothed')).length !== 2) throw new Error('compare: not two smoothed lines');
  await page.goto(`${base}/compare.html?ids=${longId},${rlId}`);
  await page.check('[data-metric="reward_mean"]');
  await page.waitForFunction((id) => new RegExp(`run ${id}\\b`).test(document.querySelector('#x-axis-note')?.textContent || '') && !document.querySelector('#x-axis-note').hidden, rlId, { timeout: 30_000 });
  await page.selectOption('#x-axis', 'time');
  await waitChart('reward_mean', 'e.dataset.xKind === "time" && Number(e.dataset.points) === 0 && Number(e.dataset.series) === 1');
  await waitChart('loss', 'e.dataset.xKind === "time" && Number(e.dataset.series) === 2');
  if (!(await page.isHidden('#x-axis-note')) || !new RegExp(`ids=${longId},${rlId}`).test(page.url()) || !/x=time/.test(page.url())) throw new Error(`compare on the time axis: ${page.url()}`);
  step('compare: settings carried over, tokens axis leaves the RL run out, time axis takes both');
  await page.selectOption('#x-axis', 'tokens');

  // An RL run has no token count: its charts stay on steps, the option disabled. A log axis
  // leaves out the values ≤ 0 (the all-zero dropped counters: nothing drawn, no NaN).
  await page.goto(`${base}/run.html?id=${rlId}`);
  await waitChart('dropped', 'Number(e.dataset.points) === 6 && e.dataset.xKind === "step"');
  const picker = await page.$eval('#x-axis', (s) => ({ value: s.value, tokens: s.querySelector('option[value="tokens"]').disabled }));
  if (picker.value !== 'step' || !picker.tokens) throw new Error(`an RL run's x axis picker: ${JSON.stringify(picker)}`);
  await page.check('[data-chart="dropped"] input[data-log-toggle]');
  await waitChart('dropped', 'e.dataset.log === "true"');
  const droppedLog = await page.$eval('[data-chart="dropped"]', (e) => ({ drawn: Number(e.dataset.drawn), dropped: Number(e.dataset.dropped), lines: e.querySelectorAll('path.line').length, paths: [...e.querySelectorAll('path')].map((p) => p.getAttribute('d')) }));
  if (droppedLog.drawn !== 0 || droppedLog.dropped !== 12 || droppedLog.lines !== 0) throw new Error(`log of all-zero counters: ${JSON.stringify(droppedLog)}`);
  noNaN(droppedLog, 'log dropped');
  await page.uncheck('[data-chart="dropped"] input[data-log-toggle]');
  const synthetic = await page.evaluate(async () => {
    const { LineChart } = await import('/charts.js');
    const box = document.createElement('div');
    box.dataset.chart = 'log-synthetic';
    document.querySelector('#charts').prepend(box);
    const chart = new LineChart(box, { title: 'log', labels: ['a', 'b'], band: '± std', logY: true });
    chart.set([[[0, -1], [1, 0], [2, 1], [3, 10], [4, 100]], [[0, 5], [1, -3], [2, 0.5]]], [[2, -4, 2], [3, 5, 15], [4, -1, -0.5]]);
    return { drawn: Number(box.dataset.drawn), dropped: Number(box.dataset.dropped), points: Number(box.dataset.points), ticks: JSON.parse(box.dataset.yTicks), paths: [...box.querySelectorAll('path')].map((p) => p.getAttribute('d')) };
  });
  if (synthetic.points !== 5 || synthetic.drawn !== 3 || synthetic.dropped !== 3 || JSON.stringify(synthetic.ticks) !== '["0.5","1","2","5","10","20","50","100"]' && JSON.stringify(synthetic.ticks) !== '["1","10","100"]') throw new Error(`a log chart of mixed signs: ${JSON.stringify(synthetic)}`);
  noNaN(synthetic, 'log synthetic');
  step(`log axes: the RL counters' ${droppedLog.dropped} zeros left out; mixed signs keep ${synthetic.drawn} of ${synthetic.points}, ticks ${synthetic.ticks.join(', ')}`);

  // Back to the defaults, so the later pages read as before.
  await page.goto(`${base}/run.html?id=${longId}`);
  await waitPointsAbove('loss', 1);
  await page.uncheck('[data-chart="loss"] input[data-log-toggle]');
  await page.selectOption('#x-axis', 'step');
  await page.$eval('#smoothing', (e) => { e.value = '0'; e.dispatchEvent(new Event('input', { bubbles: true })); });
  await waitChart('loss', 'e.dataset.smoothing === "0" && e.dataset.xKind === "step" && e.dataset.log === "false" && !e.querySelector("path.line.smoothed")');
  const reset = await page.evaluate(() => ({ url: location.search, stored: JSON.parse(localStorage.getItem('anneal-charts')) }));
  if (reset.url !== `?id=${longId}` || reset.stored.smoothing !== 0 || reset.stored.x !== 'step' || reset.stored.log.length) throw new Error(`the defaults again: ${JSON.stringify(reset)}`);

  // 14. A multi-turn RL run's samples: each episode turn by turn (the prompt first and collapsed,
  //     then policy turns and the tool's outputs in turn), tool calls shown as calls, the turn an
  //     episode failed at marked with its error; everything as text, as the API gave it.
  await page.goto(`${base}/run.html?id=${toolsRun}`);
  await waitStatus('completed', 30_000);
  await page.waitForSelector('#samples-table tr[data-turns] ol.turns li.turn', { timeout: 30_000 });
  const api = await page.evaluate(async (id) => (await fetch(`/api/runs/${id}/samples?limit=20`)).json(), toolsRun);
  const shown = await page.$$eval('#samples-table tr[data-sample]', (rows) => rows.map((r) => ({
    cells: r.cells.length,
    turns: [...r.querySelectorAll('li.turn')].map((li) => ({
      role: li.dataset.role,
      error: li.dataset.error === 'true',
      errorText: li.querySelector('.turn-error')?.textContent || '',
      calls: [...li.querySelectorAll('.tool-call:not(.bad) code')].map((c) => c.textContent),
      collapsed: li.querySelector('details') ? !li.querySelector('details').open : null,
    })),
  })));
  if (shown.length !== api.samples.length || !shown.length) throw new Error(`${shown.length} episodes shown, the API gave ${api.samples.length}`);
  shown.forEach((row, i) => {
    const turns = api.samples[i].turns;
    const roles = row.turns.map((t) => t.role);
    if (row.cells !== 5 || roles.join() !== turns.map((t) => t.role).join()) throw new Error(`episode ${i}: turns ${roles} (${row.cells} cells), the API's ${turns.map((t) => t.role)}`);
    // prompt, then policy and observation turns alternating, a policy turn after the prompt.
    if (roles[0] !== 'prompt' || roles.slice(1).some((r, j) => (j % 2 === 0) !== (r === 'policy'))) throw new Error(`episode ${i}: turns out of order: ${roles}`);
    if (row.turns[0].collapsed !== true) throw new Error(`episode ${i}: the prompt is not collapsed`);
    row.turns.forEach((t, j) => {
      const want = turns[j].error;
      if (t.error !== Boolean(want) || (want && !t.errorText.includes(want.slice(want.indexOf(': ') + 2)))) throw new Error(`episode ${i} turn ${j}: error ${JSON.stringify(t.errorText)}, the API's ${JSON.stringify(want)}`);
    });
  });
  const calls = shown.flatMap((r) => r.turns.flatMap((t) => t.calls));
  if (!calls.some((c) => /^calculator\(\{"expression": "[^"]*"\}\)$/.test(c))) throw new Error(`no tool call shown as calculator({"expression": ...}): ${JSON.stringify(calls)}`);
  const failedTurns = shown.flatMap((r) => r.turns.filter((t) => t.error));
  if (!failedTurns.length) throw new Error('no failed episode marked');
  // A tool's output follows a turn with a call; model text is text (no <tool_call> element).
  if (!shown.some((r) => r.turns.some((t) => t.role === 'tool'))) throw new Error('no tool output shown');
  if (await page.$('#samples-table tool_call')) throw new Error('model text was parsed as HTML');
  // The prompt opens to the rendered first messages, the tools' system block with them.
  const firstPrompt = page.locator('#samples-table li.turn[data-role="prompt"] details').first();
  await firstPrompt.locator('summary').click();
  const promptText = await firstPrompt.locator('code.completion').textContent();
  if (!(await firstPrompt.evaluate((d) => d.open)) || !promptText.includes('<|im_start|>') || !promptText.includes('calculator')) throw new Error(`the opened prompt: ${JSON.stringify(promptText.slice(0, 200))}`);
  step(`multi-turn samples: ${shown.length} episodes, ${calls.length} tool calls (e.g. ${calls[0]}), ${failedTurns.length} failed (${failedTurns[0].errorText.slice(0, 80)})`);
  await page.locator('#samples').scrollIntoViewIfNeeded();
  await shot('13-rl-turns');

  if (consoleErrors.length) throw new Error(`errors in the page: ${consoleErrors.join(' | ')}`);
  step('ok');
} catch (e) {
  await shot('failure').catch(() => {});
  console.error(`browser test failed: ${e.message}`);
  if (consoleErrors.length) console.error(`page errors: ${consoleErrors.join(' | ')}`);
  await browser.close();
  process.exit(1);
}
await browser.close();

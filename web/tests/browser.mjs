// Browser test of the UI in headless Chromium (playwright-core driving Debian's chromium):
// create a run from the form (with an inline validation error first), watch its chart gain
// points, stop it, resume it, compare two runs, check the runs table's mini-curves, the plugins
// page, a reward module upload and test, and the sampling box.
// Saves screenshots of each stage.
//
//   node web/tests/browser.mjs http://127.0.0.1:PORT SCREENSHOT_DIR
//
// Environment: ANNEAL_LONG_OVERRIDES and ANNEAL_SHORT_OVERRIDES (newline-separated overrides of
// a run long enough to stop, and of a short one), ANNEAL_BAD_OVERRIDE (one the config rejects),
// ANNEAL_BAD_KEY (the key path the error must name), ANNEAL_REWARD_MODULE (a reward module file),
// CHROMIUM (default /usr/bin/chromium).
import { chromium } from 'playwright-core';
import { mkdirSync } from 'node:fs';
import { join } from 'node:path';

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
  // Event streams are cut when the page navigates away.
  if (!r.url().includes('/events')) consoleErrors.push(`request failed: ${r.url()}`);
});

const step = (what) => console.log(`browser: ${what}`);
const shot = async (name) => {
  await page.screenshot({ path: join(shots, `${name}.png`), fullPage: true });
  step(`screenshot ${name}.png`);
};
const points = (chart) => page.$eval(`[data-chart="${chart}"]`, (e) => Number(e.dataset.points || 0)).catch(() => 0);
const waitStatus = (status, timeout = 90_000) =>
  page.waitForSelector(`#run-status [data-status="${status}"]`, { timeout });
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
      body: JSON.stringify({ name: 'browser-short', config_path: (await (await fetch('/api/configs')).json())[0].path, overrides }),
    });
    return { status: res.status, body: await res.json() };
  }, shortOverrides);
  if (created.status !== 201) throw new Error(`creating the second run: ${JSON.stringify(created)}`);
  const shortId = created.body.id;
  await page.goto(`${base}/run.html?id=${shortId}`);
  await waitStatus('completed', 120_000);
  step(`run ${shortId} completed`);

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

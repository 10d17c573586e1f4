#!/usr/bin/env bash
# Regenerates docs/serving.md's screenshots of the RL pages (docs/screenshots/*.png) from a real run:
# the digit-sorting warm start (configs/rl_digits_sft.toml), then 150 steps of
# configs/rl_digits.toml started through `anneal serve`'s API with the two example reward
# modules uploaded, then headless Chromium on the run page and on its failed samples.
# Needs a release build and scripts/setup-web.sh (chromium, playwright-core). About 2 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${CARGO_TARGET_DIR:-target}/release/anneal"
HOME_DIR="$(mktemp -d)"
SERVER=""
trap 'kill "$SERVER" 2>/dev/null || true; rm -rf "$HOME_DIR"' EXIT
[ -f data/digits_sft.jsonl ] || python3 scripts/digits-sft-data.py data/digits_sft.jsonl 20000
"$BIN" train configs/rl_digits_sft.toml --run-dir "$HOME_DIR/sft" >/dev/null
"$BIN" serve --addr 127.0.0.1:0 --home "$HOME_DIR/serve" >"$HOME_DIR/serve.out" 2>&1 &
SERVER=$!
for _ in $(seq 100); do grep -q http:// "$HOME_DIR/serve.out" && break; sleep 0.1; done
URL="$(grep -o 'http://[0-9.:]*' "$HOME_DIR/serve.out" | head -1)"
upload() {
  curl -sf -X POST "$URL/api/rewards?name=$1" -H 'Content-Type: application/wasm' \
    --data-binary @"reward-wasm/examples/${1%.wat}/reward.wat" | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])'
}
EXACT="$(upload exact_match.wat)"
POSITION="$(upload position_match.wat)"
RUN="$(curl -sf -X POST "$URL/api/runs" -H 'Content-Type: application/json' -d "{
  \"name\": \"digits GRPO\", \"config_path\": \"configs/rl_digits.toml\",
  \"overrides\": [\"rl.init_from=\\\"$HOME_DIR/sft/checkpoints/step-260\\\"\", \"training.steps=150\",
                  \"rl.eval_freq=25\", \"rl.eval_prompts=100\", \"rl.samples_every=10\"],
  \"rewards\": [{\"id\": $EXACT, \"weight\": 1.0}, {\"id\": $POSITION, \"weight\": 1.0}]}" \
  | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')"
until curl -sf "$URL/api/runs/$RUN" | grep -q '"status":"\(completed\|failed\)"'; do sleep 2; done
(cd web && node --input-type=module -e "
import { chromium } from 'playwright-core';
const browser = await chromium.launch({ executablePath: '/usr/bin/chromium',
  args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking',
         '--disable-component-update', '--disable-sync', '--no-first-run', '--disable-quic'] });
const page = await browser.newPage({ viewport: { width: 1280, height: 800 } });
await page.goto('$URL/run.html?id=$RUN');
await page.waitForFunction(() => Number(document.querySelector('[data-chart=\"reward\"]')?.dataset.points || 0) > 100);
await page.screenshot({ path: '../docs/screenshots/rl-run.png' });
await page.check('#samples-failed');
await page.waitForTimeout(1000);
await page.\$eval('#samples-failed', (e) => (e.closest('.panel') || e).scrollIntoView());
await page.screenshot({ path: '../docs/screenshots/rl-samples.png' });
await browser.close();
")
echo "wrote docs/screenshots/rl-run.png and rl-samples.png (run $RUN)"

#!/usr/bin/env bash
# Installs what the browser UI and its tests need: the UI's npm packages (uPlot, served from
# web/node_modules; playwright-core for the browser tests) and Debian's headless Chromium.
# Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
sudo=""
[ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && sudo="sudo"
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq nodejs npm
fi
if [ ! -x /usr/bin/chromium ]; then
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium
fi
if [ ! -f web/node_modules/uplot/dist/uPlot.esm.js ] || [ ! -d web/node_modules/playwright-core ]; then
  (cd web && npm ci --no-audit --no-fund --loglevel=error)
fi

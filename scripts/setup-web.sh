#!/usr/bin/env bash
# Installs what the browser UI's tests need: playwright-core (web/node_modules) and Debian's
# headless Chromium. The UI itself needs no package: `anneal serve` serves web/ as it is.
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
if [ ! -d web/node_modules/playwright-core ]; then
  (cd web && npm ci --no-audit --no-fund --loglevel=error)
fi

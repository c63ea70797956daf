#!/usr/bin/env bash
# The docs in a real browser: headless Chromium, driven through WebDriver by
# Selenium (pinned in .ci/requirements-browser.txt), runs what a person
# would on /docs against a fresh `serve --demo` reached as
# http://localhost:<random port>, so the page must work on a host and port
# other than the spec's defaults, under its same-origin CSP. It authorizes
# with tok_test_A, runs "Try it out" for POST /transfers twice with one
# Idempotency-Key (201, then the replay), checks the ledger moved once and
# that / lands on /docs (.ci/docs-try-it-out.py). Debian's chromium and
# chromium-driver are installed with apt when missing. The screenshot is
# kept in target/browser/docs-try-it-out.png, on failure too. About 15
# seconds once installed.
set -euo pipefail
cd "$(dirname "$0")/../.."

CHROMIUM=/usr/bin/chromium
CHROMEDRIVER=/usr/bin/chromedriver
SCREENSHOT=target/browser/docs-try-it-out.png
# The browser's part; each wait inside it is bounded by 20s on its own.
BROWSER_TIMEOUT_SECS=120
APT_TIMEOUT_SECS=900

if [ ! -x "$CHROMIUM" ] || [ ! -x "$CHROMEDRIVER" ]; then
  echo "installing chromium and chromium-driver"
  sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  # The package lists of a fresh machine may be missing or name versions
  # the mirror no longer has.
  timeout "$APT_TIMEOUT_SECS" "${sudo[@]}" apt-get update -qq
  timeout "$APT_TIMEOUT_SECS" "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
fi
# Debian's launcher script trips over its own /dev/shm check on some
# machines; the noise on stderr is not this step's.
echo "$("$CHROMIUM" --version 2>/dev/null), $("$CHROMEDRIVER" --version | cut -d' ' -f1-2)"

source .ci/lib/python-venv.sh
source .ci/lib/demo-server.sh

python_venv target/ci-venv-browser .ci/requirements-browser.txt
start_demo_server browser
# Through localhost, not the 127.0.0.1 the server was started on: the page
# must send its requests to whatever origin it was opened from.
BROWSER_BASE_URL="http://localhost:${BASE_URL##*:}"

rm -f "$SCREENSHOT"
timeout "$BROWSER_TIMEOUT_SECS" target/ci-venv-browser/bin/python .ci/docs-try-it-out.py \
  --base-url "$BROWSER_BASE_URL" --screenshot "$SCREENSHOT" \
  --chromium "$CHROMIUM" --chromedriver "$CHROMEDRIVER"
echo "browser test passed; screenshot in $SCREENSHOT"

#!/usr/bin/env bash
# The contract test: schemathesis (pinned, from PyPI) drives the running
# server from openapi.yaml and fails on any response whose status, content
# type, headers or body the spec does not describe, on any 5xx, on valid
# data refused or invalid data accepted, on auth that is ignored and on
# methods that are not refused (`--checks all`; the one per-operation
# exception is explained in .ci/schemathesis.toml). Bounded by
# CONTRACT_MAX_EXAMPLES per operation and CONTRACT_TIMEOUT_SECS in all.
set -euo pipefail
cd "$(dirname "$0")/../.."

# Test cases per operation and phase: enough to walk every schema keyword,
# few enough that the whole run takes about a minute on 2 cores.
CONTRACT_MAX_EXAMPLES="${CONTRACT_MAX_EXAMPLES:-100}"
CONTRACT_TIMEOUT_SECS="${CONTRACT_TIMEOUT_SECS:-600}"
REPORT_DIR=target/schemathesis

source .ci/lib/python-venv.sh
source .ci/lib/demo-server.sh

python_venv target/ci-venv-contract .ci/requirements-contract.txt
# The admin endpoint on, with a token made for this run, and the scheduled
# reconciliation on, so the endpoint has a report to show.
CONTRACT_ADMIN_TOKEN="$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')"
export CONTRACT_ADMIN_TOKEN
NEXO_ADMIN_TOKEN="$CONTRACT_ADMIN_TOKEN" NEXO_RECONCILE_INTERVAL=60s start_demo_server contract

seed_args=()
if [ -n "${CONTRACT_SEED:-}" ]; then
  seed_args=(--seed "$CONTRACT_SEED")
fi

rm -rf "$REPORT_DIR"
# One worker: hypothesis describes its strategies by parsing source with
# Python's ast module, which fails with "AST constructor recursion depth
# mismatch" when two threads do it at once on CPython 3.11.
timeout "$CONTRACT_TIMEOUT_SECS" target/ci-venv-contract/bin/schemathesis \
  --config-file .ci/schemathesis.toml \
  run openapi.yaml \
  --url "$BASE_URL" \
  --checks all \
  --workers 1 \
  --max-examples "$CONTRACT_MAX_EXAMPLES" \
  --request-timeout 20 \
  --report junit --report-junit-path "$REPORT_DIR/junit.xml" \
  "${seed_args[@]}"
echo "contract test passed; JUnit report in $REPORT_DIR/junit.xml"

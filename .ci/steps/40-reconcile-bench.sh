#!/usr/bin/env bash
# The reconciliation on a synthetic ledger far larger than the tests' (100k
# transfers, about half a minute on 2 cores): a healthy ledger must exit 0,
# the same ledger broken in two places must exit 1 naming both. The full
# million-transfer measurement in docs/operations.md uses the same script.
set -euo pipefail
cargo build --locked --bin nexo-transfers
RECONCILE_BENCH_RUNS=1 timeout 600 scripts/reconcile-bench.sh 100000

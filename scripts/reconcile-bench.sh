#!/usr/bin/env bash
# Times `nexo-transfers reconcile` on a synthetic ledger of N customer
# transfers (default 1,000,000) in a throwaway database, then breaks the
# ledger in two places and checks that reconcile exits 1 naming both.
#
#   scripts/reconcile-bench.sh [N]
#
# Needs psql, a PostgreSQL server reachable through DATABASE_URL (its user
# may create databases; the database part of the URL is replaced), and the
# binary at NEXO_BIN (default target/debug/nexo-transfers: the time is spent
# in PostgreSQL, not in the binary). The database is dropped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

transfers="${1:-1000000}"
runs="${RECONCILE_BENCH_RUNS:-3}"
bin="${NEXO_BIN:-target/debug/nexo-transfers}"
url="${DATABASE_URL:-postgres://postgres:postgres@localhost:5432/nexo_transfers}"
url="${url%%\?*}"
server="${url%/*}"
db="nexo_reconcile_bench_$$"
bench_url="$server/$db"

[ -x "$bin" ] || { echo "no binary at $bin: run cargo build first" >&2; exit 1; }
psql -X -q "$server/postgres" -c "CREATE DATABASE $db"
trap 'psql -X -q "$server/postgres" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)"' EXIT

DATABASE_URL="$bench_url" "$bin" migrate >/dev/null
echo "== building a ledger of $transfers transfers"
start=$(date +%s)
psql -X -q "$bench_url" -v transfers="$transfers" -f scripts/reconcile-bench.sql
echo "built in $(( $(date +%s) - start ))s"

echo "== reconcile, $runs runs (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
for run in $(seq 1 "$runs"); do
  log=$(mktemp)
  set +e
  DATABASE_URL="$bench_url" RUST_LOG=nexo_transfers::reconcile=debug NEXO_LOG_FORMAT=json \
    "$bin" reconcile >"$log.out" 2>"$log"
  status=$?
  set -e
  if [ "$status" -ne 0 ]; then
    cat "$log.out" "$log" >&2
    echo "FAIL: reconcile exited $status on a healthy ledger" >&2
    exit 1
  fi
  per_check=$(grep -o '"check":"[a-z_]*","found":[0-9]*,"elapsed_ms":[0-9]*' "$log" \
    | sed -E 's/"check":"([a-z_]*)","found":[0-9]*,"elapsed_ms":([0-9]*)/\1=\2ms/' | paste -sd' ')
  echo "run $run: $(head -1 "$log.out") | $per_check"
  rm -f "$log" "$log.out"
done

echo "== breaking the ledger: a balance edited by hand, a young key record deleted"
psql -X -q "$bench_url" <<'SQL'
UPDATE accounts SET balance_minor = balance_minor + 1 WHERE id = 'acc_busd7';
DELETE FROM idempotency_keys
WHERE (principal_id, idempotency_key) IN (
    SELECT principal_id, idempotency_key FROM idempotency_keys ORDER BY created_at DESC LIMIT 1);
SQL
set +e
report=$(DATABASE_URL="$bench_url" RUST_LOG=warn "$bin" reconcile)
status=$?
set -e
echo "$report"
[ "$status" -eq 1 ] || { echo "FAIL: expected exit status 1 on a broken ledger, got $status" >&2; exit 1; }
for expected in "FAIL account_balances" "account_id=acc_busd7" "FAIL currency_totals" \
                "FAIL transfer_key_record" "3 discrepancies found"; do
  grep -qF "$expected" <<<"$report" || { echo "FAIL: the report does not name: $expected" >&2; exit 1; }
done
echo "ok: healthy ledger exits 0, broken ledger exits 1 naming each discrepancy"

#!/usr/bin/env bash
# A small run of every load-generator scenario against the real server on a
# fresh database: each run checks afterwards that the ledger reconciles and
# that every key executed once, and fails on any 5xx or transport error.
# About half a minute; the full benchmark (bench/run.sh) is not run in CI.
set -euo pipefail

DB="nexo_loadgen_smoke_$$"
URL="${DATABASE_URL%/*}/${DB}"
ADMIN_URL="${DATABASE_URL%/*}/postgres"
PORT="${LOADGEN_SMOKE_PORT:-18191}"
DIR="target/loadgen-smoke"
SERVER_PID=""

cleanup() {
  if [ -n "$SERVER_PID" ]; then
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  psql "$ADMIN_URL" -qAt -c "DROP DATABASE IF EXISTS ${DB} WITH (FORCE)" >/dev/null 2>&1 || true
}
trap cleanup EXIT

cargo build --locked --bins
mkdir -p "$DIR"
psql "$ADMIN_URL" -qAt -c "CREATE DATABASE ${DB}"
DATABASE_URL="$URL" target/debug/loadgen setup --accounts 200 --fixture "$DIR/fixture.json"

DATABASE_URL="$URL" NEXO_BIND="127.0.0.1:${PORT}" NEXO_PURGE_INTERVAL=0s RUST_LOG=warn \
  target/debug/nexo-transfers serve > "$DIR/server.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 1 100); do
  curl -fs "http://127.0.0.1:${PORT}/readyz" >/dev/null 2>&1 && break
  kill -0 "$SERVER_PID" 2>/dev/null || { cat "$DIR/server.log"; exit 1; }
  sleep 0.1
done

for scenario in new replay storm hot hold mixed; do
  DATABASE_URL="$URL" target/debug/loadgen run --scenario "$scenario" --concurrency 8 \
    --requests 200 --warmup 0s --replay-intents 50 --fail-on-errors \
    --url "http://127.0.0.1:${PORT}" --fixture "$DIR/fixture.json" \
    --server-pid "$SERVER_PID" --out "$DIR/${scenario}.json"
done
echo "loadgen smoke: 6 scenarios passed their checks"

#!/usr/bin/env bash
# The benchmark, in one go, on a fresh database: pgbench running the SQL a
# transfer needs (the database's own ceiling), then the release server
# driven by the load generator for each scenario and concurrency, the same
# server with synchronous replication on and off (bench/replication.sh, when
# pg_autoctl is installed), then docs/benchmarks.md and docs/benchmarks.png
# from the results.
#
#   bench/run.sh           full run (about 20 minutes)
#   bench/run.sh --quick   short durations and fewer accounts: a smoke check
#
# Needs PostgreSQL (DATABASE_URL names any database on the server; a fresh
# one is created beside it and dropped afterwards), pgbench, psql, cargo and
# python3 (matplotlib is installed from PyPI into target/bench-venv).
# Everything runs on loopback. Exits non-zero when any run's checks failed.
set -euo pipefail
cd "$(dirname "$0")/.."

QUICK=0
WRITE_DOCS=1
for arg in "$@"; do
  case "$arg" in
    --quick) QUICK=1 ;;
    --no-docs) WRITE_DOCS=0 ;;
    *) echo "usage: bench/run.sh [--quick] [--no-docs]" >&2; exit 2 ;;
  esac
done

BASE_URL="${DATABASE_URL:-postgres://postgres:postgres@localhost:5432/nexo_transfers}"
BENCH_DB="nexo_bench_$$"
# One transport for every client of the database (pgbench, psql, the server,
# the load generator), so their figures compare: libpq and the server both
# default to `prefer`, TLS wherever the server offers it (Debian's does).
# BENCH_SSLMODE=disable measures without TLS on both sides.
BENCH_SSLMODE="${BENCH_SSLMODE:-prefer}"
BENCH_URL="${BASE_URL%/*}/${BENCH_DB}?sslmode=${BENCH_SSLMODE}"
ADMIN_URL="${BASE_URL%/*}/postgres"
PORT="${BENCH_PORT:-18181}"
CONCURRENCIES="${BENCH_CONCURRENCIES:-1 8 32 64}"
SCENARIOS="${BENCH_SCENARIOS:-new replay storm hot hold mixed}"
BATCHED_K="${BENCH_BATCHED_K:-16 32}"
if [ "$QUICK" = 1 ]; then
  ACCOUNTS=1000; SECONDS_PER_RUN=2; WARMUP=0.5s; READ_KEYS=1000
else
  # 10,000 accounts as in the issue's ceiling; 10 s per point keeps a full
  # run (7 pgbench variants and 6 scenarios at 4 concurrencies) near 20 min.
  ACCOUNTS=10000; SECONDS_PER_RUN=10; WARMUP=2s; READ_KEYS=10000
fi
OUT="target/bench/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$OUT"
echo "results in $OUT"

SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  psql "$ADMIN_URL" -qAt -c "DROP DATABASE IF EXISTS ${BENCH_DB} WITH (FORCE)" >/dev/null 2>&1 || true
}
trap cleanup EXIT

if (exec 3<>"/dev/tcp/127.0.0.1/${PORT}") 2>/dev/null; then
  echo "port ${PORT} is in use; set BENCH_PORT" >&2
  exit 1
fi

echo "== build (release)"
cargo build --release --locked --bins
SERVER=target/release/nexo-transfers
LOADGEN=target/release/loadgen

echo "== machine"
{
  echo "nproc=$(nproc)"
  echo "memory_mib=$(awk '/MemTotal/ {printf "%d", $2/1024}' /proc/meminfo)"
  echo "cpu=$(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo)"
  echo "postgres=$(psql "$ADMIN_URL" -qAt -c 'SHOW server_version')"
  echo "synchronous_commit=$(psql "$ADMIN_URL" -qAt -c 'SHOW synchronous_commit')"
  echo "shared_buffers=$(psql "$ADMIN_URL" -qAt -c 'SHOW shared_buffers')"
  echo "load_before=$(cut -d' ' -f1-3 /proc/loadavg)"
  echo "quick=${QUICK}"
  echo "accounts=${ACCOUNTS}"
  echo "seconds_per_run=${SECONDS_PER_RUN}"
  echo "batched_k=${BATCHED_K}"
} > "$OUT/machine.txt"
cat "$OUT/machine.txt"

echo "== fresh database ${BENCH_DB} with ${ACCOUNTS} funded accounts"
psql "$ADMIN_URL" -qAt -c "CREATE DATABASE ${BENCH_DB}"
DATABASE_URL="$BENCH_URL" "$LOADGEN" setup --accounts "$ACCOUNTS" --fixture "$OUT/fixture.json"
PRINCIPAL=$(psql "$BENCH_URL" -qAt -c "SELECT id FROM principals ORDER BY name LIMIT 1")

# pgbench: -M prepared as sqlx does; two threads, one per core.
pgbench_run() { # name clients script [-D ...]
  local name=$1 clients=$2 script=$3
  shift 3
  local threads=$(( clients < 2 ? 1 : 2 ))
  mkdir -p "$OUT/pgbench-log"
  pgbench -n -M prepared -c "$clients" -j "$threads" -T "$SECONDS_PER_RUN" \
    -l --log-prefix="$OUT/pgbench-log/${name}-${clients}" \
    -D principal="$PRINCIPAL" -D accounts="$ACCOUNTS" "$@" \
    -f "bench/pgbench/${script}" "$BENCH_URL" > "$OUT/pgbench-${name}-${clients}.txt" 2>&1
  echo "pgbench ${name} c=${clients}: $(grep -E '^tps' "$OUT/pgbench-${name}-${clients}.txt")"
}

echo "== database ceiling (pgbench, ${SECONDS_PER_RUN}s each)"
for c in $CONCURRENCIES; do pgbench_run new "$c" transfer.sql -D hot=0; done
for c in $CONCURRENCIES; do pgbench_run hot "$c" transfer.sql -D hot=1; done
psql "$BENCH_URL" -qAt -v principal="$PRINCIPAL" -v read_keys="$READ_KEYS" -f bench/pgbench/read_keys.sql >/dev/null
for c in $CONCURRENCIES; do pgbench_run read "$c" read.sql -D read_keys="$READ_KEYS"; done
# The batched ceiling: the same SQL for k transfers per transaction and
# their k claims in one statement, as the server's posting batches write
# them (k = 16, and 32: BATCH_TRANSFERS_MAX, the most a server batch holds).
psql "$BENCH_URL" -qAt -f bench/pgbench/pairs.sql >/dev/null
# Statistics for the tables the runs above filled: a plan made on the empty
# tables' (autovacuum analyzes later, and each pgbench connection keeps its
# plans) reads every key of the benchmark's one principal per batch, and
# the batched ceiling would fall below the naive one as the tables grow.
psql "$BENCH_URL" -qAt -c "ANALYZE" >/dev/null
for k in $BATCHED_K; do
  for c in $CONCURRENCIES; do pgbench_run "newb${k}" "$c" transfer_batch.sql -D hot=0 -D k="$k"; done
  for c in $CONCURRENCIES; do pgbench_run "hotb${k}" "$c" transfer_batch.sql -D hot=1 -D k="$k"; done
done

start_server() {
  DATABASE_URL="$BENCH_URL" NEXO_BIND="127.0.0.1:${PORT}" NEXO_PURGE_INTERVAL=0s \
    "$SERVER" serve >> "$OUT/server.log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 100); do
    if curl -fs "http://127.0.0.1:${PORT}/readyz" >/dev/null 2>&1; then return 0; fi
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "the server exited; see $OUT/server.log" >&2; exit 1; }
    sleep 0.1
  done
  echo "the server did not become ready" >&2
  exit 1
}

stop_server() {
  kill "$SERVER_PID"
  wait "$SERVER_PID" 2>/dev/null || true
  SERVER_PID=""
}

echo "== server + loadgen (${SECONDS_PER_RUN}s each after ${WARMUP} warm-up)"
FAILED=0
for s in $SCENARIOS; do
  for c in $CONCURRENCIES; do
    # A fresh process per point, so its peak resident memory is this load's.
    start_server
    if ! DATABASE_URL="$BENCH_URL" "$LOADGEN" run --scenario "$s" --concurrency "$c" \
        --url "http://127.0.0.1:${PORT}" --duration "${SECONDS_PER_RUN}s" --warmup "$WARMUP" \
        --fixture "$OUT/fixture.json" --server-pid "$SERVER_PID" \
        --out "$OUT/loadgen-${s}-${c}.json"; then
      echo "CHECKS FAILED: ${s} c=${c}" | tee -a "$OUT/failures.txt"
      FAILED=1
    fi
    stop_server
  done
done
echo "load_after=$(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/machine.txt"

echo "== storage per transfer (after VACUUM)"
# Every row the runs left: pgbench's transfers and the server's, their
# entries, their key records (full answers, none compacted: the purge is
# off) and, where the schema has them, holds and events. Total relation
# size: heap, TOAST and every index.
psql "$BENCH_URL" -qAt -c "VACUUM ANALYZE" >/dev/null
psql "$BENCH_URL" -qAt -F ' ' -c "
  SELECT c.relname, pg_total_relation_size(c.oid),
         (xpath('/row/n/text()', query_to_xml(format('SELECT count(*) AS n FROM %I', c.relname), false, true, '')))[1]::text::bigint
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
  WHERE n.nspname = 'public' AND c.relkind = 'r'
    AND c.relname IN ('transfers', 'ledger_entries', 'idempotency_keys', 'holds', 'events')
  ORDER BY c.relname" > "$OUT/storage.txt"
cat "$OUT/storage.txt"

# What synchronous replication costs (ADR-008): the same server on a
# two-node pg_auto_failover cluster of its own (never the machine's
# PostgreSQL), when pg_autoctl is installed; BENCH_REPLICATION=0 skips it.
if [ "${BENCH_REPLICATION:-1}" = 1 ] && command -v pg_autoctl >/dev/null 2>&1; then
  echo "== synchronous replication (bench/replication.sh)"
  if ! BENCH_REPLICATION_OUT="$OUT/replication" BENCH_REPLICATION_SECONDS="$SECONDS_PER_RUN" \
      bash bench/replication.sh; then
    echo "CHECKS FAILED: replication" | tee -a "$OUT/failures.txt"
    FAILED=1
  fi
else
  echo "== synchronous replication: skipped (no pg_autoctl, or BENCH_REPLICATION=0)"
fi

if [ "$WRITE_DOCS" = 1 ]; then
  echo "== report"
  VENV=target/bench-venv
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "matplotlib>=3.8,<4"
  mkdir -p docs
  "$VENV/bin/python" bench/report.py "$OUT" docs/benchmarks.md docs/benchmarks.png
  echo "wrote docs/benchmarks.md and docs/benchmarks.png"
fi
exit "$FAILED"

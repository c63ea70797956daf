#!/usr/bin/env bash
# What synchronous replication costs: the release server on the highly
# available cluster of scripts/ha-cluster.sh (pg_auto_failover from Debian's
# packages, a primary and a standby on loopback), driven by the load
# generator with the same load twice: the standby in the commit quorum
# (every acknowledged transfer is on both nodes, ADR-008), then trailing
# asynchronously. Prints both rates and their ratio, writes them to
# target/bench/replication-<time>/ (or BENCH_REPLICATION_OUT), and exits non-zero when a run's
# exactly-once or ledger checks fail.
#
#   bench/replication.sh                       32 clients, `new`, 10 s each
#   BENCH_REPLICATION_CLIENTS=64 bench/replication.sh
#
# The cluster is created under a temporary directory and removed at the
# end; it never touches the machine's own PostgreSQL.
set -euo pipefail
cd "$(dirname "$0")/.."

CLIENTS="${BENCH_REPLICATION_CLIENTS:-32}"
SECONDS_PER_RUN="${BENCH_REPLICATION_SECONDS:-10}"
SCENARIO="${BENCH_REPLICATION_SCENARIO:-new}"
PORT="${BENCH_PORT:-18182}"
# bench/run.sh passes its own result folder, so the report has it.
OUT="${BENCH_REPLICATION_OUT:-target/bench/replication-$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$OUT"
export HA_DIR="${HA_DIR:-$(mktemp -d /tmp/nexo-ha-bench.XXXXXX)}"
rmdir "$HA_DIR" 2>/dev/null || true

SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ]; then
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  bash scripts/ha-cluster.sh down || true
}
trap cleanup EXIT

cargo build --release --locked --bins
bash scripts/ha-cluster.sh up
URL="$(bash scripts/ha-cluster.sh uri)"
# The load generator's own connections (setup, the checks) take one host:
# the primary's, from the service's two-host URL.
PRIMARY_PORT=$(case "$(bash scripts/ha-cluster.sh primary)" in node2) echo 2 ;; *) echo 1 ;; esac)
HOSTS="${URL#postgres://}"; HOSTS="${HOSTS%%/*}"; HOSTS="${HOSTS#*@}"
PRIMARY_HOST=$(echo "$HOSTS" | cut -d, -f"$PRIMARY_PORT")
DBPATH="${URL#*://*/}"; DBPATH="${DBPATH%%\?*}"
CHECK_URL="postgres://postgres@${PRIMARY_HOST}/${DBPATH}"
DATABASE_URL="$CHECK_URL" target/release/loadgen setup --accounts 1000 --fixture "$OUT/fixture.json"

DATABASE_URL="$URL" NEXO_BIND="127.0.0.1:${PORT}" NEXO_PURGE_INTERVAL=0s \
  target/release/nexo-transfers serve >> "$OUT/server.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 1 100); do
  curl -fs "http://127.0.0.1:${PORT}/readyz" >/dev/null 2>&1 && break
  kill -0 "$SERVER_PID" 2>/dev/null || { cat "$OUT/server.log" >&2; exit 1; }
  sleep 0.1
done

FAILED=0
for mode in on off; do
  bash scripts/ha-cluster.sh sync "$mode"
  echo "== synchronous replication ${mode}: ${SCENARIO}, ${CLIENTS} clients, ${SECONDS_PER_RUN}s"
  if ! DATABASE_URL="$CHECK_URL" target/release/loadgen run --scenario "$SCENARIO" --concurrency "$CLIENTS" \
      --url "http://127.0.0.1:${PORT}" --duration "${SECONDS_PER_RUN}s" --warmup 2s \
      --fixture "$OUT/fixture.json" --server-pid "$SERVER_PID" --out "$OUT/sync-${mode}.json"; then
    FAILED=1
  fi
done
bash scripts/ha-cluster.sh sync on

python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
runs = {m: json.load(open(os.path.join(out, f"sync-{m}.json"))) for m in ("on", "off")}
rows = ["| synchronous replication | req/s | p50 ms | p99 ms | checks |", "|---|---:|---:|---:|---|"]
for mode, r in runs.items():
    rows.append(f"| {mode} | {r['throughput_rps']:,.0f} | {r['latency_ms']['p50']:.2f} | "
                f"{r['latency_ms']['p99']:.2f} | {'ok' if r['ok'] else 'FAILED'} |")
ratio = runs["on"]["throughput_rps"] / runs["off"]["throughput_rps"] if runs["off"]["throughput_rps"] else float("nan")
rows.append("")
rows.append(f"With the standby in the commit quorum the server does {ratio:.2f} of its asynchronous throughput.")
text = "\n".join(rows) + "\n"
open(os.path.join(out, "replication.md"), "w").write(text)
print(text)
PY
exit "$FAILED"

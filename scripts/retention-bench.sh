#!/usr/bin/env bash
# What the long memory of idempotency keys costs: N completed key records
# (default 1,000,000; 95% successes with a real-sized 201 body, 5% refusals)
# in a throwaway database, measured full, then compacted past their TTL by
# `nexo-transfers purge-expired` (timed), then deleted past their retention
# by the same command (timed). Prints bytes per key (heap, TOAST and
# indexes, after VACUUM FULL so dead space is not counted) at each stage.
#
#   scripts/retention-bench.sh [N]
#
# Needs psql, a PostgreSQL server reachable through DATABASE_URL (its user
# may create databases; the database part of the URL is replaced), and the
# binary at NEXO_BIN (default target/debug/nexo-transfers: the time is spent
# in PostgreSQL). The database is dropped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

keys="${1:-1000000}"
bin="${NEXO_BIN:-target/debug/nexo-transfers}"
url="${DATABASE_URL:-postgres://postgres:postgres@localhost:5432/nexo_transfers}"
url="${url%%\?*}"
server="${url%/*}"
db="nexo_retention_bench_$$"
bench_url="$server/$db"

[ -x "$bin" ] || { echo "no binary at $bin: run cargo build first" >&2; exit 1; }
psql -X -q "$server/postgres" -c "CREATE DATABASE $db"
trap 'psql -X -q "$server/postgres" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)"' EXIT
DATABASE_URL="$bench_url" "$bin" migrate >/dev/null

# The keys look like the ones clients send (a UUID), the bodies like the
# service's own 201 (about 400 bytes) and problem documents.
psql -X -q "$bench_url" -v keys="$keys" <<'SQL'
INSERT INTO principals (id, name, token_sha256)
VALUES ('00000000-0000-4000-8000-000000000001', 'bench', sha256('bench'));
INSERT INTO idempotency_keys
    (principal_id, idempotency_key, request_method, request_path, fingerprint, status, lock_token,
     locked_until, response_status, response_headers, response_body, problem_type, request_id,
     transfer_id, created_at, updated_at, expires_at, retain_until)
SELECT '00000000-0000-4000-8000-000000000001', gen_random_uuid()::text, 'POST', '/transfers',
       sha256(convert_to(n::text, 'UTF8')), 'COMPLETED', gen_random_uuid(),
       now() - interval '2 days', s.status,
       CASE WHEN s.status = 201
            THEN jsonb_build_array(jsonb_build_array('content-type', 'application/json'),
                                   jsonb_build_array('location', '/transfers/' || t.id))
            ELSE '[["content-type","application/problem+json"]]'::jsonb END,
       convert_to(CASE WHEN s.status = 201 THEN
           json_build_object('transfer_id', t.id, 'status', 'posted', 'from', 'acc_00001',
                             'to', 'acc_00002', 'amount_minor', 2500, 'currency', 'USD',
                             'description', 'Invoice 2026-11 #' || n,
                             'created_at', '2026-11-30T12:00:00.123456Z',
                             'receipt', json_build_object('receipt_id', 'rcpt_' || replace(t.id::text, '-', ''),
                                                          'debit_entry_id', 2 * n, 'credit_entry_id', 2 * n + 1,
                                                          'issued_at', '2026-11-30T12:00:00.123456Z'))::text
         ELSE '{"type":"/problems/insufficient-funds","title":"Insufficient funds","status":422,"detail":"the source account balance cannot cover this transfer","param":"amount_minor","request_id":"' || r.id || '"}'
         END, 'UTF8'),
       CASE WHEN s.status = 422 THEN 'insufficient-funds' END,
       CASE WHEN s.status = 422 THEN r.id::text END,
       CASE WHEN s.status = 201 THEN t.id END,
       now() - interval '3 days', now() - interval '3 days', now() - interval '2 days',
       now() + interval '397 days'
FROM generate_series(1, :keys) AS n
CROSS JOIN LATERAL (SELECT gen_random_uuid() AS id) AS t
CROSS JOIN LATERAL (SELECT gen_random_uuid() AS id) AS r
CROSS JOIN LATERAL (SELECT CASE WHEN n % 20 = 0 THEN 422 ELSE 201 END AS status) AS s;
SQL

measure() {
  psql -X -q "$bench_url" -c "VACUUM FULL idempotency_keys" >/dev/null
  psql -X -q -A -t -F ' ' "$bench_url" <<'SQL'
SELECT count(*),
       pg_total_relation_size('idempotency_keys'),
       pg_relation_size('idempotency_keys') + COALESCE(pg_total_relation_size(NULLIF(c.reltoastrelid, 0)), 0),
       pg_indexes_size('idempotency_keys'),
       COALESCE(round(avg(pg_column_size(k.*))), 0)
FROM idempotency_keys k, pg_class c
WHERE c.oid = 'idempotency_keys'::regclass
GROUP BY c.reltoastrelid
SQL
}

report() {
  local stage=$1 rows total heap indexes row
  read -r rows total heap indexes row <<<"$(measure)"
  if [ "${rows:-0}" -eq 0 ]; then
    printf '%-30s %9s keys  %8s MiB total\n' "$stage" 0 \
      "$(psql -X -q -A -t "$bench_url" -c "SELECT round(pg_total_relation_size('idempotency_keys') / 1048576.0, 1)")"
    return
  fi
  printf '%-30s %9d keys  %8.1f MiB total  %5d B/key (heap+TOAST %d, indexes %d; row %d B)\n' \
    "$stage" "$rows" "$(echo "$total / 1048576" | bc -l)" "$((total / rows))" \
    "$((heap / rows))" "$((indexes / rows))" "$row"
}

timed() {
  local start end
  start=$(date +%s.%N)
  DATABASE_URL="$bench_url" RUST_LOG=warn "$bin" purge-expired
  end=$(date +%s.%N)
  printf 'took %.1f s\n' "$(echo "$end - $start" | bc -l)"
}

echo "== $keys completed keys past their TTL (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
report "full records"
echo "== purge-expired: compaction"
timed
report "compacted records"
echo "== past their retention: purge-expired deletes them"
psql -X -q "$bench_url" -c "UPDATE idempotency_keys SET retain_until = expires_at" >/dev/null
psql -X -q "$bench_url" -c "VACUUM idempotency_keys" >/dev/null
timed
report "after deletion"

# Sourced by the CI steps that drive the real server (contract, newman).
#
#   start_demo_server NAME   builds the binary, starts `serve --demo` on a
#                            free loopback port over a fresh database
#                            nexo_NAME_<pid>, waits until it is ready and
#                            sets BASE_URL; on exit the server is stopped
#                            and the database dropped.
#
# The server's log is kept in target/ci-logs/NAME-server.log.

# The same default as .ci/run and .cargo/config.toml, so a step runs alone.
DATABASE_URL="${DATABASE_URL:-postgres://postgres:postgres@localhost:5432/nexo_transfers}"

# How long the server may take to migrate, load the demo data and listen.
SERVER_START_TIMEOUT_SECS=60
# How long a SIGTERM'd server may take to drain before it is killed.
SERVER_STOP_TIMEOUT_SECS=15

# DATABASE_URL with another database name (keeps user, host, port, query).
database_url_with_name() {
  python3 - "$DATABASE_URL" "$1" <<'PY'
import sys
from urllib.parse import urlsplit, urlunsplit
url = urlsplit(sys.argv[1])
print(urlunsplit(url._replace(path="/" + sys.argv[2])))
PY
}

start_demo_server() {
  local name=$1
  cargo build --locked --bin nexo-transfers
  SERVER_DB="nexo_${name}_$$"
  SERVER_LOG="target/ci-logs/${name}-server.log"
  mkdir -p target/ci-logs
  SERVER_PID=""
  trap stop_demo_server EXIT
  # A log left by an earlier run must not be read for this run's address.
  rm -f "$SERVER_LOG"
  DATABASE_URL="$(database_url_with_name "$SERVER_DB")" \
    NEXO_BIND=127.0.0.1:0 NEXO_LOG_FORMAT=json RUST_LOG=info \
    target/debug/nexo-transfers serve --demo >"$SERVER_LOG" 2>&1 &
  SERVER_PID=$!

  local addr="" deadline=$((SECONDS + SERVER_START_TIMEOUT_SECS))
  while [ -z "$addr" ]; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      echo "the server exited during start-up:" >&2
      cat "$SERVER_LOG" >&2
      return 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "the server did not listen within ${SERVER_START_TIMEOUT_SECS}s:" >&2
      cat "$SERVER_LOG" >&2
      return 1
    fi
    addr=$(grep -so '"addr":"127\.0\.0\.1:[0-9]*"' "$SERVER_LOG" | head -1 | cut -d'"' -f4 || true)
    [ -n "$addr" ] || sleep 0.2
  done
  BASE_URL="http://$addr"
  curl -fsS --max-time 5 "$BASE_URL/readyz" >/dev/null
  echo "server ready at $BASE_URL (database $SERVER_DB, log $SERVER_LOG)"
}

stop_demo_server() {
  local status=$?
  if [ -n "${SERVER_PID:-}" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    local deadline=$((SECONDS + SERVER_STOP_TIMEOUT_SECS))
    while kill -0 "$SERVER_PID" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do
      sleep 0.2
    done
    kill -KILL "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  if [ -n "${SERVER_DB:-}" ]; then
    PGOPTIONS="-c client_min_messages=warning" psql "$(database_url_with_name postgres)" \
      -q -v ON_ERROR_STOP=1 -c "DROP DATABASE IF EXISTS \"$SERVER_DB\" WITH (FORCE)" ||
      echo "warning: could not drop database $SERVER_DB" >&2
    SERVER_DB=""
  fi
  if [ "$status" -ne 0 ] && [ -f "${SERVER_LOG:-}" ]; then
    echo "--- last lines of $SERVER_LOG" >&2
    tail -n 40 "$SERVER_LOG" >&2
  fi
  return "$status"
}

#!/usr/bin/env bash
# A highly available PostgreSQL on loopback, from Debian's packages:
# pg_auto_failover's monitor and two data nodes (a primary and a
# synchronous standby), for the failover tests and for trying the service
# against a failover by hand. Everything runs as the `postgres` user, with
# its data under $HA_DIR; nothing touches the machine's own cluster.
#
#   scripts/ha-cluster.sh up             install what is missing, create and start all three
#   scripts/ha-cluster.sh uri            the service's DATABASE_URL (both nodes, read-write target)
#   scripts/ha-cluster.sh status         the monitor's view of the nodes
#   scripts/ha-cluster.sh primary        the name of the node that is primary now
#   scripts/ha-cluster.sh kill-primary   SIGKILL the primary's keeper and postmaster: a crash
#   scripts/ha-cluster.sh stop-standby   stop the standby (replication stalls)
#   scripts/ha-cluster.sh start-standby  start it again
#   scripts/ha-cluster.sh sync on|off    the standby confirms commits (on, the default) or trails them
#   scripts/ha-cluster.sh rejoin         start again the nodes that were killed: they rejoin as standbys
#   scripts/ha-cluster.sh wait-healthy   until one primary and one secondary are in sync
#   scripts/ha-cluster.sh down           stop everything and delete $HA_DIR
#
# Health checks are shortened so that a failover takes seconds, not the
# production defaults' tens of seconds (see docs/high-availability.md).
set -euo pipefail

HA_DIR="${HA_DIR:-/tmp/nexo-ha}"
MONITOR_PORT="${HA_MONITOR_PORT:-55400}"
NODE_PORTS=("${HA_NODE1_PORT:-55401}" "${HA_NODE2_PORT:-55402}")
DBNAME="${HA_DBNAME:-nexo_transfers}"
PG_BIN="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)"
MONITOR_URI="postgres://autoctl_node@127.0.0.1:${MONITOR_PORT}/pg_auto_failover?sslmode=disable"
# How long `up` and `wait-healthy` wait for the cluster to settle.
SETTLE_SECONDS="${HA_SETTLE_SECONDS:-120}"

as_postgres() {
  if [ "$(id -un)" = postgres ]; then
    "$@"
  else
    runuser -u postgres -- env PATH="$PG_BIN:$PATH" XDG_CONFIG_HOME="$HA_DIR/config" \
      XDG_DATA_HOME="$HA_DIR/share" "$@"
  fi
}

install_packages() {
  if command -v pg_autoctl >/dev/null 2>&1; then
    return 0
  fi
  echo "installing pg_auto_failover"
  local version
  version="$(basename "$(dirname "$PG_BIN")")"
  local packages=("postgresql-${version}-auto-failover" pg-auto-failover-cli)
  # A machine whose package lists were never fetched knows no candidate.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${packages[@]}" >/dev/null 2>&1 || {
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${packages[@]}" >/dev/null
  }
}

# Starts `pg_autoctl run` for one data directory in the background; its
# pid and log stay under $HA_DIR.
run_node() {
  local name="$1"
  as_postgres bash -c "nohup pg_autoctl run --pgdata '$HA_DIR/$name' >>'$HA_DIR/$name.log' 2>&1 & echo \$! >'$HA_DIR/$name.keeper.pid'"
}

monitor_sql() {
  as_postgres psql -qAtX -h 127.0.0.1 -p "$MONITOR_PORT" -d pg_auto_failover -c "$1"
}

# Node states as the monitor sees them: "name reported goal" per line.
states() {
  monitor_sql "SELECT nodename, reportedstate, goalstate FROM pgautofailover.node ORDER BY nodeid" 2>/dev/null || true
}

wait_healthy() {
  local deadline=$((SECONDS + SETTLE_SECONDS))
  until [ "$(states | grep -c -E '\|primary\|primary$|\|secondary\|secondary$')" = 2 ]; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "the cluster did not settle within ${SETTLE_SECONDS}s:" >&2
      states >&2
      return 1
    fi
    sleep 0.5
  done
}

up() {
  install_packages
  if [ -d "$HA_DIR/monitor" ]; then
    echo "$HA_DIR already holds a cluster; run '$0 down' first" >&2
    exit 1
  fi
  mkdir -p "$HA_DIR/config" "$HA_DIR/share"
  touch "$HA_DIR/monitor.log" "$HA_DIR/node1.log" "$HA_DIR/node2.log"
  chown -R postgres:postgres "$HA_DIR"
  as_postgres pg_autoctl create monitor --pgdata "$HA_DIR/monitor" --pgport "$MONITOR_PORT" \
    --hostname 127.0.0.1 --auth trust --no-ssl --pgctl "$PG_BIN/pg_ctl" >>"$HA_DIR/monitor.log" 2>&1
  run_node monitor
  local deadline=$((SECONDS + SETTLE_SECONDS))
  until monitor_sql "SELECT 1" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$deadline" ] || { echo "the monitor did not start" >&2; exit 1; }
    sleep 0.2
  done
  # Failover in seconds: a node is checked every second and declared
  # unhealthy after 3 s without an answer (defaults: 5 s and 20 s).
  monitor_sql "ALTER SYSTEM SET pgautofailover.health_check_period = 1000"
  monitor_sql "ALTER SYSTEM SET pgautofailover.health_check_timeout = 1000"
  monitor_sql "ALTER SYSTEM SET pgautofailover.health_check_max_retries = 1"
  monitor_sql "ALTER SYSTEM SET pgautofailover.health_check_retry_delay = 500"
  monitor_sql "ALTER SYSTEM SET pgautofailover.node_considered_unhealthy_timeout = 3000"
  monitor_sql "ALTER SYSTEM SET pgautofailover.primary_demote_timeout = 5000"
  monitor_sql "SELECT pg_reload_conf()" >/dev/null
  local i
  for i in 0 1; do
    local name="node$((i + 1))"
    as_postgres pg_autoctl create postgres --pgdata "$HA_DIR/$name" --pgport "${NODE_PORTS[$i]}" \
      --hostname 127.0.0.1 --name "$name" --dbname "$DBNAME" --auth trust --no-ssl \
      --pgctl "$PG_BIN/pg_ctl" --monitor "$MONITOR_URI" >>"$HA_DIR/$name.log" 2>&1
    run_node "$name"
    if [ "$i" = 0 ]; then
      until states | grep -q '^node1|single|single$'; do
        [ "$SECONDS" -lt "$deadline" ] || { echo "node1 did not become primary" >&2; states >&2; exit 1; }
        sleep 0.5
      done
    fi
  done
  wait_healthy
  # Trust on loopback for the service and the tests, as on the machine's
  # own cluster; the keepers already wrote their replication rules.
  for i in 1 2; do
    echo "host all all 127.0.0.1/32 trust" >>"$HA_DIR/node$i/pg_hba.conf"
  done
  for i in 0 1; do
    as_postgres psql -qAtX -h 127.0.0.1 -p "${NODE_PORTS[$i]}" -d postgres -c "SELECT pg_reload_conf()" \
      >/dev/null 2>&1 || true
  done
  status
}

uri() {
  echo "postgres://postgres@127.0.0.1:${NODE_PORTS[0]},127.0.0.1:${NODE_PORTS[1]}/${DBNAME}?target_session_attrs=read-write"
}

status() {
  as_postgres pg_autoctl show state --pgdata "$HA_DIR/monitor"
}

# By the state the monitor assigned: a dead node keeps reporting its last
# state, the monitor has already demoted it.
primary() {
  states | awk -F'|' '$3 == "primary" || $3 == "wait_primary" || $3 == "single" { print $1; exit }'
}

secondary() {
  states | awk -F'|' '$3 == "secondary" { print $1; exit }'
}

# Starts again every data node whose keeper is not running (after
# kill-primary): it rejoins as a standby, rewound where needed.
rejoin() {
  local name
  for name in node1 node2; do
    if ! kill -0 "$(cat "$HA_DIR/$name.keeper.pid" 2>/dev/null || echo 0)" 2>/dev/null; then
      run_node "$name"
      echo "$name started"
    fi
  done
}

# SIGKILL of a node's keeper, then of its postmaster: the keeper would
# otherwise restart PostgreSQL at once and no failover would happen.
kill_node() {
  local name="$1"
  local keeper postmaster
  keeper="$(cat "$HA_DIR/$name.keeper.pid" 2>/dev/null || true)"
  postmaster="$(head -1 "$HA_DIR/$name/postmaster.pid" 2>/dev/null || true)"
  [ -n "$keeper" ] && pkill -KILL -P "$keeper" 2>/dev/null || true
  [ -n "$keeper" ] && kill -KILL "$keeper" 2>/dev/null || true
  [ -n "$postmaster" ] && kill -KILL "$postmaster" 2>/dev/null || true
  echo "$name killed"
}

kill_primary() {
  local name
  name="$(primary)"
  [ -n "$name" ] || { echo "no primary" >&2; exit 1; }
  kill_node "$name"
}

stop_standby() {
  local name
  name="$(secondary)"
  [ -n "$name" ] || { echo "no standby" >&2; exit 1; }
  as_postgres pg_autoctl stop --pgdata "$HA_DIR/$name" >/dev/null 2>&1 || kill_node "$name"
  echo "$name" >"$HA_DIR/stopped-standby"
  echo "$name stopped"
}

start_standby() {
  local name
  name="$(cat "$HA_DIR/stopped-standby")"
  run_node "$name"
  rm -f "$HA_DIR/stopped-standby"
  echo "$name started"
}

# Whether the standby takes part in the commit quorum: off turns the
# cluster's replication asynchronous (synchronous_standby_names empty), to
# measure what synchronous replication costs.
set_sync() {
  local quorum
  case "${1:-}" in
    on) quorum=true ;;
    off) quorum=false ;;
    *) echo "usage: $0 sync on|off" >&2; exit 2 ;;
  esac
  local name
  name="$(secondary)"
  [ -n "$name" ] || { echo "no standby" >&2; exit 1; }
  # pg_autoctl 2.0 prints spurious monitor errors here; the loop below
  # checks that the setting took effect.
  as_postgres pg_autoctl set node replication-quorum "$quorum" --pgdata "$HA_DIR/$name" >/dev/null 2>&1 || true
  local port="${NODE_PORTS[0]}"
  [ "$(primary)" = node2 ] && port="${NODE_PORTS[1]}"
  local want="<>"
  [ "$quorum" = false ] && want="="
  local deadline=$((SECONDS + SETTLE_SECONDS)) asked=$SECONDS
  until [ "$(as_postgres psql -qAtX -h 127.0.0.1 -p "$port" -d postgres \
      -c "SELECT current_setting('synchronous_standby_names') $want ''")" = t ]; do
    [ "$SECONDS" -lt "$deadline" ] || { echo "synchronous_standby_names did not change" >&2; exit 1; }
    # pg_autoctl 2.0 sometimes fails the request outright: ask again.
    if [ $((SECONDS - asked)) -ge 5 ]; then
      as_postgres pg_autoctl set node replication-quorum "$quorum" --pgdata "$HA_DIR/$name" \
        >/dev/null 2>&1 || true
      asked=$SECONDS
    fi
    sleep 0.2
  done
}

down() {
  local name
  for name in node1 node2 monitor; do
    [ -d "$HA_DIR/$name" ] || continue
    as_postgres pg_autoctl stop --pgdata "$HA_DIR/$name" --immediate >/dev/null 2>&1 || true
    kill_node "$name" >/dev/null
  done
  rm -rf "$HA_DIR"
}

case "${1:-}" in
  up) up ;;
  uri) uri ;;
  status) status ;;
  primary) primary ;;
  kill-primary) kill_primary ;;
  stop-standby) stop_standby ;;
  start-standby) start_standby ;;
  wait-healthy) wait_healthy ;;
  rejoin) rejoin ;;
  sync) set_sync "${2:-}" ;;
  down) down ;;
  *) sed -n '2,22p' "$0" >&2; exit 2 ;;
esac

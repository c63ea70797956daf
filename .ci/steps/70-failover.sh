#!/usr/bin/env bash
# The failover test: a real highly available PostgreSQL (pg_auto_failover
# from Debian's packages, installed by the script when missing: a monitor
# and two data nodes on loopback ports 55400-55402, data under a temporary
# directory), two service instances following its primary, and three fault
# runs under load: the primary killed; commits whose replication wait was
# cancelled, then the primary killed; the standby away for a while. Each
# run checks that no acknowledged transfer was lost or doubled and that the
# ledger reconciles. The cluster is stopped whatever happens.
set -euo pipefail
cd "$(dirname "$0")/../.."

# The test is built only with the feature; lint it as the rest is linted.
cargo clippy --locked --all-targets --features ha-cluster -- -D warnings

export HA_DIR="${HA_DIR:-$(mktemp -d /tmp/nexo-ha.XXXXXX)}"
rmdir "$HA_DIR" 2>/dev/null || true
trap 'bash scripts/ha-cluster.sh down' EXIT
bash scripts/ha-cluster.sh up
NEXO_HA_URL="$(bash scripts/ha-cluster.sh uri)"
export NEXO_HA_URL
# One at a time: the three runs share the cluster. Bounded: a run that
# hangs fails the step instead of the whole CI budget. What synchronous
# replication costs is a measurement, not a check: bench/replication.sh.
timeout 900 cargo test --locked --features ha-cluster --test failover -- --test-threads=1 --nocapture

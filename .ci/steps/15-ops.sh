#!/usr/bin/env bash
# The operations kit (ops/) checked by Prometheus' own tool: promtool
# validates the alerting rules (PromQL, durations, annotation templates),
# runs their unit tests, synthetic series under which each alert must fire
# or stay silent (ops/prometheus/alerts.test.yml), and parses every query
# of the Grafana dashboard. That every metric the rules and the dashboard
# name is exported is tests/alert_rules.rs's part. promtool comes with
# Debian's prometheus package, installed when missing. A few seconds once
# installed.
set -euo pipefail
cd "$(dirname "$0")/../.."

if ! command -v promtool >/dev/null 2>&1; then
  echo "installing prometheus (for promtool)"
  # Without recommends: prometheus-node-exporter would start a listener on
  # :9100 that nothing here uses.
  install=(apt-get install -y -q --no-install-recommends prometheus)
  # A machine whose package lists were never fetched knows no candidate.
  DEBIAN_FRONTEND=noninteractive "${install[@]}" >/dev/null 2>&1 || {
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive "${install[@]}" >/dev/null
  }
  # Only promtool is wanted: the package enables and starts a server on
  # :9090 (a systemd unit, or its init script), which would hold the port.
  if [ -d /run/systemd/system ]; then
    systemctl disable --now prometheus >/dev/null 2>&1 || true
  elif /etc/init.d/prometheus status >/dev/null 2>&1; then
    /etc/init.d/prometheus stop >/dev/null
  fi
fi

promtool --version 2>&1 | sed -n 1p
promtool check rules ops/prometheus/alerts.yml
promtool test rules ops/prometheus/alerts.test.yml

# The dashboard's queries through the same PromQL parser: each becomes a
# recording rule of a throwaway rules file, with Grafana's variables
# replaced by values of their shape (intervals by a duration, the others,
# used in =~ matchers, by .*).
mkdir -p target/ops
python3 - ops/grafana/nexo-transfers.json target/ops/dashboard-queries.yml <<'PY'
import json, re, sys

dashboard = json.load(open(sys.argv[1]))

def substitute(query):
    def value(match):
        name = match.group(1) or match.group(2)
        return {"__rate_interval": "5m", "__interval": "5m", "__range": "1h"}.get(name, ".*")
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, query)

queries = []
for panel in dashboard["panels"]:
    for target in panel.get("targets", []):
        queries.append(target["expr"])
for variable in dashboard["templating"]["list"]:
    if variable["type"] == "query":
        query = variable["query"] if isinstance(variable["query"], str) else variable["query"]["query"]
        queries.append(re.fullmatch(r"label_values\((.*),\s*\w+\)", query).group(1))

with open(sys.argv[2], "w") as out:
    out.write("groups:\n  - name: dashboard-queries\n    rules:\n")
    for n, query in enumerate(queries):
        out.write(f"      - record: dashboard_query_{n}\n        expr: {json.dumps(substitute(query))}\n")
PY
promtool check rules target/ops/dashboard-queries.yml

#!/usr/bin/env bash
# Renders docs/key-lifecycle.dot to docs/key-lifecycle.svg with Graphviz,
# installing it from Debian's packages when `dot` is missing. Run it after
# editing the .dot; both files are committed.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v dot >/dev/null 2>&1; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q graphviz >/dev/null
fi
dot -Tsvg docs/key-lifecycle.dot -o docs/key-lifecycle.svg
echo "wrote docs/key-lifecycle.svg"

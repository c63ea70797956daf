#!/usr/bin/env bash
# Runs the Postman collection (postman/) with newman against a fresh
# `serve --demo`: the seed's five cases, each asserting statuses, replay
# headers, transfer ids, receipts and the ledger read back through the API.
# Two iterations, to show the collection can run again and again against
# one server. Fails on any failed assertion; newman's JUnit report is kept
# in target/newman/junit.xml.
set -euo pipefail
cd "$(dirname "$0")/../.."

NEWMAN_DIR=target/ci-newman
# Two runs: the second must pass against the state the first one left.
NEWMAN_ITERATIONS=2
# Any single request, including the five concurrent ones of case 3.
NEWMAN_REQUEST_TIMEOUT_MS=20000
NEWMAN_TIMEOUT_SECS=300

source .ci/lib/demo-server.sh

# newman at the version pinned by .ci/newman/package-lock.json, installed
# under target/ (ignored by git); reinstalled only when the lock changes.
if ! cmp -s .ci/newman/package-lock.json "$NEWMAN_DIR/package-lock.json" ||
  [ ! -x "$NEWMAN_DIR/node_modules/.bin/newman" ]; then
  rm -rf "$NEWMAN_DIR"
  mkdir -p "$NEWMAN_DIR"
  cp .ci/newman/package.json .ci/newman/package-lock.json "$NEWMAN_DIR/"
  (cd "$NEWMAN_DIR" && npm ci --no-audit --no-fund --loglevel=error)
fi

start_demo_server newman

rm -rf target/newman
timeout "$NEWMAN_TIMEOUT_SECS" "$NEWMAN_DIR/node_modules/.bin/newman" run \
  postman/nexo-transfers.postman_collection.json \
  --environment postman/nexo-transfers.postman_environment.json \
  --env-var "baseUrl=$BASE_URL" \
  --iteration-count "$NEWMAN_ITERATIONS" \
  --timeout-request "$NEWMAN_REQUEST_TIMEOUT_MS" \
  --color off \
  --reporters cli,junit \
  --reporter-junit-export target/newman/junit.xml
echo "newman passed; JUnit report in target/newman/junit.xml"

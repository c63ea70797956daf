#!/usr/bin/env bash
# Fault tests that need fail points compiled in (the `failpoints` feature):
# each stops one request at a dangerous moment of a transfer, kills the real
# binary there with SIGKILL, restarts it and retries. Plain `cargo test`
# skips them (required-features), so they run here.
set -euo pipefail
cargo clippy --locked --all-targets --features failpoints -- -D warnings
cargo test --locked --features failpoints --test failpoints

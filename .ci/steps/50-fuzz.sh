#!/usr/bin/env bash
# A bounded run of the request-parsing fuzz target (fuzz/, libFuzzer through
# cargo-fuzz): idempotency keys, bodies and the fingerprint fed arbitrary
# bytes must never panic. cargo-fuzz needs a nightly toolchain for its
# sanitizer flags; on a machine without one the step says so and passes,
# since plain builds never need nightly. cargo-fuzz is installed from
# crates.io at the pinned version when missing. About five minutes, most of
# it the sanitized build.
set -euo pipefail
cd "$(dirname "$0")/../.."

# Seconds of fuzzing after the build: over a million inputs on 2 cores.
FUZZ_SECONDS="${FUZZ_SECONDS:-30}"
CARGO_FUZZ_VERSION=0.13.2

if ! rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
  echo "fuzz: skipped, this machine has no nightly toolchain"
  exit 0
fi
if [ "$(cargo fuzz --version 2>/dev/null)" != "cargo-fuzz ${CARGO_FUZZ_VERSION}" ]; then
  cargo install --locked cargo-fuzz --version "$CARGO_FUZZ_VERSION"
fi
# A crash leaves its input in fuzz/artifacts/request_parsing/ and fails the step.
cargo +nightly fuzz run request_parsing -- -max_total_time="$FUZZ_SECONDS"
echo "fuzz: request_parsing ran ${FUZZ_SECONDS}s without a crash"

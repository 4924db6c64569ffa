#!/usr/bin/env bash
# The whole test suite: builds every test of the workspace with every feature, starts the servers
# the backend tests need, then runs the tests. Extra arguments go to `cargo test`.
#
# The servers are started (or found answering) after the build, right before the tests run: a
# cold build takes minutes, and a server that stopped meanwhile is started again rather than
# failing every test of its backend.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --all-features --no-run "$@"
scripts/services.sh
cargo test --workspace --all-features "$@"

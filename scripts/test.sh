#!/usr/bin/env bash
# The whole test suite: starts the servers the backend tests need, then runs every test of the
# workspace with every feature. Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
cargo test --workspace --all-features "$@"

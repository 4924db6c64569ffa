#!/usr/bin/env bash
# Runs every fuzz target of fuzz/ for a bounded time and fails on the first crash.
#
#   scripts/fuzz.sh                 every target, IDEM_FUZZ_SECONDS (default 20) each
#   scripts/fuzz.sh keys dynamo_item  only these targets
#   scripts/fuzz.sh --merge [T...]  also merge the inputs that found new coverage into the
#                                   committed corpus (fuzz/corpus/T), then commit them
#
# A run reads the committed corpus and writes what it finds to a scratch directory, so the
# repository does not change unless --merge is given. On a crash libFuzzer leaves the input in
# fuzz/artifacts/T/; reproduce it with `cargo +nightly fuzz run T fuzz/artifacts/T/<file>`.
# Needs a nightly toolchain (cargo-fuzz builds with sanitizers); installs cargo-fuzz if missing.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${IDEM_FUZZ_SECONDS:-20}
# The fuzz build (nightly, sanitizers, release) is long from cold; its target dir lives in the
# cache so that later runs, from any clone, only rebuild the idem crates.
export CARGO_TARGET_DIR=${IDEM_FUZZ_TARGET_DIR:-${IDEM_CACHE_DIR:-$HOME/.cache/idem}/fuzz-target}
merge=false
if [ "${1:-}" = "--merge" ]; then
  merge=true
  shift
fi

if ! cargo +nightly --version >/dev/null 2>&1; then
  echo "scripts/fuzz.sh: a nightly toolchain is needed (rustup toolchain install nightly)" >&2
  exit 1
fi
if ! command -v cargo-fuzz >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked
fi

if [ "$#" -gt 0 ]; then
  targets=("$@")
else
  mapfile -t targets < <(cargo +nightly fuzz list)
fi

cargo +nightly fuzz build -O
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
started=$(date +%s)
for t in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$t" "$scratch/$t"
  echo "=== fuzz $t for ${seconds}s"
  # libFuzzer writes new inputs to the first directory; the committed corpus is only read.
  # `timeout` bounds the run even if libFuzzer hangs on startup.
  if ! timeout $((seconds + 120)) cargo +nightly fuzz run -O "$t" "$scratch/$t" "fuzz/corpus/$t" -- \
      -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 2>"$scratch/$t.log"; then
    tail -n 60 "$scratch/$t.log" >&2
    echo "scripts/fuzz.sh: $t crashed; the input is in fuzz/artifacts/$t/" >&2
    exit 1
  fi
  grep -E '^(#[0-9]+.*DONE|stat::number_of_executed_units|stat::new_units_added)' "$scratch/$t.log" || true
  if $merge; then
    cargo +nightly fuzz run -O "$t" "fuzz/corpus/$t" "$scratch/$t" -- -merge=1 -set_cover_merge=1 2>/dev/null
    echo "merged: fuzz/corpus/$t now holds $(ls "fuzz/corpus/$t" | wc -l) inputs"
  fi
done
echo "=== fuzzing done: ${#targets[@]} targets in $(( $(date +%s) - started ))s, no crash"

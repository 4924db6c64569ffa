#!/usr/bin/env bash
# Ensures a NATS server with JetStream answers on 127.0.0.1:${IDEM_NATS_PORT:-4222} (the
# idem-nats tests, benchmark and example).
#
# Reuses a server already answering there with JetStream on. Otherwise installs the Debian
# package nats-server when missing (apt-get update once, then apt-get install) and starts it in
# the background on loopback with JetStream, storing under $IDEM_RUN_DIR/nats. Idempotent; never
# stops anything, and never anything it did not start. Exits non-zero with a message when it
# cannot (a server without JetStream on the port is an error).
#
#   IDEM_NATS_PORT                 port (default 4222)
#   IDEM_RUN_DIR / IDEM_CACHE_DIR  as in scripts/services.sh
#
# Stop the server it started with: kill "$(cat "$IDEM_RUN_DIR/nats.pid")"
set -euo pipefail
# shellcheck source=../lib/await-child.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/../lib/await-child.sh"

port=${IDEM_NATS_PORT:-4222}
run_dir=${IDEM_RUN_DIR:-/tmp/idem-services}
store_dir="$run_dir/nats"
log="$run_dir/nats.log"
pidfile="$run_dir/nats.pid"
mkdir -p "$store_dir"

say() { echo "nats: $*"; }
die() { echo "nats: $*" >&2; exit 1; }

# The server's INFO line, which a NATS server sends first on every connection.
info() {
  timeout 3 bash -c "exec 3<>/dev/tcp/127.0.0.1/$port && head -n 1 <&3" 2>/dev/null || true
}

# Answers as a NATS server with JetStream on.
answers() {
  info | grep -q '"jetstream":true'
}

if answers; then
  say "already answering on 127.0.0.1:$port with JetStream (reused)"
  exit 0
fi
line=$(info)
if [ -n "$line" ]; then
  case "$line" in
    INFO*) die "a NATS server on 127.0.0.1:$port runs without JetStream; restart it with -js, or set IDEM_NATS_PORT (and IDEM_NATS_URL for the tests)" ;;
  esac
fi
if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
  die "something that does not answer as a NATS server listens on 127.0.0.1:$port; free the port or set IDEM_NATS_PORT (and IDEM_NATS_URL for the tests)"
fi

if ! command -v nats-server >/dev/null; then
  say "installing nats-server (apt-get)"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nats-server; } >"$run_dir/nats-apt.log" 2>&1; then
    tail -20 "$run_dir/nats-apt.log" >&2 || true
    die "apt-get install nats-server failed (see $run_dir/nats-apt.log)"
  fi
  command -v nats-server >/dev/null || die "nats-server is still missing after installing the package"
  # The package may have started the system service meanwhile (where an init system runs).
  if answers; then
    say "up on 127.0.0.1:$port with JetStream (started by the package)"
    exit 0
  fi
fi

say "starting nats-server on 127.0.0.1:$port with JetStream, storing in $store_dir"
nohup nats-server -a 127.0.0.1 -p "$port" -js -sd "$store_dir" </dev/null >"$log" 2>&1 &
pid=$!
echo "$pid" >"$pidfile"

await_child nats "nats-server on 127.0.0.1:$port" "$pid" "$log" "$pidfile" 30
say "up on 127.0.0.1:$port with JetStream (pid $pid, log $log)"

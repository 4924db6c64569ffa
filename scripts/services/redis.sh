#!/usr/bin/env bash
# Ensures a standalone Redis (7+) answers on 127.0.0.1:${IDEM_REDIS_PORT:-6379}.
# Reuses one already answering; otherwise installs redis-server (Debian package) when missing and
# starts it daemonized, without persistence. Exits non-zero with a message when it cannot.
set -euo pipefail
port=${IDEM_REDIS_PORT:-6379}
run_dir=${IDEM_RUN_DIR:-/tmp/idem-services}/redis
mkdir -p "$run_dir"

need_install() {
  if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
    echo "redis: installing redis-server (apt-get)"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools; } >"$run_dir/apt.log" 2>&1; then
      echo "redis: apt-get install redis-server failed (see $run_dir/apt.log)" >&2
      tail -20 "$run_dir/apt.log" >&2 || true
      exit 1
    fi
  fi
}

need_install
if redis-cli -h 127.0.0.1 -p "$port" ping 2>/dev/null | grep -q PONG; then
  echo "redis: already answering on 127.0.0.1:$port ($(redis-cli -p "$port" info server | grep -m1 redis_version | tr -d '\r'))"
  exit 0
fi

echo "redis: starting redis-server on 127.0.0.1:$port"
redis-server --daemonize yes --bind 127.0.0.1 --port "$port" --save "" --appendonly no \
  --dir "$run_dir" --pidfile "$run_dir/redis-$port.pid" --logfile "$run_dir/redis-$port.log" \
  --protected-mode yes
for _ in $(seq 1 100); do
  if redis-cli -h 127.0.0.1 -p "$port" ping 2>/dev/null | grep -q PONG; then
    echo "redis: up on 127.0.0.1:$port"
    exit 0
  fi
  sleep 0.1
done
echo "redis: redis-server did not answer on 127.0.0.1:$port within 10 s (log: $run_dir/redis-$port.log)" >&2
tail -20 "$run_dir/redis-$port.log" >&2 || true
exit 1

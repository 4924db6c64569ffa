#!/usr/bin/env bash
# Ensures a Redis Cluster of three masters (no replicas) answers on 127.0.0.1:7001-7003
# (IDEM_REDIS_CLUSTER_PORTS to change the ports). Idempotent: a healthy cluster (cluster_state:ok,
# all 16384 slots assigned) is reused; a broken one is rebuilt, stopping only the processes this
# script started (its pid files) and wiping only its own directory,
# ${IDEM_RUN_DIR:-/tmp/idem-services}/redis-cluster. Exits non-zero with a message on failure.
set -euo pipefail
read -r -a ports <<<"${IDEM_REDIS_CLUSTER_PORTS:-7001 7002 7003}"
dir=${IDEM_RUN_DIR:-/tmp/idem-services}/redis-cluster
mkdir -p "$dir"

fail() {
  echo "redis-cluster: $*" >&2
  for p in "${ports[@]}"; do
    [ -f "$dir/$p/redis.log" ] && { echo "--- $dir/$p/redis.log" >&2; tail -10 "$dir/$p/redis.log" >&2; }
  done
  exit 1
}

if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
  echo "redis-cluster: installing redis-server (apt-get)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools; } \
    >"$dir/apt.log" 2>&1 || fail "apt-get install redis-server failed (see $dir/apt.log)"
fi

healthy() {
  local p info
  for p in "${ports[@]}"; do
    info=$(redis-cli -h 127.0.0.1 -p "$p" cluster info 2>/dev/null | tr -d '\r') || return 1
    grep -q '^cluster_state:ok$' <<<"$info" || return 1
    grep -q '^cluster_slots_assigned:16384$' <<<"$info" || return 1
    grep -q "^cluster_known_nodes:${#ports[@]}$" <<<"$info" || return 1
  done
}

if healthy; then
  echo "redis-cluster: healthy on ports ${ports[*]}, reused"
  exit 0
fi

# Something answers on a port but is not a node we can reuse: if we did not start it, refuse to
# touch it.
for p in "${ports[@]}"; do
  if redis-cli -h 127.0.0.1 -p "$p" ping 2>/dev/null | grep -q PONG; then
    pid=$(cat "$dir/$p/redis.pid" 2>/dev/null || true)
    if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then
      fail "port $p answers but was not started by this script (no live pid file in $dir/$p); stop it or set IDEM_REDIS_CLUSTER_PORTS"
    fi
  fi
done

echo "redis-cluster: (re)building on ports ${ports[*]} in $dir"
for p in "${ports[@]}"; do
  pid=$(cat "$dir/$p/redis.pid" 2>/dev/null || true)
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -rf "${dir:?}/$p"
  mkdir -p "$dir/$p"
done

for p in "${ports[@]}"; do
  redis-server --daemonize yes --bind 127.0.0.1 --port "$p" --protected-mode yes \
    --cluster-enabled yes --cluster-config-file "$dir/$p/nodes.conf" --cluster-node-timeout 5000 \
    --save "" --appendonly no --dir "$dir/$p" --pidfile "$dir/$p/redis.pid" \
    --logfile "$dir/$p/redis.log" || fail "redis-server did not start on port $p"
done
for p in "${ports[@]}"; do
  ok=
  for _ in $(seq 1 100); do
    if redis-cli -h 127.0.0.1 -p "$p" ping 2>/dev/null | grep -q PONG; then ok=1; break; fi
    sleep 0.1
  done
  [ -n "$ok" ] || fail "node on port $p did not answer within 10 s"
done

addrs=()
for p in "${ports[@]}"; do addrs+=("127.0.0.1:$p"); done
redis-cli --cluster create "${addrs[@]}" --cluster-replicas 0 --cluster-yes >"$dir/create.log" 2>&1 \
  || { cat "$dir/create.log" >&2; fail "redis-cli --cluster create failed"; }

for _ in $(seq 1 300); do
  if healthy; then
    echo "redis-cluster: up on ports ${ports[*]}"
    exit 0
  fi
  sleep 0.1
done
fail "cluster did not reach cluster_state:ok within 30 s"

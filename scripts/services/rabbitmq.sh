#!/usr/bin/env bash
# Ensures RabbitMQ answers AMQP 0-9-1 on 127.0.0.1:${IDEM_RABBITMQ_PORT:-5672} with the default
# user guest/guest (the idem-amqp tests, benchmark and example).
#
# Reuses a broker already answering there. Otherwise installs the Debian package rabbitmq-server
# when missing (apt-get update once, then apt-get install) and starts a node of its own in the
# background: node name idem@localhost, listening on loopback only (AMQP and Erlang
# distribution), data, logs and Erlang cookie under $IDEM_RUN_DIR/rabbitmq, no plugins. It does
# not use the system service (which needs systemd). Idempotent; never stops anything, and never
# anything it did not start. Exits non-zero with a message when it cannot.
#
#   IDEM_RABBITMQ_PORT             AMQP port (default 5672; Erlang distribution on port + 20000)
#   IDEM_RUN_DIR / IDEM_CACHE_DIR  as in scripts/services.sh
#
# Stop the node it started with: kill "$(cat "$IDEM_RUN_DIR/rabbitmq.pid")"
set -euo pipefail
# shellcheck source=../lib/await-child.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/../lib/await-child.sh"

port=${IDEM_RABBITMQ_PORT:-5672}
dist_port=$((port + 20000))
run_dir=${IDEM_RUN_DIR:-/tmp/idem-services}
node_dir="$run_dir/rabbitmq"
log="$run_dir/rabbitmq.log"
pidfile="$run_dir/rabbitmq.pid"
server=/usr/lib/rabbitmq/bin/rabbitmq-server
mkdir -p "$node_dir"

say() { echo "rabbitmq: $*"; }
die() { echo "rabbitmq: $*" >&2; exit 1; }

# Answers like an AMQP 0-9-1 broker: after the protocol header it sends connection.start, a
# method frame (frame type 1).
answers() {
  local first
  first=$(timeout 3 bash -c "exec 3<>/dev/tcp/127.0.0.1/$port && printf 'AMQP\x00\x00\x09\x01' >&3 && head -c 1 <&3 | od -An -tx1" 2>/dev/null | tr -d ' \n') || return 1
  [ "$first" = "01" ]
}

if answers; then
  say "already answering on 127.0.0.1:$port (reused)"
  exit 0
fi
if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
  die "something that does not answer as an AMQP 0-9-1 broker listens on 127.0.0.1:$port; free the port or set IDEM_RABBITMQ_PORT (and IDEM_AMQP_URL for the tests)"
fi

if [ ! -x "$server" ]; then
  say "installing rabbitmq-server (apt-get)"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rabbitmq-server; } >"$run_dir/rabbitmq-apt.log" 2>&1; then
    tail -20 "$run_dir/rabbitmq-apt.log" >&2 || true
    die "apt-get install rabbitmq-server failed (see $run_dir/rabbitmq-apt.log)"
  fi
  # The package may have started the system service meanwhile (where an init system runs).
  for _ in $(seq 1 20); do
    if answers; then
      say "up on 127.0.0.1:$port (started by the package)"
      exit 0
    fi
    sleep 0.5
  done
  [ -x "$server" ] || die "$server is still missing after installing rabbitmq-server"
fi

# The node's own configuration, data, logs and cookie.
mkdir -p "$node_dir/mnesia" "$node_dir/log" "$node_dir/home"
printf 'listeners.tcp.local = 127.0.0.1:%s\n' "$port" >"$node_dir/rabbitmq.conf"
echo '[].' >"$node_dir/enabled_plugins"
: >"$node_dir/rabbitmq-env.conf"

say "starting a RabbitMQ node (idem@localhost) on 127.0.0.1:$port, data in $node_dir"
HOME="$node_dir/home" \
  RABBITMQ_NODENAME=idem@localhost \
  RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
  RABBITMQ_NODE_PORT="$port" \
  RABBITMQ_DIST_PORT="$dist_port" \
  RABBITMQ_MNESIA_BASE="$node_dir/mnesia" \
  RABBITMQ_LOG_BASE="$node_dir/log" \
  RABBITMQ_CONFIG_FILE="$node_dir/rabbitmq.conf" \
  RABBITMQ_ADVANCED_CONFIG_FILE="$node_dir/advanced.config" \
  RABBITMQ_ENABLED_PLUGINS_FILE="$node_dir/enabled_plugins" \
  RABBITMQ_CONF_ENV_FILE="$node_dir/rabbitmq-env.conf" \
  RABBITMQ_PID_FILE="$node_dir/node.pid" \
  ERL_EPMD_ADDRESS=127.0.0.1 \
  ERL_FLAGS="-kernel inet_dist_use_interface {127,0,0,1}" \
  nohup "$server" </dev/null >"$log" 2>&1 &
pid=$!
echo "$pid" >"$pidfile"

await_child rabbitmq "rabbitmq-server on 127.0.0.1:$port" "$pid" "$log" "$pidfile" 90
say "up on 127.0.0.1:$port (pid $pid, log $log, node logs in $node_dir/log)"

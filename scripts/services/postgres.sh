#!/usr/bin/env bash
# Ensures PostgreSQL answers on 127.0.0.1:${IDEM_POSTGRES_PORT:-5432} with trust authentication for loopback TCP and a
# database `test`, and that `pgbench` is available (the idem-postgres benchmark runs it).
# Reuses a server already answering; otherwise installs the Debian packages when missing, trusts
# 127.0.0.1, starts the newest cluster and creates the database. Idempotent; never stops anything.
# Exits non-zero with a message when it cannot.
set -euo pipefail
port=${IDEM_POSTGRES_PORT:-5432}
db=test
run_dir=${IDEM_RUN_DIR:-/tmp/idem-services}/postgres
mkdir -p "$run_dir"

fail() {
  echo "postgres: $*" >&2
  exit 1
}

# The query the tests effectively run: TCP on loopback, user postgres, database test.
answers() {
  psql -X -q -h 127.0.0.1 -p "$port" -U postgres -d "$db" -tAc 'SELECT 1' >/dev/null 2>&1
}

install_packages() {
  echo "postgres: installing postgresql (apt-get)"
  if ! { apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql postgresql-client postgresql-contrib; } \
    >"$run_dir/apt.log" 2>&1; then
    tail -20 "$run_dir/apt.log" >&2 || true
    fail "apt-get install postgresql failed (see $run_dir/apt.log)"
  fi
}

if ! command -v psql >/dev/null || ! command -v pgbench >/dev/null || ! command -v pg_ctlcluster >/dev/null; then
  install_packages
fi
command -v pgbench >/dev/null || fail "pgbench is still missing after installing postgresql"

if answers; then
  echo "postgres: already answering on 127.0.0.1:$port, database $db ($(psql -X -h 127.0.0.1 -p "$port" -U postgres -d "$db" -tAc 'SHOW server_version'))"
  exit 0
fi

# Pick the cluster: the one on our port if any, else the newest version's `main` (created if the
# package's post-install did not create one).
cluster=$(pg_lsclusters -h 2>/dev/null | awk -v p="$port" '$3 == p { print $1 " " $2; exit }')
if [ -z "$cluster" ]; then
  version=$(ls /etc/postgresql 2>/dev/null | sort -V | tail -1 || true)
  if [ -z "$version" ]; then
    version=$(ls /usr/lib/postgresql | sort -V | tail -1)
    echo "postgres: creating cluster $version/main"
    pg_createcluster --port "$port" "$version" main >"$run_dir/createcluster.log" 2>&1 ||
      fail "pg_createcluster $version main failed (see $run_dir/createcluster.log)"
  fi
  cluster="$version main"
fi
read -r version name <<<"$cluster"
conf_dir=/etc/postgresql/$version/$name
hba=$conf_dir/pg_hba.conf
[ -f "$hba" ] || fail "no $hba"

# Trust loopback TCP and local sockets (a test server only: first matching line wins, so these go
# on top).
changed=0
for line in "host all all 127.0.0.1/32 trust" "host all all ::1/128 trust" "local all all trust"; do
  if ! grep -Eq "^${line// /[[:space:]]+}[[:space:]]*$" "$hba"; then
    sed -i "1i $line" "$hba"
    changed=1
  fi
done
[ "$changed" = 1 ] && echo "postgres: trusting loopback connections in $hba"

status=$(pg_lsclusters -h | awk -v v="$version" -v n="$name" '$1 == v && $2 == n { print $4 }')
if [ "$status" = "online" ]; then
  if [ "$changed" = 1 ]; then
    pg_ctlcluster --skip-systemctl-redirect "$version" "$name" reload
  fi
else
  echo "postgres: starting cluster $version/$name"
  pg_ctlcluster --skip-systemctl-redirect "$version" "$name" start >"$run_dir/start.log" 2>&1 || {
    tail -20 "$run_dir/start.log" >&2 || true
    tail -20 "/var/log/postgresql/postgresql-$version-$name.log" >&2 || true
    fail "pg_ctlcluster $version $name start failed"
  }
fi

for _ in $(seq 1 100); do
  if psql -X -q -h 127.0.0.1 -p "$port" -U postgres -d postgres -tAc 'SELECT 1' >/dev/null 2>&1; then
    break
  fi
  sleep 0.1
done
psql -X -q -h 127.0.0.1 -p "$port" -U postgres -d postgres -tAc 'SELECT 1' >/dev/null 2>&1 ||
  fail "cluster $version/$name does not answer on 127.0.0.1:$port (log: /var/log/postgresql/postgresql-$version-$name.log)"

if [ -z "$(psql -X -h 127.0.0.1 -p "$port" -U postgres -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname = '$db'")" ]; then
  echo "postgres: creating database $db"
  psql -X -q -h 127.0.0.1 -p "$port" -U postgres -d postgres -c "CREATE DATABASE $db" ||
    fail "could not create database $db"
fi

answers || fail "127.0.0.1:$port answers but database $db is not usable"
echo "postgres: up on 127.0.0.1:$port, database $db"

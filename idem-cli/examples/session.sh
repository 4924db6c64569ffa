#!/bin/bash
# Re-captures the "Operating idem" session of the README against the local servers
# (scripts/services.sh redis postgres dynamo): prints each command after "$ " and its real
# output. It deletes the demo records it wrote last time (namespace payments) first.
cd "$(dirname "$0")/../.."
cargo build -q -p idem-cli --bin idem --example seed
export PATH="$PWD/target/debug:$PATH"
export AWS_EC2_METADATA_DISABLED=true
rm -f /tmp/idem-demo.db
# A fresh demo schema, so that the session shows the migrations applied.
psql -q -h 127.0.0.1 -U postgres test -c 'DROP SCHEMA IF EXISTS idem_ops CASCADE' >/dev/null 2>&1
export AWS_ACCESS_KEY_ID=local AWS_SECRET_ACCESS_KEY=local
for u in redis://127.0.0.1:6379 'postgres://postgres@127.0.0.1:5432/test?schema=idem_ops' 'dynamodb://idem-ops?endpoint=http://127.0.0.1:8000&region=us-east-1'; do
  idem --store "$u" delete payments order-1001 order-1002 order-1003 order-1004 order-1005 order-1006 order-1007 --include-live --yes >/dev/null 2>&1
done
show() { echo "\$ $*"; eval "$@" 2>&1; }
comment() { echo; echo "# $*"; }
comment "Set the stores up (each is safe to run again)."
show "export AWS_ACCESS_KEY_ID=local AWS_SECRET_ACCESS_KEY=local  # DynamoDB Local takes any"
export AWS_ACCESS_KEY_ID=local AWS_SECRET_ACCESS_KEY=local
show "idem --store 'postgres://postgres@127.0.0.1:5432/test?schema=idem_ops' migrate --print | head -2"
show "idem --store 'postgres://postgres@127.0.0.1:5432/test?schema=idem_ops' migrate"
show "idem --store 'dynamodb://idem-ops?endpoint=http://127.0.0.1:8000&region=us-east-1' create-table"
show "idem --store sqlite:///tmp/idem-demo.db migrate"
comment "Consumers write records (the seed example plays them: two completions, a terminal and a"
echo "# retryable failure, a poison message out of attempts, a live lease, and a worker that"
echo "# crashed holding a one-second lease)."
for u in "sqlite:///tmp/idem-demo.db" "redis://127.0.0.1:6379" "'postgres://postgres@127.0.0.1:5432/test?schema=idem_ops'" "'dynamodb://idem-ops?endpoint=http://127.0.0.1:8000&region=us-east-1'"; do
  show "cargo run -q -p idem-cli --example seed -- $u payments"
done
sleep 2
comment "3 a.m.: what is stuck, what is poison?"
show "export IDEM_STORE=sqlite:///tmp/idem-demo.db"
export IDEM_STORE=sqlite:///tmp/idem-demo.db
show "idem stats payments"
show "idem list payments"
show "idem list payments --status lease_expired,exhausted --json"
comment "What did the poison message fail with, what did order-1002 store?"
show "idem get payments order-1005"
show "idem get payments order-1002"
comment "Give back the crashed worker's lease (dry run first), delete the poison message; a live"
echo "# lease is left alone."
show "idem release-stuck payments --older-than 1s; echo \"exit \$?\""
show "idem release-stuck payments --older-than 1s --dry-run"
show "idem release-stuck payments --older-than 1s --yes"
show "idem delete payments order-1005 --yes"
show "idem delete payments order-1006 --yes; echo \"exit \$?\""
show "idem get payments order-1005; echo \"exit \$?\""
show "idem list payments --limit 3"
comment "The same questions on Redis, PostgreSQL and DynamoDB, each with its own listing."
show "idem --store redis://127.0.0.1:6379 get payments order-1003"
show "idem --store redis://127.0.0.1:6379 list payments --status failed_terminal,exhausted"
show "idem --store 'postgres://postgres@127.0.0.1:5432/test?schema=idem_ops' get payments order-1001 --json"
show "idem --store 'postgres://postgres@127.0.0.1:5432/test?schema=idem_ops' delete payments order-1001 --yes"
show "idem --store 'postgres://postgres@127.0.0.1:5432/test?schema=idem_ops' purge"
show "idem --store 'dynamodb://idem-ops?endpoint=http://127.0.0.1:8000&region=us-east-1' get payments order-1007"
comment "When the store is not there, not set up, or not what the URL says."
show "idem --timeout 2s --store redis://127.0.0.1:6390 get payments order-1001; echo \"exit \$?\""
show "idem --store 'postgres://postgres@127.0.0.1:5432/test?schema=idem_nowhere' get payments order-1001; echo \"exit \$?\""
show "idem --store mysql://127.0.0.1/payments get payments order-1001; echo \"exit \$?\""
show "idem --store redis://127.0.0.1:7001 list payments; echo \"exit \$?\""

#!/usr/bin/env bash
# Starts (and where missing, installs) every server the test suite talks to, on loopback.
# Idempotent: a service already answering is reused; nothing is ever stopped here.
#
#   scripts/services.sh            # all services
#   scripts/services.sh redis postgres
#
# Each service has its own script in scripts/services/NAME.sh that exits non-zero when it could
# not bring its server up. Logs and pid files go under $IDEM_RUN_DIR (default /tmp/idem-services);
# downloads are cached under $IDEM_CACHE_DIR (default ~/.cache/idem).
set -euo pipefail
shopt -s nullglob
here=$(cd "$(dirname "$0")" && pwd)
export IDEM_RUN_DIR=${IDEM_RUN_DIR:-/tmp/idem-services}
export IDEM_CACHE_DIR=${IDEM_CACHE_DIR:-$HOME/.cache/idem}
mkdir -p "$IDEM_RUN_DIR" "$IDEM_CACHE_DIR"

all=()
for f in "$here"/services/*.sh; do all+=("$(basename "$f" .sh)"); done
wanted=("$@")
[ ${#wanted[@]} -gt 0 ] || wanted=("${all[@]}")

failed=()
for name in "${wanted[@]}"; do
  script="$here/services/$name.sh"
  if [ ! -f "$script" ]; then
    echo "services: unknown service '$name' (known: ${all[*]})" >&2
    exit 2
  fi
  echo "services: $name"
  if ! bash "$script"; then
    failed+=("$name")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "services: FAILED to start: ${failed[*]} (logs in $IDEM_RUN_DIR)" >&2
  exit 1
fi
echo "services: all up (${wanted[*]})"

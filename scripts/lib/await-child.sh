# Sourced by the service scripts that run their server as a background child of theirs.
#
#   await_child NAME WHAT PID LOG PIDFILE SECONDS
#
# Polls the caller's `answers` function every 0.5 s and returns once it succeeds. Exits 1 with
# the last lines of LOG when the child PID exits first, or when it does not answer within
# SECONDS; in that case it stops the child (the caller started it) and removes PIDFILE.
await_child() {
  local name=$1 what=$2 pid=$3 log=$4 pidfile=$5 seconds=$6
  for _ in $(seq 1 $((seconds * 2))); do
    if answers; then
      return 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "$name: $what exited; last lines of $log:" >&2
      tail -n 30 "$log" >&2 || true
      rm -f "$pidfile"
      exit 1
    fi
    sleep 0.5
  done
  echo "$name: $what did not answer within $seconds s; stopping the process it started (pid $pid); last lines of $log:" >&2
  tail -n 30 "$log" >&2 || true
  kill "$pid" 2>/dev/null || true
  rm -f "$pidfile"
  exit 1
}

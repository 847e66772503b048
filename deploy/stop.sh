#!/usr/bin/env bash
# Stop what deploy/start.sh started (DIR as given to it): every process it started and all their
# descendants (a SuperNode's SuperExec and the ClientApp processes it spawned, which would otherwise
# outlive their SuperNode).
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=${DIR:-$ROOT/runs/deploy}
[[ -f $DIR/pids ]] || exit 0
tree() {  # a pid and all its descendants, children first
  local child
  for child in $(pgrep -P "$1"); do tree "$child"; done
  echo "$1"
}
all=$(while read -r pid; do tree "$pid"; done < "$DIR/pids")
kill -TERM $all 2>/dev/null
sleep 2
kill -KILL $all 2>/dev/null
rm -f "$DIR/pids"
exit 0

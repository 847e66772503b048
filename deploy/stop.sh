#!/usr/bin/env bash
# Stop what deploy/start.sh started (DIR as given to it).
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=${DIR:-$ROOT/runs/deploy}
[[ -f $DIR/pids ]] || exit 0
while read -r pid; do
  pkill -TERM -P "$pid" 2>/dev/null; kill -TERM "$pid" 2>/dev/null
done < "$DIR/pids"
sleep 2
while read -r pid; do
  pkill -KILL -P "$pid" 2>/dev/null; kill -KILL "$pid" 2>/dev/null
done < "$DIR/pids"
rm -f "$DIR/pids"

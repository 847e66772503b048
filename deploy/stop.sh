#!/usr/bin/env bash
# Stop the deployment deploy/start.sh started in DIR: every process it started with all their descendants,
# and every Flower process of this deployment that is no longer below them (a ServerApp or ClientApp
# whose SuperExec died is reparented to init). A process belongs to the deployment when it is a Flower
# runtime process (SuperLink, SuperNode, SuperExec, ServerApp, ClientApp) and either carries the
# deployment's marker in its environment (FEDLMC_DEPLOYMENT=DIR, inherited from start.sh) or names one
# of the deployment's own addresses or its state file on its command line. Nothing is matched by
# name alone. Exits 1, listing them, if any survive SIGTERM and then SIGKILL.
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=$(cd "${DIR:-$ROOT/runs/deploy}" 2>/dev/null && pwd) || exit 0
[[ -f $DIR/pids || -f $DIR/deployment ]] || exit 0

MARK="FEDLMC_DEPLOYMENT=$DIR"
ADDRESSES=()
DATABASE=
if [[ -f $DIR/deployment ]]; then
  while IFS='=' read -r key value; do
    case $key in
      PORT | NODE_PORT*) ADDRESSES+=("127.0.0.1:$value") ;;
      DATABASE) DATABASE=$value ;;
    esac
  done < "$DIR/deployment"
fi

tree() { # a pid and all its descendants, children first
  local child
  for child in $(pgrep -P "$1"); do tree "$child"; done
  echo "$1"
}

ours() { # is pid $1 a Flower process of this deployment?
  local args a
  args=" $(tr '\0' ' ' < "/proc/$1/cmdline" 2>/dev/null) " || return 1
  case $args in
    *flower-superlink* | *fedlmc-superlink* | *flower-supernode* | *flower-superexec* | *flwr-serverapp* | *flwr-clientapp*) ;;
    *) return 1 ;;
  esac
  tr '\0' '\n' < "/proc/$1/environ" 2>/dev/null | grep -qxF "$MARK" && return 0
  for a in "${ADDRESSES[@]}"; do [[ $args == *" $a "* ]] && return 0; done
  [[ -n $DATABASE && $args == *" $DATABASE "* ]] && return 0
  return 1
}

members() { # the deployment's live processes
  {
    [[ -f $DIR/pids ]] && while read -r pid; do [[ -n $pid ]] && tree "$pid"; done < "$DIR/pids"
    for p in /proc/[0-9]*; do
      p=${p#/proc/}
      [[ $p != "$$" ]] && ours "$p" && echo "$p"
    done
  } | sort -u
}

alive() { # the pids of $@ that still exist (zombies count as gone)
  local p
  for p in "$@"; do
    [[ -e /proc/$p && $(awk '{print $3}' "/proc/$p/stat" 2>/dev/null) != Z ]] && echo "$p"
  done
}

all=$(members)
[[ -n $all ]] && kill -TERM $all 2>/dev/null
for _ in $(seq 20); do
  [[ -z $(alive $all) ]] && break
  sleep 0.5
done
all=$(sort -u <(alive $all) <(members)) # anything started while we waited is stopped too
[[ -n $all ]] && kill -KILL $all 2>/dev/null
for _ in $(seq 10); do
  left=$(alive $all)
  [[ -z $left ]] && break
  sleep 0.5
done
if [[ -n $left ]]; then
  echo "deploy/stop.sh: still running after SIGKILL: $left" >&2
  exit 1
fi
rm -f "$DIR/pids"
exit 0

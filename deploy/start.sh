#!/usr/bin/env bash
# Start a real SuperLink and N SuperNodes on loopback, each node with its partition (and width).
#   MODE=insecure|secure N=2 DIR=runs/deploy WIDTHS="1,2" deploy/start.sh
# Then, from the project root:  FLWR_HOME=$DIR/flwr flwr run . fedlmc-deploy --stream
# secure: TLS with DIR/certs (made by certs.sh if missing) and SuperNode authentication: only the
# keys registered here (DIR/certs/keys/node*) may connect. Stop everything with deploy/stop.sh.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
MODE=${MODE:-insecure}
N=${N:-2}
DIR=$(mkdir -p "${DIR:-$ROOT/runs/deploy}" && cd "${DIR:-$ROOT/runs/deploy}" && pwd)
PORT=${PORT:-8000}           # the SuperLink's HTTP API (fleet, control, runtime)
NODE_PORT=${NODE_PORT:-9094} # first SuperNode's ClientAppIo port (one per node)
WIDTHS=${WIDTHS:-}
DATABASE=${DATABASE-$DIR/state.db} # the SuperLink's state; DATABASE="" keeps it in memory (no restart possible)
PAYLOADS=${PAYLOADS:-memory}        # message payloads: in the SuperLink's memory, or in the state file (database)
BIN=${BIN:-$ROOT/.venv/bin}
export PATH="$BIN:$PATH" FLWR_TELEMETRY_ENABLED=0
export FLWR_HOME="$DIR/flwr"
# every process of this deployment inherits the marker; deploy/stop.sh finds them by it, and by the
# addresses and state file recorded in DIR/deployment, even when they are no longer below a started pid
export FEDLMC_DEPLOYMENT="$DIR"
mkdir -p "$FLWR_HOME"
: > "$DIR/pids"
{
  echo "PORT=$PORT"
  for ((i = 0; i < N; i++)); do echo "NODE_PORT$i=$((NODE_PORT + i))"; done
  echo "DATABASE=$DATABASE"
} > "$DIR/deployment"

if [[ $MODE == secure ]]; then
  [[ -f $DIR/certs/ca.crt && -f $DIR/certs/keys/node$((N - 1)).pub ]] || "$ROOT/deploy/certs.sh" "$DIR/certs" "$N"
  LINK_TLS=(--ssl-ca-certfile "$DIR/certs/ca.crt" --ssl-certfile "$DIR/certs/server.pem" --ssl-keyfile "$DIR/certs/server.key"
            --enable-supernode-auth)
  cat > "$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "fedlmc-deploy"

[superlink.fedlmc-deploy]
address = "127.0.0.1:$PORT"
root-certificates = "$DIR/certs/ca.crt"
TOML
else
  LINK_TLS=(--insecure)
  cat > "$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "fedlmc-deploy"

[superlink.fedlmc-deploy]
address = "127.0.0.1:$PORT"
insecure = true
TOML
fi

# the SuperLink never installs the app's dependencies (they are in this venv; a fetch would pull CUDA torch).
# fedlmc-superlink is flower-superlink with the message payloads out of the state file (PAYLOADS=memory,
# the default; PAYLOADS=database keeps Flower's layout) and writes that wait for the file's lock
# (SUPERLINK=flower: Flower's own flower-superlink, payloads in the state file, writes waiting 5 s)
DB_ARGS=()
[[ -n $DATABASE ]] && DB_ARGS=(--database "$DATABASE")
LINK=(fedlmc-superlink --payloads "$PAYLOADS")
[[ ${SUPERLINK:-fedlmc} == flower ]] && LINK=(flower-superlink)
"${LINK[@]}" "${LINK_TLS[@]}" --disable-runtime-dependency-installation "${DB_ARGS[@]}" \
  --fleet-api-address "127.0.0.1:$PORT" --control-api-address "127.0.0.1:$PORT" --host 127.0.0.1 --port "$PORT" \
  > "$DIR/superlink.log" 2>&1 &
echo $! >> "$DIR/pids"
for _ in $(seq 60); do grep -q "Application startup complete\|Flower SuperExec" "$DIR/superlink.log" 2>/dev/null && break; sleep 0.5; done

IFS=, read -r -a FACTORS <<< "${WIDTHS:-1}"
for ((i = 0; i < N; i++)); do
  cfg="partition-id=$i num-partitions=$N"
  f=${FACTORS[$((i % ${#FACTORS[@]}))]}
  [[ -n $WIDTHS ]] && cfg="$cfg width-factor=$f"
  if [[ $MODE == secure ]]; then
    flwr supernode register "$DIR/certs/keys/node$i.pub" fedlmc-deploy > "$DIR/register$i.log" 2>&1
    NODE_TLS=(--root-certificates "$DIR/certs/ca.crt" --auth-supernode-private-key "$DIR/certs/keys/node$i")
  else
    NODE_TLS=(--insecure)
  fi
  flower-supernode "${NODE_TLS[@]}" --superlink "127.0.0.1:$PORT" --node-config "$cfg" --port $((NODE_PORT + i)) \
    > "$DIR/supernode$i.log" 2>&1 &
  echo $! >> "$DIR/pids"
done
echo "SuperLink on 127.0.0.1:$PORT ($MODE) with $N SuperNodes; logs and pids in $DIR"
echo "run:  FLWR_HOME=$FLWR_HOME flwr run . fedlmc-deploy --stream"

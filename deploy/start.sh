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
BIN=${BIN:-$ROOT/.venv/bin}
export PATH="$BIN:$PATH" FLWR_TELEMETRY_ENABLED=0
export FLWR_HOME="$DIR/flwr"
mkdir -p "$FLWR_HOME"
: > "$DIR/pids"

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

# the SuperLink never installs the app's dependencies (they are in this venv; a fetch would pull CUDA torch)
DB_ARGS=()
[[ -n $DATABASE ]] && DB_ARGS=(--database "$DATABASE")
flower-superlink "${LINK_TLS[@]}" --disable-runtime-dependency-installation "${DB_ARGS[@]}" \
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

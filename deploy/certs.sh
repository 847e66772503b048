#!/usr/bin/env bash
# Certificates and SuperNode keys for a secure local deployment.
#   deploy/certs.sh DIR [N]   → DIR/ca.crt, DIR/server.{pem,key} (for 127.0.0.1 / localhost; add hosts with
#                               SERVER_HOSTS="DNS:link.example.org,IP:10.0.0.5"), DIR/keys/node{0..N-1}{,.pub}
set -euo pipefail
DIR=${1:?usage: certs.sh DIR [N]}
N=${2:-2}
HOSTS=${SERVER_HOSTS:-}
mkdir -p "$DIR/keys"
cd "$DIR"
openssl genrsa -out ca.key 4096 2>/dev/null
openssl req -x509 -new -nodes -key ca.key -sha256 -days 365 -subj "/CN=fedlmc test CA" -out ca.crt
openssl genrsa -out server.key 4096 2>/dev/null
SAN="DNS:localhost,IP:127.0.0.1,IP:::1${HOSTS:+,$HOSTS}"
openssl req -new -key server.key -subj "/CN=localhost" -addext "subjectAltName=$SAN" -out server.csr
printf "subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n" "$SAN" > server.ext
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 -sha256 -extfile server.ext -out server.pem 2>/dev/null
rm -f server.csr server.ext
# SuperNode authentication keys (ECDSA P-384, OpenSSH format, as Flower expects)
for ((i = 0; i < N; i++)); do
  rm -f "keys/node$i" "keys/node$i.pub"
  ssh-keygen -q -t ecdsa -b 384 -N "" -C "fedlmc-node$i" -f "keys/node$i"
done
chmod 600 ca.key server.key keys/node*[0-9]
echo "wrote $DIR/ca.crt, $DIR/server.pem, $DIR/server.key and $N SuperNode key pairs in $DIR/keys"

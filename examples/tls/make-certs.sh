#!/usr/bin/env bash
# Makes a private CA and, signed by it, a server certificate for sluice and a client certificate
# (for Envoy, or `sluice health`), for local trials of TLS and mTLS. Not for production: the CA
# key sits unencrypted beside the certificates.
#
#   examples/tls/make-certs.sh [DIR] [SERVER_NAME…]
#
# DIR defaults to ./certs; the server certificate holds `localhost`, 127.0.0.1 and every
# SERVER_NAME given (a DNS name or an IP address). Every key is EC P-256, in PKCS#8.
set -euo pipefail

dir="${1:-certs}"
shift || true
mkdir -p "$dir"
cd "$dir"

sans="DNS:localhost,IP:127.0.0.1"
for name in "$@"; do
    if [[ "$name" =~ ^[0-9.]+$ || "$name" == *:* ]]; then sans="$sans,IP:$name"; else sans="$sans,DNS:$name"; fi
done

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

# The CA: 10 years, allowed to sign certificates only.
key ca-key.pem
openssl req -x509 -new -key ca-key.pem -sha256 -days 3650 -subj "/CN=sluice trial CA" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out ca.pem

# issue NAME CN EXTENSIONS: NAME.pem and NAME-key.pem, signed by the CA for a year.
issue() {
    key "$1-key.pem"
    openssl req -new -key "$1-key.pem" -subj "/CN=$2" -out "$1.csr"
    openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca-key.pem -CAcreateserial -sha256 \
        -days 365 -extfile <(printf '%s\n' "$3") -out "$1.pem" 2>/dev/null
    rm "$1.csr"
}

issue server localhost "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth
subjectAltName=$sans"

issue client envoy "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=clientAuth"

rm -f ca.srl
chmod 600 ./*-key.pem
echo "in $PWD: ca.pem, server.pem + server-key.pem ($sans), client.pem + client-key.pem"

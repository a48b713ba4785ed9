#!/usr/bin/env bash
# Test-only TLS material: a stand-in for Google served over https in
# tests/tests/fcm.rs, and the service's own TLS in tests/tests/tls.rs.
# NEVER real secrets. Regenerate with
#
#   certs/make-tls.sh
#
# (needs the openssl command line tool; the autopush binary never links openssl).
#
#   tls-ca.pem            a root certificate authority for the tests
#   tls-127.0.0.1.pem     a server certificate for 127.0.0.1, signed by that CA
#   tls-127.0.0.1-key.pem ...and its key (EC P-256, PKCS#8)
#   tls-127.0.0.1-renewed.pem, tls-127.0.0.1-renewed-key.pem
#                         another certificate and key for 127.0.0.1 from that
#                         CA, as a renewal would bring (the reload tests)
#   tls-other-ca.pem      another root, which vouches for nothing the tests serve
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

root() { # name -> $work/name.key, name.pem
    openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$work/$1.key"
    openssl req -new -x509 -key "$work/$1.key" -out "$1.pem" -days 36500 \
        -subj "/CN=autopush $1 (TEST ONLY)" \
        -addext basicConstraints=critical,CA:true -addext keyUsage=critical,keyCertSign,cRLSign
}
root tls-ca
root tls-other-ca

leaf() { # name: a certificate for 127.0.0.1 signed by tls-ca -> name.pem, name-key.pem
    openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1-key.pem"
    openssl req -new -key "$1-key.pem" -out "$work/leaf.csr" -subj "/CN=127.0.0.1"
    printf 'subjectAltName=IP:127.0.0.1\nbasicConstraints=critical,CA:false\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n' > "$work/leaf.ext"
    openssl x509 -req -in "$work/leaf.csr" -CA tls-ca.pem -CAkey "$work/tls-ca.key" \
        -CAcreateserial -CAserial "$work/ca.srl" -out "$1.pem" -days 36500 -extfile "$work/leaf.ext" 2>/dev/null
}
leaf tls-127.0.0.1
leaf tls-127.0.0.1-renewed

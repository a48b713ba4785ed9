#!/usr/bin/env bash
# Test-only APNs key material for the tests in routers/apns and tests/.
# NEVER real secrets: nothing here is known to Apple. Regenerate with
#
#   certs/make-apns.sh
#
# (needs the openssl command line tool; the autopush binary never links openssl).
#
#   apns-token-key.p8     token auth: an EC P-256 key in PKCS#8 PEM, as Apple's .p8 files
#   apns-cert.pem         certificate auth: a self-signed client certificate
#   apns-cert-key.pem     ...and its RSA key in PKCS#8 PEM (Apple's are RSA 2048)
#   apns-cert-key-pkcs1.pem  the same key as PKCS#1 (BEGIN RSA PRIVATE KEY), which the
#                         router refuses with a hint to convert it
#   apns-other-key.pem    an RSA key that is not the certificate's, which the router
#                         refuses at start-up
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out apns-token-key.p8

openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out apns-cert-key.pem
openssl req -new -x509 -key apns-cert-key.pem -out apns-cert.pem -days 36500 \
    -subj "/UID=org.example.autopush.test/CN=Apple Push Services: org.example.autopush.test (TEST ONLY)"
openssl pkey -in apns-cert-key.pem -traditional -out apns-cert-key-pkcs1.pem
openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out apns-other-key.pem

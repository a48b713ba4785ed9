#!/usr/bin/env bash
# Test-only service account for the FCM/GCM bridge tests: a fresh RSA key and
# the service-account JSON Google would hand out for it. NEVER a real secret.
#
#   fcm-service-account.json  the key file the server is configured with; its
#                             token_uri is a placeholder the tests rewrite to
#                             their local OAuth server
#   fcm-public.pem            the public key (PKCS#1) the tests' OAuth server
#                             verifies the JWT-bearer grant's RS256 signature with
#
# Needs the openssl command-line tool (the server itself never links openssl).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

key=$(mktemp)
trap 'rm -f "$key"' EXIT
openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$key" 2>/dev/null
openssl rsa -in "$key" -RSAPublicKey_out -out fcm-public.pem 2>/dev/null

# The PEM on one JSON line, newlines as \n.
pem=$(awk '{printf "%s\\n", $0}' "$key")
cat >fcm-service-account.json <<JSON
{
  "type": "service_account",
  "project_id": "autopush-test",
  "private_key_id": "fcm-test-key",
  "private_key": "$pem",
  "client_email": "autopush-test@autopush-test.iam.gserviceaccount.com",
  "client_id": "100000000000000000001",
  "auth_uri": "https://accounts.google.com/o/oauth2/auth",
  "token_uri": "http://127.0.0.1:9/token-placeholder",
  "auth_provider_x509_cert_url": "https://www.googleapis.com/oauth2/v1/certs"
}
JSON
echo "wrote certs/fcm-service-account.json and certs/fcm-public.pem"

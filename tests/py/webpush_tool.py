#!/usr/bin/env python3
"""Web Push application-server / user-agent helper for the end-to-end tests.

The Rust tests (crate ``autopush-tests``) run this as a subprocess. It uses the
real PyPI libraries an application server uses (pywebpush, py_vapid, http_ece,
cryptography). Every subcommand prints exactly one JSON object on stdout.

Subcommands:
  keys        new browser subscription keys (private key, p256dh, auth)
  vapid-key   new VAPID key pair, private key written as PEM (and printed raw)
  send        encrypt + POST a push message with pywebpush (optionally VAPID)
  encrypt     encrypt only (pywebpush's encoder); prints body + headers in the
              form the push service forwards them over the websocket
  decrypt     decrypt a notification as received over the websocket
"""

import argparse
import base64
import json
import os
import string
import sys
from urllib.parse import urlparse

import http_ece
import requests
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from py_vapid import Vapid01, Vapid02
from pywebpush import WebPusher

PATTERN_ALPHABET = string.ascii_letters + string.digits


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")


def unb64url(text: str) -> bytes:
    text = text.strip()
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def emit(obj) -> None:
    sys.stdout.write(json.dumps(obj))
    sys.stdout.write("\n")
    sys.stdout.flush()


def data_pattern(n: int) -> bytes:
    """Deterministic, non-repeating-per-record payload; mirrored in Rust."""
    return "".join(PATTERN_ALPHABET[i % len(PATTERN_ALPHABET)] for i in range(n)).encode()


def payload(args) -> bytes | None:
    if args.data is not None:
        return args.data.encode("utf-8")
    if args.data_hex is not None:
        return bytes.fromhex(args.data_hex)
    if args.data_len is not None:
        return data_pattern(args.data_len)
    return None


def public_raw(key) -> bytes:
    return key.public_bytes(
        serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
    )


# ---------------------------------------------------------------- keys


def cmd_keys(_args) -> None:
    private = ec.generate_private_key(ec.SECP256R1())
    scalar = private.private_numbers().private_value.to_bytes(32, "big")
    emit(
        {
            "private_key": b64url(scalar),
            "p256dh": b64url(public_raw(private.public_key())),
            "auth": b64url(os.urandom(16)),
        }
    )


def cmd_vapid_key(args) -> None:
    vapid = Vapid02()
    vapid.generate_keys()
    vapid.save_key(args.out)
    scalar = vapid.private_key.private_numbers().private_value.to_bytes(32, "big")
    emit(
        {
            "private_pem": args.out,
            "public_key": b64url(public_raw(vapid.public_key)),
            # The raw private scalar, as web-push (npm) wants it in vapidDetails.
            "private_key": b64url(scalar),
        }
    )


# ---------------------------------------------------------------- send


def origin(url: str) -> str:
    parsed = urlparse(url)
    return f"{parsed.scheme}://{parsed.netloc}"


def subscription_info(args) -> dict:
    return {
        "endpoint": getattr(args, "endpoint", None) or "http://127.0.0.1/unused",
        "keys": {"p256dh": args.p256dh, "auth": args.auth},
    }


def vapid_headers(args) -> dict:
    if not args.vapid_pem:
        return {}
    cls = Vapid01 if args.vapid_scheme == "webpush" else Vapid02
    vapid = cls.from_file(private_key_file=args.vapid_pem)
    claims = {"sub": args.vapid_sub, "aud": args.vapid_aud or origin(args.endpoint)}
    if args.vapid_exp is not None:
        claims["exp"] = args.vapid_exp
    return vapid.sign(claims)


def cmd_send(args) -> None:
    headers = dict(vapid_headers(args))
    if args.topic is not None:
        headers["Topic"] = args.topic
    if args.urgency is not None:
        headers["Urgency"] = args.urgency
    session = requests.Session()
    session.trust_env = False  # never route loopback traffic through a proxy
    if args.ca_file:
        session.verify = args.ca_file
    pusher = WebPusher(subscription_info(args), requests_session=session)
    resp = pusher.send(
        payload(args),
        headers,
        ttl=args.ttl,
        content_encoding=args.encoding,
        timeout=30,
    )
    sent = resp.request
    emit(
        {
            "status": resp.status_code,
            "headers": {k.lower(): v for k, v in resp.headers.items()},
            "body": resp.text,
            "sent_headers": {k.lower(): v for k, v in sent.headers.items()},
            "sent_body_len": len(sent.body or b""),
        }
    )


# ---------------------------------------------------------------- encrypt


def cmd_encrypt(args) -> None:
    data = payload(args)
    if not data:
        raise SystemExit("encrypt needs --data, --data-hex or --data-len > 0")
    encoded = WebPusher(subscription_info(args)).encode(data, args.encoding)
    headers = {"encoding": args.encoding}
    if "salt" in encoded:
        headers["encryption"] = "salt=" + encoded["salt"].decode("ascii")
    if "crypto_key" in encoded:
        headers["crypto_key"] = "dh=" + encoded["crypto_key"].decode("ascii")
    emit({"body": b64url(encoded["body"]), "headers": headers})


# ---------------------------------------------------------------- decrypt


def header_params(value: str) -> dict:
    """Parse `salt=..;rs=..` / `dh=..;p256ecdsa=..,keyid=..` into a dict.

    Both ',' (several keys) and ';' (parameters of one key) separate entries;
    the first occurrence of a name wins.
    """
    params: dict = {}
    for part in value.replace(",", ";").split(";"):
        if "=" not in part:
            continue
        name, val = part.split("=", 1)
        params.setdefault(name.strip().lower(), val.strip().strip('"'))
    return params


def cmd_decrypt(args) -> None:
    headers = {k.lower().replace("-", "_"): v for k, v in json.loads(args.headers).items()}
    encoding = headers.get("encoding")
    scalar = int.from_bytes(unb64url(args.private_key), "big")
    private = ec.derive_private_key(scalar, ec.SECP256R1())
    auth = unb64url(args.auth)
    content = unb64url(args.data)
    if encoding == "aes128gcm":
        plaintext = http_ece.decrypt(
            content, private_key=private, auth_secret=auth, version="aes128gcm"
        )
    elif encoding == "aesgcm":
        enc = header_params(headers.get("encryption", ""))
        ckey = header_params(headers.get("crypto_key", ""))
        if "salt" not in enc:
            raise SystemExit(f"aesgcm: no salt in encryption header: {headers!r}")
        if "dh" not in ckey:
            raise SystemExit(f"aesgcm: no dh in crypto_key header: {headers!r}")
        plaintext = http_ece.decrypt(
            content,
            salt=unb64url(enc["salt"]),
            rs=int(enc.get("rs", 4096)),
            private_key=private,
            dh=unb64url(ckey["dh"]),
            auth_secret=auth,
            version="aesgcm",
        )
    else:
        raise SystemExit(f"unsupported encoding {encoding!r} in headers {headers!r}")
    emit(
        {
            "plaintext": plaintext.decode("utf-8", errors="replace"),
            "plaintext_hex": plaintext.hex(),
        }
    )


# ---------------------------------------------------------------- CLI


def add_payload_args(p) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("--data", help="UTF-8 text payload")
    group.add_argument("--data-hex", help="payload as hex")
    group.add_argument("--data-len", type=int, help="N bytes of the deterministic pattern")
    p.add_argument("--encoding", default="aes128gcm", choices=["aes128gcm", "aesgcm"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)

    sub.add_parser("keys").set_defaults(func=cmd_keys)

    p = sub.add_parser("vapid-key")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_vapid_key)

    p = sub.add_parser("send")
    p.add_argument("--endpoint", required=True)
    p.add_argument("--p256dh", required=True)
    p.add_argument("--auth", required=True)
    add_payload_args(p)
    p.add_argument("--ttl", type=int, default=0)
    p.add_argument("--topic")
    p.add_argument("--urgency")
    p.add_argument("--vapid-pem")
    p.add_argument("--vapid-sub", default="mailto:test@example.com")
    p.add_argument("--vapid-aud")
    p.add_argument("--vapid-exp", type=int)
    p.add_argument("--ca-file", help="trust only these CA certificates (PEM) for https")
    p.add_argument(
        "--vapid-scheme",
        default="vapid",
        choices=["vapid", "webpush"],
        help="vapid: RFC 8292 'Authorization: vapid t=,k=' (pywebpush's default); "
        "webpush: draft 'Authorization: WebPush <jwt>' + 'Crypto-Key: p256ecdsa='",
    )
    p.set_defaults(func=cmd_send)

    p = sub.add_parser("encrypt")
    p.add_argument("--p256dh", required=True)
    p.add_argument("--auth", required=True)
    add_payload_args(p)
    p.set_defaults(func=cmd_encrypt)

    p = sub.add_parser("decrypt")
    p.add_argument("--private-key", required=True)
    p.add_argument("--auth", required=True)
    p.add_argument("--data", required=True, help="b64url body as received")
    p.add_argument("--headers", required=True, help="JSON object of the notification's headers")
    p.set_defaults(func=cmd_decrypt)

    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()

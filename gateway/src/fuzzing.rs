//! Every parser reachable from the network, with what must hold whatever a
//! client sends: no panic, and round trips where they are cheap to check.
//!
//! The `cargo fuzz` targets in `fuzz/` call these functions with libFuzzer's
//! inputs; the bounded randomized tests below call them with arbitrary and
//! near-valid inputs on every `cargo test`. A failed property panics.

use std::sync::LazyLock;

use autopush_common::endpoint::{EndpointCrypto, MessageIdInfo, key_hash};
use autopush_common::ids::{decode_vapid_key, parse_channel_id};
use autopush_connection::protocol::{ClientMessage, error_json};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE;
use uuid::Uuid;
use warp::http::{HeaderMap, HeaderName, HeaderValue};

use crate::endpoint::headers::{self, MAX_TTL};
use crate::vapid::VapidVerifier;

/// The origin the VAPID verifier here expects as `aud`.
pub const AUDIENCE: &str = "http://localhost:8082";

static CRYPTO: LazyLock<EndpointCrypto> = LazyLock::new(|| {
    let key = URL_SAFE.encode([7u8; 32]);
    EndpointCrypto::new(&[key], AUDIENCE).expect("a valid fixed key")
});

static VAPID: LazyLock<VapidVerifier> =
    LazyLock::new(|| VapidVerifier::new(AUDIENCE.to_owned(), 16));

/// A websocket text message from a user agent (`connection::protocol`).
pub fn client_message(data: &[u8]) {
    // Websocket text frames are UTF-8; tungstenite refuses anything else.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Err(e) = ClientMessage::parse(text) {
        assert!(!e.reason.is_empty(), "an error without a reason");
        let reply = error_json(e.message_type.as_deref().unwrap_or("error"), 401, &e.reason);
        assert!(serde_json::from_str::<serde_json::Value>(&reply).is_ok());
    }
}

/// The headers of a push request (`endpoint::headers`), given as
/// `name: value` lines; the first byte's low bit says whether a body came.
pub fn push_headers(data: &[u8]) {
    let Some((first, lines)) = data.split_first() else {
        return;
    };
    let has_body = first & 1 == 1;
    let mut map = HeaderMap::new();
    for line in lines.split(|b| *b == b'\n') {
        let Some(colon) = line.iter().position(|b| *b == b':') else {
            continue;
        };
        // What HTTP itself refuses never reaches the parser.
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(&line[..colon]),
            HeaderValue::from_bytes(line[colon + 1..].trim_ascii()),
        ) else {
            continue;
        };
        map.append(name, value);
    }
    if let Ok(parsed) = headers::parse(&map, has_body) {
        assert!(parsed.ttl <= MAX_TTL, "TTL over the cap: {}", parsed.ttl);
        assert!(parsed.topic.as_ref().is_none_or(|t| t.len() <= 32));
        assert_eq!(parsed.forward.is_some(), has_body);
    }
}

/// Endpoint tokens (`/wpush/{v1,v2}/TOKEN`) and message ids (`/m/ID`) as
/// sent, and the round trip of both for ids and keys taken from `data`.
pub fn endpoint_token(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    if let Ok(info) = CRYPTO.parse_token("v1", &text) {
        assert!(info.key_hash.is_none());
    }
    if let Ok(info) = CRYPTO.parse_token("v2", &text) {
        assert!(info.key_hash.is_some());
    }
    let _ = CRYPTO.parse_message_id(&text);

    let (Some(uaid), Some(channel_id)) = (
        data.get(..16).and_then(|b| Uuid::from_slice(b).ok()),
        data.get(16..32).and_then(|b| Uuid::from_slice(b).ok()),
    ) else {
        return;
    };
    let rest = &data[32..];
    let vapid_key = rest.get(..65);
    let url = CRYPTO.make_endpoint(&uaid, &channel_id, vapid_key);
    let path = url
        .strip_prefix(AUDIENCE)
        .and_then(|p| p.strip_prefix("/wpush/"))
        .expect("an endpoint under the endpoint URL");
    let (version, token) = path.split_once('/').expect("/wpush/VERSION/TOKEN");
    let info = CRYPTO
        .parse_token(version, token)
        .expect("a token we made reads back");
    assert_eq!(
        (info.uaid, info.channel_id, info.key_hash),
        (uaid, channel_id, vapid_key.map(key_hash))
    );

    // A Topic is base64url by the time it is in an id (the headers check).
    let topic: String = String::from_utf8_lossy(rest)
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
        .collect();
    let timestamp = rest
        .iter()
        .fold(0u64, |t, b| t.rotate_left(8) ^ u64::from(*b));
    for (topic, sortkey_timestamp) in [(Some(topic), None), (None, Some(timestamp))] {
        let message = MessageIdInfo {
            uaid,
            channel_id,
            topic,
            sortkey_timestamp,
            ..Default::default()
        };
        let id = CRYPTO.make_message_id(&message);
        assert_eq!(CRYPTO.parse_message_id(&id).as_ref(), Ok(&message));
    }
}

/// VAPID credentials (`vapid::header`, `vapid::jws`, `vapid::claims`): the
/// `Authorization` value, then after the first newline the `Crypto-Key` value.
pub fn vapid(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let (authorization, crypto_key) = match text.split_once('\n') {
        Some((a, c)) => (a, Some(c)),
        None => (text.as_ref(), None),
    };
    if let Ok(Some(identity)) = VAPID.verify(Some(authorization), crypto_key) {
        assert_eq!(identity.key_hash, key_hash(&identity.public_key));
    }
}

/// A `/v1/.../registration` request body (`registration-api`) and the ids
/// and key it may carry.
pub fn registration_body(data: &[u8]) {
    let Ok(input) = autopush_registration::parse_body(data) else {
        return;
    };
    if let Some(chid) = &input.channel_id
        && let Some(uuid) = parse_channel_id(chid)
    {
        assert_eq!(&uuid.hyphenated().to_string(), chid);
    }
    if let Some(key) = &input.key
        && let Some(raw) = decode_vapid_key(key)
    {
        assert_eq!((raw.len(), raw[0]), (65, 4));
    }
}

/// Bounded randomized runs of the properties above: arbitrary bytes, and
/// near-valid inputs that get past the first checks.
#[cfg(test)]
mod tests {
    use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
    use proptest::prelude::*;
    use ring::rand::SystemRandom;
    use ring::signature::{ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair, KeyPair};
    use serde_json::{Value, json};

    use super::*;

    /// 2 000 cases each, or `PROPTEST_CASES` for a longer hunt.
    fn config() -> ProptestConfig {
        let default = ProptestConfig::default();
        let asked = std::env::var_os("PROPTEST_CASES").is_some();
        ProptestConfig {
            cases: if asked { default.cases } else { 2000 },
            // Any failure found becomes a named regression test instead.
            failure_persistence: None,
            ..ProptestConfig::default()
        }
    }

    /// Any JSON value, a few levels deep, with strings that are not only ASCII.
    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            ".{0,20}".prop_map(Value::from),
        ];
        leaf.prop_recursive(2, 12, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                prop::collection::btree_map(".{0,8}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// A JSON object with some of `names` set to any value, plus odd extras.
    fn json_object(names: &'static [&'static str]) -> impl Strategy<Value = Value> {
        (
            prop::collection::vec((prop::sample::select(names), json_value()), 0..4),
            prop::collection::vec((".{0,8}", json_value()), 0..2),
        )
            .prop_map(|(known, extra)| {
                let mut object = serde_json::Map::new();
                for (name, value) in known {
                    object.insert(name.to_owned(), value);
                }
                for (name, value) in extra {
                    object.insert(name, value);
                }
                Value::Object(object)
            })
    }

    fn client_message_json() -> impl Strategy<Value = Value> {
        let message_type = prop_oneof![
            prop::sample::select(vec![
                "hello",
                "register",
                "unregister",
                "ack",
                "nack",
                "ping",
                "broadcast_subscribe",
            ])
            .prop_map(Value::from),
            ".{0,200}".prop_map(Value::from),
            json_value(),
        ];
        let fields = json_object(&[
            "uaid",
            "use_webpush",
            "broadcasts",
            "channelID",
            "key",
            "code",
            "updates",
            "version",
        ]);
        (message_type, fields, any::<bool>()).prop_map(|(t, mut fields, typed)| {
            if typed {
                fields["messageType"] = t;
            }
            fields
        })
    }

    fn header_line() -> impl Strategy<Value = String> {
        let name = prop_oneof![
            prop::sample::select(vec![
                "ttl",
                "topic",
                "urgency",
                "content-encoding",
                "encryption",
                "crypto-key",
            ])
            .prop_map(str::to_owned),
            "[a-zA-Z-]{1,12}",
        ];
        let value = prop_oneof![
            "[0-9]{1,25}",
            "-?[0-9]{0,5}\\.?[0-9]{0,3}",
            "[A-Za-z0-9_=-]{0,40}",
            prop::sample::select(vec![
                "aes128gcm",
                "AESGCM",
                "aesgcm",
                "very-low",
                "high",
                "salt=abc",
                "salt=\"\"",
                "dh=xyz;p256ecdsa=k",
                "keyid=p256dh;dh=",
            ])
            .prop_map(str::to_owned),
            ".{0,30}",
        ];
        (name, value).prop_map(|(n, v)| format!("{n}: {v}"))
    }

    fn registration_json() -> impl Strategy<Value = Value> {
        let channel_id = prop_oneof![
            any::<u128>().prop_map(|u| Uuid::from_u128(u).hyphenated().to_string()),
            any::<u128>().prop_map(|u| Uuid::from_u128(u).simple().to_string()),
            any::<u128>().prop_map(|u| Uuid::from_u128(u).hyphenated().to_string().to_uppercase()),
            ".{0,40}",
        ];
        let key = prop::collection::vec(any::<u8>(), 60..70).prop_map(|mut raw| {
            raw[0] = 4;
            match raw[1] % 3 {
                0 => URL_SAFE_NO_PAD.encode(&raw),
                1 => STANDARD.encode(&raw),
                _ => format!(" {}== ", URL_SAFE.encode(&raw)),
            }
        });
        (
            json_object(&["token", "channelID", "key", "aps"]),
            prop::option::of(channel_id),
            prop::option::of(key),
        )
            .prop_map(|(mut body, chid, key)| {
                if let Some(chid) = chid {
                    body["channelID"] = chid.into();
                }
                if let Some(key) = key {
                    body["key"] = key.into();
                }
                body
            })
    }

    /// A few VAPID key pairs (made once: key generation is the slow part).
    static SIGNERS: LazyLock<Vec<EcdsaKeyPair>> = LazyLock::new(|| {
        let rng = SystemRandom::new();
        (0..3)
            .map(|_| {
                let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng)
                    .expect("generate a P-256 key");
                EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref(), &rng)
                    .expect("read it back")
            })
            .collect()
    });

    fn now() -> i64 {
        i64::try_from(autopush_common::time::now_secs()).unwrap_or(i64::MAX)
    }

    /// How a signed token is presented, and how it may be damaged.
    #[derive(Debug, Clone)]
    struct VapidCase {
        signer: usize,
        header: Value,
        claims: Value,
        style: u8,
        cut: Option<usize>,
        flip: Option<(usize, u8)>,
    }

    fn vapid_case() -> impl Strategy<Value = VapidCase> {
        let header = prop_oneof![
            3 => Just(json!({"typ": "JWT", "alg": "ES256"})),
            1 => json_object(&["typ", "alg", "kid"]),
        ];
        let aud = prop_oneof![
            3 => Just(Value::from(AUDIENCE)),
            1 => json_value(),
        ];
        let exp = prop_oneof![
            3 => (-3600i64..90_000).prop_map(|d| Value::from(now() + d)),
            1 => json_value(),
        ];
        let sub = prop_oneof![
            Just(Value::from("mailto:ops@example.com")),
            Just(Value::from("https://example.com")),
            json_value(),
        ];
        let claims = (
            prop::option::of(aud),
            prop::option::of(exp),
            prop::option::of(sub),
        )
            .prop_map(|(aud, exp, sub)| {
                let mut claims = json!({});
                for (name, value) in [("aud", aud), ("exp", exp), ("sub", sub)] {
                    if let Some(value) = value {
                        claims[name] = value;
                    }
                }
                claims
            });
        (
            0..3usize,
            header,
            claims,
            any::<u8>(),
            prop::option::weighted(0.2, any::<usize>()),
            prop::option::weighted(0.2, (any::<usize>(), any::<u8>())),
        )
            .prop_map(|(signer, header, claims, style, cut, flip)| VapidCase {
                signer,
                header,
                claims,
                style,
                cut,
                flip,
            })
    }

    impl VapidCase {
        /// `Authorization`, newline, `Crypto-Key`: what [`vapid`] reads.
        fn input(&self) -> Vec<u8> {
            let signer = &SIGNERS[self.signer];
            let input = format!(
                "{}.{}",
                URL_SAFE_NO_PAD.encode(self.header.to_string()),
                URL_SAFE_NO_PAD.encode(self.claims.to_string())
            );
            let signature = signer
                .sign(&SystemRandom::new(), input.as_bytes())
                .expect("sign");
            let mut token = format!("{input}.{}", URL_SAFE_NO_PAD.encode(signature.as_ref()));
            if let Some(cut) = self.cut {
                token.truncate(cut % (token.len() + 1));
            }
            let mut token = token.into_bytes();
            if let Some((at, byte)) = self.flip
                && !token.is_empty()
            {
                let at = at % token.len();
                token[at] = byte;
            }
            let token = String::from_utf8_lossy(&token);
            let key = URL_SAFE_NO_PAD.encode(signer.public_key().as_ref());
            match self.style % 4 {
                0 => format!("vapid t={token}, k={key}"),
                1 => format!("vapid k=\"{key}\",t={token}"),
                2 => format!("WebPush {token}\ndh=abc;p256ecdsa={key}"),
                _ => format!("Bearer {token}\np256ecdsa=\"{key}\",dh=abc"),
            }
            .into_bytes()
        }

        /// Whether the token is one the verifier must accept.
        fn valid(&self) -> bool {
            let exp = self.claims["exp"].as_i64().unwrap_or(0) - now();
            self.cut.is_none()
                && self.flip.is_none()
                && self.header["alg"] == "ES256"
                && self.claims["aud"] == AUDIENCE
                && (60..80_000).contains(&exp)
        }
    }

    #[test]
    fn the_seed_corpora_hold() {
        let corpora = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus");
        type Target = fn(&[u8]);
        let targets: [(&str, Target); 5] = [
            ("client_message", client_message),
            ("push_headers", push_headers),
            ("endpoint_token", endpoint_token),
            ("vapid", vapid),
            ("registration_body", registration_body),
        ];
        for (name, target) in targets {
            let seeds = std::fs::read_dir(corpora.join(name)).expect("a seed corpus");
            let mut count = 0;
            for seed in seeds {
                target(&std::fs::read(seed.expect("a seed").path()).expect("read a seed"));
                count += 1;
            }
            assert!(count > 0, "no seeds for {name}");
        }
    }

    proptest! {
        #![proptest_config(config())]

        #[test]
        fn client_message_any_bytes(data in prop::collection::vec(any::<u8>(), 0..300)) {
            client_message(&data);
        }

        #[test]
        fn client_message_near_valid(message in client_message_json()) {
            client_message(message.to_string().as_bytes());
        }

        #[test]
        fn push_headers_any_bytes(data in prop::collection::vec(any::<u8>(), 0..300)) {
            push_headers(&data);
        }

        #[test]
        fn push_headers_near_valid(has_body: bool, lines in prop::collection::vec(header_line(), 0..6)) {
            let mut data = vec![u8::from(has_body)];
            data.extend(lines.join("\n").into_bytes());
            push_headers(&data);
        }

        #[test]
        fn endpoint_token_any_bytes(data in prop::collection::vec(any::<u8>(), 0..200)) {
            endpoint_token(&data);
        }

        #[test]
        fn endpoint_token_made_then_damaged(
            ids in prop::collection::vec(any::<u8>(), 32..120),
            cut: usize,
            flip: (usize, u8),
        ) {
            // The round trip runs inside; then the token, damaged, is refused or read.
            endpoint_token(&ids);
            let uaid = Uuid::from_slice(&ids[..16]).expect("16 bytes");
            let chid = Uuid::from_slice(&ids[16..32]).expect("16 bytes");
            let url = CRYPTO.make_endpoint(&uaid, &chid, ids.get(32..97));
            let token = url.rsplit('/').next().expect("a token").to_owned();
            let mut damaged = token.clone().into_bytes();
            damaged.truncate(cut % (damaged.len() + 1));
            endpoint_token(&damaged);
            let mut flipped = token.into_bytes();
            let at = flip.0 % flipped.len();
            flipped[at] = flip.1;
            endpoint_token(&flipped);
        }

        #[test]
        fn vapid_any_bytes(data in prop::collection::vec(any::<u8>(), 0..300)) {
            vapid(&data);
        }

        #[test]
        fn vapid_signed_near_valid(case in vapid_case()) {
            let input = case.input();
            vapid(&input);
            if case.valid() {
                let text = String::from_utf8(input).expect("ASCII");
                let (authorization, crypto_key) = match text.split_once('\n') {
                    Some((a, c)) => (a, Some(c)),
                    None => (text.as_str(), None),
                };
                let verified = VAPID.verify(Some(authorization), crypto_key);
                prop_assert!(matches!(verified, Ok(Some(_))), "{case:?}: {verified:?}");
            }
        }

        #[test]
        fn registration_body_any_bytes(data in prop::collection::vec(any::<u8>(), 0..300)) {
            registration_body(&data);
        }

        #[test]
        fn registration_body_near_valid(body in registration_json()) {
            registration_body(body.to_string().as_bytes());
        }
    }
}

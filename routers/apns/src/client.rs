//! [`A2Sender`]: the real APNs client, one per channel, built at start-up
//! and reused (a2 multiplexes every push over its HTTP/2 connection). This
//! is the only code that calls the a2 crate.

use a2::request::payload::PayloadLike;
use a2::{Client, ClientConfig, CollapseId, Endpoint, NotificationOptions, Priority, PushType};
use async_trait::async_trait;
use serde::Serialize;
use serde_json::value::RawValue;

use crate::sender::{ApnsHeaders, ApnsRequest, ApnsResponse, ApnsSender, TransportError};
use crate::settings::{ApnsChannel, Auth};

pub struct A2Sender {
    client: Client,
}

impl A2Sender {
    /// Read the channel's key material and build its client. Errors name the
    /// field at fault (`key: ...`, `cert: ...`), so that a bad file stops the
    /// start-up instead of the first push.
    pub fn new(channel: &ApnsChannel) -> Result<A2Sender, String> {
        let config = ClientConfig {
            endpoint: if channel.sandbox {
                Endpoint::Sandbox
            } else {
                Endpoint::Production
            },
            // The router's own deadline ends a push first; this only stops a
            // request that outlives it from lingering.
            request_timeout_secs: Some(channel.timeout().as_secs_f64().ceil() as u64),
            pool_idle_timeout_secs: Some(600),
        };
        let client = match channel.auth()? {
            Auth::Token {
                key,
                key_id,
                team_id,
            } => {
                let pem = key.load().map_err(|e| format!("key: {e}"))?;
                expect_pkcs8(&pem, "the .p8 key Apple issues")?;
                Client::token(&mut pem.as_slice(), key_id, team_id, config).map_err(|e| {
                    format!("key: not a P-256 signing key Apple's token auth can use ({e})")
                })?
            }
            Auth::Certificate { cert, key } => {
                let cert_pem = cert.load().map_err(|e| format!("cert: {e}"))?;
                let blocks =
                    pem::parse_many(&cert_pem).map_err(|e| format!("cert: not PEM ({e})"))?;
                if !blocks.iter().any(|b| b.tag() == "CERTIFICATE") {
                    return Err("cert: no PEM certificate (BEGIN CERTIFICATE) in it".into());
                }
                let key_pem = key.load().map_err(|e| format!("key: {e}"))?;
                expect_pkcs8(&key_pem, "the certificate's private key")?;
                expect_pair(&blocks, &key_pem)?;
                Client::certificate_parts(&cert_pem, &key_pem, config)
                    .map_err(|e| format!("key: the certificate and key are unusable ({e})"))?
            }
        };
        Ok(A2Sender { client })
    }
}

/// The key must be a PKCS#8 PEM (`BEGIN PRIVATE KEY`), the form a2 reads;
/// say how to convert the older forms.
fn expect_pkcs8(pem_bytes: &[u8], what: &str) -> Result<(), String> {
    let block = pem::parse(pem_bytes).map_err(|e| format!("key: {what} is not PEM ({e})"))?;
    match block.tag() {
        "PRIVATE KEY" => Ok(()),
        tag @ ("RSA PRIVATE KEY" | "EC PRIVATE KEY") => Err(format!(
            "key: {what} is a {tag}; convert it to PKCS#8 with \
             `openssl pkcs8 -topk8 -nocrypt -in KEY -out KEY.p8`"
        )),
        tag => Err(format!(
            "key: expected {what} (BEGIN PRIVATE KEY), found BEGIN {tag}"
        )),
    }
}

/// The key must be the certificate's own (the first certificate in the
/// file is the client's), or Apple would refuse the first push.
fn expect_pair(cert_blocks: &[pem::Pem], key_pem: &[u8]) -> Result<(), String> {
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
    let chain = cert_blocks
        .iter()
        .filter(|b| b.tag() == "CERTIFICATE")
        .map(|b| CertificateDer::from(b.contents().to_vec()))
        .collect();
    let key = pem::parse(key_pem).map_err(|e| format!("key: not PEM ({e})"))?;
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.contents().to_vec()));
    let provider = rustls::crypto::ring::default_provider();
    match rustls::sign::CertifiedKey::from_der(chain, key, &provider) {
        Ok(_) => Ok(()),
        Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) => {
            Err("key: does not match the certificate (it is the private key of another one)".into())
        }
        Err(e) => Err(format!("key: the certificate and key are unusable ({e})")),
    }
}

#[async_trait]
impl ApnsSender for A2Sender {
    async fn send(&self, request: &ApnsRequest) -> Result<ApnsResponse, TransportError> {
        let payload = A2Payload::new(request)?;
        match self.client.send(payload).await {
            Ok(response) => Ok(ApnsResponse {
                status: response.code,
                reason: None,
            }),
            Err(a2::Error::ResponseError(response)) => Ok(ApnsResponse {
                status: response.code,
                // a2's reason variants are spelt as Apple spells the reasons.
                reason: response.error.map(|body| format!("{:?}", body.reason)),
            }),
            Err(a2::Error::RequestTimeout(_)) => Err(TransportError::Timeout),
            Err(e @ (a2::Error::ConnectionError(_) | a2::Error::ClientError(_))) => {
                Err(TransportError::Connect(e.to_string()))
            }
            Err(e) => Err(TransportError::Request(e.to_string())),
        }
    }
}

/// An [`ApnsRequest`] in the form a2 sends: our JSON body as is.
#[derive(Debug)]
struct A2Payload<'a> {
    device_token: &'a str,
    options: NotificationOptions<'a>,
    json: Box<RawValue>,
}

impl<'a> A2Payload<'a> {
    fn new(request: &'a ApnsRequest) -> Result<A2Payload<'a>, TransportError> {
        let ApnsHeaders {
            topic,
            priority,
            expiration,
            collapse_id,
            push_type,
        } = &request.headers;
        let collapse_id = collapse_id
            .as_deref()
            .map(CollapseId::new)
            .transpose()
            .map_err(|e| TransportError::Request(e.to_string()))?;
        Ok(A2Payload {
            device_token: &request.device_token,
            options: NotificationOptions {
                apns_id: None,
                apns_push_type: Some(if *push_type == ApnsHeaders::BACKGROUND {
                    PushType::Background
                } else {
                    PushType::Alert
                }),
                apns_expiration: Some(*expiration),
                apns_priority: Some(if *priority == 5 {
                    Priority::Normal
                } else {
                    Priority::High
                }),
                apns_topic: Some(topic),
                apns_collapse_id: collapse_id,
            },
            json: RawValue::from_string(request.payload.clone())
                .map_err(|e| TransportError::Request(e.to_string()))?,
        })
    }
}

impl Serialize for A2Payload<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.json.serialize(serializer)
    }
}

impl PayloadLike for A2Payload<'_> {
    fn get_device_token(&self) -> &str {
        self.device_token
    }

    fn get_options(&self) -> &NotificationOptions<'_> {
        &self.options
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::sync::Arc;

    use super::*;
    use crate::ApnsRouter;
    use crate::settings::ApnsSettings;

    /// A file made by `certs/make-apns.sh`.
    fn cert_file(name: &str) -> String {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../certs")
            .join(name);
        path.display().to_string()
    }

    fn channel(fields: serde_json::Value) -> ApnsChannel {
        let mut channel = serde_json::json!({"topic": "org.example.autopush.test"});
        if let (Some(c), Some(f)) = (channel.as_object_mut(), fields.as_object()) {
            c.extend(f.clone());
        }
        serde_json::from_value(channel).unwrap()
    }

    fn token(key: &str) -> ApnsChannel {
        channel(serde_json::json!({"key": key, "key_id": "KEYID12345", "team_id": "TEAM123456"}))
    }

    fn certificate(cert: &str, key: &str) -> ApnsChannel {
        channel(serde_json::json!({"cert": cert, "key": key}))
    }

    #[test]
    fn clients_build_from_the_test_key_material() {
        let p8 = cert_file("apns-token-key.p8");
        A2Sender::new(&token(&p8)).unwrap();
        let inline = std::fs::read_to_string(&p8).unwrap();
        A2Sender::new(&token(&inline)).unwrap();
        let (cert, key) = (cert_file("apns-cert.pem"), cert_file("apns-cert-key.pem"));
        A2Sender::new(&certificate(&cert, &key)).unwrap();
        let inline_cert = std::fs::read_to_string(&cert).unwrap();
        let inline_key = std::fs::read_to_string(&key).unwrap();
        A2Sender::new(&certificate(&inline_cert, &inline_key)).unwrap();
    }

    #[test]
    fn bad_key_material_is_an_error_naming_the_field() {
        let err = |channel: ApnsChannel| A2Sender::new(&channel).err().unwrap();
        let missing = cert_file("no-such-file.p8");
        assert!(err(token(&missing)).starts_with("key: cannot read"));
        // An RSA key cannot sign Apple's ES256 provider tokens.
        assert!(err(token(&cert_file("apns-cert-key.pem"))).contains("P-256"));
        assert!(err(token(&cert_file("apns-cert.pem"))).contains("found BEGIN CERTIFICATE"));
        assert!(err(token("-----BEGIN PRIVATE KEY-----\nnot base64\n")).starts_with("key:"));
        let (cert, key) = (cert_file("apns-cert.pem"), cert_file("apns-cert-key.pem"));
        let pkcs1 = cert_file("apns-cert-key-pkcs1.pem");
        assert!(err(certificate(&cert, &pkcs1)).contains("openssl pkcs8 -topk8"));
        assert!(err(certificate(&key, &key)).starts_with("cert: no PEM certificate"));
        assert!(err(certificate(&missing, &key)).starts_with("cert: cannot read"));
        let other = cert_file("apns-other-key.pem");
        assert!(err(certificate(&cert, &other)).starts_with("key: does not match the certificate"));
        // The certificate given as its own key.
        assert!(err(certificate(&cert, &cert)).starts_with("key:"));
    }

    #[test]
    fn the_router_names_the_channel_at_fault() {
        let settings = ApnsSettings::from_json(
            &serde_json::json!({
                "firefox": {"key": cert_file("apns-token-key.p8"), "key_id": "K", "team_id": "T", "topic": "t"},
                "beta": {"cert": cert_file("apns-cert.pem"), "key": cert_file("missing.pem"), "topic": "t"},
            })
            .to_string(),
        )
        .unwrap();
        let err = ApnsRouter::new(&settings, &Default::default())
            .err()
            .unwrap();
        assert!(
            err.starts_with("apns channel \"beta\": key: cannot read"),
            "{err}"
        );
    }

    #[test]
    fn a_reload_keeps_what_is_unchanged_and_what_it_cannot_build() {
        let dir = std::env::temp_dir().join(format!("apns-reload-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p8 = dir.join("key.p8");
        let key = std::fs::read_to_string(cert_file("apns-token-key.p8")).unwrap();
        std::fs::write(&p8, &key).unwrap();
        let firefox = token(&p8.display().to_string());
        let beta = certificate(&cert_file("apns-cert.pem"), &cert_file("apns-cert-key.pem"));
        let limits = Default::default();
        let settings = ApnsSettings {
            channels: [
                ("firefox".into(), firefox.clone()),
                ("beta".into(), beta.clone()),
            ]
            .into(),
        };
        let before = ApnsRouter::new(&settings, &limits).unwrap();

        let mut renamed = beta.clone();
        renamed.topic = "org.example.renamed".into();
        let missing = token(&cert_file("missing.p8"));
        let offered = [
            ("firefox".to_owned(), Ok(firefox.clone())),
            ("beta".to_owned(), Ok(renamed)),
            ("nightly".to_owned(), Ok(missing.clone())),
        ]
        .into();
        let (after, refused) = before.reloaded(&offered, &limits);
        let same = |a: &ApnsRouter, b: &ApnsRouter, name: &str| {
            Arc::ptr_eq(&a.channels[name], &b.channels[name])
        };
        assert!(same(&before, &after, "firefox"), "unchanged: kept");
        assert_eq!(after.channels["beta"].topic, "org.example.renamed");
        assert!(
            !after.channels.contains_key("nightly"),
            "not built: not served"
        );
        assert_eq!(refused.len(), 1);
        assert!(
            refused[0].0 == "nightly" && refused[0].1.contains("cannot read"),
            "{refused:?}"
        );

        // A key rewritten in place is a change; new settings that cannot be
        // built leave the channel as it was; a channel not offered is gone.
        std::fs::write(&p8, format!("{key}\n")).unwrap();
        let offered = [("firefox".to_owned(), Ok(firefox.clone()))].into();
        let (rotated, refused) = after.reloaded(&offered, &limits);
        assert!(refused.is_empty(), "{refused:?}");
        assert!(
            !same(&after, &rotated, "firefox"),
            "a new key: a new client"
        );
        assert_eq!(rotated.names().collect::<Vec<_>>(), ["firefox"]);
        let offered = [("firefox".to_owned(), Ok(missing))].into();
        let (kept, refused) = rotated.reloaded(&offered, &limits);
        assert!(same(&rotated, &kept, "firefox"), "{refused:?}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn our_json_goes_out_unchanged_with_the_headers_as_options() {
        let request = ApnsRequest {
            device_token: "ab".repeat(32),
            headers: ApnsHeaders {
                topic: "org.example.app".into(),
                priority: 5,
                expiration: 1234,
                collapse_id: Some("news".into()),
                push_type: ApnsHeaders::ALERT,
            },
            payload: r#"{"aps":{"mutable-content":1},"chid":"c","ver":"v"}"#.into(),
        };
        let payload = A2Payload::new(&request).unwrap();
        assert_eq!(payload.to_json_string().unwrap(), request.payload);
        assert_eq!(payload.get_device_token(), request.device_token);
        let options = payload.get_options();
        assert_eq!(options.apns_topic, Some("org.example.app"));
        assert_eq!(options.apns_expiration, Some(1234));
        assert!(matches!(options.apns_priority, Some(Priority::Normal)));
        assert_eq!(options.apns_collapse_id.as_ref().unwrap().value, "news");
    }
}

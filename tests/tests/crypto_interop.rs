//! autopush-crypto (what `autopush check` encrypts, signs and decrypts with)
//! against an independent implementation: pywebpush and http_ece. Each side
//! decrypts what the other encrypted, in both encodings.

use autopush_crypto::ece::{self, Encrypted, SubscriptionKeys};
use autopush_crypto::{b64, unb64};
use autopush_tests::*;
use serde_json::json;

const SIZES: [usize; 4] = [1, 100, 4079, MAX_PLAINTEXT];

fn py_keys(keys: &SubscriptionKeys) -> Keys {
    Keys {
        private_key: b64(&keys.private_bytes()),
        p256dh: b64(keys.p256dh()),
        auth: b64(keys.auth()),
    }
}

fn ece_encoding(encoding: Encoding) -> ece::Encoding {
    match encoding {
        Encoding::Aes128Gcm => ece::Encoding::Aes128Gcm,
        Encoding::AesGcm => ece::Encoding::AesGcm,
    }
}

#[tokio::test]
async fn rust_decrypts_what_pywebpush_encrypts() {
    let keys = SubscriptionKeys::generate();
    for encoding in Encoding::ALL {
        for size in SIZES {
            let sent = py::encrypt(&py_keys(&keys), &Payload::Pattern(size), encoding).await;
            let message = Encrypted::from_notification(&json!({
                "data": sent.body,
                "headers": sent.headers,
            }))
            .unwrap_or_else(|e| panic!("{encoding:?} {size}: {e}"));
            let plaintext = keys
                .decrypt(&message)
                .unwrap_or_else(|e| panic!("{encoding:?} {size}: {e}"));
            assert_eq!(
                plaintext,
                data_pattern(size).as_bytes(),
                "{encoding:?} {size}"
            );
        }
    }
}

#[tokio::test]
async fn http_ece_decrypts_what_rust_encrypts() {
    let keys = Keys::generate().await;
    for encoding in Encoding::ALL {
        for size in SIZES {
            let plaintext = data_pattern(size);
            let sent = ece::encrypt(
                &unb64(&keys.p256dh).unwrap(),
                &unb64(&keys.auth).unwrap(),
                plaintext.as_bytes(),
                ece_encoding(encoding),
            )
            .unwrap();
            let notification = json!({
                "data": b64(&sent.body),
                "headers": {
                    "encoding": encoding.as_str(),
                    "encryption": sent.encryption,
                    "crypto_key": sent.crypto_key,
                },
            });
            let decrypted = py::decrypt(&keys, &notification).await;
            assert_eq!(decrypted.text, plaintext, "{encoding:?} {size}");
        }
    }
}

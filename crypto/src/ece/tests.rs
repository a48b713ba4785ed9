use serde_json::json;

use super::*;

fn d(text: &str) -> Vec<u8> {
    unb64(text).unwrap()
}

/// RFC 8188 §3.1: one record, no key id, the key used directly as IKM.
#[test]
fn rfc8188_single_record() {
    let body = d("I1BsxtFttlv3u_Oo94xnmwAAEAAA-NAVub2qFgBEuQKRapoZu-IxkIva3MEB1PD-ly8Thjg");
    let key = d("yqdlZ-tYemfogSmv7Ws5PQ");
    let header = Aes128GcmHeader::parse(&body).unwrap();
    assert_eq!(open_aes128gcm(&key, &header).unwrap(), b"I am the walrus");
    let salt = salt_bytes(&d("I1BsxtFttlv3u_Oo94xnmw")).unwrap();
    assert_eq!(
        seal_aes128gcm(&key, &salt, 4096, b"", b"I am the walrus"),
        body
    );
}

/// RFC 8188 §3.2: two 25-byte records with padding and key id "a1".
#[test]
fn rfc8188_multiple_records_with_padding() {
    let body = d(
        "uNCkWiNYzKTnBN9ji3-qWAAAABkCYTHOG8chz_gnvgOqdGYovxyjuqRyJFjEDyoF1Fvkj6hQPdPHI51OEUKEpgz3SsLWIqS_uA",
    );
    let header = Aes128GcmHeader::parse(&body).unwrap();
    assert_eq!((header.rs, header.keyid), (25, &b"a1"[..]));
    let key = d("BO3ZVPxUlnLORbVGMpbT1Q");
    assert_eq!(open_aes128gcm(&key, &header).unwrap(), b"I am the walrus");
}

const RFC8291_PLAINTEXT: &[u8] = b"When I grow up, I want to be a watermelon";
const RFC8291_BODY: &str = "DGv6ra1nlYgDCS1FRnbzlwAAEABBBP4z9KsN6nGRTbVYI_c7VJSPQTBtkgcy27mlmlMoZIIgDll6e3vCYLocInmYWAmS6TlzAC8wEqKK6PBru3jl7A_yl95bQpu6cVPTpK4Mqgkf1CXztLVBSt2Ks3oZwbuwXPXLWyouBWLVWGNWQexSgSxsj_Qulcy4a-fN";

fn rfc8291_keys() -> SubscriptionKeys {
    SubscriptionKeys::from_bytes(
        &d("q1dXpw3UpT5VOmu_cf_v6ih07Aems3njxI-JWgLcM94"),
        &d("BTBZMqHH6r4Tts7J_aSIgg"),
    )
    .unwrap()
}

/// RFC 8291 §5: the full example, both ways.
#[test]
fn rfc8291_example() {
    let ua = rfc8291_keys();
    assert_eq!(
        b64(ua.p256dh()),
        "BCVxsr7N_eNgVRqvHtD0zTZsEc6-VV-JvLexhqUzORcxaOzi6-AYWXvTBHm4bjyPjs7Vd8pZGH6SRpkNtoIAiw4"
    );
    let sender = SecretKey::from_slice(&d("yfWPiYE-n46HLnH0KqZOF1fJJU3MYrct3AELtAQ-oRw")).unwrap();
    let salt = salt_bytes(&d("DGv6ra1nlYgDCS1FRnbzlw")).unwrap();
    let sent = encrypt_with(
        &sender,
        salt,
        ua.p256dh(),
        ua.auth(),
        RFC8291_PLAINTEXT,
        Encoding::Aes128Gcm,
    )
    .unwrap();
    assert_eq!(b64(&sent.body), RFC8291_BODY);
    assert_eq!(ua.decrypt(&sent).unwrap(), RFC8291_PLAINTEXT);
}

#[test]
fn round_trips_every_size_and_encoding() {
    let ua = SubscriptionKeys::generate();
    // 4094 and 8188 fill aesgcm records exactly; 4079 fills an aes128gcm one.
    for len in [0, 1, 41, 4079, 4080, 4094, 4096, 8188, 10_000] {
        let plaintext: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        for encoding in Encoding::ALL {
            let sent = encrypt(ua.p256dh(), ua.auth(), &plaintext, encoding).unwrap();
            let got = ua.decrypt(&sent);
            assert_eq!(got.as_deref(), Ok(&plaintext[..]), "{encoding:?} {len}");
        }
    }
}

#[test]
fn aes128gcm_is_one_record_with_its_key_in_the_header() {
    let ua = SubscriptionKeys::generate();
    let sent = encrypt(ua.p256dh(), ua.auth(), &[7; 4096], Encoding::Aes128Gcm).unwrap();
    let header = Aes128GcmHeader::parse(&sent.body).unwrap();
    assert_eq!(header.keyid.len(), 65);
    assert_eq!(header.records.len(), 4096 + 1 + TAG_BYTES);
    assert!(header.rs as usize > header.records.len());
    assert_eq!(
        sent.http_headers(),
        [("content-encoding", "aes128gcm".into())]
    );
}

#[test]
fn aesgcm_carries_salt_and_key_in_headers() {
    let ua = SubscriptionKeys::generate();
    let sent = encrypt(ua.p256dh(), ua.auth(), b"hi", Encoding::AesGcm).unwrap();
    let names: Vec<_> = sent.http_headers().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["content-encoding", "encryption", "crypto-key"]);
    assert_eq!(sent.body.len(), 2 + 2 + TAG_BYTES);
    // Receivers find the parameters among others, quoted or not.
    let mut reshaped = sent.clone();
    reshaped.encryption = Some(format!(
        "keyid=p256dh; {}; rs=4096",
        sent.encryption.as_deref().unwrap()
    ));
    reshaped.crypto_key = Some(format!(
        "keyid=\"p256dh\";{}, p256ecdsa=BAAA",
        sent.crypto_key.as_deref().unwrap().replace("dh=", "dh=\"") + "\""
    ));
    assert_eq!(ua.decrypt(&reshaped).unwrap(), b"hi");
}

#[test]
fn other_keys_or_altered_bytes_do_not_decrypt() {
    let ua = SubscriptionKeys::generate();
    let other = SubscriptionKeys::generate();
    for encoding in Encoding::ALL {
        let sent = encrypt(ua.p256dh(), ua.auth(), b"secret", encoding).unwrap();
        assert_eq!(other.decrypt(&sent), Err(EceError::Decrypt(0)));
        let mut altered = sent.clone();
        *altered.body.last_mut().unwrap() ^= 1;
        assert_eq!(ua.decrypt(&altered), Err(EceError::Decrypt(0)));
        let mut cut = sent.clone();
        cut.body.truncate(cut.body.len() - 1);
        assert!(ua.decrypt(&cut).is_err());
    }
}

#[test]
fn missing_or_broken_parts_are_named() {
    let ua = SubscriptionKeys::generate();
    let sent = encrypt(ua.p256dh(), ua.auth(), b"x", Encoding::AesGcm).unwrap();
    let without = |f: fn(&mut Encrypted)| {
        let mut m = sent.clone();
        f(&mut m);
        ua.decrypt(&m).unwrap_err().to_string()
    };
    assert_eq!(
        without(|m| m.encryption = None),
        "missing the Encryption header"
    );
    assert_eq!(
        without(|m| m.encryption = Some("rs=4096".into())),
        "missing salt= in the Encryption header"
    );
    assert_eq!(
        without(|m| m.crypto_key = Some("p256ecdsa=BAAA".into())),
        "missing dh= in the Crypto-Key header"
    );
    assert_eq!(
        without(|m| m.crypto_key = Some("dh=AAAA".into())),
        "the dh key is not an uncompressed P-256 public key"
    );
    let short = Encrypted {
        encoding: Encoding::Aes128Gcm,
        body: vec![0; 20],
        encryption: None,
        crypto_key: None,
    };
    assert_eq!(ua.decrypt(&short), Err(EceError::ShortHeader(20)));
    assert_eq!(
        encrypt(&[4; 10], ua.auth(), b"", Encoding::AesGcm),
        Err(EceError::PublicKey("p256dh"))
    );
    assert_eq!(
        encrypt(ua.p256dh(), &[0; 8], b"", Encoding::AesGcm),
        Err(EceError::AuthSecret(8))
    );
}

#[test]
fn reads_a_websocket_notification() {
    let ua = SubscriptionKeys::generate();
    let sent = encrypt(ua.p256dh(), ua.auth(), b"over the socket", Encoding::AesGcm).unwrap();
    let notification = json!({
        "messageType": "notification",
        "data": b64(&sent.body),
        "headers": {
            "encoding": "aesgcm",
            "encryption": sent.encryption,
            "crypto_key": sent.crypto_key,
        },
    });
    let got = Encrypted::from_notification(&notification).unwrap();
    assert_eq!(got, sent);
    assert_eq!(ua.decrypt(&got).unwrap(), b"over the socket");
    assert_eq!(
        Encrypted::from_notification(&json!({"messageType": "notification"})),
        Err(EceError::Missing("data in the notification"))
    );
}

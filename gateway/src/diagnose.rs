//! `autopush diagnose URL`: what an endpoint URL points at.
//!
//! Decodes the token, then shows the user record from the store. The
//! embedded store belongs to the running server, so when it is held the
//! record is asked of that server's internal router API instead.

use serde_json::{Value, json};
use uuid::Uuid;

use crate::app::open_storage;
use crate::keys;
use crate::settings::{Db, Settings};

pub async fn run(settings: &Settings, url: &str) -> Result<Value, String> {
    let path = url
        .split("://")
        .nth(1)
        .and_then(|rest| rest.find('/').map(|i| &rest[i..]))
        .unwrap_or(url);
    let mut parts = path.trim_matches('/').split('/');
    let (Some("wpush"), Some(version), Some(token)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err(format!(
            "{url} is not a push endpoint (expected .../wpush/v1/TOKEN or .../wpush/v2/TOKEN)"
        ));
    };
    let data_dir = match &settings.db {
        Db::Embedded(dir) => Some(dir.as_path()),
        Db::DynamoDb => None,
    };
    if let Some(dir) = data_dir.filter(|d| !d.is_dir()) {
        return Err(format!(
            "no data directory at {} (give --db)",
            dir.display()
        ));
    }
    let keys = keys::resolve(
        keys::Key::Crypto,
        settings.crypto_key.as_deref(),
        data_dir,
        keys::Missing::Fail,
    )?;
    let crypto = autopush_common::endpoint::EndpointCrypto::new(&keys, &settings.endpoint_url)?;
    let info = crypto
        .parse_token(version, token)
        .map_err(|_| "the token does not decrypt with the configured key(s)".to_string())?;

    let mut out = json!({
        "endpoint_version": version,
        "uaid": info.uaid.simple().to_string(),
        "channel_id": info.channel_id.to_string(),
        "restricted_to_key_hash": info.key_hash.map(|h| h.iter().map(|b| format!("{b:02x}")).collect::<String>()),
    });
    out["user"] = match lookup(settings, &info.uaid).await {
        Ok(Some(user)) => {
            let subscribed = user["channels"].as_array().is_some_and(|c| {
                c.iter()
                    .any(|c| c.as_str() == Some(&info.channel_id.to_string()))
            });
            out["channel_subscribed"] = json!(subscribed);
            user
        }
        Ok(None) => json!(null),
        Err(e) => json!({"error": e}),
    };
    Ok(out)
}

async fn lookup(settings: &Settings, uaid: &Uuid) -> Result<Option<Value>, String> {
    match open_storage(settings).await {
        Ok(storage) => autopush_connection::router_api::describe_user(storage.as_ref(), uaid)
            .await
            .map_err(|e| e.to_string()),
        Err(store_error) => {
            let url = format!("{}/user/{}", settings.node_url, uaid.simple());
            let response = reqwest::get(&url).await.map_err(|e| {
                format!("{store_error}; and the running node at {url} did not answer: {e}")
            })?;
            match response.status().as_u16() {
                404 => Ok(None),
                200 => response.json().await.map(Some).map_err(|e| e.to_string()),
                status => Err(format!("{url} answered {status}")),
            }
        }
    }
}

//! `autopush diagnose URL`: what an endpoint URL points at.
//!
//! Decodes the token, then shows the user record from the store. It reads
//! the same settings as the service (flags, `AUTOPUSH_*`, `--config`), so
//! it finds the same data directory and keys; the report and every error
//! name the directory it looked in. The embedded store belongs to the
//! running server, so when it is held the record is asked of that server's
//! internal router API instead (signed with the router key, from the
//! settings or that server's data directory).

use std::path::Path;

use autopush_common::node_auth::NodeKeys;
use autopush_webpush::NodeClient;
use http::Method;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::app::open_storage;
use crate::keys;
use crate::settings::{Db, Settings};

/// How to point `diagnose` at the right store, for its error messages:
/// where the data directory came from, or (when it is the default) how to
/// name the service's.
fn point_elsewhere(settings: &Settings) -> String {
    match settings.sources.get("db") {
        None => "Give the service's data directory with --db DIR (or AUTOPUSH_DB), or the \
                 service's own settings file with --config FILE"
            .into(),
        Some(_) => format!("(the data directory is {})", settings.sources.name("db")),
    }
}

/// What `diagnose` found: the report, and why the user could not be read,
/// if it could not (the report then holds the token's side only).
pub struct Report {
    pub report: Value,
    pub user_error: Option<String>,
}

pub async fn run(settings: &Settings, url: &str) -> Result<Report, String> {
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
        Db::Embedded(dir) => Some(std::path::absolute(dir).unwrap_or_else(|_| dir.clone())),
        Db::DynamoDb | Db::Bigtable(_) | Db::Postgres(_) => None,
    };
    if let Some(dir) = &data_dir {
        let elsewhere = point_elsewhere(settings);
        match std::fs::metadata(dir) {
            Ok(meta) if meta.is_dir() => {}
            Ok(_) => return Err(format!("{} is not a directory {elsewhere}", dir.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(format!(
                    "no data directory at {} {elsewhere}",
                    dir.display()
                ));
            }
            Err(e) => {
                return Err(format!(
                    "cannot use the data directory {}: {e} {elsewhere}; run this as root \
                     or as the service's user",
                    dir.display()
                ));
            }
        }
    }
    let source = settings.sources.name("crypto_key");
    let keys = keys::resolve(
        keys::Key::Crypto,
        settings.crypto_key.as_ref().map(|k| (k, source.as_str())),
        data_dir.as_deref(),
        keys::Missing::Fail,
    )
    .map_err(|e| format!("{e} {}", point_elsewhere(settings)))?;
    let crypto = autopush_common::endpoint::EndpointCrypto::new(&keys, &settings.endpoint_url)?;
    let info = crypto.parse_token(version, token).map_err(|_| {
        match (&settings.crypto_key, &data_dir) {
            (None, Some(dir)) => format!(
                "the token does not decrypt with the crypto key kept in {}: is that the data \
                 directory of the service that issued it? {}",
                dir.display(),
                point_elsewhere(settings)
            ),
            _ => format!(
                "the token does not decrypt with the crypto key of {}",
                settings.sources.name("crypto_key")
            ),
        }
    })?;

    let mut out = json!({
        "data_dir": data_dir.as_ref().map(|d| d.display().to_string()),
        "endpoint_version": version,
        "uaid": info.uaid.simple().to_string(),
        "channel_id": info.channel_id.to_string(),
        "restricted_to_key_hash": info.key_hash.map(|h| h.iter().map(|b| format!("{b:02x}")).collect::<String>()),
    });
    let mut user_error = None;
    out["user"] = match lookup(settings, data_dir.as_deref(), &info.uaid).await {
        Ok(Some(user)) => {
            let subscribed = user["channels"].as_array().is_some_and(|c| {
                c.iter()
                    .any(|c| c.as_str() == Some(&info.channel_id.to_string()))
            });
            out["channel_subscribed"] = json!(subscribed);
            user
        }
        Ok(None) => json!(null),
        Err(e) => {
            user_error = Some(e.clone());
            json!({"error": e})
        }
    };
    Ok(Report {
        report: out,
        user_error,
    })
}

async fn lookup(
    settings: &Settings,
    data_dir: Option<&Path>,
    uaid: &Uuid,
) -> Result<Option<Value>, String> {
    match open_storage(settings).await {
        Ok(storage) => autopush_connection::router_api::describe_user(storage.as_ref(), uaid)
            .await
            .map_err(|e| e.to_string()),
        Err(store_error) => {
            let source = settings.sources.name("router_key");
            let keys = keys::resolve(
                keys::Key::Router,
                settings.router_key.as_ref().map(|k| (k, source.as_str())),
                data_dir,
                keys::Missing::Fail,
            )?;
            let nodes = NodeClient::new(NodeKeys::new(&keys)?);
            let node = &settings.node_url;
            let path = format!("/user/{}", uaid.simple());
            let url = format!("{node}{path}");
            let response = nodes
                .call(Method::GET, node, &path, Vec::new())
                .await
                .map_err(|e| {
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

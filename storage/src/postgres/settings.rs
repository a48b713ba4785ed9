//! `--db postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE` and `db_settings`
//! in autopush-rs's shape (`schema`, `router_table`, `message_table`,
//! `meta_table`, `reliability_table`, `max_router_ttl`), so an operator's
//! settings carry over; `receipt_table` and `pool_size` are ours.

use std::time::Duration;

use serde_json::{Map, Value};

use super::tls::TlsSettings;

/// autopush-rs's `MAX_ROUTER_TTL_SECS`: the `expiry` it gives a router row.
const MAX_ROUTER_TTL: u64 = 60 * 86_400;
/// Connections per node unless `pool_size` says otherwise.
pub const DEFAULT_POOL_SIZE: usize = 16;

#[derive(Clone, Debug, PartialEq)]
pub struct PostgresSettings {
    /// The parsed DSN (its `Debug` hides the password).
    pub config: tokio_postgres::Config,
    /// The DSN's `sslmode` and `sslrootcert`.
    pub tls: TlsSettings,
    /// The schema the tables are in; `None`: the connection's search path.
    pub schema: Option<String>,
    pub router_table: String,
    pub message_table: String,
    pub meta_table: String,
    pub reliability_table: String,
    /// Our own table of receipts, which autopush-rs never reads.
    pub receipt_table: String,
    /// Seconds written as a router row's `expiry` past its last write.
    pub max_router_ttl: u64,
    /// Most connections this node opens.
    pub pool_size: usize,
}

impl PostgresSettings {
    /// Settings from a `postgres://` or `postgresql://` DSN (libpq's URL
    /// form: several hosts, `sslmode` and `sslrootcert` (see [`super::tls`]),
    /// `target_session_attrs`, `connect_timeout`) and the `db_settings` JSON. Errors never repeat
    /// the DSN: it may hold a password.
    pub fn parse(dsn: &str, db_settings: Option<&str>) -> Result<Self, String> {
        if !(dsn.starts_with("postgres://") || dsn.starts_with("postgresql://")) {
            return Err(
                "a PostgreSQL --db is postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE".into(),
            );
        }
        let (dsn, tls) = TlsSettings::split_dsn(dsn)?;
        let mut config: tokio_postgres::Config = dsn
            .parse()
            .map_err(|e| format!("--db postgres://...: {e}"))?;
        config.ssl_mode(tls.tokio_postgres_mode());
        if config.get_hosts().is_empty() {
            return Err("--db postgres://...: name a host (USER@HOST/DATABASE)".into());
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(Duration::from_secs(5));
        }
        let mut settings = PostgresSettings {
            config,
            tls,
            schema: None,
            router_table: "router".into(),
            message_table: "message".into(),
            meta_table: "meta".into(),
            reliability_table: "reliability".into(),
            receipt_table: "receipt".into(),
            max_router_ttl: MAX_ROUTER_TTL,
            pool_size: DEFAULT_POOL_SIZE,
        };
        let Some(text) = db_settings.filter(|t| !t.trim().is_empty()) else {
            return Ok(settings);
        };
        let map: Map<String, Value> = serde_json::from_str(text)
            .map_err(|e| format!("db_settings is not a JSON object: {e}"))?;
        for (key, value) in map {
            let name = |v: &Value| match v.as_str() {
                Some(s) if is_identifier(s) => Ok(s.to_owned()),
                _ => Err(format!(
                    "db_settings {key} must be a name of letters, digits and _ (not starting with a digit), got {v}"
                )),
            };
            let count = |v: &Value| {
                v.as_u64()
                    .ok_or_else(|| format!("db_settings {key} must be a whole number, got {v}"))
            };
            match key.as_str() {
                "schema" if value.is_null() => settings.schema = None,
                "schema" => settings.schema = Some(name(&value)?),
                "router_table" => settings.router_table = name(&value)?,
                "message_table" => settings.message_table = name(&value)?,
                "meta_table" => settings.meta_table = name(&value)?,
                "reliability_table" => settings.reliability_table = name(&value)?,
                "receipt_table" => settings.receipt_table = name(&value)?,
                "max_router_ttl" => settings.max_router_ttl = count(&value)?,
                "pool_size" => match count(&value)? {
                    0 => return Err("db_settings pool_size must be at least 1".into()),
                    n => settings.pool_size = n as usize,
                },
                other => {
                    return Err(format!(
                        "db_settings: unknown key {other:?} for PostgreSQL (schema, router_table, \
                         message_table, meta_table, reliability_table, receipt_table, max_router_ttl, pool_size)"
                    ));
                }
            }
        }
        Ok(settings)
    }

    /// `table` as SQL names it: qualified by the schema if one is set.
    pub fn qualified(&self, table: &str) -> String {
        match &self.schema {
            Some(schema) => format!("{schema}.{table}"),
            None => table.to_owned(),
        }
    }
}

/// A name safe to put in SQL as it is: table and schema names come from
/// settings, and SQL has no parameters for them.
fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && s.len() <= 63
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn autopush_rs_settings_carry_over() {
        let s = PostgresSettings::parse(
            "postgres://push:secret@db1:5433,db2/autopush?target_session_attrs=read-write",
            Some(r#"{"schema":"autopush","router_table":"r","message_table":"m","meta_table":"c","reliability_table":"rel","pool_size":4}"#),
        )
        .unwrap();
        assert_eq!(s.config.get_hosts().len(), 2);
        assert_eq!(s.config.get_ports(), [5433, 5432]);
        assert_eq!(
            s.config.get_target_session_attrs(),
            tokio_postgres::config::TargetSessionAttrs::ReadWrite
        );
        assert_eq!(s.qualified(&s.router_table), "autopush.r");
        assert_eq!(s.pool_size, 4);
        assert!(!format!("{s:?}").contains("secret"));
        let d = PostgresSettings::parse("postgresql://u@h/d", None).unwrap();
        assert_eq!(d.qualified(&d.message_table), "message");
    }

    #[test]
    fn bad_settings_fail_loudly_without_the_password() {
        for (dsn, settings, says) in [
            (
                "postgres://u:pw@h/d",
                Some(r#"{"router_table":"a;drop"}"#),
                "router_table",
            ),
            (
                "postgres://u:pw@h/d",
                Some(r#"{"table_name":"x"}"#),
                "unknown key",
            ),
            (
                "postgres://u:pw@h/d",
                Some(r#"{"pool_size":0}"#),
                "pool_size",
            ),
            ("postgres://u:pw@h:notaport/d", None, "--db"),
        ] {
            let e = PostgresSettings::parse(dsn, settings).unwrap_err();
            assert!(e.contains(says) && !e.contains("pw"), "{e}");
        }
    }
}

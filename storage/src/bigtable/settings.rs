//! `--db grpc://HOST:PORT` (or `--db bigtable`) and `db_settings` in
//! autopush-rs's shapes, so an operator's settings carry over.

use serde_json::{Map, Value};

use super::row::Families;

/// Google's Bigtable endpoint, when the DSN names none.
const GOOGLE_ENDPOINT: &str = "bigtable.googleapis.com:443";

/// autopush-rs `db_settings` keys about its own connection pool and
/// timeouts: accepted, so its settings carry over, and not used (our
/// deadlines are the storage layer's).
const IGNORED_KEYS: &[&str] = &[
    "database_pool_max_size",
    "database_pool_create_timeout",
    "database_pool_wait_timeout",
    "database_pool_connection_ttl",
    "database_pool_max_idle",
    "grpc_channel_count",
    "grpc_connect_timeout",
    "grpc_point_attempt_timeout",
    "grpc_scan_attempt_timeout",
    "grpc_point_total_timeout",
    "grpc_scan_total_timeout",
    "route_to_leader",
    "retry_count",
    "max_router_ttl",
];

#[derive(Clone, Debug, PartialEq)]
pub struct BigtableSettings {
    /// `host:port` of the data and admin APIs.
    pub endpoint: String,
    /// Plain HTTP/2 without credentials: `BIGTABLE_EMULATOR_HOST` is set,
    /// or the DSN names this machine.
    pub emulator: bool,
    /// `projects/{project}/instances/{instance}/tables/{table}`.
    pub table_name: String,
    pub app_profile_id: String,
    pub families: Families,
    /// autopush-rs keys given and not used, to say so at start-up.
    pub ignored: Vec<String>,
}

impl BigtableSettings {
    /// Settings from a DSN (`grpc://HOST:PORT`, or `bigtable` for Google's
    /// endpoint), the `db_settings` JSON and `BIGTABLE_EMULATOR_HOST`
    /// (which, as for Google's own clients, wins over the DSN's host).
    pub fn parse(
        dsn: &str,
        db_settings: Option<&str>,
        emulator_host: Option<&str>,
    ) -> Result<Self, String> {
        let dsn_endpoint = match dsn {
            "bigtable" => GOOGLE_ENDPOINT.to_owned(),
            dsn => dsn
                .strip_prefix("grpc://")
                .map(|e| e.trim_end_matches('/').to_owned())
                .filter(|e| !e.is_empty() && !e.contains('/'))
                .ok_or_else(|| {
                    format!("--db {dsn:?}: a Bigtable DSN is grpc://HOST:PORT (or `bigtable`)")
                })?,
        };
        let (endpoint, emulator) = match emulator_host.filter(|h| !h.is_empty()) {
            Some(host) => (host.to_owned(), true),
            None => {
                let host = dsn_endpoint
                    .rsplit_once(':')
                    .map_or(&*dsn_endpoint, |h| h.0);
                let local = ["localhost", "127.0.0.1", "[::1]"].contains(&host);
                (dsn_endpoint.clone(), local)
            }
        };
        let endpoint = match endpoint.contains(':') {
            true => endpoint,
            false => format!("{endpoint}:443"),
        };
        let mut map: Map<String, Value> = match db_settings {
            Some(json) => serde_json::from_str(json)
                .map_err(|e| format!("db_settings is not a JSON object: {e}"))?,
            None => Map::new(),
        };
        let mut text = |key: &str| -> Result<Option<String>, String> {
            match map.remove(key) {
                None => Ok(None),
                Some(Value::String(s)) if !s.is_empty() => Ok(Some(s)),
                Some(other) => Err(format!(
                    "db_settings: {key} must be a non-empty string, got {other}"
                )),
            }
        };
        let table_name = text("table_name")?.ok_or(
            "--db bigtable needs db_settings with table_name \
             (projects/PROJECT/instances/INSTANCE/tables/TABLE)",
        )?;
        let parts: Vec<&str> = table_name.split('/').collect();
        let valid = parts.len() == 6
            && parts[0] == "projects"
            && parts[2] == "instances"
            && parts[4] == "tables"
            && [parts[1], parts[3], parts[5]].iter().all(|p| !p.is_empty());
        if !valid {
            return Err(format!(
                "db_settings: table_name {table_name:?} is not projects/PROJECT/instances/INSTANCE/tables/TABLE"
            ));
        }
        let defaults = Families::default();
        let families = Families {
            router: text("router_family")?.unwrap_or(defaults.router),
            message: text("message_family")?.unwrap_or(defaults.message),
            message_topic: text("message_topic_family")?.unwrap_or(defaults.message_topic),
        };
        let app_profile_id = text("app_profile_id")?.unwrap_or_else(|| "default".into());
        let mut ignored = Vec::new();
        for key in map.keys() {
            match IGNORED_KEYS.contains(&key.as_str()) {
                true => ignored.push(key.clone()),
                false => return Err(format!("db_settings: unknown key {key:?}")),
            }
        }
        Ok(BigtableSettings {
            endpoint,
            emulator,
            table_name,
            app_profile_id,
            families,
            ignored,
        })
    }

    /// `projects/{project}/instances/{instance}`.
    pub fn instance_name(&self) -> &str {
        self.table_name
            .rsplit_once("/tables/")
            .map_or(&*self.table_name, |(instance, _)| instance)
    }

    /// The table's own name.
    pub fn table_id(&self) -> &str {
        self.table_name
            .rsplit_once("/tables/")
            .map_or(&*self.table_name, |(_, table)| table)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = r#"{"table_name": "projects/p/instances/i/tables/autopush"}"#;

    #[test]
    fn autopush_rs_shapes_are_read() {
        let s = BigtableSettings::parse("grpc://bigtable.googleapis.com:443", Some(TABLE), None)
            .unwrap();
        assert_eq!(s.endpoint, "bigtable.googleapis.com:443");
        assert!(!s.emulator);
        assert_eq!(s.app_profile_id, "default");
        assert_eq!(s.families, Families::default());
        assert_eq!(s.instance_name(), "projects/p/instances/i");
        assert_eq!(s.table_id(), "autopush");

        let s = BigtableSettings::parse(
            "grpc://localhost:8086",
            Some(
                r#"{"table_name": "projects/p/instances/i/tables/t", "app_profile_id": "push",
                    "router_family": "r", "message_family": "m", "message_topic_family": "mt",
                    "retry_count": 3}"#,
            ),
            None,
        )
        .unwrap();
        assert!(s.emulator);
        assert_eq!(s.app_profile_id, "push");
        assert_eq!(s.families.message_topic, "mt");
        assert_eq!(s.ignored, ["retry_count"]);
    }

    #[test]
    fn the_emulator_variable_wins_over_the_dsn() {
        let s = BigtableSettings::parse("bigtable", Some(TABLE), Some("127.0.0.1:9035")).unwrap();
        assert_eq!(s.endpoint, "127.0.0.1:9035");
        assert!(s.emulator);
    }

    #[test]
    fn wrong_settings_are_named() {
        let e = BigtableSettings::parse("grpc://h:1", None, None).unwrap_err();
        assert!(e.contains("table_name"), "{e}");
        let e = BigtableSettings::parse("http://h:1", Some(TABLE), None).unwrap_err();
        assert!(e.contains("grpc://HOST:PORT"), "{e}");
        let e = BigtableSettings::parse("grpc://h:1", Some(r#"{"table_name": "t"}"#), None)
            .unwrap_err();
        assert!(e.contains("projects/PROJECT"), "{e}");
        let e = BigtableSettings::parse(
            "grpc://h:1",
            Some(r#"{"table_name": "projects/p/instances/i/tables/t", "tabel": 1}"#),
            None,
        )
        .unwrap_err();
        assert!(e.contains("unknown key \"tabel\""), "{e}");
    }
}

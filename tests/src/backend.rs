//! The storage backends the binary runs on, for tests that must hold on
//! each: the embedded store, DynamoDB (on moto and on dynalite, which
//! speak its API differently enough to matter, see [`crate::dynamo`]),
//! Bigtable (Google's emulator, see [`crate::bigtable`]) and PostgreSQL (a
//! private cluster, see [`crate::postgres`]).

use std::sync::Arc;

use autopush_storage::Storage;
use autopush_storage::bigtable::{BigtableSettings, BigtableStore};
use autopush_storage::dynamodb::Tables;
use autopush_storage::postgres::{PostgresSettings, PostgresStore};

use crate::server::{Node, Server};
use crate::{bigtable, dynamo, postgres};

#[derive(Clone, Copy, Debug)]
pub enum Db {
    Embedded,
    /// DynamoDB on moto.
    Dynamo,
    /// DynamoDB on dynalite.
    Dynalite,
    Bigtable,
    Postgres,
}

/// A node on `db` (fresh tables for DynamoDB, a fresh table for Bigtable,
/// with keys the server would otherwise keep in its data dir) with extra
/// `args`. Receipts are off by default on Bigtable (autopush-rs cannot read
/// their rows): this turns them on unless `args` set a retention.
pub async fn node(db: Db, args: &[&str]) -> Node {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let key = autopush_common::endpoint::generate_key;
    let keys = || {
        [
            format!("--crypto-key={}", key()),
            format!("--auth-key={}", key()),
            format!("--router-key={}", key()),
        ]
    };
    match db {
        Db::Embedded => Node {
            args,
            ..Node::default()
        },
        Db::Dynamo | Db::Dynalite => {
            let tables = dynamo::tables();
            let endpoint = match db {
                Db::Dynalite => &dynamo::dynalite().await.endpoint,
                _ => &dynamo::local().await.endpoint,
            };
            dynamo::connect(endpoint, tables.clone())
                .await
                .create_tables()
                .await
                .expect("create tables");
            let mut shared = vec![
                format!("--router-table={}", tables.router),
                format!("--message-table={}", tables.message),
            ];
            shared.extend(keys());
            shared.extend(args);
            Node {
                db: Some("dynamodb".into()),
                env: dynamo::aws_env(endpoint)
                    .into_iter()
                    .map(|(k, v)| (k.to_owned(), v))
                    .collect(),
                args: shared,
                ..Node::default()
            }
        }
        Db::Bigtable => {
            let store = bigtable::fresh_store().await;
            let emulator = bigtable::local().await;
            let mut shared = vec![format!(
                "--db-settings={}",
                bigtable::db_settings(&store.settings().table_name)
            )];
            shared.extend(keys());
            if !args.iter().any(|a| a.starts_with("--receipt-retention")) {
                shared.push("--receipt-retention=86400".into());
            }
            shared.extend(args);
            Node {
                db: Some(emulator.dsn()),
                args: shared,
                ..Node::default()
            }
        }
        Db::Postgres => {
            let settings = postgres::fresh_settings().await;
            let schema = settings.schema.unwrap_or_default();
            let mut shared = vec![format!("--db-settings={}", postgres::db_settings(&schema))];
            shared.extend(keys());
            shared.extend(args);
            Node {
                db: Some(postgres::local().await.dsn.clone()),
                args: shared,
                ..Node::default()
            }
        }
    }
}

/// [`node`] on a shared store (DynamoDB, Bigtable, PostgreSQL), with the
/// store its tables are on, for a test that starts several nodes from the
/// node (they share its tables and keys) and looks at what they stored.
pub async fn shared(db: Db, args: &[&str]) -> (Node, Arc<dyn Storage>) {
    let node = node(db, args).await;
    let arg = |name: &str| {
        node.args
            .iter()
            .find_map(|a| a.strip_prefix(name))
            .unwrap_or_default()
            .to_owned()
    };
    let store: Arc<dyn Storage> = match db {
        Db::Embedded => panic!("the embedded store is one node's own, not shared"),
        Db::Dynamo | Db::Dynalite => {
            let endpoint = match db {
                Db::Dynalite => &dynamo::dynalite().await.endpoint,
                _ => &dynamo::local().await.endpoint,
            };
            let tables = Tables {
                router: arg("--router-table="),
                message: arg("--message-table="),
                ..dynamo::tables()
            };
            Arc::new(dynamo::connect(endpoint, tables).await)
        }
        Db::Bigtable => {
            let settings = BigtableSettings::parse(
                &bigtable::local().await.dsn(),
                Some(&arg("--db-settings=")),
                None,
            )
            .expect("emulator settings");
            Arc::new(
                BigtableStore::connect(settings)
                    .await
                    .expect("connect to the Bigtable emulator"),
            )
        }
        Db::Postgres => Arc::new(
            PostgresStore::connect(
                PostgresSettings::parse(&postgres::local().await.dsn, Some(&arg("--db-settings=")))
                    .expect("postgres settings"),
            )
            .expect("postgres store"),
        ),
    };
    (node, store)
}

/// A server on `db` with extra `args` (see [`node`]).
pub async fn start(db: Db, args: &[&str]) -> Server {
    Server::start_node(node(db, args).await).await
}

/// Tests `async fn test(db: Db)` of the calling module, run on every
/// backend: `embedded::test`, `dynamodb::test` (moto), `dynalite::test`,
/// `bigtable::test` and `postgres::test`.
#[macro_export]
macro_rules! on_every_backend {
    ($($test:ident),* $(,)?) => {
        mod embedded {
            $(
                #[tokio::test]
                async fn $test() {
                    super::$test($crate::backend::Db::Embedded).await;
                }
            )*
        }
        mod dynamodb {
            $(
                #[tokio::test]
                async fn $test() {
                    super::$test($crate::backend::Db::Dynamo).await;
                }
            )*
        }
        mod dynalite {
            $(
                #[tokio::test]
                async fn $test() {
                    super::$test($crate::backend::Db::Dynalite).await;
                }
            )*
        }
        mod bigtable {
            $(
                #[tokio::test]
                async fn $test() {
                    super::$test($crate::backend::Db::Bigtable).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test]
                async fn $test() {
                    super::$test($crate::backend::Db::Postgres).await;
                }
            )*
        }
    };
}

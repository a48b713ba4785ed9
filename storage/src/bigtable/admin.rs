//! `autopush db create-tables` and `db preflight` on Bigtable: the table
//! and families autopush-rs's `scripts/setup_bt.sh` makes, through the
//! admin API (the emulator's or Google's).
//!
//! GC policies, as autopush-rs sets them: `message` and `message_topic`
//! `maxage=1s or maxversions=1` (a message cell's timestamp is its expiry,
//! so GC removes it a second after it expires), `router` `maxversions=1`.
//! The `reliability` family is autopush-rs's own and left alone.

use std::collections::HashMap;

use googleapis_tonic_google_bigtable_admin_v2::google::bigtable::admin::v2::{
    self as admin, ColumnFamily, GcRule, bigtable_table_admin_client::BigtableTableAdminClient,
    gc_rule, modify_column_families_request::Modification,
    modify_column_families_request::modification::Mod, table::View,
};
use googleapis_tonic_google_bigtable_v2::google::bigtable::v2 as pb;

use super::BigtableStore;
use super::client::{ADMIN_SCOPE, Retry};
use super::row;
use crate::{Result, StorageError};

/// What `db preflight` found.
#[derive(Debug, Default)]
pub struct Preflight {
    /// What stops the service from working.
    pub problems: Vec<String>,
    /// What differs from autopush-rs's setup without stopping anything.
    pub notes: Vec<String>,
}

fn max_versions(n: i32) -> GcRule {
    GcRule {
        rule: Some(gc_rule::Rule::MaxNumVersions(n)),
    }
}

/// `maxage=1s or maxversions=1`.
fn message_gc() -> GcRule {
    let max_age = GcRule {
        rule: Some(gc_rule::Rule::MaxAge(prost_types::Duration {
            seconds: 1,
            nanos: 0,
        })),
    };
    GcRule {
        rule: Some(gc_rule::Rule::Union(gc_rule::Union {
            rules: vec![max_age, max_versions(1)],
        })),
    }
}

/// `cbt`'s spelling of a GC rule.
fn describe(rule: Option<&GcRule>) -> String {
    match rule.and_then(|r| r.rule.as_ref()) {
        None => "none (cells kept forever)".into(),
        Some(gc_rule::Rule::MaxNumVersions(n)) => format!("maxversions={n}"),
        Some(gc_rule::Rule::MaxAge(d)) => format!("maxage={}s", d.seconds),
        Some(gc_rule::Rule::Union(u)) => join(&u.rules, " or "),
        Some(gc_rule::Rule::Intersection(i)) => join(&i.rules, " and "),
    }
}

fn join(rules: &[GcRule], with: &str) -> String {
    rules
        .iter()
        .map(|r| describe(Some(r)))
        .collect::<Vec<_>>()
        .join(with)
}

impl BigtableStore {
    /// Each family this service uses, with autopush-rs's GC rule.
    fn family_rules(&self) -> Vec<(String, GcRule)> {
        let f = &self.settings().families;
        vec![
            (f.router.clone(), max_versions(1)),
            (f.message.clone(), message_gc()),
            (f.message_topic.clone(), message_gc()),
        ]
    }

    fn admin(&self) -> BigtableTableAdminClient<tonic::transport::Channel> {
        BigtableTableAdminClient::new(self.conn.channel.clone())
    }

    /// The table's families and their GC rules; `None` when there is no
    /// such table.
    async fn families_now(&self) -> Result<Option<HashMap<String, ColumnFamily>>> {
        let name = self.settings().table_name.clone();
        let got = self
            .conn
            .retry("GetTable", Retry::Idempotent, || {
                let request = admin::GetTableRequest {
                    name: name.clone(),
                    view: View::SchemaView as i32,
                };
                async {
                    let request = self
                        .conn
                        .request_to(request, ADMIN_SCOPE, &[("name", &name)])
                        .await?;
                    Ok(self.admin().get_table(request).await)
                }
            })
            .await;
        match got {
            Ok(table) => Ok(Some(table.into_inner().column_families)),
            Err(StorageError::NoTable(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Create the table with its families, or the families an existing
    /// table lacks; returns what it did, one line each.
    pub async fn create_tables(&self) -> Result<Vec<String>> {
        let settings = self.settings();
        let table = &settings.table_name;
        let Some(existing) = self.families_now().await? else {
            let column_families = self
                .family_rules()
                .into_iter()
                .map(|(name, rule)| {
                    let family = ColumnFamily {
                        gc_rule: Some(rule),
                        ..Default::default()
                    };
                    (name, family)
                })
                .collect();
            let request = admin::CreateTableRequest {
                parent: settings.instance_name().to_owned(),
                table_id: settings.table_id().to_owned(),
                table: Some(admin::Table {
                    column_families,
                    ..Default::default()
                }),
                ..Default::default()
            };
            let parent = settings.instance_name();
            self.conn
                .retry("CreateTable", Retry::Unsent, || {
                    let request = request.clone();
                    async move {
                        let request = self
                            .conn
                            .request_to(request, ADMIN_SCOPE, &[("parent", parent)])
                            .await?;
                        Ok(self.admin().create_table(request).await.map(|_| ()))
                    }
                })
                .await?;
            let names: Vec<_> = self.family_rules().into_iter().map(|(n, _)| n).collect();
            return Ok(vec![format!(
                "created table {table} with families {}",
                names.join(", ")
            )]);
        };
        let mut done = vec![format!("table {table} exists")];
        let modifications: Vec<_> = self
            .family_rules()
            .into_iter()
            .filter(|(name, _)| !existing.contains_key(name))
            .map(|(name, rule)| Modification {
                id: name,
                r#mod: Some(Mod::Create(ColumnFamily {
                    gc_rule: Some(rule),
                    ..Default::default()
                })),
                ..Default::default()
            })
            .collect();
        if modifications.is_empty() {
            return Ok(done);
        }
        let names: Vec<_> = modifications.iter().map(|m| m.id.clone()).collect();
        let request = admin::ModifyColumnFamiliesRequest {
            name: table.clone(),
            modifications,
            ignore_warnings: false,
        };
        self.conn
            .retry("ModifyColumnFamilies", Retry::Unsent, || {
                let request = request.clone();
                async move {
                    let request = self
                        .conn
                        .request_to(request, ADMIN_SCOPE, &[("name", table)])
                        .await?;
                    Ok(self
                        .admin()
                        .modify_column_families(request)
                        .await
                        .map(|_| ()))
                }
            })
            .await?;
        done.push(format!("created families {}", names.join(", ")));
        Ok(done)
    }

    /// Check the table, its families and their GC rules, and that these
    /// credentials can write, read and delete a row.
    pub async fn preflight(&self) -> Result<Preflight> {
        let mut found = Preflight::default();
        let table = &self.settings().table_name;
        let existing = match self.families_now().await {
            Ok(Some(existing)) => existing,
            Ok(None) => {
                found.problems.push(format!(
                    "table {table} (run `autopush db create-tables` with the same settings)"
                ));
                return Ok(found);
            }
            // Data-only credentials may not read the schema: go on to the
            // round trip, which is what the service needs.
            Err(e) => {
                found
                    .notes
                    .push(format!("cannot read the table's schema: {e}"));
                HashMap::new()
            }
        };
        for (name, rule) in self.family_rules() {
            match existing.get(&name) {
                None if !existing.is_empty() => found.problems.push(format!(
                    "family {name} in {table} (run `autopush db create-tables`)"
                )),
                Some(family) if family.gc_rule.as_ref() != Some(&rule) => {
                    found.notes.push(format!(
                        "family {name} has GC rule {}; autopush-rs sets {} (reads skip expired cells either way)",
                        describe(family.gc_rule.as_ref()),
                        describe(Some(&rule))
                    ))
                }
                _ => {}
            }
        }
        if found.problems.is_empty()
            && let Err(e) = self.round_trip().await
        {
            found
                .problems
                .push(format!("a write, read and delete in {table}: {e}"));
        }
        Ok(found)
    }

    /// Write, read back and delete a probe row (not a UAID: autopush-rs
    /// never reads it).
    async fn round_trip(&self) -> Result<()> {
        let key = format!("preflight-{}", uuid::Uuid::new_v4().simple()).into_bytes();
        let router = &self.settings().families.router;
        let probe = pb::Mutation {
            mutation: Some(pb::mutation::Mutation::SetCell(pb::mutation::SetCell {
                family_name: router.clone(),
                column_qualifier: b"preflight".to_vec(),
                timestamp_micros: 0,
                value: b"ok".to_vec(),
            })),
        };
        self.write(key.clone(), vec![probe]).await?;
        let read = self
            .read_row(key.clone(), row::column(router, b"preflight"))
            .await?;
        self.write(key, vec![row::delete_row()]).await?;
        match read {
            Some(_) => Ok(()),
            None => Err(StorageError::Backend(
                "the probe row read back empty".into(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gc_rules_read_as_cbt_writes_them() {
        assert_eq!(describe(Some(&message_gc())), "maxage=1s or maxversions=1");
        assert_eq!(describe(Some(&max_versions(1))), "maxversions=1");
        assert_eq!(describe(None), "none (cells kept forever)");
    }
}

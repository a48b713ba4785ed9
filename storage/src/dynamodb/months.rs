//! Legacy monthly message tables, as Python autopush rotated them
//! (`--message-table-rotation`): one message table per UTC month, named
//! `{prefix}_{YYYY}_{MM}`, and each router record naming in `current_month`
//! the table that holds the user's channels and unread messages.
//!
//! The seeds' "Rotating Message Table Interaction Rules", and how each is
//! kept:
//! * An endpoint stores a message in the table the user's `current_month`
//!   names, where its channel set is.
//! * Only a connection node moves a user to this month's table, and only
//!   once the old table holds nothing unread: it copies the channel set,
//!   then flips `current_month`, conditional on the month it read.
//! * An endpoint that read the old month just before the flip stores in the
//!   old table just after it. Reads therefore always cover last month's
//!   table as well as the user's own and this month's, so nothing stored
//!   there is stranded.
//! * A webpush user whose table is older than last month's has not read its
//!   messages for a month or more: it is treated as gone (410 to senders, a
//!   new UAID at its next hello), as Python autopush dropped it. Bridge
//!   users never connect, so they keep the table they registered in.
//!
//! Nodes' clocks may disagree at the turn of a month: a user already moved
//! to a month a node thinks is next month is read there and never moved
//! back.

use autopush_common::time::now_millis;
use autopush_common::{RouterType, User};

use super::item::month_offset;

/// The monthly message tables of one prefix.
#[derive(Clone, Debug)]
pub struct MonthTables {
    prefix: String,
}

/// Where one user's data lives in the message tables.
#[derive(Debug, PartialEq)]
pub struct Home {
    /// The table with the user's channel set, where new messages go.
    pub table: String,
    /// Every table its messages are read from, the user's own first.
    pub reads: Vec<String>,
}

impl Home {
    /// The outcome of reading `table`, where a table other than the user's
    /// own that does not exist (last month's, in a deployment younger than
    /// a month) reads as empty.
    pub async fn unless_absent<T: Default>(
        &self,
        table: &str,
        read: impl std::future::Future<Output = crate::Result<T>>,
    ) -> crate::Result<T> {
        match read.await {
            Err(crate::StorageError::NoTable(_)) if table != self.table => Ok(T::default()),
            other => other,
        }
    }
}

impl MonthTables {
    pub fn new(prefix: &str) -> Self {
        MonthTables {
            prefix: prefix.to_owned(),
        }
    }

    /// The table of the month `delta` months from this one (UTC, this node's
    /// clock): 0 is this month, -1 the last, 1 the next.
    pub fn month(&self, delta: i64) -> String {
        self.name_at(now_millis(), delta)
    }

    fn name_at(&self, millis: u64, delta: i64) -> String {
        let (year, month) = month_offset(millis, delta);
        format!("{}_{year:04}_{month:02}", self.prefix)
    }

    /// Whether `table` is one of ours no older than last month's. Names
    /// compare as dates: the year and month are zero-padded.
    pub fn is_recent(&self, table: &str) -> bool {
        table
            .strip_prefix(&self.prefix)
            .is_some_and(|rest| rest.starts_with('_'))
            && table >= self.month(-1).as_str()
    }

    /// Whether a user reading `table` is due to move to this month's.
    pub fn is_behind(&self, table: &str) -> bool {
        table < self.month(0).as_str()
    }

    /// A webpush user whose month is too old to read is gone.
    pub fn is_stale(&self, user: &User) -> bool {
        user.router_type == RouterType::WebPush
            && user
                .current_month
                .as_deref()
                .is_some_and(|table| !self.is_recent(table))
    }

    /// Where `user` (if any) keeps its data.
    pub fn home(&self, user: Option<&User>) -> Home {
        let current = self.month(0);
        let table = match user {
            Some(user) if !self.is_stale(user) => user
                .current_month
                .clone()
                .unwrap_or_else(|| current.clone()),
            _ => current.clone(),
        };
        let mut reads = vec![table.clone()];
        for other in [self.month(-1), current] {
            if !reads.contains(&other) {
                reads.push(other);
            }
        }
        Home { table, reads }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(month: Option<String>, router_type: RouterType) -> User {
        let mut user = User::new_webpush(uuid::Uuid::new_v4(), "node", 1);
        user.current_month = month;
        user.router_type = router_type;
        user
    }

    #[test]
    fn names_are_prefix_year_month() {
        let months = MonthTables::new("message");
        // 2024-01-15 UTC
        let millis = 1_705_276_800_000;
        assert_eq!(months.name_at(millis, 0), "message_2024_01");
        assert_eq!(months.name_at(millis, -1), "message_2023_12");
        assert_eq!(months.name_at(millis, 1), "message_2024_02");
    }

    #[test]
    fn a_user_reads_its_own_then_last_then_this_months_table() {
        let months = MonthTables::new("message");
        let (now, last) = (months.month(0), months.month(-1));
        let on_last = user(Some(last.clone()), RouterType::WebPush);
        assert_eq!(
            months.home(Some(&on_last)),
            Home {
                table: last.clone(),
                reads: vec![last.clone(), now.clone()],
            }
        );
        assert!(months.is_behind(&last));
        let on_now = user(Some(now.clone()), RouterType::WebPush);
        assert_eq!(months.home(Some(&on_now)).reads, vec![now.clone(), last]);
        assert!(!months.is_behind(&now));
        // A node whose clock is behind never moves a user back.
        assert!(!months.is_behind(&months.month(1)));
        assert_eq!(months.home(None).table, now);
    }

    #[test]
    fn webpush_users_older_than_last_month_are_stale_bridge_users_never() {
        let months = MonthTables::new("message");
        let old = months.month(-2);
        assert!(months.is_stale(&user(Some(old.clone()), RouterType::WebPush)));
        assert!(!months.is_stale(&user(Some(old.clone()), RouterType::Fcm)));
        assert_eq!(
            months
                .home(Some(&user(Some(old.clone()), RouterType::Fcm)))
                .table,
            old
        );
        assert!(!months.is_stale(&user(None, RouterType::WebPush)));
        assert!(months.is_stale(&user(Some("other_2099_01".into()), RouterType::WebPush)));
    }
}

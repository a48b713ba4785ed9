//! `autopush db move-legacy-cells`: older builds of ours kept
//! `last_connect` and `over_msg_limit` in the user row's router family,
//! where autopush-rs takes them for channels and fails on that user (see
//! [`row`]). A connection moves them; this moves them for every user who
//! has not come back, so autopush-rs can read every row.
//!
//! One pass over the user rows, a page at a time; each row holding such a
//! cell gets one `CheckAndMutateRow` conditional on the cells read (value
//! and timestamp), so a row a node changed meanwhile is read again, never
//! overwritten. Safe while nodes run, and again.

use googleapis_tonic_google_bigtable_v2::google::bigtable::v2::{
    self as pb, RowFilter, RowRange, RowSet, row_range,
};

use super::BigtableStore;
use super::row;
use crate::Result;

/// User rows read per request.
const PAGE: usize = 500;
/// Conditional writes tried on one row before it is left for another run.
const TRIES: usize = 3;
/// Pages between progress lines (a large table takes a while).
const PAGES_PER_LINE: u64 = 100;

/// What one pass did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct LegacyCells {
    /// User rows read.
    pub scanned: u64,
    /// Rows whose router cells of ours were moved by this pass.
    pub moved: u64,
    /// Rows that held them when read and changed before the write: a node
    /// connected the user (which moves them itself) or removed it.
    pub changed: u64,
    /// Rows that still hold them after [`TRIES`] writes lost to changes
    /// (their UAIDs): another run picks them up.
    pub left: Vec<String>,
}

/// `^[0-9a-f]{32}$`: user rows, not message rows (`{uaid}#...`) or a
/// preflight probe.
fn user_rows() -> RowFilter {
    RowFilter {
        filter: Some(pb::row_filter::Filter::RowKeyRegexFilter(
            b"^[0-9a-f]{32}$".to_vec(),
        )),
    }
}

/// Every row after `after` (from the first without).
fn rows_after(after: Option<Vec<u8>>) -> RowSet {
    RowSet {
        row_keys: Vec::new(),
        row_ranges: vec![RowRange {
            start_key: after.map(row_range::StartKey::StartKeyOpen),
            end_key: None,
        }],
    }
}

impl BigtableStore {
    /// Move every user row's router `last_connect`/`over_msg_limit` to the
    /// message family (see the module's notes); `progress` gets a line
    /// every [`PAGES_PER_LINE`] pages.
    pub async fn move_legacy_cells(
        &self,
        progress: &mut (dyn FnMut(String) + Send),
    ) -> Result<LegacyCells> {
        let families = self.families();
        let filter = row::chain(vec![user_rows(), row::own_cells(families)]);
        let mut done = LegacyCells::default();
        let mut after = None;
        for pages in 1.. {
            let page = self
                .conn
                .read_rows(self.read_request(rows_after(after.take()), filter.clone(), PAGE))
                .await?;
            let full = page.len() == PAGE;
            for read in page {
                done.scanned += 1;
                after = Some(read.key.clone());
                if row::has_legacy_cells(families, &read) {
                    self.move_row(read, &mut done).await?;
                }
            }
            if !full {
                break;
            }
            if pages % PAGES_PER_LINE == 0 {
                progress(format!(
                    "scanned {} user rows so far, moved cells in {}",
                    done.scanned, done.moved
                ));
            }
        }
        Ok(done)
    }

    /// User `uaid`'s cells as [`move_legacy_row`](Self::move_legacy_row)
    /// needs them read.
    pub async fn read_legacy_cells(&self, uaid: &uuid::Uuid) -> Result<Option<row::Row>> {
        let filter = row::own_cells(self.families());
        self.read_row(row::user_key(uaid), filter).await
    }

    /// Move the router cells of ours in `read` (a user row read with
    /// [`row::own_cells`]) in one `CheckAndMutateRow`, if that row's
    /// cells of ours are still what `read` holds; returns whether they were.
    pub async fn move_legacy_row(&self, read: &row::Row) -> Result<bool> {
        let families = self.families();
        let unchanged = row::own_cells_unchanged(families, read);
        let moved = row::own_cells_rewritten(families, read, self.stamp());
        self.check_and_mutate(read.key.clone(), unchanged, moved, Vec::new())
            .await
    }

    /// One row's move, read again after each write lost to a change.
    async fn move_row(&self, mut read: row::Row, done: &mut LegacyCells) -> Result<()> {
        let families = self.families();
        for _ in 0..TRIES {
            if self.move_legacy_row(&read).await? {
                done.moved += 1;
                return Ok(());
            }
            let filter = row::own_cells(families);
            match self.read_row(read.key.clone(), filter).await? {
                Some(again) if row::has_legacy_cells(families, &again) => read = again,
                _ => {
                    done.changed += 1;
                    return Ok(());
                }
            }
        }
        done.left
            .push(String::from_utf8_lossy(&read.key).into_owned());
        Ok(())
    }
}

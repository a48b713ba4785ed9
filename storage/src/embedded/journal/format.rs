//! The journal file's format: its first page, and records framed,
//! stamped with their epoch, and read back.
//!
//! Two formats: each batch a [`Format::V2`] file holds starts with a
//! [`Record::Synced`] saying how far the file was synced when it was
//! written; a [`Format::V1`] file (written by releases before) has none,
//! and is read as they read it.

use autopush_common::Notification;
use autopush_common::bridge::{write_json_str, write_json_uuid};
use autopush_common::receipt::MessageState;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::super::corrupt;
use crate::{Receipt, Result, StorageError};

/// The first page of the file: [`FILE_MAGIC`] and the epoch (twice, the
/// second inverted) whose records are current. Records start after it.
pub(super) const HEADER: u64 = 4096;
/// The first page of a [`Format::V2`] file: what this release writes.
pub(super) const FILE_MAGIC: &[u8; 8] = b"APJRNL02";
/// The first page of a [`Format::V1`] file: read, never written.
pub(super) const FILE_MAGIC_V1: &[u8; 8] = b"APJRNL01";

/// How a journal file tells a batch a power loss cut short from damage.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Format {
    /// Records only. A crash is taken to leave at most a torn tail, as
    /// after `kill -9`: a place that holds no whole record, with whole
    /// ones after it, is damage. (A power loss can leave that too: until
    /// `fdatasync` returns, the disk may keep a batch's later blocks and
    /// not its first.)
    V1,
    /// Each batch starts with [`Record::Synced`]. A place that holds no
    /// whole record is damage only if a batch after it says the file was
    /// synced past it; else it is the start of a batch never synced
    /// (whose senders were not answered), dropped with what follows.
    V2,
}
/// Starts every record: bytes that JSON and base64url text never hold, so
/// that a record is not seen where another's body is.
pub(super) const RECORD_MAGIC: [u8; 4] = [0xa7, 0x4a, 0x9c, 0xf1];
/// A record's head: magic, epoch, body length, body checksum.
pub(super) const RECORD_HEAD: usize = 16;

/// One journal record.
#[derive(Serialize, Deserialize)]
pub(super) enum Record {
    /// Starts a batch ([`Format::V2`]): when it was written, the file was
    /// synced up to offset `to` in this epoch.
    Synced { to: u64 },
    /// A message accepted for direct delivery.
    Put { uaid: Uuid, message: Notification },
    /// The message under `key` was settled, if it is still `version`; its
    /// receipt, with receipts on.
    Settle {
        uaid: Uuid,
        key: String,
        version: String,
        receipt: Option<SettledAs>,
    },
}

/// A receipt as a settle's record carries it: its version is the record's,
/// not written twice. (Records written before carry it twice; the second
/// is not read.)
#[derive(Clone, Copy, Serialize, Deserialize)]
pub(super) struct SettledAs {
    #[serde(rename = "settled")]
    pub(super) state: MessageState,
    pub(super) updated: u64,
    pub(super) expiry: u64,
}

impl SettledAs {
    pub(super) fn of(receipt: &Receipt) -> SettledAs {
        SettledAs {
            state: receipt.state,
            updated: receipt.updated,
            expiry: receipt.expiry,
        }
    }

    /// What `serde_json` writes for it, without its escape scan of the
    /// names (a settle's record, on every ack with receipts on).
    pub(super) fn write_json(&self, out: &mut Vec<u8>) -> serde_json::Result<()> {
        out.extend_from_slice(br#"{"settled":""#);
        out.extend_from_slice(self.state.as_str().as_bytes());
        out.extend_from_slice(br#"","updated":"#);
        serde_json::to_writer(&mut *out, &self.updated)?;
        out.extend_from_slice(br#","expiry":"#);
        serde_json::to_writer(&mut *out, &self.expiry)?;
        out.push(b'}');
        Ok(())
    }

    pub(super) fn receipt(self, version: String) -> Receipt {
        Receipt {
            state: self.state,
            version,
            updated: self.updated,
            expiry: self.expiry,
        }
    }
}

/// Tells a record torn by a crash from a whole one: a word-at-a-time hash
/// (cheap next to the message it covers; not a defence against tampering).
pub(super) fn checksum(bytes: &[u8]) -> u32 {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut hash = K ^ bytes.len() as u64;
    let mut words = bytes.chunks_exact(8);
    for word in &mut words {
        let mut w = [0u8; 8];
        w.copy_from_slice(word);
        hash = (hash ^ u64::from_le_bytes(w))
            .wrapping_mul(K)
            .rotate_left(31);
    }
    for b in words.remainder() {
        hash = (hash ^ u64::from(*b)).wrapping_mul(K).rotate_left(31);
    }
    (hash ^ (hash >> 32)) as u32
}

/// [`Record`] to write, borrowing the message.
#[cfg_attr(test, derive(Serialize))]
pub(super) enum RecordRef<'a> {
    Synced {
        to: u64,
    },
    Put {
        uaid: Uuid,
        message: &'a Notification,
    },
    Settle {
        uaid: Uuid,
        key: &'a str,
        version: &'a str,
        receipt: Option<SettledAs>,
    },
}

impl RecordRef<'_> {
    /// Append the record's JSON to `out`: what `serde_json` writes for the
    /// [`Record`] it reads back, without its escape scan of every byte of
    /// the message id, which every push's records hold.
    pub(super) fn write_json(&self, out: &mut Vec<u8>) -> serde_json::Result<()> {
        match self {
            RecordRef::Synced { to } => {
                out.extend_from_slice(br#"{"Synced":{"to":"#);
                serde_json::to_writer(&mut *out, to)?;
            }
            RecordRef::Put { uaid, message } => {
                out.extend_from_slice(br#"{"Put":{"uaid":"#);
                write_json_uuid(out, uaid);
                out.extend_from_slice(br#","message":"#);
                message.write_json(out)?;
            }
            RecordRef::Settle {
                uaid,
                key,
                version,
                receipt,
            } => {
                out.extend_from_slice(br#"{"Settle":{"uaid":"#);
                write_json_uuid(out, uaid);
                out.extend_from_slice(br#","key":"#);
                write_json_str(out, key)?;
                out.extend_from_slice(br#","version":"#);
                write_json_str(out, version)?;
                out.extend_from_slice(br#","receipt":"#);
                match receipt {
                    Some(receipt) => receipt.write_json(out)?,
                    None => out.extend_from_slice(b"null"),
                }
            }
        }
        out.extend_from_slice(b"}}");
        Ok(())
    }
}

/// Frame a record at the end of `out` (a batch being written, or the
/// settles waiting for one), its JSON written by `json`; on an error `out`
/// is left as it was.
///
/// A record as written: `[magic][epoch][length][checksum]` (see
/// [`RECORD_HEAD`]; the epoch is [`stamp`]ed when the record is written),
/// then the body: `[JSON length][JSON][0, or 1 and a message's data]`,
/// zero-padded to 8 bytes. A message's data (its encrypted body, most of
/// its size) is kept out of the JSON, which would scan it for characters
/// to escape; it is base64url, so has none.
pub(super) fn frame_into(
    out: &mut Vec<u8>,
    json: impl FnOnce(&mut Vec<u8>) -> serde_json::Result<()>,
    data: Option<&str>,
) -> Result<()> {
    let too_large = || StorageError::Backend("direct journal: record too large".into());
    let start = out.len();
    out.extend_from_slice(&[0u8; RECORD_HEAD + 4]);
    if let Err(e) = json(out) {
        out.truncate(start);
        return Err(corrupt(e));
    }
    let json = out.len() - start - RECORD_HEAD - 4;
    match data {
        Some(data) => {
            out.push(1);
            out.extend_from_slice(data.as_bytes());
        }
        None => out.push(0),
    }
    let (Ok(json), Ok(len)) = (
        u32::try_from(json),
        u32::try_from(out.len() - start - RECORD_HEAD),
    ) else {
        out.truncate(start);
        return Err(too_large());
    };
    let record = &mut out[start..];
    record[RECORD_HEAD..RECORD_HEAD + 4].copy_from_slice(&json.to_le_bytes());
    let sum = checksum(&record[RECORD_HEAD..]);
    record[0..4].copy_from_slice(&RECORD_MAGIC);
    record[8..12].copy_from_slice(&len.to_le_bytes());
    record[12..16].copy_from_slice(&sum.to_le_bytes());
    out.resize(out.len().next_multiple_of(8), 0);
    Ok(())
}

/// The little-endian `u32` at `at` in `bytes`, if they reach that far.
pub(super) fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    let word = bytes.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes(word.try_into().ok()?))
}

/// Mark a framed record as written in `epoch`.
pub(super) fn stamp(record: &mut [u8], epoch: u32) {
    record[4..8].copy_from_slice(&epoch.to_le_bytes());
}

/// Mark every framed record in `records` (whole ones, back to back) as
/// written in `epoch`.
pub(super) fn stamp_all(records: &mut [u8], epoch: u32) {
    let mut at = 0;
    while let Some(len) = u32_at(records, at + 8) {
        stamp(&mut records[at..], epoch);
        at += (RECORD_HEAD + len as usize).next_multiple_of(8);
    }
}

/// The record of `epoch` at the start of `bytes` and its framed size, if
/// one is there whole.
pub(super) fn record_at(bytes: &[u8], epoch: u32) -> Option<(Record, usize)> {
    if bytes.get(0..4)? != RECORD_MAGIC || u32_at(bytes, 4)? != epoch {
        return None;
    }
    let len = u32_at(bytes, 8)? as usize;
    let body = bytes.get(RECORD_HEAD..RECORD_HEAD.checked_add(len)?)?;
    if checksum(body) != u32_at(bytes, 12)? {
        return None;
    }
    Some((unframe(body)?, (RECORD_HEAD + len).next_multiple_of(8)))
}

/// The current epoch's records in a journal file, as [`read_records`]
/// finds them.
pub(super) struct Records {
    /// Messages and settles, in order (no [`Record::Synced`]).
    pub(super) records: Vec<Record>,
    /// Where they end.
    pub(super) end: usize,
    /// A record of the epoch starts at `end` but is not whole: the last
    /// write, cut short by a crash.
    pub(super) torn: bool,
    /// Whole records of the epoch past `end`, the first at this offset,
    /// that no later batch says were synced ([`Format::V2`]): a power loss
    /// kept them and not a block before them. Never synced, so their
    /// senders were not answered; dropped.
    pub(super) unsynced: Option<usize>,
}

/// A place in the current epoch that holds no whole record, yet was
/// synced: whole records of the epoch follow it ([`Format::V1`]), or a
/// batch written after it was synced ([`Format::V2`]), at `next`.
#[derive(Debug)]
pub(super) struct Unreadable {
    pub(super) at: usize,
    pub(super) next: usize,
}

/// The records of `epoch` in a journal file's `bytes`, in order. The one
/// writer writes them back to back and syncs each batch of messages
/// before it answers. After `kill -9` what follows the last whole record
/// holds none of this epoch (a torn record, zeros, an earlier epoch's
/// records). After a power loss a batch whose sync had not returned may
/// hold any of its blocks and not the others: what follows the last
/// whole record may hold whole records of the epoch, and was never
/// synced, unless a batch after it says it was. A place that holds no
/// whole record and was synced is damage to what a sender was answered
/// for: that is [`Unreadable`], never stepped over. See [`Format`].
pub(super) fn read_records(
    bytes: &[u8],
    epoch: u32,
    format: Format,
) -> std::result::Result<Records, Unreadable> {
    let mut records = Vec::new();
    let mut at = HEADER as usize;
    while let Some((record, size)) = bytes.get(at..).and_then(|rest| record_at(rest, epoch)) {
        if !matches!(record, Record::Synced { .. }) {
            records.push(record);
        }
        at += size;
    }
    let after = next_record(bytes, at + 8, Some(epoch));
    let synced_past = |next: &usize| match record_at(&bytes[*next..], epoch) {
        Some((Record::Synced { to }, _)) => to > at as u64,
        _ => false,
    };
    let proof = match format {
        Format::V1 => after,
        Format::V2 => whole_records(bytes, after, epoch).find(synced_past),
    };
    if let Some(next) = proof {
        return Err(Unreadable { at, next });
    }
    let torn = bytes.get(at..).is_some_and(|rest| {
        rest.get(0..4) == Some(&RECORD_MAGIC[..]) && u32_at(rest, 4) == Some(epoch)
    });
    Ok(Records {
        records,
        end: at,
        torn,
        unsynced: after,
    })
}

/// Where each whole record of `epoch` in `bytes` starts, from `first` on.
fn whole_records(bytes: &[u8], first: Option<usize>, epoch: u32) -> impl Iterator<Item = usize> {
    std::iter::successors(first, move |at| next_record(bytes, at + 8, Some(epoch)))
}

/// Where the first whole record of `epoch` (of any epoch, with `None`)
/// starts in `bytes`, at or past `from`.
pub(super) fn next_record(bytes: &[u8], from: usize, epoch: Option<u32>) -> Option<usize> {
    let from = from.max(HEADER as usize).next_multiple_of(8);
    (from..bytes.len()).step_by(8).find(|at| {
        let rest = &bytes[*at..];
        let Some(found) = u32_at(rest, 4) else {
            return false;
        };
        rest.get(0..4) == Some(&RECORD_MAGIC[..])
            && epoch.is_none_or(|epoch| epoch == found)
            && record_at(rest, found).is_some()
    })
}

/// Every whole record of `epoch` in `bytes`, stepping over what is not
/// one, and where each stretch stepped over starts: what a file the node
/// refused still holds (see `autopush db replay-journal`).
pub(super) fn salvage_records(bytes: &[u8], epoch: u32) -> (Vec<Record>, Vec<usize>) {
    let (mut records, mut skipped) = (Vec::new(), Vec::new());
    let mut at = HEADER as usize;
    while at < bytes.len() {
        match record_at(&bytes[at..], epoch) {
            Some((record, size)) => {
                if !matches!(record, Record::Synced { .. }) {
                    records.push(record);
                }
                at += size;
            }
            None => match next_record(bytes, at + 8, Some(epoch)) {
                Some(next) => {
                    skipped.push(at);
                    at = next;
                }
                None => break,
            },
        }
    }
    (records, skipped)
}

/// The latest epoch among the whole records in `bytes`: the current one,
/// for a file whose first page was lost, unless none was written in it.
pub(super) fn latest_epoch(bytes: &[u8]) -> Option<u32> {
    let mut latest = None;
    let mut at = HEADER as usize;
    while let Some(found) = next_record(bytes, at, None) {
        let epoch = u32_at(bytes, found + 4)?;
        latest = latest.max(Some(epoch));
        at = found + 8;
    }
    latest
}

/// The file's first page for `epoch`.
pub(super) fn header(epoch: u32) -> [u8; 16] {
    header_of(FILE_MAGIC, epoch)
}

/// A first page of the format `magic` names, for `epoch`.
pub(super) fn header_of(magic: &[u8; 8], epoch: u32) -> [u8; 16] {
    let mut page = [0u8; 16];
    page[..8].copy_from_slice(magic);
    page[8..12].copy_from_slice(&epoch.to_le_bytes());
    page[12..].copy_from_slice(&(!epoch).to_le_bytes());
    page
}

/// Why a journal file's first page names no epoch.
#[derive(Debug)]
pub(super) enum FirstPage {
    /// It is not a journal's.
    Foreign,
    /// Zeros, yet a whole record starts at this offset: the epoch that
    /// tells current records from older ones was lost.
    Zeroed(usize),
}

/// The epoch in a journal file's first page: `None` for a new file (its
/// first page never written: nothing was journaled in it).
pub(super) fn epoch_of(bytes: &[u8]) -> std::result::Result<Option<u32>, FirstPage> {
    Ok(first_page(bytes)?.map(|(epoch, _)| epoch))
}

/// The epoch and the format a journal file's first page names (see
/// [`epoch_of`]).
pub(super) fn first_page(bytes: &[u8]) -> std::result::Result<Option<(u32, Format)>, FirstPage> {
    let page = &bytes[..bytes.len().min(16)];
    if page.iter().all(|b| *b == 0) {
        // New, or its first start was cut short, unless a record says
        // that something was journaled.
        return match next_record(bytes, HEADER as usize, None) {
            Some(at) => Err(FirstPage::Zeroed(at)),
            None => Ok(None),
        };
    }
    let format = match page.get(..8) {
        Some(magic) if magic == FILE_MAGIC => Format::V2,
        Some(magic) if magic == FILE_MAGIC_V1 => Format::V1,
        _ => return Err(FirstPage::Foreign),
    };
    match (u32_at(page, 8), u32_at(page, 12)) {
        (Some(epoch), Some(check)) if epoch == !check => Ok(Some((epoch, format))),
        _ => Err(FirstPage::Foreign),
    }
}

/// One record's body back (see [`frame_into`]); `None` if it does not parse.
pub(super) fn unframe(body: &[u8]) -> Option<Record> {
    let json_len = u32_at(body, 0)? as usize;
    let json = body.get(4..4 + json_len)?;
    let mut record: Record = serde_json::from_slice(json).ok()?;
    let rest = body.get(4 + json_len..)?;
    match (rest.first()?, &mut record) {
        (0, _) => {}
        (1, Record::Put { message, .. }) => {
            message.data = Some(std::str::from_utf8(&rest[1..]).ok()?.to_owned());
        }
        _ => return None,
    }
    Some(record)
}

//! The journal file as the journal uses it: read whole at start-up,
//! written in place, synced. Behind one trait, so that a test can record
//! every write and sync and build the states a power loss can leave (see
//! `power_loss.rs`); the node's is the file itself.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::FileExt;

pub(in crate::embedded) trait JournalFile: Send {
    /// The whole file.
    fn read_all(&mut self) -> std::io::Result<Vec<u8>>;
    /// Write all of `bytes` at offset `at`.
    fn write_at(&self, bytes: &[u8], at: u64) -> std::io::Result<()>;
    /// Make what was written durable: its data, and the file's size
    /// (`fdatasync`).
    fn sync(&self) -> std::io::Result<()>;
}

impl JournalFile for File {
    fn read_all(&mut self) -> std::io::Result<Vec<u8>> {
        let mut bytes = Vec::new();
        self.seek(SeekFrom::Start(0))?;
        self.read_to_end(&mut bytes)?;
        Ok(bytes)
    }

    fn write_at(&self, bytes: &[u8], at: u64) -> std::io::Result<()> {
        self.write_all_at(bytes, at)
    }

    fn sync(&self) -> std::io::Result<()> {
        self.sync_data()
    }
}

//! A command run by root on a data directory that belongs to another user
//! (the packaged service's dynamic user owns `/var/lib/private/autopush`):
//! what it makes there is handed to that user and readable by it only, as
//! the service itself would have made it, so the service can open it again.
//! Files written in place (the store, the journal) keep their owner and mode
//! by themselves.

use std::collections::HashSet;
use std::ffi::OsString;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The data directory's owner, and what the directory held before the
/// command: what it holds beyond that after, [`Owner::hand_over`] gives to
/// the owner.
pub struct Owner {
    dir: PathBuf,
    uid: u32,
    gid: u32,
    before: HashSet<OsString>,
}

impl Owner {
    /// `None` unless this process is root and `dir` belongs to another
    /// user. Else files made from now on are readable by their owner only
    /// (umask 077), and root must be able to give them away: if it cannot
    /// (no `CAP_CHOWN`), it refuses before writing anything, naming the
    /// command that runs it as the service's user.
    pub fn of(dir: &Path) -> Result<Option<Owner>, String> {
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            return Ok(None);
        }
        let Ok(meta) = std::fs::metadata(dir) else {
            return Ok(None);
        };
        if !meta.is_dir() || meta.uid() == 0 {
            return Ok(None);
        }
        let (uid, gid) = (meta.uid(), meta.gid());
        let probe = dir.join(format!(".owner-check-{}", std::process::id()));
        let given = std::fs::File::create_new(&probe)
            .and_then(|file| std::os::unix::fs::fchown(&file, Some(uid), Some(gid)));
        let _ = std::fs::remove_file(&probe);
        if let Err(e) = given {
            let command: Vec<String> = std::env::args().collect();
            return Err(format!(
                "{} belongs to uid {uid}, and this process cannot give what it would write \
                 there to that user ({e}): run the command as that user instead; for the \
                 packaged service: systemd-run -p DynamicUser=yes -p StateDirectory=autopush \
                 --pty --wait --collect {}",
                dir.display(),
                command.join(" ")
            ));
        }
        // SAFETY: umask has no preconditions and cannot fail.
        unsafe { libc::umask(0o077) };
        let before = entries(dir)?;
        Ok(Some(Owner {
            dir: dir.to_owned(),
            uid,
            gid,
            before,
        }))
    }

    /// Give what the command made in the directory to its owner.
    pub fn hand_over(self) -> Result<(), String> {
        for name in entries(&self.dir)? {
            if !self.before.contains(&name) {
                self.give(&self.dir.join(name))?;
            }
        }
        Ok(())
    }

    /// `path` (and what it holds, if a directory) to the directory's owner.
    fn give(&self, path: &Path) -> Result<(), String> {
        std::os::unix::fs::lchown(path, Some(self.uid), Some(self.gid))
            .map_err(|e| format!("cannot give {} to uid {}: {e}", path.display(), self.uid))?;
        if std::fs::symlink_metadata(path).is_ok_and(|meta| meta.is_dir()) {
            for name in entries(path)? {
                self.give(&path.join(name))?;
            }
        }
        Ok(())
    }
}

fn entries(dir: &Path) -> Result<HashSet<OsString>, String> {
    let read = |e: std::io::Error| format!("cannot list {}: {e}", dir.display());
    std::fs::read_dir(dir)
        .map_err(read)?
        .map(|entry| entry.map(|entry| entry.file_name()).map_err(read))
        .collect()
}

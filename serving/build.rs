//! Stamp the git commit being built into `AUTOPUSH_GIT_COMMIT` (served by
//! `/__version__`), or "unknown" where git or the repository is missing.

use std::path::{Path, PathBuf};
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let output = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(output.stdout).ok()?;
    let text = text.trim();
    (output.status.success() && !text.is_empty()).then(|| text.to_owned())
}

fn rerun_if_exists(path: &Path) {
    if path.exists() {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let commit = git(&["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=AUTOPUSH_GIT_COMMIT={commit}");
    // A new commit moves the branch ref; a checkout changes HEAD.
    if let Some(git_dir) = git(&["rev-parse", "--absolute-git-dir"]) {
        rerun_if_exists(&PathBuf::from(git_dir).join("HEAD"));
    }
    if let (Some(common), Some(head_ref)) = (
        git(&["rev-parse", "--path-format=absolute", "--git-common-dir"]),
        git(&["symbolic-ref", "-q", "HEAD"]),
    ) {
        let common = PathBuf::from(common);
        rerun_if_exists(&common.join(head_ref));
        rerun_if_exists(&common.join("packed-refs"));
    }
}

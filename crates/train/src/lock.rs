//! One run per checkpoint directory: an exclusive lock on `DIR/.lock`,
//! held for the life of the process.
//!
//! The lock is the kernel's (`flock`), so it is released however the
//! holder ends, `kill -9` included, and a stale lock cannot block a new run.
//! The file also records who holds it (pid, host, start time), written
//! after the lock is taken, so that a refused second run can name the live
//! process, and a run that takes over a file left by a dead one can say so.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// The lock file inside a checkpoint directory.
pub const LOCK_FILE: &str = ".lock";

/// A held lock; dropping it (or the process ending) releases it.
#[derive(Debug)]
pub struct RunLock {
    file: File,
    path: PathBuf,
    /// Who held the file before, when that process had ended without removing it.
    pub took_over: Option<String>,
}

impl RunLock {
    /// Takes the lock of `dir` (created if missing), or refuses naming the
    /// process that holds it.
    pub fn acquire(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("--checkpoint-dir: creating {}", dir.display()))?;
        let path = dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("--checkpoint-dir: opening the lock file {}", path.display()))?;
        // SAFETY: `file` is open for the duration of the call; flock only
        // takes the descriptor and has no memory contract.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        let mut previous = String::new();
        let _ = file.read_to_string(&mut previous);
        let previous = previous.trim().to_string();
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                let holder = if previous.is_empty() { "another process".to_string() } else { previous };
                bail!(
                    "{} is in use by another training run ({holder}): two runs writing one checkpoint directory \
                     would overwrite each other's checkpoints and metrics; wait for it to end, stop it, or give this \
                     run another --checkpoint-dir",
                    dir.display()
                );
            }
            if matches!(err.raw_os_error(), Some(libc::ENOLCK | libc::EOPNOTSUPP | libc::ENOSYS)) {
                // A filesystem without locks (some network mounts): the run
                // goes on, said once, rather than being refused outright.
                eprintln!(
                    "note: the filesystem of {} does not support file locks ({err}): a second run on this \
                     checkpoint directory would not be refused",
                    dir.display()
                );
            } else {
                return Err(err).with_context(|| format!("locking {}", path.display()));
            }
        }
        let me = holder_line();
        file.set_len(0)
            .and_then(|()| file.seek(SeekFrom::Start(0)).map(|_| ()))
            .and_then(|()| file.write_all(format!("{me}\n").as_bytes()))
            .and_then(|()| file.sync_all())
            .with_context(|| format!("writing the lock file {}", path.display()))?;
        let took_over = (!previous.is_empty()).then_some(previous);
        Ok(RunLock { file, path, took_over })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for RunLock {
    /// A run that ends (an error included) empties the file while it still
    /// holds the lock; only a killed run leaves its line for the next to see.
    /// The file itself stays: removing it could let two runs lock two
    /// different files of the same name.
    fn drop(&mut self) {
        let _ = self.file.set_len(0);
    }
}

/// `pid 1234 on host gpu-7, started 2026-12-05 06:31:02 UTC`.
fn holder_line() -> String {
    let host = hostname().unwrap_or_else(|| "an unknown host".to_string());
    let started = chrono::Utc::now().format("%Y-%m-%d %H:%M:%S UTC");
    format!("pid {} on host {host}, started {started}", std::process::id())
}

fn hostname() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname writes at most
    // that many bytes.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Some(String::from_utf8_lossy(&buf[..end]).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_is_refused_naming_the_holder_and_a_released_one_is_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        let first = RunLock::acquire(dir.path()).unwrap();
        assert_eq!(first.took_over, None);
        let e = RunLock::acquire(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("in use by another training run") && e.contains(&format!("pid {}", std::process::id())),
            "{e}"
        );
        drop(first);
        // A run that ended leaves an empty file: no note.
        let second = RunLock::acquire(dir.path()).unwrap();
        assert_eq!(second.took_over, None);
        drop(second);
        // A killed run leaves its line; the kernel released its lock all the same.
        std::fs::write(dir.path().join(LOCK_FILE), "pid 4194999 on host elsewhere, started then\n").unwrap();
        let third = RunLock::acquire(dir.path()).unwrap();
        assert_eq!(third.took_over.as_deref(), Some("pid 4194999 on host elsewhere, started then"));
        let text = std::fs::read_to_string(third.path()).unwrap();
        assert!(
            text.starts_with(&format!("pid {} on host", std::process::id())) && text.lines().count() == 1,
            "{text}"
        );
    }
}

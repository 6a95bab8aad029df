//! The launcher of a `--gpus N` run (N > 1): the NCCL unique id in a
//! private file, N copies of this executable as rank processes (the same
//! arguments plus the hidden `--rank r --nccl-id FILE`), and their
//! supervision: the first rank that fails stops the others.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use stepgraph_cuda::nccl::NcclId;
use stepgraph_cuda::session::{device_count, gpu_available};

/// The arguments of rank `rank`'s process: the launcher's own, then the
/// hidden rank flags.
pub fn rank_args(own: &[OsString], rank: usize, id_file: &Path) -> Vec<OsString> {
    let mut a = own.to_vec();
    a.extend(["--rank".into(), rank.to_string().into(), "--nccl-id".into(), id_file.as_os_str().to_owned()]);
    a
}

/// A private file for the group's id, removed when dropped.
pub struct IdFile(pub PathBuf);

impl IdFile {
    pub fn create(id: &NcclId) -> Result<Self> {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
        let path = std::env::temp_dir().join(format!("stepgraph-nccl-{}-{nanos}.id", std::process::id()));
        id.write_file(&path)?;
        Ok(IdFile(path))
    }
}

impl Drop for IdFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The parent of a `--gpus N` run: checks, id, N rank processes, supervision.
pub fn launch(gpus: usize) -> Result<()> {
    let visible = if gpu_available() { device_count().unwrap_or(0) } else { 0 };
    if visible < gpus {
        bail!(
            "--gpus {gpus} needs {gpus} NVIDIA GPU{}, and this machine shows {visible}{}",
            if gpus == 1 { "" } else { "s" },
            if visible == 0 { " (no driver or no GPU): train on the CPU without --gpus" } else { "" }
        );
    }
    let id = NcclId::new().context("creating the NCCL unique id for the ranks")?;
    let id_file = IdFile::create(&id)?;
    let exe = std::env::current_exe().context("finding this executable to start the ranks")?;
    let own: Vec<OsString> = std::env::args_os().skip(1).collect();
    let mut children = Vec::with_capacity(gpus);
    // A signal to the launcher stops its ranks (see `supervise`) instead of
    // leaving them running without it.
    super::signals::install();
    for rank in 0..gpus {
        let child = Command::new(&exe)
            .args(rank_args(&own, rank, &id_file.0))
            .spawn()
            .with_context(|| format!("starting rank {rank} ({})", exe.display()));
        match child {
            Ok(c) => children.push(c),
            Err(e) => {
                stop_all(&mut children);
                return Err(e);
            }
        }
    }
    supervise(children, Duration::from_millis(100))
}

fn stop_all(children: &mut [Child]) {
    for c in children.iter_mut() {
        // Only the ranks this launcher started, by their handles.
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// Waits for every rank. The first that fails stops the others, and the
/// error names it with its exit status. SIGTERM or SIGINT to the launcher
/// stops every rank at once: the ranks of a data-parallel step must stop
/// after the same step, which they cannot agree on yet, so the run goes
/// back to its last checkpoint.
pub fn supervise(mut children: Vec<Child>, poll: Duration) -> Result<()> {
    let mut done: Vec<Option<ExitStatus>> = vec![None; children.len()];
    while done.iter().any(Option::is_none) {
        if let Some(signal) = super::signals::requested() {
            stop_all(&mut children);
            return Err(super::signals::Interrupted {
                signal,
                message: format!(
                    "stopped by {}: the {} ranks were stopped at once (a run over several GPUs does not finish its \
                     step first); continue from its last checkpoint with the same command and --resume auto",
                    super::signals::name(signal),
                    children.len()
                ),
            }
            .into());
        }
        for (rank, c) in children.iter_mut().enumerate() {
            if done[rank].is_some() {
                continue;
            }
            let status = match c.try_wait() {
                Ok(s) => s,
                Err(e) => {
                    stop_all(&mut children);
                    bail!("waiting for rank {rank}: {e}");
                }
            };
            if let Some(s) = status {
                done[rank] = Some(s);
                if !s.success() {
                    let others: Vec<usize> = (0..done.len()).filter(|&r| done[r].is_none()).collect();
                    stop_all(&mut children);
                    bail!(
                        "rank {rank} of {} failed ({s}){}; its error is above",
                        done.len(),
                        if others.is_empty() { String::new() } else { format!(", stopped ranks {others:?}") }
                    );
                }
            }
        }
        std::thread::sleep(poll);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use clap::Parser;

    use super::super::Role;
    use super::*;

    #[test]
    fn rank_processes_get_the_launchers_arguments_and_their_rank() {
        let own: Vec<OsString> = ["train", "--gpus", "2", "--batch", "4"].iter().map(OsString::from).collect();
        let a = rank_args(&own, 1, Path::new("/tmp/x.id"));
        let strs: Vec<&str> = a.iter().map(|s| s.to_str().unwrap()).collect();
        assert_eq!(strs, ["train", "--gpus", "2", "--batch", "4", "--rank", "1", "--nccl-id", "/tmp/x.id"]);
        // What a rank parses is its role.
        let t = crate::Cli::try_parse_from(std::iter::once(OsString::from("stepgraph")).chain(a)).unwrap();
        let crate::Command::Train { train, .. } = t.command else { panic!("not train") };
        assert_eq!(train.role(false).unwrap(), Role::Rank { rank: 1, world: 2, id_file: PathBuf::from("/tmp/x.id") });
    }

    #[test]
    fn the_id_file_round_trips_and_is_removed() {
        let id = NcclId(std::array::from_fn(|i| (i * 3) as u8));
        let path = {
            let f = IdFile::create(&id).unwrap();
            assert_eq!(NcclId::read_file(&f.0).unwrap(), id);
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                assert_eq!(std::fs::metadata(&f.0).unwrap().permissions().mode() & 0o777, 0o600);
            }
            f.0.clone()
        };
        assert!(!path.exists(), "the id file outlived the launcher");
    }

    fn sh(script: &str) -> Child {
        Command::new("sh").args(["-c", script]).spawn().unwrap()
    }

    #[test]
    fn a_failing_rank_stops_the_others() {
        supervise(vec![sh("exit 0"), sh("sleep 0.2")], Duration::from_millis(10)).unwrap();
        let t0 = Instant::now();
        let e = supervise(vec![sh("sleep 30"), sh("exit 3"), sh("sleep 30")], Duration::from_millis(10)).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("rank 1 of 3 failed") && msg.contains("stopped ranks [0, 2]"), "{msg}");
        assert!(t0.elapsed() < Duration::from_secs(10), "the other ranks were not stopped");
    }
}

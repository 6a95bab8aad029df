//! Checkpoints of a training run: one directory per step
//! (`DIR/step-000050/`) holding the weights (`weights.safetensors`), the
//! AdamW moments (`optimizer.safetensors`, or one
//! `optimizer-rank{r}-of-{n}.safetensors` per rank under ZeRO-1) and
//! `state.json`: the step, the schedule, the data cursor (which holds the
//! batch RNG's position), the loss, the settings a resume must match, and
//! the list of the checkpoint's files.
//!
//! **Atomicity.** A checkpoint is assembled in a hidden temporary directory
//! (`DIR/.step-000050.tmp-PID`): every file is written and fsynced, then
//! `state.json`, then the directory is renamed to its final name and `DIR`
//! is fsynced. A process killed at any point leaves either no `step-…`
//! directory or a complete one; [`CheckpointDir::complete`] also re-checks
//! that `state.json` parses and lists only files that exist, so a directory
//! damaged later (a half-finished deletion) is skipped. Under ZeRO-1 the
//! other ranks write their shards, each atomically, into
//! `DIR/.step-000050.shards/`, and rank 0 moves them in before the rename.
//!
//! **Keeping K.** Older checkpoints are deleted only after a newer one is
//! complete, each first renamed out of the `step-…` namespace so that a
//! deletion cut short never looks like a checkpoint.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::ValueKind;
use stepgraph_core::models::checkpoint::{read_safetensors, write_safetensors_atomic};
use stepgraph_core::session::Session;

use super::schedule::LrSchedule;

/// The file that makes a checkpoint directory one: written last.
pub const STATE_FILE: &str = "state.json";
/// The parameters, by their trace names.
pub const WEIGHTS_FILE: &str = "weights.safetensors";
/// The version of `state.json`'s layout.
const FORMAT: u32 = 1;

/// The AdamW moments' file: one for the whole state, or rank `r`'s shard.
pub fn optimizer_file(shard: Option<(usize, usize)>) -> String {
    match shard {
        None => "optimizer.safetensors".into(),
        Some((rank, world)) => format!("optimizer-rank{rank}-of-{world}.safetensors"),
    }
}

/// `state.json`: everything besides the tensors that a resume needs.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CheckpointState {
    pub format: u32,
    /// The last step whose update the weights hold.
    pub step: usize,
    /// The schedule the run was following, and the rate of `step`.
    pub schedule: LrSchedule,
    pub lr: f64,
    /// The loss of `step`.
    pub loss: f64,
    /// The data source's cursor after `step`'s batch.
    pub data: serde_json::Value,
    /// Settings a resumed run must share ([`check_compatible`]).
    pub run: BTreeMap<String, serde_json::Value>,
    /// Ranks whose optimizer shards the checkpoint holds (0: one unsharded file).
    pub shards: usize,
    /// Every file of the checkpoint besides `state.json`.
    pub files: Vec<String>,
}

impl CheckpointState {
    pub fn new(
        step: usize,
        schedule: LrSchedule,
        loss: f64,
        data: serde_json::Value,
        run: BTreeMap<String, serde_json::Value>,
        shards: usize,
    ) -> Self {
        let mut files = vec![WEIGHTS_FILE.to_string()];
        if shards == 0 {
            files.push(optimizer_file(None));
        } else {
            files.extend((0..shards).map(|r| optimizer_file(Some((r, shards)))));
        }
        CheckpointState { format: FORMAT, step, lr: schedule.at(step), schedule, loss, data, run, shards, files }
    }
}

/// A resumed run must match the checkpoint in every setting of `run`; the
/// error names the first that differs, with both values.
pub fn check_compatible(
    dir: &Path,
    saved: &BTreeMap<String, serde_json::Value>,
    now: &BTreeMap<String, serde_json::Value>,
) -> Result<()> {
    for (key, value) in now {
        match saved.get(key) {
            Some(old) if old == value => {}
            Some(old) => bail!(
                "cannot resume from {}: it was trained with {key} = {old}, this run has {key} = {value} \
                 (resume with the same setting, or start a new run in another --checkpoint-dir)",
                dir.display()
            ),
            None => bail!("cannot resume from {}: its state.json does not record `{key}`", dir.display()),
        }
    }
    Ok(())
}

/// The directory holding a run's checkpoints.
#[derive(Clone, Debug)]
pub struct CheckpointDir {
    pub root: PathBuf,
}

fn step_name(step: usize) -> String {
    format!("step-{step:06}")
}

fn sync_dir(dir: &Path) {
    // Some file systems refuse to fsync a directory; what was written is in
    // place either way, only its durability across a power cut is weaker.
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Reads `dir/state.json` and checks that every file it lists exists.
pub fn read_complete(dir: &Path) -> Result<CheckpointState> {
    let path = dir.join(STATE_FILE);
    let text = fs::read_to_string(&path)
        .with_context(|| format!("{} is not a complete checkpoint: reading {}", dir.display(), path.display()))?;
    let state: CheckpointState = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a checkpoint state (state.json of stepgraph train)", path.display()))?;
    if state.format != FORMAT {
        bail!("{} has checkpoint format {}, this stepgraph reads format {FORMAT}", path.display(), state.format);
    }
    let missing: Vec<&str> = state.files.iter().map(String::as_str).filter(|f| !dir.join(f).is_file()).collect();
    if !missing.is_empty() {
        bail!("{} is not a complete checkpoint: it lacks {}", dir.display(), missing.join(", "));
    }
    Ok(state)
}

impl CheckpointDir {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        CheckpointDir { root: root.into() }
    }

    pub fn step_dir(&self, step: usize) -> PathBuf {
        self.root.join(step_name(step))
    }

    fn shard_dir(&self, step: usize) -> PathBuf {
        self.root.join(format!(".{}.shards", step_name(step)))
    }

    /// Complete checkpoints, oldest first; torn and foreign directories are skipped.
    pub fn complete(&self) -> Result<Vec<(usize, PathBuf)>> {
        let entries = match fs::read_dir(&self.root) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e).with_context(|| format!("listing checkpoints in {}", self.root.display())),
        };
        let mut found = Vec::new();
        for entry in entries {
            let entry = entry.with_context(|| format!("listing checkpoints in {}", self.root.display()))?;
            let name = entry.file_name();
            let Some(step) = name.to_str().and_then(|n| n.strip_prefix("step-")).and_then(|s| s.parse().ok()) else {
                continue;
            };
            let dir = entry.path();
            if read_complete(&dir).is_ok_and(|s| s.step == step) {
                found.push((step, dir));
            }
        }
        found.sort();
        Ok(found)
    }

    /// The newest complete checkpoint.
    pub fn newest(&self) -> Result<Option<(usize, PathBuf)>> {
        Ok(self.complete()?.pop())
    }

    /// Removes what killed saves left behind: temporary checkpoint
    /// directories and shard folders. Call before the first step, when no
    /// save of this run is under way.
    pub fn clean_leftovers(&self) -> Result<()> {
        let Ok(entries) = fs::read_dir(&self.root) else { return Ok(()) };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let leftover = name.starts_with(".step-")
                && (name.contains(".tmp-") || name.ends_with(".shards") || name.contains(".deleting-"));
            if leftover {
                fs::remove_dir_all(entry.path())
                    .with_context(|| format!("removing a torn checkpoint {}", entry.path().display()))?;
            }
        }
        Ok(())
    }

    /// Rank `rank` of `world` (> 0) writes its optimizer shard for rank 0 to collect.
    pub fn write_shard(&self, step: usize, rank: usize, world: usize, state: &[(String, HostTensor)]) -> Result<()> {
        let dir = self.shard_dir(step);
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        write_safetensors_atomic(&dir.join(optimizer_file(Some((rank, world)))), state)?;
        Ok(())
    }

    /// Writes a complete checkpoint of `state.step` (see the module doc) and
    /// returns its directory. `optimizer` is this process's moments: all of
    /// them, or with `state.shards > 0` rank 0's shard, the other ranks'
    /// shards being awaited (up to `shard_wait`) in the shard folder.
    pub fn save(
        &self,
        state: &CheckpointState,
        weights: &[(String, HostTensor)],
        optimizer: &[(String, HostTensor)],
        shard_wait: Duration,
    ) -> Result<PathBuf> {
        let step = state.step;
        let dest = self.step_dir(step);
        if dest.exists() {
            bail!("{} already exists: a checkpoint is never overwritten", dest.display());
        }
        fs::create_dir_all(&self.root)
            .with_context(|| format!("creating the checkpoint directory {}", self.root.display()))?;
        let tmp = self.root.join(format!(".{}.tmp-{}", step_name(step), std::process::id()));
        if tmp.exists() {
            fs::remove_dir_all(&tmp).with_context(|| format!("removing {}", tmp.display()))?;
        }
        fs::create_dir(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        let written = (|| -> Result<()> {
            write_safetensors_atomic(&tmp.join(WEIGHTS_FILE), weights)?;
            let own = optimizer_file(if state.shards == 0 { None } else { Some((0, state.shards)) });
            write_safetensors_atomic(&tmp.join(own), optimizer)?;
            if state.shards > 1 {
                self.collect_shards(step, state.shards, &tmp, shard_wait)?;
            }
            let path = tmp.join(STATE_FILE);
            let mut f = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
            f.write_all(serde_json::to_string_pretty(state)?.as_bytes())
                .and_then(|()| f.sync_all())
                .with_context(|| format!("writing {}", path.display()))?;
            sync_dir(&tmp);
            fs::rename(&tmp, &dest).with_context(|| format!("renaming {} to {}", tmp.display(), dest.display()))?;
            sync_dir(&self.root);
            Ok(())
        })();
        if let Err(e) = written {
            let _ = fs::remove_dir_all(&tmp);
            return Err(e.context(format!("saving the checkpoint of step {step} in {}", self.root.display())));
        }
        Ok(dest)
    }

    /// Moves the shards of ranks 1.. into `into`, waiting for them.
    fn collect_shards(&self, step: usize, world: usize, into: &Path, wait: Duration) -> Result<()> {
        let dir = self.shard_dir(step);
        let start = Instant::now();
        for rank in 1..world {
            let name = optimizer_file(Some((rank, world)));
            let from = dir.join(&name);
            while !from.is_file() {
                if start.elapsed() > wait {
                    bail!(
                        "rank {rank} did not write its optimizer shard {} within {:.0} s",
                        from.display(),
                        wait.as_secs_f64()
                    );
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            fs::rename(&from, into.join(&name)).with_context(|| format!("moving {}", from.display()))?;
        }
        let _ = fs::remove_dir(&dir);
        Ok(())
    }

    /// Deletes all but the newest `keep` complete checkpoints; returns what it deleted.
    pub fn prune(&self, keep: usize) -> Result<Vec<PathBuf>> {
        let complete = self.complete()?;
        let excess = complete.len().saturating_sub(keep.max(1));
        let mut deleted = Vec::new();
        for (step, dir) in complete.into_iter().take(excess) {
            let doomed = self.root.join(format!(".{}.deleting-{}", step_name(step), std::process::id()));
            fs::rename(&dir, &doomed).with_context(|| format!("retiring the old checkpoint {}", dir.display()))?;
            fs::remove_dir_all(&doomed).with_context(|| format!("deleting {}", doomed.display()))?;
            deleted.push(dir);
        }
        if !deleted.is_empty() {
            sync_dir(&self.root);
        }
        Ok(deleted)
    }
}

/// Parameters (`ValueKind::Param`) or optimizer state (`ValueKind::State`)
/// of a session, by name.
pub fn read_leaves(session: &mut dyn Session, params: bool) -> Result<Vec<(String, HostTensor)>> {
    let trace = session.trace().clone();
    let mut out = Vec::new();
    for v in trace.leaves() {
        let name = match &trace.value(v).kind {
            ValueKind::Param { name } if params => name,
            ValueKind::State { name } if !params => name,
            _ => continue,
        };
        out.push((name.clone(), session.read(v)?));
    }
    Ok(out)
}

/// Writes the tensors of `file` into the session's leaves of the same
/// names (parameters or state); every such leaf must be in the file.
pub fn load_leaves(session: &mut dyn Session, file: &Path, params: bool) -> Result<()> {
    let tensors: BTreeMap<String, HostTensor> = read_safetensors(file)?.into_iter().collect();
    let trace = session.trace().clone();
    for v in trace.leaves() {
        let name = match &trace.value(v).kind {
            ValueKind::Param { name } if params => name,
            ValueKind::State { name } if !params => name,
            _ => continue,
        };
        let t = tensors.get(name).with_context(|| format!("{} has no tensor `{name}`", file.display()))?;
        session.write(v, t).with_context(|| format!("restoring `{name}` from {}", file.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use stepgraph_core::ir::{DType, TensorType};

    fn temp_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("stepgraph-ckpt-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    fn tensor(x: f64) -> Vec<(String, HostTensor)> {
        vec![("w".into(), HostTensor::from_f64(TensorType::new(DType::F32, [2]), &[x, -x]))]
    }

    fn state(step: usize, shards: usize) -> CheckpointState {
        let schedule = LrSchedule::new(1e-3, 1, 1e-4, 100).unwrap();
        let run = BTreeMap::from([("batch".to_string(), serde_json::json!(2))]);
        CheckpointState::new(step, schedule, 1.5, serde_json::json!({"pos": step}), run, shards)
    }

    #[test]
    fn saves_are_complete_listed_and_pruned_oldest_first() {
        let d = CheckpointDir::new(temp_dir("prune"));
        for step in [5, 10, 15] {
            d.save(&state(step, 0), &tensor(step as f64), &tensor(0.5), Duration::ZERO).unwrap();
        }
        let steps: Vec<usize> = d.complete().unwrap().iter().map(|c| c.0).collect();
        assert_eq!(steps, [5, 10, 15]);
        let back = read_complete(&d.step_dir(10)).unwrap();
        assert_eq!(back, state(10, 0));
        let w = read_safetensors(&d.step_dir(10).join(WEIGHTS_FILE)).unwrap();
        assert_eq!(w[0].1.to_f64(), [10.0, -10.0]);
        assert_eq!(d.prune(2).unwrap(), [d.step_dir(5)]);
        assert_eq!(d.newest().unwrap().unwrap().0, 15);
        let e = d.save(&state(15, 0), &tensor(1.0), &tensor(1.0), Duration::ZERO).unwrap_err().to_string();
        assert!(e.contains("already exists"), "{e}");
        fs::remove_dir_all(&d.root).unwrap();
    }

    #[test]
    fn torn_checkpoints_are_skipped_and_cleaned() {
        let d = CheckpointDir::new(temp_dir("torn"));
        d.save(&state(3, 0), &tensor(3.0), &tensor(0.0), Duration::ZERO).unwrap();
        // A checkpoint directory that lost a file, one without state.json,
        // one whose state.json is cut short, and a save killed half-way.
        let lost = d.save(&state(4, 0), &tensor(4.0), &tensor(0.0), Duration::ZERO).unwrap();
        fs::remove_file(lost.join(WEIGHTS_FILE)).unwrap();
        fs::create_dir_all(d.step_dir(5)).unwrap();
        fs::create_dir_all(d.step_dir(6)).unwrap();
        fs::write(d.step_dir(6).join(STATE_FILE), "{\"format\": 1, \"st").unwrap();
        let killed = d.root.join(".step-000007.tmp-99999");
        fs::create_dir_all(&killed).unwrap();
        assert_eq!(d.newest().unwrap().unwrap().0, 3);
        let e = read_complete(&lost).unwrap_err().to_string();
        assert!(e.contains("lacks weights.safetensors"), "{e}");
        d.clean_leftovers().unwrap();
        assert!(!killed.exists());
        fs::remove_dir_all(&d.root).unwrap();
    }

    #[test]
    fn zero1_shards_of_other_ranks_are_collected_before_the_checkpoint_is_complete() {
        let d = CheckpointDir::new(temp_dir("shards"));
        let other = d.clone();
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            other.write_shard(8, 1, 2, &tensor(2.0)).unwrap();
        });
        let dir = d.save(&state(8, 2), &tensor(8.0), &tensor(1.0), Duration::from_secs(20)).unwrap();
        writer.join().unwrap();
        let s = read_complete(&dir).unwrap();
        assert_eq!(s.files, [WEIGHTS_FILE, "optimizer-rank0-of-2.safetensors", "optimizer-rank1-of-2.safetensors"]);
        let shard = read_safetensors(&dir.join(optimizer_file(Some((1, 2))))).unwrap();
        assert_eq!(shard[0].1.to_f64(), [2.0, -2.0]);
        // A rank that never writes: the save fails and leaves nothing that looks complete.
        let e = d.save(&state(9, 2), &tensor(9.0), &tensor(1.0), Duration::from_millis(50)).unwrap_err();
        assert!(format!("{e:#}").contains("rank 1 did not write its optimizer shard"), "{e:#}");
        assert_eq!(d.newest().unwrap().unwrap().0, 8);
        fs::remove_dir_all(&d.root).unwrap();
    }

    #[test]
    fn a_different_setting_is_named_with_both_values() {
        let saved = BTreeMap::from([("batch".to_string(), serde_json::json!(4)), ("seq".into(), 16.into())]);
        let mut now = saved.clone();
        check_compatible(Path::new("ck/step-000002"), &saved, &now).unwrap();
        now.insert("batch".into(), 2.into());
        let e = check_compatible(Path::new("ck/step-000002"), &saved, &now).unwrap_err().to_string();
        assert!(e.contains("ck/step-000002") && e.contains("batch = 4") && e.contains("batch = 2"), "{e}");
    }
}

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

use crate::divergence::DivergenceMonitor;
use crate::schedule::LrSchedule;

/// The file that makes a checkpoint directory one: written last.
pub const STATE_FILE: &str = "state.json";
/// The parameters, by their trace names.
pub const WEIGHTS_FILE: &str = "weights.safetensors";
/// The version of `state.json`'s layout.
/// Format 2 records the whole run configuration in `run`; format 1 (still
/// read) recorded a hand-kept list of settings.
pub const FORMAT: u32 = 2;

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
    /// The divergence check's state after `step`, for a resumed run to go
    /// on with (absent in checkpoints of format 1).
    #[serde(default)]
    pub divergence: Option<DivergenceMonitor>,
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
        CheckpointState {
            format: FORMAT,
            step,
            lr: schedule.at(step),
            schedule,
            loss,
            data,
            run,
            shards,
            files,
            divergence: None,
        }
    }
}

/// A resumed run must match the checkpoint in every setting of `run` (the
/// whole configuration, flattened to dotted keys: `step.f32_products`,
/// `model.config.n_layer`, `switches.gemm_tiled`); the error
/// names the first that differs, with both values. A setting one side
/// records and the other does not (a stepgraph of another version) is a
/// difference too, except the settings added since ([`ADDED_SETTINGS`]):
/// a run saved before one existed ran as its value there says (before
/// packing was a choice the stream was packed; before `--fp8` no product
/// was FP8), and is taken to have said so.
///
/// Checkpoints of format 1 recorded a shorter list under other keys: they
/// are checked on `legacy`, the same list as it was, and the caller says
/// that the rest could not be checked.
pub fn check_compatible(
    dir: &Path,
    saved: &CheckpointState,
    now: &BTreeMap<String, serde_json::Value>,
    legacy: &BTreeMap<String, serde_json::Value>,
) -> Result<()> {
    let now = if saved.format == 1 { legacy } else { now };
    let mut run = saved.run.clone();
    for (key, before) in ADDED_SETTINGS {
        if saved.format > 1 && now.contains_key(*key) {
            run.entry(key.to_string()).or_insert_with(|| (*before).into());
        }
    }
    let keys: std::collections::BTreeSet<&String> = run.keys().chain(now.keys()).collect();
    for key in keys {
        match (run.get(key), now.get(key)) {
            (Some(old), Some(value)) if old == value => {}
            (Some(old), Some(value)) => bail!(
                "cannot resume from {}: it was trained with {key} = {old}, this run has {key} = {value}; a resumed \
                 run must be the same run to continue it bit for bit (resume with the same setting, or start a new \
                 run in another --checkpoint-dir)",
                dir.display()
            ),
            (None, Some(value)) => bail!(
                "cannot resume from {}: its state.json does not record `{key}` (this run has {value}); it was \
                 written by another version of stepgraph: continue it with that version, or start a new run",
                dir.display()
            ),
            (Some(old), None) => bail!(
                "cannot resume from {}: it was trained with {key} = {old}, a setting this stepgraph does not have; \
                 continue it with the version that wrote it, or start a new run",
                dir.display()
            ),
            (None, None) => unreachable!("the key came from one of the maps"),
        }
    }
    Ok(())
}

/// The resume-identity key of `--packing`.
const PACKING_KEY: &str = "data.packing";

/// Settings added to the resume identity after its format 2, each with the
/// value every run saved before it had.
const ADDED_SETTINGS: &[(&str, &str)] = &[(PACKING_KEY, "stream"), ("step.fp8", "off")];

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
    if !(1..=FORMAT).contains(&state.format) {
        bail!("{} has checkpoint format {}, this stepgraph reads formats 1 to {FORMAT}", path.display(), state.format);
    }
    let missing: Vec<&str> = state.files.iter().map(String::as_str).filter(|f| !dir.join(f).is_file()).collect();
    if !missing.is_empty() {
        bail!("{} is not a complete checkpoint: it lacks {}", dir.display(), missing.join(", "));
    }
    for file in &state.files {
        check_safetensors_length(&dir.join(file))
            .with_context(|| format!("{} is not a complete checkpoint", dir.display()))?;
    }
    Ok(state)
}

/// Checks that a safetensors file is as long as its header says: a file
/// cut short (a full disk, a copy interrupted) is caught here, by reading
/// the header only, instead of half-way through a resume.
fn check_safetensors_length(path: &Path) -> Result<()> {
    use std::io::Read;
    let mut f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let len = f.metadata().with_context(|| format!("reading {}", path.display()))?.len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n).with_context(|| format!("{} is cut short: {len} bytes, no header", path.display()))?;
    let header_len = u64::from_le_bytes(n);
    if header_len > len.saturating_sub(8) {
        bail!("{} is cut short: {len} bytes for a header of {header_len}", path.display());
    }
    let mut header = vec![0u8; header_len as usize];
    f.read_exact(&mut header).with_context(|| format!("reading the header of {}", path.display()))?;
    let header: serde_json::Value =
        serde_json::from_slice(&header).with_context(|| format!("{} has a damaged header", path.display()))?;
    let data_end =
        header.as_object().into_iter().flatten().filter_map(|(_, t)| t["data_offsets"][1].as_u64()).max().unwrap_or(0);
    let expected = 8 + header_len + data_end;
    if len != expected {
        bail!("{} is {len} bytes where its header describes {expected}: the file is damaged", path.display());
    }
    Ok(())
}

/// What a checkpoint directory holds: its complete checkpoints, oldest
/// first, and the `step-…` directories that are not.
#[derive(Clone, Debug, Default)]
pub struct Scan {
    pub complete: Vec<(usize, PathBuf)>,
    pub damaged: Vec<Damaged>,
}

/// The checkpoint a run continues from, if any, and the damaged
/// directories moved aside, each with its new name.
pub type ResumePoint = (Option<PathBuf>, Vec<(Damaged, PathBuf)>);

/// A `step-…` directory that is not a usable checkpoint, and why.
#[derive(Clone, Debug)]
pub struct Damaged {
    pub dir: PathBuf,
    pub reason: String,
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
        Ok(self.scan()?.complete)
    }

    /// Complete checkpoints, oldest first, and the `step-…` directories that
    /// are not (cut short, a file missing, a state of another step), with why.
    pub fn scan(&self) -> Result<Scan> {
        let entries = match fs::read_dir(&self.root) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Scan::default()),
            Err(e) => return Err(e).with_context(|| format!("listing checkpoints in {}", self.root.display())),
        };
        let (mut found, mut damaged) = (Vec::new(), Vec::new());
        for entry in entries {
            let entry = entry.with_context(|| format!("listing checkpoints in {}", self.root.display()))?;
            let name = entry.file_name();
            let Some(step) = name.to_str().and_then(|n| n.strip_prefix("step-")).and_then(|s| s.parse().ok()) else {
                continue;
            };
            let dir = entry.path();
            match read_complete(&dir) {
                Ok(s) if s.step == step => found.push((step, dir)),
                Ok(s) => damaged.push(Damaged { dir, reason: format!("its state.json is of step {}", s.step) }),
                Err(e) => damaged.push(Damaged { dir, reason: format!("{e:#}") }),
            }
        }
        found.sort();
        damaged.sort_by(|a, b| a.dir.cmp(&b.dir));
        Ok(Scan { complete: found, damaged })
    }

    /// Moves a damaged checkpoint out of the `step-…` namespace, to
    /// `step-NNNNNN.damaged` (kept for the user to inspect, never read as a
    /// checkpoint), so that the run can save that step again.
    pub fn set_aside(&self, damaged: &Path) -> Result<PathBuf> {
        let name = damaged.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let mut to = self.root.join(format!("{name}.damaged"));
        let mut n = 1;
        while to.exists() {
            n += 1;
            to = self.root.join(format!("{name}.damaged-{n}"));
        }
        fs::rename(damaged, &to)
            .with_context(|| format!("moving the damaged checkpoint {} aside", damaged.display()))?;
        sync_dir(&self.root);
        Ok(to)
    }

    /// The newest complete checkpoint.
    pub fn newest(&self) -> Result<Option<(usize, PathBuf)>> {
        Ok(self.complete()?.pop())
    }

    /// The checkpoint a run continues from: the newest complete one. With
    /// `set_aside` (the process that saves), the damaged `step-…`
    /// directories newer than it are moved aside ([`CheckpointDir::set_aside`])
    /// so that saving their step again finds the name free; each is
    /// returned with where it went.
    pub fn resume_point(&self, set_aside: bool) -> Result<ResumePoint> {
        let Scan { complete, damaged } = self.scan()?;
        let newest = complete.last().cloned();
        let mut moved = Vec::new();
        for d in damaged {
            let newer = d.dir.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_prefix("step-"));
            let newer = newer
                .and_then(|n| n.parse::<usize>().ok())
                .is_some_and(|s| newest.as_ref().is_none_or(|(n, _)| s > *n));
            if newer && set_aside {
                let kept = self.set_aside(&d.dir)?;
                moved.push((d, kept));
            }
        }
        Ok((newest.map(|(_, p)| p), moved))
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
            if read_complete(&dest).is_ok_and(|s| s.step == step) {
                bail!("{} already exists: a checkpoint is never overwritten", dest.display());
            }
            // A damaged directory of this step (the run skipped it when it
            // resumed): kept under another name, not overwritten.
            self.set_aside(&dest)?;
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

    /// Deletes all but the newest `keep` complete checkpoints, and never the
    /// newest one at or before step `protect` (the last saved before a
    /// divergence began); returns what it deleted.
    pub fn prune(&self, keep: usize, protect: Option<usize>) -> Result<Vec<PathBuf>> {
        let complete = self.complete()?;
        let protected = protect.and_then(|p| complete.iter().rev().find(|(s, _)| *s <= p).map(|(s, _)| *s));
        let excess = complete.len().saturating_sub(keep.max(1));
        let mut deleted = Vec::new();
        for (step, dir) in complete.into_iter().take(excess) {
            if Some(step) == protected {
                continue;
            }
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
        if let Some((i, x)) = t.first_non_finite() {
            bail!(
                "{} holds {x} in `{name}` (element {i}): the checkpoint is damaged (a training run never saves a \
                 non-finite value); resume from an older checkpoint with --resume DIR/step-NNNNNN",
                file.display()
            );
        }
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
        assert_eq!(d.prune(2, None).unwrap(), [d.step_dir(5)]);
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
        let mut saved = state(2, 0);
        saved.run =
            BTreeMap::from([("model.batch".to_string(), serde_json::json!(4)), ("model.seq".into(), 16.into())]);
        let mut now = saved.run.clone();
        let dir = Path::new("ck/step-000002");
        check_compatible(dir, &saved, &now, &BTreeMap::new()).unwrap();
        now.insert("model.batch".into(), 2.into());
        let e = check_compatible(dir, &saved, &now, &BTreeMap::new()).unwrap_err().to_string();
        assert!(e.contains("ck/step-000002") && e.contains("model.batch = 4") && e.contains("model.batch = 2"), "{e}");
        // A setting only one side records is a difference too, either way round.
        let mut added = saved.run.clone();
        added.insert("step.f32_products".into(), "exact".into());
        let e = check_compatible(dir, &saved, &added, &BTreeMap::new()).unwrap_err().to_string();
        assert!(e.contains("does not record `step.f32_products`"), "{e}");
        // A run saved before `--fp8` existed had no FP8 products: it resumes
        // as `step.fp8 = off`, and not with FP8 products.
        let mut fp8 = saved.run.clone();
        fp8.insert("step.fp8".into(), "off".into());
        check_compatible(dir, &saved, &fp8, &BTreeMap::new()).unwrap();
        fp8.insert("step.fp8".into(), "products".into());
        let e = check_compatible(dir, &saved, &fp8, &BTreeMap::new()).unwrap_err().to_string();
        assert!(e.contains("step.fp8 = \"off\"") && e.contains("step.fp8 = \"products\""), "{e}");
        let mut fewer = saved.run.clone();
        fewer.remove("model.seq");
        let e = check_compatible(dir, &saved, &fewer, &BTreeMap::new()).unwrap_err().to_string();
        assert!(e.contains("model.seq = 16"), "{e}");
        // A format-1 checkpoint is checked on the settings it recorded.
        saved.format = 1;
        saved.run = BTreeMap::from([("batch".to_string(), serde_json::json!(4))]);
        let legacy = saved.run.clone();
        check_compatible(dir, &saved, &now, &legacy).unwrap();
    }

    #[test]
    fn pruning_keeps_the_last_checkpoint_before_a_divergence() {
        let d = CheckpointDir::new(temp_dir("protect"));
        for step in [5, 10, 15, 20, 25] {
            d.save(&state(step, 0), &tensor(step as f64), &tensor(0.5), Duration::ZERO).unwrap();
        }
        // The best loss was at step 12: step 10's checkpoint survives --keep 2.
        assert_eq!(d.prune(2, Some(12)).unwrap(), [d.step_dir(5), d.step_dir(15)]);
        let steps: Vec<usize> = d.complete().unwrap().iter().map(|c| c.0).collect();
        assert_eq!(steps, [10, 20, 25]);
        fs::remove_dir_all(&d.root).unwrap();
    }

    #[test]
    fn damaged_checkpoints_are_reported_and_set_aside_when_their_step_is_saved_again() {
        let d = CheckpointDir::new(temp_dir("damaged"));
        d.save(&state(10, 0), &tensor(10.0), &tensor(0.5), Duration::ZERO).unwrap();
        let cut = d.save(&state(15, 0), &tensor(15.0), &tensor(0.5), Duration::ZERO).unwrap();
        let weights = cut.join(WEIGHTS_FILE);
        let len = fs::metadata(&weights).unwrap().len();
        File::options().write(true).open(&weights).unwrap().set_len(len - 3).unwrap();
        // A directory renamed by hand: its state is of another step.
        let moved = d.save(&state(20, 0), &tensor(20.0), &tensor(0.5), Duration::ZERO).unwrap();
        fs::rename(&moved, d.step_dir(25)).unwrap();
        let Scan { complete, damaged } = d.scan().unwrap();
        assert_eq!(complete.iter().map(|c| c.0).collect::<Vec<_>>(), [10]);
        assert_eq!(damaged.len(), 2);
        assert!(
            damaged[0].reason.contains("weights.safetensors") && damaged[0].reason.contains("damaged"),
            "{damaged:?}"
        );
        assert!(damaged[1].reason.contains("state.json is of step 20"), "{damaged:?}");
        // Saving step 15 again keeps the damaged one under another name.
        d.save(&state(15, 0), &tensor(15.0), &tensor(0.5), Duration::ZERO).unwrap();
        assert!(d.root.join("step-000015.damaged").join(WEIGHTS_FILE).is_file());
        assert_eq!(d.newest().unwrap().unwrap().0, 15);
        fs::remove_dir_all(&d.root).unwrap();
    }

    #[test]
    fn a_non_finite_tensor_in_a_checkpoint_is_named_with_its_file() {
        use stepgraph_core::autodiff::StepKind;
        use stepgraph_core::models::{LossKind, ModelSpec};
        use stepgraph_core::pipeline::{compile_step, StepOptions};
        let spec = ModelSpec::named("tiny-llama", 1, 8, DType::F32, LossKind::CrossEntropy).unwrap();
        let c = compile_step(&spec, &StepOptions::new(StepKind::Train)).unwrap();
        let mut session = stepgraph_core::cpu::exec::CpuSession::new(c.step, c.plan).unwrap();
        session.zero_state().unwrap();
        let mut state = read_leaves(&mut session, false).unwrap();
        let (name, t) = &mut state[3];
        let name = name.clone();
        let mut values = t.to_f64();
        values[5] = f64::INFINITY;
        *t = HostTensor::from_f64(t.ty.clone(), &values);
        let d = temp_dir("nan");
        fs::create_dir_all(&d).unwrap();
        let file = d.join("optimizer.safetensors");
        write_safetensors_atomic(&file, &state).unwrap();
        let e = load_leaves(&mut session, &file, false).unwrap_err().to_string();
        assert!(e.contains(&format!("inf in `{name}` (element 5)")) && e.contains("optimizer.safetensors"), "{e}");
        fs::remove_dir_all(&d).unwrap();
    }
}

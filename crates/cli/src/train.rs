//! `stepgraph train`: byte-level training on a text file, on the CPU backend
//! or, with `--gpus N`, data-parallel on N GPUs through NCCL.
//!
//! **The launcher.** `train --gpus N` (no `--rank`) is the parent: it checks
//! the arguments and the GPUs, creates the NCCL unique id, writes it as hex
//! to a private temporary file, and starts N copies of its own executable
//! with the same arguments plus the hidden `--rank r --nccl-id FILE`. Rank
//! `r` runs on CUDA device `r`, builds its step of the data-parallel trace
//! ([`stepgraph_core::pipeline::compile_step`] with the group's
//! [`DataParallel`]), writes the same initial
//! weights as every rank (the same seed), and trains on its rows of the same
//! global batch (every rank draws the global batch from the same seeded
//! generator). Only rank 0 prints. The parent waits for every rank; when one
//! fails it stops the others and fails naming that rank.
//!
//! On the GPU the first step runs eagerly (NCCL connects the ranks at their
//! first collectives) and the rest replay one captured CUDA graph of the
//! step, collectives included; `--eager` runs every step eagerly. The
//! collectives run in order on the compute stream, or with `--overlap` on a
//! second stream that rejoins the compute stream where their bytes are next
//! touched ([`stepgraph_cuda::overlap`]).
//!
//! The backend is chosen once, when the session opens; the training loop
//! drives a `dyn Session` and only knows from which step on it replays.

use std::ffi::OsString;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use rand::{Rng, SeedableRng};

use stepgraph_core::autodiff::{StepKind, TrainOptions, LR_INPUT, STEP_INPUT};
use stepgraph_core::cpu::exec::{scalar_input, CpuSession};
use stepgraph_core::dist::{rank_batch, shard_rows, DataParallel, DEFAULT_BUCKET_BYTES};
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, TensorType, Trace};
use stepgraph_core::models::gpt::{TARGETS_INPUT, TOKENS_INPUT};
use stepgraph_core::models::{init_params, ModelSpec};
use stepgraph_core::pipeline::{compile_step, trace_step, CompiledStep, StepOptions};
use stepgraph_core::session::Session;
use stepgraph_cuda::nccl::{NcclGroup, NcclId};
use stepgraph_cuda::session::{device_count, gpu_available, CudaOptions, CudaSession, RankOptions};

use crate::memory_args::{free_bytes, MemoryArgs};
use crate::{LossArg, ModelArgs};

/// `stepgraph train`'s own flags (the model flags are shared).
#[derive(Args, Clone, Debug)]
pub struct TrainArgs {
    /// Text to train on.
    #[arg(long, default_value = "data/tiny.txt")]
    pub data: PathBuf,
    /// Optimizer steps.
    #[arg(long, default_value_t = 200)]
    pub steps: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f64,
    /// Linear warm-up steps.
    #[arg(long, default_value_t = 10)]
    pub warmup: usize,
    /// Fail (exit non-zero) when the loss diverges: the mean of the last
    /// ten losses above twice the first; without it a warning is printed.
    #[arg(long)]
    pub fail_on_divergence: bool,
    /// When stderr is not a terminal, log the loss every N steps (0: never).
    #[arg(long, default_value_t = 10)]
    pub log_every: usize,
    /// Seed for initial weights and batch sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Train data-parallel on N GPUs through NCCL, one process per GPU
    /// (`--batch` is the global batch, split by rows); 1 runs on one GPU.
    #[arg(long)]
    pub gpus: Option<usize>,
    /// With --gpus: shard the AdamW state over the GPUs (ZeRO-1).
    #[arg(long, requires = "gpus")]
    pub zero1: bool,
    /// With --gpus: gradient bucket size in MiB, like PyTorch DDP's bucket_cap_mb [default: 25].
    #[arg(long, requires = "gpus")]
    pub bucket_mb: Option<f64>,
    /// With --gpus: run every step eagerly instead of replaying a captured CUDA graph.
    #[arg(long, requires = "gpus")]
    pub eager: bool,
    /// With --gpus: run the collectives on a second stream, overlapping the
    /// backward work that does not touch their gradients.
    #[arg(long, requires = "gpus")]
    pub overlap: bool,
    /// Set by the launcher: this process is rank R (on GPU R) of a --gpus run.
    #[arg(long, hide = true, requires_all = ["gpus", "nccl_id"])]
    pub rank: Option<usize>,
    /// Set by the launcher: the file holding the group's NCCL unique id (hex).
    #[arg(long, hide = true, requires = "rank")]
    pub nccl_id: Option<PathBuf>,
}

/// What this process does.
#[derive(Clone, Debug, PartialEq)]
pub enum Role {
    /// Train on the CPU backend.
    Cpu,
    /// Start `gpus` rank processes and wait for them.
    Launcher { gpus: usize },
    /// Rank `rank` of `world`, joining the group through the id in `id_file`.
    Rank { rank: usize, world: usize, id_file: PathBuf },
}

impl TrainArgs {
    pub fn role(&self) -> Result<Role> {
        match (self.gpus, self.rank, &self.nccl_id) {
            (None, _, _) => Ok(Role::Cpu),
            (Some(0), _, _) => bail!("--gpus must be at least 1"),
            (Some(gpus), None, _) => Ok(Role::Launcher { gpus }),
            (Some(world), Some(rank), Some(id)) if rank < world => Ok(Role::Rank { rank, world, id_file: id.clone() }),
            (Some(world), Some(rank), Some(_)) => bail!("--rank {rank} is outside a group of {world} GPUs"),
            (Some(_), Some(_), None) => bail!("--rank needs --nccl-id (both are set by the launcher)"),
        }
    }

    pub fn data_parallel(&self, world: usize) -> Result<DataParallel> {
        let bucket_bytes = match self.bucket_mb {
            None => DEFAULT_BUCKET_BYTES,
            Some(mb) if mb.is_finite() && mb * 1048576.0 >= 1.0 => (mb * 1048576.0).round() as u64,
            Some(mb) => bail!("--bucket-mb must be a positive size in MiB, got {mb}"),
        };
        Ok(DataParallel { world, bucket_bytes, zero1: self.zero1 })
    }
}

/// `stepgraph train`.
pub fn run(model: &ModelArgs, train: TrainOptions, args: &TrainArgs, memory: &MemoryArgs) -> Result<()> {
    let role = args.role()?;
    if args.steps == 0 {
        bail!("--steps 0 trains nothing: ask for at least 1 step");
    }
    if !(args.lr.is_finite() && args.lr >= 0.0) {
        bail!("--lr must be a finite non-negative learning rate, got {}", args.lr);
    }
    if !matches!(model.loss, LossArg::Ce) {
        bail!("training needs the cross-entropy loss (--loss ce)");
    }
    let text = std::fs::read(&args.data).with_context(|| format!("reading training text {}", args.data.display()))?;
    let spec = model.spec()?;
    if spec.config.vocab_size < 256 {
        bail!(
            "byte-level training needs a vocabulary of at least 256 tokens; `{}` has {}",
            spec.config.name,
            spec.config.vocab_size
        );
    }
    if text.len() < spec.seq + 2 {
        bail!(
            "{} has {} bytes; a sequence of {} tokens needs at least {}",
            args.data.display(),
            text.len(),
            spec.seq,
            spec.seq + 2
        );
    }
    let mut opts = StepOptions { train, ..StepOptions::new(StepKind::Train) };
    // Every rank must build the same step: a budget measured per process
    // could differ between them.
    let auto_budget = memory.memory_budget.as_deref().is_some_and(|b| b.trim().eq_ignore_ascii_case("auto"));
    if auto_budget && args.gpus.is_some_and(|g| g > 1) {
        bail!("--memory-budget auto with --gpus: give a size, so that every rank plans the same step");
    }
    memory.apply(&mut opts, free_bytes)?;
    match &role {
        Role::Cpu => {}
        Role::Launcher { gpus } => {
            // The ranks' step, built once here so that a step the group cannot
            // run (a batch or a parameter that does not split) fails before
            // any process starts, with one message instead of N.
            opts.data_parallel = Some(args.data_parallel(*gpus)?);
            trace_step(&spec, &opts)?;
            return launch(*gpus);
        }
        Role::Rank { world, .. } => opts.data_parallel = Some(args.data_parallel(*world)?),
    }
    let CompiledStep { forward, step, plan, .. } = compile_step(&spec, &opts)?;
    let planned = plan.planned_peak_bytes();
    // The backend, chosen once: the CPU replays its recorded launch list
    // from step 1; a GPU runs step 1 eagerly (NCCL connects the ranks at
    // their first collectives), then replays one captured graph, unless
    // --eager.
    match role {
        Role::Cpu => {
            let mut session = CpuSession::new(step, plan)?;
            train_loop(&mut session, Some(1), &forward, &spec, &text, args, (0, 1), planned, "CPU")
        }
        Role::Rank { rank, world, id_file } => {
            let id = NcclId::read_file(&id_file)
                .with_context(|| format!("rank {rank}: reading the NCCL id the launcher wrote"))?;
            let group = NcclGroup { id, rank, world };
            let mut session = CudaSession::new_rank(
                step,
                plan,
                CudaOptions::default(),
                RankOptions { device: rank, group: Some(group), overlap: args.overlap },
            )
            .with_context(|| format!("rank {rank}: opening the CUDA session on GPU {rank}"))?;
            let on = format!("{world} GPU{}", if world == 1 { "" } else { "s" });
            let replay_from = if args.eager { None } else { Some(2) };
            train_loop(&mut session, replay_from, &forward, &spec, &text, args, (rank, world), planned, &on)
                .with_context(|| format!("rank {rank} of {world}"))
        }
        Role::Launcher { .. } => unreachable!("the launcher returned above"),
    }
}

/// A closing note on how the steps ran: the recording, and where the
/// backend measures its memory, the peak it held against the plan.
fn closing_note(session: &mut dyn Session, recorded: Option<Duration>) -> Result<String> {
    let how = match recorded {
        Some(t) => format!("{} in {:.2} ms", session.replay_label(), t.as_secs_f64() * 1e3),
        None => "eager".to_string(),
    };
    let m = session.memory()?;
    if !m.measured {
        return Ok(how);
    }
    Ok(format!(
        "{how}; device peak {:.1} MB for a {:.1} MB plan (NCCL {:.1} MB)",
        m.held_bytes as f64 / 1e6,
        m.planned_bytes as f64 / 1e6,
        m.comm_bytes as f64 / 1e6
    ))
}

/// How many of the last losses the divergence check averages.
const SMOOTHING: usize = 10;
/// A run diverged when its smoothed final loss exceeds the first by this factor.
const DIVERGENCE_FACTOR: f64 = 2.0;

/// Names what became non-finite first when the loss of step `it` was not
/// finite, and the fix that applies. That loss is the forward pass of the
/// parameters step `it - 1` wrote, so a non-finite parameter came first (an
/// update overflowed), then a gradient (seen through the first AdamW
/// moment), then the second moment; when all are finite, or at step 1, the
/// forward pass itself overflowed.
fn diagnose_non_finite(session: &mut dyn Session, dtype: DType, it: usize) -> Result<String> {
    let trace = session.trace().clone();
    let finite = |t: &HostTensor| t.to_f64().iter().all(|x| x.is_finite());
    let mut read = |name: &str| -> Result<Option<HostTensor>> {
        match trace.leaf_by_name(name) {
            Some(v) => Ok(Some(session.read(v)?)),
            None => Ok(None),
        }
    };
    let range = match dtype {
        DType::F16 => "float16's range (±65504)",
        DType::BF16 => "bfloat16's precision",
        _ => "the float range",
    };
    let names: Vec<String> =
        trace.params().map(|p| trace.value(p).kind.leaf_name().unwrap_or_default().to_string()).collect();
    if it > 1 {
        for name in &names {
            if read(name)?.is_some_and(|value| !finite(&value)) {
                let state = trace.leaf_by_name(&format!("{name}.exp_avg_sq")).map(|s| trace.ty(s).dtype);
                let fix = if state == Some(DType::F16) {
                    "its AdamW second moment is float16, where (1-β2)·g² underflows to 0 and the update \
                     m/(√v+ε) explodes: keep the moments in float32 (--state-dtype auto or f32)"
                        .to_string()
                } else {
                    format!("the update overflowed {range}: lower the learning rate (--lr)")
                };
                return Ok(format!(
                    "parameter `{name}` became non-finite in the AdamW update of step {}; {fix}",
                    it - 1
                ));
            }
        }
        for name in &names {
            if read(&format!("{name}.exp_avg"))?.is_some_and(|m| !finite(&m)) {
                return Ok(format!(
                    "the gradient of `{name}` was not finite (its AdamW first moment is not): the backward pass \
                     overflowed {range}; lower the learning rate (--lr) or train in a wider dtype (--dtype f32)"
                ));
            }
            if let Some(v) = read(&format!("{name}.exp_avg_sq"))?.filter(|v| !finite(v)) {
                return Ok(format!(
                    "the AdamW second moment of `{name}` overflowed its {} storage: keep the moments in float32 \
                     (--state-dtype f32)",
                    v.ty.dtype
                ));
            }
        }
    }
    Ok(format!(
        "the forward pass overflowed {range} on finite parameters: lower the learning rate (--lr){}",
        if dtype == DType::F16 { " or train in bf16 or f32 (--dtype)" } else { "" }
    ))
}

/// The global batch of one step: `batch` random windows of `seq + 1` bytes.
fn draw_batch(rng: &mut rand::rngs::StdRng, text: &[u8], batch: usize, seq: usize, ty: &TensorType) -> [HostTensor; 2] {
    let mut tokens = Vec::with_capacity(batch * seq);
    let mut targets = Vec::with_capacity(batch * seq);
    for _ in 0..batch {
        let o = rng.gen_range(0..text.len() - seq - 1);
        tokens.extend(text[o..o + seq].iter().map(|&b| b as f64));
        targets.extend(text[o + 1..o + seq + 1].iter().map(|&b| b as f64));
    }
    [HostTensor::from_f64(ty.clone(), &tokens), HostTensor::from_f64(ty.clone(), &targets)]
}

/// Trains rank `rank` of `world` (0 of 1 without data parallelism); only
/// rank 0 prints. `spec` has the global batch. Steps from `replay_from` on
/// (counting from 1) replay the recorded step, recorded right before the
/// first of them; earlier steps, or every step with `None`, run eagerly.
#[allow(clippy::too_many_arguments)]
fn train_loop(
    session: &mut dyn Session,
    replay_from: Option<usize>,
    forward: &Trace,
    spec: &ModelSpec,
    text: &[u8],
    args: &TrainArgs,
    (rank, world): (usize, usize),
    planned: u64,
    on: &str,
) -> Result<()> {
    let (global, seq, steps, lr) = (spec.batch, spec.seq, args.steps, args.lr);
    let talk = rank == 0;
    for (fp, value) in init_params(forward, args.seed) {
        let name = forward.value(fp).kind.leaf_name().unwrap_or_default().to_string();
        session.write_named(&name, &value)?;
    }
    session.zero_state()?;
    let params: usize = session.trace().params().map(|p| session.trace().ty(p).numel()).sum();
    let global_ty = TensorType::new(DType::I32, [global, seq]);
    if talk {
        let per_rank =
            if world > 1 { format!(" ({} rows per GPU)", rank_batch(global, world)?) } else { String::new() };
        eprintln!(
            "training {} ({params} parameters, {} layers) on {} ({} bytes) on {on}: batch {global} x {seq} tokens{per_rank}, \
             {steps} steps, planned {:.1} MB{}",
            spec.config.name,
            spec.config.n_layer,
            args.data.display(),
            text.len(),
            planned as f64 / 1e6,
            if world > 1 { " per GPU" } else { "" }
        );
    }
    // On a terminal a progress bar; otherwise (a log file, CI) plain lines every --log-every steps.
    let tty = std::io::stderr().is_terminal();
    let bar = if talk && tty { ProgressBar::new(steps as u64) } else { ProgressBar::hidden() };
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}")
            .expect("valid template"),
    );
    // Every rank draws the same global batches and keeps its rows.
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed ^ 0x5eed);
    let (mut first, mut last) = (f64::NAN, f64::NAN);
    let mut recent: std::collections::VecDeque<f64> = std::collections::VecDeque::with_capacity(SMOOTHING);
    let mut recorded: Option<Duration> = None;
    let t0 = Instant::now();
    for it in 1..=steps {
        let [tokens, targets] = draw_batch(&mut rng, text, global, seq, &global_ty);
        let lr_now = if it <= args.warmup { lr * it as f64 / args.warmup.max(1) as f64 } else { lr };
        session.write_named(TOKENS_INPUT, &shard_rows(&tokens, rank, world)?)?;
        session.write_named(TARGETS_INPUT, &shard_rows(&targets, rank, world)?)?;
        session.write_named(LR_INPUT, &scalar_input(lr_now))?;
        session.write_named(STEP_INPUT, &scalar_input(it as f64))?;
        if replay_from.is_some_and(|from| it >= from) {
            if recorded.is_none() {
                recorded = Some(session.prepare_replay()?);
            }
            session.replay()?;
        } else {
            session.run_eager()?;
        }
        let loss = session.loss()?;
        if !loss.is_finite() {
            bar.finish_and_clear();
            let cause = diagnose_non_finite(session, spec.dtype, it)?;
            bail!("the loss became {loss} at step {it}: {cause}");
        }
        if it == 1 {
            first = loss;
        }
        last = loss;
        if recent.len() == SMOOTHING {
            recent.pop_front();
        }
        recent.push_back(loss);
        let tps = (it * global * seq) as f64 / t0.elapsed().as_secs_f64();
        bar.set_message(format!("loss {loss:.4}  {tps:.0} tok/s"));
        bar.inc(1);
        if talk && !tty && args.log_every > 0 && (it % args.log_every == 0 || it == steps) {
            eprintln!("step {it}/{steps}: loss {loss:.4}, {tps:.0} tok/s");
        }
    }
    // Clear the bar so that the summary starts on its own line.
    bar.finish_and_clear();
    let smoothed = recent.iter().sum::<f64>() / recent.len() as f64;
    if smoothed > DIVERGENCE_FACTOR * first {
        let msg = format!(
            "the loss diverged: the mean of the last {} losses, {smoothed:.4}, is {:.1}x the first, {first:.4} \
             (lower --lr, now {lr})",
            recent.len(),
            smoothed / first
        );
        if args.fail_on_divergence {
            bail!("{msg}");
        }
        if talk {
            eprintln!("warning: {msg}");
        }
    }
    let note = closing_note(session, recorded)?;
    if talk {
        // A replayed GPU step of a small model takes a millisecond: say ms below a second.
        let secs = t0.elapsed().as_secs_f64();
        let took = if secs < 1.0 { format!("{:.1} ms", secs * 1e3) } else { format!("{secs:.1} s") };
        let per_step = secs * 1e3 / steps.max(1) as f64;
        println!(
            "final loss {last:.4} (first {first:.4}) after {steps} steps in {took} ({per_step:.2} ms/step); {note}"
        );
    }
    Ok(())
}

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
fn launch(gpus: usize) -> Result<()> {
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
/// error names it with its exit status.
pub fn supervise(mut children: Vec<Child>, poll: Duration) -> Result<()> {
    let mut done: Vec<Option<ExitStatus>> = vec![None; children.len()];
    while done.iter().any(Option::is_none) {
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
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        optim: crate::OptimArgs,
        #[command(flatten)]
        train: TrainArgs,
    }

    fn parse(args: &[&str]) -> std::result::Result<T, clap::Error> {
        T::try_parse_from(std::iter::once("train").chain(args.iter().copied()))
    }

    #[test]
    fn arguments_choose_the_role() {
        assert_eq!(parse(&[]).unwrap().train.role().unwrap(), Role::Cpu);
        assert_eq!(parse(&["--gpus", "2", "--batch", "4"]).unwrap().train.role().unwrap(), Role::Launcher { gpus: 2 });
        let r = parse(&["--gpus", "2", "--rank", "1", "--nccl-id", "/tmp/id"]).unwrap().train.role().unwrap();
        assert_eq!(r, Role::Rank { rank: 1, world: 2, id_file: PathBuf::from("/tmp/id") });
        let e = parse(&["--gpus", "2", "--rank", "2", "--nccl-id", "/tmp/id"]).unwrap().train.role().unwrap_err();
        assert!(e.to_string().contains("--rank 2 is outside a group of 2"), "{e}");
        assert!(parse(&["--gpus", "0"]).unwrap().train.role().unwrap_err().to_string().contains("at least 1"));
        // The rank flags belong to a --gpus run and come together; ZeRO-1 and buckets need --gpus.
        assert!(parse(&["--rank", "0", "--nccl-id", "/tmp/id"]).is_err());
        assert!(parse(&["--gpus", "2", "--rank", "0"]).is_err());
        assert!(parse(&["--zero1"]).is_err());
        assert!(parse(&["--bucket-mb", "4"]).is_err());
        assert!(parse(&["--overlap"]).is_err() && parse(&["--eager"]).is_err());
        assert!(parse(&["--gpus", "2", "--overlap", "--eager"]).unwrap().train.overlap);
        let t = parse(&["--gpus", "2", "--zero1", "--bucket-mb", "0.5"]).unwrap().train;
        assert_eq!(t.data_parallel(2).unwrap(), DataParallel { world: 2, bucket_bytes: 524288, zero1: true });
        let bad = parse(&["--gpus", "2", "--bucket-mb", "0"]).unwrap().train;
        assert!(bad.data_parallel(2).unwrap_err().to_string().contains("--bucket-mb"));
    }

    #[test]
    fn rank_processes_get_the_launchers_arguments_and_their_rank() {
        let own: Vec<OsString> = ["train", "--gpus", "2", "--batch", "4"].iter().map(OsString::from).collect();
        let a = rank_args(&own, 1, Path::new("/tmp/x.id"));
        let strs: Vec<&str> = a.iter().map(|s| s.to_str().unwrap()).collect();
        assert_eq!(strs, ["train", "--gpus", "2", "--batch", "4", "--rank", "1", "--nccl-id", "/tmp/x.id"]);
        // What a rank parses is its role.
        let t = crate::Cli::try_parse_from(std::iter::once(OsString::from("stepgraph")).chain(a)).unwrap();
        let crate::Command::Train { train, .. } = t.command else { panic!("not train") };
        assert_eq!(train.role().unwrap(), Role::Rank { rank: 1, world: 2, id_file: PathBuf::from("/tmp/x.id") });
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

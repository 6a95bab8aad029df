//! The [`Trainer`]: a run's sessions, data, checkpoints and metrics, driven
//! step by step from a [`RunConfig`].
//!
//! Each step writes its batch ([`TrainData`]), its learning rate and its
//! count as step inputs and runs the step: on the CPU by replaying its
//! recorded launch list from step 1, on a GPU eagerly at the first step
//! (modules load, NCCL connects ranks) and as one captured CUDA graph after,
//! unless eager. Every `eval_every` steps a forward-only step evaluates
//! the held-out split ([`Evaluator`]): on the CPU and on one GPU it is a
//! segment of the training session's own program, planned in its arena
//! ([`TrainProgram`]); on rank 0 of a data-parallel group, whose session
//! runs on two streams (which node ranges do not), a session of its own
//! with a copy of the weights. A non-finite loss stops
//! the run with the step and what went non-finite first, before any
//! checkpoint of that step is saved. Checkpoints are saved every
//! `save_every` steps, at the last step of the process and at the end; a
//! resumed run equals the uninterrupted one bit for bit.
//!
//! The trainer prints nothing: progress, validation and warnings go to a
//! [`Reporter`], and the end of the run comes back as a [`Summary`] or a
//! [`RunEnd::Stopped`]. Only rank 0 of a data-parallel run reports,
//! evaluates and writes metrics.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use stepgraph_core::autodiff::{TrainOptions, GRAD_NORM_OUTPUT, LR_INPUT, PREVIOUS_GRAD_NORM_STATE, STEP_INPUT};
use stepgraph_core::cpu::exec::scalar_input;
use stepgraph_core::dist::shard_rows;
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, OutputKind, Trace, ValueId, ValueKind};
use stepgraph_core::models::gpt::{IGNORE_INDEX, POSITIONS_INPUT, TARGETS_INPUT, TOKENS_INPUT};
use stepgraph_core::models::hf_dir::HfModelDir;
use stepgraph_core::models::lora::is_adapter_weight;
use stepgraph_core::models::{init_param_as, param_init};
use stepgraph_core::ops::Op;
use stepgraph_core::pipeline::{CompileTimes, CompiledStep};
use stepgraph_core::plan::MemoryPlan;
use stepgraph_core::session::{Session, SessionMemory, StartupTimes};
use stepgraph_core::train_program::{with_evaluation, TrainProgram};
use stepgraph_cuda::nccl::NcclGroup;
use stepgraph_cuda::session::device_name;

use crate::checkpoint::{self, CheckpointDir, CheckpointState};
use crate::config::{state_dtype, RunConfig};
use crate::data::{self, TrainData};
use crate::divergence::DivergenceMonitor;
use crate::metrics::{self, MetricsFile};
use crate::schedule::short;
use crate::session::{open_session, Backend, SessionOptions};

/// Where this process trains.
#[derive(Clone, Debug)]
pub enum Placement {
    /// The CPU backend.
    Cpu,
    /// GPU 0, with no collectives and no NCCL.
    Gpu,
    /// Rank `group.rank` of a data-parallel group, on GPU `group.rank`.
    Rank { group: NcclGroup, overlap: bool },
}

/// What a run starts from besides its configuration: the compiled steps,
/// the opened data, where it runs, and its initial weights.
pub struct Start<'a> {
    /// The training step ([`RunConfig::compile`]).
    pub compiled: CompiledStep,
    /// The forward-only step that evaluates (rank 0, with `eval_every > 0`).
    pub eval: Option<CompiledStep>,
    pub data: Box<dyn TrainData>,
    pub placement: Placement,
    /// On a GPU, run every step eagerly instead of replaying a captured graph.
    pub eager: bool,
    /// Initial weights from a Hugging Face folder (fitted to the step by
    /// [`HfModelDir::check`]); otherwise the seeded draw.
    pub pretrained: Option<&'a HfModelDir>,
    /// Adapter weights to start from (an adapter folder's, by trace name)
    /// instead of the seeded draw; not used when resuming.
    pub adapters: Option<Vec<(String, HostTensor)>>,
    /// A checkpoint to continue, read and checked by [`read_resumable`].
    pub resume: Option<(PathBuf, CheckpointState)>,
}

/// One trained step, as reported.
#[derive(Clone, Debug)]
pub struct StepReport {
    pub step: usize,
    /// The run's `steps`, and the last step of this process.
    pub steps: usize,
    pub last: usize,
    pub loss: f64,
    pub lr: f64,
    /// The global gradient norm, when the step computes it (clipping).
    pub grad_norm: Option<f64>,
    /// Training tokens per second since the first step of this process,
    /// evaluations left out.
    pub tokens_per_s: f64,
    /// Model-FLOPs utilization, on a GPU whose peak is known.
    pub mfu: Option<f64>,
    /// The run's memory: the training and the evaluation sessions together.
    pub memory: SessionMemory,
}

/// Receives what a run has to say as it goes; every method defaults to
/// ignoring it.
pub trait Reporter {
    /// Step `report.step` has trained.
    fn step(&mut self, _report: &StepReport) {}
    /// The held-out split's mean loss after step `step`.
    fn validation(&mut self, _step: usize, _loss: f64) {}
    /// The loss diverged at the step the message names; the run goes on.
    fn divergence(&mut self, _message: &str) {}
}

/// A reporter that reports nothing.
pub struct Quiet;

impl Reporter for Quiet {}

/// How a call of [`Trainer::run`] ended.
#[derive(Clone, Debug)]
pub enum RunEnd {
    /// Every step up to the last of this process trained.
    Finished(Summary),
    /// The stop callback asked to stop; the run stopped after `step`.
    Stopped {
        step: usize,
        /// The checkpoint of `step`, when checkpoints are saved.
        saved: Option<PathBuf>,
        /// Steps this process trained before it stopped.
        ran: usize,
    },
}

/// What a finished run did.
#[derive(Clone, Debug)]
pub struct Summary {
    /// The loss of the first step this process trained, and of the last.
    pub first_loss: f64,
    pub last_loss: f64,
    /// Steps trained, and the wall time from the first to the end of the
    /// last (evaluations, checkpoints and graph capture included).
    pub ran: usize,
    pub took: Duration,
    /// The time of the training steps alone: inputs written, the step run
    /// or replayed, its loss read back (no capture, evaluation or saving).
    pub step_time: Duration,
    /// Batches skipped for having a part without a loss target.
    pub skipped: u64,
    /// The checkpoint of the last step.
    pub saved: Option<PathBuf>,
    /// The divergence warning, when the loss diverged.
    pub diverged: Option<String>,
}

/// How long rank 0 waits for the other ranks' optimizer shards.
const SHARD_WAIT: Duration = Duration::from_secs(600);

/// A training run in progress.
pub struct Trainer {
    config: RunConfig,
    session: Box<dyn Session>,
    /// The step at which replay starts; `None`: every step eager.
    replay_from: Option<usize>,
    /// The training step's nodes, where the session's program holds the
    /// evaluation too; `None`: the whole trace.
    step_nodes: Option<std::ops::Range<usize>>,
    eval: Option<Evaluator>,
    data: Box<dyn TrainData>,
    device: String,
    rank: usize,
    world: usize,
    /// The AdamW state is sharded over the ranks (ZeRO-1).
    shard: bool,
    ckpt: Option<CheckpointDir>,
    identity: BTreeMap<String, serde_json::Value>,
    /// The model's forward trace: its parameters by name.
    forward: Trace,
    params: usize,
    state_dtype: Option<String>,
    flops_per_token: f64,
    /// The group's peak FLOP/s for MFU; `None` on the CPU or an unknown GPU.
    peak_flops: Option<f64>,
    grad_norm: Option<ValueId>,
    monitor: DivergenceMonitor,
    metrics: Option<MetricsFile>,
    /// The step the run resumed from, if it did.
    resumed: Option<usize>,
    /// The next step to train, and the first this process trained.
    next: usize,
    first: usize,
    session_time: Duration,
    weights_time: Duration,
    // What the steps so far did.
    t0: Option<Instant>,
    /// The time of the training steps alone ([`Summary::step_time`]).
    step_time: Duration,
    eval_time: Duration,
    recorded: Option<Duration>,
    first_loss: f64,
    last_loss: f64,
    skipped: u64,
    saved: Option<PathBuf>,
    diverged: Option<String>,
}

impl Trainer {
    /// A run from its configuration alone: the data opened, the step (and
    /// with `eval_every` the evaluation step) compiled, the sessions opened
    /// on `placement` and the seeded initial weights written.
    pub fn new(config: RunConfig, placement: Placement) -> Result<Self> {
        let data = config.open_data()?;
        let (compiled, _) = config.compile()?;
        let eval = eval_step(&config, &compiled, data.as_ref(), &placement)?;
        Trainer::start(
            config,
            Start { compiled, eval, data, placement, eager: false, pretrained: None, adapters: None, resume: None },
        )
    }

    /// A run from its configuration and what [`Start`] gives: opens the
    /// sessions, writes the initial weights or loads the checkpoint, and
    /// removes what killed saves left in the checkpoint directory.
    pub fn start(config: RunConfig, start: Start) -> Result<Self> {
        let Start { compiled, eval, data, placement, eager, pretrained, adapters, resume } = start;
        let CompiledStep { step, plan, forward, .. } = compiled;
        let params: usize = forward.params().map(|p| forward.ty(p).numel()).sum();
        let moments_dtype = state_dtype(&step);
        let shard = config.step.data_parallel.as_ref().is_some_and(|dp| dp.zero1 && dp.world > 1);
        let (rank, world) = match &placement {
            Placement::Cpu | Placement::Gpu => (0, 1),
            Placement::Rank { group, .. } => (group.rank, group.world),
        };
        let opened = Instant::now();
        let Sessions { session, replay_from, device, eval: eval_runs, step_nodes } =
            open_sessions(&placement, eager, &config, step, plan, eval)?;
        let session_time = opened.elapsed();
        let peak_flops = match &placement {
            Placement::Cpu => None,
            _ => device_name(rank)
                .ok()
                .and_then(|n| metrics::peak_flops(&n, config.model.dtype))
                .map(|p| p * world as f64),
        };
        let identity = config.identity()?;
        let ckpt = config.course.checkpoints.as_ref().map(|c| CheckpointDir::new(&c.dir));
        let eval = match eval_runs {
            Some(runs) => Some(Evaluator {
                runs,
                batches: data.validation_batches(config.course.eval_batches)?,
                micro_batches: config.step.grad_accum,
            }),
            None => None,
        };
        let mut trainer = Trainer {
            flops_per_token: metrics::train_flops_per_token(
                params,
                metrics::frozen_weight_count(&forward),
                &config.model.config,
                config.model.seq,
            ),
            monitor: DivergenceMonitor::new(config.model.config.padded_vocab_size),
            grad_norm: grad_norm_output(session.trace()),
            config,
            session,
            replay_from,
            step_nodes,
            eval,
            data,
            device,
            rank,
            world,
            shard,
            ckpt,
            identity,
            forward,
            params,
            state_dtype: moments_dtype,
            peak_flops,
            metrics: None,
            resumed: None,
            next: 1,
            first: 1,
            session_time,
            weights_time: Duration::ZERO,
            t0: None,
            step_time: Duration::ZERO,
            eval_time: Duration::ZERO,
            recorded: None,
            first_loss: f64::NAN,
            last_loss: f64::NAN,
            skipped: 0,
            saved: None,
            diverged: None,
        };
        let weights_from = Instant::now();
        match resume {
            Some((dir, state)) => {
                // A checkpoint of adapters holds no base: it comes from
                // where it came from at the start.
                if trainer.forward.frozen().next().is_some() {
                    init_weights(trainer.session.as_mut(), &trainer.forward, pretrained, trainer.config.seed)?;
                }
                trainer.load_checkpoint(&dir, &state)?
            }
            None => {
                init_weights(trainer.session.as_mut(), &trainer.forward, pretrained, trainer.config.seed)?;
                if let Some(tensors) = &adapters {
                    load_adapters(trainer.session.as_mut(), &trainer.forward, tensors)?;
                }
                trainer.session.zero_state()?;
            }
        }
        trainer.weights_time = weights_from.elapsed();
        if let (Some(dir), 0) = (&trainer.ckpt, trainer.rank) {
            dir.clean_leftovers()?;
        }
        Ok(trainer)
    }

    /// Continues the checkpoint in `dir`: checks that it is of this run
    /// ([`read_resumable`], [`RunConfig::check_resume`]) and loads its
    /// weights, moments, batch order and divergence state.
    pub fn resume(&mut self, dir: &Path) -> Result<CheckpointState> {
        let state = read_resumable(dir, &self.config, self.session.trace())?;
        self.config.check_resume(dir, &state)?;
        self.load_checkpoint(dir, &state)?;
        Ok(state)
    }

    fn load_checkpoint(&mut self, dir: &Path, state: &CheckpointState) -> Result<()> {
        let shards = if state.shards == 0 { None } else { Some((self.rank, state.shards)) };
        checkpoint::load_leaves(self.session.as_mut(), &dir.join(checkpoint::WEIGHTS_FILE), true)?;
        checkpoint::load_leaves(self.session.as_mut(), &dir.join(checkpoint::optimizer_file(shards)), false)?;
        self.data.restore(&state.data).with_context(|| format!("resuming the batches of {}", dir.display()))?;
        if let Some(m) = &state.divergence {
            self.monitor = m.clone();
        }
        self.resumed = Some(state.step);
        self.next = state.step + 1;
        self.first = self.next;
        Ok(())
    }

    pub fn config(&self) -> &RunConfig {
        &self.config
    }

    /// The training session (its trace, plan and weights).
    pub fn session(&mut self) -> &mut dyn Session {
        self.session.as_mut()
    }

    /// The model's forward trace: its parameters by their names.
    pub fn forward(&self) -> &Trace {
        &self.forward
    }

    pub fn data(&self) -> &dyn TrainData {
        self.data.as_ref()
    }

    /// The device in words ("cpu", "cuda:0 (NVIDIA H100)", "2 GPUs").
    pub fn device(&self) -> &str {
        &self.device
    }

    /// The parameters the model trains.
    pub fn params(&self) -> usize {
        self.params
    }

    /// The dtype of the optimizer state, as the step was built.
    pub fn state_dtype(&self) -> Option<&str> {
        self.state_dtype.as_deref()
    }

    /// The step's FP8 products and those of its marked products that stay
    /// in the model's dtype (`--fp8 products`; both 0 without it).
    pub fn fp8_products(&self) -> (usize, usize) {
        let step = self.session.trace();
        let count = |f: &dyn Fn(&Op) -> bool| step.nodes.iter().filter(|n| f(&n.op)).count();
        (count(&|op| matches!(op, Op::MatMulFp8(_))), count(&|op| matches!(op, Op::MatMul(m) if m.fp8.is_some())))
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The next step to train; past `steps` when the run is complete.
    pub fn next_step(&self) -> usize {
        self.next
    }

    /// Where the time before the first step went, given the compile times.
    pub fn startup(&self, compile: CompileTimes) -> StartupTimes {
        StartupTimes::new(compile, self.session_time, self.session.startup_phases(), self.weights_time)
    }

    /// The metrics file, once the first step opened it.
    pub fn metrics_path(&self) -> Option<&Path> {
        self.metrics.as_ref().map(MetricsFile::path)
    }

    /// Planned bytes that validation adds to the training step's plan, where
    /// it runs in the training arena (`None`: no validation, or a session
    /// of its own).
    pub fn eval_extra_bytes(&self) -> Option<u64> {
        match self.eval.as_ref()?.runs {
            EvalRuns::Segment { extra_bytes, .. } => Some(extra_bytes),
            EvalRuns::Session { .. } => None,
        }
    }

    /// Where the training step was planned again, to less than
    /// `--memory-budget`, so that validation fits beside it: the budget
    /// it was planned to.
    pub fn step_budget_for_validation(&self) -> Option<u64> {
        match self.eval.as_ref()?.runs {
            EvalRuns::Segment { step_budget, .. } => step_budget,
            EvalRuns::Session { .. } => None,
        }
    }

    /// The run's memory: the training session's and, where validation has
    /// one, the evaluation session's, together.
    pub fn memory(&mut self) -> Result<SessionMemory> {
        let m = self.session.memory()?;
        Ok(match self.eval.as_mut().and_then(|e| e.own_session()) {
            Some(own) => m.combine(&own.memory()?),
            None => m,
        })
    }

    /// How the steps ran: recorded (the label and the recording time) or eager.
    pub fn recorded(&self) -> Option<(&'static str, Duration)> {
        self.recorded.map(|t| (self.session.replay_label(), t))
    }

    /// Trains the steps from the next to the last of this process, asking
    /// `stop` after each whether to stop there (with a checkpoint).
    pub fn run(&mut self, reporter: &mut dyn Reporter, stop: &mut dyn FnMut() -> bool) -> Result<RunEnd> {
        let last = self.config.course.last();
        while self.next <= last {
            let it = self.next;
            self.step(reporter)?;
            if it < last && stop() {
                if self.saved.as_deref() != self.ckpt.as_ref().map(|d| d.step_dir(it)).as_deref() {
                    self.save_checkpoint(it)?;
                }
                return Ok(RunEnd::Stopped { step: it, saved: self.saved.clone(), ran: it + 1 - self.first });
            }
        }
        Ok(RunEnd::Finished(Summary {
            first_loss: self.first_loss,
            last_loss: self.last_loss,
            ran: (last + 1).saturating_sub(self.first),
            took: self.t0.map(|t| t.elapsed()).unwrap_or_default(),
            step_time: self.step_time,
            skipped: self.skipped,
            saved: self.saved.clone(),
            diverged: self.diverged.clone(),
        }))
    }

    /// Trains the next step: its metrics row, the divergence check, an
    /// evaluation and a checkpoint when they are due. Returns its loss.
    pub fn step(&mut self, reporter: &mut dyn Reporter) -> Result<f64> {
        let (steps, last) = (self.config.course.steps, self.config.course.last());
        let it = self.next;
        if it > steps {
            bail!("the run is complete: it trained its {steps} steps");
        }
        if self.t0.is_none() {
            // Opened at the first step, so that a run with nothing left to
            // train leaves its metrics as they are; rank 0 writes them.
            if let (0, Some(p)) = (self.rank, &self.config.course.metrics) {
                self.metrics = Some(MetricsFile::open(p, self.resumed)?);
            }
        }
        let t0 = *self.t0.get_or_insert_with(Instant::now);
        let course = &self.config.course;
        let (rank, world, accum) = (self.rank, self.world, self.config.step.grad_accum);
        let global = self.config.model.batch * accum;
        let seq = self.config.model.seq;
        let batch = next_usable_batch(self.data.as_mut(), world * accum, &mut self.skipped)?;
        let lr = course.schedule.at(it);
        let session = self.session.as_mut();
        let step_started = Instant::now();
        let mut capture = Duration::ZERO;
        session.write_named(TOKENS_INPUT, &shard_rows(&batch.tokens, rank, world)?)?;
        session.write_named(TARGETS_INPUT, &shard_rows(&batch.targets, rank, world)?)?;
        if let Some(p) = &batch.positions {
            session.write_named(POSITIONS_INPUT, &shard_rows(p, rank, world)?)?;
        }
        session.write_named(LR_INPUT, &scalar_input(lr))?;
        session.write_named(STEP_INPUT, &scalar_input(it as f64))?;
        // The whole trace, or its training segment beside the evaluation's.
        let nodes = self.step_nodes.clone();
        if self.replay_from.is_some_and(|from| it >= from) {
            if self.recorded.is_none() {
                let capturing = Instant::now();
                self.recorded = Some(match nodes.clone() {
                    Some(n) => session.prepare_replay_nodes(n)?,
                    None => session.prepare_replay()?,
                });
                capture = capturing.elapsed();
            }
            match nodes {
                Some(n) => session.replay_nodes(n)?,
                None => session.replay()?,
            }
        } else {
            match nodes {
                Some(n) => session.run_nodes(n)?,
                None => session.run_eager()?,
            }
        }
        let loss = session.loss()?;
        self.step_time += step_started.elapsed().saturating_sub(capture);
        if !loss.is_finite() {
            let cause = diagnose_non_finite(session, self.config.model.dtype, it)?;
            let kept = match &self.ckpt {
                None => "no checkpoint was saved (--checkpoint-dir)".to_string(),
                Some(d) => match d.newest()? {
                    Some((_, p)) => format!("the last good checkpoint is {} (nothing was saved after it)", p.display()),
                    None => "no checkpoint was saved before it".to_string(),
                },
            };
            bail!("the loss became {loss} at step {it}: {cause}; {kept}");
        }
        self.next = it + 1;
        if it == self.first {
            self.first_loss = loss;
        }
        self.last_loss = loss;
        let train_secs = (t0.elapsed() - self.eval_time).as_secs_f64();
        let tps = ((it + 1 - self.first) * global * seq) as f64 / train_secs;
        let mfu = self.peak_flops.map(|peak| self.flops_per_token * tps / peak);
        let memory = self.memory()?;
        let grad_norm = match self.grad_norm {
            Some(v) => Some(self.session.read(v)?.to_f64()[0]),
            None => None,
        };
        // Clipping by the previous step's norm: this step's norm is the next one's.
        if let (Some(norm), Some(previous)) = (grad_norm, self.session.trace().leaf_by_name(PREVIOUS_GRAD_NORM_STATE)) {
            let ty = self.session.trace().ty(previous).clone();
            self.session.write(previous, &HostTensor::from_f64(ty, &[norm]))?;
        }
        let report =
            StepReport { step: it, steps, last, loss, lr, grad_norm, tokens_per_s: tps, mfu, memory: memory.clone() };
        if rank == 0 {
            reporter.step(&report);
        }
        if let Some(m) = &mut self.metrics {
            let mut row = serde_json::json!({
                "step": it, "loss": loss, "lr": lr, "tokens_per_s": tps,
                "planned_bytes": memory.planned_bytes, "held_bytes": memory.held_bytes,
            });
            if let Some(g) = grad_norm {
                row["grad_norm"] = g.into();
            }
            for (name, v) in router_loss_outputs(self.session.trace()) {
                row[name] = self.session.read(v)?.to_f64()[0].into();
            }
            if let Some(m) = mfu {
                row["mfu"] = m.into();
            }
            m.write(&row)?;
        }
        if self.diverged.is_none() {
            if let Some(d) = self.monitor.observe(it, loss, grad_norm) {
                let good = match &self.ckpt {
                    None => "no checkpoint was saved (--checkpoint-dir saves them)".to_string(),
                    Some(dir) => match dir.complete()?.into_iter().rev().find(|(s, _)| *s <= d.best_step()) {
                        Some((_, p)) => {
                            format!("the last checkpoint saved before it is {} (--keep keeps it)", p.display())
                        }
                        None => "no checkpoint was saved before it".to_string(),
                    },
                };
                let peak = self.config.course.schedule.peak;
                let msg = format!("{}; {good} (lower --lr, now {})", d.describe(it), short(peak));
                if self.config.course.fail_on_divergence {
                    bail!("{msg}; stopped by --fail-on-divergence");
                }
                if rank == 0 {
                    reporter.divergence(&msg);
                }
                self.diverged = Some(msg);
            }
        }
        let course = &self.config.course;
        if self.eval.is_some() && (it.is_multiple_of(course.eval_every) || it == last) {
            let t = Instant::now();
            let val = self.evaluate()?;
            self.eval_time += t.elapsed();
            reporter.validation(it, val);
            if let Some(m) = &mut self.metrics {
                m.write(&serde_json::json!({"step": it, "val_loss": val, "val_ppl": val.exp()}))?;
            }
        }
        let course = &self.config.course;
        let periodic = course.checkpoints.as_ref().is_some_and(|c| c.save_every > 0 && it.is_multiple_of(c.save_every));
        if it == steps || (self.ckpt.is_some() && (periodic || it == last)) {
            self.save_checkpoint(it)?;
        }
        Ok(loss)
    }

    /// The mean loss of the held-out split on the current weights (rank 0,
    /// with evaluation configured).
    pub fn evaluate(&mut self) -> Result<f64> {
        let Some(e) = &mut self.eval else { bail!("this run has no evaluation step: set eval_every and eval_batches") };
        e.evaluate(self.session.as_mut(), self.rank, self.world)
    }

    /// Saves a checkpoint of `step`, the step the weights last trained
    /// (every rank takes part: ZeRO-1 ranks write their shards), and deletes
    /// the ones beyond `keep`. Without a checkpoint directory it does nothing.
    pub fn save_checkpoint(&mut self, step: usize) -> Result<()> {
        let Some(dir) = &self.ckpt else { return Ok(()) };
        self.saved = Some(dir.step_dir(step));
        let shards = if self.shard { self.world } else { 0 };
        let session = self.session.as_mut();
        if self.rank > 0 {
            if self.shard {
                let state = checkpoint::read_leaves(session, false)?;
                dir.write_shard(step, self.rank, self.world, &state)?;
            }
            return Ok(());
        }
        let weights = checkpoint::read_leaves(session, true)?;
        let optimizer = checkpoint::read_leaves(session, false)?;
        let schedule = self.config.course.schedule;
        let mut state =
            CheckpointState::new(step, schedule, self.last_loss, self.data.cursor(), self.identity.clone(), shards);
        state.divergence = Some(self.monitor.clone());
        dir.save(&state, &weights, &optimizer, SHARD_WAIT)?;
        // The checkpoint at or before the best loss is the one to go back
        // to if the run is diverging (or will): `keep` never deletes it.
        let keep = self.config.course.checkpoints.as_ref().map_or(usize::MAX, |c| c.keep);
        dir.prune(keep, self.monitor.last_good_step())?;
        Ok(())
    }

    /// The optimizer settings the step was built with.
    pub fn train_options(&self) -> &TrainOptions {
        &self.config.step.train
    }
}

impl RunConfig {
    /// Checks that a checkpoint of `state.step` can go on in this run's
    /// course: its step is within `steps` and before `stop_after`.
    pub fn check_resume(&self, dir: &Path, state: &CheckpointState) -> Result<()> {
        let steps = self.course.steps;
        if state.step > steps {
            bail!(
                "{} holds step {}, past the run's --steps {steps}: ask for more steps to continue it",
                dir.display(),
                state.step
            );
        }
        if let Some(stop) = self.course.stop_after.filter(|&n| n <= state.step) {
            bail!("--stop-after {stop} is not after the checkpoint's step {} ({})", state.step, dir.display());
        }
        Ok(())
    }
}

/// Reads the complete checkpoint in `dir` and checks that it was saved by
/// this run: every setting of the identity matches (see
/// [`checkpoint::check_compatible`]); `step` is the step as built, for
/// checkpoints of format 1.
pub fn read_resumable(dir: &Path, config: &RunConfig, step: &Trace) -> Result<CheckpointState> {
    let state = checkpoint::read_complete(dir)?;
    checkpoint::check_compatible(dir, &state, &config.identity()?, &config.legacy_identity(step))?;
    Ok(state)
}

/// The evaluation step of a run: forward only, compiled for the training
/// step's spec, on rank 0 when `eval_every > 0` (joined to the training
/// step's program when the run opens, except on a data-parallel rank). The held-out split is
/// checked to hold a batch first.
pub fn eval_step(
    config: &RunConfig,
    compiled: &CompiledStep,
    data: &dyn TrainData,
    placement: &Placement,
) -> Result<Option<CompiledStep>> {
    let rank0 = !matches!(placement, Placement::Rank { group, .. } if group.rank > 0);
    if config.course.eval_every == 0 || !rank0 {
        return Ok(None);
    }
    data.validation_batches(1)?;
    Ok(Some(stepgraph_core::train_program::evaluation_step(compiled)?))
}

/// What [`open_sessions`] opens.
struct Sessions {
    session: Box<dyn Session>,
    /// The step at which replay starts; `None`: every step eager.
    replay_from: Option<usize>,
    /// The device in words.
    device: String,
    /// Where the evaluation runs, with validation.
    eval: Option<EvalRuns>,
    /// The training step's nodes, where the program holds the evaluation too.
    step_nodes: Option<std::ops::Range<usize>>,
}

/// The training step with the evaluation forward `eval` as one program
/// ([`with_evaluation`]), planned as the step was, and held to the run's
/// memory budget. A step planned up to the budget leaves validation no
/// room: it is planned again to the budget less what validation adds,
/// once, and that budget comes back with the program.
fn join_evaluation(
    config: &RunConfig,
    step: &Trace,
    plan: &MemoryPlan,
    eval: &CompiledStep,
) -> Result<(TrainProgram, Option<u64>)> {
    use stepgraph_core::passes::recompute::RecomputePolicy;
    let program = with_evaluation(step, plan, &eval.step, config.step.plan)?;
    let RecomputePolicy::Budget(budget) = config.step.recompute else { return Ok((program, None)) };
    let planned = program.plan.planned_peak_bytes();
    if planned <= budget {
        return Ok((program, None));
    }
    let over = planned - budget;
    let tighter = stepgraph_core::pipeline::StepOptions {
        recompute: RecomputePolicy::Budget(budget.saturating_sub(over)),
        ..config.step.clone()
    };
    if let Ok(c) = stepgraph_core::pipeline::compile_step(&config.model, &tighter) {
        let again = with_evaluation(&c.step, &c.plan, &eval.step, config.step.plan)?;
        if again.plan.planned_peak_bytes() <= budget {
            return Ok((again, Some(budget - over)));
        }
    }
    bail!(
        "validation needs {} B ({:.3} GB) more than the training step, so the run plans {planned} B ({:.3} GB), \
         over --memory-budget {budget} B ({:.3} GB), and the step planned to leave it that room does not fit: \
         raise the budget, or turn validation off with --eval-every 0",
        program.eval_extra_bytes,
        program.eval_extra_bytes as f64 / 1e9,
        planned as f64 / 1e9,
        budget as f64 / 1e9
    );
}

/// The sessions of this process: the train step's (its program holding
/// the evaluation where it runs there), where its replay starts, the
/// device in words, and where the evaluation runs.
fn open_sessions(
    placement: &Placement,
    eager: bool,
    config: &RunConfig,
    step: Trace,
    plan: MemoryPlan,
    eval: Option<CompiledStep>,
) -> Result<Sessions> {
    // The backend, chosen once: the CPU replays its recorded launch list
    // from step 1; a GPU runs step 1 eagerly (modules load; NCCL connects
    // the ranks at their first collectives), then replays one captured
    // graph, unless eager.
    let (backend, replay_from, session_opts) = match placement {
        Placement::Cpu => (Backend::Cpu, Some(1), SessionOptions::default()),
        // One GPU: the step has no collectives, so no group and no NCCL.
        Placement::Gpu => (Backend::Cuda, (!eager).then_some(2), SessionOptions::on_device(0, config.switches)),
        Placement::Rank { group, overlap } => {
            let opts = SessionOptions::rank(group.rank, Some(group.clone()), *overlap, config.switches);
            (Backend::Cuda, (!eager).then_some(2), opts)
        }
    };
    // The training session, of the step or of the program that holds it.
    let open_step = |trace: Trace, plan: MemoryPlan| -> Result<Box<dyn Session>> {
        let opened = open_session(backend, trace, plan, session_opts.clone());
        Ok(match placement {
            Placement::Rank { group, .. } => {
                opened.with_context(|| format!("rank {} of {}", group.rank, group.world))?
            }
            _ => opened?,
        }
        .session)
    };
    let device_in_words = |s: &dyn Session| match placement {
        Placement::Cpu => s.device(),
        Placement::Gpu => format!("{} ({})", s.device(), device_name(0).unwrap_or_default()),
        Placement::Rank { group, .. } => format!("{} GPUs", group.world),
    };
    match (placement, eval) {
        // A data-parallel rank keeps the evaluation in a session of its
        // own: its step may overlap collectives on a second stream.
        (Placement::Rank { group, .. }, Some(c)) => {
            let rank = group.rank;
            let session = open_step(step, plan)?;
            // The evaluation step has no collectives: no group, no NCCL.
            let opts = SessionOptions::on_device(rank, config.switches);
            let weights = c.step.leaf_bytes(|k| matches!(k, ValueKind::Param { .. } | ValueKind::Frozen { .. }));
            let own = open_session(backend, c.step, c.plan, opts)
                .with_context(|| {
                    format!(
                        "opening the evaluation step, which holds its own copy of the model's weights ({:.2} GB) \
                         on rank {rank} of a data-parallel run: --eval-every 0 turns validation off",
                        weights as f64 / 1e9
                    )
                })?
                .session;
            let device = device_in_words(session.as_ref());
            let eval = Some(EvalRuns::Session { session: own, frozen_copied: false });
            Ok(Sessions { session, replay_from, device, eval, step_nodes: None })
        }
        (_, Some(c)) => {
            let (program, step_budget) = join_evaluation(config, &step, &plan, &c)?;
            let session = open_step(program.trace, program.plan)?;
            let device = device_in_words(session.as_ref());
            let eval = Some(EvalRuns::Segment {
                nodes: program.eval,
                loss: program.eval_loss,
                replay: replay_from.is_some(),
                warm: false,
                extra_bytes: program.eval_extra_bytes,
                step_budget,
            });
            Ok(Sessions { session, replay_from, device, eval, step_nodes: Some(program.step) })
        }
        (_, None) => {
            let session = open_step(step, plan)?;
            let device = device_in_words(session.as_ref());
            Ok(Sessions { session, replay_from, device, eval: None, step_nodes: None })
        }
    }
}

/// Writes the initial weights: from a Hugging Face folder, its tensors one
/// at a time (memory-mapped, cast to each parameter's dtype, copied to the
/// device), after [`HfModelDir::check`] has fitted them to `forward`;
/// otherwise the seeded draw, made by the session where it runs (on a GPU,
/// in place, without a host copy of the model).
pub fn init_weights(
    session: &mut dyn Session,
    forward: &Trace,
    pretrained: Option<&HfModelDir>,
    seed: u64,
) -> Result<()> {
    match pretrained {
        Some(hf) => {
            hf.load_into(forward, session)
                .with_context(|| format!("loading the weights of --init-from {}", hf.dir().display()))?;
            // Adapters are not in the folder: they start from the seeded
            // draw (A uniform, B zero), as a fresh PEFT model's do.
            for p in forward.params() {
                let name = forward.value(p).kind.leaf_name().unwrap_or_default();
                if is_adapter_weight(name) {
                    session.write_named(name, &init_param_as(param_init(forward, p), name, forward.ty(p), seed)?)?;
                }
            }
        }
        None => {
            session.init_params(seed)?;
        }
    }
    Ok(())
}

/// Writes adapter matrices (an adapter folder's, by trace name) into the
/// session of the model `forward`, each cast to the adapter's dtype; every
/// adapter of the model must be given, with its shape.
pub fn load_adapters(session: &mut dyn Session, forward: &Trace, tensors: &[(String, HostTensor)]) -> Result<()> {
    for (name, t) in tensors {
        let Some(v) = forward.leaf_by_name(name) else {
            bail!("the adapter folder holds `{name}`, which the model has no adapter for");
        };
        if forward.ty(v).shape != t.ty.shape {
            bail!("adapter `{name}` is {} in the folder, {} in the model", t.ty, forward.ty(v));
        }
        let cast = HostTensor::from_f64(forward.ty(v).clone(), &t.to_f64());
        session.write_named(name, &cast)?;
    }
    let given: std::collections::HashSet<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
    if let Some(missing) =
        forward.params().find_map(|p| forward.value(p).kind.leaf_name().filter(|n| !given.contains(n)))
    {
        bail!("the adapter folder has no `{missing}`, which the model adapts");
    }
    Ok(())
}

/// Where the forward-only step that evaluates runs.
pub enum EvalRuns {
    /// The evaluation segment of the training session's program
    /// ([`TrainProgram`]): it reads the weights the training step keeps,
    /// so nothing is copied. Its first run is eager (the GPU's modules
    /// warm), later ones replay its recording unless the run is eager.
    /// `extra_bytes`: what it adds to the training step's plan.
    /// `step_budget`: the budget the training step was planned to again
    /// to leave validation room, where `--memory-budget` left it none.
    Segment {
        nodes: std::ops::Range<usize>,
        loss: ValueId,
        replay: bool,
        warm: bool,
        extra_bytes: u64,
        step_budget: Option<u64>,
    },
    /// A session of its own (a data-parallel rank, the `eval` command):
    /// the weights are copied in before each evaluation, from the training
    /// session when there is one. A train step always applies its AdamW
    /// update, so it cannot evaluate the weights without changing them.
    Session { session: Box<dyn Session>, frozen_copied: bool },
}

/// The forward-only step that evaluates the held-out split: the mean loss
/// over its batches, on the weights of the training session.
pub struct Evaluator {
    pub runs: EvalRuns,
    /// Batches of the training step's rows: `micro_batches` of the evaluation step's each.
    pub batches: Vec<data::Batch>,
    pub micro_batches: usize,
}

impl Evaluator {
    /// An evaluator on a session that holds the weights to evaluate already
    /// (the `eval` command's).
    pub fn on_loaded_session(session: Box<dyn Session>, batches: Vec<data::Batch>) -> Self {
        Evaluator { runs: EvalRuns::Session { session, frozen_copied: true }, batches, micro_batches: 1 }
    }

    /// The session of its own, where it has one.
    pub fn own_session(&mut self) -> Option<&mut dyn Session> {
        match &mut self.runs {
            EvalRuns::Session { session, .. } => Some(session.as_mut()),
            EvalRuns::Segment { .. } => None,
        }
    }

    /// The mean loss over the validation batches, on the weights of `train`.
    pub fn evaluate(&mut self, train: &mut dyn Session, rank: usize, world: usize) -> Result<f64> {
        if let EvalRuns::Session { session, frozen_copied } = &mut self.runs {
            // The trained parameters every time; frozen weights (a base under
            // adapters) the first time only, since nothing changes them.
            let params: Vec<(String, _)> = {
                let t = session.trace();
                let frozen = if *frozen_copied { None } else { Some(t.frozen()) };
                t.params()
                    .chain(frozen.into_iter().flatten())
                    .map(|p| (t.value(p).kind.leaf_name().unwrap_or_default().to_string(), p))
                    .collect()
            };
            *frozen_copied = true;
            for (name, v) in params {
                let src = train
                    .trace()
                    .leaf_by_name(&name)
                    .with_context(|| format!("the training step has no parameter `{name}` to evaluate"))?;
                let value = train.read(src)?;
                session.write(v, &value)?;
            }
        }
        self.mean_loss_with(Some(train), rank, world)
    }

    /// The mean loss over the validation batches, on the weights the
    /// evaluator's own session holds (see [`Evaluator::on_loaded_session`]).
    pub fn mean_loss(&mut self, rank: usize, world: usize) -> Result<f64> {
        let EvalRuns::Session { .. } = &self.runs else {
            bail!("an evaluation segment reads the training session's weights: use Evaluator::evaluate")
        };
        self.mean_loss_with(None, rank, world)
    }

    /// The mean loss over the validation batches, run where
    /// [`Evaluator::runs`] says (`train` runs a segment).
    /// Batches whose targets are all masked (a chat prompt, padding) have
    /// no loss (0/0) and are left out of the mean.
    fn mean_loss_with(&mut self, mut train: Option<&mut dyn Session>, rank: usize, world: usize) -> Result<f64> {
        let (mut total, mut counted) = (0.0, 0usize);
        let n = self.micro_batches.max(1);
        for b in &self.batches {
            for k in 0..n {
                let (tokens, targets) = (shard_rows(&b.tokens, k, n)?, shard_rows(&b.targets, k, n)?);
                let targets = shard_rows(&targets, rank, world)?;
                if !has_target(&targets) {
                    continue;
                }
                let mut inputs = vec![(TOKENS_INPUT, shard_rows(&tokens, rank, world)?), (TARGETS_INPUT, targets)];
                if let Some(p) = &b.positions {
                    inputs.push((POSITIONS_INPUT, shard_rows(&shard_rows(p, k, n)?, rank, world)?));
                }
                total += match &mut self.runs {
                    EvalRuns::Session { session, .. } => {
                        for (name, t) in &inputs {
                            session.write_named(name, t)?;
                        }
                        session.run_eager()?;
                        session.loss()?
                    }
                    EvalRuns::Segment { nodes, loss, replay, warm, .. } => {
                        let train =
                            train.as_deref_mut().context("an evaluation segment runs in the training session")?;
                        for (name, t) in &inputs {
                            train.write_named(&TrainProgram::eval_input(name), t)?;
                        }
                        if *replay && *warm {
                            train.replay_nodes(nodes.clone())?;
                        } else {
                            train.run_nodes(nodes.clone())?;
                            *warm = true;
                        }
                        train.read(*loss)?.to_f64()[0]
                    }
                };
                counted += 1;
            }
        }
        if counted == 0 {
            bail!(
                "none of the {} validation batches has a loss target (the loss mask covers every held-out token): \
                 hold out other documents, or use a longer --seq",
                self.batches.len()
            );
        }
        Ok(total / counted as f64)
    }
}

/// Whether some target of `targets` counts in the loss (is not the ignore index).
fn has_target(targets: &HostTensor) -> bool {
    targets.to_f64().iter().any(|&t| t != IGNORE_INDEX as f64)
}

/// How many batches in a row may lack a loss target before the run gives up.
const MAX_SKIPPED_IN_A_ROW: u64 = 1000;

/// The next training batch in which every part a device computes a mean
/// loss over (the rows of each of `parts` ranks) has a loss target.
///
/// A token file's loss mask can leave a whole short row unmasked-free (a
/// chat prompt longer than the sequence): its mean cross-entropy is 0/0, a
/// NaN that would stop the run. Such batches teach nothing and are skipped;
/// the data cursor counts them, so a resumed run skips the same ones.
fn next_usable_batch(data: &mut dyn TrainData, parts: usize, skipped: &mut u64) -> Result<data::Batch> {
    let mut seq = 0;
    for _ in 0..MAX_SKIPPED_IN_A_ROW {
        let batch = data.next_batch()?;
        seq = batch.targets.ty.shape[1];
        let mut usable = true;
        for p in 0..parts {
            usable &= has_target(&shard_rows(&batch.targets, p, parts)?);
        }
        if usable {
            return Ok(batch);
        }
        *skipped += 1;
    }
    bail!(
        "{MAX_SKIPPED_IN_A_ROW} training batches in a row have a part without a loss target: the token file's loss \
         mask leaves too few targets for --seq {seq} (prepare other data, or use a longer --seq or a larger --batch)"
    )
}

/// The named outputs of a step whose loss includes a mixture of experts'
/// load-balancing loss or router z-loss: each before its weight, by name.
pub fn router_loss_outputs(trace: &Trace) -> Vec<(&'static str, ValueId)> {
    use stepgraph_core::autodiff::{ROUTER_AUX_LOSS_OUTPUT, ROUTER_Z_LOSS_OUTPUT};
    [ROUTER_AUX_LOSS_OUTPUT, ROUTER_Z_LOSS_OUTPUT]
        .into_iter()
        .filter_map(|name| {
            let o = trace.outputs.iter().find(|o| matches!(&o.kind, OutputKind::Named(n) if n == name))?;
            Some((name, o.value))
        })
        .collect()
}

/// The named output `grad_norm` of a step that computes it (gradient clipping).
pub fn grad_norm_output(trace: &Trace) -> Option<ValueId> {
    trace.outputs.iter().find(|o| matches!(&o.kind, OutputKind::Named(n) if n == GRAD_NORM_OUTPUT)).map(|o| o.value)
}

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

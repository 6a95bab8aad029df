//! The backend-neutral session: a planned step bound to one backend's
//! memory, which callers drive without knowing the backend.
//!
//! A [`Session`] is written (leaves, by id or by name), run, and read back
//! (any value, the loss). It runs a step in one of two ways that give the
//! same bits: **eagerly**, launch by launch, or by **replay** of a recording
//! made once with every address fixed — the CPU's launch list, the GPU's
//! CUDA graph ([`Session::prepare_replay`], [`Session::replay`]). Its
//! [`SessionMemory`] puts the plan next to what the backend holds.
//!
//! The CPU backend ([`crate::cpu::exec::CpuSession`]) implements it here;
//! the CUDA backend's session implements it in its own crate. A command
//! chooses the backend once, when it opens the session, and is written
//! against `dyn Session` from there on.
//!
//! A session also writes its own initial weights
//! ([`Session::init_params`]: the bits of [`crate::models::init_params`],
//! drawn where the step runs when the backend can) and reports the phases of
//! its own start-up ([`Session::startup_phases`]), which [`StartupTimes`]
//! puts next to building, planning and the weights.
//!
//! Every session holds its trace's parameters by name
//! ([`crate::models::hf_dir::NamedParams`]), which is how Hugging Face
//! folders load into it and save from it; the dependency runs from here to
//! the models, not back.

use std::fmt;
use std::ops::Range;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::error::{Error, Result};
use crate::host::HostTensor;
use crate::ir::{Trace, ValueId, ValueKind};
use crate::models::hf_dir::NamedParams;
use crate::models::init::fill_param;
use crate::models::lora::{init_quantized, is_quantized_leaf};
use crate::pipeline::CompileTimes;
use crate::plan::MemoryPlan;

/// Planned and held memory of a session, in bytes, in terms every backend has.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SessionMemory {
    /// The plan's peak: persistent buffer plus arena.
    pub planned_bytes: u64,
    /// The most memory the session has held for the step so far: its host
    /// buffers on the CPU; on a GPU the device memory measured above the
    /// context's baseline (the allocation, kernel modules, library state,
    /// the captured graph and the communicator included).
    pub held_bytes: u64,
    /// Of `held_bytes`, what the collective library holds (0 without a group).
    pub comm_bytes: u64,
    /// `held_bytes` is measured from the device (true) rather than counted
    /// from the session's own allocations (false).
    pub measured: bool,
    /// Where a measured session's `held_bytes` start: the device memory in
    /// use when it opened (0 when not measured). Two sessions of one
    /// process on one device measure the same driver counter, so the
    /// later one's baseline already holds the earlier one's allocation.
    pub baseline_bytes: u64,
}

impl SessionMemory {
    /// The memory of two sessions of one run, together: plans add up; held
    /// bytes add up when counted, and when measured on one device are the
    /// higher of the two absolute peaks above the earlier baseline. (Each
    /// measured peak is the whole device's use, so after the second session
    /// opens the first one's peak already includes it: adding the two
    /// would count the second session twice.)
    pub fn combine(&self, other: &SessionMemory) -> SessionMemory {
        let planned_bytes = self.planned_bytes + other.planned_bytes;
        let comm_bytes = self.comm_bytes + other.comm_bytes;
        if !(self.measured && other.measured) {
            return SessionMemory {
                planned_bytes,
                held_bytes: self.held_bytes + other.held_bytes,
                comm_bytes,
                measured: self.measured && other.measured,
                baseline_bytes: self.baseline_bytes.min(other.baseline_bytes),
            };
        }
        let baseline_bytes = self.baseline_bytes.min(other.baseline_bytes);
        let peak = (self.baseline_bytes + self.held_bytes).max(other.baseline_bytes + other.held_bytes);
        SessionMemory { planned_bytes, held_bytes: peak - baseline_bytes, comm_bytes, measured: true, baseline_bytes }
    }
}

/// What [`Session::init_params`] wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct InitReport {
    /// Parameters written.
    pub tensors: usize,
    /// Their bytes.
    pub bytes: u64,
    /// Drawn where the step runs, by the backend's own kernel (true), or
    /// on the host and copied over tensor by tensor (false).
    pub on_device: bool,
    /// Wall time, until the weights are in place.
    pub elapsed: Duration,
}

/// One named phase of a session's start-up and its wall time.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StartupPhase {
    pub name: &'static str,
    pub ms: f64,
}

impl StartupPhase {
    pub fn new(name: &'static str, took: Duration) -> Self {
        StartupPhase { name, ms: took.as_secs_f64() * 1e3 }
    }
}

/// Where the time before a run's first step went, in milliseconds:
/// building the step's traces, planning, opening the session (with the
/// backend's phases: on a GPU kernel load and GEMM tuning among them), and
/// the initial weights. Printed as one line by its `Display`.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct StartupTimes {
    /// Tracing: the model builder, autodiff and the data-parallel rewrite.
    pub build_ms: f64,
    /// The memory plan and `check_plan`.
    pub plan_ms: f64,
    /// Opening the session, whole.
    pub session_ms: f64,
    /// Of `session_ms`, the backend's phases in order
    /// ([`Session::startup_phases`]; none from the CPU backend).
    pub session_phases: Vec<StartupPhase>,
    /// Writing the initial weights and zeroing the optimizer state.
    pub weights_ms: f64,
    /// All of the above.
    pub total_ms: f64,
}

impl StartupTimes {
    /// The breakdown of a start-up: `compile` from
    /// [`crate::pipeline::compile_step_timed`], `session` the wall time of
    /// opening the session `session_phases` come from, `weights` that of
    /// writing the weights and zeroing the optimizer state.
    pub fn new(compile: CompileTimes, session: Duration, session_phases: Vec<StartupPhase>, weights: Duration) -> Self {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let (build_ms, plan_ms, session_ms, weights_ms) =
            (ms(compile.build), ms(compile.plan), ms(session), ms(weights));
        StartupTimes {
            build_ms,
            plan_ms,
            session_ms,
            session_phases,
            weights_ms,
            total_ms: build_ms + plan_ms + session_ms + weights_ms,
        }
    }

    /// Milliseconds of the session phase called `name`; 0 when the backend
    /// does not report one of that name.
    pub fn phase_ms(&self, name: &str) -> f64 {
        self.session_phases.iter().filter(|p| p.name == name).map(|p| p.ms).sum()
    }
}

/// `start-up 12.345 s: build 0.120 s, plan 0.340 s, backend 9.800 s (open
/// device 0.310, ..., other 0.002), weights 0.085 s`: the one line a
/// command prints before its first step ("backend": opening the CPU or GPU
/// that runs the step, its phases in parentheses).
impl fmt::Display for StartupTimes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = |ms: f64| ms / 1e3;
        write!(
            f,
            "start-up {:.3} s: build {:.3} s, plan {:.3} s, backend {:.3} s",
            s(self.total_ms),
            s(self.build_ms),
            s(self.plan_ms),
            s(self.session_ms)
        )?;
        if !self.session_phases.is_empty() {
            let parts: Vec<String> = self.session_phases.iter().map(|p| format!("{} {:.3}", p.name, s(p.ms))).collect();
            let other = self.session_ms - self.session_phases.iter().map(|p| p.ms).sum::<f64>();
            write!(f, " ({}, other {:.3})", parts.join(", "), s(other.max(0.0)))?;
        }
        write!(f, ", weights {:.3} s", s(self.weights_ms))
    }
}

/// A planned step bound to one backend. See the module doc.
pub trait Session {
    /// The step trace the session runs.
    fn trace(&self) -> &Trace;

    /// The memory plan the session's buffers are laid out by.
    fn plan(&self) -> &MemoryPlan;

    /// The device that runs the step, in words ("the CPU", "GPU 0 (sm_90)").
    fn device(&self) -> String;

    /// Writes a leaf (parameter, optimizer state or step input); index
    /// inputs are checked against what they index first.
    fn write(&mut self, v: ValueId, data: &HostTensor) -> Result<()>;

    /// Writes the leaf called `name`.
    fn write_named(&mut self, name: &str, data: &HostTensor) -> Result<()> {
        let v = self.trace().leaf_by_name(name).ok_or_else(|| Error::Input {
            name: name.into(),
            reason: format!("trace `{}` has no leaf of that name", self.trace().name),
        })?;
        self.write(v, data)
    }

    /// Writes zeros into every optimizer state leaf (AdamW's moments before
    /// the first step).
    fn zero_state(&mut self) -> Result<()> {
        let states: Vec<ValueId> =
            self.trace().leaves().filter(|&v| matches!(self.trace().value(v).kind, ValueKind::State { .. })).collect();
        for s in states {
            let zeros = HostTensor::zeros(self.trace().ty(s).clone());
            self.write(s, &zeros)?;
        }
        Ok(())
    }

    /// Writes every parameter's initial value for `seed`: the bits
    /// [`crate::models::init_params`] draws on the host, for any trace with
    /// those parameter names (streams are per name). This default draws on
    /// the host one tensor at a time into one reused buffer and writes it,
    /// so the model is never in host memory whole; a backend with its own
    /// generator draws in place instead.
    fn init_params(&mut self, seed: u64) -> Result<InitReport> {
        let start = Instant::now();
        // Frozen weights too: a run with adapters and no pretrained folder
        // starts its base from the same draw as a full run.
        let params: Vec<ValueId> = self
            .trace()
            .weights()
            .filter(|&v| !self.trace().value(v).kind.leaf_name().is_some_and(is_quantized_leaf))
            .collect();
        let Some(largest) = params.iter().map(|&p| self.trace().ty(p)).max_by_key(|t| t.bytes()).cloned() else {
            return Ok(InitReport { tensors: 0, bytes: 0, on_device: false, elapsed: start.elapsed() });
        };
        let mut buffer = HostTensor::zeros(largest);
        let mut bytes = 0;
        for &p in &params {
            let ty = self.trace().ty(p).clone();
            let name = self.trace().value(p).kind.leaf_name().unwrap_or_default().to_string();
            bytes += ty.bytes();
            buffer.retype(ty.clone());
            fill_param(&name, &ty, seed, buffer.bytes_mut())?;
            self.write(p, &buffer)?;
        }
        let trace = self.trace().clone();
        let quantized = init_quantized(self, &trace, seed)?;
        Ok(InitReport { tensors: params.len() + quantized, bytes, on_device: false, elapsed: start.elapsed() })
    }

    /// The phases of opening this session and their times, in order (for
    /// [`StartupTimes`]); empty where the backend does not time them.
    fn startup_phases(&self) -> Vec<StartupPhase> {
        Vec::new()
    }

    /// Runs one step launch by launch, and waits for it.
    fn run_eager(&mut self) -> Result<()>;

    /// Records the step for replay with every address fixed (the CPU's
    /// launch list, the GPU's CUDA graph, which wants one eager step before
    /// it so modules and communicators are warm); returns how long that took.
    fn prepare_replay(&mut self) -> Result<Duration>;

    /// What [`Session::prepare_replay`] makes, with its verb, for reports
    /// ("launch list recorded").
    fn replay_label(&self) -> &'static str;

    /// Runs one step from the recording (made first if there is none), and
    /// waits for it.
    fn replay(&mut self) -> Result<()>;

    /// Runs the nodes `nodes` of the trace eagerly and waits for them: one
    /// segment of a trace that holds several programs over one plan (a
    /// generation program's prefill and decode buckets). A segment reads
    /// the leaves and the values earlier segments left in persistent
    /// storage, never another segment's arena values.
    fn run_nodes(&mut self, nodes: Range<usize>) -> Result<()>;

    /// Runs the nodes `nodes` from a recording of that range made once (a
    /// CUDA graph per range on the GPU), and waits for it.
    fn replay_nodes(&mut self, nodes: Range<usize>) -> Result<()>;

    /// Makes the recording [`Session::replay_nodes`] runs for `nodes` (once;
    /// a GPU wants the range run eagerly before, as
    /// [`Session::prepare_replay`] does), and returns how long that took.
    fn prepare_replay_nodes(&mut self, nodes: Range<usize>) -> Result<Duration>;

    /// The device memory the recording of `nodes` took, once made (`None`
    /// before, or where recordings are host launch lists).
    fn segment_graph_bytes(&self, _nodes: Range<usize>) -> Option<u64> {
        None
    }

    /// Runs the nodes `nodes` once eagerly with a timer around every
    /// launch: per kernel name, the launch count and milliseconds, slowest
    /// first. Empty where the backend does not time launches.
    fn profile_nodes(&mut self, _nodes: Range<usize>) -> Result<Vec<(String, usize, f64)>> {
        Ok(Vec::new())
    }

    /// Reads any value (meaningful for leaves and step outputs after a step).
    fn read(&mut self, v: ValueId) -> Result<HostTensor>;

    /// The loss of the last step, as f64.
    fn loss(&mut self) -> Result<f64> {
        let l = self.trace().loss().ok_or_else(|| Error::Input {
            name: "loss".into(),
            reason: format!("trace `{}` has no loss output", self.trace().name),
        })?;
        Ok(self.read(l)?.to_f64()[0])
    }

    /// The plan next to the memory the session holds, sampled now.
    fn memory(&mut self) -> Result<SessionMemory>;

    /// Bytes per second of copies between device memory and page-locked
    /// host memory (the slower direction), where the session measured it:
    /// a GPU session whose plan offloads values does while it opens.
    fn host_link_bytes_per_second(&self) -> Option<f64> {
        None
    }
}

impl<S: Session + ?Sized> NamedParams for S {
    fn params_trace_name(&self) -> &str {
        &self.trace().name
    }

    fn has_param(&self, name: &str) -> bool {
        self.trace().leaf_by_name(name).is_some()
    }

    fn read_param(&mut self, name: &str) -> Result<HostTensor> {
        let v = self.trace().leaf_by_name(name).ok_or_else(|| Error::Input {
            name: name.into(),
            reason: format!("trace `{}` has no leaf of that name", self.trace().name),
        })?;
        self.read(v)
    }

    fn write_param(&mut self, name: &str, value: &HostTensor) -> Result<()> {
        self.write_named(name, value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autodiff::{StepKind, LR_INPUT, STEP_INPUT};
    use crate::cpu::exec::{scalar_input, CpuSession};
    use crate::ir::{DType, TensorType};
    use crate::models::gpt::{TARGETS_INPUT, TOKENS_INPUT};
    use crate::models::{init_params, LossKind, ModelSpec};
    use crate::pipeline::{compile_step, CompileTimes, CompiledStep, StepOptions};

    fn tiny(kind: StepKind) -> CompiledStep {
        let spec = ModelSpec::named("tiny-llama", 2, 8, DType::F32, LossKind::CrossEntropy).unwrap();
        compile_step(&spec, &StepOptions::new(kind)).unwrap()
    }

    fn open(c: &CompiledStep) -> Box<dyn Session> {
        Box::new(CpuSession::new(c.step.clone(), c.plan.clone()).unwrap())
    }

    /// Parameters, zero state and one batch, through the trait only.
    fn load(s: &mut dyn Session, c: &CompiledStep, it: usize) {
        for (v, t) in init_params(&c.forward, 5) {
            s.write_named(c.forward.value(v).kind.leaf_name().unwrap(), &t).unwrap();
        }
        s.zero_state().unwrap();
        let ty = TensorType::new(DType::I32, [2, 8]);
        let ids: Vec<f64> = (0..16).map(|i| ((i * 29 + it * 7) % 256) as f64).collect();
        let tg: Vec<f64> = (0..16).map(|i| ((i * 13 + it) % 256) as f64).collect();
        s.write_named(TOKENS_INPUT, &HostTensor::from_f64(ty.clone(), &ids)).unwrap();
        s.write_named(TARGETS_INPUT, &HostTensor::from_f64(ty, &tg)).unwrap();
        if s.trace().leaf_by_name(LR_INPUT).is_some() {
            s.write_named(LR_INPUT, &scalar_input(1e-2)).unwrap();
            s.write_named(STEP_INPUT, &scalar_input(it as f64)).unwrap();
        }
    }

    #[test]
    fn a_cpu_session_is_driven_through_the_trait() {
        let c = tiny(StepKind::Grads);
        let mut s = open(&c);
        assert_eq!(s.device(), "the CPU");
        assert_eq!(s.trace().to_string(), c.step.to_string());
        assert_eq!(s.plan().slots, c.plan.slots);
        load(s.as_mut(), &c, 1);
        s.run_eager().unwrap();
        let loss = s.loss().unwrap();
        assert!(loss.is_finite() && loss > 0.0, "{loss}");
        let l = s.trace().loss().unwrap();
        assert_eq!(s.read(l).unwrap().to_f64(), [loss]);
        // Parameters read back as written; every gradient is computed.
        let (p, value) = init_params(&c.forward, 5).into_iter().next().unwrap();
        let name = c.forward.value(p).kind.leaf_name().unwrap();
        let sp = s.trace().leaf_by_name(name).unwrap();
        assert_eq!(s.read(sp).unwrap().bytes(), value.bytes());
        let g = s.trace().grad_of(sp).unwrap();
        assert!(s.read(g).unwrap().to_f64().iter().all(|x| x.is_finite()));
        // Replay gives the eager step's bits on the same inputs, written
        // again: the plan lets the step reuse a step input's bytes once it
        // is read (the targets' here).
        assert_eq!(s.replay_label(), "launch list recorded");
        load(s.as_mut(), &c, 1);
        s.prepare_replay().unwrap();
        s.replay().unwrap();
        assert_eq!(s.loss().unwrap().to_bits(), loss.to_bits());
        let m = s.memory().unwrap();
        assert_eq!(m.planned_bytes, c.planned_peak_bytes());
        assert!(m.held_bytes >= m.planned_bytes && !m.measured && m.comm_bytes == 0, "{m:?}");
    }

    #[test]
    fn replayed_and_eager_training_agree_through_the_trait() {
        let c = tiny(StepKind::Train);
        let (mut eager, mut replayed) = (open(&c), open(&c));
        for it in 1..=3 {
            load(eager.as_mut(), &c, it);
            load(replayed.as_mut(), &c, it);
            eager.run_eager().unwrap();
            replayed.replay().unwrap();
            assert_eq!(eager.loss().unwrap().to_bits(), replayed.loss().unwrap().to_bits(), "step {it}");
        }
        // The AdamW moments moved from the zeros written before each step.
        let m = c.step.leaves().find(|&v| matches!(c.step.value(v).kind, ValueKind::State { .. })).unwrap();
        assert!(eager.read(m).unwrap().to_f64().iter().any(|&x| x != 0.0));
    }

    /// The session's own initial weights are the host draw's bits, written
    /// by name into the step trace (whose parameter order is not the
    /// forward trace's), for every float dtype.
    #[test]
    fn a_session_writes_the_host_draw_of_the_weights() {
        for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            let spec = ModelSpec::named("tiny-neox", 1, 8, dtype, LossKind::CrossEntropy).unwrap();
            let c = compile_step(&spec, &StepOptions::new(StepKind::Train)).unwrap();
            let mut s = open(&c);
            // Garbage first, so that a parameter the session skipped shows.
            for p in c.step.params().collect::<Vec<_>>() {
                s.write(p, &HostTensor::garbage(c.step.ty(p).clone())).unwrap();
            }
            let report = s.init_params(11).unwrap();
            let host = init_params(&c.forward, 11);
            assert_eq!(report.tensors, host.len());
            assert_eq!(report.bytes, host.iter().map(|(_, t)| t.ty.bytes()).sum::<u64>());
            assert!(!report.on_device);
            for (v, t) in host {
                let name = c.forward.value(v).kind.leaf_name().unwrap();
                let sp = s.trace().leaf_by_name(name).unwrap();
                assert!(s.read(sp).unwrap() == t, "{dtype} {name}");
            }
            assert!(s.startup_phases().is_empty(), "the CPU session does not time its phases");
        }
    }

    #[test]
    fn startup_times_add_up_and_print_on_one_line() {
        let compile = CompileTimes { build: Duration::from_millis(1500), plan: Duration::from_millis(250) };
        let phases = vec![
            StartupPhase::new("kernel load", Duration::from_millis(400)),
            StartupPhase::new("GEMM tuning", Duration::from_millis(2000)),
        ];
        let t = StartupTimes::new(compile, Duration::from_millis(3000), phases, Duration::from_millis(125));
        assert_eq!(t.total_ms, 1500.0 + 250.0 + 3000.0 + 125.0);
        assert_eq!(t.phase_ms("GEMM tuning"), 2000.0);
        assert_eq!(t.phase_ms("graph capture"), 0.0);
        assert_eq!(
            t.to_string(),
            "start-up 4.875 s: build 1.500 s, plan 0.250 s, backend 3.000 s \
             (kernel load 0.400, GEMM tuning 2.000, other 0.600), weights 0.125 s"
        );
        let json = serde_json::to_value(&t).unwrap();
        assert_eq!(json["session_phases"][1]["name"], "GEMM tuning");
        assert_eq!(json["weights_ms"], 125.0);
        let cpu = StartupTimes::new(compile, Duration::from_millis(10), Vec::new(), Duration::ZERO);
        assert_eq!(cpu.to_string(), "start-up 1.760 s: build 1.500 s, plan 0.250 s, backend 0.010 s, weights 0.000 s");
    }

    #[test]
    fn bad_writes_are_refused_through_the_trait() {
        let c = tiny(StepKind::Grads);
        let mut s = open(&c);
        let e = s.write_named("no_such_leaf", &scalar_input(1.0)).unwrap_err().to_string();
        assert!(e.contains("no_such_leaf") && e.contains("no leaf of that name"), "{e}");
        let e = s.write_named(TOKENS_INPUT, &scalar_input(1.0)).unwrap_err().to_string();
        assert!(e.contains("expected i32[2,8]"), "{e}");
        let ids = HostTensor::from_f64(TensorType::new(DType::I32, [2, 8]), &[300.0; 16]);
        let e = s.write_named(TOKENS_INPUT, &ids).unwrap_err().to_string();
        assert!(e.contains("token id 300"), "{e}");
    }

    /// Two sessions measured on one device: the later one's baseline holds
    /// the earlier one's memory, and the earlier one's peak (sampled after
    /// the later one opened) holds both, so the run held the larger peak,
    /// not the sum; counted memory adds up.
    #[test]
    fn combined_memory_counts_a_second_session_once() {
        let m = |held_bytes, baseline_bytes, measured| SessionMemory {
            planned_bytes: 10,
            held_bytes,
            comm_bytes: 0,
            measured,
            baseline_bytes,
        };
        // Train: 200 B from a 100 B baseline, then eval opens (baseline 300)
        // and holds 150 B more; train's later samples see 350 B above its baseline.
        let (train, eval) = (m(350, 100, true), m(150, 300, true));
        let run = train.combine(&eval);
        assert_eq!((run.planned_bytes, run.held_bytes, run.baseline_bytes), (20, 350, 100));
        // Sampled before the eval session grew: its own peak decides.
        let run = m(200, 100, true).combine(&eval);
        assert_eq!(run.held_bytes, 350);
        let counted = m(200, 0, false).combine(&m(150, 0, false));
        assert_eq!((counted.held_bytes, counted.measured), (350, false));
    }
}

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

use std::time::Duration;

use serde::Serialize;

use crate::error::{Error, Result};
use crate::host::HostTensor;
use crate::ir::{Trace, ValueId, ValueKind};
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autodiff::{StepKind, LR_INPUT, STEP_INPUT};
    use crate::cpu::exec::{scalar_input, CpuSession};
    use crate::ir::{DType, TensorType};
    use crate::models::gpt::{TARGETS_INPUT, TOKENS_INPUT};
    use crate::models::{init_params, LossKind, ModelSpec};
    use crate::pipeline::{compile_step, CompiledStep, StepOptions};

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
}

//! A one-device session never loads NCCL; a data-parallel rank's does,
//! before it touches the GPU. Runs on every machine (CI has no GPU): the
//! library is looked for in the session's first stage, before the device is
//! opened, so a machine without a GPU still shows whether it was.
//!
//! One test in its own binary: NCCL's load state is per process.

use stepgraph_core::autodiff::StepKind;
use stepgraph_core::dist::DataParallel;
use stepgraph_core::ir::DType;
use stepgraph_core::models::{LossKind, ModelSpec};
use stepgraph_core::pipeline::{compile_step, StepOptions};
use stepgraph_cuda::nccl::{load_attempted, NcclGroup, NcclId};
use stepgraph_cuda::session::{gpu_available, step_needs_nccl, CudaOptions, CudaSession, RankOptions};

#[test]
fn only_a_step_with_collectives_loads_nccl() {
    let spec = ModelSpec::named("tiny-llama", 2, 8, DType::F32, LossKind::CrossEntropy).unwrap();
    let single = compile_step(&spec, &StepOptions::new(StepKind::Train)).unwrap();
    assert!(!step_needs_nccl(&single.step));
    // With a GPU this opens a real session; without one it fails at the
    // device. Either way NCCL stays unloaded.
    let opened =
        CudaSession::new_rank(single.step, single.plan, CudaOptions::from_env().unwrap(), RankOptions::default());
    if !gpu_available() {
        assert!(opened.is_err());
    }
    drop(opened);
    assert!(!load_attempted(), "a one-device session loaded NCCL");

    // A rank of a 2-GPU group looks for NCCL first. With GPUs the session
    // would then wait for a second rank that never comes, so only where
    // there is no GPU (CI).
    if gpu_available() {
        return;
    }
    let dp = StepOptions { data_parallel: Some(DataParallel::new(2)), ..StepOptions::new(StepKind::Train) };
    let rank = compile_step(&spec, &dp).unwrap();
    assert!(step_needs_nccl(&rank.step));
    let group = NcclGroup { id: NcclId([0; 128]), rank: 0, world: 2 };
    let opts = RankOptions { device: 0, group: Some(group), overlap: false };
    assert!(CudaSession::new_rank(rank.step, rank.plan, CudaOptions::from_env().unwrap(), opts).is_err());
    assert!(load_attempted(), "the data-parallel rank did not look for NCCL");
}

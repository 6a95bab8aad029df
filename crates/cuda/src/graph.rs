//! CUDA graph capture and replay: the only module that knows graphs exist.
//!
//! The session hands it a stream and a closure that enqueues the step's
//! launch list; everything enqueued is recorded into one graph, which is
//! instantiated and uploaded once and then replayed. The launches carry the
//! plan's fixed addresses, so a replay needs no copies of anything: the
//! host writes the next step's inputs into their planned slots and replays.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaStream};

use crate::error::{CudaError, Result};

/// One captured step.
pub struct StepGraph {
    graph: CudaGraph,
    /// Wall time of capture plus instantiation.
    pub capture_time: Duration,
}

impl StepGraph {
    /// Records everything `enqueue` puts on `stream` into one graph.
    pub fn capture(stream: &Arc<CudaStream>, enqueue: impl FnOnce() -> Result<()>) -> Result<Self> {
        let t0 = Instant::now();
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let enqueued = enqueue();
        // End the capture whatever happened, so the stream is usable again.
        let ended = stream.end_capture(CUgraphInstantiate_flags(0));
        enqueued?;
        let graph = ended?.ok_or_else(|| CudaError::Driver("stream capture produced no graph".into()))?;
        graph.upload()?;
        Ok(StepGraph { graph, capture_time: t0.elapsed() })
    }

    /// Enqueues one replay of the step.
    pub fn replay(&self) -> Result<()> {
        self.graph.launch()?;
        Ok(())
    }
}

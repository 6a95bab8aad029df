//! The one error type of `stepgraph-core`. Every message names the thing that
//! is wrong (the op, the value, the model, the line) and the shapes or values
//! involved, so a user can act on it without reading the source.

use thiserror::Error;

/// Errors raised anywhere in the compiler and the CPU backend.
#[derive(Debug, Error)]
pub enum Error {
    /// A model name that no named config matches: `suggest` holds the
    /// closest known names (perhaps none), `known` every one.
    #[error(
        "unknown model name `{name}`{}; known models: {known}",
        match suggest.as_slice() {
            [] => String::new(),
            [one] => format!(" (did you mean `{one}`?)"),
            many => format!(" (did you mean `{}`?)", many.join("`, `")),
        }
    )]
    UnknownModel { name: String, suggest: Vec<String>, known: String },
    /// A size past what stepgraph can hold: a value of more than
    /// [`crate::ir::MAX_VALUE_BYTES`], a model or batch whose sizes multiply
    /// past it, a count past what an id or a kernel's index can number.
    /// `keys` are the config keys and batch fields (`batch`, `seq`) the
    /// size is made of, when it comes from a model (empty otherwise), so a
    /// caller can name the flags or file keys they came from.
    #[error("{reason}")]
    Size { keys: Vec<&'static str>, reason: String },
    /// A model configuration that cannot describe a valid network.
    #[error("invalid model config `{model}`: {reason}")]
    Config { model: String, reason: String },
    /// An op applied to inputs whose shapes or dtypes it does not accept.
    #[error("op `{op}`: {reason}")]
    Op { op: String, reason: String },
    /// A trace text that does not parse.
    #[error("trace text, line {line}: {reason}")]
    Parse { line: usize, reason: String },
    /// A trace that breaks one of the IR invariants.
    #[error("trace `{trace}` fails verification: {reason}")]
    Verify { trace: String, reason: String },
    /// A pass whose output breaks an IR invariant: `pass` names it, `source`
    /// is the verifier's error ([`crate::passes::verify_after`]).
    #[error("pass `{pass}` produced a trace that fails verification: {source}")]
    PassOutput { pass: String, source: Box<Error> },
    /// A pass that cannot take the trace it was given (a pass that adds or
    /// moves nodes, handed a trace run in segments it cannot keep).
    #[error("pass `{pass}`: {reason}")]
    Pass { pass: String, reason: String },
    /// Differentiation could not build the backward trace.
    #[error("autodiff: {0}")]
    Autodiff(String),
    /// An op whose VJP rule declares it is not differentiable (backward ops,
    /// the optimizer update, collectives), met by differentiation.
    #[error("autodiff: `{op}` {reason}")]
    NotDifferentiable { op: String, reason: String },
    /// The memory planner or its checker found a problem.
    #[error("memory plan: {0}")]
    Plan(String),
    /// A memory budget that recomputation and offload cannot meet, at any MLP row
    /// tiling tried: `least` is the smallest planned peak reached, with the
    /// MLP in `mlp_tiles` row tiles. No smaller budget works. `hint` says
    /// what else would lower the peak (a setting that costs memory).
    #[error(
        "memory plan: the memory budget of {budget} B ({:.3} GB) cannot be met: recomputing every saved value \
         that can be recomputed, and keeping what backward reads in host memory where that helps, plans \
         {least} B ({:.3} GB){}; ask for at least that, or a smaller batch or sequence{}",
        *budget as f64 / 1e9,
        *least as f64 / 1e9,
        if *mlp_tiles > 1 { format!(" with the MLP in {mlp_tiles} row tiles") } else { String::new() },
        hint.as_ref().map(|h| format!("; {h}")).unwrap_or_default()
    )]
    MemoryBudget { budget: u64, least: u64, mlp_tiles: usize, hint: Option<String> },
    /// `what` (a planned step) needs more host memory than is available:
    /// refused before anything was allocated. `origin` says where the
    /// available number comes from (see [`crate::host::memory`]).
    #[error(
        "{what} needs {needed} bytes ({:.2} GB) of host memory, but {available} bytes ({:.2} GB) are available \
         ({origin}); nothing was allocated",
        *needed as f64 / 1e9,
        *available as f64 / 1e9
    )]
    HostMemory { what: String, needed: u64, available: u64, origin: String },
    /// A host allocation that failed (the allocator refused it).
    #[error("allocating {bytes} bytes ({:.2} GB) of host memory for {what} failed", *bytes as f64 / 1e9)]
    Allocation { what: String, bytes: u64 },
    /// The CPU backend could not run a program.
    #[error("cpu backend: {0}")]
    Cpu(String),
    /// A collective op or its communicator failed: a rank failed or never
    /// arrived, the ranks disagree on the program, or no communicator is set.
    #[error("collective: {0}")]
    Collective(String),
    /// A data-parallel transform that cannot apply to this step (batch or
    /// parameter shapes that do not split over the ranks, a step without gradients).
    #[error("data parallel: {0}")]
    Parallel(String),
    /// Another backend's error, passed through a backend-neutral interface
    /// ([`crate::session::Session`]); its message names the backend's problem.
    #[error("{0}")]
    Backend(Box<dyn std::error::Error + Send + Sync + 'static>),
    /// Bad data handed to a step: wrong length, token id out of range, ...
    #[error("step input `{name}`: {reason}")]
    Input { name: String, reason: String },
    /// A Hugging Face model folder or safetensors file that cannot be
    /// loaded into (or saved from) a model; `reason` names the file and
    /// the tensor.
    #[error("checkpoint `{path}`: {reason}")]
    Checkpoint { path: String, reason: String },
    // The cause is in the message, not a `#[source]`, so `{:#}` chains print it once.
    #[error("io error on `{path}`: {cause}")]
    Io { path: String, cause: std::io::Error },
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
}

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Shorthand for an [`Error::Op`] naming `op`.
    pub fn op(op: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Op { op: op.into(), reason: reason.into() }
    }
}

//! stepgraph's training runtime as a library: what the `train` command
//! runs, usable without the command line.
//!
//! A run is one [`RunConfig`] (model, step options, data, seed, group,
//! switches, and its [`Course`]: steps, schedule, evaluation, checkpoints),
//! which builds the step and, serialized, is the identity a checkpoint is
//! resumed against. A [`Trainer`] opens the sessions ([`open_session`], the
//! one place any command binds a step to a backend), writes the initial
//! weights or loads a checkpoint, and trains step by step, telling a
//! [`Reporter`] what happens. The modules:
//!
//! - [`config`]: the run configuration and its resume identity;
//! - [`trainer`]: the training loop, evaluation, checkpoints and resume;
//! - [`session`]: [`Backend`] and [`open_session`];
//! - [`checkpoint`]: atomic checkpoint directories, keeping K;
//! - [`export`]: a checkpoint as a model (or peft adapter) folder;
//! - [`data`]: byte-level text and token files as batches;
//! - [`divergence`], [`schedule`], [`metrics`]: the loss watch, the
//!   learning-rate schedule, the JSONL metrics file and MFU;
//! - [`tensorboard`]: the metrics as TensorBoard event files;
//! - [`lock`]: one run per checkpoint directory.
//!
//! Messages name the `stepgraph train` flags that change a setting, since
//! the command line is where most runs are configured.

pub mod checkpoint;
pub mod config;
pub mod data;
pub mod divergence;
pub mod export;
pub mod lock;
pub mod metrics;
pub mod schedule;
pub mod session;
pub mod tensorboard;
pub mod trainer;

pub use config::{Checkpoints, Course, DataConfig, RunConfig};
pub use session::{open_cuda_session, open_session, Backend, Opened, SessionOptions};
pub use trainer::{Placement, Quiet, Reporter, RunEnd, Start, StepReport, Summary, Trainer};

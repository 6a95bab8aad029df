//! Models: GPT-family configurations ([`config`]) and the builder that
//! records a configuration's forward pass and loss as a trace ([`gpt`]).

pub mod checkpoint;
pub mod config;
pub mod gpt;

pub use config::{Config, MlpKind, NormKind, Overrides};
pub use gpt::{build_forward, init_params, init_params_fast, LossKind, ModelSpec};

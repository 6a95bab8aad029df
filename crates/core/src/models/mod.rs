//! Models: GPT-family configurations ([`config`]), reading Hugging Face
//! `config.json` files into them ([`hf`]), and the builder that records a
//! configuration's forward pass and loss as a trace ([`gpt`]).

pub mod checkpoint;
pub mod config;
pub mod gpt;
pub mod hf;

pub use config::{Config, MlpKind, NormKind, Overrides};
pub use gpt::{build_forward, build_forward_opts, init_params, init_params_fast, ForwardOptions, LossKind, ModelSpec};

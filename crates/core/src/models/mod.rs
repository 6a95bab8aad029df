//! Models: GPT-family configurations ([`config`]), reading Hugging Face
//! `config.json` files into them ([`hf`]), the builder that records a
//! configuration's forward pass and loss as a trace ([`gpt`]), safetensors
//! files ([`checkpoint`]) and whole Hugging Face model folders in and out of
//! a session ([`hf_dir`]).

pub mod checkpoint;
pub mod config;
pub mod gpt;
pub mod hf;
pub mod hf_dir;

pub use config::{Config, MlpKind, NormKind, Overrides};
pub use gpt::{build_forward, init_params, init_params_fast, LossKind, ModelSpec};

//! Models: GPT-family configurations ([`config`]), reading Hugging Face
//! `config.json` files into them ([`hf`]), the Hugging Face model families
//! and everything that differs between them ([`family`]), the builder that records a
//! configuration's forward pass and loss as a trace ([`gpt`]), safetensors
//! files ([`checkpoint`]), whole Hugging Face model folders in and out of
//! a session ([`hf_dir`]), the initial weights, the same bits on the
//! host and on a GPU ([`init`]), low-rank adapters over a frozen base
//! ([`lora`]) and the adapter folders `peft` reads and writes ([`peft`]),
//! and what a mixture-of-experts step holds for its experts ([`moe`]).

pub mod checkpoint;
pub mod config;
pub mod family;
pub mod generate;
pub mod gpt;
pub mod hf;
pub mod hf_dir;
pub mod init;
pub mod lora;
pub mod moe;
pub mod peft;

pub use config::{Config, MlpKind, MoeConfig, NormKind, Overrides, QkNorm};
pub use gpt::{build_forward, build_forward_opts, ForwardOptions, LossKind, ModelSpec};
pub use init::{init_param, init_param_as, init_params, param_init};
pub use lora::{Adapters, BaseStorage, LoraTarget};

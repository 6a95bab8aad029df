//! Models: GPT-family configurations ([`config`]) and the builder that
//! records a configuration's forward pass and loss as a trace ([`gpt`]).

pub mod config;
// pub mod gpt; (enabled once the nn ops land)

pub use config::{Config, MlpKind, NormKind, Overrides};

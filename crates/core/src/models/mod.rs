//! Model configs and the GPT builder.
pub mod config;

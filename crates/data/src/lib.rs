//! stepgraph's training data, kept out of the compiler core: Hugging Face
//! tokenizers and chat templates ([`tokenizer`], [`template`]), input records
//! and their loss masks ([`records`]), the input files they come from
//! (text, JSONL, JSON arrays, Parquet: [`inputs`], [`parquet_input`]) and
//! mixtures of them ([`mixture`]), the memory-mapped token file
//! ([`token_file`]), `stepgraph prepare` as a library call ([`prepare`]),
//! and the batch loader the training loop calls ([`batcher`]).
//!
//! The training loop's use:
//!
//! ```no_run
//! # use stepgraph_data::{TokenFile, Batcher, BatcherOptions, Packing, Split};
//! # fn main() -> stepgraph_data::Result<()> {
//! let file = TokenFile::open("data/tiny.tokens")?;
//! let opts = BatcherOptions { batch: 8, seq: 128, seed: 0, split: Split::Train, packing: Packing::Documents };
//! let mut batches = Batcher::new(&file, opts)?;
//! let batch = batches.next_batch()?;
//! let [input_ids, targets] = batch.host_tensors();
//! let position_ids = batch.positions_tensor(); // each token's position in its document
//! let cursor = batches.cursor(); // saved with a checkpoint; Batcher::resume restores it
//! # let _ = (input_ids, targets, position_ids, cursor); Ok(()) }
//! ```

pub mod batcher;
pub mod error;
pub mod fixtures;
pub mod inputs;
pub mod mixture;
pub mod parquet_input;
pub mod prepare;
pub mod records;
pub mod template;
pub mod token_file;
pub mod tokenizer;

pub use batcher::{Batch, Batcher, BatcherOptions, DataCursor, Packing, IGNORE_INDEX};
pub use error::{Error, RecordAt, Result};
pub use inputs::InputFormat;
pub use prepare::{prepare, Holdout, InputReport, PrepareOptions, PrepareReport};
pub use records::TextSplit;
pub use token_file::{Document, Split, TokenFile, TokenFileMeta};
pub use tokenizer::{Tokenizer, TokenizerFingerprint};

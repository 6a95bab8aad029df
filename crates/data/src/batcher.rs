//! Batches for the training step, drawn from a [`TokenFile`].
//!
//! **Packing** ([`Packing`]). With [`Packing::Documents`] (the default) and
//! [`Packing::Stream`], a split's documents (each ending with EOS) are one
//! continuous token stream. Sequence `k` is the `seq + 1` tokens starting at
//! `k·seq`: its first `seq` tokens are the inputs and the last `seq` the
//! targets, so consecutive sequences share one token. The last sequence is
//! padded (input EOS, target ignored) so no token is dropped. With
//! [`Packing::None`] every sequence holds tokens of one document only
//! (a long document fills several, sharing one token as above), padded
//! after the document's end.
//!
//! **Document boundaries.** With [`Packing::Documents`] no token sees
//! another document: the batch carries each token's position in its
//! document (0 at a document's first token in the row, and at the row's
//! first token), which the model's RoPE rotates by and its attention masks
//! by, and a document's last token (its EOS) predicts nothing, since what
//! follows it is another document. So a packed row trains exactly as its
//! documents would one by one. With [`Packing::Stream`] sequences cross
//! boundaries freely (GPT-2-style pre-training): the model attends across
//! the EOS into the previous document and the token after an EOS is a
//! target. Targets are also [`IGNORE_INDEX`] where the token file's mask
//! says the token is not a target (chat prompts) and in padding.
//!
//! **Order.** Training draws the sequences in a fresh permutation each epoch
//! (without replacement), seeded by `(seed, epoch)`; rows continue from one
//! epoch into the next, so every batch is full. Validation is one pass in
//! stream order, its last batch padded with rows whose targets are all
//! ignored, repeated identically.
//!
//! **Resume.** Batch `n` depends only on the file, the options and `n`, so
//! a [`DataCursor`] (the options' fingerprint and the number of batches
//! drawn) restores a run exactly: [`Batcher::resume`] then yields the batches
//! the uninterrupted run would have.

use std::borrow::Borrow;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, TensorType};
pub use stepgraph_core::models::gpt::IGNORE_INDEX;

use crate::error::{Error, Result};
use crate::token_file::{Split, TokenFile};

/// How documents share the rows of a batch (see the module doc).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Packing {
    /// Documents back to back, none seeing another: batches carry
    /// positions within documents, and a document's EOS predicts nothing.
    #[default]
    Documents,
    /// Documents back to back, each token attending to everything before
    /// it in its row (GPT-2-style pre-training).
    Stream,
    /// One document per row, padded after its end.
    None,
}

impl Packing {
    /// The names `--packing` takes.
    pub const NAMES: [&'static str; 3] = ["documents", "stream", "none"];

    pub fn parse(s: &str) -> Option<Packing> {
        match s {
            "documents" => Some(Packing::Documents),
            "stream" => Some(Packing::Stream),
            "none" => Some(Packing::None),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Packing::Documents => "documents",
            Packing::Stream => "stream",
            Packing::None => "none",
        }
    }

    /// Batches carry positions within documents (the model masks by them).
    pub fn has_positions(self) -> bool {
        self == Packing::Documents
    }

    /// What cursors saved before packing was a choice did: the stream.
    fn saved_before_choice() -> Packing {
        Packing::Stream
    }
}

/// The shape and order of the batches.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct BatcherOptions {
    /// Rows per batch (the global batch; data-parallel ranks take their rows).
    pub batch: usize,
    /// Tokens per row: the model's sequence length.
    pub seq: usize,
    /// Seeds each epoch's permutation of the training sequences.
    pub seed: u64,
    pub split: Split,
    pub packing: Packing,
}

/// One batch in the layout of the step inputs `input_ids`, `targets` and,
/// with [`Packing::Documents`], `position_ids` (`i32[batch, seq]`, row-major).
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub inputs: Vec<i32>,
    /// The inputs shifted by one in the packed stream; [`IGNORE_INDEX`]
    /// where the token is not a loss target, and in padding.
    pub targets: Vec<i32>,
    /// Each token's position in its document ([`Packing::Documents`]).
    pub positions: Option<Vec<i32>>,
    pub batch: usize,
    pub seq: usize,
    /// The epoch (pass, for validation) of the batch's first row, from 0.
    pub epoch: u64,
    /// This batch's number, from 0 at the start of the run.
    pub index: u64,
    /// Targets that count in the loss (not [`IGNORE_INDEX`]).
    pub loss_tokens: usize,
}

impl Batch {
    /// The batch as the step's `[input_ids, targets]` host tensors (`i32[batch, seq]`).
    pub fn host_tensors(&self) -> [HostTensor; 2] {
        [self.tensor(&self.inputs), self.tensor(&self.targets)]
    }

    /// The `position_ids` host tensor (`i32[batch, seq]`), with
    /// [`Packing::Documents`].
    pub fn positions_tensor(&self) -> Option<HostTensor> {
        self.positions.as_ref().map(|p| self.tensor(p))
    }

    fn tensor(&self, values: &[i32]) -> HostTensor {
        let mut t = HostTensor::zeros(TensorType::new(DType::I32, [self.batch, self.seq]));
        for (out, v) in t.bytes_mut().chunks_exact_mut(4).zip(values) {
            out.copy_from_slice(&v.to_ne_bytes());
        }
        t
    }
}

/// Where a batcher stands: what a checkpoint saves to resume the data
/// exactly. The fields besides `batches` identify the stream, so resuming
/// with another file, split, shape or seed is refused.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataCursor {
    /// Batches drawn so far; the next batch has this index.
    pub batches: u64,
    /// The epoch of the next batch's first row (informational; derived from `batches`).
    pub epoch: u64,
    pub seed: u64,
    pub split: Split,
    pub batch: usize,
    pub seq: usize,
    /// Sequences in the split.
    pub sequences: u64,
    /// [`TokenFile::content_hash`] of the file the cursor was taken on.
    pub file_hash: u64,
    /// How rows were packed; cursors saved before it was a choice packed
    /// the stream.
    #[serde(default = "Packing::saved_before_choice")]
    pub packing: Packing,
}

/// Draws batches from a token file (see the module doc). `F` holds the
/// file: a `&TokenFile` to borrow it, or a `TokenFile` or an
/// `Arc<TokenFile>` for a batcher that owns it (a training run's data
/// source keeps one for the whole run).
pub struct Batcher<F: Borrow<TokenFile>> {
    file: F,
    opts: BatcherOptions,
    /// First token of the split in the file.
    start: u64,
    /// Tokens in the split.
    len: u64,
    sequences: u64,
    batches: u64,
    /// The permutation of the training sequences for one epoch, kept for the
    /// epoch being drawn.
    permutation: Option<(u64, Vec<u64>)>,
    /// With [`Packing::None`]: the first sequence of each document of the
    /// split, and the sequence count after the last (`docs + 1` entries).
    doc_rows: Vec<u64>,
}

/// SplitMix64: decorrelates the per-epoch seeds of neighbouring `(seed, epoch)`.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl<F: Borrow<TokenFile>> Batcher<F> {
    /// A batcher at the start of the split.
    pub fn new(file: F, opts: BatcherOptions) -> Result<Batcher<F>> {
        let tf: &TokenFile = file.borrow();
        if opts.batch == 0 || opts.seq == 0 {
            return Err(Error::Options(format!(
                "batches need at least one row of one token, got batch {} and seq {}",
                opts.batch, opts.seq
            )));
        }
        let range = tf.split_tokens(opts.split);
        let len = range.end - range.start;
        if len < 2 {
            let which = match opts.split {
                Split::Train => "training",
                Split::Validation => "validation",
            };
            return Err(Error::token_file(
                tf.path(),
                format!(
                    "the {which} split has {len} tokens ({} documents); a batch needs at least 2{}",
                    tf.split_docs(opts.split).end - tf.split_docs(opts.split).start,
                    if opts.split == Split::Validation {
                        " (prepare with --val-docs N or --val-fraction F)"
                    } else {
                        ""
                    }
                ),
            ));
        }
        if i32::try_from(tf.vocab_size()).is_err() {
            return Err(Error::token_file(
                tf.path(),
                format!("vocabulary of {} ids does not fit i32 inputs", tf.vocab_size()),
            ));
        }
        let (sequences, doc_rows) = match opts.packing {
            Packing::Documents | Packing::Stream => ((len - 1).div_ceil(opts.seq as u64), Vec::new()),
            Packing::None => {
                // A document of L tokens has L − 1 targets, seq to a row.
                let docs = tf.split_docs(opts.split);
                let mut rows = Vec::with_capacity((docs.end - docs.start + 1) as usize);
                let mut total = 0u64;
                for d in docs {
                    rows.push(total);
                    let r = tf.doc_tokens(d);
                    total += (r.end - r.start).saturating_sub(1).div_ceil(opts.seq as u64);
                }
                rows.push(total);
                (total, rows)
            }
        };
        if sequences == 0 {
            return Err(Error::token_file(
                tf.path(),
                "every document is a single token, so unpacked rows (--packing none) have nothing to predict",
            ));
        }
        Ok(Batcher { file, opts, start: range.start, len, sequences, batches: 0, permutation: None, doc_rows })
    }

    /// A batcher that continues where `cursor` was taken, after checking
    /// that the cursor belongs to this file, split, shape and seed.
    pub fn resume(file: F, opts: BatcherOptions, cursor: &DataCursor) -> Result<Batcher<F>> {
        let mut b = Batcher::new(file, opts)?;
        let file = b.file();
        let mismatch = |what: &str, saved: String, now: String| {
            Err(Error::Cursor(format!("it was saved with {what} {saved}, but this run has {now}")))
        };
        if cursor.split != opts.split {
            return mismatch("split", format!("{:?}", cursor.split), format!("{:?}", opts.split));
        }
        if (cursor.batch, cursor.seq) != (opts.batch, opts.seq) {
            return mismatch(
                "batch x seq",
                format!("{} x {}", cursor.batch, cursor.seq),
                format!("{} x {}", opts.batch, opts.seq),
            );
        }
        if cursor.seed != opts.seed {
            return mismatch("seed", cursor.seed.to_string(), opts.seed.to_string());
        }
        if cursor.packing != opts.packing {
            return mismatch("--packing", cursor.packing.name().into(), opts.packing.name().into());
        }
        if cursor.file_hash != file.content_hash() || cursor.sequences != b.sequences {
            return mismatch(
                "a token file of fingerprint",
                format!("{:#018x} ({} sequences)", cursor.file_hash, cursor.sequences),
                format!(
                    "{} with fingerprint {:#018x} ({} sequences)",
                    file.path().display(),
                    file.content_hash(),
                    b.sequences
                ),
            );
        }
        b.batches = cursor.batches;
        Ok(b)
    }

    /// The token file the batches come from.
    pub fn file(&self) -> &TokenFile {
        self.file.borrow()
    }

    /// Sequences in the split (one epoch of training rows).
    pub fn sequences(&self) -> u64 {
        self.sequences
    }

    /// Batches in one validation pass (the last padded); for training, the
    /// batches that start in one epoch on average is `sequences / batch`.
    pub fn batches_per_pass(&self) -> u64 {
        self.sequences.div_ceil(self.opts.batch as u64)
    }

    /// Where the batcher stands, for a checkpoint.
    pub fn cursor(&self) -> DataCursor {
        DataCursor {
            batches: self.batches,
            epoch: self.epoch_of_batch(self.batches),
            seed: self.opts.seed,
            split: self.opts.split,
            batch: self.opts.batch,
            seq: self.opts.seq,
            sequences: self.sequences,
            file_hash: self.file().content_hash(),
            packing: self.opts.packing,
        }
    }

    fn epoch_of_batch(&self, index: u64) -> u64 {
        match self.opts.split {
            Split::Train => index.saturating_mul(self.opts.batch as u64) / self.sequences,
            Split::Validation => index / self.batches_per_pass(),
        }
    }

    /// The sequence of training row `row` (counting over all epochs).
    fn train_sequence(&mut self, row: u64) -> u64 {
        let (epoch, at) = (row / self.sequences, row % self.sequences);
        if self.permutation.as_ref().is_none_or(|(e, _)| *e != epoch) {
            let mut order: Vec<u64> = (0..self.sequences).collect();
            let mut rng = rand::rngs::StdRng::seed_from_u64(mix(mix(self.opts.seed) ^ epoch));
            order.shuffle(&mut rng);
            self.permutation = Some((epoch, order));
        }
        self.permutation.as_ref().expect("set above").1[at as usize]
    }

    /// The tokens `[first, end)` (absolute) sequence `k` reads: its first
    /// input and the end of what its targets may read.
    fn sequence_span(&self, k: u64) -> (u64, u64) {
        let seq = self.opts.seq as u64;
        match self.opts.packing {
            Packing::Documents | Packing::Stream => (self.start + k * seq, self.start + self.len),
            Packing::None => {
                // The document whose rows hold k: the last with doc_rows ≤ k.
                let d = self.doc_rows.partition_point(|&r| r <= k) - 1;
                let doc = self.file().doc_tokens(self.file().split_docs(self.opts.split).start + d as u64);
                (doc.start + (k - self.doc_rows[d]) * seq, doc.end)
            }
        }
    }

    /// Writes sequence `k` (or a padding row for `None`) into a row.
    fn fill_row(&self, k: Option<u64>, inputs: &mut [i32], targets: &mut [i32], mut positions: Option<&mut [i32]>) {
        let pad = self.file().eos_id() as i32;
        let Some(k) = k else {
            inputs.fill(pad);
            targets.fill(IGNORE_INDEX as i32);
            // Every padding token is a document of its own.
            if let Some(p) = positions {
                p.fill(0);
            }
            return;
        };
        let (first, end) = self.sequence_span(k);
        let file = self.file();
        // The document of the current token, and where it started in the row.
        let mut doc = if positions.is_some() { file.doc_tokens(file.doc_of(first)) } else { first..end };
        let mut doc_start_in_row = first;
        for (j, (input, target)) in inputs.iter_mut().zip(targets.iter_mut()).enumerate() {
            let at = first + j as u64;
            if at >= end {
                *input = pad;
                *target = IGNORE_INDEX as i32;
                if let Some(p) = positions.as_deref_mut() {
                    p[j] = 0;
                }
                continue;
            }
            if let Some(p) = positions.as_deref_mut() {
                if at >= doc.end {
                    doc = file.doc_tokens(file.doc_of(at));
                    doc_start_in_row = at;
                }
                p[j] = (at - doc_start_in_row.max(doc.start)) as i32;
            }
            // Ids are below the vocabulary size, which fits i32 (checked in `new`).
            *input = file.token(at) as i32;
            // With positions, a document's last token predicts nothing.
            let next_in_reach = at + 1 < end && (positions.is_none() || at + 1 < doc.end);
            *target =
                if next_in_reach && file.is_target(at + 1) { file.token(at + 1) as i32 } else { IGNORE_INDEX as i32 };
        }
    }

    /// The next batch.
    pub fn next_batch(&mut self) -> Result<Batch> {
        let BatcherOptions { batch, seq, packing, .. } = self.opts;
        let index = self.batches;
        let mut inputs = vec![0i32; batch * seq];
        let mut targets = vec![0i32; batch * seq];
        let mut positions = packing.has_positions().then(|| vec![0i32; batch * seq]);
        for r in 0..batch {
            let k = match self.opts.split {
                Split::Train => {
                    let row = index
                        .checked_mul(batch as u64)
                        .and_then(|x| x.checked_add(r as u64))
                        .ok_or_else(|| Error::Cursor(format!("batch index {index} overflows the row count")))?;
                    Some(self.train_sequence(row))
                }
                Split::Validation => {
                    let row = (index % self.batches_per_pass()) * batch as u64 + r as u64;
                    (row < self.sequences).then_some(row)
                }
            };
            let span = r * seq..(r + 1) * seq;
            let row_positions = positions.as_mut().map(|p| &mut p[span.clone()]);
            self.fill_row(k, &mut inputs[span.clone()], &mut targets[span], row_positions);
        }
        self.batches += 1;
        let loss_tokens = targets.iter().filter(|&&t| t != IGNORE_INDEX as i32).count();
        Ok(Batch { inputs, targets, positions, batch, seq, epoch: self.epoch_of_batch(index), index, loss_tokens })
    }
}

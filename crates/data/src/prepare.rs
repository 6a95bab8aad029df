//! `stepgraph prepare` as a library call: read the inputs (text, JSONL,
//! JSON arrays, Parquet: [`crate::inputs`]), tokenize them (in parallel,
//! results in input order), mix them when they carry weights
//! ([`crate::mixture`]), hold out a validation split, and write one token
//! file.
//!
//! Without weights, every document of every input is used once, in input
//! order. The documents are held in memory until the split is drawn (about
//! 4 bytes per token plus a byte per token of a chat), then written in one
//! pass.

use std::fmt;
use std::path::PathBuf;

use indicatif::{ProgressBar, ProgressStyle};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::inputs::read_records;
pub use crate::inputs::InputFormat;
use crate::mixture;
use crate::records::{tokenize_record, TextSplit};
use crate::token_file::{token_bytes_for, write_token_file, Document, TokenFileMeta};
use crate::tokenizer::Tokenizer;

/// How many documents to hold out for validation.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum Holdout {
    /// A fraction of the documents, rounded, at least one when the fraction
    /// is positive and there are two documents or more.
    Fraction(f64),
    /// Exactly this many documents.
    Docs(u64),
}

/// Everything `prepare` needs.
#[derive(Clone, Debug)]
pub struct PrepareOptions {
    pub tokenizer: PathBuf,
    pub inputs: Vec<PathBuf>,
    /// Mixture weights, one per input (see [`crate::mixture`]); empty
    /// means every document of every input, once.
    pub weights: Vec<f64>,
    /// The column read from Parquet inputs (`None`: `text`, `messages`,
    /// `conversations` or the alpaca columns, the first the file has).
    pub column: Option<String>,
    pub out: PathBuf,
    pub format: InputFormat,
    pub text_split: TextSplit,
    /// Accept chat and instruction records (rendered with the chat template).
    pub chat: bool,
    pub holdout: Holdout,
    /// Seeds the choice of validation documents and the mixture's draw.
    pub seed: u64,
    /// Show a progress bar on a terminal.
    pub progress: bool,
}

/// What one input gave the token file.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct InputReport {
    pub path: PathBuf,
    /// The weight asked for (`None` without a mixture).
    pub weight: Option<f64>,
    /// The share of the tokens asked for: the normalised weight.
    pub asked_share: Option<f64>,
    /// Documents and tokens the input holds.
    pub docs_read: u64,
    pub tokens_read: u64,
    /// Documents and tokens of it in the token file (train and validation).
    pub docs: u64,
    pub tokens: u64,
    /// `tokens` over the token file's tokens.
    pub share: f64,
}

/// What `prepare` wrote.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct PrepareReport {
    pub out: PathBuf,
    pub files: usize,
    /// Each input's contribution, in `--input` order.
    pub inputs: Vec<InputReport>,
    pub docs: u64,
    pub train_docs: u64,
    pub validation_docs: u64,
    pub tokens: u64,
    pub train_tokens: u64,
    pub validation_tokens: u64,
    /// Tokens left out of the loss (chat prompts).
    pub masked_tokens: u64,
    pub vocab_size: u32,
    pub token_bytes: u32,
    pub eos_id: u32,
}

impl fmt::Display for PrepareReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "wrote {}", self.out.display())?;
        writeln!(f, "  input files:      {}", self.files)?;
        if self.inputs.len() > 1 || self.inputs.iter().any(|i| i.weight.is_some()) {
            for i in &self.inputs {
                let asked = match i.asked_share {
                    Some(a) => format!(", asked {:.1}%", a * 100.0),
                    None => String::new(),
                };
                writeln!(
                    f,
                    "    {}: {} tokens ({:.1}%{asked}), {} of {} documents",
                    i.path.display(),
                    i.tokens,
                    i.share * 100.0,
                    i.docs,
                    i.docs_read
                )?;
            }
        }
        writeln!(
            f,
            "  documents:        {} ({} train, {} validation)",
            self.docs, self.train_docs, self.validation_docs
        )?;
        writeln!(
            f,
            "  tokens:           {} ({} train, {} validation)",
            self.tokens, self.train_tokens, self.validation_tokens
        )?;
        writeln!(f, "  masked tokens:    {} (not loss targets)", self.masked_tokens)?;
        write!(f, "  vocabulary:       {} (u{} ids), eos id {}", self.vocab_size, self.token_bytes * 8, self.eos_id)
    }
}

/// How many documents of `n` to hold out.
pub fn validation_count(holdout: Holdout, n: u64) -> Result<u64> {
    let count = match holdout {
        Holdout::Fraction(f) => {
            if !(0.0..1.0).contains(&f) {
                return Err(Error::Options(format!("--val-fraction must be in [0, 1), got {f}")));
            }
            let k = (f * n as f64).round() as u64;
            if f > 0.0 && k == 0 && n >= 2 {
                1
            } else {
                k
            }
        }
        Holdout::Docs(k) => k,
    };
    if count > 0 && count >= n {
        return Err(Error::Options(format!(
            "holding out {count} validation documents of {n} leaves none to train on; use fewer (--val-docs / --val-fraction)"
        )));
    }
    Ok(count)
}

/// Splits documents into (train, validation): `count` documents drawn with
/// `seed`, each split keeping the input order.
pub fn split_documents(docs: Vec<Document>, count: u64, seed: u64) -> (Vec<Document>, Vec<Document>) {
    let mut order: Vec<usize> = (0..docs.len()).collect();
    order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
    let mut held = vec![false; docs.len()];
    for &i in &order[..count as usize] {
        held[i] = true;
    }
    let (mut train, mut val) = (Vec::new(), Vec::new());
    for (doc, h) in docs.into_iter().zip(held) {
        if h {
            val.push(doc)
        } else {
            train.push(doc)
        }
    }
    (train, val)
}

/// Runs the whole preparation and writes `opts.out`.
pub fn prepare(opts: &PrepareOptions) -> Result<PrepareReport> {
    if opts.inputs.is_empty() {
        return Err(Error::Options("no input files: pass one or more --input FILE".into()));
    }
    if !opts.weights.is_empty() {
        if opts.weights.len() != opts.inputs.len() {
            return Err(Error::Options(format!(
                "{} mixture weights for {} inputs: either every --input has a weight (FILE:WEIGHT) or none has",
                opts.weights.len(),
                opts.inputs.len()
            )));
        }
        for (path, &w) in opts.inputs.iter().zip(&opts.weights) {
            mixture::check_weight(w, &format!("{}:{w}", path.display()))?;
        }
    }
    let tokenizer = Tokenizer::load(&opts.tokenizer)?;
    let total_bytes: u64 = opts.inputs.iter().map(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)).sum();
    // Small inputs finish before a bar would be readable.
    let bar = if opts.progress && total_bytes >= 1 << 20 {
        let bar = ProgressBar::new(total_bytes);
        bar.set_style(
            ProgressStyle::with_template("{spinner} {msg} [{bar:30}] {bytes}/{total_bytes} ({eta})")
                .expect("a valid progress template")
                .progress_chars("=> "),
        );
        bar
    } else {
        ProgressBar::hidden()
    };
    let mut per_input: Vec<Vec<Document>> = Vec::with_capacity(opts.inputs.len());
    for path in &opts.inputs {
        bar.set_message(path.display().to_string());
        let records = read_records(path, opts.format, opts.text_split, opts.column.as_deref())?;
        let tokenized: Vec<Document> = records
            .par_iter()
            .map(|(at, record)| tokenize_record(&tokenizer, record, opts.chat, path, *at))
            .collect::<Result<_>>()?;
        per_input.push(tokenized);
        bar.inc(std::fs::metadata(path).map(|m| m.len()).unwrap_or(0));
    }
    bar.finish_and_clear();
    let doc_tokens: Vec<Vec<u64>> =
        per_input.iter().map(|docs| docs.iter().map(|d| d.tokens.len() as u64).collect()).collect();
    let asked = (!opts.weights.is_empty()).then(|| mixture::shares(&opts.weights));
    let mut inputs: Vec<InputReport> = opts
        .inputs
        .iter()
        .zip(&doc_tokens)
        .enumerate()
        .map(|(i, (path, lens))| InputReport {
            path: path.clone(),
            weight: opts.weights.get(i).copied(),
            asked_share: asked.as_ref().map(|a| a[i]),
            docs_read: lens.len() as u64,
            tokens_read: lens.iter().sum(),
            docs: lens.len() as u64,
            tokens: lens.iter().sum(),
            share: 0.0,
        })
        .collect();
    let docs: Vec<Document> = if opts.weights.is_empty() {
        per_input.into_iter().flatten().collect()
    } else {
        if let Some(empty) = inputs.iter().find(|i| i.tokens_read == 0) {
            return Err(Error::Options(format!(
                "{} holds no documents, so it cannot give its share of a mixture",
                empty.path.display()
            )));
        }
        let chosen = mixture::choose(&doc_tokens, &opts.weights, opts.seed);
        let mut mixed: Vec<Document> = Vec::new();
        for ((docs, picks), input) in per_input.into_iter().zip(&chosen).zip(&mut inputs) {
            let mut docs: Vec<Option<Document>> = docs.into_iter().map(Some).collect();
            input.docs = picks.len() as u64;
            input.tokens = 0;
            for &d in picks {
                let doc = docs[d].take().expect("a document is drawn once");
                input.tokens += doc.tokens.len() as u64;
                mixed.push(doc);
            }
        }
        // The inputs interleaved, so that the file read in order is the
        // mixture, not one input after another.
        mixed.shuffle(&mut rand::rngs::StdRng::seed_from_u64(opts.seed ^ 0x696e_7465_726c_6561));
        mixed
    };
    if docs.is_empty() {
        return Err(Error::Options(format!(
            "the inputs hold no documents: {}",
            opts.inputs.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        )));
    }
    let count = validation_count(opts.holdout, docs.len() as u64)?;
    let (train, validation) = split_documents(docs, count, opts.seed);
    let meta = TokenFileMeta {
        vocab_size: tokenizer.vocab_size(),
        eos_id: tokenizer.eos_id,
        tokenizer: Some(tokenizer.fingerprint()),
    };
    write_token_file(&opts.out, meta, &train, &validation)?;
    let count_tokens = |d: &[Document]| d.iter().map(|d| d.tokens.len() as u64).sum::<u64>();
    let masked: u64 = train
        .iter()
        .chain(&validation)
        .filter_map(|d| d.loss_mask.as_ref())
        .map(|m| m.iter().filter(|&&t| !t).count() as u64)
        .sum();
    let (train_tokens, validation_tokens) = (count_tokens(&train), count_tokens(&validation));
    for input in &mut inputs {
        input.share = input.tokens as f64 / (train_tokens + validation_tokens) as f64;
    }
    Ok(PrepareReport {
        out: opts.out.clone(),
        files: opts.inputs.len(),
        inputs,
        docs: (train.len() + validation.len()) as u64,
        train_docs: train.len() as u64,
        validation_docs: validation.len() as u64,
        tokens: train_tokens + validation_tokens,
        train_tokens,
        validation_tokens,
        masked_tokens: masked,
        vocab_size: meta.vocab_size,
        token_bytes: token_bytes_for(meta.vocab_size),
        eos_id: meta.eos_id,
    })
}

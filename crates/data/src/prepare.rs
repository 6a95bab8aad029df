//! `stepgraph prepare` as a library call: read text and JSONL inputs,
//! tokenize them (in parallel, results in input order), hold out a
//! validation split, and write one token file.
//!
//! The documents are held in memory until the split is drawn (about 4 bytes
//! per token plus a byte per token of a chat), then written in one pass.

use std::fmt;
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::records::{parse_jsonl_record, text_documents, tokenize_record, Record, TextSplit};
use crate::token_file::{token_bytes_for, write_token_file, Document, TokenFileMeta};
use crate::tokenizer::Tokenizer;

/// How an input file is read.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum InputFormat {
    Text,
    Jsonl,
    /// JSONL for `.jsonl`/`.json` files, text otherwise.
    Auto,
}

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
    pub out: PathBuf,
    pub format: InputFormat,
    pub text_split: TextSplit,
    /// Accept chat and instruction records (rendered with the chat template).
    pub chat: bool,
    pub holdout: Holdout,
    /// Seeds the choice of validation documents.
    pub seed: u64,
    /// Show a progress bar on a terminal.
    pub progress: bool,
}

/// What `prepare` wrote.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct PrepareReport {
    pub out: PathBuf,
    pub files: usize,
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

fn is_jsonl(path: &Path, format: InputFormat) -> bool {
    match format {
        InputFormat::Text => false,
        InputFormat::Jsonl => true,
        InputFormat::Auto => {
            matches!(
                path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase).as_deref(),
                Some("jsonl" | "json")
            )
        }
    }
}

/// Reads one input file into records, each with its 1-based line (0 for text).
fn read_records(path: &Path, jsonl: bool, split: TextSplit) -> Result<Vec<(usize, Record)>> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, "reading the input", e))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let line = e.as_bytes()[..at].iter().filter(|&&b| b == b'\n').count() + 1;
        Error::record(path, line, format!("not UTF-8 (invalid byte at offset {at})"))
    })?;
    if !jsonl {
        return Ok(text_documents(&text, split).into_iter().map(|t| (0, Record::Text(t))).collect());
    }
    let mut records = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if !line.trim().is_empty() {
            records.push((i + 1, parse_jsonl_record(line, path, i + 1)?));
        }
    }
    Ok(records)
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
    let mut docs: Vec<Document> = Vec::new();
    for path in &opts.inputs {
        bar.set_message(path.display().to_string());
        let records = read_records(path, is_jsonl(path, opts.format), opts.text_split)?;
        let tokenized: Vec<Document> = records
            .par_iter()
            .map(|(line, record)| tokenize_record(&tokenizer, record, opts.chat, path, *line))
            .collect::<Result<_>>()?;
        docs.extend(tokenized);
        bar.inc(std::fs::metadata(path).map(|m| m.len()).unwrap_or(0));
    }
    bar.finish_and_clear();
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
    Ok(PrepareReport {
        out: opts.out.clone(),
        files: opts.inputs.len(),
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

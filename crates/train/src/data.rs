//! Where a training run's batches come from, behind [`TrainData`]: the
//! training batches in a resumable order and a fixed held-out split for
//! validation. [`ByteText`] is the byte-level source (a text file, one
//! token per byte, the default); [`TokenData`] reads a token file written
//! by `stepgraph prepare` through `stepgraph_data`'s [`Batcher`]: documents
//! packed with their EOS, a fresh permutation of the sequences every epoch,
//! the file's loss mask, and the file's own validation split. [`open`]
//! tells the two apart by the token file's magic bytes, not by the name.
//! [`check_tokenizer`] refuses data whose ids do not mean the model's
//! tokens: a token file of another tokenizer, or byte-level text for a
//! model that has a tokenizer.
//!
//! **Invariant:** [`TrainData::cursor`] taken after batch `k` and given to
//! [`TrainData::restore`] on a fresh source makes the next batch batch
//! `k + 1` of the uninterrupted run, bit for bit.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use stepgraph_core::host::memory::try_with_capacity;
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, TensorType};
use stepgraph_data::token_file::MAGIC;
use stepgraph_data::tokenizer::fingerprint_of;
use stepgraph_data::{Batcher, BatcherOptions, DataCursor, Packing, Split, TokenFile, TokenizerFingerprint};

/// Token ids and next-token targets of one global batch, `[batch, seq]` i32.
pub struct Batch {
    pub tokens: HostTensor,
    pub targets: HostTensor,
    /// Each token's position in its document (`[batch, seq]` i32), when the
    /// rows are packed with documents that must not see each other.
    pub positions: Option<HostTensor>,
}

/// A source of training and validation batches.
pub trait TrainData {
    /// The next training batch (the global batch: every rank draws the same
    /// and keeps its rows).
    fn next_batch(&mut self) -> Result<Batch>;
    /// `n` batches of the held-out split, the same ones at every call.
    fn validation_batches(&self, n: usize) -> Result<Vec<Batch>>;
    /// Where the training batches stand, to save in a checkpoint.
    fn cursor(&self) -> serde_json::Value;
    /// Continues from a [`TrainData::cursor`]; an error names what does not fit.
    fn restore(&mut self, cursor: &serde_json::Value) -> Result<()>;
    /// One line for the start of the run ("data/tiny.txt: 1.1 MB, ...").
    fn describe(&self) -> String;
    /// Training sequences in one epoch: a token file's packed sequences, or
    /// as many windows as the training text holds end to end (its windows
    /// are drawn at random offsets, so an epoch there is a count of tokens).
    fn sequences_per_epoch(&self) -> u64;
    /// Checks that every token id of the data is a row of the embedding of
    /// a model with `vocab` rows (`model` names it), before anything trains.
    fn check_vocab(&self, vocab: usize, model: &str) -> Result<()>;
    /// Checks that the data's ids are the tokens of `model`'s tokenizer
    /// (see [`check_tokenizer`]).
    fn check_tokenizer(&self, model: &ModelTokenizer) -> Result<()>;
    /// Whether batches carry positions within documents
    /// ([`Batch::positions`]): the model must then take them
    /// (`ModelSpec::documents`).
    fn has_positions(&self) -> bool {
        false
    }
}

/// The tokenizer whose ids a model's embedding rows mean.
pub struct ModelTokenizer {
    /// The flag it came from and its value: `--tokenizer data/tok`.
    pub source: String,
    /// The folder to give `stepgraph prepare --tokenizer`.
    pub dir: PathBuf,
    /// Its `tokenizer.json`.
    pub json: PathBuf,
    pub fingerprint: TokenizerFingerprint,
    pub vocab_size: u32,
}

impl ModelTokenizer {
    /// The model's tokenizer: `--tokenizer` (a tokenizer.json or its
    /// folder) when given, else the `tokenizer.json` of the `--init-from`
    /// folder; `None` for a model without one (a named model, or a folder
    /// saved without tokenizer files), whose ids are whatever its data says.
    pub fn find(tokenizer: Option<&Path>, init_from: Option<&Path>) -> Result<Option<ModelTokenizer>> {
        let (source, path) = match (tokenizer, init_from) {
            (Some(t), _) => (format!("--tokenizer {}", t.display()), t.to_path_buf()),
            (None, Some(dir)) if dir.join("tokenizer.json").is_file() => {
                (format!("--init-from {}", dir.display()), dir.to_path_buf())
            }
            _ => return Ok(None),
        };
        let (json, fingerprint, vocab_size) =
            fingerprint_of(&path).with_context(|| format!("reading the model's tokenizer ({source})"))?;
        let dir = json.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")).to_path_buf();
        Ok(Some(ModelTokenizer { source, dir, json, fingerprint, vocab_size }))
    }

    /// `stepgraph prepare` with this tokenizer, writing `out`.
    fn prepare_command(&self, input: &str, out: &Path) -> String {
        format!("stepgraph prepare --tokenizer {} --input {input} --out {}", self.dir.display(), out.display())
    }
}

/// Refuses `data` whose ids are not the tokens of the model's tokenizer
/// (`tokenizer`: the `--tokenizer` flag; `init_from`: the `--init-from`
/// folder, see [`ModelTokenizer::find`]), before anything is compiled: a
/// token file written by another tokenizer, or byte-level text (one id per
/// byte) for a model that has a tokenizer. The errors say which `stepgraph
/// prepare` to run. A token file written before tokenizers were recorded
/// is accepted with a note; a model without a tokenizer takes any data.
pub fn check_tokenizer(data: &dyn TrainData, tokenizer: Option<&Path>, init_from: Option<&Path>) -> Result<()> {
    match ModelTokenizer::find(tokenizer, init_from)? {
        Some(model) => data.check_tokenizer(&model),
        None => Ok(()),
    }
}

/// Whether `path` starts with a token file's magic bytes.
pub fn is_token_file(path: &Path) -> Result<bool> {
    let mut f = std::fs::File::open(path).with_context(|| format!("opening training data {}", path.display()))?;
    let mut head = [0u8; 8];
    match f.read_exact(&mut head) {
        Ok(()) => Ok(head == MAGIC),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(e).with_context(|| format!("reading training data {}", path.display())),
    }
}

/// The data source of `--data PATH`: a token file (by its magic bytes) or
/// byte-level text. `batch` is the rows of one optimizer step (every
/// micro-batch of it), `val_fraction` applies to text only (a token file
/// carries its split), and so does `packing` (text has no documents: it is
/// one stream).
pub fn open(
    path: &Path,
    batch: usize,
    seq: usize,
    val_fraction: f64,
    seed: u64,
    packing: Packing,
) -> Result<Box<dyn TrainData>> {
    if is_token_file(path)? {
        Ok(Box::new(TokenData::open(path, batch, seq, seed, packing)?))
    } else {
        Ok(Box::new(ByteText::open(path, batch, seq, val_fraction, seed ^ 0x5eed)?))
    }
}

/// Byte-level text: each byte is a token. Training windows of `seq + 1`
/// bytes are drawn at random offsets of the first `1 - val_fraction` of the
/// text, by a ChaCha8 stream whose word position is the cursor; validation
/// windows tile the rest.
pub struct ByteText {
    path: PathBuf,
    text: Vec<u8>,
    /// Training windows start below this offset; validation at or above it.
    split: usize,
    batch: usize,
    seq: usize,
    seed: u64,
    rng: ChaCha8Rng,
}

impl ByteText {
    /// Reads `path` and splits it; the errors name the file and the flag.
    pub fn open(path: &Path, batch: usize, seq: usize, val_fraction: f64, seed: u64) -> Result<Self> {
        let text = std::fs::read(path).with_context(|| format!("reading training text {}", path.display()))?;
        Self::new(path, text, batch, seq, val_fraction, seed)
    }

    pub fn new(path: &Path, text: Vec<u8>, batch: usize, seq: usize, val_fraction: f64, seed: u64) -> Result<Self> {
        if !(val_fraction.is_finite() && (0.0..1.0).contains(&val_fraction)) {
            bail!("--val-fraction must be at least 0 and below 1, got {val_fraction}");
        }
        let window = seq + 1;
        // The training part must hold one window more than the draw needs
        // (`gen_range` over an empty range panics), the validation part one window.
        let val_bytes = if val_fraction > 0.0 { ((text.len() as f64 * val_fraction) as usize).max(window) } else { 0 };
        let split = text.len().saturating_sub(val_bytes);
        if split < window + 1 {
            bail!(
                "{} has {} bytes; a sequence of {seq} tokens needs at least {} bytes of training text{}",
                path.display(),
                text.len(),
                window + 1,
                if val_bytes > 0 {
                    format!(" after the validation split of {val_bytes} bytes (--val-fraction {val_fraction})")
                } else {
                    String::new()
                }
            );
        }
        Ok(ByteText { path: path.to_path_buf(), text, split, batch, seq, seed, rng: ChaCha8Rng::seed_from_u64(seed) })
    }

    /// The batch of windows at `offsets`; host memory that cannot be
    /// allocated for it is an error, not an abort.
    fn windows(&self, offsets: impl Iterator<Item = usize>) -> Result<Batch> {
        let ty = TensorType::new(DType::I32, [self.batch, self.seq]);
        let what = "a training batch";
        let mut tokens = try_with_capacity(self.batch * self.seq, what)?;
        let mut targets = try_with_capacity(self.batch * self.seq, what)?;
        for o in offsets {
            tokens.extend(self.text[o..o + self.seq].iter().map(|&b| b as f64));
            targets.extend(self.text[o + 1..o + self.seq + 1].iter().map(|&b| b as f64));
        }
        Ok(Batch {
            tokens: HostTensor::try_from_f64(ty.clone(), &tokens, "a batch's token ids")?,
            targets: HostTensor::try_from_f64(ty, &targets, "a batch's targets")?,
            positions: None,
        })
    }
}

impl TrainData for ByteText {
    fn sequences_per_epoch(&self) -> u64 {
        (((self.split - 1) / self.seq) as u64).max(1)
    }

    fn next_batch(&mut self) -> Result<Batch> {
        let last_start = self.split - self.seq - 1;
        let offsets: Vec<usize> = (0..self.batch).map(|_| self.rng.gen_range(0..last_start)).collect();
        self.windows(offsets.into_iter())
    }

    fn validation_batches(&self, n: usize) -> Result<Vec<Batch>> {
        let window = self.seq + 1;
        let available = (self.text.len() - self.split) / window;
        if available == 0 {
            bail!("validation needs a held-out split: set --val-fraction above 0 or --eval-every 0");
        }
        // Consecutive windows of the held-out text, wrapping around when
        // more are asked for than it holds.
        (0..n)
            .map(|b| self.windows((0..self.batch).map(|r| self.split + ((b * self.batch + r) % available) * window)))
            .collect()
    }

    fn cursor(&self) -> serde_json::Value {
        serde_json::json!({
            "kind": "byte-text",
            "seed": self.seed,
            "bytes": self.text.len(),
            // u128 does not fit a JSON number exactly: a decimal string.
            "rng_word_pos": self.rng.get_word_pos().to_string(),
        })
    }

    fn restore(&mut self, cursor: &serde_json::Value) -> Result<()> {
        let kind = cursor["kind"].as_str().unwrap_or("");
        if kind != "byte-text" {
            bail!("the checkpoint's data cursor is of kind `{kind}`, not the byte-level text of --data");
        }
        if cursor["seed"].as_u64() != Some(self.seed) {
            bail!("the checkpoint drew its batches with --seed {}, this run has --seed {}", cursor["seed"], self.seed);
        }
        if cursor["bytes"].as_u64() != Some(self.text.len() as u64) {
            bail!(
                "the checkpoint was trained on a text of {} bytes, {} has {}",
                cursor["bytes"],
                self.path.display(),
                self.text.len()
            );
        }
        let pos: u128 = cursor["rng_word_pos"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("the checkpoint's data cursor has no valid rng_word_pos: {cursor}"))?;
        self.rng = ChaCha8Rng::seed_from_u64(self.seed);
        self.rng.set_word_pos(pos);
        Ok(())
    }

    fn describe(&self) -> String {
        format!(
            "{} ({} bytes: {} for training, {} held out)",
            self.path.display(),
            self.text.len(),
            self.split,
            self.text.len() - self.split
        )
    }

    fn check_tokenizer(&self, model: &ModelTokenizer) -> Result<()> {
        let out = self.path.with_extension("tokens");
        bail!(
            "--data {} is text, read as one token per byte, but the model's ids are the tokens of its tokenizer {} \
             ({}): training or evaluating it on bytes would read meaningless ids. Tokenize the text first: `{}`, \
             then pass --data {}",
            self.path.display(),
            model.json.display(),
            model.source,
            model.prepare_command(&self.path.display().to_string(), &out),
            out.display()
        )
    }

    fn check_vocab(&self, vocab: usize, model: &str) -> Result<()> {
        if vocab < 256 {
            bail!(
                "byte-level training on {} needs a vocabulary of at least 256 tokens; `{model}` has {vocab} \
                 (train on a token file from `stepgraph prepare`, or give --vocab 256)",
                self.path.display()
            );
        }
        Ok(())
    }
}

/// A token file of `stepgraph prepare`, batched by [`Batcher`] (see the
/// module doc). The checkpoint cursor is the batcher's [`DataCursor`]: the
/// batches drawn and the file's fingerprint, so a resume on another file,
/// seed or shape is refused and one on the same file continues exactly.
pub struct TokenData {
    file: Arc<TokenFile>,
    train: Batcher<Arc<TokenFile>>,
    opts: BatcherOptions,
}

impl TokenData {
    /// Opens and validates the whole file (every token id); the training
    /// split must hold at least one sequence pair.
    pub fn open(path: &Path, batch: usize, seq: usize, seed: u64, packing: Packing) -> Result<Self> {
        let file = Arc::new(TokenFile::open(path)?);
        let opts = BatcherOptions { batch, seq, seed, split: Split::Train, packing };
        let train = Batcher::new(file.clone(), opts)?;
        Ok(TokenData { file, train, opts })
    }

    fn host_batch(b: &stepgraph_data::Batch) -> Batch {
        let [tokens, targets] = b.host_tensors();
        Batch { tokens, targets, positions: b.positions_tensor() }
    }
}

impl TrainData for TokenData {
    fn sequences_per_epoch(&self) -> u64 {
        self.train.sequences()
    }

    fn next_batch(&mut self) -> Result<Batch> {
        Ok(Self::host_batch(&self.train.next_batch()?))
    }

    fn validation_batches(&self, n: usize) -> Result<Vec<Batch>> {
        let opts = BatcherOptions { split: Split::Validation, ..self.opts };
        let mut val = Batcher::new(self.file.clone(), opts).with_context(|| {
            "validation reads the token file's held-out documents: prepare it with --val-docs N or \
             --val-fraction F, or turn validation off with --eval-every 0"
        })?;
        // One pass at most: more batches would repeat the same ones.
        let n = n.min(val.batches_per_pass() as usize).max(1);
        (0..n).map(|_| Ok(Self::host_batch(&val.next_batch()?))).collect()
    }

    fn cursor(&self) -> serde_json::Value {
        serde_json::json!({
            "kind": "token-file",
            "cursor": serde_json::to_value(self.train.cursor()).expect("a data cursor serializes"),
        })
    }

    fn restore(&mut self, cursor: &serde_json::Value) -> Result<()> {
        let kind = cursor["kind"].as_str().unwrap_or("");
        if kind != "token-file" {
            bail!(
                "the checkpoint's data cursor is of kind `{kind}`, but --data {} is a token file",
                self.file.path().display()
            );
        }
        let saved: DataCursor = serde_json::from_value(cursor["cursor"].clone())
            .with_context(|| format!("the checkpoint's token-file cursor is not valid: {cursor}"))?;
        self.train = Batcher::resume(self.file.clone(), self.opts, &saved)?;
        Ok(())
    }

    fn describe(&self) -> String {
        let f = &self.file;
        let (train, val) = (f.split_tokens(Split::Train), f.split_tokens(Split::Validation));
        let docs = |s: Split| f.split_docs(s).end - f.split_docs(s).start;
        format!(
            "{} (token file: {} tokens of a {}-token vocabulary; {} documents, {} tokens for training, {} documents, \
             {} tokens held out; {} sequences per epoch, packing {}{})",
            f.path().display(),
            f.n_tokens(),
            f.vocab_size(),
            docs(Split::Train),
            train.end - train.start,
            docs(Split::Validation),
            val.end - val.start,
            self.train.sequences(),
            self.opts.packing.name(),
            if f.has_mask() { "; loss mask" } else { "" }
        )
    }

    fn check_tokenizer(&self, model: &ModelTokenizer) -> Result<()> {
        let path = self.file.path();
        let redo = model.prepare_command("<the text and JSONL files>", path);
        match self.file.meta().tokenizer {
            None => {
                eprintln!(
                    "note: token file {} records no tokenizer (it was written before token files recorded one), so \
                     it cannot be checked against the model's tokenizer {} ({}); `{redo}` writes one that can be",
                    path.display(),
                    model.json.display(),
                    model.source
                );
                Ok(())
            }
            Some(fp) if fp == model.fingerprint => Ok(()),
            Some(fp) => bail!(
                "token file {} was written by another tokenizer (fingerprint {fp}, {} tokens) than the model's \
                 tokenizer {} ({}; fingerprint {}, {} tokens): its ids mean other tokens to this model. Tokenize the \
                 data again with the model's tokenizer: `{redo}`",
                path.display(),
                self.file.vocab_size(),
                model.json.display(),
                model.source,
                model.fingerprint,
                model.vocab_size
            ),
        }
    }

    fn has_positions(&self) -> bool {
        self.opts.packing.has_positions()
    }

    fn check_vocab(&self, vocab: usize, model: &str) -> Result<()> {
        self.file
            .check_vocab(vocab)
            .with_context(|| format!("training `{model}` on --data {}", self.file.path().display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(seed: u64) -> ByteText {
        let text: Vec<u8> = (0..2000u32).map(|i| (i * 7 % 251) as u8).collect();
        ByteText::new(Path::new("t.txt"), text, 3, 16, 0.1, seed).unwrap()
    }

    #[test]
    fn a_restored_cursor_continues_the_same_batches() {
        let mut straight = source(4);
        let mut first = source(4);
        for _ in 0..5 {
            straight.next_batch().unwrap();
            first.next_batch().unwrap();
        }
        let cursor = first.cursor();
        let mut resumed = source(4);
        resumed.restore(&cursor).unwrap();
        for _ in 0..3 {
            let (a, b) = (straight.next_batch().unwrap(), resumed.next_batch().unwrap());
            assert_eq!(a.tokens.bytes(), b.tokens.bytes());
            assert_eq!(a.targets.bytes(), b.targets.bytes());
        }
        // Another seed draws other batches, and its cursor is refused.
        let e = source(5).restore(&cursor).unwrap_err().to_string();
        assert!(e.contains("--seed 4") && e.contains("--seed 5"), "{e}");
    }

    #[test]
    fn training_never_reads_the_held_out_text() {
        // The last 10% of the text is byte 255, which the training part never holds.
        let mut text: Vec<u8> = (0..1800u32).map(|i| (i % 200) as u8).collect();
        text.extend([255u8; 200]);
        let mut s = ByteText::new(Path::new("t.txt"), text, 3, 16, 0.1, 9).unwrap();
        assert_eq!(s.split, 1800);
        for _ in 0..300 {
            let b = s.next_batch().unwrap();
            let ids: Vec<f64> = b.tokens.to_f64().into_iter().chain(b.targets.to_f64()).collect();
            assert!(ids.iter().all(|&t| t < 255.0), "a training window reached the held-out text");
        }
        let val = s.validation_batches(5).unwrap();
        assert!(val.iter().all(|b| b.tokens.to_f64().iter().all(|&t| t == 255.0)));
        // The same batches at every call.
        assert_eq!(val[4].targets.bytes(), s.validation_batches(5).unwrap()[4].targets.bytes());
    }

    #[test]
    fn bad_splits_name_the_flag() {
        let text = vec![b'a'; 40];
        let e = ByteText::new(Path::new("t.txt"), text.clone(), 1, 16, 1.0, 0).err().unwrap().to_string();
        assert!(e.contains("--val-fraction") && e.contains("got 1"), "{e}");
        let e = ByteText::new(Path::new("t.txt"), text.clone(), 1, 32, 0.1, 0).err().unwrap().to_string();
        assert!(e.contains("t.txt has 40 bytes") && e.contains("--val-fraction 0.1"), "{e}");
        let s = ByteText::new(Path::new("t.txt"), text, 1, 16, 0.0, 0).unwrap();
        assert!(s.validation_batches(1).err().unwrap().to_string().contains("--val-fraction"));
    }
}

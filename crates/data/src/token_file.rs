//! The token file: documents of token ids, an optional loss mask, and the
//! train/validation split, in one little-endian binary file that `stepgraph
//! prepare` writes atomically and training memory-maps.
//!
//! Layout (version 1; every integer little-endian, every section 8-byte aligned):
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 8 | magic `b"SGTOKENS"` |
//! | 8 | 4 | version, `1` |
//! | 12 | 4 | flags: bit 0 set when a loss mask follows the tokens; other bits 0 |
//! | 16 | 4 | vocabulary size `V` (every token id is below it) |
//! | 20 | 4 | bytes per token: 2 (`u16`, when `V ≤ 65536`) or 4 (`u32`) |
//! | 24 | 4 | the end-of-sequence id that ends every document |
//! | 28 | 4 | reserved, 0 |
//! | 32 | 8 | number of documents `D` |
//! | 40 | 8 | training documents `D_train`: documents `[0, D_train)` are the training split, `[D_train, D)` the validation split |
//! | 48 | 8 | number of tokens `N` |
//! | 56 | 8 | the [`TokenizerFingerprint`] of the tokenizer that wrote the ids; 0 when not recorded |
//! | 64 | 8·(D+1) | document offsets in tokens: `0 = o₀ < o₁ < … < o_D = N`; document `d` is tokens `[o_d, o_{d+1})` |
//! | … | N·(2 or 4) | token ids, zero-padded to a multiple of 8 bytes |
//! | … | ⌈N/8⌉ | loss mask (only with flag bit 0): bit `i % 8` of byte `i / 8` is 1 when token `i` is a loss target |
//!
//! Without a mask every token is a loss target. Files written before the
//! tokenizer fingerprint was recorded have 0 at offset 56 (then a reserved
//! field): they stay readable, with [`TokenFileMeta::tokenizer`] `None`.
//!
//! The file has exactly this length; [`TokenFile::open`] checks all of it
//! (magic, version, sizes, offsets, every token id) before anything reads a
//! token, so a truncated or foreign file is an error naming the file and
//! the position, never a panic.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::{Error, Result};
use crate::tokenizer::TokenizerFingerprint;

/// The first eight bytes of every token file.
pub const MAGIC: [u8; 8] = *b"SGTOKENS";
/// The format version this crate writes and reads.
pub const VERSION: u32 = 1;
const HEADER_BYTES: u64 = 64;
const FLAG_MASK: u32 = 1;

/// One tokenized document: its ids (ending with the end-of-sequence id) and,
/// for chat records, which tokens are loss targets.
#[derive(Clone, Debug, PartialEq)]
pub struct Document {
    pub tokens: Vec<u32>,
    /// `Some(m)`: token `i` is a loss target when `m[i]`; `None`: every token is.
    pub loss_mask: Option<Vec<bool>>,
}

/// Which documents a batch draws from.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Split {
    Train,
    Validation,
}

/// What a token file's header says about its tokens.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct TokenFileMeta {
    pub vocab_size: u32,
    pub eos_id: u32,
    /// The tokenizer that wrote the ids; `None` in files written before it
    /// was recorded (and by writers without a tokenizer).
    pub tokenizer: Option<TokenizerFingerprint>,
}

/// Bytes per token id for a vocabulary: `u16` when every id fits, else `u32`.
pub fn token_bytes_for(vocab_size: u32) -> u32 {
    if vocab_size <= 1 << 16 {
        2
    } else {
        4
    }
}

/// Writes `train` then `validation` documents to `path` atomically: into a
/// temporary file in the same directory, flushed and fsynced, then renamed
/// over `path` (and the directory fsynced), so a crash leaves either the old
/// file or the complete new one.
pub fn write_token_file(path: &Path, meta: TokenFileMeta, train: &[Document], validation: &[Document]) -> Result<()> {
    let TokenFileMeta { vocab_size, eos_id, tokenizer } = meta;
    if vocab_size == 0 || eos_id >= vocab_size {
        return Err(Error::token_file(
            path,
            format!("end-of-sequence id {eos_id} is not below the vocabulary size {vocab_size}"),
        ));
    }
    let docs: Vec<&Document> = train.iter().chain(validation).collect();
    let mut n_tokens = 0u64;
    let mut with_mask = false;
    for (d, doc) in docs.iter().enumerate() {
        if doc.tokens.is_empty() {
            return Err(Error::token_file(path, format!("document {d} has no tokens")));
        }
        if let Some(bad) = doc.tokens.iter().position(|&t| t >= vocab_size) {
            return Err(Error::token_file(
                path,
                format!(
                    "document {d}: token id {} at position {bad} is not below the vocabulary size {vocab_size}",
                    doc.tokens[bad]
                ),
            ));
        }
        if let Some(mask) = &doc.loss_mask {
            if mask.len() != doc.tokens.len() {
                return Err(Error::token_file(
                    path,
                    format!("document {d}: {} mask entries for {} tokens", mask.len(), doc.tokens.len()),
                ));
            }
            with_mask |= mask.iter().any(|&m| !m);
        }
        n_tokens += doc.tokens.len() as u64;
    }
    let token_bytes = token_bytes_for(vocab_size);
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let tmp = tempfile::Builder::new()
        .prefix(".stepgraph-tokens-")
        .tempfile_in(&dir)
        .map_err(|e| Error::io(&dir, "creating a temporary token file", e))?;
    let wio = |e| Error::io(tmp.path(), "writing the token file", e);
    let mut w = BufWriter::with_capacity(1 << 20, tmp.as_file());
    let mut header = Vec::with_capacity(HEADER_BYTES as usize);
    header.extend_from_slice(&MAGIC);
    header.extend_from_slice(&VERSION.to_le_bytes());
    header.extend_from_slice(&(if with_mask { FLAG_MASK } else { 0 }).to_le_bytes());
    header.extend_from_slice(&vocab_size.to_le_bytes());
    header.extend_from_slice(&token_bytes.to_le_bytes());
    header.extend_from_slice(&eos_id.to_le_bytes());
    header.extend_from_slice(&0u32.to_le_bytes());
    header.extend_from_slice(&(docs.len() as u64).to_le_bytes());
    header.extend_from_slice(&(train.len() as u64).to_le_bytes());
    header.extend_from_slice(&n_tokens.to_le_bytes());
    header.extend_from_slice(&tokenizer.map_or(0, |t| t.0).to_le_bytes());
    debug_assert_eq!(header.len() as u64, HEADER_BYTES);
    w.write_all(&header).map_err(wio)?;
    let mut offset = 0u64;
    w.write_all(&offset.to_le_bytes()).map_err(wio)?;
    for doc in &docs {
        offset += doc.tokens.len() as u64;
        w.write_all(&offset.to_le_bytes()).map_err(wio)?;
    }
    for doc in &docs {
        for &t in &doc.tokens {
            // `t < vocab_size ≤ 65536` was checked above, so the u16 cast is exact.
            let r =
                if token_bytes == 2 { w.write_all(&(t as u16).to_le_bytes()) } else { w.write_all(&t.to_le_bytes()) };
            r.map_err(wio)?;
        }
    }
    let token_section = n_tokens * token_bytes as u64;
    w.write_all(&vec![0u8; (token_section.next_multiple_of(8) - token_section) as usize]).map_err(wio)?;
    if with_mask {
        let mut byte = 0u8;
        let mut i = 0u64;
        for doc in &docs {
            for k in 0..doc.tokens.len() {
                let target = doc.loss_mask.as_ref().is_none_or(|m| m[k]);
                byte |= (target as u8) << (i % 8);
                i += 1;
                if i.is_multiple_of(8) {
                    w.write_all(&[byte]).map_err(wio)?;
                    byte = 0;
                }
            }
        }
        if !i.is_multiple_of(8) {
            w.write_all(&[byte]).map_err(wio)?;
        }
    }
    w.flush().map_err(wio)?;
    drop(w);
    tmp.as_file().sync_all().map_err(wio)?;
    tmp.persist(path).map_err(|e| Error::io(path, "renaming the finished token file into place", e.error))?;
    // The rename is durable once the directory entry is; not every platform
    // can open a directory, so this last fsync is best effort.
    if let Ok(d) = File::open(&dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// A validated, memory-mapped token file.
#[derive(Debug)]
pub struct TokenFile {
    path: PathBuf,
    map: Mmap,
    meta: TokenFileMeta,
    token_bytes: u32,
    n_docs: u64,
    n_train_docs: u64,
    n_tokens: u64,
    tokens_at: usize,
    mask_at: Option<usize>,
    content_hash: u64,
}

fn read_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn read_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// FNV-1a over 64-bit words: a cheap fingerprint of the file's contents that
/// a saved data cursor carries, so resuming on a different file is caught.
fn fnv1a(hash: u64, word: u64) -> u64 {
    (hash ^ word).wrapping_mul(0x0000_0100_0000_01b3)
}

impl TokenFile {
    /// Maps `path` and validates all of it: header, sizes, document offsets
    /// and every token id.
    pub fn open(path: impl AsRef<Path>) -> Result<TokenFile> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| Error::io(path, "opening the token file", e))?;
        // SAFETY: the map is read-only and private to this process; like any
        // reader of a file we rely on no one truncating or rewriting it while
        // it is open (`stepgraph prepare` replaces files by rename, which
        // leaves an open map on the old contents).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, "memory-mapping the token file", e))?;
        let bad = |reason: String| Err(Error::token_file(path, reason));
        let b: &[u8] = &map;
        let len = b.len() as u64;
        if len < HEADER_BYTES {
            return bad(format!("truncated: {len} bytes, but the header alone is {HEADER_BYTES}"));
        }
        if b[..8] != MAGIC {
            return bad(format!(
                "not a stepgraph token file: it starts with {:?}, expected {:?} (write one with `stepgraph prepare`)",
                String::from_utf8_lossy(&b[..8]),
                String::from_utf8_lossy(&MAGIC)
            ));
        }
        let version = read_u32(b, 8);
        if version != VERSION {
            return bad(format!("format version {version}, but this build reads version {VERSION}"));
        }
        let flags = read_u32(b, 12);
        if flags & !FLAG_MASK != 0 {
            return bad(format!("unknown flags {flags:#x} (only bit 0, the loss mask, is defined)"));
        }
        let vocab_size = read_u32(b, 16);
        let token_bytes = read_u32(b, 20);
        let eos_id = read_u32(b, 24);
        let (n_docs, n_train_docs, n_tokens) = (read_u64(b, 32), read_u64(b, 40), read_u64(b, 48));
        if vocab_size == 0 {
            return bad("vocabulary size 0".into());
        }
        if token_bytes != token_bytes_for(vocab_size) {
            return bad(format!(
                "{token_bytes} bytes per token for a vocabulary of {vocab_size}, expected {}",
                token_bytes_for(vocab_size)
            ));
        }
        if eos_id >= vocab_size {
            return bad(format!("end-of-sequence id {eos_id} is not below the vocabulary size {vocab_size}"));
        }
        if n_train_docs > n_docs {
            return bad(format!("{n_train_docs} training documents out of only {n_docs}"));
        }
        // Checked arithmetic: the counts come from the file, and a corrupt
        // header must not wrap into a plausible length.
        let sizes = || -> Option<(u64, u64, u64)> {
            let tokens_at = HEADER_BYTES.checked_add(n_docs.checked_add(1)?.checked_mul(8)?)?;
            let token_section = n_tokens.checked_mul(token_bytes as u64)?.checked_next_multiple_of(8)?;
            let mask_at = tokens_at.checked_add(token_section)?;
            let end = if flags & FLAG_MASK != 0 { mask_at.checked_add(n_tokens.div_ceil(8))? } else { mask_at };
            Some((tokens_at, mask_at, end))
        };
        let Some((tokens_at, mask_at, end)) = sizes() else {
            return bad(format!("header counts overflow: {n_docs} documents, {n_tokens} tokens"));
        };
        if len < end {
            return bad(format!(
                "truncated: the header describes {n_docs} documents and {n_tokens} tokens in {end} bytes, but the file has {len}"
            ));
        }
        if len > end {
            return bad(format!("{} bytes after the end of the data ({end} bytes expected)", len - end));
        }
        let mut hash = 0xcbf2_9ce4_8422_2325u64;
        let mut prev = read_u64(b, HEADER_BYTES as usize);
        if prev != 0 {
            return bad(format!("the first document offset is {prev}, expected 0"));
        }
        for d in 0..n_docs {
            let next = read_u64(b, (HEADER_BYTES + 8 * (d + 1)) as usize);
            if next <= prev || next > n_tokens {
                return bad(format!(
                    "document {d} ends at token {next}, outside ({prev}, {n_tokens}]: offsets must increase up to the token count"
                ));
            }
            hash = fnv1a(hash, next);
            prev = next;
        }
        if prev != n_tokens {
            return bad(format!("the documents end at token {prev}, but the header counts {n_tokens} tokens"));
        }
        let tf = TokenFile {
            path: path.to_path_buf(),
            meta: TokenFileMeta {
                vocab_size,
                eos_id,
                tokenizer: Some(read_u64(b, 56)).filter(|&t| t != 0).map(TokenizerFingerprint),
            },
            token_bytes,
            n_docs,
            n_train_docs,
            n_tokens,
            tokens_at: tokens_at as usize,
            mask_at: (flags & FLAG_MASK != 0).then_some(mask_at as usize),
            content_hash: 0,
            map,
        };
        for i in 0..n_tokens {
            let t = tf.token(i);
            if t >= vocab_size {
                let doc = tf.doc_of(i);
                return bad(format!(
                    "token id {t} at position {i} (document {doc}) is not below the vocabulary size {vocab_size}"
                ));
            }
            hash = fnv1a(hash, t as u64);
        }
        if let Some(at) = tf.mask_at {
            for chunk in tf.map[at..].chunks(8) {
                let mut w = [0u8; 8];
                w[..chunk.len()].copy_from_slice(chunk);
                hash = fnv1a(hash, u64::from_le_bytes(w));
            }
        }
        hash = fnv1a(hash, n_train_docs);
        Ok(TokenFile { content_hash: hash, ..tf })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn meta(&self) -> TokenFileMeta {
        self.meta
    }
    pub fn vocab_size(&self) -> u32 {
        self.meta.vocab_size
    }
    pub fn eos_id(&self) -> u32 {
        self.meta.eos_id
    }
    /// 2 (`u16` ids) or 4 (`u32` ids).
    pub fn token_bytes(&self) -> u32 {
        self.token_bytes
    }
    pub fn n_docs(&self) -> u64 {
        self.n_docs
    }
    pub fn n_tokens(&self) -> u64 {
        self.n_tokens
    }
    /// Whether the file stores a loss mask (some token is not a loss target).
    pub fn has_mask(&self) -> bool {
        self.mask_at.is_some()
    }
    /// A fingerprint of the whole contents, computed while validating.
    pub fn content_hash(&self) -> u64 {
        self.content_hash
    }

    /// The documents of a split, as document indices.
    pub fn split_docs(&self, split: Split) -> Range<u64> {
        match split {
            Split::Train => 0..self.n_train_docs,
            Split::Validation => self.n_train_docs..self.n_docs,
        }
    }

    /// The tokens of a split: the training documents come first, so each
    /// split is one contiguous range.
    pub fn split_tokens(&self, split: Split) -> Range<u64> {
        let docs = self.split_docs(split);
        self.offset(docs.start)..self.offset(docs.end)
    }

    /// Tokens `[start, end)` of document `doc` (`doc < n_docs`).
    pub fn doc_tokens(&self, doc: u64) -> Range<u64> {
        assert!(doc < self.n_docs, "document {doc} of {}", self.n_docs);
        self.offset(doc)..self.offset(doc + 1)
    }

    fn offset(&self, doc: u64) -> u64 {
        read_u64(&self.map, (HEADER_BYTES + 8 * doc) as usize)
    }

    /// The document holding token `i` (binary search over the offsets).
    pub fn doc_of(&self, i: u64) -> u64 {
        let (mut lo, mut hi) = (0, self.n_docs);
        while lo + 1 < hi {
            let mid = (lo + hi) / 2;
            if self.offset(mid) <= i {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// Token id `i` (`i < n_tokens`).
    pub fn token(&self, i: u64) -> u32 {
        assert!(i < self.n_tokens, "token {i} of {}", self.n_tokens);
        let at = self.tokens_at + (i * self.token_bytes as u64) as usize;
        if self.token_bytes == 2 {
            u16::from_le_bytes([self.map[at], self.map[at + 1]]) as u32
        } else {
            read_u32(&self.map, at)
        }
    }

    /// Whether token `i` is a loss target (always, without a mask).
    pub fn is_target(&self, i: u64) -> bool {
        assert!(i < self.n_tokens, "token {i} of {}", self.n_tokens);
        match self.mask_at {
            None => true,
            Some(at) => self.map[at + (i / 8) as usize] >> (i % 8) & 1 == 1,
        }
    }

    /// Checks that every id of this file is a row of a model's embedding.
    pub fn check_vocab(&self, model_vocab: usize) -> Result<()> {
        if self.meta.vocab_size as usize > model_vocab {
            return Err(Error::token_file(
                &self.path,
                format!(
                    "vocabulary of {} tokens does not fit a model with {model_vocab} embedding rows; \
                     use --vocab {} (or larger) or a tokenizer of at most {model_vocab} tokens",
                    self.meta.vocab_size, self.meta.vocab_size
                ),
            ));
        }
        Ok(())
    }
}

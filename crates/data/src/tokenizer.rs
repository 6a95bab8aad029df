//! A Hugging Face tokenizer as `stepgraph prepare` uses it: `tokenizer.json`
//! through the `tokenizers` crate (pure Rust, nothing downloaded), plus what
//! `tokenizer_config.json` adds: the end-of-sequence and beginning-of-sequence
//! tokens and the chat template (or a `chat_template.jinja` next to it);
//! and the [`TokenizerFingerprint`] that token files record, so data is
//! never fed to a model whose ids mean other tokens.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{Error, Result};
use crate::template::ChatTemplate;

/// A fingerprint of a tokenizer's vocabulary: which token each id is.
/// Two tokenizers with the same fingerprint give their ids the same
/// meaning, so a token file of one trains a model of the other.
///
/// It is the 64-bit FNV-1a hash (offset basis `0xcbf29ce484222325`, prime
/// `0x100000001b3`) of every entry of the vocabulary, added tokens
/// included, in increasing id order, each as its id (`u32` little-endian),
/// the byte length of its text (`u32` little-endian) and that text in
/// UTF-8. The hash is stable across builds and platforms (it is written
/// into token files); a hash of 0 is stored as 1, since 0 in a token file
/// means "no tokenizer recorded".
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct TokenizerFingerprint(pub u64);

impl std::fmt::Display for TokenizerFingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl TokenizerFingerprint {
    /// The fingerprint of `(id, token)` entries, in any order.
    pub fn of_vocab<'a>(entries: impl IntoIterator<Item = (u32, &'a str)>) -> TokenizerFingerprint {
        let mut entries: Vec<(u32, &str)> = entries.into_iter().collect();
        entries.sort_unstable();
        let mut hash = 0xcbf2_9ce4_8422_2325u64;
        let mut eat = |bytes: &[u8]| {
            for &b in bytes {
                hash = (hash ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
            }
        };
        for (id, token) in entries {
            eat(&id.to_le_bytes());
            eat(&(token.len() as u32).to_le_bytes());
            eat(token.as_bytes());
        }
        TokenizerFingerprint(hash.max(1))
    }

    fn of(inner: &tokenizers::Tokenizer) -> TokenizerFingerprint {
        let vocab = inner.get_vocab(true);
        Self::of_vocab(vocab.iter().map(|(t, &id)| (id, t.as_str())))
    }
}

/// `tokenizer.json` of `dir_or_file`: the file itself, or the one in the directory.
fn tokenizer_json(dir_or_file: &Path) -> (PathBuf, PathBuf) {
    if dir_or_file.is_dir() {
        (dir_or_file.to_path_buf(), dir_or_file.join("tokenizer.json"))
    } else {
        let dir = dir_or_file.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        (dir.to_path_buf(), dir_or_file.to_path_buf())
    }
}

fn load_json(json: &Path) -> Result<tokenizers::Tokenizer> {
    if !json.is_file() {
        return Err(Error::Tokenizer {
            path: json.to_path_buf(),
            reason: "not found: --tokenizer takes a tokenizer.json or the directory holding one".into(),
        });
    }
    tokenizers::Tokenizer::from_file(json)
        .map_err(|e| Error::Tokenizer { path: json.to_path_buf(), reason: format!("cannot be loaded: {e}") })
}

/// Vocabulary size including added tokens: one more than the largest id.
fn vocab_size_of(inner: &tokenizers::Tokenizer) -> u32 {
    // Added tokens may sit past the model vocabulary with gaps, so the
    // size is the largest id plus one, not the number of entries.
    let largest = inner.get_vocab(true).values().copied().max().unwrap_or(0);
    (inner.get_vocab_size(true) as u32).max(largest + 1)
}

/// The `tokenizer.json` of `dir_or_file` (a directory holding it, or the
/// file), its fingerprint and vocabulary size, without the
/// `tokenizer_config.json` a full [`Tokenizer::load`] needs: what a model
/// folder's tokenizer is checked by.
pub fn fingerprint_of(dir_or_file: &Path) -> Result<(PathBuf, TokenizerFingerprint, u32)> {
    let (_, json) = tokenizer_json(dir_or_file);
    let inner = load_json(&json)?;
    Ok((json, TokenizerFingerprint::of(&inner), vocab_size_of(&inner)))
}

/// A loaded tokenizer with its special tokens.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The same tokenizer without its post-processor, for [`Tokenizer::encode_exact_offsets`].
    without_post: tokenizers::Tokenizer,
    /// The `tokenizer.json` it was loaded from (named in errors).
    pub path: PathBuf,
    pub eos_token: String,
    pub eos_id: u32,
    pub bos_token: Option<String>,
    /// The chat template, when the config (or `chat_template.jinja`) has one.
    pub chat_template: Option<ChatTemplate>,
    vocab_size: u32,
    fingerprint: TokenizerFingerprint,
}

/// A special token in `tokenizer_config.json`: a string, or an added-token
/// object `{"content": …}`.
fn special_token(config: &Value, key: &str) -> Option<String> {
    match config.get(key)? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// One encoded text: ids and each id's byte span in the text.
pub struct Encoded {
    pub ids: Vec<u32>,
    pub offsets: Vec<(usize, usize)>,
}

impl Tokenizer {
    /// Loads `tokenizer.json` from `dir_or_file` (a directory holding it, or
    /// the file itself) and `tokenizer_config.json` from the same directory.
    pub fn load(dir_or_file: &Path) -> Result<Tokenizer> {
        let (dir, json) = tokenizer_json(dir_or_file);
        let inner = load_json(&json)?;
        let config_path = dir.join("tokenizer_config.json");
        let config: Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| Error::Tokenizer {
                path: config_path.clone(),
                reason: format!("is not valid JSON: {e}"),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::Tokenizer {
                    path: config_path,
                    reason: "not found: its `eos_token` is the token that ends every document".into(),
                })
            }
            Err(e) => return Err(Error::io(&config_path, "reading the tokenizer config", e)),
        };
        let eos_token = special_token(&config, "eos_token").ok_or_else(|| Error::Tokenizer {
            path: config_path.clone(),
            reason: "has no `eos_token` (a string or {\"content\": …}); it is the token that ends every document"
                .into(),
        })?;
        let eos_id = inner.token_to_id(&eos_token).ok_or_else(|| Error::Tokenizer {
            path: json.clone(),
            reason: format!("eos_token `{eos_token}` of tokenizer_config.json is not in the vocabulary"),
        })?;
        let bos_token = special_token(&config, "bos_token");
        let chat_template = match config.get("chat_template") {
            Some(Value::String(source)) => Some(ChatTemplate::new(source.clone(), config_path.clone())?),
            // Some configs hold named templates: [{"name": "default", "template": …}, …].
            Some(Value::Array(list)) => {
                let default = list.iter().find(|t| t.get("name").and_then(Value::as_str) == Some("default"));
                let source = default.and_then(|t| t.get("template")).and_then(Value::as_str).ok_or_else(|| {
                    Error::Tokenizer {
                        path: config_path.clone(),
                        reason: "`chat_template` is a list without a template named \"default\"".into(),
                    }
                })?;
                Some(ChatTemplate::new(source.to_string(), config_path.clone())?)
            }
            Some(other) => {
                return Err(Error::Tokenizer {
                    path: config_path,
                    reason: format!("`chat_template` must be a string or a list of named templates, got {other}"),
                })
            }
            None => {
                let jinja = dir.join("chat_template.jinja");
                match std::fs::read_to_string(&jinja) {
                    Ok(source) => Some(ChatTemplate::new(source, jinja)?),
                    Err(_) => None,
                }
            }
        };
        let vocab_size = vocab_size_of(&inner);
        let fingerprint = TokenizerFingerprint::of(&inner);
        let mut without_post = inner.clone();
        without_post.with_post_processor(None::<tokenizers::PostProcessorWrapper>);
        Ok(Tokenizer {
            inner,
            without_post,
            path: json,
            eos_token,
            eos_id,
            bos_token,
            chat_template,
            vocab_size,
            fingerprint,
        })
    }

    /// Vocabulary size including added tokens: one more than the largest id.
    pub fn vocab_size(&self) -> u32 {
        self.vocab_size
    }

    /// Which token each id is, as token files record it.
    pub fn fingerprint(&self) -> TokenizerFingerprint {
        self.fingerprint
    }

    /// Encodes `text`; `special` adds the post-processor's special tokens
    /// (a BOS for Llama-style tokenizers) as `transformers` does for plain text.
    pub fn encode(&self, text: &str, special: bool) -> std::result::Result<Encoded, String> {
        let enc = self.inner.encode(text, special).map_err(|e| e.to_string())?;
        Ok(Encoded { ids: enc.get_ids().to_vec(), offsets: enc.get_offsets().to_vec() })
    }

    /// Encodes `text` without special tokens, with each token's untrimmed
    /// byte span: the ByteLevel post-processor's `trim_offsets` would move a
    /// whitespace token's span to its end, into the next message.
    pub fn encode_exact_offsets(&self, text: &str) -> std::result::Result<Encoded, String> {
        let enc = self.without_post.encode(text, false).map_err(|e| e.to_string())?;
        Ok(Encoded { ids: enc.get_ids().to_vec(), offsets: enc.get_offsets().to_vec() })
    }

    pub fn decode(&self, ids: &[u32]) -> std::result::Result<String, String> {
        self.inner.decode(ids, false).map_err(|e| e.to_string())
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
}

/// The text of a growing list of generated tokens, decoded a few tokens at a
/// time instead of the whole list after every token (quadratic in the
/// output's length): the offsets method of Hugging Face's
/// text-generation-inference. Each push decodes only the window from
/// `prefix` (the start of the previous piece, kept as context: decoders that
/// drop a leading space or join pieces see the same neighbours as in the
/// whole list) and keeps what the new token added; a piece that ends in an
/// incomplete character (U+FFFD) waits for the tokens that complete it.
/// [`StreamDecoder::text`] is therefore final text only, what a stream may
/// print; [`StreamDecoder::finish`] adds what is still pending.
#[derive(Clone, Debug, Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    /// Start of the window: the first token of the previous piece.
    prefix: usize,
    /// End of the text already taken: tokens `..read` are in `text`.
    read: usize,
    text: String,
}

impl StreamDecoder {
    pub fn new() -> StreamDecoder {
        StreamDecoder::default()
    }

    /// Appends `id`; returns the length of [`StreamDecoder::text`] before it
    /// (the new text starts there; it may have grown by nothing).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> std::result::Result<usize, String> {
        let before = self.text.len();
        self.ids.push(id);
        let (taken, now) = self.window(tok)?;
        if now.len() > taken.len() && !now.ends_with('\u{FFFD}') {
            if let Some(piece) = now.get(taken.len()..) {
                self.text.push_str(piece);
                self.prefix = self.read;
                self.read = self.ids.len();
            }
        }
        Ok(before)
    }

    /// The window's text without and with the tokens not yet taken.
    fn window(&self, tok: &Tokenizer) -> std::result::Result<(String, String), String> {
        Ok((tok.decode(&self.ids[self.prefix..self.read])?, tok.decode(&self.ids[self.prefix..])?))
    }

    /// The final text so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Takes the pending tokens as they decode (an incomplete character as
    /// U+FFFD, as a decode of the whole list gives it) and returns the text.
    pub fn finish(&mut self, tok: &Tokenizer) -> std::result::Result<&str, String> {
        if self.read < self.ids.len() {
            let (taken, now) = self.window(tok)?;
            // Pieces always extend their window's text; the guard keeps a
            // decoder that rewrote it from losing the whole window.
            match now.get(taken.len()..).filter(|_| now.starts_with(&taken)) {
                Some(piece) => self.text.push_str(piece),
                None => self.text = tok.decode(&self.ids)?,
            }
            self.prefix = self.read;
            self.read = self.ids.len();
        }
        Ok(&self.text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fingerprint_is_the_documented_hash_of_the_id_order() {
        // FNV-1a of 00000000 01000000 'a' 01000000 01000000 'b', as documented
        // (computed independently): a token file written by one build is
        // checked by every later one.
        let ab = TokenizerFingerprint::of_vocab([(1, "b"), (0, "a")]);
        assert_eq!(ab, TokenizerFingerprint(0x1d04_e222_c511_ae87));
        assert_eq!(ab.to_string(), "1d04e222c511ae87");
        // Same tokens under other ids, or another token, is another tokenizer.
        assert_ne!(ab, TokenizerFingerprint::of_vocab([(0, "b"), (1, "a")]));
        assert_ne!(ab, TokenizerFingerprint::of_vocab([(0, "a"), (1, "c")]));
        assert_ne!(ab, TokenizerFingerprint::of_vocab([(0, "ab")]));
    }
}

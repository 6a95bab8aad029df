//! The one error type of `stepgraph-data`. Every message names the file (and
//! the line or token position where there is one), the bad value, and what
//! would have been accepted, so a user can fix the input without the source.

use std::path::{Path, PathBuf};

use thiserror::Error;

/// Errors raised while reading tokenizers, input records and token files,
/// and while drawing batches.
#[derive(Debug, Error)]
pub enum Error {
    /// A file that could not be read, written, created or renamed. The
    /// cause is in the message, not a `#[source]`, so `{:#}` chains print
    /// it once.
    #[error("{}: {action}: {cause}", path.display())]
    Io { path: PathBuf, action: &'static str, cause: std::io::Error },
    /// A tokenizer directory or file that cannot be used.
    #[error("tokenizer {}: {reason}", path.display())]
    Tokenizer { path: PathBuf, reason: String },
    /// An input record (a JSONL line, an element of a JSON array, a
    /// Parquet row or a text file) that cannot be turned into a document.
    #[error("{}{at}: {reason}", path.display())]
    Record { path: PathBuf, at: RecordAt, reason: String },
    /// A chat template that does not compile or fails while rendering.
    #[error("chat template from {}: {reason}", path.display())]
    Template { path: PathBuf, reason: String },
    /// A token file that is not a valid stepgraph token file.
    #[error("token file {}: {reason}", path.display())]
    TokenFile { path: PathBuf, reason: String },
    /// Options (flags or library options) that do not fit together or the data.
    #[error("{0}")]
    Options(String),
    /// A saved data cursor that does not belong to this token file and batch shape.
    #[error("data cursor does not match: {0}")]
    Cursor(String),
}

/// Where a record sits in its input file, as error messages name it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum RecordAt {
    /// The whole file (a text input); printed as nothing.
    File,
    /// A 1-based line of a JSONL file: `data.jsonl:12`.
    Line(usize),
    /// A 0-based element of a JSON array, as indexed in it: `data.json[3]`.
    Index(usize),
    /// A 0-based row of a Parquet file, as pandas and `datasets` index it:
    /// `data.parquet row 3`.
    Row(usize),
}

impl std::fmt::Display for RecordAt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecordAt::File => Ok(()),
            RecordAt::Line(n) => write!(f, ":{n}"),
            RecordAt::Index(i) => write!(f, "[{i}]"),
            RecordAt::Row(r) => write!(f, " row {r}"),
        }
    }
}

impl Error {
    pub(crate) fn io(path: &Path, action: &'static str, source: std::io::Error) -> Self {
        Error::Io { path: path.to_path_buf(), action, cause: source }
    }
    pub(crate) fn token_file(path: &Path, reason: impl Into<String>) -> Self {
        Error::TokenFile { path: path.to_path_buf(), reason: reason.into() }
    }
    pub(crate) fn record(path: &Path, at: RecordAt, reason: impl Into<String>) -> Self {
        Error::Record { path: path.to_path_buf(), at, reason: reason.into() }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

//! Input files into records: which reader a file gets, and the readers of
//! text, JSONL and JSON arrays (Parquet is [`crate::parquet_input`]).
//!
//! **Invariant:** a file that starts with Parquet's magic bytes `PAR1` is
//! never read as text or JSON: under [`InputFormat::Auto`] it is read as
//! Parquet whatever its name, and a format that would read its bytes as
//! characters refuses it.
//!
//! Under [`InputFormat::Auto`], `.jsonl` and `.json` files are JSON
//! records, `.parquet` files Parquet, anything else text. A JSON input
//! whose first character is `[` is one array of records (as alpaca
//! datasets ship); otherwise it is JSONL, a record per line.

use std::io::Read;
use std::path::Path;

use serde_json::Value;

use crate::error::{Error, RecordAt, Result};
use crate::parquet_input;
use crate::records::{parse_jsonl_record, record_from_value, text_documents, Record, TextSplit};

/// How an input file is read.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum InputFormat {
    Text,
    /// JSON records: JSONL, or one JSON array of records when the file
    /// starts with `[`.
    Jsonl,
    /// The same as [`InputFormat::Jsonl`], named after `.json` files.
    Json,
    Parquet,
    /// By the file's magic bytes and extension (see the module doc).
    Auto,
}

/// The first bytes (and the last) of every Parquet file.
pub const PARQUET_MAGIC: &[u8; 4] = b"PAR1";

/// Whether `path` starts with [`PARQUET_MAGIC`].
pub fn is_parquet(path: &Path) -> Result<bool> {
    let mut file = std::fs::File::open(path).map_err(|e| Error::io(path, "reading the input", e))?;
    let mut head = [0u8; 4];
    let mut got = 0;
    while got < head.len() {
        match file.read(&mut head[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io(path, "reading the input", e)),
        }
    }
    Ok(got == head.len() && &head == PARQUET_MAGIC)
}

fn extension(path: &Path) -> Option<String> {
    path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase)
}

/// The records of one input file, each with where it sits in the file.
/// `column` picks a Parquet file's column (see [`parquet_input`]); other
/// files ignore it.
pub fn read_records(
    path: &Path,
    format: InputFormat,
    split: TextSplit,
    column: Option<&str>,
) -> Result<Vec<(RecordAt, Record)>> {
    let parquet = is_parquet(path)?;
    let format = match format {
        InputFormat::Auto if parquet => InputFormat::Parquet,
        InputFormat::Auto => match extension(path).as_deref() {
            Some("jsonl" | "json") => InputFormat::Jsonl,
            Some("parquet") => InputFormat::Parquet,
            _ => InputFormat::Text,
        },
        InputFormat::Text | InputFormat::Jsonl | InputFormat::Json if parquet => {
            return Err(Error::record(
                path,
                RecordAt::File,
                "a Parquet file (it starts with the magic bytes PAR1), so it is not read as text or JSON: \
                 use --format parquet or auto",
            ));
        }
        other => other,
    };
    if format == InputFormat::Parquet {
        return parquet_input::read_parquet(path, column);
    }
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, "reading the input", e))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let line = e.as_bytes()[..at].iter().filter(|&&b| b == b'\n').count() + 1;
        Error::record(path, RecordAt::Line(line), format!("not UTF-8 (invalid byte at offset {at})"))
    })?;
    if format == InputFormat::Text {
        return Ok(text_documents(&text, split).into_iter().map(|t| (RecordAt::File, Record::Text(t))).collect());
    }
    if text.trim_start().starts_with('[') {
        return json_array_records(&text, path);
    }
    let mut records = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if !line.trim().is_empty() {
            records.push((RecordAt::Line(i + 1), parse_jsonl_record(line, path, i + 1)?));
        }
    }
    Ok(records)
}

/// The records of a file holding one JSON array, each named by its index.
fn json_array_records(text: &str, path: &Path) -> Result<Vec<(RecordAt, Record)>> {
    let values: Vec<Value> = serde_json::from_str(text).map_err(|e| {
        Error::record(
            path,
            RecordAt::Line(e.line()),
            format!("not a valid JSON array of records (column {}): {e}", e.column()),
        )
    })?;
    values
        .iter()
        .enumerate()
        .map(|(i, v)| Ok((RecordAt::Index(i), record_from_value(v, path, RecordAt::Index(i))?)))
        .collect()
}

//! `stepgraph prepare`: text and JSONL files → one token file for training
//! (the format is documented in `stepgraph_data::token_file`). The work is
//! `stepgraph_data::prepare`; this module owns the flags, the checks of
//! `--out` before any tokenizing (not an input, writable, room for the
//! file: [`crate::output_paths`]) and the report.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};

use stepgraph_data::{Holdout, InputFormat, PrepareOptions, TextSplit};

use crate::output_paths;

#[derive(Copy, Clone, ValueEnum)]
pub enum FormatArg {
    /// Plain text (see --text-split).
    Text,
    /// One JSON record per line: {"text"}, {"instruction","input","output"} or {"messages"}.
    Jsonl,
    /// JSONL for .jsonl/.json files, text otherwise.
    Auto,
}

#[derive(Copy, Clone, ValueEnum)]
pub enum TextSplitArg {
    /// A document per paragraph (text between blank lines).
    Paragraph,
    /// A document per file.
    File,
}

#[derive(Args, Clone)]
pub struct PrepareArgs {
    /// A Hugging Face tokenizer.json, or the directory holding it and tokenizer_config.json.
    #[arg(long)]
    tokenizer: PathBuf,
    /// Input files (text or JSONL); repeat the flag or list several.
    #[arg(long, required = true, num_args = 1..)]
    input: Vec<PathBuf>,
    /// The token file to write (replaced atomically).
    #[arg(long)]
    out: PathBuf,
    /// How to read the inputs.
    #[arg(long, value_enum, default_value_t = FormatArg::Auto)]
    format: FormatArg,
    /// How text files are cut into documents.
    #[arg(long, value_enum, default_value_t = TextSplitArg::Paragraph)]
    text_split: TextSplitArg,
    /// Accept chat ({"messages"}) and instruction records: render them with the
    /// tokenizer's chat template and keep only the assistant's tokens in the loss.
    #[arg(long)]
    chat: bool,
    /// Fraction of the documents held out for validation [default: 0.01; at
    /// least one document when positive and there are two or more].
    #[arg(long, conflicts_with = "val_docs")]
    val_fraction: Option<f64>,
    /// Number of documents held out for validation (instead of --val-fraction).
    #[arg(long)]
    val_docs: Option<u64>,
    /// Seed of the choice of validation documents.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// Room asked for the token file besides a byte per byte of input (a
/// token file of u16 ids is as large as its text at one token per two
/// bytes, and BPE tokenizers average three to four bytes per token): the
/// header, document offsets and loss mask of a small input.
const OUT_BYTES_EXTRA: u64 = 1 << 20;

/// Refuses an `--out` that would replace an input (a `--input` file, or
/// any file of the tokenizer's folder, which `prepare` reads
/// `tokenizer_config.json` from too) and one that cannot be written or has
/// no room, before anything is tokenized. Missing folders above `--out`
/// are created.
fn check_out(args: &PrepareArgs) -> Result<()> {
    let tokenizer_dir = if args.tokenizer.is_file() {
        args.tokenizer.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")).to_path_buf()
    } else {
        args.tokenizer.clone()
    };
    let mut inputs: Vec<(&str, &Path)> = args.input.iter().map(|p| ("--input", p.as_path())).collect();
    inputs.push(("--tokenizer", &tokenizer_dir));
    output_paths::refuse_overwriting_inputs("--out", &args.out, &inputs)?;
    // A missing input is reported by name when it is read.
    let input_bytes: u64 = args.input.iter().filter_map(|p| std::fs::metadata(p).ok()).map(|m| m.len()).sum();
    let need = input_bytes.saturating_add(OUT_BYTES_EXTRA);
    output_paths::check_writable("--out", &args.out, need)
}

pub fn run(args: &PrepareArgs) -> Result<()> {
    let holdout = match (args.val_fraction, args.val_docs) {
        (Some(f), _) if !(0.0..1.0).contains(&f) => bail!("--val-fraction must be in [0, 1), got {f}"),
        (Some(f), _) => Holdout::Fraction(f),
        (None, Some(n)) => Holdout::Docs(n),
        (None, None) => Holdout::Fraction(0.01),
    };
    check_out(args)?;
    let opts = PrepareOptions {
        tokenizer: args.tokenizer.clone(),
        inputs: args.input.clone(),
        out: args.out.clone(),
        format: match args.format {
            FormatArg::Text => InputFormat::Text,
            FormatArg::Jsonl => InputFormat::Jsonl,
            FormatArg::Auto => InputFormat::Auto,
        },
        text_split: match args.text_split {
            TextSplitArg::Paragraph => TextSplit::Paragraph,
            TextSplitArg::File => TextSplit::File,
        },
        chat: args.chat,
        holdout,
        seed: args.seed,
        progress: true,
    };
    let report = stepgraph_data::prepare(&opts)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("{report}");
    }
    Ok(())
}

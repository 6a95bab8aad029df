//! `stepgraph prepare`: text, JSONL, JSON and Parquet files, one or a
//! weighted mixture → one token file for training (the format is
//! documented in `stepgraph_data::token_file`; the inputs' formats in
//! docs/guide/data-formats.md). The work is `stepgraph_data::prepare`;
//! this module owns the flags, the checks of
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
    /// JSON records, one per line (or one JSON array of them): {"text"},
    /// {"instruction","input","output"}, {"messages"} or {"conversations"}.
    Jsonl,
    /// The same as jsonl.
    Json,
    /// A column of a Parquet file (see --column).
    Parquet,
    /// Parquet for files starting with PAR1 or named .parquet, JSON for
    /// .jsonl/.json, text otherwise.
    Auto,
}

#[derive(Copy, Clone, ValueEnum)]
pub enum TextSplitArg {
    /// A document per paragraph (text between blank lines).
    Paragraph,
    /// A document per file.
    File,
}

/// One `--input`: a file, and its mixture weight when spelled FILE:WEIGHT.
#[derive(Clone, Debug)]
pub struct InputArg {
    path: PathBuf,
    weight: Option<f64>,
}

fn parse_input_arg(spec: &str) -> Result<InputArg, String> {
    // clap names the flag and the value already.
    let (path, weight) = stepgraph_data::mixture::parse_input(spec).map_err(|e| {
        let e = e.to_string();
        e.strip_prefix(&format!("--input {spec}: ")).map_or(e.clone(), str::to_string)
    })?;
    Ok(InputArg { path, weight })
}

#[derive(Args, Clone)]
#[command(after_help = "Input formats, with an example of each: docs/guide/data-formats.md")]
pub struct PrepareArgs {
    /// A Hugging Face tokenizer.json, or the directory holding it and tokenizer_config.json.
    #[arg(long)]
    tokenizer: PathBuf,
    /// Input files (text, JSONL, a JSON array of records, Parquet); FILE:WEIGHT on each makes a mixture.
    ///
    /// Repeat the flag or list several. Without weights every document of
    /// every input is used once. With a weight on every input
    /// (--input a.jsonl:0.7 b.parquet:0.3), each input gives that share of
    /// the tokens (weights are normalised): the input that runs out first
    /// is used whole and the others are sampled by --seed, no document
    /// twice. The weight is what follows the last ':' when it is a number.
    #[arg(long, required = true, num_args = 1.., value_name = "FILE[:WEIGHT]", value_parser = parse_input_arg)]
    input: Vec<InputArg>,
    /// The token file to write (replaced atomically).
    #[arg(long)]
    out: PathBuf,
    /// How to read the inputs.
    #[arg(long, value_enum, default_value_t = FormatArg::Auto)]
    format: FormatArg,
    /// The column of Parquet inputs [default: text, messages, conversations or instruction + output].
    ///
    /// Strings are a document per row; a list of {role, content} or
    /// {from, value} structs a chat per row. Without the flag: the first of
    /// text, messages and conversations the file has, else the alpaca
    /// columns instruction + output (with input and system when present).
    #[arg(long, value_name = "NAME")]
    column: Option<String>,
    /// How text files are cut into documents.
    #[arg(long, value_enum, default_value_t = TextSplitArg::Paragraph)]
    text_split: TextSplitArg,
    /// Accept chat ({"messages"}, ShareGPT {"conversations"}) and instruction
    /// records: render them with the tokenizer's chat template and keep only
    /// the assistant's tokens in the loss.
    #[arg(long)]
    chat: bool,
    /// Fraction of the documents held out for validation [default: 0.01; at
    /// least one document when positive and there are two or more].
    #[arg(long, conflicts_with = "val_docs")]
    val_fraction: Option<f64>,
    /// Number of documents held out for validation (instead of --val-fraction).
    #[arg(long)]
    val_docs: Option<u64>,
    /// Seed of the choice of validation documents and of a mixture's documents.
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
    let mut inputs: Vec<(&str, &Path)> = args.input.iter().map(|i| ("--input", i.path.as_path())).collect();
    inputs.push(("--tokenizer", &tokenizer_dir));
    output_paths::refuse_overwriting_inputs("--out", &args.out, &inputs)?;
    // A missing input is reported by name when it is read.
    let input_bytes: u64 = args.input.iter().filter_map(|i| std::fs::metadata(&i.path).ok()).map(|m| m.len()).sum();
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
    let weighted = args.input.iter().filter(|i| i.weight.is_some()).count();
    if weighted != 0 && weighted != args.input.len() {
        let bare: Vec<String> =
            args.input.iter().filter(|i| i.weight.is_none()).map(|i| i.path.display().to_string()).collect();
        bail!(
            "--input: {weighted} of {} inputs have a mixture weight, but {} has none: \
             give every input a weight (FILE:WEIGHT) or none",
            args.input.len(),
            bare.join(", ")
        );
    }
    check_out(args)?;
    let opts = PrepareOptions {
        tokenizer: args.tokenizer.clone(),
        inputs: args.input.iter().map(|i| i.path.clone()).collect(),
        weights: args.input.iter().filter_map(|i| i.weight).collect(),
        column: args.column.clone(),
        out: args.out.clone(),
        format: match args.format {
            FormatArg::Text => InputFormat::Text,
            FormatArg::Jsonl => InputFormat::Jsonl,
            FormatArg::Json => InputFormat::Json,
            FormatArg::Parquet => InputFormat::Parquet,
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

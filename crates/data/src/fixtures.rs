//! Test fixtures, public so that every crate's tests share them: a small
//! byte-level BPE tokenizer trained with the `tokenizers` crate on a text
//! file (no network), saved with a `tokenizer_config.json` whose chat
//! template is in the Qwen2 (ChatML) or the Llama-3 style, sample JSONL
//! records of every kind `stepgraph prepare` reads, and Parquet files laid
//! out as pyarrow (and so Hugging Face `datasets`) writes them.

use std::path::{Path, PathBuf};

use std::sync::Arc;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;

use parquet::basic::Compression;
use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;
use tokenizers::AddedToken;

use crate::error::{Error, Result};

/// The special tokens of both template styles (ids 0 to 7, in this order).
pub const SPECIAL_TOKENS: [&str; 8] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
];

/// Qwen2's ChatML template (without tool calls): a default system prompt
/// when the chat has none, `<|im_start|>role\n…<|im_end|>\n` per message.
pub const CHATML_TEMPLATE: &str = r#"{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('Unexpected role ' + message.role) }}
    {%- endif %}
    {%- if (message.role == "system" and not loop.first) or message.role != "system" %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"#;

/// Llama-3's template: BOS, then `<|start_header_id|>role<|end_header_id|>\n\n`
/// and the trimmed content ending with `<|eot_id|>` per message.
pub const LLAMA3_TEMPLATE: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}\
{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}\
{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}\
{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

/// Which chat template (and special tokens) the fixture's config carries.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TemplateStyle {
    /// Qwen2: EOS `<|endoftext|>`, no BOS, [`CHATML_TEMPLATE`].
    ChatMl,
    /// Llama-3 instruct: BOS `<|begin_of_text|>`, EOS `<|eot_id|>`, [`LLAMA3_TEMPLATE`].
    Llama3,
}

fn tk_err<'a>(path: &'a Path, what: &str) -> impl Fn(tokenizers::Error) -> Error + 'a {
    let what = what.to_string();
    move |e| Error::Tokenizer { path: path.to_path_buf(), reason: format!("{what}: {e}") }
}

/// Trains a byte-level BPE tokenizer of about `vocab_size` entries on
/// `corpus` and saves `tokenizer.json` and `tokenizer_config.json` in `dir`.
/// Returns `dir`.
pub fn train_tokenizer(corpus: &Path, dir: &Path, vocab_size: usize, style: TemplateStyle) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, "creating the fixture directory", e))?;
    let mut tokenizer = tokenizers::Tokenizer::new(BPE::default());
    // No prefix space, as in the Qwen2 and Llama-3 tokenizers.
    tokenizer.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tokenizer.with_post_processor(Some(ByteLevel::default().add_prefix_space(false)));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    let specials: Vec<AddedToken> = SPECIAL_TOKENS.iter().map(|t| AddedToken::from(t.to_string(), true)).collect();
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .show_progress(false)
        .vocab_size(vocab_size)
        .min_frequency(2)
        .special_tokens(specials)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    let corpus_name = corpus.to_str().ok_or_else(|| Error::Options(format!("{} is not UTF-8", corpus.display())))?;
    tokenizer.train_from_files(&mut trainer, vec![corpus_name.to_string()]).map_err(tk_err(corpus, "training BPE"))?;
    let json = dir.join("tokenizer.json");
    tokenizer.save(&json, false).map_err(tk_err(&json, "saving"))?;
    let config = match style {
        TemplateStyle::ChatMl => serde_json::json!({
            "bos_token": null,
            "eos_token": "<|endoftext|>",
            "chat_template": CHATML_TEMPLATE,
        }),
        TemplateStyle::Llama3 => serde_json::json!({
            "bos_token": {"content": "<|begin_of_text|>", "special": true},
            "eos_token": "<|eot_id|>",
            "chat_template": LLAMA3_TEMPLATE,
        }),
    };
    let config_path = dir.join("tokenizer_config.json");
    std::fs::write(&config_path, serde_json::to_string_pretty(&config).expect("JSON"))
        .map_err(|e| Error::io(&config_path, "writing", e))?;
    Ok(dir.to_path_buf())
}

/// JSONL with `{"text": …}` records.
pub const TEXT_JSONL: &str = r#"{"text": "The planner reads the whole story before it is told."}
{"text": "A gradient can sleep where an activation once lived."}

{"text": "The graph remembers the story once it has been told."}
"#;

/// Instruction records (one with an input, one without, one with a system prompt).
pub const INSTRUCTION_JSONL: &str = r#"{"instruction": "Say what the planner does.", "input": "", "output": "It gives each tensor a place in one arena."}
{"instruction": "Finish the sentence.", "input": "The tokens come in, the rows pass", "output": "through the layers, one after another."}
{"instruction": "Name the loss.", "output": "Cross-entropy.", "system": "Answer in two words."}
"#;

/// Chat records, one with two assistant turns.
pub const CHAT_JSONL: &str = r#"{"messages": [{"role": "user", "content": "What does the graph keep?"}, {"role": "assistant", "content": "The list of kernels and every address."}]}
{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What moves the weights?"}, {"role": "assistant", "content": "The optimizer."}, {"role": "user", "content": "And then?"}, {"role": "assistant", "content": "The next batch comes in."}]}
"#;

/// ShareGPT records (`conversations` of `{from, value}`), one with a system turn.
pub const SHAREGPT_JSONL: &str = r#"{"conversations": [{"from": "human", "value": "What does the plan hold?"}, {"from": "gpt", "value": "Every buffer of the step, each at its offset."}]}
{"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Where do gradients go?"}, {"from": "gpt", "value": "Into their accumulators."}, {"from": "human", "value": "And then?"}, {"from": "gpt", "value": "The optimizer reads them."}]}
"#;

/// Alpaca records as one JSON array, as alpaca datasets ship.
pub const ALPACA_JSON: &str = r#"[
  {"instruction": "Say what the planner does.", "input": "", "output": "It gives each tensor a place in one arena."},
  {"instruction": "Finish the sentence.", "input": "The tokens come in, the rows pass", "output": "through the layers, one after another."},
  {"instruction": "Name the loss.", "input": "", "output": "Cross-entropy."}
]
"#;

fn parquet_err(path: &Path) -> impl Fn(parquet::errors::ParquetError) -> Error + '_ {
    move |e| Error::Options(format!("writing the Parquet fixture {}: {e}", path.display()))
}

fn write_parquet(
    path: &Path,
    schema: &str,
    columns: &[(Vec<ByteArray>, Vec<i16>, Vec<i16>)],
    ids: Option<&[i64]>,
    compression: Compression,
) -> Result<()> {
    let err = parquet_err(path);
    let schema = Arc::new(parse_message_type(schema).map_err(&err)?);
    let props = Arc::new(WriterProperties::builder().set_compression(compression).build());
    let file = std::fs::File::create(path).map_err(|e| Error::io(path, "creating the Parquet fixture", e))?;
    let mut writer = SerializedFileWriter::new(file, schema, props).map_err(&err)?;
    let mut group = writer.next_row_group().map_err(&err)?;
    let mut strings = columns.iter();
    while let Some(mut column) = group.next_column().map_err(&err)? {
        if let Some((values, def, rep)) = strings.next() {
            let rep = if rep.is_empty() { None } else { Some(&rep[..]) };
            column.typed::<ByteArrayType>().write_batch(values, Some(def), rep).map_err(&err)?;
        } else {
            let ids = ids.expect("an id column only when ids are given");
            column.typed::<Int64Type>().write_batch(ids, Some(&vec![1; ids.len()]), None).map_err(&err)?;
        }
        column.close().map_err(&err)?;
    }
    group.close().map_err(&err)?;
    writer.close().map_err(&err)?;
    Ok(())
}

/// Writes a Snappy-compressed Parquet file of two columns, as pyarrow
/// writes a table: `column`, optional strings (`None` a null), and `id`,
/// optional int64 (the row's index).
pub fn write_parquet_texts(path: &Path, column: &str, texts: &[Option<&str>]) -> Result<()> {
    write_parquet_texts_compressed(path, column, texts, Compression::SNAPPY)
}

/// [`write_parquet_texts`] with another codec.
pub fn write_parquet_texts_compressed(
    path: &Path,
    column: &str,
    texts: &[Option<&str>],
    compression: Compression,
) -> Result<()> {
    let schema = format!("message schema {{ OPTIONAL BYTE_ARRAY {column} (UTF8); OPTIONAL INT64 id; }}");
    let values: Vec<ByteArray> = texts.iter().flatten().map(|t| ByteArray::from(*t)).collect();
    let def: Vec<i16> = texts.iter().map(|t| i16::from(t.is_some())).collect();
    let ids: Vec<i64> = (0..texts.len() as i64).collect();
    write_parquet(path, &schema, &[(values, def, vec![])], Some(&ids), compression)
}

/// Writes a Snappy-compressed Parquet file of optional string columns,
/// each a name and its rows (`None` a null), all of one length.
pub fn write_parquet_string_columns(path: &Path, columns: &[(&str, Vec<Option<&str>>)]) -> Result<()> {
    let fields: String = columns.iter().map(|(name, _)| format!("OPTIONAL BYTE_ARRAY {name} (UTF8); ")).collect();
    let data: Vec<_> = columns
        .iter()
        .map(|(_, rows)| {
            let values = rows.iter().flatten().map(|t| ByteArray::from(*t)).collect();
            (values, rows.iter().map(|t| i16::from(t.is_some())).collect(), vec![])
        })
        .collect();
    write_parquet(path, &format!("message schema {{ {fields}}}"), &data, None, Compression::SNAPPY)
}

/// Writes a Snappy-compressed Parquet file with one chat column, a list
/// of structs laid out as pyarrow writes `list<struct<…>>`: `keys` names
/// the struct's two string fields (`("role", "content")` as in
/// `messages`, `("from", "value")` as in ShareGPT's `conversations`), and
/// each chat is a list of (role, text) pairs.
pub fn write_parquet_chats(path: &Path, column: &str, keys: (&str, &str), chats: &[Vec<(&str, &str)>]) -> Result<()> {
    let schema = format!(
        "message schema {{ OPTIONAL group {column} (LIST) {{ REPEATED group list {{ OPTIONAL group element {{ \
         OPTIONAL BYTE_ARRAY {} (UTF8); OPTIONAL BYTE_ARRAY {} (UTF8); }} }} }} }}",
        keys.0, keys.1
    );
    // Every level present: definition level 4 (the column, the list
    // entry, the element, the field); a new row repeats at level 0.
    let mut roles = (Vec::new(), Vec::new(), Vec::new());
    let mut texts = (Vec::new(), Vec::new(), Vec::new());
    for chat in chats {
        for (i, (role, text)) in chat.iter().enumerate() {
            let rep = i16::from(i > 0);
            roles.0.push(ByteArray::from(*role));
            texts.0.push(ByteArray::from(*text));
            for levels in [&mut roles, &mut texts] {
                levels.1.push(4);
                levels.2.push(rep);
            }
        }
    }
    write_parquet(path, &schema, &[roles, texts], None, Compression::SNAPPY)
}

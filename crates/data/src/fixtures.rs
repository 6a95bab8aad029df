//! Test fixtures, public so that every crate's tests share them: a small
//! byte-level BPE tokenizer trained with the `tokenizers` crate on a text
//! file (no network), saved with a `tokenizer_config.json` whose chat
//! template is in the Qwen2 (ChatML) or the Llama-3 style, and sample JSONL
//! records of every kind `stepgraph prepare` reads.

use std::path::{Path, PathBuf};

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
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

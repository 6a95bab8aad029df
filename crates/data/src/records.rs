//! Input records and their tokenization into [`Document`]s.
//!
//! - **Text files**: split into documents at blank lines (a line holding only
//!   whitespace), so a paragraph is a document ([`TextSplit::Paragraph`]), or
//!   one document per file ([`TextSplit::File`]). Every token is a loss target.
//! - **JSON records** (a JSONL line, an element of a JSON array, or a
//!   Parquet row read as JSON; see [`crate::inputs`]):
//!   `{"text": …}` is a plain document; `{"instruction", "input"?, "output",
//!   "system"?}` (alpaca) becomes a chat (user: the instruction, then the
//!   input after a blank line; assistant: the output); `{"messages":
//!   [{"role", "content"}, …]}` is a chat, and so is ShareGPT's
//!   `{"conversations": [{"from", "value"}, …]}`, its `from` names mapped
//!   to roles by [`SHAREGPT_ROLES`]. Chats need `--chat` and are rendered
//!   with the tokenizer's chat template.
//!
//! **The loss mask of a chat** covers only what the assistant says. It is
//! found by rendering prefixes, which works for any template without knowing
//! its markers: for the assistant message `i`, rendering messages `[0, i)`
//! with `add_generation_prompt` gives the text before the reply, and
//! rendering `[0, i]` the text through its end-of-turn marker; the reply is
//! the byte span between the two, and a token of the whole rendering is a
//! target when it starts in such a span (with untrimmed offsets, so a
//! whitespace token before a reply stays in the prompt). A template whose prefixes are not prefixes of the whole
//! conversation is refused (the span would be a guess).
//!
//! Every document ends with the end-of-sequence id (appended unless the
//! tokenizer already put it there); it is a target, except after a chat
//! whose last message is not the assistant's.

use std::path::Path;

use serde_json::Value;

use crate::error::{Error, RecordAt, Result};
use crate::template::{Message, ROLES};
use crate::token_file::Document;
use crate::tokenizer::Tokenizer;

/// How text files become documents.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TextSplit {
    /// A document per paragraph (text between blank lines).
    Paragraph,
    /// A document per file.
    File,
}

/// One input record before tokenization.
#[derive(Clone, Debug, PartialEq)]
pub enum Record {
    Text(String),
    Chat(Vec<Message>),
}

/// The documents of a text file, by `split`.
pub fn text_documents(text: &str, split: TextSplit) -> Vec<String> {
    match split {
        TextSplit::File => {
            if text.trim().is_empty() {
                vec![]
            } else {
                vec![text.trim_end().to_string()]
            }
        }
        TextSplit::Paragraph => {
            let mut docs = Vec::new();
            let mut current: Vec<&str> = Vec::new();
            for line in text.lines() {
                if line.trim().is_empty() {
                    if !current.is_empty() {
                        docs.push(current.join("\n"));
                        current.clear();
                    }
                } else {
                    current.push(line);
                }
            }
            if !current.is_empty() {
                docs.push(current.join("\n"));
            }
            docs
        }
    }
}

fn string_field<'a>(obj: &'a serde_json::Map<String, Value>, key: &str, path: &Path, at: RecordAt) -> Result<&'a str> {
    match obj.get(key) {
        Some(Value::String(s)) => Ok(s),
        Some(other) => Err(Error::record(path, at, format!("`{key}` must be a string, got {other}"))),
        None => Err(Error::record(path, at, format!("missing key `{key}`"))),
    }
}

/// ShareGPT's `from` names and the chat role each stands for. The names
/// past `human`/`gpt` are those of the original ShareGPT dumps and of
/// datasets converted from `messages`.
pub const SHAREGPT_ROLES: [(&str, &str); 9] = [
    ("system", "system"),
    ("human", "user"),
    ("user", "user"),
    ("gpt", "assistant"),
    ("assistant", "assistant"),
    ("chatgpt", "assistant"),
    ("bing", "assistant"),
    ("bard", "assistant"),
    ("model", "assistant"),
];

/// How a list of chat messages names its fields: `messages` holds
/// `{"role", "content"}` with the roles of [`ROLES`]; ShareGPT's
/// `conversations` holds `{"from", "value"}` with the names of
/// [`SHAREGPT_ROLES`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ChatShape {
    Messages,
    ShareGpt,
}

impl ChatShape {
    fn keys(self) -> (&'static str, &'static str) {
        match self {
            ChatShape::Messages => ("role", "content"),
            ChatShape::ShareGpt => ("from", "value"),
        }
    }

    /// The shape whose keys the first message uses (`messages` when none).
    pub fn of(list: &[Value]) -> ChatShape {
        match list.first() {
            Some(Value::Object(m)) if m.contains_key("from") || m.contains_key("value") => ChatShape::ShareGpt,
            _ => ChatShape::Messages,
        }
    }

    fn role(self, name: &str) -> Option<&'static str> {
        match self {
            ChatShape::Messages => ROLES.iter().find(|&&r| r == name).copied(),
            ChatShape::ShareGpt => SHAREGPT_ROLES.iter().find(|(from, _)| *from == name).map(|&(_, role)| role),
        }
    }

    fn accepted(self) -> String {
        match self {
            ChatShape::Messages => ROLES.join(", "),
            ChatShape::ShareGpt => {
                let names = |role: &str| {
                    SHAREGPT_ROLES.iter().filter(|(_, r)| *r == role).map(|(f, _)| *f).collect::<Vec<_>>().join(", ")
                };
                format!("{} → user; {} → assistant; system", names("user"), names("assistant"))
            }
        }
    }
}

/// A list of chat messages (the value of `name` in a record) as a chat.
pub fn chat_from_list(list: &Value, shape: ChatShape, name: &str, path: &Path, at: RecordAt) -> Result<Record> {
    let Value::Array(list) = list else {
        return Err(Error::record(path, at, format!("`{name}` must be an array, got {list}")));
    };
    let (role_key, content_key) = shape.keys();
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let Value::Object(m) = m else {
            return Err(Error::record(path, at, format!("{name}[{i}] must be an object, got {m}")));
        };
        let within = |e: Error| match e {
            Error::Record { path, at, reason } => Error::Record { path, at, reason: format!("{name}[{i}]: {reason}") },
            other => other,
        };
        let from = string_field(m, role_key, path, at).map_err(within)?;
        let content = string_field(m, content_key, path, at).map_err(within)?;
        let Some(role) = shape.role(from) else {
            return Err(Error::record(
                path,
                at,
                format!("{name}[{i}]: unknown role `{from}` (accepted: {})", shape.accepted()),
            ));
        };
        out.push(Message { role: role.to_string(), content: content.to_string() });
    }
    if out.is_empty() {
        return Err(Error::record(path, at, format!("`{name}` is empty")));
    }
    Ok(Record::Chat(out))
}

/// Parses one JSONL line (1-based `line`) into a record.
pub fn parse_jsonl_record(text: &str, path: &Path, line: usize) -> Result<Record> {
    let at = RecordAt::Line(line);
    let value: Value =
        serde_json::from_str(text).map_err(|e| Error::record(path, at, format!("not valid JSON: {e}")))?;
    record_from_value(&value, path, at)
}

/// One record (a JSONL line, an element of a JSON array, a Parquet row as
/// JSON) by its keys: `messages` or `conversations` (a chat), then
/// `instruction` (alpaca), then `text`.
pub fn record_from_value(value: &Value, path: &Path, at: RecordAt) -> Result<Record> {
    let Value::Object(obj) = value else {
        return Err(Error::record(path, at, format!("expected a JSON object, got {value}")));
    };
    if let Some(messages) = obj.get("messages") {
        return chat_from_list(messages, ChatShape::Messages, "messages", path, at);
    }
    if let Some(conversations) = obj.get("conversations") {
        return chat_from_list(conversations, ChatShape::ShareGpt, "conversations", path, at);
    }
    if obj.contains_key("instruction") {
        let instruction = string_field(obj, "instruction", path, at)?;
        let output = string_field(obj, "output", path, at)?;
        let input = match obj.get("input") {
            None | Some(Value::Null) => "",
            Some(_) => string_field(obj, "input", path, at)?,
        };
        let mut messages = Vec::new();
        if let Some(system) = obj.get("system").filter(|v| !v.is_null()) {
            let Value::String(system) = system else {
                return Err(Error::record(path, at, format!("`system` must be a string, got {system}")));
            };
            messages.push(Message { role: "system".into(), content: system.clone() });
        }
        let user = if input.is_empty() { instruction.to_string() } else { format!("{instruction}\n\n{input}") };
        messages.push(Message { role: "user".into(), content: user });
        messages.push(Message { role: "assistant".into(), content: output.to_string() });
        return Ok(Record::Chat(messages));
    }
    if obj.contains_key("text") {
        return Ok(Record::Text(string_field(obj, "text", path, at)?.to_string()));
    }
    let keys: Vec<&str> = obj.keys().map(String::as_str).collect();
    Err(Error::record(
        path,
        at,
        format!(
            "missing key: a record needs `text`, `messages` or `conversations` (a chat) or `instruction` + `output`, \
             but has only [{}]",
            keys.join(", ")
        ),
    ))
}

fn with_eos(tokenizer: &Tokenizer, mut ids: Vec<u32>, mut mask: Option<Vec<bool>>, eos_target: bool) -> Document {
    if ids.last() != Some(&tokenizer.eos_id) {
        ids.push(tokenizer.eos_id);
        if let Some(m) = &mut mask {
            m.push(eos_target);
        }
    }
    Document { tokens: ids, loss_mask: mask }
}

/// Tokenizes a plain text document.
pub fn tokenize_text(tokenizer: &Tokenizer, text: &str, path: &Path, at: RecordAt) -> Result<Document> {
    let enc = tokenizer.encode(text, true).map_err(|e| Error::record(path, at, format!("tokenizer failed: {e}")))?;
    Ok(with_eos(tokenizer, enc.ids, None, true))
}

/// Renders a chat with the tokenizer's template and tokenizes it, with the
/// loss mask covering the assistant's replies (see the module doc).
pub fn tokenize_chat(tokenizer: &Tokenizer, messages: &[Message], path: &Path, at: RecordAt) -> Result<Document> {
    let Some(template) = &tokenizer.chat_template else {
        return Err(Error::record(
            path,
            at,
            format!(
                "a chat record needs a chat template, but {} has no `chat_template` (nor a chat_template.jinja next to it)",
                tokenizer.path.with_file_name("tokenizer_config.json").display()
            ),
        ));
    };
    if !messages.iter().any(|m| m.role == "assistant") {
        return Err(Error::record(path, at, "the chat has no assistant message, so it has nothing to train on"));
    }
    let bos = tokenizer.bos_token.as_deref().unwrap_or("");
    let eos = tokenizer.eos_token.as_str();
    let render = |msgs: &[Message], gen: bool| {
        template.render(msgs, gen, bos, eos).map_err(|e| Error::Template {
            path: template.path.clone(),
            reason: format!("rendering the record at {}{at}: {e}", path.display()),
        })
    };
    let full = render(messages, false)?;
    let mut spans = Vec::new();
    for (i, _) in messages.iter().enumerate().filter(|(_, m)| m.role == "assistant") {
        let before = render(&messages[..i], true)?;
        let through = render(&messages[..=i], false)?;
        if !(through.starts_with(&before) && full.starts_with(&through)) {
            return Err(Error::Template {
                path: template.path.clone(),
                reason: format!(
                    "record {}{at}: the rendering of the first {i} messages (with the generation prompt) is not a prefix \
                     of the rendering through message {i}, so the assistant's reply cannot be located for the loss mask",
                    path.display()
                ),
            });
        }
        spans.push(before.len()..through.len());
    }
    // The template writes the special tokens (BOS included) itself.
    let enc =
        tokenizer.encode_exact_offsets(&full).map_err(|e| Error::record(path, at, format!("tokenizer failed: {e}")))?;
    let mask: Vec<bool> = enc.offsets.iter().map(|&(start, _)| spans.iter().any(|s| s.contains(&start))).collect();
    if !mask.iter().any(|&m| m) {
        return Err(Error::record(
            path,
            at,
            "the assistant's messages render to no tokens, so there is nothing to train on",
        ));
    }
    let last_is_assistant = messages.last().is_some_and(|m| m.role == "assistant");
    Ok(with_eos(tokenizer, enc.ids, Some(mask), last_is_assistant))
}

/// Tokenizes any record; chats only when `chat` is allowed.
pub fn tokenize_record(
    tokenizer: &Tokenizer,
    record: &Record,
    chat: bool,
    path: &Path,
    at: RecordAt,
) -> Result<Document> {
    match record {
        Record::Text(text) => tokenize_text(tokenizer, text, path, at),
        Record::Chat(_) if !chat => Err(Error::record(
            path,
            at,
            "a chat or instruction record: pass --chat to render it with the tokenizer's chat template \
             (the prompt is then masked out of the loss)",
        )),
        Record::Chat(messages) => tokenize_chat(tokenizer, messages, path, at),
    }
}

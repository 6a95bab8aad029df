//! Chat templates: the Jinja `chat_template` of a Hugging Face
//! `tokenizer_config.json`, rendered with `minijinja` the way `transformers`'
//! `apply_chat_template` renders it: `trim_blocks` and `lstrip_blocks` on,
//! the context `messages` (each with `role` and `content`), `bos_token`,
//! `eos_token` and `add_generation_prompt`, the functions HF templates call
//! (`raise_exception`, `strftime_now`), loop controls, `tojson`, and Python
//! string and dict methods (`.strip()`, `.startswith()`, `.items()`, …).

use std::path::{Path, PathBuf};

use minijinja::{Environment, ErrorKind, Value};
use serde::Serialize;

use crate::error::{Error, Result};

/// One chat message.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// The roles a record may use; the loss covers the assistant's messages.
pub const ROLES: [&str; 3] = ["system", "user", "assistant"];

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Where the template came from (named in errors).
    pub path: PathBuf,
}

const NAME: &str = "chat_template";

/// `raise_exception(message)`: how HF templates reject a conversation.
fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("the template raised: {message}")))
}

/// `strftime_now(format)`: the current UTC date in a C `strftime` format
/// (Llama 3.1 puts today's date in its system prompt). An unknown directive
/// is a template error rather than chrono's formatting panic.
fn strftime_now(format: String) -> std::result::Result<String, minijinja::Error> {
    use chrono::format::{Item, StrftimeItems};
    if StrftimeItems::new(&format).any(|item| matches!(item, Item::Error)) {
        return Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: `{format}` is not a valid strftime format"),
        ));
    }
    Ok(chrono::Utc::now().format(&format).to_string())
}

fn describe(e: &minijinja::Error) -> String {
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        s.push_str(&format!(": {inner}"));
        source = inner.source();
    }
    s
}

impl ChatTemplate {
    /// Compiles `source`; `path` names where it came from in errors.
    pub fn new(source: String, path: PathBuf) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(NAME, source).map_err(|e| Error::Template {
            path: path.clone(),
            reason: format!("does not compile: {}", describe(&e)),
        })?;
        Ok(ChatTemplate { env, path })
    }

    /// Renders a conversation; `add_generation_prompt` appends the header of
    /// the assistant's next turn.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
    ) -> std::result::Result<String, String> {
        let template = self.env.get_template(NAME).map_err(|e| describe(&e))?;
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => bos_token,
            eos_token => eos_token,
        };
        template.render(ctx).map_err(|e| describe(&e))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, messages: &[Message]) -> std::result::Result<String, String> {
        let t = ChatTemplate::new(source.to_string(), PathBuf::from("test.jinja")).map_err(|e| e.to_string())?;
        t.render(messages, true, "<s>", "</s>")
    }

    fn chat() -> Vec<Message> {
        vec![
            Message { role: "system".into(), content: "  be brief ".into() },
            Message { role: "user".into(), content: "hi".into() },
        ]
    }

    #[test]
    fn hf_template_features() {
        // Loop controls, tojson, Python string methods, the context variables.
        let source = "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}\
            {{ m.role.upper() }}={{ m.content.strip() | tojson }}{% if m.content.startswith('h') %}!{% endif %}\
            {% break %}{% endfor %}{% if add_generation_prompt %}[gen]{{ eos_token }}{% endif %}";
        assert_eq!(render(source, &chat()).unwrap(), "<s>USER=\"hi\"![gen]</s>");
        // trim_blocks and lstrip_blocks, as transformers sets them.
        let source = "{% for m in messages %}\n    {% if true %}\n{{ m.role }}\n    {% endif %}\n{% endfor %}";
        assert_eq!(render(source, &chat()).unwrap(), "system\nuser\n");
    }

    #[test]
    fn strftime_now_formats_today_and_refuses_bad_formats() {
        let today = render("{{ strftime_now('%Y-%m-%d') }}", &chat()).unwrap();
        assert_eq!(today, chrono::Utc::now().format("%Y-%m-%d").to_string());
        let e = render("{{ strftime_now('%Q') }}", &chat()).unwrap_err();
        assert!(e.contains("`%Q` is not a valid strftime format"), "{e}");
    }

    #[test]
    fn raise_exception_and_compile_errors() {
        let e = render("{{ raise_exception('roles must alternate') }}", &chat()).unwrap_err();
        assert!(e.contains("the template raised: roles must alternate"), "{e}");
        let e = render("{% if %}", &chat()).unwrap_err();
        assert!(e.contains("test.jinja") && e.contains("does not compile"), "{e}");
    }
}

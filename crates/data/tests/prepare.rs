//! `prepare` end to end with a BPE tokenizer trained on `data/tiny.txt`:
//! every input format, chat masks in the ChatML and Llama-3 styles, EOS per
//! document, the validation split, and every bad input named precisely.

use std::path::{Path, PathBuf};

use stepgraph_data::fixtures::{self, TemplateStyle};
use stepgraph_data::{prepare, Holdout, InputFormat, PrepareOptions, Split, TextSplit, TokenFile, Tokenizer};

const TINY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/tiny.txt");

struct Fixture {
    dir: tempfile::TempDir,
    tokenizer: PathBuf,
}

fn fixture(style: TemplateStyle) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = fixtures::train_tokenizer(Path::new(TINY), &dir.path().join("tok"), 400, style).unwrap();
    Fixture { dir, tokenizer }
}

impl Fixture {
    fn input(&self, name: &str, text: &str) -> PathBuf {
        let p = self.dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    }
    fn opts(&self, inputs: Vec<PathBuf>) -> PrepareOptions {
        PrepareOptions {
            tokenizer: self.tokenizer.clone(),
            inputs,
            weights: vec![],
            column: None,
            out: self.dir.path().join("out.tokens"),
            format: InputFormat::Auto,
            text_split: TextSplit::Paragraph,
            chat: false,
            holdout: Holdout::Docs(0),
            seed: 0,
            progress: false,
        }
    }
    fn tok(&self) -> Tokenizer {
        Tokenizer::load(&self.tokenizer).unwrap()
    }
}

/// Each document's ids, and the ids that are loss targets.
fn docs(file: &TokenFile) -> Vec<(Vec<u32>, Vec<u32>)> {
    (0..file.n_docs())
        .map(|d| {
            let r = file.doc_tokens(d);
            let ids = r.clone().map(|i| file.token(i)).collect();
            let kept = r.filter(|&i| file.is_target(i)).map(|i| file.token(i)).collect();
            (ids, kept)
        })
        .collect()
}

#[test]
fn text_paragraphs_become_documents_ending_with_eos() {
    let fx = fixture(TemplateStyle::ChatMl);
    let report = prepare(&fx.opts(vec![TINY.into()])).unwrap();
    let text = std::fs::read_to_string(TINY).unwrap();
    let paragraphs: Vec<&str> = text.split("\n\n").map(str::trim).filter(|p| !p.is_empty()).collect();
    assert_eq!(report.docs as usize, paragraphs.len());
    assert_eq!((report.masked_tokens, report.validation_docs, report.token_bytes), (0, 0, 2));
    let file = TokenFile::open(&report.out).unwrap();
    assert!(!file.has_mask());
    let tok = fx.tok();
    assert_eq!(file.eos_id(), tok.eos_id);
    assert_eq!(file.n_tokens(), report.tokens);
    for ((ids, _), paragraph) in docs(&file).iter().zip(&paragraphs) {
        assert_eq!(*ids.last().unwrap(), tok.eos_id);
        assert_eq!(ids.iter().filter(|&&t| t == tok.eos_id).count(), 1);
        assert_eq!(tok.decode(&ids[..ids.len() - 1]).unwrap(), *paragraph);
    }
    // One document per file.
    let mut o = fx.opts(vec![TINY.into()]);
    o.text_split = TextSplit::File;
    assert_eq!(prepare(&o).unwrap().docs, 1);
}

#[test]
fn jsonl_text_records_and_the_validation_split() {
    let fx = fixture(TemplateStyle::ChatMl);
    let jsonl = fx.input("text.jsonl", fixtures::TEXT_JSONL);
    let mut o = fx.opts(vec![jsonl.clone(), TINY.into()]);
    o.holdout = Holdout::Docs(3);
    o.seed = 4;
    let report = prepare(&o).unwrap();
    assert_eq!((report.docs, report.train_docs, report.validation_docs), (11, 8, 3));
    let file = TokenFile::open(&report.out).unwrap();
    let all = docs(&file);
    let (train, val) = all.split_at(8);
    assert!(val.iter().all(|d| !train.contains(d)), "validation documents are not trained on");
    assert_eq!(
        file.split_tokens(Split::Validation).end - file.split_tokens(Split::Validation).start,
        report.validation_tokens
    );
    let tok = fx.tok();
    let texts: Vec<String> = all.iter().map(|(ids, _)| tok.decode(&ids[..ids.len() - 1]).unwrap()).collect();
    for line in
        ["The planner reads the whole story before it is told.", "The graph remembers the story once it has been told."]
    {
        assert!(texts.iter().any(|t| t == line), "{line} in {texts:?}");
    }
    // The same seed draws the same split; a fraction rounds, with at least one.
    assert_eq!(docs(&TokenFile::open(&prepare(&o).unwrap().out).unwrap()), all);
    o.holdout = Holdout::Fraction(0.01);
    assert_eq!(prepare(&o).unwrap().validation_docs, 1);
    o.holdout = Holdout::Docs(11);
    let e = prepare(&o).unwrap_err().to_string();
    assert!(e.contains("11 validation documents of 11"), "{e}");
}

/// The kept (target) tokens of each chat decode to exactly the replies.
fn chat_targets(style: TemplateStyle, records: &str) -> (Vec<String>, Vec<String>) {
    let fx = fixture(style);
    let path = fx.input("chat.jsonl", records);
    let mut o = fx.opts(vec![path]);
    o.chat = true;
    let report = prepare(&o).unwrap();
    let file = TokenFile::open(&report.out).unwrap();
    assert!(file.has_mask());
    let tok = fx.tok();
    let all = docs(&file);
    let masked: u64 = all.iter().map(|(ids, kept)| (ids.len() - kept.len()) as u64).sum();
    assert_eq!(report.masked_tokens, masked);
    assert!(masked > 0);
    let full = all.iter().map(|(ids, _)| tok.decode(ids).unwrap()).collect();
    let kept = all.iter().map(|(_, kept)| tok.decode(kept).unwrap()).collect();
    (full, kept)
}

#[test]
fn instruction_records_in_chatml_train_only_on_the_output() {
    let (full, kept) = chat_targets(TemplateStyle::ChatMl, fixtures::INSTRUCTION_JSONL);
    assert_eq!(
        full[1],
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nFinish the sentence.\n\n\
         The tokens come in, the rows pass<|im_end|>\n<|im_start|>assistant\nthrough the layers, one after another.\
         <|im_end|>\n<|endoftext|>"
    );
    assert_eq!(
        kept,
        [
            "It gives each tensor a place in one arena.<|im_end|>\n<|endoftext|>",
            "through the layers, one after another.<|im_end|>\n<|endoftext|>",
            "Cross-entropy.<|im_end|>\n<|endoftext|>",
        ]
    );
    assert!(full[2].starts_with("<|im_start|>system\nAnswer in two words.<|im_end|>"), "{}", full[2]);
}

#[test]
fn chat_records_mask_every_prompt_turn() {
    let (full, kept) = chat_targets(TemplateStyle::ChatMl, fixtures::CHAT_JSONL);
    assert_eq!(kept[1], "The optimizer.<|im_end|>\nThe next batch comes in.<|im_end|>\n<|endoftext|>");
    assert!(full[1].contains("<|im_start|>user\nAnd then?<|im_end|>"));
}

#[test]
fn llama3_chats_start_with_bos_and_end_with_their_own_eos() {
    let (full, kept) = chat_targets(TemplateStyle::Llama3, fixtures::CHAT_JSONL);
    assert_eq!(
        full[0],
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat does the graph keep?<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\nThe list of kernels and every address.<|eot_id|>",
        "the template's <|eot_id|> is the EOS: none is appended"
    );
    assert_eq!(kept[0], "The list of kernels and every address.<|eot_id|>");
    assert_eq!(kept[1], "The optimizer.<|eot_id|>The next batch comes in.<|eot_id|>");
}

#[test]
fn mixed_text_and_chat_records_with_chat() {
    let fx = fixture(TemplateStyle::ChatMl);
    let path = fx.input("mixed.jsonl", &format!("{}{}", fixtures::TEXT_JSONL, fixtures::CHAT_JSONL));
    let mut o = fx.opts(vec![path]);
    o.chat = true;
    let report = prepare(&o).unwrap();
    let file = TokenFile::open(&report.out).unwrap();
    let all = docs(&file);
    assert_eq!(all.len(), 5);
    assert!(all[..3].iter().all(|(ids, kept)| ids == kept), "text records are trained on whole");
    assert!(all[3..].iter().all(|(ids, kept)| kept.len() < ids.len()));
}

fn error_of(style: TemplateStyle, records: &str, chat: bool) -> (String, String) {
    let fx = fixture(style);
    let path = fx.input("bad.jsonl", records);
    let mut o = fx.opts(vec![path.clone()]);
    o.chat = chat;
    let e = prepare(&o).unwrap_err().to_string();
    assert!(!o.out.exists(), "no output on error");
    (e, path.display().to_string())
}

#[test]
fn bad_records_name_the_file_and_line() {
    let ok = r#"{"text": "fine"}"#;
    let cases: [(&str, bool, &str, &[&str]); 9] = [
        ("bad json", false, "{\"text\": \"unterminated}", &[":2:", "not valid JSON"]),
        ("missing key", false, r#"{"body": "x", "id": 3}"#, &[":2:", "missing key", "[body, id]", "`text`"]),
        ("missing output", true, r#"{"instruction": "x"}"#, &[":2:", "missing key `output`"]),
        ("text type", false, r#"{"text": 5}"#, &[":2:", "`text` must be a string, got 5"]),
        ("not an object", false, "[1, 2]", &[":2:", "expected a JSON object"]),
        (
            "unknown role",
            true,
            r#"{"messages": [{"role": "robot", "content": "x"}]}"#,
            &[":2:", "messages[0]", "unknown role `robot`", "system, user, assistant"],
        ),
        (
            "missing content",
            true,
            r#"{"messages": [{"role": "user"}]}"#,
            &[":2:", "messages[0]", "missing key `content`"],
        ),
        (
            "chat without --chat",
            false,
            r#"{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}"#,
            &[":2:", "--chat"],
        ),
        ("no assistant", true, r#"{"messages": [{"role": "user", "content": "x"}]}"#, &[":2:", "no assistant message"]),
    ];
    for (what, chat, line, needles) in cases {
        let (e, path) = error_of(TemplateStyle::ChatMl, &format!("{ok}\n{line}\n{ok}\n"), chat);
        assert!(e.contains(&path), "{what}: {e}");
        for n in needles {
            assert!(e.contains(n), "{what}: `{n}` in {e}");
        }
    }
}

fn with_template(template: &str) -> Fixture {
    let fx = fixture(TemplateStyle::ChatMl);
    let config = serde_json::json!({"eos_token": "<|endoftext|>", "chat_template": template});
    std::fs::write(fx.tokenizer.join("tokenizer_config.json"), config.to_string()).unwrap();
    fx
}

#[test]
fn template_errors_name_the_template_and_the_record() {
    let chat = r#"{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}"#;
    // raise_exception from the template.
    let fx =
        with_template("{% if messages|length > 1 %}{{ raise_exception('Only one message is supported') }}{% endif %}x");
    let mut o = fx.opts(vec![fx.input("c.jsonl", chat)]);
    o.chat = true;
    let e = prepare(&o).unwrap_err().to_string();
    assert!(
        e.contains("tokenizer_config.json") && e.contains("c.jsonl:1") && e.contains("Only one message is supported"),
        "{e}"
    );
    // A template that does not compile.
    let fx = with_template("{% for m in messages %}{{ m.content }}");
    let mut o = fx.opts(vec![fx.input("c.jsonl", chat)]);
    o.chat = true;
    let e = prepare(&o).unwrap_err().to_string();
    assert!(e.contains("tokenizer_config.json") && e.contains("does not compile"), "{e}");
    // A template whose prefixes move: the reply cannot be located.
    let fx = with_template("{{ messages|length }}{% for m in messages %}{{ m.content }}{% endfor %}");
    let mut o = fx.opts(vec![fx.input("c.jsonl", chat)]);
    o.chat = true;
    let e = prepare(&o).unwrap_err().to_string();
    assert!(e.contains("not a prefix") && e.contains("c.jsonl:1"), "{e}");
    // No template at all.
    let fx = fixture(TemplateStyle::ChatMl);
    std::fs::write(fx.tokenizer.join("tokenizer_config.json"), r#"{"eos_token": "<|endoftext|>"}"#).unwrap();
    let mut o = fx.opts(vec![fx.input("c.jsonl", chat)]);
    o.chat = true;
    let e = prepare(&o).unwrap_err().to_string();
    assert!(e.contains("c.jsonl:1") && e.contains("no `chat_template`"), "{e}");
}

#[test]
fn tokenizer_problems_are_named() {
    let fx = fixture(TemplateStyle::ChatMl);
    let config = fx.tokenizer.join("tokenizer_config.json");
    let load = || Tokenizer::load(&fx.tokenizer).err().unwrap().to_string();
    std::fs::write(&config, r#"{"bos_token": "<s>"}"#).unwrap();
    let e = load();
    assert!(e.contains("tokenizer_config.json") && e.contains("no `eos_token`"), "{e}");
    std::fs::write(&config, r#"{"eos_token": "</s>"}"#).unwrap();
    let e = load();
    assert!(e.contains("eos_token `</s>`") && e.contains("not in the vocabulary"), "{e}");
    std::fs::write(&config, "{").unwrap();
    assert!(load().contains("not valid JSON"));
    std::fs::remove_file(&config).unwrap();
    assert!(load().contains("tokenizer_config.json: not found"));
    let e = Tokenizer::load(&fx.dir.path().join("nowhere")).err().unwrap().to_string();
    assert!(e.contains("nowhere") && e.contains("not found"), "{e}");
    // The file itself also works as --tokenizer.
    std::fs::write(&config, r#"{"eos_token": {"content": "<|im_end|>"}}"#).unwrap();
    let t = Tokenizer::load(&fx.tokenizer.join("tokenizer.json")).unwrap();
    assert_eq!(t.eos_id, 2);
    // A non-UTF-8 input.
    let bad = fx.dir.path().join("latin1.txt");
    std::fs::write(&bad, b"caf\xe9\n").unwrap();
    let e = prepare(&fx.opts(vec![bad])).unwrap_err().to_string();
    assert!(e.contains("latin1.txt:1") && e.contains("not UTF-8"), "{e}");
}

/// The token file records which tokenizer wrote it: the same fingerprint
/// as the tokenizer's, another for a tokenizer of another vocabulary.
#[test]
fn the_token_file_records_its_tokenizer() {
    let fx = fixture(TemplateStyle::ChatMl);
    let input = fx.input("a.txt", "Once upon a time.\n\nThe end.\n");
    prepare(&fx.opts(vec![input])).unwrap();
    let file = TokenFile::open(fx.dir.path().join("out.tokens")).unwrap();
    let tok = fx.tok();
    assert_eq!(file.meta().tokenizer, Some(tok.fingerprint()));
    assert_eq!(file.vocab_size(), tok.vocab_size());
    // The tokenizer.json alone gives the same fingerprint.
    let (json, fp, vocab) = stepgraph_data::tokenizer::fingerprint_of(&fx.tokenizer).unwrap();
    assert_eq!((json, fp, vocab), (fx.tokenizer.join("tokenizer.json"), tok.fingerprint(), tok.vocab_size()));
    let other =
        fixtures::train_tokenizer(Path::new(TINY), &fx.dir.path().join("tok300"), 300, TemplateStyle::ChatMl).unwrap();
    assert_ne!(Tokenizer::load(&other).unwrap().fingerprint(), tok.fingerprint());
}

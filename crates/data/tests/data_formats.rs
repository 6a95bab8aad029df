//! The formats people bring to `prepare`: ShareGPT records, JSON arrays of
//! records, Parquet files (string and chat columns, written here with the
//! `parquet` crate's writer), and weighted mixtures of inputs. Each format
//! is checked against the same records in a format `prepare` read before,
//! so a record means the same tokens and loss mask whatever file it is in.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use parquet::basic::Compression;
use stepgraph_data::fixtures::{self, TemplateStyle};
use stepgraph_data::{prepare, Holdout, InputFormat, PrepareOptions, PrepareReport, TextSplit, TokenFile, Tokenizer};

const TINY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/tiny.txt");

struct Fixture {
    dir: tempfile::TempDir,
    tokenizer: PathBuf,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer =
        fixtures::train_tokenizer(Path::new(TINY), &dir.path().join("tok"), 400, TemplateStyle::ChatMl).unwrap();
    Fixture { dir, tokenizer }
}

impl Fixture {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
    fn input(&self, name: &str, text: &str) -> PathBuf {
        let p = self.path(name);
        std::fs::write(&p, text).unwrap();
        p
    }
    fn opts(&self, inputs: Vec<PathBuf>, out: &str) -> PrepareOptions {
        PrepareOptions {
            tokenizer: self.tokenizer.clone(),
            inputs,
            weights: vec![],
            column: None,
            out: self.path(out),
            format: InputFormat::Auto,
            text_split: TextSplit::Paragraph,
            chat: true,
            holdout: Holdout::Docs(0),
            seed: 0,
            progress: false,
        }
    }
    fn prepare(&self, inputs: Vec<PathBuf>, out: &str) -> PrepareReport {
        prepare(&self.opts(inputs, out)).unwrap()
    }
    fn error(&self, opts: &PrepareOptions) -> String {
        let e = prepare(opts).unwrap_err().to_string();
        assert!(!opts.out.exists(), "no output on error: {e}");
        e
    }
}

/// Each document's ids and loss mask.
fn docs(path: &Path) -> Vec<(Vec<u32>, Vec<bool>)> {
    let file = TokenFile::open(path).unwrap();
    (0..file.n_docs())
        .map(|d| {
            let r = file.doc_tokens(d);
            (r.clone().map(|i| file.token(i)).collect(), r.map(|i| file.is_target(i)).collect())
        })
        .collect()
}

/// The ShareGPT fixture's chats spelled as `messages` records.
fn sharegpt_as_messages() -> String {
    fixtures::SHAREGPT_JSONL
        .lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let messages: Vec<serde_json::Value> = v["conversations"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| {
                    let role = match m["from"].as_str().unwrap() {
                        "human" => "user",
                        "gpt" => "assistant",
                        other => other,
                    };
                    serde_json::json!({"role": role, "content": m["value"]})
                })
                .collect();
            serde_json::json!({ "messages": messages }).to_string() + "\n"
        })
        .collect()
}

#[test]
fn sharegpt_records_are_chats_in_jsonl_and_in_json_arrays() {
    let fx = fixture();
    let sharegpt = fx.input("sharegpt.jsonl", fixtures::SHAREGPT_JSONL);
    let report = fx.prepare(vec![sharegpt], "sharegpt.tokens");
    assert_eq!(report.docs, 2);
    assert!(report.masked_tokens > 0, "the human turns are masked out of the loss");
    let messages = fx.input("messages.jsonl", &sharegpt_as_messages());
    fx.prepare(vec![messages], "messages.tokens");
    let want = docs(&fx.path("messages.tokens"));
    assert_eq!(docs(&fx.path("sharegpt.tokens")), want, "human → user, gpt → assistant, system → system");

    let array: Vec<serde_json::Value> =
        fixtures::SHAREGPT_JSONL.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let array = fx.input("sharegpt.json", &serde_json::to_string_pretty(&array).unwrap());
    fx.prepare(vec![array], "array.tokens");
    assert_eq!(docs(&fx.path("array.tokens")), want);
}

#[test]
fn an_alpaca_json_array_reads_as_its_jsonl_records() {
    let fx = fixture();
    let array = fx.input("alpaca.json", fixtures::ALPACA_JSON);
    let report = fx.prepare(vec![array], "array.tokens");
    assert_eq!(report.docs, 3);
    let values: Vec<serde_json::Value> = serde_json::from_str(fixtures::ALPACA_JSON).unwrap();
    let lines: String = values.iter().map(|v| v.to_string() + "\n").collect();
    // A .json file of JSONL lines is still read line by line.
    let jsonl = fx.input("alpaca-lines.json", &lines);
    fx.prepare(vec![jsonl], "lines.tokens");
    assert_eq!(docs(&fx.path("array.tokens")), docs(&fx.path("lines.tokens")));
}

#[test]
fn bad_records_name_the_file_and_the_record() {
    let fx = fixture();
    // ShareGPT with a role it does not know, at line 2 of JSONL ...
    let bad = r#"{"conversations": [{"from": "human", "value": "x"}, {"from": "robot", "value": "y"}]}"#;
    let path = fx.input("bad.jsonl", &format!("{}\n{bad}\n", fixtures::SHAREGPT_JSONL.lines().next().unwrap()));
    let e = fx.error(&fx.opts(vec![path.clone()], "out.tokens"));
    let line = format!("{}:2:", path.display());
    for want in [line.as_str(), "conversations[1]", "unknown role `robot`", "human, user → user"] {
        assert!(e.contains(want), "`{want}` in {e}");
    }
    // ... and at index 1 of a JSON array.
    let path = fx.input("bad.json", &format!("[{{\"text\": \"fine\"}}, {bad}]"));
    let e = fx.error(&fx.opts(vec![path.clone()], "out.tokens"));
    assert!(e.contains(&format!("{}[1]:", path.display())) && e.contains("unknown role `robot`"), "{e}");
    // A record of an array with no known key.
    let path = fx.input("keys.json", r#"[{"text": "fine"}, {"text": "fine"}, {"body": "x"}]"#);
    let e = fx.error(&fx.opts(vec![path.clone()], "out.tokens"));
    assert!(e.contains(&format!("{}[2]:", path.display())) && e.contains("`conversations`"), "{e}");
    // An array that is not valid JSON names its line.
    let path = fx.input("broken.json", "[\n{\"text\": \"fine\"},\n{\"text\": }\n]");
    let e = fx.error(&fx.opts(vec![path.clone()], "out.tokens"));
    assert!(e.contains(&format!("{}:3:", path.display())) && e.contains("not a valid JSON array"), "{e}");
}

const TEXTS: [&str; 3] = [
    "The planner reads the whole story before it is told.",
    "A gradient can sleep where an activation once lived.",
    "The graph remembers the story once it has been told.",
];

#[test]
fn a_parquet_string_column_is_a_document_per_row() {
    let fx = fixture();
    let texts: Vec<Option<&str>> = TEXTS.iter().map(|t| Some(*t)).collect();
    let parquet = fx.path("texts.parquet");
    fixtures::write_parquet_texts(&parquet, "text", &texts).unwrap();
    let report = fx.prepare(vec![parquet.clone()], "parquet.tokens");
    assert_eq!(report.docs, 3);
    let jsonl = fx.input("texts.jsonl", fixtures::TEXT_JSONL);
    fx.prepare(vec![jsonl], "jsonl.tokens");
    assert_eq!(docs(&fx.path("parquet.tokens")), docs(&fx.path("jsonl.tokens")));
    let tok = Tokenizer::load(&fx.tokenizer).unwrap();
    let (first, _) = &docs(&fx.path("parquet.tokens"))[0];
    assert_eq!(tok.decode(&first[..first.len() - 1]).unwrap(), TEXTS[0]);

    // The codecs published datasets use.
    for (name, codec) in
        [("zstd.parquet", Compression::ZSTD(Default::default())), ("plain.parquet", Compression::UNCOMPRESSED)]
    {
        let path = fx.path(name);
        fixtures::write_parquet_texts_compressed(&path, "text", &texts, codec).unwrap();
        fx.prepare(vec![path], "codec.tokens");
        assert_eq!(docs(&fx.path("codec.tokens")), docs(&fx.path("jsonl.tokens")), "{name}");
    }

    // Another column name, with --column.
    let content = fx.path("content.parquet");
    fixtures::write_parquet_texts(&content, "content", &texts).unwrap();
    let mut o = fx.opts(vec![content.clone()], "content.tokens");
    o.column = Some("content".into());
    prepare(&o).unwrap();
    assert_eq!(docs(&fx.path("content.tokens")), docs(&fx.path("jsonl.tokens")));
}

#[test]
fn parquet_chat_columns_are_chats() {
    let fx = fixture();
    let owned: Vec<Vec<(String, String)>> = fixtures::SHAREGPT_JSONL
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let turns = v["conversations"].as_array().unwrap().iter();
            turns.map(|m| (m["from"].as_str().unwrap().to_string(), m["value"].as_str().unwrap().to_string())).collect()
        })
        .collect();
    let chats: Vec<Vec<(&str, &str)>> =
        owned.iter().map(|c| c.iter().map(|(f, v)| (f.as_str(), v.as_str())).collect()).collect();
    let want = {
        let messages = fx.input("messages.jsonl", &sharegpt_as_messages());
        fx.prepare(vec![messages], "messages.tokens");
        docs(&fx.path("messages.tokens"))
    };
    let sharegpt = fx.path("sharegpt.parquet");
    fixtures::write_parquet_chats(&sharegpt, "conversations", ("from", "value"), &chats).unwrap();
    fx.prepare(vec![sharegpt], "sharegpt.tokens");
    assert_eq!(docs(&fx.path("sharegpt.tokens")), want);

    let roles: Vec<Vec<(&str, &str)>> = chats
        .iter()
        .map(|c| {
            c.iter()
                .map(|&(from, value)| {
                    let role = match from {
                        "human" => "user",
                        "gpt" => "assistant",
                        other => other,
                    };
                    (role, value)
                })
                .collect()
        })
        .collect();
    let messages = fx.path("messages.parquet");
    fixtures::write_parquet_chats(&messages, "messages", ("role", "content"), &roles).unwrap();
    fx.prepare(vec![messages], "messages-parquet.tokens");
    assert_eq!(docs(&fx.path("messages-parquet.tokens")), want);
}

#[test]
fn parquet_alpaca_columns_read_as_alpaca_records() {
    let fx = fixture();
    let values: Vec<serde_json::Value> = serde_json::from_str(fixtures::ALPACA_JSON).unwrap();
    let column = |key: &str| -> Vec<Option<&str>> { values.iter().map(|v| v[key].as_str()).collect() };
    let path = fx.path("alpaca.parquet");
    let columns = [("instruction", column("instruction")), ("input", column("input")), ("output", column("output"))];
    fixtures::write_parquet_string_columns(&path, &columns).unwrap();
    assert_eq!(fx.prepare(vec![path], "parquet.tokens").docs, 3);
    fx.prepare(vec![fx.input("alpaca.json", fixtures::ALPACA_JSON)], "json.tokens");
    assert_eq!(docs(&fx.path("parquet.tokens")), docs(&fx.path("json.tokens")));
}

#[test]
fn a_parquet_file_is_never_read_as_text() {
    let fx = fixture();
    let texts: Vec<Option<&str>> = TEXTS.iter().map(|t| Some(*t)).collect();
    // Named like a text file: its magic bytes make it Parquet.
    let disguised = fx.path("data.txt");
    fixtures::write_parquet_texts(&disguised, "text", &texts).unwrap();
    assert_eq!(fx.prepare(vec![disguised.clone()], "out.tokens").docs, 3);
    for format in [InputFormat::Text, InputFormat::Jsonl, InputFormat::Json] {
        let mut o = fx.opts(vec![disguised.clone()], "refused.tokens");
        o.format = format;
        let e = fx.error(&o);
        assert!(e.contains("data.txt") && e.contains("Parquet file") && e.contains("--format parquet"), "{e}");
    }
}

#[test]
fn parquet_errors_list_the_columns_and_name_the_row() {
    let fx = fixture();
    let path = fx.path("content.parquet");
    fixtures::write_parquet_texts(&path, "content", &[Some("a"), None, Some("c")]).unwrap();
    // No default column: the file's columns and their types are listed.
    let e = fx.error(&fx.opts(vec![path.clone()], "out.tokens"));
    for want in ["content.parquet", "no column `text`", "content (string), id (int64)", "--column"] {
        assert!(e.contains(want), "`{want}` in {e}");
    }
    // A column name the file does not have.
    let mut o = fx.opts(vec![path.clone()], "out.tokens");
    o.column = Some("body".into());
    let e = fx.error(&o);
    assert!(e.contains("no column `body`") && e.contains("content (string), id (int64)"), "{e}");
    // A column of a type that is not accepted.
    o.column = Some("id".into());
    let e = fx.error(&o);
    assert!(e.contains("column `id` is int64") && e.contains("a string column"), "{e}");
    // A null in the column names its row.
    o.column = Some("content".into());
    let e = fx.error(&o);
    assert!(e.contains("content.parquet row 1: `content` is null"), "{e}");
    // A chat row names its row and its message.
    let chats = fx.path("chats.parquet");
    fixtures::write_parquet_chats(&chats, "messages", ("role", "content"), &[vec![("robot", "x")]]).unwrap();
    let e = fx.error(&fx.opts(vec![chats], "out.tokens"));
    assert!(e.contains("chats.parquet row 0: messages[0]: unknown role `robot`"), "{e}");
}

/// `n` JSONL text records whose words mark where they came from.
fn records(tag: &str, n: usize) -> Vec<String> {
    (0..n)
        .map(|i| match i % 3 {
            0 => format!("{tag} {i}: the planner reads the whole story before it is told."),
            1 => format!("{tag} {i}: a gradient can sleep."),
            _ => format!("{tag} {i}: the graph remembers the story once it has been told, and then it tells it again."),
        })
        .collect()
}

#[test]
fn a_mixture_gives_each_input_its_share_of_the_tokens() {
    let fx = fixture();
    let alpha = records("alpha", 300);
    let beta = records("beta", 400);
    let jsonl: String = alpha.iter().map(|t| serde_json::json!({ "text": t }).to_string() + "\n").collect();
    let a = fx.input("alpha.jsonl", &jsonl);
    let b = fx.path("beta.parquet");
    fixtures::write_parquet_texts(&b, "text", &beta.iter().map(|t| Some(t.as_str())).collect::<Vec<_>>()).unwrap();
    let tok = Tokenizer::load(&fx.tokenizer).unwrap();
    let alpha: HashSet<String> = alpha.into_iter().collect();
    let beta: HashSet<String> = beta.into_iter().collect();

    for (weights, seed) in [([0.7, 0.3], 0), ([0.3, 0.7], 1), ([1.0, 1.0], 2), ([7.0, 3.0], 0)] {
        let mut o = fx.opts(vec![a.clone(), b.clone()], "mix.tokens");
        o.weights = weights.to_vec();
        o.seed = seed;
        o.holdout = Holdout::Docs(5);
        let report = prepare(&o).unwrap();
        // The token file itself, each document traced back to its input.
        let (mut from_a, mut from_b, mut docs_a) = (0u64, 0u64, 0u64);
        let mut seen = HashSet::new();
        for (ids, _) in docs(&o.out) {
            let text = tok.decode(&ids[..ids.len() - 1]).unwrap();
            assert!(seen.insert(text.clone()), "no document twice: {text}");
            if alpha.contains(&text) {
                from_a += ids.len() as u64;
                docs_a += 1;
            } else {
                assert!(beta.contains(&text), "{text}");
                from_b += ids.len() as u64;
            }
        }
        let total = (from_a + from_b) as f64;
        let asked = weights[0] / (weights[0] + weights[1]);
        let got = from_a as f64 / total;
        assert!((got - asked).abs() <= 0.02, "weights {weights:?}: {got:.4} of the tokens from the first input");
        assert_eq!(report.tokens, from_a + from_b);
        assert_eq!((report.inputs[0].tokens, report.inputs[0].docs), (from_a, docs_a));
        assert_eq!(report.inputs[1].tokens, from_b);
        assert_eq!(report.inputs[0].asked_share, Some(asked));
        // One input is used whole: the one that runs out first.
        assert!(report.inputs.iter().any(|i| i.docs == i.docs_read), "{report:?}");
        let printed = report.to_string();
        assert!(printed.contains(&format!("{}: {from_a} tokens", a.display())), "{printed}");
        assert!(printed.contains(&format!("asked {:.1}%", asked * 100.0)), "{printed}");
    }
    // The same seed draws the same file; weights are normalised.
    let mut o = fx.opts(vec![a.clone(), b.clone()], "again.tokens");
    o.weights = vec![0.7, 0.3];
    o.holdout = Holdout::Docs(5);
    prepare(&o).unwrap();
    assert_eq!(std::fs::read(&o.out).unwrap(), std::fs::read(fx.path("mix.tokens")).unwrap());
}

#[test]
fn mixture_weights_must_be_positive_finite_and_one_per_input() {
    let fx = fixture();
    let a = fx.input("a.jsonl", fixtures::TEXT_JSONL);
    let b = fx.input("b.txt", "one paragraph\n\nanother\n");
    for bad in [0.0, -0.5, f64::INFINITY, f64::NAN] {
        let mut o = fx.opts(vec![a.clone(), b.clone()], "out.tokens");
        o.weights = vec![1.0, bad];
        let e = fx.error(&o);
        assert!(e.contains("b.txt") && e.contains("must be positive and finite"), "{bad}: {e}");
    }
    let mut o = fx.opts(vec![a.clone(), b.clone()], "out.tokens");
    o.weights = vec![1.0];
    assert!(fx.error(&o).contains("1 mixture weights for 2 inputs"));
    let empty = fx.input("empty.txt", "\n\n");
    let mut o = fx.opts(vec![a, empty], "out.tokens");
    o.weights = vec![1.0, 1.0];
    assert!(fx.error(&o).contains("empty.txt holds no documents"));
}

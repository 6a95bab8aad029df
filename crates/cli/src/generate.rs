//! `stepgraph generate`: text from a model, on the CPU or one GPU.
//!
//! The model is a Hugging Face folder (`--init-from`, with its tokenizer
//! and chat template) or a named model with seeded random weights (for
//! benchmarks: `--random-prompts`). Prompts come from `--prompt` or a JSONL
//! file (`--prompts`, one `{"prompt": …}`, `{"text": …}` or
//! `{"messages": [...]}` per line); `--chat` renders a `--prompt` as a user
//! turn through the chat template. Every prompt is tokenized and checked
//! first; the generation program ([`stepgraph_core::models::generate`]) is
//! then built for exactly these prompts: its prefill as long as the longest
//! prompt, its cache as long as that plus `--max-new-tokens`, its decode
//! buckets the ladder 1, 2, 4, … up to the smallest that holds every
//! prompt (at most 64; `--buckets` sets them). The plan must fit the
//! device before anything is allocated; if it does not, the error says how
//! many cache positions would.
//!
//! One prompt streams its text to stdout as the tokens come; several (or
//! `--json`) print one JSON line per prompt, with a progress bar over the
//! new tokens on a terminal. A summary goes to stderr: time
//! to first token, decode time per step, tokens per second, and the plan
//! (weights, cache, working set, each captured bucket's graph).

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

use stepgraph_core::generation::{check_requests, BatchTimes, Finish, Generated, Generator, Request, Sampling};
use stepgraph_core::ir::ValueKind;
use stepgraph_core::models::generate::{
    build_generation, FusedWriter, GenerationProgram, GenerationSpec, DEFAULT_BUCKETS,
};
use stepgraph_core::models::hf_dir::{HfModelDir, GENERATION_FILE};
use stepgraph_core::models::lora::AdapterMerge;
use stepgraph_core::models::peft::{read_adapter_config, read_adapter_weights};
use stepgraph_core::plan::{check_plan, plan, PlanOptions};
use stepgraph_core::session::Session;
use stepgraph_cuda::CudaError;
use stepgraph_data::template::Message;
use stepgraph_data::tokenizer::{StreamDecoder, Tokenizer};

use stepgraph_train::export::{is_checkpoint, model_folders};
use stepgraph_train::trainer::init_weights;
use stepgraph_train::{open_session, Backend, SessionOptions};

use crate::train;
use crate::ModelArgs;

/// `stepgraph generate`'s own flags (the model and dtype flags are shared).
#[derive(Args, Clone, Debug)]
pub struct GenerateArgs {
    /// A Hugging Face model folder: config.json, safetensors weights, and its tokenizer files; or a
    /// checkpoint a run saved (`DIR/step-000050`, with --tokenizer for text prompts).
    #[arg(long, value_name = "DIR", conflicts_with_all = ["model", "config"])]
    pub init_from: Option<PathBuf>,
    /// A PEFT adapter folder (adapter_config.json, adapter_model.safetensors), or a checkpoint of a
    /// run of adapters, over the --init-from base: its adapters are merged into the base's weights
    /// as they load.
    #[arg(long, value_name = "DIR", requires = "init_from")]
    pub adapter: Option<PathBuf>,
    /// The tokenizer (a tokenizer.json or its folder) [default: the --init-from folder].
    #[arg(long, value_name = "PATH")]
    pub tokenizer: Option<PathBuf>,
    /// The text to continue.
    #[arg(long, conflicts_with_all = ["prompts", "random_prompts"])]
    pub prompt: Option<String>,
    /// A JSONL file of prompts: {"prompt": "..."}, {"text": "..."} or {"messages": [{"role", "content"}, ...]} per line.
    #[arg(long, value_name = "FILE", conflicts_with = "random_prompts")]
    pub prompts: Option<PathBuf>,
    /// Render --prompt as a user message through the tokenizer's chat template (JSONL `messages` always are).
    #[arg(long)]
    pub chat: bool,
    /// N prompts of random token ids (--prompt-tokens long): a benchmark, no tokenizer needed.
    #[arg(long, value_name = "N")]
    pub random_prompts: Option<usize>,
    /// With --random-prompts: tokens per prompt.
    #[arg(long, default_value_t = 512, requires = "random_prompts")]
    pub prompt_tokens: usize,
    /// New tokens per prompt, at most.
    #[arg(long, default_value_t = 128)]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 is greedy (the most likely token every time).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Sample among the K most likely tokens only (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    /// Sample among the most likely tokens holding P of the probability (1: all).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Seed of the sampling noise (prompt i uses seed + i) and of random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop a sequence when its text contains this string (repeatable); the text ends before it.
    #[arg(long, value_name = "TEXT")]
    pub stop: Vec<String>,
    /// Keep generating past the end-of-sequence token (benchmarks).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Decode batch sizes, one CUDA graph each, comma-separated [default: 1, 2, 4, … up to the prompt count, at most 64].
    #[arg(long, value_delimiter = ',')]
    pub buckets: Option<Vec<usize>>,
    /// Generate on the CPU or on one GPU [default: cuda when this machine has an NVIDIA GPU].
    #[arg(long, value_enum)]
    pub device: Option<Backend>,
    /// Run every decode step eagerly instead of replaying its recording.
    #[arg(long)]
    pub eager: bool,
    /// Print one JSON line per prompt, and a summary line, on stdout.
    #[arg(long)]
    pub json: bool,
    /// After generating, time every kernel of one decode step of the largest bucket used (on a GPU) and print
    /// the slowest to stderr.
    #[arg(long)]
    pub profile: bool,
}

/// A prompt as given and as tokens.
struct Prompt {
    text: Option<String>,
    ids: Vec<u32>,
}

fn load_tokenizer(args: &GenerateArgs) -> Result<Option<Tokenizer>> {
    // Random prompts need no tokenizer: a model folder without one is fine.
    let folder =
        args.init_from.as_ref().filter(|d| args.random_prompts.is_none() || d.join("tokenizer.json").is_file());
    let path = args.tokenizer.as_ref().or(folder);
    match path {
        Some(p) => Ok(Some(Tokenizer::load(p).with_context(|| format!("loading the tokenizer of {}", p.display()))?)),
        None => Ok(None),
    }
}

/// The tokens that end a sequence: the tokenizer's end-of-sequence token and
/// every `eos_token_id` of the model folder's `generation_config.json`, as
/// `transformers`' `generate` reads them (a chat model lists its
/// end-of-turn token there, e.g. `<|im_end|>` next to `<|endoftext|>`).
fn stop_tokens(tok: Option<&Tokenizer>, model_dir: Option<&Path>) -> Result<Vec<u32>> {
    let mut stops: Vec<u32> = tok.map(|t| t.eos_id).into_iter().collect();
    let Some(path) = model_dir.map(|d| d.join(GENERATION_FILE)).filter(|p| p.is_file()) else {
        return Ok(stops);
    };
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let config: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))?;
    let listed = match config.get("eos_token_id") {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(serde_json::Value::Array(ids)) => ids.iter().collect(),
        Some(one) => vec![one],
    };
    for id in listed {
        let id = id.as_u64().and_then(|v| u32::try_from(v).ok()).with_context(|| {
            format!("{}: eos_token_id holds {id}, which is not a token id (a non-negative integer)", path.display())
        })?;
        if !stops.contains(&id) {
            stops.push(id);
        }
    }
    Ok(stops)
}

fn render_chat(tok: &Tokenizer, messages: &[Message], what: &str) -> Result<String> {
    let template = tok.chat_template.as_ref().with_context(|| {
        format!(
            "{what} asks for the chat template, but {} has none (no chat_template in tokenizer_config.json, no \
             chat_template.jinja)",
            tok.path.display()
        )
    })?;
    let bos = tok.bos_token.clone().unwrap_or_default();
    template
        .render(messages, true, &bos, &tok.eos_token)
        .map_err(|e| anyhow::anyhow!("{what}: the chat template of {} failed: {e}", template.path().display()))
}

fn encode(tok: &Tokenizer, text: &str, what: &str) -> Result<Vec<u32>> {
    Ok(tok.encode(text, true).map_err(|e| anyhow::anyhow!("{what}: {e}"))?.ids)
}

/// The prompts of the run, tokenized.
fn read_prompts(args: &GenerateArgs, tok: Option<&Tokenizer>, vocab: usize) -> Result<Vec<Prompt>> {
    if let Some(n) = args.random_prompts {
        if n == 0 || args.prompt_tokens == 0 {
            bail!(
                "--random-prompts {n} --prompt-tokens {}: ask for at least one prompt of one token",
                args.prompt_tokens
            );
        }
        // splitmix64 per (prompt, position): reproducible from --seed.
        let ids = |i: usize| {
            (0..args.prompt_tokens)
                .map(|t| {
                    let h = stepgraph_core::ops::decode::splitmix64(args.seed ^ ((i as u64) << 32 | t as u64));
                    (h % vocab as u64) as u32
                })
                .collect()
        };
        return Ok((0..n).map(|i| Prompt { text: None, ids: ids(i) }).collect());
    }
    let need_tok = || {
        tok.context("a text prompt needs a tokenizer: --init-from a folder with tokenizer.json, or --tokenizer PATH")
    };
    if let Some(p) = &args.prompt {
        let tok = need_tok()?;
        let text = if args.chat {
            render_chat(tok, &[Message { role: "user".into(), content: p.clone() }], "--chat")?
        } else {
            p.clone()
        };
        return Ok(vec![Prompt { ids: encode(tok, &text, "--prompt")?, text: Some(text) }]);
    }
    let Some(file) = &args.prompts else {
        bail!("nothing to continue: give --prompt TEXT, --prompts FILE.jsonl or --random-prompts N");
    };
    let tok = need_tok()?;
    let body = std::fs::read_to_string(file).with_context(|| format!("reading --prompts {}", file.display()))?;
    let mut out = Vec::new();
    for (n, line) in body.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = format!("{} line {}", file.display(), n + 1);
        let v: serde_json::Value = serde_json::from_str(line).with_context(|| format!("{at}: not JSON"))?;
        let text = if let Some(m) = v.get("messages") {
            let messages: Vec<Message> = serde_json::from_value(m.clone())
                .with_context(|| format!("{at}: \"messages\" must be a list of {{\"role\", \"content\"}}"))?;
            render_chat(tok, &messages, &at)?
        } else if let Some(t) = v.get("prompt").or_else(|| v.get("text")).and_then(|t| t.as_str()) {
            if args.chat {
                render_chat(tok, &[Message { role: "user".into(), content: t.into() }], &at)?
            } else {
                t.to_string()
            }
        } else {
            bail!("{at}: expected {{\"prompt\": \"...\"}}, {{\"text\": \"...\"}} or {{\"messages\": [...]}}");
        };
        out.push(Prompt { ids: encode(tok, &text, &at)?, text: Some(text) });
    }
    if out.is_empty() {
        bail!("--prompts {} holds no prompt", file.display());
    }
    Ok(out)
}

/// The default buckets: the ladder up to the smallest rung that holds `n` prompts.
fn default_buckets(n: usize) -> Vec<usize> {
    let top = DEFAULT_BUCKETS.iter().copied().find(|&b| b >= n).unwrap_or(*DEFAULT_BUCKETS.last().unwrap());
    DEFAULT_BUCKETS.iter().copied().filter(|&b| b <= top).collect()
}

fn gb(b: u64) -> f64 {
    b as f64 / 1e9
}

/// The adapters of the folder `dir` for the base `hf`, to merge as the base loads.
/// The adapters of the folder `dir` (given as `shown`) as merged into `hf`'s weights.
fn adapter_merge(dir: &std::path::Path, shown: &std::path::Path, hf: &HfModelDir) -> Result<AdapterMerge> {
    let context = || format!("--adapter {}", shown.display());
    let (adapters, _) = read_adapter_config(dir).with_context(context)?;
    let tensors = read_adapter_weights(dir, hf.family(), &adapters).with_context(context)?;
    AdapterMerge::new(&adapters, &tensors).with_context(context)
}

pub fn run(model: &ModelArgs, args: &GenerateArgs) -> Result<()> {
    let switches = stepgraph_cuda::Switches::from_env()?;
    let backend = Backend::or_default(args.device);
    let model = &model.on_gpu(backend == Backend::Cuda);
    // Checkpoints are read through folders written from them; messages
    // name what was given.
    let given = args;
    if let Some(dir) = args.init_from.as_ref().filter(|d| is_checkpoint(d)) {
        if args.tokenizer.is_none() && args.random_prompts.is_none() {
            bail!(
                "--init-from {}: a checkpoint holds no tokenizer: give --tokenizer DIR (the folder the run \
                 started from) for text prompts, or --random-prompts N",
                dir.display()
            );
        }
    }
    let folders = match &args.init_from {
        Some(dir) => Some(model_folders(dir, args.adapter.as_deref(), args.tokenizer.as_deref())?),
        None => None,
    };
    for note in folders.iter().flat_map(|f| &f.notes) {
        eprintln!("{note}");
    }
    let args = &GenerateArgs {
        init_from: folders.as_ref().map(|f| f.init_from.clone()).or_else(|| args.init_from.clone()),
        adapter: folders.as_ref().and_then(|f| f.adapter.clone()),
        ..args.clone()
    };
    let (spec, hf) = train::model_spec(model, args.init_from.as_deref())?;
    let cfg = spec.config.clone();
    let tok = load_tokenizer(args)?;
    let prompts = read_prompts(args, tok.as_ref(), cfg.padded_vocab_size)?;
    if args.max_new_tokens == 0 {
        bail!("--max-new-tokens 0 generates nothing: ask for at least 1");
    }
    let sampling = Sampling { temperature: args.temperature, top_k: args.top_k, top_p: args.top_p, seed: args.seed };
    sampling.check().map_err(|e| anyhow::anyhow!("{e} (--temperature, --top-k, --top-p)"))?;
    // The rest of each request is checked against the program
    // (`check_requests`) once it is built, before anything is allocated.
    for (i, p) in prompts.iter().enumerate() {
        if p.ids.len() >= cfg.block_size {
            bail!(
                "prompt {i} has {} tokens, but the model's context is {} tokens and a new token needs a position",
                p.ids.len(),
                cfg.block_size
            );
        }
    }
    let longest = prompts.iter().map(|p| p.ids.len()).max().expect("at least one prompt");
    // Checked: `--max-new-tokens` may be any usize, and a wrapped sum
    // would build a context of a few positions.
    let wanted = longest.checked_add(args.max_new_tokens).filter(|&n| n <= cfg.block_size);
    let context = wanted.unwrap_or(cfg.block_size);
    if wanted.is_none() {
        eprintln!(
            "note: {} new tokens after the longest prompt ({longest} tokens) pass the model's context of {}; \
             at most {} new tokens each",
            args.max_new_tokens,
            cfg.block_size,
            cfg.block_size - longest
        );
    }
    let buckets = match &args.buckets {
        Some(b) => {
            let mut b = b.clone();
            b.sort_unstable();
            b.dedup();
            b
        }
        None => default_buckets(prompts.len()),
    };
    // At least one prefill token, so that an empty prompt is refused by
    // `check_requests` as the empty request it is.
    let mut prompt_len = longest.max(1);
    // A LongRoPE model recomputes a sequence that reaches its original
    // context with one prefill of that length plus one.
    if let Some(long) = cfg.long_rope() {
        let original = long.original_max_position_embeddings;
        if longest <= original && context > original + 1 {
            prompt_len = prompt_len.max(original + 1);
        }
    }
    let context = context.max(prompt_len + 1);
    let gspec = GenerationSpec { config: cfg.clone(), dtype: spec.dtype, buckets, context, prompt_len, logits: false };
    let built = Instant::now();
    let program = build_generation(&gspec)?;
    let memory_plan = plan(&program.trace, PlanOptions::default())?;
    check_plan(&program.trace, &memory_plan)?;
    let weights_bytes = program.trace.leaf_bytes(|k| matches!(k, ValueKind::Param { .. }));
    let cache_bytes = program.cache_bytes();
    eprintln!(
        "generation plan: weights {:.3} GB, KV cache {:.3} GB ({} sequences x {} positions), working set {:.3} GB, \
         total {:.3} GB; buckets {:?}; built in {:.2} s",
        gb(weights_bytes),
        gb(cache_bytes),
        program.max_batch(),
        context,
        gb(memory_plan.arena_bytes),
        gb(memory_plan.planned_peak_bytes()),
        program.spec.buckets,
        built.elapsed().as_secs_f64()
    );
    if let Ok(step) = stepgraph_cuda::lower::step_launches(&program.trace, &memory_plan, "sm_90", &switches) {
        eprintln!("{}", launch_line(&program, &step));
    }
    let stops = if args.ignore_eos { Vec::new() } else { stop_tokens(tok.as_ref(), args.init_from.as_deref())? };
    let requests: Vec<Request> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| Request {
            prompt: p.ids.clone(),
            max_new_tokens: args.max_new_tokens.min(context.saturating_sub(p.ids.len())),
            sampling: Sampling { seed: args.seed.wrapping_add(i as u64), ..sampling },
            stop_tokens: stops.clone(),
        })
        .collect();
    check_requests(&program, &requests)?;
    // The parameters as the folder names them (the fused projections' parts).
    let checkpoint = program.checkpoint_params()?;
    if let Some(hf) = &hf {
        hf.check(&checkpoint)?;
    }
    let planned = memory_plan.planned_peak_bytes();
    // What cuBLASLt's tuning chose, for `--profile`.
    let opened = open_session(backend, program.trace.clone(), memory_plan, SessionOptions::on_device(0, switches));
    let (mut session, tuning) = match opened {
        Ok(o) => (o.session, o.gemm_tuning),
        Err(e) => match e.downcast_ref::<CudaError>() {
            Some(&CudaError::DoesNotFit { needed, free, .. }) => return Err(does_not_fit(&program, needed, free)),
            _ => return Err(e),
        },
    };
    match hf.as_ref() {
        // The folder's tensors, q/k/v and gate/up rows gathered into the
        // generation's fused projection weights.
        Some(hf) => {
            let merge = match (&args.adapter, &given.adapter) {
                (Some(dir), Some(shown)) => Some(adapter_merge(dir, shown, hf)?),
                _ => None,
            };
            let mut writer = FusedWriter::new(&program);
            hf.load_into_with(
                &checkpoint,
                &mut |name, t| match merge.as_ref().map(|m| m.merge(name, t)).transpose()? {
                    Some(Some(merged)) => writer.write(session.as_mut(), name, &merged),
                    _ => writer.write(session.as_mut(), name, t),
                },
            )
            .with_context(|| {
                format!(
                    "loading the weights of --init-from {}",
                    given.init_from.as_deref().unwrap_or(hf.dir()).display()
                )
            })?;
            writer.finish()?;
        }
        None => init_weights(session.as_mut(), &program.trace, None, args.seed)?,
    }
    // The cache and the decode states start from zeros (the padding a
    // prompt leaves is never read; zeros keep a dump readable).
    session.zero_state()?;

    let stream = prompts.len() == 1 && !args.json;
    // Several prompts on a terminal: a progress bar over the new tokens
    // asked for (sequences that stop early leave it short of the end).
    let bar = if !stream && std::io::stderr().is_terminal() {
        ProgressBar::new(requests.iter().map(|r| r.max_new_tokens as u64).sum())
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} tokens ({per_sec}) ETA {eta}")
            .expect("valid template"),
    );
    // Each sequence's text grows a few tokens at a time (no re-decoding of
    // the whole output per token); `cuts[i]` is where a stop string ended it.
    let mut decoders = vec![StreamDecoder::new(); prompts.len()];
    let mut cuts: Vec<Option<usize>> = vec![None; prompts.len()];
    let longest_stop = args.stop.iter().map(String::len).max().unwrap_or(0);
    let mut printed = 0usize;
    let stdout = std::io::stdout();
    let start = Instant::now();
    let (out, times) = {
        let mut gen = Generator::new(session.as_mut(), &program);
        gen.replay = !args.eager;
        let mut on_token = |i: usize, t: u32| -> bool {
            bar.inc(1);
            let Some(tok) = tok.as_ref() else { return false };
            if stops.contains(&t) {
                return false;
            }
            let Ok(grew_at) = decoders[i].push(tok, t) else { return false };
            let text = decoders[i].text();
            // A stop string that ends in the new text starts at most
            // `longest_stop − 1` bytes before it.
            let mut from = grew_at.saturating_sub(longest_stop.saturating_sub(1));
            while !text.is_char_boundary(from) {
                from -= 1;
            }
            cuts[i] = args.stop.iter().filter_map(|s| text[from..].find(s.as_str())).min().map(|at| from + at);
            if stream {
                // The decoder's text is final: print it, up to a stop string.
                let end = cuts[i].unwrap_or(text.len());
                if end > printed {
                    let mut lock = stdout.lock();
                    let _ = lock.write_all(&text.as_bytes()[printed..end]);
                    let _ = lock.flush();
                    printed = end;
                }
            }
            cuts[i].is_some()
        };
        gen.generate(&requests, &mut on_token)?
    };
    let wall = start.elapsed();
    bar.finish_and_clear();
    // What is still pending (an incomplete last character) joins the text
    // of sequences that no stop string ended.
    let mut texts = Vec::with_capacity(prompts.len());
    for (dec, cut) in decoders.iter_mut().zip(&cuts) {
        texts.push(match (cut, tok.as_ref()) {
            (Some(at), _) => dec.text()[..*at].to_string(),
            (None, Some(tok)) => {
                dec.finish(tok).map_err(|e| anyhow::anyhow!("decoding the generated tokens: {e}"))?.to_string()
            }
            (None, None) => String::new(),
        });
    }
    if stream {
        let rest = texts[0].get(printed..).unwrap_or_default();
        println!("{rest}");
    }
    let mem = session.memory()?;
    if args.profile {
        if let Some(bucket) = times.iter().map(|t| t.bucket).max() {
            let nodes = program.decode(bucket).expect("a bucket that ran").nodes.clone();
            let rows = session.profile_nodes(nodes)?;
            crate::profile::print(&format!("profile of one eager decode step of bucket {bucket}"), &rows, 15);
        }
        if let Some(t) = &tuning {
            crate::profile::print_tuning(t);
        }
    }
    report(args, &program, &prompts, &out, &texts, &times, wall.as_secs_f64(), planned, mem, session.as_ref())?;
    Ok(())
}

/// `launches on an sm_90 GPU: prefill 265, decode step 264 (bucket 1), ...`:
/// what each segment of the program is on a Hopper GPU, lowered without one.
fn launch_line(program: &GenerationProgram, step: &stepgraph_cuda::launch::LaunchList) -> String {
    let count = |nodes: &std::ops::Range<usize>| step.of_nodes(nodes.clone()).len();
    let decode: Vec<String> = (program.spec.buckets.iter())
        .filter_map(|&b| program.decode(b).map(|s| format!("{} (bucket {b})", count(&s.nodes))))
        .collect();
    format!("launches on an sm_90 GPU: prefill {}, decode step {}", count(&program.prefill().nodes), decode.join(", "))
}

/// The session's refusal of a plan larger than the GPU's free memory
/// (`needed`: the plan and cuBLASLt's workspace), said in cache positions:
/// how many per sequence would fit next to the weights and working set.
fn does_not_fit(program: &GenerationProgram, needed: u64, free: u64) -> anyhow::Error {
    let cache_bytes = program.cache_bytes();
    // Sliding-window layers keep rings of their window whatever the
    // context; only the other layers' caches grow with it.
    let (rings, per_position) = program.cache_growth();
    let other = needed.saturating_sub(cache_bytes);
    let cache = match free.saturating_sub(other + rings).checked_div(per_position) {
        Some(fit) => format!(
            "the cache fits {fit} positions per sequence for {} sequences (this run asks for {})",
            program.max_batch(),
            program.spec.context
        ),
        None => format!(
            "the cache ({:.2} GB, every layer a ring of its sliding window) does not grow with the context",
            gb(rings)
        ),
    };
    anyhow::anyhow!(
        "the generation plan needs {:.2} GB but GPU 0 has {:.2} GB free: the weights and working set take {:.2} GB, \
         and {cache}; use fewer or shorter prompts, fewer --max-new-tokens or smaller --buckets",
        gb(needed),
        gb(free),
        gb(other),
    )
}

#[allow(clippy::too_many_arguments)]
fn report(
    args: &GenerateArgs,
    program: &GenerationProgram,
    prompts: &[Prompt],
    out: &[Generated],
    texts: &[String],
    times: &[BatchTimes],
    wall_s: f64,
    planned: u64,
    mem: stepgraph_core::session::SessionMemory,
    session: &dyn Session,
) -> Result<()> {
    let new_tokens: usize = out.iter().map(|g| g.tokens.len()).sum();
    let first = times.first().cloned().unwrap_or_default();
    let ttft_ms = first.prefill.as_secs_f64() * 1e3;
    let steps: usize = times.iter().map(|t| t.decode_steps).sum();
    let decode_s: f64 = times.iter().map(|t| t.decode.as_secs_f64()).sum();
    // The first step of a bucket runs eagerly and the second records it:
    // the per-step time is over the replays after those (every step when
    // there are none), each with the host's read of its tokens.
    let replayed: usize = times.iter().map(|t| t.replayed_steps).sum();
    let replayed_s: f64 = times.iter().map(|t| t.replayed.as_secs_f64()).sum();
    let step_ms = if replayed > 0 {
        replayed_s * 1e3 / replayed as f64
    } else if steps > 0 {
        decode_s * 1e3 / steps as f64
    } else {
        0.0
    };
    let graphs: Vec<(usize, Option<u64>)> = program
        .spec
        .buckets
        .iter()
        .map(|&b| (b, program.decode(b).and_then(|s| session.segment_graph_bytes(s.nodes.clone()))))
        .collect();
    let graph_total: u64 = graphs.iter().filter_map(|g| g.1).sum();
    if args.json {
        for (i, (p, g)) in prompts.iter().zip(out).enumerate() {
            let finish = match g.finish {
                Finish::Stop => "eos",
                Finish::Caller => "stop",
                Finish::Length => "length",
            };
            println!(
                "{}",
                json!({"index": i, "prompt": p.text, "prompt_tokens": p.ids.len(), "prompt_ids": p.ids, "text": texts[i],
                       "tokens": g.tokens, "finish": finish})
            );
        }
    } else if prompts.len() > 1 {
        for (i, t) in texts.iter().enumerate() {
            println!("{}", json!({"index": i, "text": t, "tokens": out[i].tokens.len()}));
        }
    }
    let summary = json!({
        "prompts": prompts.len(), "new_tokens": new_tokens, "wall_s": wall_s,
        "time_to_first_token_ms": ttft_ms, "decode_steps": steps, "decode_ms_per_step": step_ms,
        "tokens_per_s": new_tokens as f64 / wall_s.max(1e-9), "buckets": program.spec.buckets,
        "batches": times.iter().map(|t| json!({"bucket": t.bucket, "prefill_ms": t.prefill.as_secs_f64() * 1e3,
            "decode_steps": t.decode_steps, "decode_ms": t.decode.as_secs_f64() * 1e3,
            "replayed_steps": t.replayed_steps, "replayed_ms": t.replayed.as_secs_f64() * 1e3,
            "record_ms": t.record.as_secs_f64() * 1e3})).collect::<Vec<_>>(),
        "planned_bytes": planned, "held_bytes": mem.held_bytes, "measured": mem.measured,
        "cache_bytes": program.cache_bytes(),
        "graph_bytes": graphs.iter().map(|(b, g)| json!({"bucket": b, "bytes": g})).collect::<Vec<_>>(),
    });
    if args.json {
        println!("{}", json!({ "summary": summary }));
    }
    eprintln!(
        "generated {new_tokens} tokens for {} prompt{} in {wall_s:.2} s: time to first token {ttft_ms:.1} ms, \
         decode {step_ms:.2} ms/step over {steps} steps, {:.1} tokens/s",
        prompts.len(),
        if prompts.len() == 1 { "" } else { "s" },
        new_tokens as f64 / wall_s.max(1e-9)
    );
    if mem.measured {
        eprintln!(
            "device peak {:.1} MB for a {:.1} MB plan; captured graphs {:.1} MB ({})",
            mem.held_bytes as f64 / 1e6,
            planned as f64 / 1e6,
            graph_total as f64 / 1e6,
            graphs
                .iter()
                .filter_map(|(b, g)| g.map(|g| format!("bucket {b}: {:.2} MB", g as f64 / 1e6)))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `eos_token_id` as `transformers` writes it: one id, a list, or null;
    /// anything else is refused naming the file.
    #[test]
    fn stop_tokens_come_from_the_generation_config() {
        let d = tempfile::tempdir().unwrap();
        let write = |text: &str| std::fs::write(d.path().join(GENERATION_FILE), text).unwrap();
        assert_eq!(stop_tokens(None, Some(d.path())).unwrap(), Vec::<u32>::new());
        write(r#"{"eos_token_id": 7}"#);
        assert_eq!(stop_tokens(None, Some(d.path())).unwrap(), [7]);
        write(r#"{"eos_token_id": [2, 0, 2]}"#);
        assert_eq!(stop_tokens(None, Some(d.path())).unwrap(), [2, 0]);
        write(r#"{"eos_token_id": null, "bos_token_id": 1}"#);
        assert_eq!(stop_tokens(None, Some(d.path())).unwrap(), Vec::<u32>::new());
        write(r#"{"eos_token_id": [-1]}"#);
        let e = stop_tokens(None, Some(d.path())).unwrap_err().to_string();
        assert!(e.contains("generation_config.json: eos_token_id holds -1"), "{e}");
        write("{");
        let e = format!("{:#}", stop_tokens(None, Some(d.path())).unwrap_err());
        assert!(e.contains("is not valid JSON"), "{e}");
    }

    /// The refusal of a plan too large for the GPU counts the sliding
    /// layers' rings as fixed bytes and only the other layers' caches per
    /// position; with every layer a ring, the cache does not grow at all.
    #[test]
    fn a_refused_plan_counts_ring_caches_as_fixed() {
        use stepgraph_core::ir::DType;
        use stepgraph_core::models::config::SlidingLayers;
        use stepgraph_core::models::Config;
        let program = |sliding_layers| {
            let config = Config { sliding_window: Some(8), sliding_layers, ..Config::named("tiny-llama").unwrap() };
            let spec = GenerationSpec {
                config,
                dtype: DType::F32,
                buckets: vec![1, 2],
                context: 64,
                prompt_len: 12,
                logits: false,
            };
            build_generation(&spec).unwrap()
        };
        // Every other layer slides: the rings and the global layers' caches.
        let p = program(SlidingLayers::GlobalEvery(2));
        let (rings, per_position) = p.cache_growth();
        assert!(rings > 0 && per_position > 0);
        let other = 1_000_000;
        let needed = other + p.cache_bytes();
        let free = other + rings + 40 * per_position + per_position / 2;
        let e = does_not_fit(&p, needed, free).to_string();
        assert!(e.contains("the cache fits 40 positions per sequence for 2 sequences (this run asks for 64)"), "{e}");
        // Every layer slides: nothing grows with the context.
        let p = program(SlidingLayers::All);
        let (rings, per_position) = p.cache_growth();
        assert_eq!((rings, per_position), (p.cache_bytes(), 0));
        let e = does_not_fit(&p, other + rings, other).to_string();
        assert!(e.contains("every layer a ring of its sliding window) does not grow with the context"), "{e}");
    }
}

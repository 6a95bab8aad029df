//! Running a generation program ([`crate::models::generate`]) on any
//! backend: prompts in, tokens out.
//!
//! A [`Generator`] drives one session of the program's trace. A batch of
//! requests (at most the largest bucket) is prefilled one prompt at a
//! time, each into its own cache row, which samples its first new token;
//! the decode segment of the smallest bucket that holds the batch then
//! runs once eagerly and afterwards from its recording (a CUDA graph on
//! the GPU), one new token per sequence per replay. Between replays the
//! host only reads the tokens (to stream them and to see stops): the step
//! itself advances every sequence's token and position in device memory.
//! Rows of the bucket beyond the batch decode a dummy sequence that is
//! never read. A finished sequence keeps decoding with the others until
//! the whole batch is done (its tokens are dropped).
//!
//! Every request is checked before anything runs: a prompt must be
//! non-empty, fit the prefill, and leave room in its cache row for the new
//! tokens (the error says how many fit).

use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::host::HostTensor;
use crate::ir::{DType, TensorType, ValueId};
use crate::models::generate::GenerationProgram;
use crate::session::Session;

/// How a request's tokens are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// 0 (or less) is greedy: the most likely token every time.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0: all).
    pub top_k: u32,
    /// Keep the most likely tokens holding `top_p` of the probability (1: all).
    pub top_p: f32,
    /// The noise's seed: the same seed, prompt and settings give the same tokens.
    pub seed: u64,
}

impl Sampling {
    pub const GREEDY: Sampling = Sampling { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0 };

    /// Why these settings cannot sample, if they cannot.
    pub fn check(&self) -> std::result::Result<(), String> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(format!("temperature must be 0 (greedy) or positive, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top-p must be in (0, 1], got {}", self.top_p));
        }
        if self.top_k > (1 << 24) {
            return Err(format!("top-k must be at most 2^24, got {}", self.top_k));
        }
        Ok(())
    }

    /// The row of a `sampling` input: `(temperature, top_k, top_p)`.
    fn row(&self) -> [f64; 3] {
        [self.temperature as f64, self.top_k as f64, self.top_p as f64]
    }
}

/// One prompt to continue.
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: Sampling,
    /// Tokens that end the sequence (kept in the output): end of text.
    pub stop_tokens: Vec<u32>,
}

/// Why a sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Finish {
    /// It drew one of its stop tokens.
    Stop,
    /// The caller stopped it (a stop string).
    Caller,
    /// It reached its `max_new_tokens`.
    Length,
}

/// One request's result.
#[derive(Clone, Debug, PartialEq)]
pub struct Generated {
    pub tokens: Vec<u32>,
    pub finish: Finish,
}

/// Times of one batch.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BatchTimes {
    /// From the start until every prompt is prefilled (the batch's first tokens).
    pub prefill: Duration,
    /// The decode steps, each one new token for every sequence of the bucket.
    pub decode_steps: usize,
    pub decode: Duration,
    /// The bucket the batch ran in.
    pub bucket: usize,
    /// Recording the decode step for replay (0 when recorded before).
    pub record: Duration,
    /// Of the decode steps, those replayed from an existing recording
    /// (neither the bucket's first, eager, step nor the one that records):
    /// the steady state, each timed from its launch to its tokens read back.
    pub replayed_steps: usize,
    pub replayed: Duration,
}

/// Runs a [`GenerationProgram`] on a session of its trace (see the module doc).
pub struct Generator<'a> {
    session: &'a mut dyn Session,
    program: &'a GenerationProgram,
    /// Decode buckets that ran once eagerly (their kernels are warm).
    warm: Vec<usize>,
    /// Decode buckets whose recording exists.
    recorded: Vec<usize>,
    /// Replay decode steps from a recording (false: every step eagerly).
    pub replay: bool,
}

/// What a caller sees after each new token: the sequence's index in the
/// batch and the token; it answers whether that sequence should stop.
pub type OnToken<'f> = dyn FnMut(usize, u32) -> bool + 'f;

impl<'a> Generator<'a> {
    pub fn new(session: &'a mut dyn Session, program: &'a GenerationProgram) -> Self {
        Generator { session, program, warm: Vec::new(), recorded: Vec::new(), replay: true }
    }

    fn leaf(&self, name: &str) -> Result<ValueId> {
        self.session
            .trace()
            .leaf_by_name(name)
            .ok_or_else(|| Error::Input { name: name.into(), reason: "the generation program has no such leaf".into() })
    }

    fn write(&mut self, name: &str, dtype: DType, shape: &[usize], values: &[f64]) -> Result<()> {
        let t = HostTensor::try_from_f64(TensorType::new(dtype, shape), values, name)?;
        let v = self.leaf(name)?;
        self.session.write(v, &t)
    }

    fn read_output(&mut self, name: &str) -> Result<Vec<f64>> {
        let trace = self.session.trace();
        let v = trace
            .outputs
            .iter()
            .find(|o| matches!(&o.kind, crate::ir::OutputKind::Named(n) if n == name))
            .map(|o| o.value)
            .ok_or_else(|| Error::Input {
                name: name.into(),
                reason: "the generation program has no such output".into(),
            })?;
        Ok(self.session.read(v)?.to_f64())
    }

    /// Checks every request against the program before anything runs
    /// ([`check_requests`]).
    pub fn check(&self, requests: &[Request]) -> Result<()> {
        check_requests(self.program, requests)
    }

    /// Generates every request, in batches of at most the largest bucket.
    pub fn generate(
        &mut self,
        requests: &[Request],
        on_token: &mut OnToken,
    ) -> Result<(Vec<Generated>, Vec<BatchTimes>)> {
        self.check(requests)?;
        let mut out = Vec::with_capacity(requests.len());
        let mut times = Vec::new();
        let max = self.program.max_batch();
        for (c, chunk) in requests.chunks(max).enumerate() {
            let offset = c * max;
            let mut cb = |i: usize, t: u32| on_token(offset + i, t);
            let (g, t) = self.run_batch(chunk, &mut cb)?;
            out.extend(g);
            times.push(t);
        }
        Ok((out, times))
    }

    /// Prefills one prompt into cache row `row`; returns its first new token.
    fn prefill(&mut self, request: &Request, row: usize) -> Result<u32> {
        self.prefill_tokens(&request.prompt, row, &request.sampling, false)
    }

    /// Prefills `tokens` into cache row `row`; returns the token sampled
    /// after them. A LongRoPE model rotates them at their own positions and
    /// the padding at the last one, so their length picks the factors; with
    /// `past_end` the padding sits one further, a position past them, which
    /// is how the crossing of the original context recomputes a sequence's
    /// cache with the long factors ([`Generator::run_batch`]).
    fn prefill_tokens(&mut self, tokens: &[u32], row: usize, sampling: &Sampling, past_end: bool) -> Result<u32> {
        let l = self.program.spec.prompt_len;
        let mut ids = vec![0.0; l];
        for (x, &t) in ids.iter_mut().zip(tokens) {
            *x = t as f64;
        }
        let last = tokens.len() - 1;
        self.write("prefill.input_ids", DType::I32, &[1, l], &ids)?;
        self.write("prefill.row", DType::I32, &[1], &[row as f64])?;
        self.write("prefill.start", DType::I32, &[1], &[0.0])?;
        self.write("prefill.last", DType::I32, &[1], &[last as f64])?;
        self.write("prefill.sampling", DType::F32, &[1, 3], &sampling.row())?;
        self.write("prefill.seed", DType::I64, &[1], &[seed_value(sampling.seed)])?;
        self.write("prefill.token", DType::I32, &[1], &[0.0])?;
        if self.program.spec.config.long_rope().is_some() {
            let padding = if past_end { tokens.len() } else { last };
            let positions: Vec<f64> = (0..l).map(|t| t.min(padding) as f64).collect();
            self.write("prefill.positions", DType::I32, &[1, l], &positions)?;
        }
        let nodes = self.program.prefill().nodes.clone();
        self.session.run_nodes(nodes)?;
        Ok(self.read_output("prefill.next")?[0] as u32)
    }

    /// `transformers`' Phi-3 generation at the original context of a
    /// LongRoPE model: the step that feeds a sequence's token at position
    /// `original` (the first whose largest position passes it) drops the
    /// cache and recomputes it with the long factors. Each live sequence
    /// about to feed that position is prefilled again from its tokens so
    /// far, with the long factors; the decode step then feeds the token.
    fn recompute_at_original_context(&mut self, requests: &[Request], out: &[Generated], done: &[bool]) -> Result<()> {
        let Some(original) = self.program.spec.config.long_rope().map(|l| l.original_max_position_embeddings) else {
            return Ok(());
        };
        for (i, r) in requests.iter().enumerate() {
            let fed = r.prompt.len() + out[i].tokens.len() - 1;
            if done[i] || fed != original {
                continue;
            }
            let mut tokens = r.prompt.clone();
            tokens.extend(&out[i].tokens[..out[i].tokens.len() - 1]);
            self.prefill_tokens(&tokens, i, &r.sampling, true)?;
        }
        Ok(())
    }

    /// Generates a batch of at most the largest bucket's sequences.
    pub fn generate_batch(
        &mut self,
        requests: &[Request],
        on_token: &mut OnToken,
    ) -> Result<(Vec<Generated>, BatchTimes)> {
        self.check(requests)?;
        self.run_batch(requests, on_token)
    }

    /// [`Generator::generate_batch`] of requests already checked.
    fn run_batch(&mut self, requests: &[Request], on_token: &mut OnToken) -> Result<(Vec<Generated>, BatchTimes)> {
        let n = requests.len();
        let bucket = self.program.bucket_for(n).ok_or_else(|| Error::Input {
            name: "batch".into(),
            reason: format!(
                "{n} sequences exceed the largest bucket {}: use Generator::generate",
                self.program.max_batch()
            ),
        })?;
        let start = Instant::now();
        let mut out: Vec<Generated> =
            requests.iter().map(|_| Generated { tokens: Vec::new(), finish: Finish::Length }).collect();
        let mut done = vec![false; n];
        let mut first = Vec::with_capacity(n);
        for (i, r) in requests.iter().enumerate() {
            first.push(self.prefill(r, i)?);
        }
        let prefill = start.elapsed();
        for (i, &t) in first.iter().enumerate() {
            accept(&mut out[i], &mut done[i], &requests[i], t, on_token(i, t));
        }
        let mut times = BatchTimes { prefill, bucket, ..BatchTimes::default() };
        if done.iter().all(|&d| d) {
            return Ok((out, times));
        }
        // The bucket's state and settings; rows past the batch decode a
        // one-token dummy at position 0 of their own cache row.
        let name = format!("decode{bucket}");
        let (mut tokens, mut positions, mut sampling, mut seeds) =
            (vec![0.0; bucket], vec![0.0; bucket], vec![0.0; bucket * 3], vec![0.0; bucket]);
        for (i, r) in requests.iter().enumerate() {
            tokens[i] = first[i] as f64;
            positions[i] = r.prompt.len() as f64;
            sampling[i * 3..i * 3 + 3].copy_from_slice(&r.sampling.row());
            seeds[i] = seed_value(r.sampling.seed);
        }
        let rows: Vec<f64> = (0..bucket).map(|i| i as f64).collect();
        self.write(&format!("{name}.tokens"), DType::I32, &[bucket], &tokens)?;
        self.write(&format!("{name}.positions"), DType::I32, &[bucket], &positions)?;
        self.write(&format!("{name}.rows"), DType::I32, &[bucket], &rows)?;
        self.write(&format!("{name}.sampling"), DType::F32, &[bucket, 3], &sampling)?;
        self.write(&format!("{name}.seeds"), DType::I64, &[bucket], &seeds)?;
        let nodes = self.program.decode(bucket).expect("bucket_for returned a bucket").nodes.clone();
        let tokens_leaf = self.leaf(&format!("{name}.tokens"))?;
        let steps = requests.iter().map(|r| r.max_new_tokens).max().unwrap_or(1) - 1;
        let decode_start = Instant::now();
        for _ in 0..steps {
            self.recompute_at_original_context(requests, &out, &done)?;
            let step_start = Instant::now();
            let mut steady = false;
            if !self.replay || !self.warm.contains(&bucket) {
                // The first step of a bucket runs eagerly (warming its
                // kernels); a later replay records it.
                self.session.run_nodes(nodes.clone())?;
                if !self.warm.contains(&bucket) {
                    self.warm.push(bucket);
                }
            } else {
                let t = Instant::now();
                self.session.replay_nodes(nodes.clone())?;
                if !self.recorded.contains(&bucket) {
                    times.record = t.elapsed();
                    self.recorded.push(bucket);
                } else {
                    steady = true;
                }
            }
            times.decode_steps += 1;
            let next = self.session.read(tokens_leaf)?.to_f64();
            if steady {
                // The replay and the host's read of its tokens: a step as a caller sees it.
                times.replayed_steps += 1;
                times.replayed += step_start.elapsed();
            }
            for i in 0..n {
                if !done[i] {
                    let t = next[i] as u32;
                    accept(&mut out[i], &mut done[i], &requests[i], t, on_token(i, t));
                }
            }
            if done.iter().all(|&d| d) {
                break;
            }
        }
        times.decode = decode_start.elapsed();
        Ok((out, times))
    }
}

/// Checks every request against `program` before anything runs: a
/// non-empty prompt of ids in the vocabulary that fits the prefill, at
/// least one new token and room for them all in its cache row (the error
/// names the request and how many new tokens fit), valid sampling.
pub fn check_requests(program: &GenerationProgram, requests: &[Request]) -> Result<()> {
    let spec = &program.spec;
    let vocab = spec.config.padded_vocab_size as u64;
    for (i, r) in requests.iter().enumerate() {
        let bad = |reason: String| Err(Error::Input { name: format!("request {i}"), reason });
        if r.prompt.is_empty() {
            return bad("the prompt is empty: give at least one token".into());
        }
        if let Some(t) = r.prompt.iter().find(|&&t| t as u64 >= vocab) {
            return bad(format!("token id {t} is outside the model's vocabulary of {vocab}"));
        }
        if r.prompt.len() > spec.prompt_len {
            return bad(format!(
                "the prompt has {} tokens, more than the {} the prefill was built for",
                r.prompt.len(),
                spec.prompt_len
            ));
        }
        if r.max_new_tokens == 0 {
            return bad("max_new_tokens is 0: ask for at least one new token".into());
        }
        if r.prompt.len() + r.max_new_tokens > spec.context {
            return bad(format!(
                "{} prompt + {} new tokens do not fit the cache of {} positions per sequence: at most {} new \
                 tokens fit after this prompt",
                r.prompt.len(),
                r.max_new_tokens,
                spec.context,
                spec.context - r.prompt.len()
            ));
        }
        if let Some(long) = spec.config.long_rope() {
            let original = long.original_max_position_embeddings;
            if r.prompt.len() <= original
                && r.prompt.len() + r.max_new_tokens > original + 1
                && spec.prompt_len <= original
            {
                return bad(format!(
                    "the sequence passes the original context of {original} positions, where LongRoPE recomputes it \
                     with its long factors, but the prefill holds {} tokens: build it for at least {}",
                    spec.prompt_len,
                    original + 1
                ));
            }
        }
        r.sampling.check().map_err(|e| Error::Input { name: format!("request {i}"), reason: e })?;
    }
    Ok(())
}

/// A seed as the `seeds` input holds it: i64 bits, through f64 exactly
/// (seeds are kept below 2^53).
fn seed_value(seed: u64) -> f64 {
    (seed & ((1u64 << 53) - 1)) as f64
}

/// Appends `token` to a sequence and marks it done when it stops.
fn accept(g: &mut Generated, done: &mut bool, r: &Request, token: u32, caller_stop: bool) {
    g.tokens.push(token);
    if r.stop_tokens.contains(&token) {
        g.finish = Finish::Stop;
        *done = true;
    } else if caller_stop {
        g.finish = Finish::Caller;
        *done = true;
    } else if g.tokens.len() >= r.max_new_tokens {
        g.finish = Finish::Length;
        *done = true;
    }
}

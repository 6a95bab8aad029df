//! The generation program: one trace holding a prefill step and a decode
//! step per batch bucket, recorded from the same layers as training
//! ([`super::gpt`]) over one KV cache, so one memory plan holds the weights,
//! the cache and the largest step's working set, and every step's
//! recording (a CUDA graph per decode bucket) runs over those addresses.
//!
//! **Segments.** The trace is a sequence of [`Segment`]s, each a node
//! range a session runs on its own ([`crate::session::Session::run_nodes`],
//! [`crate::session::Session::replay_nodes`]): the prefill first, then one
//! decode step per bucket, smallest first. The plan is the trace's, so
//! segments reuse one arena; what one segment hands to a later one lives
//! in persistent storage:
//! - the KV cache, `cache.{layer}.k` / `.v` `[N, S, Hkv, D]` (N the largest
//!   bucket, S [`GenerationSpec::context`], or a sliding-window layer's
//!   shorter window: a ring of the last S positions,
//!   [`GenerationSpec::cache_len`]): state written in place by
//!   every segment, a chain `c1 = kv_write(cache, …)`, `c2 = kv_write(c1, …)`
//!   … ending in the state's update, which the planner keeps in the
//!   cache's bytes (so any segment may run in any order);
//! - each decode bucket's `decode{B}.tokens` and `decode{B}.positions`
//!   (`i32[B]`): the last token of each sequence and its position, which the
//!   step reads and [`crate::ops::decode::SampleNext`] overwrites with the
//!   next token and position, so the next replay needs no host write.
//!
//! Step inputs (written by the host, kept for the whole trace by the
//! planner, so a decode bucket's settings survive between replays):
//! - prefill, one prompt at a time into cache row `prefill.row`:
//!   `prefill.input_ids` `i32[1, L]` (right-padded), `prefill.start` `i32[1]`
//!   (0), `prefill.last` `i32[1]` (the prompt length − 1: its hidden state
//!   gives the next token), `prefill.sampling` `f32[1, 3]`, `prefill.seed`
//!   `i64[1]`, `prefill.token` `i32[1]` (any: sampling writes beside it);
//!   output `prefill.next` `i32[1]`; for a LongRoPE model also
//!   `prefill.positions` `i32[1, L]`, the positions it rotates at (see
//!   below);
//! - decode bucket B: `decode{B}.rows` `i32[B]` (cache row of each batch
//!   row), `decode{B}.sampling` `f32[B, 3]`, `decode{B}.seeds` `i64[B]`.
//!
//! Padding a prompt to L writes garbage keys at positions `len..L` of its
//! cache row; the first decode step writes position `len` before it
//! attends, and attention reads positions `≤` the query's own, so the
//! garbage is never read. A ring cache takes no padding at all: its writes
//! end at `prefill.last`, so padding cannot push real keys out of the ring.
//!
//! **LongRoPE** picks its factors by the largest position a call rotates
//! (`transformers`' rule), which for a padded prompt would be L − 1: the
//! prefill of a LongRoPE model rotates at host-given positions instead,
//! the prompt's own and, on the padding, its last one, so the prompt's
//! length decides. `transformers`' Phi-3 generation recomputes the whole
//! cache with the long factors when a sequence reaches the original
//! context; [`crate::generation`] does the same by prefilling the
//! sequence again with the padding placed one past it.
//!
//! With [`GenerationSpec::logits`] each segment
//! also outputs its logits (`prefill.logits` [1, V], `decode{B}.logits`
//! [B, V]) for tests against the full forward.

use std::ops::Range;

use super::config::Config;
pub use super::gpt::FusedParam;
use super::gpt::Gpt;
use crate::error::{Error, Result};
use crate::host::HostTensor;
use crate::ir::{Builder, DType, OutputKind, TensorType, Trace, ValueId};
use crate::models::hf_dir::NamedParams;
use crate::ops::attention::Scores;
use crate::ops::decode::CachedAttention;
use crate::passes::fusion::Fold;
use crate::passes::views::SliceViews;
use crate::passes::{run_passes, PassContext, PassReport};
use crate::plan::PlanOptions;

/// The decode batch buckets used when none are given (vLLM captures 1, 2,
/// 4, then multiples of 8; this is the same ladder up to 64).
pub const DEFAULT_BUCKETS: [usize; 7] = [1, 2, 4, 8, 16, 32, 64];

/// GPU units a decode step's attention should fill (two blocks per SM of
/// an H100/H200), for the split count of its cached attention.
const ATTENTION_BLOCKS: usize = 264;

/// What to build a generation program for.
#[derive(Clone, Debug)]
pub struct GenerationSpec {
    pub config: Config,
    pub dtype: DType,
    /// Decode batch sizes, one recorded step each (sorted, distinct, ≥ 1).
    pub buckets: Vec<usize>,
    /// Cache positions per sequence: the longest prompt plus new tokens.
    pub context: usize,
    /// Tokens of the prefill step (prompts are padded to it).
    pub prompt_len: usize,
    /// Output every segment's logits (for tests).
    pub logits: bool,
}

/// What a segment computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SegmentKind {
    /// One prompt into the cache, and its first new token.
    Prefill,
    /// One new token for each of `batch` sequences.
    Decode { batch: usize },
}

/// A node range of the program's trace that runs on its own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    pub name: String,
    pub kind: SegmentKind,
    pub nodes: Range<usize>,
}

/// A generation trace and its segments (see the module doc).
#[derive(Clone, Debug)]
pub struct GenerationProgram {
    pub spec: GenerationSpec,
    pub trace: Trace,
    pub segments: Vec<Segment>,
    /// The fused projection weights (q/k/v, gate/up) and the checkpoint
    /// tensors each is made of ([`GenerationProgram::checkpoint_params`],
    /// [`FusedWriter`]).
    pub fused: Vec<FusedParam>,
    /// What the passes did to the recorded trace (adds folded, slices made views).
    pub report: PassReport,
}

impl GenerationProgram {
    /// The prefill segment.
    pub fn prefill(&self) -> &Segment {
        &self.segments[0]
    }

    /// The decode segment of bucket `batch`, if there is one.
    pub fn decode(&self, batch: usize) -> Option<&Segment> {
        self.segments.iter().find(|s| s.kind == SegmentKind::Decode { batch })
    }

    /// The smallest bucket that holds `batch` sequences.
    pub fn bucket_for(&self, batch: usize) -> Option<usize> {
        self.spec.buckets.iter().copied().find(|&b| b >= batch)
    }

    /// The largest bucket.
    pub fn max_batch(&self) -> usize {
        *self.spec.buckets.last().expect("validated: at least one bucket")
    }

    /// Bytes of the KV cache (every layer's keys and values).
    pub fn cache_bytes(&self) -> u64 {
        self.trace.leaf_bytes(|k| matches!(k, crate::ir::ValueKind::State { name } if name.starts_with("cache.")))
    }

    /// How the cache grows with the context: `(ring bytes, bytes per
    /// position)`, the rings of the sliding-window layers (which stay at
    /// their window) and, per position of every sequence, the other layers'.
    pub fn cache_growth(&self) -> (u64, u64) {
        let cfg = &self.spec.config;
        let position = 2 * (self.max_batch() * cfg.n_query_groups * cfg.head_size * self.spec.dtype.size()) as u64;
        (0..cfg.n_layer).fold((0, 0), |(ring, per_position), layer| match self.spec.ring(layer) {
            true => (ring + self.spec.cache_len(layer) as u64 * position, per_position),
            false => (ring, per_position + position),
        })
    }

    /// The model's parameters as a checkpoint names them: a trace of
    /// parameters only, each fused weight replaced by its parts, for loading
    /// (`HfModelDir::check` and `load_into_with` map checkpoint tensors to
    /// these names; [`FusedWriter`] assembles the fused weights).
    pub fn checkpoint_params(&self) -> Result<Trace> {
        let mut b = Builder::new("checkpoint");
        for p in self.trace.params() {
            let name = self.trace.value(p).kind.leaf_name().unwrap_or_default();
            match self.fused.iter().find(|f| f.name == name) {
                Some(f) => {
                    for (part, ty) in &f.parts {
                        b.param(part, ty.clone())?;
                    }
                }
                None => {
                    b.param(name, self.trace.ty(p).clone())?;
                }
            }
        }
        b.finish("checkpoint")
    }
}

/// Writes checkpoint tensors, named as [`GenerationProgram::checkpoint_params`]
/// names them, into a generation session: a part of a fused weight is copied
/// into its rows, and the fused weight written when its last part has come;
/// any other tensor is written as it is.
pub struct FusedWriter<'p> {
    program: &'p GenerationProgram,
    /// Each part's fused weight (an index into `program.fused`) and its place among the parts.
    part_of: std::collections::HashMap<&'p str, (usize, usize)>,
    /// Fused weights being assembled: their bytes and how many parts have come.
    pending: std::collections::HashMap<String, (HostTensor, usize)>,
}

impl<'p> FusedWriter<'p> {
    pub fn new(program: &'p GenerationProgram) -> Self {
        let part_of = (program.fused.iter().enumerate())
            .flat_map(|(f, fused)| fused.parts.iter().enumerate().map(move |(k, part)| (part.0.as_str(), (f, k))))
            .collect();
        FusedWriter { program, part_of, pending: Default::default() }
    }

    /// Writes the checkpoint tensor `name` (or its rows of a fused weight).
    pub fn write(&mut self, session: &mut (impl NamedParams + ?Sized), name: &str, t: &HostTensor) -> Result<()> {
        let Some(&(f, k)) = self.part_of.get(name) else {
            return session.write_param(name, t);
        };
        let fused = &self.program.fused[f];
        let bad = |reason: String| Error::Input { name: name.into(), reason };
        if t.ty != fused.parts[k].1 {
            return Err(bad(format!("is {}, the part of `{}` it fills is {}", t.ty, fused.name, fused.parts[k].1)));
        }
        let leaf = self.program.trace.leaf_by_name(&fused.name).expect("a fused weight is a leaf of its trace");
        let ty = self.program.trace.ty(leaf).clone();
        let (buf, filled) = self.pending.entry(fused.name.clone()).or_insert_with(|| (HostTensor::zeros(ty), 0));
        let at: u64 = fused.parts[..k].iter().map(|p| p.1.bytes()).sum();
        buf.bytes_mut()[at as usize..][..t.bytes().len()].copy_from_slice(t.bytes());
        *filled += 1;
        if *filled == fused.parts.len() {
            let (buf, _) = self.pending.remove(&fused.name).expect("just filled");
            session.write_param(&fused.name, &buf)?;
        }
        Ok(())
    }

    /// Checks that every fused weight got all of its parts.
    pub fn finish(self) -> Result<()> {
        match self.pending.keys().next() {
            None => Ok(()),
            Some(name) => Err(Error::Input {
                name: name.clone(),
                reason: "some of its parts were never written (a checkpoint without them?)".into(),
            }),
        }
    }
}

impl GenerationSpec {
    /// Positions layer `layer`'s cache holds per sequence: the context, or
    /// for a sliding-window layer whose window is shorter, the window (a
    /// ring, [`crate::ops::decode::KvWrite`]'s `ring`).
    pub fn cache_len(&self, layer: usize) -> usize {
        match self.config.scores(layer).window {
            0 => self.context,
            window => window.min(self.context),
        }
    }

    /// Whether layer `layer`'s cache is a ring (shorter than the context).
    pub fn ring(&self, layer: usize) -> bool {
        self.cache_len(layer) < self.context
    }

    /// Checks the spec before anything is recorded.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(Error::Config { model: self.config.name.clone(), reason });
        self.config.validate()?;
        if self.buckets.is_empty() || self.buckets.contains(&0) {
            return bad(format!("decode buckets must be positive batch sizes, got {:?}", self.buckets));
        }
        if self.buckets.windows(2).any(|w| w[0] >= w[1]) {
            return bad(format!("decode buckets must be distinct and ascending, got {:?}", self.buckets));
        }
        if self.prompt_len == 0 {
            return bad("the prefill needs at least one prompt token".into());
        }
        if self.context < self.prompt_len + 1 {
            return bad(format!(
                "a context of {} positions has no room for a new token after a {}-token prompt",
                self.context, self.prompt_len
            ));
        }
        if self.context > self.config.block_size {
            return bad(format!(
                "a context of {} positions exceeds the model's block size {} (its longest sequence)",
                self.context, self.config.block_size
            ));
        }
        if !self.dtype.is_float() {
            return bad(format!("the model dtype must be a float type, not {}", self.dtype));
        }
        if i32::try_from(self.context).is_err() || i32::try_from(self.config.padded_vocab_size).is_err() {
            return bad("positions and token ids must fit i32".into());
        }
        Ok(())
    }
}

/// The recorder: the model's layers, the cache chain, the spec.
struct Recorder<'a> {
    g: Gpt<'a>,
    spec: &'a GenerationSpec,
    /// Per layer, the newest value of the key and value caches.
    cache: Vec<(ValueId, ValueId)>,
}

/// How one segment's attention reads and writes the cache.
#[derive(Clone, Copy)]
struct CacheIo {
    rows: ValueId,
    start: ValueId,
    /// Each row's last valid position (where a ring cache's writes end).
    last: ValueId,
    /// Prefill: per-token positions RoPE rotates at (LongRoPE), instead
    /// of the prompt's own `0..L`.
    rope_positions: Option<ValueId>,
    /// Decode (`Some(batch)`): attend over the cache; prefill (`None`):
    /// causal attention over the prompt itself.
    decode_batch: Option<usize>,
}

impl Recorder<'_> {
    fn i32s(&mut self, name: &str, shape: &[usize]) -> Result<ValueId> {
        self.g.b.input(name, TensorType::new(DType::I32, shape))
    }

    /// The model's blocks on the embedded `x: [B, T, C]`, each attention
    /// writing its new keys and values into the cache first: decode then
    /// attends over the cache, prefill causally over the prompt itself.
    fn layers(&mut self, x: ValueId, batch: usize, seq: usize, io: CacheIo) -> Result<ValueId> {
        let Recorder { g, cache, spec } = self;
        let start = io.decode_batch.map(|_| io.start).or(io.rope_positions);
        g.layers(x, batch, seq, start, &mut |g, layer, q, k, v, scale, scores| {
            let (kc, vc) = cache[layer];
            let (len, ring) = (spec.cache_len(layer), spec.ring(layer));
            let (kc, vc) = if ring {
                let kc = g.b.kv_write_ring(kc, k, io.rows, io.start, io.last)?;
                (kc, g.b.kv_write_ring(vc, v, io.rows, io.start, io.last)?)
            } else {
                (g.b.kv_write(kc, k, io.rows, io.start)?, g.b.kv_write(vc, v, io.rows, io.start)?)
            };
            cache[layer] = (kc, vc);
            match io.decode_batch {
                Some(batch) => {
                    let splits = CachedAttention::auto_splits(batch, spec.config.n_query_groups, len, ATTENTION_BLOCKS);
                    // A ring holds exactly the window: attending all of its
                    // written slots is the window (see `KvWrite`).
                    let scores = if ring { Scores { window: 0, ..scores } } else { scores };
                    g.b.cached_attention(q, kc, vc, io.rows, io.start, scale, splits, scores)
                }
                None => g.b.attention_with(q, k, v, scale, scores, None),
            }
        })
    }

    fn embed_table(&mut self) -> Result<ValueId> {
        let cfg = self.g.cfg;
        self.g.param("model.embed_tokens.weight", &[cfg.padded_vocab_size, cfg.n_embd])
    }

    /// Final norm and head on `x: [B, C]`: the logits `[B, V]`.
    fn head(&mut self, x: ValueId, name: &str) -> Result<ValueId> {
        let cfg = self.g.cfg;
        let x = self.g.norm(x, "model.norm")?;
        let head = if cfg.tie_embeddings {
            self.embed_table()?
        } else {
            self.g.param("lm_head.weight", &[cfg.padded_vocab_size, cfg.n_embd])?
        };
        let bias = if cfg.lm_head_bias { Some(self.g.param("lm_head.bias", &[cfg.padded_vocab_size])?) } else { None };
        let logits = self.g.b.linear(x, head, bias)?;
        let logits = self.g.cap_logits(logits)?;
        if self.spec.logits {
            self.g.b.output(OutputKind::Named(format!("{name}.logits")), logits);
        }
        Ok(logits)
    }

    fn prefill(&mut self) -> Result<()> {
        let (l, c) = (self.spec.prompt_len, self.g.cfg.n_embd);
        let ids = self.i32s("prefill.input_ids", &[1, l])?;
        let row = self.i32s("prefill.row", &[1])?;
        let start = self.i32s("prefill.start", &[1])?;
        let last = self.i32s("prefill.last", &[1])?;
        let sampling = self.g.b.input("prefill.sampling", TensorType::new(DType::F32, [1, 3]))?;
        let seed = self.g.b.input("prefill.seed", TensorType::new(DType::I64, [1]))?;
        let token = self.i32s("prefill.token", &[1])?;
        let rope_positions = match self.g.cfg.long_rope() {
            Some(_) => Some(self.i32s("prefill.positions", &[1, l])?),
            None => None,
        };
        let table = self.embed_table()?;
        let x = self.g.b.embedding(ids, table)?;
        let x = self.g.scale_embedding(x)?;
        // `last` is the prompt's last position, `start` being 0.
        let io = CacheIo { rows: row, start, last, decode_batch: None, rope_positions };
        let x = self.layers(x, 1, l, io)?;
        // Only the last prompt token's hidden state goes on: its row,
        // gathered by index (norm and head are per row).
        let rows = self.g.b.reshape(x, &[l, c])?;
        let x = self.g.b.embedding(last, rows)?;
        let logits = self.head(x, "prefill")?;
        let (next, _) = self.g.b.sample_next(logits, sampling, seed, token, last, 1)?;
        self.g.b.output(OutputKind::Named("prefill.next".into()), next);
        Ok(())
    }

    fn decode(&mut self, batch: usize) -> Result<()> {
        let cfg = self.g.cfg;
        let name = format!("decode{batch}");
        let tokens = self.g.b.state(&format!("{name}.tokens"), TensorType::new(DType::I32, [batch]))?;
        let positions = self.g.b.state(&format!("{name}.positions"), TensorType::new(DType::I32, [batch]))?;
        let rows = self.i32s(&format!("{name}.rows"), &[batch])?;
        let sampling = self.g.b.input(&format!("{name}.sampling"), TensorType::new(DType::F32, [batch, 3]))?;
        let seeds = self.g.b.input(&format!("{name}.seeds"), TensorType::new(DType::I64, [batch]))?;
        let table = self.embed_table()?;
        let ids = self.g.b.reshape(tokens, &[batch, 1])?;
        let x = self.g.b.embedding(ids, table)?;
        let x = self.g.scale_embedding(x)?;
        // One new token per row: its own position is its last.
        let io = CacheIo { rows, start: positions, last: positions, decode_batch: Some(batch), rope_positions: None };
        let x = self.layers(x, batch, 1, io)?;
        let x = self.g.b.reshape(x, &[batch, cfg.n_embd])?;
        let logits = self.head(x, &name)?;
        let (next, advanced) = self.g.b.sample_next(logits, sampling, seeds, tokens, positions, 1)?;
        self.g.b.update(tokens, next);
        self.g.b.update(positions, advanced);
        Ok(())
    }
}

/// Records the generation program of `spec` (see the module doc).
pub fn build_generation(spec: &GenerationSpec) -> Result<GenerationProgram> {
    spec.validate()?;
    let cfg = &spec.config;
    let mut g = Gpt::new("generate", cfg, spec.dtype, 1);
    g.fuse_projections = true;
    let n = *spec.buckets.last().expect("validated");
    let mut leaves = Vec::with_capacity(cfg.n_layer);
    for layer in 0..cfg.n_layer {
        let cache_ty = TensorType::new(spec.dtype, [n, spec.cache_len(layer), cfg.n_query_groups, cfg.head_size]);
        let k = g.b.state(&format!("cache.{layer}.k"), cache_ty.clone())?;
        let v = g.b.state(&format!("cache.{layer}.v"), cache_ty.clone())?;
        leaves.push((k, v));
    }
    let mut r = Recorder { g, spec, cache: leaves.clone() };
    let mut segments = Vec::new();
    let mut mark = |r: &Recorder, name: String, kind: SegmentKind, from: usize| {
        segments.push(Segment { name, kind, nodes: from..r.g.b.trace().nodes.len() });
    };
    let from = r.g.b.trace().nodes.len();
    r.prefill()?;
    mark(&r, "prefill".into(), SegmentKind::Prefill, from);
    for &batch in &spec.buckets {
        let from = r.g.b.trace().nodes.len();
        r.decode(batch)?;
        mark(&r, format!("decode{batch}"), SegmentKind::Decode { batch }, from);
    }
    for (&(k, v), &(k_new, v_new)) in leaves.iter().zip(&r.cache) {
        r.g.b.update(k, k_new);
        r.g.b.update(v, v_new);
    }
    let fused = std::mem::take(&mut r.g.fused);
    let trace = r.g.b.finish("build")?;
    // The residual adds (and biases) into their products, as in training,
    // within each segment; then the parts of the fused q/k/v and gate/up
    // products at one row per sequence (decode at batch 1), runs of the
    // product's output, as views, not copies (node order unchanged, so the
    // segments stand).
    let ranges: Vec<_> = segments.iter().map(|s| s.nodes.clone()).collect();
    let mut cx = PassContext::with_segments(PlanOptions::default(), ranges);
    let trace = run_passes(&trace, &[&Fold, &SliceViews], &mut cx)?;
    for (s, r) in segments.iter_mut().zip(cx.segments.take().expect("the passes keep the segments")) {
        s.nodes = r;
    }
    let report = cx.report;
    Ok(GenerationProgram { spec: spec.clone(), trace, segments, fused, report })
}

//! Generation on the CPU backend: the program's plan, greedy decoding
//! against the full forward at every step, sampling's determinism and
//! distribution, batches split over buckets, and bad requests refused
//! before anything runs.

use stepgraph_core::cpu::exec::CpuSession;
use stepgraph_core::generation::{Finish, Generated, Generator, Request, Sampling};
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, TensorType};
use stepgraph_core::models::generate::{build_generation, FusedWriter, GenerationProgram, GenerationSpec};
use stepgraph_core::models::gpt::{build_forward_with_logits, LossKind, ModelSpec, LOGITS_OUTPUT, TOKENS_INPUT};
use stepgraph_core::models::init::init_param;
use stepgraph_core::models::{Config, Overrides, QkNorm};
use stepgraph_core::ops::decode::sample_row;
use stepgraph_core::ops::rope::{LongRope, RopeScaling};
use stepgraph_core::ops::Op;
use stepgraph_core::plan::{check_plan, plan, PlanOptions};
use stepgraph_core::session::Session;

const SEED: u64 = 7;

fn config(name: &str, overrides: Overrides) -> Config {
    Config::named(name).unwrap().with_overrides(&overrides).unwrap()
}

fn program(cfg: &Config, dtype: DType, buckets: &[usize], prompt_len: usize, context: usize) -> GenerationProgram {
    let spec =
        GenerationSpec { config: cfg.clone(), dtype, buckets: buckets.to_vec(), context, prompt_len, logits: true };
    build_generation(&spec).unwrap()
}

/// A CPU session of `p` holding the weights of seed [`SEED`] as the model's
/// own parameters draw them (the fused q/k/v and gate/up weights assembled
/// from their parts' draws by `FusedWriter`, as a checkpoint loads).
fn session(p: &GenerationProgram) -> CpuSession {
    let pl = plan(&p.trace, PlanOptions::default()).unwrap();
    check_plan(&p.trace, &pl).unwrap();
    let mut s = CpuSession::new(p.trace.clone(), pl).unwrap();
    let plain = p.checkpoint_params().unwrap();
    let mut writer = FusedWriter::new(p);
    for param in plain.params() {
        let name = plain.value(param).kind.leaf_name().unwrap();
        writer.write(&mut s, name, &init_param(name, plain.ty(param), SEED).unwrap()).unwrap();
    }
    writer.finish().unwrap();
    s
}

/// The logits of the full forward at the last position of `tokens`, on
/// the weights of seed [`SEED`].
fn full_forward_last_logits(cfg: &Config, dtype: DType, tokens: &[u32]) -> Vec<f64> {
    let spec = ModelSpec {
        config: cfg.clone(),
        batch: 1,
        seq: tokens.len(),
        dtype,
        loss: LossKind::Sum,
        adapters: None,
        documents: false,
    };
    let fwd = build_forward_with_logits(&spec).unwrap();
    let pl = plan(&fwd, PlanOptions::default()).unwrap();
    let mut s = CpuSession::new(fwd.clone(), pl).unwrap();
    s.init_params(SEED).unwrap();
    let ids: Vec<f64> = tokens.iter().map(|&t| t as f64).collect();
    s.write_named(TOKENS_INPUT, &HostTensor::from_f64(TensorType::new(DType::I32, [1, tokens.len()]), &ids)).unwrap();
    s.run_eager().unwrap();
    let out = fwd
        .outputs
        .iter()
        .find(|o| matches!(&o.kind, stepgraph_core::ir::OutputKind::Named(n) if n == LOGITS_OUTPUT))
        .unwrap()
        .value;
    let v = cfg.padded_vocab_size;
    let all = s.read(out).to_f64();
    all[all.len() - v..].to_vec()
}

/// The value of the program's output `name`.
fn named_output(p: &GenerationProgram, name: &str) -> stepgraph_core::ir::ValueId {
    p.trace
        .outputs
        .iter()
        .find(|o| matches!(&o.kind, stepgraph_core::ir::OutputKind::Named(n) if n == name))
        .unwrap_or_else(|| panic!("the program outputs {name}"))
        .value
}

fn argmax(x: &[f64]) -> u32 {
    sample_row(x, 0.0, 0.0, 1.0, 0, 0) as u32
}

fn greedy(prompt: &[u32], max_new: usize) -> Request {
    Request { prompt: prompt.to_vec(), max_new_tokens: max_new, sampling: Sampling::GREEDY, stop_tokens: vec![] }
}

fn run(s: &mut CpuSession, p: &GenerationProgram, requests: &[Request]) -> Vec<Generated> {
    let mut g = Generator::new(s, p);
    g.generate(requests, &mut |_, _| false).unwrap().0
}

#[test]
fn the_program_plans_and_keeps_its_cache_in_place() {
    let cfg = config("tiny-llama", Overrides::default());
    let p = program(&cfg, DType::F32, &[1, 2, 4], 8, 24);
    assert_eq!(p.segments.len(), 4);
    assert_eq!(p.segments[0].nodes.start, 0);
    for w in p.segments.windows(2) {
        assert_eq!(w[0].nodes.end, w[1].nodes.start);
    }
    assert_eq!(p.segments.last().unwrap().nodes.end, p.trace.nodes.len());
    // The residual adds are folded into the products that precede them, in
    // every segment (2 layers × 2 per segment).
    for s in &p.segments {
        let nodes = &p.trace.nodes[s.nodes.clone()];
        assert!(nodes.iter().all(|n| n.op.name() != "add"), "{}: an add was left", s.name);
        let folded = nodes.iter().filter(|n| matches!(n.op, Op::MatMul(ref m) if m.addend)).count();
        assert_eq!(folded, 4, "{}", s.name);
    }
    let pl = plan(&p.trace, PlanOptions::default()).unwrap();
    check_plan(&p.trace, &pl).unwrap();
    // 2 layers × (k, v) × [4, 24, 2, 16] f32.
    assert_eq!(p.cache_bytes(), 2 * 2 * 4 * 24 * 2 * 16 * 4);
    // Every kv_write output shares its cache leaf's bytes.
    for node in &p.trace.nodes {
        if node.op.name() == "kv_write" {
            assert_eq!(pl.slot(node.outputs[0]), pl.slot(node.inputs[0]), "a cache write left the cache's storage");
        }
    }
    // At one row per sequence the q/k/v and gate/up parts of the fused
    // products are views, placed on their bytes of the product's output (no
    // copy runs).
    let slices = |name: &str| -> Vec<(bool, usize)> {
        let seg = p.segments.iter().find(|s| s.name == name).unwrap();
        p.trace.nodes[seg.nodes.clone()]
            .iter()
            .enumerate()
            .filter_map(|(i, n)| match &n.op {
                Op::Slice(s) => Some((s.view, seg.nodes.start + i)),
                _ => None,
            })
            .collect()
    };
    let one = slices("decode1");
    // 2 layers × (q and k together, then q and k of their one rotation,
    // gate, up); v starts 384 bytes in: off the arena's 256-byte boundaries.
    assert_eq!(one.iter().filter(|s| s.0).count(), 10, "{one:?}");
    let ropes = |name: &str| {
        let seg = p.segments.iter().find(|s| s.name == name).unwrap();
        p.trace.nodes[seg.nodes.clone()].iter().filter(|n| n.op.name() == "rope").count()
    };
    assert_eq!((ropes("decode1"), ropes("decode2")), (2, 4), "one rotation per layer at one row, two at more");
    // At two rows gate and up are a batch of two products, one block each,
    // both views (2 layers × 2); q, k and v (of different sizes: grouped
    // heads) stay column slices of one product, copies.
    let two = slices("decode2");
    assert_eq!(two.iter().map(|s| s.0 as usize).sum::<usize>(), 4, "{two:?}");
    assert_eq!(two.len(), 10, "{two:?}");
    // Without grouped heads q, k and v are a batch of products too, q and k
    // rotated together: every slice at two rows is a view (2 layers × (q|k,
    // v, q and k of the rotation, gate, up)), one rotation per layer.
    let mha = config("tiny-llama", Overrides { n_query_groups: Some(4), ..Overrides::default() });
    let q = program(&mha, DType::F32, &[2], 8, 24);
    let decode2 = &q.segments.iter().find(|s| s.name == "decode2").unwrap().nodes;
    let views: Vec<bool> = q.trace.nodes[decode2.clone()]
        .iter()
        .filter_map(|n| match &n.op {
            Op::Slice(s) => Some(s.view),
            _ => None,
        })
        .collect();
    assert_eq!(views, [true; 12]);
    let mha_ropes = q.trace.nodes[decode2.clone()].iter().filter(|n| n.op.name() == "rope").count();
    assert_eq!(mha_ropes, 2);
    for &(view, i) in one.iter().chain(&two) {
        let n = &p.trace.nodes[i];
        let Op::Slice(s) = &n.op else { unreachable!() };
        assert_eq!(view, s.can_view(p.trace.ty(n.inputs[0])));
        if view {
            let at = pl.slot(n.inputs[0]).offset + s.byte_offset(p.trace.ty(n.inputs[0]));
            assert_eq!(pl.slot(n.outputs[0]).offset, at, "a view off its bytes");
        }
    }
}

/// At one row, an MLP whose `up` part starts 160 bytes into its product's
/// row (40 f32 gate values): off the arena's 256-byte boundaries, on a
/// 16-byte one, and read by SwiGLU alone, so it is a narrow view placed on
/// its bytes, and the plan checks; greedy decoding still equals the full
/// forward. v, read by the cache write, stays a copy.
#[test]
fn a_part_only_swiglu_reads_is_a_view_on_a_16_byte_boundary() {
    let cfg = config("tiny-llama", Overrides { intermediate_size: Some(40), ..Overrides::default() });
    let p = program(&cfg, DType::F32, &[1], 6, 12);
    let pl = plan(&p.trace, PlanOptions::default()).unwrap();
    check_plan(&p.trace, &pl).unwrap();
    let seg = p.segments.iter().find(|s| s.name == "decode1").unwrap();
    let mut narrow = 0;
    for n in &p.trace.nodes[seg.nodes.clone()] {
        let Op::Slice(s) = &n.op else { continue };
        let input = p.trace.ty(n.inputs[0]);
        if s.narrow {
            assert!(s.view && !s.can_view(input) && s.byte_offset(input) % 16 == 0, "{s:?}");
            let at = pl.slot(n.inputs[0]).offset + s.byte_offset(input);
            assert_eq!(pl.slot(n.outputs[0]).offset, at, "a narrow view off its bytes");
            assert_eq!(at % 256, 160, "the up part of a 256-aligned product row");
            narrow += 1;
        } else {
            assert_eq!(s.view, s.can_view(input), "{s:?}");
        }
    }
    assert_eq!(narrow, 2, "one `up` per layer");
    let mut s = session(&p);
    let prompt = [5u32, 17, 99];
    let out = run(&mut s, &p, &[greedy(&prompt, 4)]);
    let mut seq = prompt.to_vec();
    for &t in &out[0].tokens {
        assert_eq!(t, argmax(&full_forward_last_logits(&cfg, DType::F32, &seq)), "after {seq:?}");
        seq.push(t);
    }
}

/// Greedy decoding equals the argmax of the full forward at every step,
/// for prompts of different lengths in one batch, and the step's logits
/// equal the full forward's last row.
#[test]
fn greedy_decoding_is_the_argmax_of_the_full_forward() {
    let llama = config("tiny-llama", Overrides::default());
    // Without grouped heads q, k and v are parts of one size: at several
    // rows a batch of products.
    let mha = config("tiny-llama", Overrides { n_query_groups: Some(4), ..Overrides::default() });
    let neox = config("tiny-neox", Overrides::default());
    for (cfg, dtype) in [(&llama, DType::F64), (&mha, DType::F64), (&neox, DType::F64), (&llama, DType::F32)] {
        let p = program(cfg, dtype, &[1, 2, 4], 9, 20);
        let mut s = session(&p);
        let prompts: [&[u32]; 3] = [&[5, 17, 99, 3, 250], &[1, 2, 3, 4, 5, 6, 7, 8, 9], &[42]];
        let requests: Vec<Request> = prompts.iter().map(|pr| greedy(pr, 6)).collect();
        let out = run(&mut s, &p, &requests);
        for (prompt, g) in prompts.iter().zip(&out) {
            assert_eq!(g.tokens.len(), 6);
            assert_eq!(g.finish, Finish::Length);
            let mut seq = prompt.to_vec();
            for &t in &g.tokens {
                let logits = full_forward_last_logits(cfg, dtype, &seq);
                assert_eq!(t, argmax(&logits), "{} {dtype}: after {seq:?}", cfg.name);
                seq.push(t);
            }
        }
    }
}

/// The decode step's logits equal the full forward's (the cache, the
/// positions of rope and the split attention are right, not just the argmax).
#[test]
fn decode_logits_equal_the_full_forward() {
    let gqa = config("tiny-llama", Overrides::default());
    let mha = config("tiny-llama", Overrides { n_query_groups: Some(4), ..Overrides::default() });
    // Qwen3's layout: per-head q/k norms before the rotation, wider heads.
    let qwen3 = Config { qk_norm: QkNorm::PerHead, head_size: 2 * mha.head_size, ..mha.clone() };
    // OLMo 2's: norms over all of q and k, norms after the sublayers.
    let olmo2 = Config { qk_norm: QkNorm::Whole, post_norms: true, ..gqa.clone() };
    for cfg in [gqa, mha, qwen3, olmo2] {
        decode_logits_equal_the_full_forward_for(&cfg);
    }
}

fn decode_logits_equal_the_full_forward_for(cfg: &Config) {
    let cfg = cfg.clone();
    let p = program(&cfg, DType::F64, &[2], 6, 12);
    let mut s = session(&p);
    let requests = [greedy(&[9, 8, 7], 4), greedy(&[1, 2, 3, 4, 5, 6], 4)];
    // Decode once, reading the logits output of the bucket-2 step.
    let out = {
        let mut g = Generator::new(&mut s, &p);
        g.generate_batch(&requests[..], &mut |_, _| false).unwrap().0
    };
    let logits_v = named_output(&p, "decode2.logits");
    let last = s.read(logits_v).to_f64();
    let v = cfg.padded_vocab_size;
    for (i, (r, g)) in requests.iter().zip(&out).enumerate() {
        // The last decode step fed the second-to-last new token.
        let mut seq = r.prompt.clone();
        seq.extend(&g.tokens[..g.tokens.len() - 1]);
        let want = full_forward_last_logits(&cfg, DType::F64, &seq);
        let got = &last[i * v..(i + 1) * v];
        let err = want.iter().zip(got).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(err < 1e-10, "sequence {i}: logits differ by {err}");
    }
}

/// tiny-llama with LongRoPE factors and an original context of 8.
fn long_rope_llama(long_factor: impl Fn(usize) -> f64) -> Config {
    let cfg = config("tiny-llama", Overrides::default());
    let pairs = cfg.n_rot() / 2;
    Config {
        rope_scaling: Some(RopeScaling::LongRope(LongRope {
            short_factor: (0..pairs).map(|i| 1.0 + 0.5 * i as f64).collect(),
            long_factor: (0..pairs).map(long_factor).collect(),
            original_max_position_embeddings: 8,
            attention_factor: 1.2,
        })),
        ..cfg
    }
}

/// LongRoPE: every decode step's logits equal the full forward of the
/// sequence so far, whose length picks the factors (short up to the
/// original context, long past it): the prefill is not decided by its
/// padding, and the sequence reaching the original context is recomputed
/// with the long factors, as `transformers`' Phi-3 generation does.
#[test]
fn long_rope_generation_follows_the_full_forward_across_the_original_context() {
    let cfg = long_rope_llama(|i| 2.0 + 7.0 * i as f64);
    let p = program(&cfg, DType::F64, &[1], 9, 16);
    let v = cfg.padded_vocab_size;
    let logits_v = named_output(&p, "decode1.logits");
    let prompt = [5, 17, 99, 3, 250];
    // Decode steps feed positions 5, 6, …: the fourth feeds 8, the first
    // past the original context.
    for new in 2..=8 {
        let mut s = session(&p);
        let out = {
            let mut g = Generator::new(&mut s, &p);
            g.generate_batch(&[greedy(&prompt, new)], &mut |_, _| false).unwrap().0
        };
        let mut seq = prompt.to_vec();
        seq.extend(&out[0].tokens[..new - 1]);
        let want = full_forward_last_logits(&cfg, DType::F64, &seq);
        let got = s.read(logits_v).to_f64();
        let err = want.iter().zip(&got[..v]).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(err < 1e-10, "{} tokens so far: logits differ by {err}", seq.len());
    }
    // The long factors matter here: the same model with the short ones
    // throughout gives other logits past the original context.
    let short_only = long_rope_llama(|i| 1.0 + 0.5 * i as f64);
    let seq: Vec<u32> = (1..=10).collect();
    let (a, b) =
        (full_forward_last_logits(&cfg, DType::F64, &seq), full_forward_last_logits(&short_only, DType::F64, &seq));
    assert!(a.iter().zip(&b).any(|(x, y)| (x - y).abs() > 1e-3), "the factor sets give the same logits");
}

/// A LongRoPE sequence that will reach its original context needs a
/// prefill that holds the recomputation.
#[test]
fn long_rope_generation_needs_a_prefill_past_the_original_context() {
    let cfg = long_rope_llama(|i| 2.0 + 7.0 * i as f64);
    let p = program(&cfg, DType::F32, &[1], 6, 16);
    let mut s = session(&p);
    let mut g = Generator::new(&mut s, &p);
    let err = g.generate(&[greedy(&[1, 2, 3], 8)], &mut |_, _| false).unwrap_err().to_string();
    assert!(err.contains("original context of 8 positions") && err.contains("at least 9"), "{err}");
    // Short of it, nothing is recomputed and any prefill does.
    g.generate(&[greedy(&[1, 2, 3], 6)], &mut |_, _| false).unwrap();
}

/// Same seed, same tokens; replay equals eager; different seeds differ;
/// a batch split over buckets gives what each request gives alone.
#[test]
fn sampling_is_deterministic_and_batches_do_not_interact() {
    let cfg = config("tiny-llama", Overrides::default());
    let p = program(&cfg, DType::F32, &[1, 2], 6, 16);
    let sampled = |seed: u64, prompt: &[u32]| Request {
        prompt: prompt.to_vec(),
        max_new_tokens: 8,
        sampling: Sampling { temperature: 1.0, top_k: 40, top_p: 0.95, seed },
        stop_tokens: vec![],
    };
    let requests = [sampled(1, &[3, 4, 5]), sampled(2, &[3, 4, 5]), sampled(1, &[200, 100]), greedy(&[7], 5)];
    let mut s = session(&p);
    let batched = run(&mut s, &p, &requests);
    assert_ne!(batched[0].tokens, batched[1].tokens, "two seeds drew the same 8 tokens");
    let mut eager_session = session(&p);
    let eager = {
        let mut g = Generator::new(&mut eager_session, &p);
        g.replay = false;
        g.generate(&requests, &mut |_, _| false).unwrap().0
    };
    assert_eq!(batched, eager, "replayed decode steps differ from eager ones");
    for (r, b) in requests.iter().zip(&batched) {
        let mut alone = session(&p);
        assert_eq!(&run(&mut alone, &p, std::slice::from_ref(r))[0], b, "a request alone differs from in a batch");
    }
}

/// Stop tokens end a sequence (kept), a caller's stop ends it, the others go on.
#[test]
fn stops_end_only_their_sequence() {
    let cfg = config("tiny-llama", Overrides::default());
    let p = program(&cfg, DType::F32, &[2], 4, 16);
    let mut s = session(&p);
    let probe = run(&mut s, &p, &[greedy(&[1, 2], 6)])[0].clone();
    let stop = probe.tokens[2];
    let requests = [Request { stop_tokens: vec![stop], ..greedy(&[1, 2], 6) }, greedy(&[5, 6, 7], 6)];
    let mut s = session(&p);
    let mut g = Generator::new(&mut s, &p);
    let (out, _) = g.generate(&requests, &mut |i, _| i == 1).unwrap();
    let end = probe.tokens.iter().position(|&t| t == stop).unwrap();
    assert_eq!(out[0].tokens, probe.tokens[..=end].to_vec());
    assert_eq!(out[0].finish, Finish::Stop);
    assert_eq!((out[1].tokens.len(), out[1].finish), (1, Finish::Caller));
}

/// Bad requests are refused before anything runs, each with its reason.
#[test]
fn bad_requests_are_refused_with_their_reason() {
    let cfg = config("tiny-llama", Overrides::default());
    let p = program(&cfg, DType::F32, &[1, 2], 4, 10);
    let mut s = session(&p);
    let mut g = Generator::new(&mut s, &p);
    let cases: [(Request, &str); 6] = [
        (greedy(&[], 3), "empty"),
        (greedy(&[1, 2, 3, 4, 5], 3), "5 tokens, more than the 4"),
        (greedy(&[1, 2, 3], 8), "at most 7 new tokens fit"),
        (greedy(&[1, 300], 2), "token id 300"),
        (greedy(&[1], 0), "max_new_tokens is 0"),
        (Request { sampling: Sampling { top_p: 0.0, ..Sampling::GREEDY }, ..greedy(&[1], 2) }, "top-p"),
    ];
    for (r, want) in cases {
        let err = g.generate(&[greedy(&[1], 2), r], &mut |_, _| false).unwrap_err().to_string();
        assert!(err.contains(want) && err.contains("request 1"), "{want}: {err}");
    }
}

/// Sampled tokens follow the softmax of the logits / temperature (a
/// loose check over many seeds on one small vocabulary), top-k keeps only
/// the k largest, and top-p only the nucleus.
#[test]
fn sample_row_draws_from_the_filtered_softmax() {
    let logits = [2.0, 1.0, 0.5, 0.0, -1.0, -3.0];
    let z: Vec<f64> = logits.iter().map(|x| (x / 0.8f64).exp()).collect();
    let total: f64 = z.iter().sum();
    let n = 20_000;
    let mut counts = [0usize; 6];
    for seed in 0..n {
        counts[sample_row(&logits, 0.8, 0.0, 1.0, seed, 3)] += 1;
    }
    for (i, &c) in counts.iter().enumerate() {
        let p = z[i] / total;
        let sd = (p * (1.0 - p) / n as f64).sqrt();
        let got = c as f64 / n as f64;
        assert!((got - p).abs() < 5.0 * sd + 1e-3, "token {i}: drawn {got}, softmax {p}");
    }
    for seed in 0..500 {
        assert!(sample_row(&logits, 1.0, 2.0, 1.0, seed, 0) < 2, "top-k 2 drew outside the top 2");
        // At T = 1, p(0) = 0.56 and p(0) + p(1) = 0.77: top-p 0.6 keeps both, 0.5 keeps one.
        assert!(sample_row(&logits, 1.0, 0.0, 0.6, seed, 0) < 2);
        assert_eq!(sample_row(&logits, 1.0, 0.0, 0.5, seed, 0), 0);
    }
    assert_eq!(sample_row(&[f64::NAN, 1.0, 3.0, 3.0], 0.0, 0.0, 1.0, 0, 0), 2, "greedy: first largest, NaN never wins");
}

/// A state written in place twice in one trace (`c1 = kv_write(cache)`,
/// `c2 = kv_write(c1)`, update `cache ← c2`) keeps every link in the
/// cache's bytes and the checker accepts it; reading `c1` after `c2` is
/// written would read overwritten bytes, so that trace is refused.
#[test]
fn a_state_written_twice_stays_in_place_and_a_stale_read_is_refused() {
    use stepgraph_core::ir::{Builder, TensorType};
    let build = |stale_read: bool| {
        let mut b = Builder::new("chain");
        let cache = b.state("cache", TensorType::new(DType::F32, [2, 4, 1, 2])).unwrap();
        let new = b.input("new", TensorType::new(DType::F32, [1, 1, 1, 2])).unwrap();
        let rows = b.input("rows", TensorType::new(DType::I32, [1])).unwrap();
        let start = b.input("start", TensorType::new(DType::I32, [1])).unwrap();
        let c1 = b.kv_write(cache, new, rows, start).unwrap();
        let c2 = b.kv_write(c1, new, rows, start).unwrap();
        let last = if stale_read { c1 } else { c2 };
        let s = b.sum_all(last).unwrap();
        b.output(stepgraph_core::ir::OutputKind::Named("s".into()), s);
        b.update(cache, c2);
        b.finish("build").unwrap()
    };
    let t = build(false);
    let pl = plan(&t, PlanOptions::default()).unwrap();
    check_plan(&t, &pl).unwrap();
    let cache = t.leaf_by_name("cache").unwrap();
    for node in t.nodes.iter().filter(|n| n.op.name() == "kv_write") {
        assert_eq!(pl.slot(node.outputs[0]), pl.slot(cache));
    }
    let err = plan(&build(true), PlanOptions::default()).unwrap_err().to_string();
    assert!(err.contains("cannot run in place"), "{err}");
}

#[test]
fn projections_are_fused_and_load_from_the_models_own_parameters() {
    for name in ["tiny-llama", "tiny-neox"] {
        let cfg = config(name, Overrides::default());
        let p = program(&cfg, DType::F32, &[1, 2], 4, 8);
        // One q/k/v weight per layer (and one gate/up weight for a gated MLP),
        // no separate q_proj leaf.
        let names: Vec<&str> = p.trace.params().map(|v| p.trace.value(v).kind.leaf_name().unwrap()).collect();
        assert!(names.iter().any(|n| n.ends_with("self_attn.qkv_proj.weight")), "{name}: {names:?}");
        assert!(!names.iter().any(|n| n.ends_with("q_proj.weight")), "{name}: {names:?}");
        // The checkpoint's view is the training model's parameters, name for name and type for type.
        let spec = ModelSpec {
            config: cfg.clone(),
            batch: 1,
            seq: 4,
            dtype: DType::F32,
            loss: LossKind::Sum,
            adapters: None,
            documents: false,
        };
        let fwd = build_forward_with_logits(&spec).unwrap();
        let of = |t: &stepgraph_core::ir::Trace| {
            let mut v: Vec<(String, TensorType)> =
                t.params().map(|p| (t.value(p).kind.leaf_name().unwrap().to_string(), t.ty(p).clone())).collect();
            v.sort_by(|a, b| a.0.cmp(&b.0));
            v
        };
        assert_eq!(of(&p.checkpoint_params().unwrap()), of(&fwd), "{name}");
    }
    // A part of the wrong shape, or a fused weight left without some of its parts, is refused.
    let cfg = config("tiny-llama", Overrides::default());
    let p = program(&cfg, DType::F32, &[1], 4, 8);
    let mut s = CpuSession::new(p.trace.clone(), plan(&p.trace, PlanOptions::default()).unwrap()).unwrap();
    let q = "model.layers.0.self_attn.q_proj.weight";
    let part = p.fused.iter().flat_map(|f| &f.parts).find(|(n, _)| n == q).unwrap().1.clone();
    let mut writer = FusedWriter::new(&p);
    let wrong = HostTensor::zeros(TensorType::new(DType::F32, [part.shape[0] + 1, part.shape[1]]));
    let err = writer.write(&mut s, q, &wrong).unwrap_err().to_string();
    assert!(err.contains(q) && err.contains("qkv_proj"), "{err}");
    writer.write(&mut s, q, &HostTensor::zeros(part)).unwrap();
    let err = writer.finish().unwrap_err().to_string();
    assert!(err.contains("qkv_proj.weight") && err.contains("never written"), "{err}");
}

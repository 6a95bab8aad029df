//! Sizes cannot overflow: every size key of a model config and of its
//! batch, at extreme values (0, 1, 2^31, 2^32, 2^62, 2^63, `usize::MAX` and
//! random large numbers), either builds and plans with consistent numbers
//! or is refused with an error, never a panic or a wrapped number. Tests
//! run with overflow checks on, so any unchecked product that wraps panics
//! here.
//!
//! Each property runs 256 cases in CI; `PROPTEST_CASES=N` runs N (keep the
//! test profile, whose overflow checks are what catches a wrapped product):
//! `PROPTEST_CASES=20000 cargo test -p stepgraph-core --test size_overflow`.
//!
//! A refusal about a size must be attributable: an `Error::Size` whose keys
//! name the config keys or batch fields it is made of, so that the command
//! line can name the flag (or the `config.json` key) that set them.

use proptest::prelude::*;

use stepgraph_core::autodiff::StepKind;
use stepgraph_core::ir::{Builder, DType, TensorType, MAX_VALUE_BYTES};
use stepgraph_core::models::config::{MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, SIZE_KEYS};
use stepgraph_core::models::{Config, LossKind, ModelSpec, Overrides};
use stepgraph_core::pipeline::{compile_step, StepOptions};
use stepgraph_core::plan::plan_report;
use stepgraph_core::Error;

/// Cases per property: 256, or `PROPTEST_CASES` for a long run.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(256)
}

/// The size keys of a config, in the order [`set`] and [`get`] number them.
const KEYS: [&str; 9] = SIZE_KEYS;

fn set(c: &mut Config, key: usize, value: usize) {
    match key {
        0 => c.block_size = value,
        1 => c.vocab_size = value,
        2 => c.padded_vocab_size = value,
        3 => c.n_layer = value,
        4 => c.n_embd = value,
        5 => c.n_head = value,
        6 => c.n_query_groups = value,
        7 => c.head_size = value,
        _ => c.intermediate_size = value,
    }
}

/// The extreme values, and random ones anywhere in `usize`.
fn extreme() -> impl Strategy<Value = usize> {
    prop_oneof![
        3 => prop_oneof![
            Just(0usize),
            Just(1),
            Just(1 << 31),
            Just(1 << 32),
            Just(1 << 62),
            Just(1 << 63),
            Just(usize::MAX),
            Just(MAX_LAYERS),
            Just(MAX_VOCAB),
            Just(MAX_POSITIONS),
        ],
        1 => any::<usize>(),
        1 => (1usize..64).prop_map(|shift| (1usize << shift) - 1),
        1 => 1usize..100_000,
    ]
}

fn base() -> impl Strategy<Value = Config> {
    prop_oneof![Just("tiny-llama"), Just("tiny-neox"), Just("pythia-14m"), Just("Qwen2.5-7B")]
        .prop_map(|name| Config::named(name).unwrap())
}

fn dtype() -> impl Strategy<Value = DType> {
    prop_oneof![Just(DType::F32), Just(DType::BF16), Just(DType::F16)]
}

/// A spec small enough in layers to build in milliseconds, whatever its widths.
fn buildable(spec: &ModelSpec) -> bool {
    spec.config.n_layer <= 4
}

/// A refusal must be an error about the config or a size, never an internal one.
fn check_refusal(err: &Error) {
    match err {
        Error::Size { keys, reason } => {
            assert!(!keys.is_empty(), "a size error that names no key: {reason}");
            for k in keys {
                assert!(KEYS.contains(k) || *k == "batch" || *k == "seq", "unknown key {k} in {reason}");
                assert!(reason.contains(k), "`{reason}` does not show {k}");
            }
        }
        Error::Config { .. } => {}
        other => panic!("a size refused with an error that names no key: {other}"),
    }
}

/// Builds and plans a train step of `spec` when it validates, checking
/// that the numbers agree with the config.
fn build_and_plan(spec: &ModelSpec) {
    match spec.validate() {
        Err(e) => check_refusal(&e),
        Ok(()) => {
            let params = spec.config.checked_param_count().expect("a valid config counts its parameters");
            assert!(params <= MAX_VALUE_BYTES);
            if !buildable(spec) {
                return;
            }
            match compile_step(spec, &StepOptions::new(StepKind::Train)) {
                Ok(c) => {
                    assert_eq!(c.param_count() as u64, params);
                    let report = plan_report(&c.step, &c.plan, 3);
                    assert_eq!(report.param_bytes, params * spec.dtype.size() as u64);
                    assert!(report.persistent_bytes >= report.param_bytes);
                    assert!(report.planned_peak_bytes >= report.persistent_bytes + report.arena_floor_bytes);
                    assert!(report.planned_peak_bytes <= 3 * MAX_VALUE_BYTES);
                    for v in c.step.value_ids() {
                        assert!(c.step.ty(v).checked_bytes().is_some_and(|b| b <= MAX_VALUE_BYTES));
                    }
                }
                // Every value fits on its own, the plan as a whole may not.
                Err(Error::Size { keys, reason }) if keys.is_empty() => {
                    assert!(reason.contains("memory plan") && reason.contains("the most one plan can hold"), "{reason}")
                }
                Err(e) => check_refusal(&e),
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    /// Config fields set directly, as a `config.json` can set them.
    #[test]
    fn config_keys_at_extreme_values_build_or_are_refused(
        mut config in base(),
        changes in prop::collection::vec((0usize..KEYS.len(), extreme()), 1..4),
        batch in prop_oneof![3 => Just(1usize), 1 => extreme()],
        seq in prop_oneof![3 => Just(16usize), 1 => extreme()],
        dtype in dtype(),
    ) {
        for &(key, value) in &changes {
            set(&mut config, key, value);
        }
        // param_count never wraps: it is exact or saturates.
        let _ = config.param_count();
        build_and_plan(&ModelSpec { config, batch, seq, dtype, loss: LossKind::CrossEntropy, adapters: None, documents: false });
    }

    /// The same keys through command-line overrides, with the derived
    /// sizes (`head_size`, the GELU width `4 × n_embd`) they recompute.
    #[test]
    fn overrides_at_extreme_values_build_or_are_refused(
        config in base(),
        n_layer in prop::option::of(extreme()),
        n_embd in prop::option::of(extreme()),
        n_head in prop::option::of(extreme()),
        n_query_groups in prop::option::of(extreme()),
        vocab_size in prop::option::of(extreme()),
        block_size in prop::option::of(extreme()),
        intermediate_size in prop::option::of(extreme()),
        batch in prop_oneof![2 => Just(1usize), 1 => extreme()],
        seq in prop_oneof![2 => Just(8usize), 1 => extreme()],
        loss in prop_oneof![Just(LossKind::CrossEntropy), Just(LossKind::Sum)],
    ) {
        let o = Overrides { n_layer, n_embd, n_head, n_query_groups, vocab_size, block_size, intermediate_size };
        match config.with_overrides(&o) {
            Err(e) => check_refusal(&e),
            Ok(config) => build_and_plan(&ModelSpec { config, batch, seq, dtype: DType::F32, loss, adapters: None, documents: false }),
        }
    }

    /// Consistent geometries (heads that divide the width, groups that
    /// divide the heads) whose sizes straddle the limit: these pass the
    /// config checks, so the model builder, autodiff, the passes and the
    /// planner all run on sizes near 2^60 bytes.
    #[test]
    fn consistent_geometries_near_the_limit_build_or_are_refused(
        log_heads in 0u32..20,
        log_head_size in 1u32..34,
        log_groups in 0u32..20,
        vocab in prop_oneof![1usize..1000, (1usize << 20)..=MAX_VOCAB],
        intermediate in prop_oneof![1usize..1000, any::<usize>().prop_map(|x| x >> 20)],
        n_layer in 1usize..3,
        batch in prop_oneof![Just(1usize), 1usize..(1 << 20), any::<usize>().prop_map(|x| x >> 30)],
        seq in prop_oneof![Just(1usize), 1usize..(1 << 16), (1usize << 16)..=MAX_POSITIONS],
        dtype in dtype(),
        neox in any::<bool>(),
    ) {
        let n_head = 1usize << log_heads;
        let head_size = 1usize << log_head_size;
        let config = Config {
            n_layer,
            n_head,
            head_size,
            n_embd: n_head * head_size,
            n_query_groups: 1 << log_groups.min(log_heads),
            vocab_size: vocab,
            padded_vocab_size: vocab,
            intermediate_size: intermediate.max(1),
            block_size: seq,
            ..Config::named(if neox { "tiny-neox" } else { "tiny-llama" }).unwrap()
        };
        build_and_plan(&ModelSpec { config, batch, seq, dtype, loss: LossKind::CrossEntropy, adapters: None, documents: false });
    }

    /// Any shape: a value's size is checked before it joins a trace, so
    /// its element count and bytes are exact, and a reshape to a shape
    /// whose product wraps is refused.
    #[test]
    fn values_past_the_limit_are_refused_by_the_builder(
        shape in prop::collection::vec(extreme(), 0..5),
        dtype in prop_oneof![Just(DType::F64), Just(DType::BF16), Just(DType::Bool)],
        target in prop::collection::vec(extreme(), 1..4),
    ) {
        let ty = TensorType::new(dtype, shape.clone());
        let fits = |shape: &[usize]| {
            let extent = shape.iter().try_fold(dtype.size() as u128, |acc, &d| acc.checked_mul(d.max(1) as u128));
            extent.is_some_and(|b| b <= MAX_VALUE_BYTES as u128)
        };
        let mut b = Builder::new("sizes");
        match b.input("x", ty.clone()) {
            Ok(x) => {
                prop_assert!(fits(&shape), "{ty} accepted");
                let exact: u128 = shape.iter().map(|&d| d as u128).product::<u128>() * dtype.size() as u128;
                prop_assert_eq!(ty.bytes() as u128, exact);
                let reshaped = b.reshape(x, &target);
                let target_elems = target.iter().try_fold(1u128, |acc, &d| acc.checked_mul(d as u128));
                let same = target_elems == Some(ty.numel() as u128) && fits(&target);
                prop_assert_eq!(reshaped.is_ok(), same, "reshape {} to {:?}", ty, target);
            }
            Err(Error::Size { reason, .. }) => {
                prop_assert!(!fits(&shape), "{ty} refused: {reason}");
                prop_assert!(reason.contains("input `x`"), "{reason}");
            }
            Err(e) => prop_assert!(false, "{ty}: {e}"),
        }
        // The checked counts never wrap.
        let exact = shape.iter().try_fold(dtype.size() as u128, |acc, &d| acc.checked_mul(d as u128));
        let expected = if shape.contains(&0) { Some(0) } else { exact.filter(|&b| b <= u64::MAX as u128) };
        prop_assert_eq!(ty.checked_bytes().map(u128::from), expected);
    }
}

/// The sizes the issue found wrapping, each refused with its key named.
#[test]
fn the_reported_overflows_are_refused_by_key() {
    let tiny = || Config::named("tiny-llama").unwrap();
    let spec = |config: Config, batch: usize, seq: usize| ModelSpec {
        config,
        batch,
        seq,
        dtype: DType::F32,
        loss: LossKind::CrossEntropy,
        adapters: None,
        documents: false,
    };
    let size_keys = |r: stepgraph_core::Result<()>| match r {
        Err(Error::Size { keys, reason }) => (keys, reason),
        other => panic!("expected a size error, got {other:?}"),
    };
    // A batch of 2^62 rows: the token ids alone pass 2^64 bytes.
    let (keys, reason) = size_keys(spec(tiny(), 1 << 62, 16).validate());
    assert_eq!(keys, ["batch", "seq"]);
    assert!(reason.contains("batch 4611686018427387904 × seq 16") && reason.contains("input_ids"), "{reason}");
    // pythia's GELU width follows n_embd: 4 × 2^62 wraps to 0 unchecked.
    let pythia = Config::named("pythia-14m").unwrap();
    let err = pythia.with_overrides(&Overrides { n_embd: Some(1 << 62), ..Default::default() }).unwrap_err();
    match err {
        Error::Size { keys, reason } => {
            assert!(keys.contains(&"n_embd"), "{reason}");
            assert!(!reason.contains("must be positive"), "{reason}");
        }
        other => panic!("expected a size error, got {other}"),
    }
    // A vocabulary of 2^62 rows: past what i32 token ids can index.
    let (keys, _) =
        size_keys(tiny().with_overrides(&Overrides { vocab_size: Some(1 << 62), ..Default::default() }).map(drop));
    assert_eq!(keys, ["vocab_size"]);
    // An MLP 2^62 wide: its weight passes 2^60 bytes.
    let (keys, reason) = size_keys(
        tiny().with_overrides(&Overrides { intermediate_size: Some(1 << 62), ..Default::default() }).map(drop),
    );
    assert_eq!(keys, ["intermediate_size", "n_embd"], "{reason}");
    // A block of 2^62 positions.
    let (keys, _) =
        size_keys(tiny().with_overrides(&Overrides { block_size: Some(1 << 62), ..Default::default() }).map(drop));
    assert_eq!(keys, ["block_size"]);
    // Wide enough to pass the cap only at the dtype's bytes: an f32
    // embedding of 2^31 × 2^28 elements is 2^61 bytes.
    let wide = Config {
        n_layer: 1,
        padded_vocab_size: 1 << 31,
        vocab_size: 1 << 31,
        n_embd: 1 << 28,
        n_head: 1,
        n_query_groups: 1,
        head_size: 1 << 28,
        intermediate_size: 1,
        tie_embeddings: true,
        ..tiny()
    };
    wide.validate().unwrap();
    let (keys, reason) = size_keys(spec(wide, 1, 1).validate());
    assert_eq!(keys, ["padded_vocab_size", "n_embd"]);
    assert!(reason.contains("the embedding weight") && reason.contains("× 4 bytes"), "{reason}");
}

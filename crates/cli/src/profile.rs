//! The per-kernel profiles that `bench --profile` and `generate --profile`
//! print: every launch of one step timed, summed by kernel name, and the
//! same times summed by kernel class (products, attention forward and
//! backward, pointwise and row-wise, loss, optimizer, other), the table
//! `scripts/torch_profile.py` prints for PyTorch on the same workload.

/// The kernel classes, in the order the table prints them.
pub const CLASSES: [&str; 9] = [
    "products",
    "experts",
    "attention forward",
    "attention backward",
    "decode attention",
    "pointwise and row-wise",
    "loss",
    "optimizer",
    "other",
];

/// The class of a kernel from its launch name (`gemm_bf16_…`,
/// `attention_mma_bwd_kv_…`, `rms_norm_vec_bf16`, …).
pub fn class_of(kernel: &str) -> &'static str {
    let has = |p: &str| kernel.contains(p);
    if kernel.starts_with("gemm") || kernel.starts_with("gemv") {
        "products"
    } else if ["top_k", "expert_sort", "grouped_matmul", "grouped_mma"].iter().any(|p| kernel.starts_with(p)) {
        // Mixture-of-experts routing and the experts' grouped products.
        "experts"
    } else if kernel.starts_with("cached_attention") || kernel.starts_with("kv_write") {
        "decode attention"
    } else if kernel.starts_with("attention") && has("bwd") {
        "attention backward"
    } else if kernel.starts_with("attention") {
        "attention forward"
    } else if kernel.starts_with("adamw") || kernel.starts_with("sgd") || kernel.starts_with("squared_norms") {
        "optimizer"
    } else if kernel.starts_with("linear_ce") || kernel.starts_with("cross_entropy") {
        "loss"
    } else if [
        "rms_norm",
        "layer_norm",
        "rope",
        "swiglu",
        "geglu",
        "gelu",
        "silu",
        "sigmoid",
        "softmax",
        "add",
        "sub",
        "mul",
        "div",
        "neg",
        "exp",
        "log",
        "sqrt",
        "rsqrt",
        "tanh",
        "cast",
        "max_backward",
        // FP8 operands: an amax, its scale, the casts to codes.
        "fp8_",
    ]
    .iter()
    .any(|p| kernel.starts_with(p))
    {
        "pointwise and row-wise"
    } else {
        "other"
    }
}

/// Launches and milliseconds per class, in [`CLASSES`] order, of profile
/// rows `(kernel, launches, ms)`.
pub fn by_class(rows: &[(String, usize, f64)]) -> Vec<(&'static str, usize, f64)> {
    let mut sums: Vec<(&'static str, usize, f64)> = CLASSES.iter().map(|c| (*c, 0, 0.0)).collect();
    for (name, n, ms) in rows {
        let c = class_of(name);
        let at = CLASSES.iter().position(|x| *x == c).expect("class_of answers one of CLASSES");
        sums[at].1 += n;
        sums[at].2 += ms;
    }
    sums
}

/// A step's launches counted by class ([`CLASSES`] order, empty classes
/// left out), what `plan` prints: `(class, launches)`.
pub fn census(launches: &[stepgraph_cuda::launch::Launch]) -> Vec<(&'static str, usize)> {
    let rows: Vec<(String, usize, f64)> = launches.iter().map(|l| (l.profile_name(), 1, 0.0)).collect();
    by_class(&rows).into_iter().filter(|c| c.1 > 0).map(|(class, n, _)| (class, n)).collect()
}

/// `launches per step on an sm_90 GPU: 93 (products 45, ...)`.
pub fn census_line(arch: &str, census: &[(&str, usize)]) -> String {
    let total: usize = census.iter().map(|c| c.1).sum();
    let parts: Vec<String> = census.iter().map(|(class, n)| format!("{class} {n}")).collect();
    format!("launches per step on an {arch} GPU: {total} ({})", parts.join(", "))
}

/// Prints the class table, then the `top` slowest kernels, to stderr.
pub fn print(title: &str, rows: &[(String, usize, f64)], top: usize) {
    let total: f64 = rows.iter().map(|r| r.2).sum();
    eprintln!("{title} ({total:.3} ms in launches)");
    eprintln!("  by class:");
    for (class, n, ms) in by_class(rows).into_iter().filter(|c| c.1 > 0) {
        eprintln!("  {ms:>9.3} ms {:>5.1}%  {n:>4}x  {class}", 100.0 * ms / total.max(f64::MIN_POSITIVE));
    }
    eprintln!("  slowest kernels:");
    for (name, n, ms) in rows.iter().take(top) {
        eprintln!("  {ms:>9.3} ms {:>5.1}%  {n:>4}x  {name}", 100.0 * ms / total.max(f64::MIN_POSITIVE));
    }
}

/// The cuBLASLt autotuning of a session to stderr ([`tuning_lines`]).
pub fn print_tuning(tuning: &stepgraph_cuda::blas::GemmTuning) {
    for line in tuning_lines(tuning) {
        eprintln!("{line}");
    }
}

/// The lines of a tuning report: the build time and what tuning saves per
/// step, then each shape's chosen candidate (with its split-k count where
/// it splits the depth, `cuBLAS` for cuBLAS's GEMM) against the
/// heuristic's first; none when tuning is off. `scripts/torch_gemm_shapes.py`
/// reads the shape lines: keep them in step with its pattern.
pub fn tuning_lines(tuning: &stepgraph_cuda::blas::GemmTuning) -> Vec<String> {
    if !tuning.enabled {
        return Vec::new();
    }
    let mut lines = vec![format!(
        "cuBLASLt autotuning: {:.0} ms at build, saves {:.2} ms per step over the heuristic's first choice",
        tuning.wall_ms,
        tuning.saved_ms_per_step()
    )];
    for sh in &tuning.shapes {
        let ms = |t: Option<f64>| t.map_or("-".to_string(), |t| format!("{t:.3}"));
        let split = match sh.chosen_algo.split_k {
            _ if sh.chosen_algo.id == stepgraph_cuda::blas::CUBLAS_ALGO_ID => ", cuBLAS".to_string(),
            0 | 1 => String::new(),
            k => format!(", split-k {k}"),
        };
        lines.push(format!(
            "  {:<40} {:>3}x  candidate {}/{}{split}  {} ms (heuristic's first {} ms)",
            sh.name,
            sh.calls,
            sh.chosen + 1,
            sh.candidates,
            ms(sh.chosen_ms),
            ms(sh.heuristic_ms)
        ));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tuning_lines_name_each_shape_its_choice_and_split() {
        use stepgraph_cuda::blas::{AlgoConfig, GemmTuning, ShapeTuning};
        let shape = |name: &str, split_k: u32, chosen_ms: Option<f64>| ShapeTuning {
            name: name.into(),
            calls: 26,
            candidates: 12,
            chosen: 4,
            candidate_ms: vec![None; 12],
            chosen_ms,
            heuristic_ms: Some(0.5),
            chosen_algo: AlgoConfig { split_k, ..AlgoConfig::default() },
            heuristic_algo: AlgoConfig::default(),
            tune_ms: 1.0,
            reused: false,
            skipped: None,
        };
        let mut cublas = shape("gemm_bf16_8192x3200x8640_tb", 1, Some(1.2));
        cublas.chosen_algo.id = stepgraph_cuda::blas::CUBLAS_ALGO_ID;
        let tuning = GemmTuning {
            enabled: true,
            wall_ms: 812.0,
            shapes: vec![
                shape("gemm_bf16_16x3200x3200_tb_acc", 4, Some(0.012)),
                shape("gemm_f32_256x256x256", 1, None),
                cublas,
            ],
        };
        let lines = tuning_lines(&tuning);
        assert!(lines[0].starts_with("cuBLASLt autotuning: 812 ms at build"), "{}", lines[0]);
        // The form scripts/torch_gemm_shapes.py parses.
        assert_eq!(
            lines[1],
            "  gemm_bf16_16x3200x3200_tb_acc             26x  candidate 5/12, split-k 4  0.012 ms (heuristic's first 0.500 ms)"
        );
        assert_eq!(
            lines[2],
            "  gemm_f32_256x256x256                      26x  candidate 5/12  - ms (heuristic's first 0.500 ms)"
        );
        assert_eq!(
            lines[3],
            "  gemm_bf16_8192x3200x8640_tb               26x  candidate 5/12, cuBLAS  1.200 ms (heuristic's first 0.500 ms)"
        );
        assert!(tuning_lines(&GemmTuning::default()).is_empty());
    }

    #[test]
    fn kernels_of_w5_and_w6_fall_in_their_classes() {
        for (kernel, class) in [
            ("gemm_bf16_8192x3200x8640_tb", "products"),
            ("attention_mma_fwd_d112_bf16", "attention forward"),
            ("attention_fwd_d64_f32", "attention forward"),
            ("attention_mma_bwd_kv_d112_bf16", "attention backward"),
            ("attention_bwd_q_d1_bf16", "attention backward"),
            ("cached_attention_split_h1_v4_e4_s2_bf16", "decode attention"),
            ("kv_write_u128", "decode attention"),
            ("grouped_matmul_weight_grad_bf16", "experts"),
            ("grouped_mma_nt_bf16", "experts"),
            ("grouped_mma_weight_grad_f16", "experts"),
            ("expert_sort_i32", "experts"),
            ("top_k_backward_f32", "experts"),
            ("rms_norm_backward_gw_bf16", "pointwise and row-wise"),
            ("rope_at_bf16", "pointwise and row-wise"),
            ("add_vec_bf16", "pointwise and row-wise"),
            ("swiglu_backward_vec_bf16", "pointwise and row-wise"),
            ("geglu_tanh_vec_bf16", "pointwise and row-wise"),
            ("linear_ce_chunk_stats_bf16", "loss"),
            ("cross_entropy_backward_f32", "loss"),
            ("softmax_backward_f32", "pointwise and row-wise"),
            ("cast_f32_bf16", "pointwise and row-wise"),
            ("adamw_vec_bf16_bf16_bf16", "optimizer"),
            ("squared_norms_partial_bf16", "optimizer"),
            ("embedding_u128_i32", "other"),
            ("memset", "other"),
        ] {
            assert_eq!(class_of(kernel), class, "{kernel}");
        }
    }

    #[test]
    fn the_census_counts_each_launch_in_its_class() {
        use stepgraph_cuda::launch::Launch;
        let launches = [Launch::Memset { ptr: 0, bytes: 4, value: 0 }, Launch::Copy { dst: 0, src: 8, bytes: 4 }];
        assert_eq!(census(&launches), vec![("other", 2)]);
        let line = census_line("sm_90", &[("products", 45), ("other", 3)]);
        assert_eq!(line, "launches per step on an sm_90 GPU: 48 (products 45, other 3)");
    }

    #[test]
    fn class_sums_keep_every_launch_and_millisecond() {
        let rows = vec![
            ("gemm_bf16_1x2x3".to_string(), 4, 2.0),
            ("gemm_bf16_4x5x6_ta".to_string(), 2, 1.0),
            ("adamw_vec_f32_f32_f32".to_string(), 3, 0.5),
            ("embedding_u128_i32".to_string(), 1, 0.25),
        ];
        let sums = by_class(&rows);
        assert_eq!(sums.len(), CLASSES.len());
        assert_eq!(sums[0], ("products", 6, 3.0));
        assert_eq!(sums.iter().find(|c| c.0 == "optimizer").unwrap().1, 3);
        assert_eq!(sums.iter().map(|c| c.1).sum::<usize>(), 10);
        assert!((sums.iter().map(|c| c.2).sum::<f64>() - 3.75).abs() < 1e-12);
    }
}

//! The command line as a user meets it: plan JSON for the benchmark
//! workloads (W2 by default and on a budget, W5 also on 8 GPUs, with and
//! without ZeRO-1), traces, short training runs (one with a tiled MLP), and
//! clear errors for bad input.

mod common;
use common::stepgraph;

fn json_u64(v: &serde_json::Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("missing `{key}` in {v}"))
}

#[test]
fn plan_w1_json_has_the_acceptance_fields() {
    let (ok, out, err) = stepgraph(&[
        "plan",
        "--model",
        "open_llama_3b",
        "--n-layer",
        "10",
        "--dtype",
        "f32",
        "--batch",
        "1",
        "--seq",
        "2048",
        "--loss",
        "sum",
        "--step",
        "grads",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let (param, persistent) = (json_u64(&v, "param_bytes"), json_u64(&v, "persistent_bytes"));
    let (peak, floor) = (json_u64(&v, "planned_peak_bytes"), json_u64(&v, "floor_bytes"));
    assert_eq!(param, persistent);
    assert_eq!(peak, persistent + json_u64(&v, "arena_bytes"));
    assert!(peak <= 11_900_000_000, "planned peak {peak}");
    assert!(peak as f64 <= floor as f64 * 1.02, "peak {peak} floor {floor}");
}

/// W5's step with `extra` flags: its plan's launch count on an sm_90 GPU,
/// total and per class. The bf16 parameters keep no master state, as in
/// `bench` and W5's PyTorch reference.
fn w5_launches(extra: &[&str]) -> (u64, Vec<(String, u64)>) {
    let mut args =
        vec!["plan", "--model", "open_llama_3b", "--batch", "4", "--seq", "2048", "--dtype", "bf16", "--step", "train"];
    args.extend(["--master-weights", "none"]);
    args.extend_from_slice(extra);
    args.push("--json");
    let (ok, out, err) = stepgraph(&args);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let l = &v["launches_sm90"];
    let classes = l["by_class"].as_array().unwrap_or_else(|| panic!("no launch census in {l}"));
    let classes = classes.iter().map(|c| (c["class"].as_str().unwrap().to_string(), json_u64(c, "launches"))).collect();
    (json_u64(l, "total"), classes)
}

/// `plan` counts the launches a step makes on a Hopper GPU without one:
/// W5 as `bench` measures it (1277 launches: 582 products, each layer's q
/// and k rotated in one launch per pass, every AdamW update in backward),
/// and with gradient clipping (`train`'s default),
/// where the squared norms of all 237 gradients take 3 pairs of
/// multi-tensor launches and the updates after backward merge into 5.
#[test]
fn plan_counts_a_steps_launches_and_clipping_adds_few() {
    let class = |c: &[(String, u64)], name: &str| c.iter().find(|x| x.0 == name).map_or(0, |x| x.1);
    let (plain, plain_classes) = w5_launches(&["--clip-grad-norm", "0"]);
    assert_eq!(plain, 1277, "{plain_classes:?}");
    assert_eq!(plain_classes.iter().map(|c| c.1).sum::<u64>(), plain);
    assert_eq!(class(&plain_classes, "products"), 582);
    assert_eq!(class(&plain_classes, "optimizer"), 237);
    let (clipped, clipped_classes) = w5_launches(&["--clip-grad-norm", "1.0"]);
    assert_eq!(class(&clipped_classes, "optimizer"), 5 + 6, "{clipped_classes:?}");
    // Around them, the norms' sum, its square root and the clipping factor
    // (constants, a max, a division, a cast to bf16): 11 small launches.
    assert!(clipped <= plain - 237 + 11 + 11, "{clipped} launches clipped, {plain} not: {clipped_classes:?}");
}

/// `stepgraph plan` under `env`: success, stdout, stderr.
fn plan_with_env(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_stepgraph"));
    cmd.arg("plan").args(args).env_remove("RUST_BACKTRACE").current_dir(common::root());
    for var in stepgraph_cuda::Switches::VARS {
        cmd.env_remove(var);
    }
    cmd.envs(env.iter().copied());
    let out = cmd.output().expect("run stepgraph");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

/// A switch set in the environment changes the plan's launch count (the
/// AdamW updates are not merged under `STEPGRAPH_MULTI_TENSOR=0`) and the
/// plan says so; a value the switch does not take is refused naming it.
#[test]
fn plan_says_which_switches_are_set() {
    let base = ["--model", "tiny-llama", "--dtype", "f32", "--seq", "16", "--step", "train"];
    let launches = |out: &str| -> usize {
        let l = out.lines().find(|l| l.starts_with("launches per step")).expect(out);
        l.split(": ").nth(1).unwrap().split_whitespace().next().unwrap().parse().unwrap()
    };
    let (ok, default, err) = plan_with_env(&base, &[]);
    assert!(ok, "{err}");
    assert!(!default.contains("switches"), "{default}");
    let (ok, single, err) = plan_with_env(&base, &[("STEPGRAPH_MULTI_TENSOR", "0")]);
    assert!(ok, "{err}");
    assert!(single.contains("switches: STEPGRAPH_MULTI_TENSOR=off (not the defaults)"), "{single}");
    assert!(launches(&single) > launches(&default), "{single}\n{default}");
    let (ok, json, err) = plan_with_env(&[&base[..], &["--json"]].concat(), &[("STEPGRAPH_MULTI_TENSOR", "off")]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["switches"]["multi_tensor"], false, "{}", v["switches"]);
    assert_eq!(v["switches"]["gemm_autotune"], true, "{}", v["switches"]);
    let (ok, _, err) = plan_with_env(&base, &[("STEPGRAPH_MULTI_TENSOR", "sometimes")]);
    assert!(!ok && err.contains("STEPGRAPH_MULTI_TENSOR=\"sometimes\": expected 1, on, true, yes or 0"), "{err}");
}

/// `--validation` plans the training program with its evaluation segment:
/// the plan says what validation adds (a tiny step's inputs and loss:
/// bytes) and JSON carries it, launches are the step's; a step that is
/// not `train` is refused.
#[test]
fn plan_says_what_validation_adds_in_the_training_arena() {
    let base = ["--model", "tiny-llama", "--dtype", "f32", "--seq", "16"];
    let (ok, plain, err) = plan_with_env(&[&base[..], &["--json"]].concat(), &[]);
    assert!(ok, "{err}");
    let (ok, joint, err) = plan_with_env(&[&base[..], &["--json", "--validation"]].concat(), &[]);
    assert!(ok, "{err}");
    let (plain, joint): (serde_json::Value, serde_json::Value) =
        (serde_json::from_str(&plain).unwrap(), serde_json::from_str(&joint).unwrap());
    assert!(plain["validation_extra_bytes"].is_null(), "{}", plain["validation_extra_bytes"]);
    let extra = json_u64(&joint, "validation_extra_bytes");
    assert!(extra > 0 && extra < 1000, "{extra}");
    assert_eq!(json_u64(&joint, "planned_peak_bytes"), json_u64(&plain, "planned_peak_bytes") + extra);
    let (ok, text, err) = plan_with_env(&[&base[..], &["--validation"]].concat(), &[]);
    assert!(ok, "{err}");
    assert!(text.contains(&format!("validation: in the training arena, {extra} B beyond the step's plan")), "{text}");
    // Launches are counted for the training step alone.
    let launches = |out: &str| out.lines().find(|l| l.starts_with("launches per step")).map(str::to_string);
    let (_, plain_text, _) = plan_with_env(&base, &[]);
    assert_eq!(launches(&text), launches(&plain_text));
    let (ok, _, err) = plan_with_env(&[&base[..], &["--validation", "--step", "grads"]].concat(), &[]);
    assert!(!ok && err.contains("--validation plans the evaluation beside a training step"), "{err}");
}

/// `--f32-products 3xtf32`: every f32 product as three TF32 ones, said in
/// the plan and counted in its launches.
#[test]
fn plan_says_how_f32_products_are_split() {
    let base = ["plan", "--model", "tiny-llama", "--dtype", "f32", "--seq", "16", "--step", "grads"];
    let (ok, exact, err) = stepgraph(&base);
    assert!(ok, "{err}");
    assert!(!exact.contains("3xTF32"), "{exact}");
    let (ok, split, err) = stepgraph(&[&base[..], &["--f32-products", "3xtf32"]].concat());
    assert!(ok, "{err}");
    let line = split.lines().find(|l| l.starts_with("3xTF32: ")).expect(&split);
    let n: Vec<usize> = line.split_whitespace().filter_map(|w| w.parse().ok()).collect();
    assert_eq!(n.len(), 3, "{line}");
    assert_eq!(n[1], 3 * n[0], "{line}");
    let launches = |out: &str| -> usize {
        let l = out.lines().find(|l| l.starts_with("launches per step")).expect(out);
        l.split(": ").nth(1).unwrap().split_whitespace().next().unwrap().parse().unwrap()
    };
    assert_eq!(launches(&split), launches(&exact) + 2 * n[0] + n[2], "three products each, and the splits");
    let (ok, json, err) = stepgraph(&[&base[..], &["--f32-products", "3xtf32", "--json"]].concat());
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["f32_products"], "3xtf32", "as the flag says it");
}

#[test]
fn fp8_products_are_planned_reported_and_trained_on_the_cpu() {
    let base = ["plan", "--model", "tiny-llama", "--dtype", "bf16", "--seq", "16", "--recompute", "off"];
    let (ok, out, err) = stepgraph(&[&base[..], &["--fp8", "products"]].concat());
    assert!(ok, "{err}");
    // Two layers of seven linear layers: forward, input and weight gradients.
    assert!(out.lines().any(|l| l.starts_with("FP8: 42 products of quantized operands")), "{out}");
    let (ok, json, err) = stepgraph(&[&base[..], &["--fp8", "products", "--json"]].concat());
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!((v["fp8"]["products"].as_u64(), v["fp8"]["kept"].as_u64()), (Some(42), Some(0)), "{}", v["fp8"]);
    // An f32 model is refused with the fix, before any work.
    let err = common::fails_with(&["plan", "--model", "tiny-llama", "--dtype", "f32", "--fp8", "products"], "--fp8");
    assert!(err.contains("bf16 or f16") && err.contains("--dtype bf16"), "{err}");
    // A short run on the CPU backend says what runs in FP8 and learns.
    let (ok, out, err) = stepgraph(&[
        "train",
        "--model",
        "tiny-llama",
        "--dtype",
        "bf16",
        "--fp8",
        "products",
        "--steps",
        "8",
        "--batch",
        "2",
        "--seq",
        "32",
    ]);
    assert!(ok, "{err}");
    let all = format!("{out}{err}");
    let header = all.lines().find(|l| l.trim_start().starts_with("fp8 ")).expect(&all);
    assert!(header.contains("products of the decoder layers' linear layers") && header.contains("e5m2"), "{header}");
    let last = all.lines().find(|l| l.starts_with("final loss")).expect(&all);
    let numbers: Vec<f64> = last.split([' ', '(']).filter_map(|w| w.trim_end_matches(')').parse().ok()).collect();
    assert!(numbers.len() >= 2 && numbers[0] < numbers[1], "the loss did not fall: {last}");
}

/// `stepgraph plan` of W2 with `extra` flags: its stdout.
fn plan_w2(extra: &[&str]) -> String {
    let mut args = vec!["plan", "--model", "Qwen2.5-7B", "--n-layer", "5", "--n-embd", "28", "--dtype", "bf16"];
    args.extend(["--seq", "4096", "--loss", "ce", "--step", "grads"]);
    args.extend_from_slice(extra);
    let (ok, out, err) = stepgraph(&args);
    assert!(ok, "{err}");
    out
}

#[test]
fn plan_w2_text_report() {
    // Bytes by kind by default; the floor and the values at the peak, by
    // their ids in the trace, with --verbose.
    let out = plan_w2(&[]);
    assert!(out.contains("planned peak") && out.contains("saved for bwd"), "{out}");
    assert!(!out.contains("largest values live at the peak") && !out.contains("floor") && !out.contains(" %"), "{out}");
    let out = plan_w2(&["--verbose"]);
    assert!(out.contains("floor") && out.contains("largest values live at the peak"), "{out}");
}

/// W2's plan with `extra` flags, as JSON.
fn plan_w2_json(extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["--json"];
    args.extend_from_slice(extra);
    serde_json::from_str(&plan_w2(&args)).unwrap()
}

#[test]
fn plan_w2_fits_its_memory_goals_by_default_and_under_half_a_gigabyte() {
    // Default flags: within 1.7 GB, the MLP untiled.
    let v = plan_w2_json(&[]);
    assert!(json_u64(&v, "planned_peak_bytes") <= 1_700_000_000, "{v}");
    assert_eq!(json_u64(&v["recompute"], "mlp_tiles"), 1);
    // Half a gigabyte: the MLP tiled, and the tiling reported.
    let v = plan_w2_json(&["--memory-budget", "0.5GB"]);
    assert!(json_u64(&v, "planned_peak_bytes") <= 500_000_000, "{v}");
    assert!(json_u64(&v["recompute"], "mlp_tiles") >= 2, "{v}");
    let (ok, out, err) = stepgraph(&[
        "plan",
        "--model",
        "Qwen2.5-7B",
        "--n-layer",
        "5",
        "--n-embd",
        "28",
        "--dtype",
        "bf16",
        "--seq",
        "4096",
        "--step",
        "grads",
        "--memory-budget",
        "0.5GB",
    ]);
    assert!(ok && out.contains("row tiles"), "{out}{err}");
}

#[test]
fn train_with_a_tiled_mlp_gives_the_untiled_losses() {
    let run = |extra: &[&str]| {
        let mut args = vec!["train", "--steps", "3", "--seq", "32", "--batch", "2"];
        args.extend_from_slice(extra);
        let (ok, out, err) = stepgraph(&args);
        assert!(ok, "{err}");
        // "final loss X (first Y) after ..."
        out.lines().find(|l| l.starts_with("final loss")).unwrap().split(" after").next().unwrap().to_string()
    };
    assert_eq!(run(&["--mlp-tiles", "4"]), run(&[]));
}

/// W5 on each of 8 GPUs: full open_llama_3b, bf16, 4 x 2048 tokens per
/// rank (a global batch of 32), cross-entropy, AdamW.
fn plan_w5_8_gpus(extra: &[&str]) -> (serde_json::Value, String) {
    let mut args = vec![
        "plan",
        "--model",
        "open_llama_3b",
        "--dtype",
        "bf16",
        "--batch",
        "32",
        "--seq",
        "2048",
        "--loss",
        "ce",
        "--step",
        "train",
        "--gpus",
        "8",
    ];
    args.extend_from_slice(extra);
    if !extra.contains(&"--master-weights") {
        args.extend(["--master-weights", "none"]);
    }
    let (ok, text, err) = stepgraph(&args);
    assert!(ok, "{err}");
    args.push("--json");
    let (ok, out, err) = stepgraph(&args);
    assert!(ok, "{err}");
    (serde_json::from_str(&out).unwrap(), text)
}

#[test]
fn plan_w5_on_8_gpus_with_and_without_zero1() {
    let (dp, dp_text) = plan_w5_8_gpus(&[]);
    let (z, z_text) = plan_w5_8_gpus(&["--zero1"]);
    let b = |v: &serde_json::Value, side: &str, key: &str| json_u64(&v[side], key);
    let params = 3_426_473_600u64 * 2;
    for v in [&dp, &z] {
        assert_eq!((json_u64(v, "gpus"), json_u64(v, "global_batch"), json_u64(v, "rank_batch")), (8, 32, 4));
        for side in ["single", "per_rank"] {
            let (persistent, arena) = (b(v, side, "persistent_bytes"), b(v, side, "arena_bytes"));
            assert_eq!(b(v, side, "param_bytes"), params, "{side}");
            assert_eq!(persistent, params + b(v, side, "optimizer_state_bytes"), "{side}");
            assert_eq!(b(v, side, "planned_peak_bytes"), persistent + arena, "{side}");
            assert!(b(v, side, "floor_bytes") <= b(v, side, "planned_peak_bytes"), "{side}");
        }
        // bf16 AdamW moments on one GPU: twice the parameters.
        assert_eq!(b(v, "single", "optimizer_state_bytes"), 2 * params);
        // Each rank holds the activations of 4 rows, not 32.
        assert!(b(v, "per_rank", "arena_bytes") * 7 < b(v, "single", "arena_bytes"), "{v}");
        // Every gradient is reduced once per step, in buckets of at least 25 MiB.
        assert_eq!(json_u64(v, "reduced_bytes"), params);
        let buckets = json_u64(v, "buckets");
        assert!(buckets <= params / json_u64(v, "bucket_bytes") + 1 && buckets > 100, "{buckets} buckets");
    }
    assert_eq!(b(&dp, "per_rank", "optimizer_state_bytes"), 2 * params);
    // The default keeps a bf16 compensation per weight beside the moments: one more parameter's bytes.
    let (kahan, _) = plan_w5_8_gpus(&["--master-weights", "kahan"]);
    assert_eq!(b(&kahan, "single", "optimizer_state_bytes"), 3 * params);
    // ZeRO-1: each rank keeps 1/8 of the optimizer state, and only that changes.
    assert_eq!(b(&z, "per_rank", "optimizer_state_bytes") * 8, b(&z, "single", "optimizer_state_bytes"));
    assert_eq!(b(&dp, "per_rank", "persistent_bytes") - b(&z, "per_rank", "persistent_bytes"), 2 * params / 8 * 7);
    assert!(b(&z, "per_rank", "arena_bytes") <= b(&dp, "per_rank", "arena_bytes"));
    assert!(b(&z, "per_rank", "planned_peak_bytes") <= 36_000_000_000, "{z}");
    assert!(b(&dp, "per_rank", "planned_peak_bytes") <= 48_000_000_000, "{dp}");
    assert!(dp_text.starts_with("data parallel over 8 GPUs: global batch 32 = 8 x 4 rows of 2048 tokens"), "{dp_text}");
    assert!(z_text.starts_with("data parallel over 8 GPUs with ZeRO-1"), "{z_text}");
    for needle in ["1 GPU (batch 32)", "per rank (batch 4)", "optimizer", "13705894400 B", "1713236800 B"] {
        assert!(z_text.contains(needle), "no `{needle}` in\n{z_text}");
    }
}

#[test]
fn trace_prints_forward_and_step() {
    let (ok, out, err) = stepgraph(&["trace", "--which", "forward", "--seq", "8"]);
    assert!(ok, "{err}");
    assert!(out.starts_with("# after: build\ntrace forward"), "{out}");
    let (ok, out, _) = stepgraph(&["trace", "--step", "train", "--seq", "8"]);
    assert!(ok);
    assert!(out.contains("== optimizer ==") && out.contains("= adamw"), "{out}");
}

#[test]
fn train_lowers_the_loss() {
    let (ok, out, err) = stepgraph(&["train", "--steps", "60", "--seq", "64", "--batch", "4", "--lr", "1e-2"]);
    assert!(ok, "{err}");
    // "final loss X (first Y) after ..."
    let nums: Vec<f64> =
        out.split(|c: char| !(c.is_ascii_digit() || c == '.')).filter_map(|s| s.parse().ok()).take(2).collect();
    let (last, first) = (nums[0], nums[1]);
    assert!(first > 5.0 && last < first - 1.5, "loss went from {first} to {last}: {out}");
}

#[test]
fn train_on_gpus_fails_clearly_without_a_gpu_or_nccl() {
    let (ok, out, err) = stepgraph(&["train", "--gpus", "1", "--steps", "2", "--seq", "16"]);
    if ok {
        // A machine with a GPU and NCCL: the run itself must have reported.
        assert!(out.contains("final loss"), "{out}");
    } else {
        assert!(err.contains("needs 1 NVIDIA GPU") || err.contains("libnccl"), "{err}");
    }
}

#[test]
fn bad_input_gets_clear_errors() {
    let cases: [(&[&str], &str); 16] = [
        (&["plan", "--model", "gpt-17"], "unknown model name `gpt-17`"),
        (&["plan", "--gpus", "3", "--batch", "4"], "the global batch of 4 rows does not split over 3 ranks"),
        (&["plan", "--zero1"], "--gpus"),
        (&["plan", "--gpus", "2", "--batch", "2", "--zero1", "--step", "grads"], "--zero1 shards the AdamW state"),
        (
            &["plan", "--gpus", "3", "--batch", "3", "--zero1", "--step", "train"],
            "ZeRO-1 over 3 ranks cannot shard param model.embed_tokens.weight",
        ),
        (&["plan", "--model", "open_llama_3b", "--n-head", "3"], "n_embd 3200 is not divisible by n_head 3"),
        (&["plan", "--seq", "100000"], "--seq 100000 exceeds the block size 256 of `tiny-llama`"),
        (&["train", "--data", "no/such/file.txt"], "opening training data no/such/file.txt"),
        (&["train", "--loss", "sum", "--steps", "1"], "training needs the cross-entropy loss"),
        (&["train", "--gpus", "3", "--batch", "4"], "the global batch of 4 rows does not split over 3 ranks"),
        (&["train", "--zero1"], "--gpus"),
        (
            &["train", "--gpus", "3", "--batch", "3", "--zero1"],
            "ZeRO-1 over 3 ranks cannot shard param model.embed_tokens.weight",
        ),
        (&["train", "--gpus", "2", "--rank", "5", "--nccl-id", "/tmp/id"], "--rank 5 is outside a group of 2"),
        (&["train", "--gpus", "2", "--batch", "2", "--rank", "1", "--nccl-id", "/no/such/nccl.id"], "/no/such/nccl.id"),
        (&["train", "--gpus", "2", "--batch", "2", "--memory-budget", "auto"], "every rank plans the same step"),
        (&["plan", "--mlp-tiles", "0"], "--mlp-tiles"),
    ];
    for (args, want) in cases {
        let (ok, _, err) = stepgraph(args);
        assert!(!ok, "{args:?} should fail");
        assert!(err.contains(want), "{args:?}: expected `{want}` in: {err}");
    }
}

#[test]
fn compare_errors_name_the_missing_gpu_or_reference() {
    // Asking for CUDA without a GPU fails before anything is read.
    if !stepgraph_cuda::session::gpu_available() {
        let (ok, _, err) = stepgraph(&["compare", "--backend", "cuda", "--reference", "no/such/dir", "--loss", "sum"]);
        assert!(!ok);
        assert!(err.contains("--device cuda needs an NVIDIA GPU") && err.contains("--device cpu"), "{err}");
    }
    let (ok, _, err) = stepgraph(&["compare", "--backend", "cpu", "--reference", "no/such/dir", "--loss", "sum"]);
    assert!(!ok);
    assert!(err.contains("reading the reference's model config: io error on `no/such/dir/config.json`"), "{err}");
    assert_eq!(err.matches("no/such/dir/config.json").count(), 1, "{err}");
}

/// `train --help` groups its flags under headings, in the order a user
/// reads them, each flag under the one it belongs to.
#[test]
fn train_help_groups_its_flags_under_headings() {
    let (ok, out, err) = stepgraph(&["train", "--help"]);
    assert!(ok, "{err}");
    let headings = [
        "Model:",
        "Data:",
        "Optimization:",
        "Schedule:",
        "Validation:",
        "Checkpoints:",
        "Output:",
        "Devices:",
        "Memory:",
        "Performance tuning:",
    ];
    let at = |needle: &str| out.find(&format!("\n{needle}\n")).unwrap_or_else(|| panic!("no `{needle}` in\n{out}"));
    let positions: Vec<usize> = headings.iter().map(|h| at(h)).collect();
    let mut sorted = positions.clone();
    sorted.sort();
    assert_eq!(positions, sorted, "headings out of order:\n{out}");
    let under = |flag: &str| {
        let p = out.find(&format!("      {flag} ")).unwrap_or_else(|| panic!("no {flag} in\n{out}"));
        headings[positions.iter().rposition(|&h| h < p).expect("a flag before every heading")]
    };
    for (flag, heading) in [
        ("--init-from", "Model:"),
        ("--data", "Data:"),
        ("--lr", "Optimization:"),
        ("--warmup", "Schedule:"),
        ("--eval-every", "Validation:"),
        ("--resume", "Checkpoints:"),
        ("--out", "Output:"),
        ("--gpus", "Devices:"),
        ("--memory-budget", "Memory:"),
        ("--epilogues", "Performance tuning:"),
    ] {
        assert_eq!(under(flag), heading, "{flag}");
    }
}

/// `plan` plans what `train` runs unless told otherwise: the train step,
/// with train's default clipping.
#[test]
fn plan_plans_the_train_step_by_default() {
    let (ok, out, err) = stepgraph(&["plan", "--model", "tiny-llama", "--seq", "16"]);
    assert!(ok, "{err}");
    assert!(out.starts_with("plan for `train`:"), "{out}");
    assert!(out.contains("gradient clipping by global norm"), "{out}");
    let (ok, out, err) = stepgraph(&["plan", "--model", "tiny-llama", "--seq", "16", "--step", "grads"]);
    assert!(ok && out.starts_with("plan for `grads`:"), "{out}{err}");
}

/// A budget that recomputation and MLP tiling cannot meet keeps layer
/// values in host memory between forward and backward: `plan` says how
/// many bytes wait there and move per step, and `train` under that budget
/// gives the losses of the same tiling with every value on the device.
#[test]
fn a_budget_met_by_offload_plans_host_bytes_and_trains_to_the_same_losses() {
    let geometry = [
        "--model",
        "tiny-llama",
        "--n-layer",
        "8",
        "--block-size",
        "2048",
        "--seq",
        "2048",
        "--batch",
        "1",
        "--dtype",
        "f32",
    ];
    let with = |extra: &[&str]| -> Vec<String> { geometry.iter().chain(extra).map(|s| s.to_string()).collect() };
    let args = with(&["--memory-budget", "1"]);
    let (ok, _, err) = plan_with_env(&args.iter().map(String::as_str).collect::<Vec<_>>(), &[]);
    assert!(!ok && err.contains("host memory where that helps"), "{err}");
    let least = err.split("plans ").nth(1).unwrap().split(' ').next().unwrap().to_string();
    let tiles = err.split("with the MLP in ").nth(1).map_or("1", |s| s.split(' ').next().unwrap()).to_string();
    let args = with(&["--memory-budget", &least]);
    let (ok, out, err) = plan_with_env(&args.iter().map(String::as_str).collect::<Vec<_>>(), &[]);
    assert!(ok, "{err}");
    assert!(out.contains("host offload") && out.contains("copied/step") && out.contains("offload: "), "{out}");
    // Text for 2,048-token rows and their validation: the sample four times.
    let text = std::env::temp_dir().join(format!("stepgraph-offload-{}.txt", std::process::id()));
    std::fs::write(&text, std::fs::read_to_string(common::root().join("data/tiny.txt")).unwrap().repeat(4)).unwrap();
    let text = text.to_str().unwrap().to_string();
    let final_loss = |extra: &[&str]| {
        // No validation, which could have the budgeted step planned again.
        let mut args = vec!["train", "--steps", "2", "--eval-every", "0", "--data", &text];
        args.extend(geometry.iter().filter(|a| **a != "f32" && **a != "--dtype"));
        args.extend(["--dtype", "f32"]);
        args.extend_from_slice(extra);
        let (ok, out, err) = stepgraph(&args);
        assert!(ok, "{err}");
        let loss = out.lines().find(|l| l.starts_with("final loss")).unwrap().split(" after").next().unwrap();
        (loss.to_string(), err.contains("host offload"))
    };
    // A megabyte over the least: a budget the offload pass meets with
    // fewer copies than the least takes.
    let budget = (least.parse::<u64>().unwrap() + 1_000_000).to_string();
    let (offloaded, kept) = (final_loss(&["--memory-budget", &budget]), final_loss(&["--mlp-tiles", &tiles]));
    assert!(offloaded.1 && !kept.1, "only the budgeted run offloads");
    assert_eq!(offloaded.0, kept.0);

    // A budget the step meets exactly (its own planned peak under the
    // budget above) leaves validation no room: the step is planned again
    // to leave it that room, and the run trains and validates.
    let args = with(&["--memory-budget", &budget]);
    let (ok, out, err) = plan_with_env(&args.iter().map(String::as_str).collect::<Vec<_>>(), &[]);
    assert!(ok, "{err}");
    let peak = out.lines().find(|l| l.trim_start().starts_with("planned peak")).unwrap();
    let peak = peak.split_whitespace().nth(2).unwrap().to_string();
    let mut args = vec!["train", "--steps", "2", "--eval-every", "1", "--data", &text, "--memory-budget", &peak];
    args.extend(geometry.iter().filter(|a| **a != "f32" && **a != "--dtype"));
    args.extend(["--dtype", "f32"]);
    let (ok, out, err) = stepgraph(&args);
    assert!(ok, "{err}");
    assert!(err.contains("the step planned again to") && err.contains("under --memory-budget"), "{err}");
    assert!(err.contains("validation at step 2: loss"), "{out}\n{err}");
}

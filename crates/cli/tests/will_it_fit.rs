//! `plan --gpu-memory`: one verdict line for a given GPU, built from real
//! plans: the bytes at the peak by kind, fits with how much to spare, or
//! does not fit with the least the step can plan and the flags that would
//! fit, each of which plans what the verdict says.

mod common;
use common::stepgraph;

fn plan(args: &[&str]) -> String {
    let (ok, out, err) = stepgraph(&[&["plan"], args].concat());
    assert!(ok, "{args:?}: {err}");
    out
}

fn verdict(out: &str) -> &str {
    out.lines().find(|l| l.starts_with("verdict: ")).unwrap_or_else(|| panic!("no verdict in:\n{out}"))
}

const LLAMA_8B: [&str; 8] = ["--model", "Meta-Llama-3-8B", "--dtype", "bf16", "--seq", "4096", "--step", "train"];
const LLAMA_1B: [&str; 8] = ["--model", "Llama-3.2-1B", "--dtype", "bf16", "--seq", "4096", "--step", "train"];

/// Full fine-tuning of Llama-3-8B with AdamW on a 24 GB card: the verdict
/// names the plan, the least any memory option reaches (with exact
/// clipping every gradient is live at once, whatever waits in host
/// memory), what its weights and optimizer state take, and what would
/// fit: without clipping, most optimizer state in host memory (and what
/// that copies per step), or adapters over the frozen base.
#[test]
fn an_8b_full_fine_tune_does_not_fit_24gb_and_says_why() {
    let out = plan(&[&LLAMA_8B[..], &["--gpu-memory", "24GB"]].concat());
    let v = verdict(&out);
    assert!(v.starts_with("verdict: does not fit a GPU with 24GB (24.96 GB usable): this step plans 80.38 GB"), "{v}");
    assert!(v.contains("the least it can plan with every memory option is 35.34 GB"), "{v}");
    assert!(v.contains("its weights and optimizer state take 64.24 GB"), "{v}");
    let peak = out.lines().find(|l| l.starts_with("at the peak: ")).expect(&out);
    assert!(peak.contains("weights 16.06 GB, optimizer state 48.18 GB, gradients 16.06 GB"), "{peak}");
    let rows: Vec<&str> = out.lines().skip_while(|l| !l.starts_with("  would fit:")).skip(1).collect();
    assert!(rows[0].trim().starts_with("--clip-grad-norm 0 --memory-budget 24.96GB "), "{out}");
    assert!(rows[0].contains("waits in host memory") && rows[0].contains("copied per step"), "{out}");
    let last = rows.last().unwrap();
    assert!(last.trim().starts_with("--lora-rank 16 --memory-budget 24.96GB "), "{out}");
    assert!(last.contains("LoRA: rank-16 adapters on every linear layer"), "{out}");
    // The same step on an 80 GB and a 141 GB card.
    let v80 = plan(&[&LLAMA_8B[..], &["--gpu-memory", "80GB"]].concat());
    assert!(verdict(&v80).starts_with("verdict: fits a GPU with 80GB with 4.72 GB to spare"), "{v80}");
    let v141 = plan(&[&LLAMA_8B[..], &["--gpu-memory", "141GB"]].concat());
    assert!(verdict(&v141).starts_with("verdict: fits a GPU with 141GB with 70.22 GB to spare"), "{v141}");
}

/// A 1B step that misses 6 GB: the verdict lists flags that fit, and each
/// listed line, run through `plan`, plans the bytes it promised within
/// the budget it names.
#[test]
fn what_would_fit_plans_what_it_says() {
    let out = plan(&[&LLAMA_1B[..], &["--gpu-memory", "6GB"]].concat());
    let v = verdict(&out);
    assert!(v.starts_with("verdict: does not fit a GPU with 6GB"), "{v}");
    assert!(v.contains("the least it can plan with every memory option is 6.52 GB"), "{v}");
    let rows: Vec<&str> = out.lines().skip_while(|l| !l.starts_with("  would fit:")).skip(1).collect();
    assert!(rows.iter().any(|r| r.contains("--clip-grad-norm 0")), "{out}");
    assert!(rows.iter().any(|r| r.contains("--zero1")), "{out}");
    for row in rows {
        let (flags, rest) = row.trim().split_once(" plans ").unwrap();
        let promised = rest.split(" GB").next().unwrap();
        let flags: Vec<&str> = flags.split_whitespace().collect();
        let budget: f64 = flags[flags.iter().position(|f| *f == "--memory-budget").unwrap() + 1]
            .trim_end_matches("GB")
            .parse()
            .unwrap();
        let json = plan(&[&LLAMA_1B[..], &flags, &["--json"]].concat());
        let value: serde_json::Value = serde_json::from_str(&json).unwrap();
        // With --gpus the report is one rank's plan next to the 1-GPU one.
        let peak = value.get("per_rank").unwrap_or(&value)["planned_peak_bytes"].as_u64().expect(&json) as f64 / 1e9;
        assert_eq!(format!("{peak:.2}"), promised, "{row}");
        assert!(peak <= budget, "{row}: {peak} GB over the budget");
    }
}

/// A step that fits says how much is left; a size that is not one is
/// refused naming the flag.
#[test]
fn a_step_that_fits_says_what_is_left_and_bad_sizes_are_refused() {
    let out = plan(&[&LLAMA_1B[..], &["--gpu-memory", "16GB"]].concat());
    assert!(verdict(&out).starts_with("verdict: fits a GPU with 16GB with 2.46 GB to spare"), "{out}");
    let json = plan(&[&LLAMA_1B[..], &["--gpu-memory", "16GB", "--json"]].concat());
    let value: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(value["verdict"]["fits"], true, "{json}");
    assert_eq!(value["verdict"]["at_peak"]["weights"], 2_471_628_800u64, "{json}");
    for (bad, want) in [("lots", "--gpu-memory \"lots\""), ("0.5GB", "less than the CUDA context")] {
        let (ok, _, err) = stepgraph(&[&["plan"], &LLAMA_1B[..], &["--gpu-memory", bad]].concat());
        assert!(!ok && err.contains(want), "{bad}: {err}");
    }
}

/// Planned for a GPU, a step is in bf16 unless `--dtype` says otherwise,
/// as `train` runs it there.
#[test]
fn a_step_planned_for_a_gpu_defaults_to_bf16() {
    let given = plan(&[&LLAMA_1B[..], &["--gpu-memory", "16GB"]].concat());
    let defaulted = plan(&["--model", "Llama-3.2-1B", "--seq", "4096", "--gpu-memory", "16GB"]);
    assert_eq!(verdict(&given), verdict(&defaulted));
    let f32 = plan(&["--model", "Llama-3.2-1B", "--seq", "4096", "--gpu-memory", "16GB", "--dtype", "f32"]);
    assert!(verdict(&f32).starts_with("verdict: does not fit"), "{f32}");
}

/// The question as a user asks it, with every default: Llama-3-8B's
/// train step, planned for a 24 GB card, gets one verdict naming the
/// least plan and what would fit: a full fine-tune without exact
/// clipping, its optimizer state in host memory, or rank-16 adapters.
#[test]
fn will_llama_3_8b_fit_24gb() {
    let out = plan(&["--model", "Meta-Llama-3-8B", "--gpu-memory", "24GB"]);
    assert!(out.starts_with("plan for `train`:"), "{out}");
    let v = verdict(&out);
    assert!(v.starts_with("verdict: does not fit a GPU with 24GB (24.96 GB usable): this step plans 80.32 GB"), "{v}");
    assert!(v.contains("the least it can plan with every memory option is 36.34 GB"), "{v}");
    assert!(out.contains("\n  would fit:\n    --clip-grad-norm 0 --memory-budget 24.96GB "), "{out}");
    assert!(out.contains("\n    --lora-rank 16 --memory-budget 24.96GB "), "{out}");
    // The README shows this command's last lines as they are.
    let readme = std::fs::read_to_string(common::root().join("README.md")).unwrap();
    let shown = readme
        .split("stepgraph plan --model Meta-Llama-3-8B --gpu-memory 24GB\n```\n\nends with\n\n```\n")
        .nth(1)
        .and_then(|rest| rest.split("\n```").next())
        .expect("the README shows the verdict of `plan --gpu-memory 24GB`");
    assert!(out.trim_end().ends_with(shown), "the README shows:\n{shown}\nthe command prints:\n{out}");
}

/// On a 70 GB card the same full fine-tune misses by about the master
/// state's compensation: a budget alone fits it, with part of the
/// optimizer state in host memory (no more than the budget needs: half of
/// the kind the offload starts from would be 7.52 GB, 15.03 GB copied),
/// and says what that copies per step.
#[test]
fn a_budget_fits_llama_3_8b_on_70gb_with_some_state_in_host_memory() {
    let out = plan(&["--model", "Meta-Llama-3-8B", "--gpu-memory", "70GB"]);
    let v = verdict(&out);
    assert!(v.starts_with("verdict: does not fit") && v.contains("but fits under a memory budget"), "{v}");
    let line =
        out.lines().find(|l| l.trim_start().starts_with("--memory-budget 74.35GB")).unwrap_or_else(|| panic!("{out}"));
    assert!(
        line.contains("plans 74.25 GB") && line.contains("6.22 GB waits in host memory, 12.45 GB copied"),
        "{line}"
    );
}

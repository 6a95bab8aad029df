//! The numbers a user watches: the JSONL metrics file (one row per logged
//! training step, one per validation) and its TensorBoard twin, model FLOPs per token and the
//! model-FLOPs utilization (MFU) against a table of GPU peaks.
//!
//! **Invariant:** on resume from step `s` the metrics file keeps only rows
//! of steps up to `s`, so it reads as one run whatever was killed.

use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::Value;

use stepgraph_core::ir::DType;
use stepgraph_core::models::checkpoint::write_atomic;
use stepgraph_core::models::Config;

use crate::tensorboard::EventFile;

/// An append-only JSONL file of metrics rows, with its TensorBoard event
/// file beside it ([`crate::tensorboard`]).
pub struct MetricsFile {
    path: PathBuf,
    file: File,
    events: EventFile,
}

impl MetricsFile {
    /// Opens `path` for a new run (truncated) or, with `resume_step`, keeps
    /// its rows of steps up to that step and appends after them.
    pub fn open(path: &Path, resume_step: Option<usize>) -> Result<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let kept = match (resume_step, File::open(path)) {
            (Some(step), Ok(f)) => BufReader::new(f)
                .lines()
                .map_while(|l| l.ok())
                .filter(|l| {
                    serde_json::from_str::<Value>(l)
                        .ok()
                        .and_then(|v| v["step"].as_u64())
                        .is_some_and(|s| s as usize <= step)
                })
                .collect::<Vec<String>>(),
            _ => Vec::new(),
        };
        // The kept rows go to a new file renamed over the old one, so a
        // kill here loses no row of the run.
        write_atomic(path, |out| kept.iter().try_for_each(|line| writeln!(out, "{line}")))
            .with_context(|| format!("creating the metrics file {}", path.display()))?;
        let file = OpenOptions::new().append(true).open(path).with_context(|| format!("opening {}", path.display()))?;
        let rows: Vec<Value> = kept.iter().filter_map(|l| serde_json::from_str(l).ok()).collect();
        let events = EventFile::create(path, &rows)?;
        Ok(MetricsFile { path: path.to_path_buf(), file, events })
    }

    /// Appends one row.
    pub fn write(&mut self, row: &Value) -> Result<()> {
        writeln!(self.file, "{row}").with_context(|| format!("writing the metrics file {}", self.path.display()))?;
        self.events.write(row)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Model FLOPs of one token of a training step (forward and backward):
/// `6·N` for the `N` trained parameters' matrix products (2 forward, 4
/// backward), `4·F` for the `F` frozen ones (a base under adapters: forward
/// and the input's gradient, no weight gradient), plus attention's score
/// and value products, `12·L·T·d` for `L` layers of width `d` at sequence
/// length `T` (the PaLM paper's appendix B count, which MFU is defined by;
/// a causal mask's skipped half is not subtracted). A mixture of experts
/// counts the experts a token uses, `k` of `E` on each sparse layer: the
/// others' weights ([`Config::idle_expert_weights`]) are left out of the
/// trained count, or of the frozen one when the experts are frozen (under
/// adapters).
pub fn train_flops_per_token(params: usize, frozen: usize, config: &Config, seq: usize) -> f64 {
    let idle = config.idle_expert_weights();
    let (params, frozen) =
        if frozen > 0 && frozen >= idle { (params, frozen - idle) } else { (params.saturating_sub(idle), frozen) };
    6.0 * params as f64 + 4.0 * frozen as f64 + 12.0 * (config.n_layer * seq * config.n_head * config.head_size) as f64
}

/// The frozen weights of `forward` counted as the model computes with
/// them: an NF4 base by its dequantized weights' elements, not its codes.
pub fn frozen_weight_count(forward: &stepgraph_core::ir::Trace) -> usize {
    use stepgraph_core::models::lora::{is_quantized_leaf, quantized_weights};
    let plain: usize = forward
        .frozen()
        .filter(|&v| !forward.value(v).kind.leaf_name().is_some_and(is_quantized_leaf))
        .map(|v| forward.ty(v).numel())
        .sum();
    plain + quantized_weights(forward).iter().map(|q| q.ty.numel()).sum::<usize>()
}

/// The dense peak FLOP/s of a GPU, by the name the driver reports, for the
/// dtype of the matrix products (from NVIDIA's data sheets; dense, without
/// 2:4 sparsity). f32 products run on the CUDA cores (TF32 is off by
/// default). `None` for a GPU not in the table.
pub fn peak_flops(gpu_name: &str, dtype: DType) -> Option<f64> {
    let name = gpu_name.to_ascii_uppercase();
    // (name fragment, bf16/f16 tensor-core TFLOP/s, f32 TFLOP/s)
    const TABLE: [(&str, f64, f64); 7] = [
        ("H200", 989.0, 67.0),
        ("H100 PCIE", 756.0, 51.0),
        ("H100", 989.0, 67.0),
        ("A100", 312.0, 19.5),
        ("L40S", 362.0, 91.6),
        ("A10G", 70.0, 31.2),
        ("RTX 4090", 165.0, 82.6),
    ];
    let (_, half, single) = TABLE.iter().find(|(fragment, ..)| name.contains(fragment))?;
    let tflops = match dtype {
        DType::BF16 | DType::F16 => *half,
        DType::F32 => *single,
        _ => return None,
    };
    Some(tflops * 1e12)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_peaks_come_from_the_table_by_name_and_dtype() {
        assert_eq!(peak_flops("NVIDIA H200", DType::BF16), Some(989e12));
        assert_eq!(peak_flops("NVIDIA H100 PCIe", DType::BF16), Some(756e12));
        assert_eq!(peak_flops("NVIDIA H100 80GB HBM3", DType::F32), Some(67e12));
        assert_eq!(peak_flops("NVIDIA A100-SXM4-80GB", DType::F16), Some(312e12));
        assert_eq!(peak_flops("Some Future GPU", DType::BF16), None);
    }

    #[test]
    fn flops_per_token_count_parameters_and_attention() {
        let c = Config::named("tiny-llama").unwrap();
        let n = 1000;
        let base = train_flops_per_token(n, 0, &c, 0);
        assert_eq!(base, 6000.0);
        let with_attention = train_flops_per_token(n, 0, &c, 64);
        assert_eq!(with_attention - base, (12 * c.n_layer * 64 * c.n_head * c.head_size) as f64);
        // A frozen weight's products: forward and the input's gradient.
        assert_eq!(train_flops_per_token(n, 500, &c, 0), 8000.0);
        // Qwen3-30B-A3B: 8 of 128 experts a token; its 3.3B active parameters
        // (of 30.5B) make the count.
        let moe = Config::named("Qwen3-30B-A3B").unwrap();
        let active = moe.param_count() as usize - moe.idle_expert_weights();
        assert_eq!(active, 3_353_032_704);
        assert_eq!(train_flops_per_token(moe.param_count() as usize, 0, &moe, 0), 6.0 * active as f64);
    }

    #[test]
    fn a_frozen_base_counts_its_weights_as_the_model_computes_with_them() {
        use stepgraph_core::ir::DType;
        use stepgraph_core::models::{build_forward, Adapters, BaseStorage, LoraTarget, LossKind, ModelSpec};
        let full = ModelSpec::named("tiny-llama", 1, 8, DType::BF16, LossKind::CrossEntropy).unwrap();
        let fwd = build_forward(&full).unwrap();
        let all: usize = fwd.params().map(|p| fwd.ty(p).numel()).sum();
        assert_eq!(frozen_weight_count(&fwd), 0);
        for base in [BaseStorage::Model, BaseStorage::Nf4 { double_quant: true }] {
            let adapters = Adapters { base, ..Adapters::new(2, 4.0, LoraTarget::ALL.to_vec()).unwrap() };
            let fwd = build_forward(&ModelSpec { adapters: Some(adapters), ..full.clone() }).unwrap();
            assert_eq!(frozen_weight_count(&fwd), all, "{base:?}");
        }
    }

    #[test]
    fn a_resumed_metrics_file_drops_the_rows_after_the_checkpoint() {
        let dir = std::env::temp_dir().join(format!("stepgraph-metrics-{}", std::process::id()));
        let path = dir.join("m.jsonl");
        let mut m = MetricsFile::open(&path, None).unwrap();
        for step in 1..=5 {
            m.write(&serde_json::json!({"step": step, "loss": 1.0})).unwrap();
        }
        m.write(&serde_json::json!({"step": 4, "val_loss": 2.0})).unwrap();
        drop(m);
        let mut m = MetricsFile::open(&path, Some(3)).unwrap();
        m.write(&serde_json::json!({"step": 4, "loss": 0.5})).unwrap();
        let text = fs::read_to_string(&path).unwrap();
        let steps: Vec<u64> =
            text.lines().map(|l| serde_json::from_str::<Value>(l).unwrap()["step"].as_u64().unwrap()).collect();
        assert_eq!(steps, [1, 2, 3, 4]);
        let last: Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
        assert_eq!(last["loss"], 0.5, "{text}");
        // A new run starts the file afresh.
        drop(MetricsFile::open(&path, None).unwrap());
        assert_eq!(fs::read_to_string(&path).unwrap(), "");
        fs::remove_dir_all(&dir).unwrap();
    }
}

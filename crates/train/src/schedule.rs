//! The learning-rate schedule of a training run and the defaults chosen from
//! the model: linear warm-up from 0 to the peak, then a cosine decay from
//! the peak to a floor at the last step ([`LrSchedule::at`], a pure
//! function of the step), and the peak learning rate that suits a model of a
//! given size ([`default_peak_lr`]).
//!
//! **Invariant:** `LrSchedule::at(step)` depends on the step and the
//! schedule only, so a resumed run recomputes exactly the rates the
//! uninterrupted run would have used.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// Linear warm-up to `peak`, then cosine decay to `min` at step `total`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    /// The rate reached at the end of warm-up.
    pub peak: f64,
    /// Steps of linear warm-up (step `warmup` runs at `peak`).
    pub warmup: usize,
    /// The floor the cosine reaches at the last step.
    pub min: f64,
    /// The run's last step.
    pub total: usize,
}

impl LrSchedule {
    /// A schedule after checking its values; the errors name the flags.
    pub fn new(peak: f64, warmup: usize, min: f64, total: usize) -> Result<Self> {
        if !(peak.is_finite() && peak >= 0.0) {
            bail!("--lr must be a finite non-negative learning rate, got {peak}");
        }
        if !(min.is_finite() && min >= 0.0 && min <= peak) {
            bail!("the floor of the cosine decay (--min-lr) must lie in [0, --lr = {peak}], got {min}");
        }
        if warmup > total {
            bail!("--warmup {warmup} is longer than the run (--steps {total}): use at most {total}");
        }
        Ok(LrSchedule { peak, warmup, min, total })
    }

    /// The learning rate of `step` (counting from 1).
    pub fn at(&self, step: usize) -> f64 {
        if step <= self.warmup {
            return self.peak * step as f64 / self.warmup.max(1) as f64;
        }
        let decay_steps = self.total.saturating_sub(self.warmup);
        if decay_steps == 0 {
            return self.peak;
        }
        let progress = ((step - self.warmup) as f64 / decay_steps as f64).min(1.0);
        let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        self.min + (self.peak - self.min) * cosine
    }
}

/// A default with where it comes from, to print at start.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Chosen<T> {
    pub value: T,
    pub source: &'static str,
}

/// The peak learning rate for a model of `params` parameters (all of them,
/// embeddings included), trained from scratch or fine-tuned from
/// pretrained weights (`fine_tuning`).
///
/// From scratch, the rate falls with the model's size as in the published
/// pre-training recipes (AdamW, batch sizes of 0.5–4 M tokens):
/// - GPT-3 (Brown et al. 2020, table 2.1): 125M 6e-4, 350M 3e-4, 1.3B 2e-4,
///   2.7B 1.6e-4, 6.7B 1.2e-4, 13B 1e-4, 175B 6e-5;
/// - Pythia (Biderman et al. 2023, table 7): 70M 1e-3, 160M 6e-4, 410M 3e-4,
///   1B 3e-4, 1.4B 2e-4, 2.8B 1.6e-4, 6.9B and 12B 1.2e-4;
/// - Llama 2 (Touvron et al. 2023, table 1): 7B and 13B 3e-4, 70B 1.5e-4;
///   litgpt's TinyLlama-1.1B pre-training config: 4e-4.
///
/// Below 20M parameters (this repository's `tiny-llama`, byte-level) the
/// rate is 3e-3, tuned here: it lowers the loss fastest in the CLI tests'
/// runs without diverging.
///
/// Fine-tuning all weights uses far smaller rates: 5e-5 is Hugging Face
/// `Trainer`'s default `learning_rate` (models up to ~1B), 2e-5 what the
/// Stanford Alpaca and Vicuna recipes use for full fine-tuning of 7–13B
/// Llama models; below 20M parameters a tenth of the from-scratch rate.
pub fn default_peak_lr(params: usize, fine_tuning: bool) -> Chosen<f64> {
    const M: usize = 1_000_000;
    const B: usize = 1_000_000_000;
    let (value, source) = if fine_tuning {
        match params {
            p if p < 20 * M => (3e-4, "a tenth of the tiny-model pre-training rate"),
            p if p < 1_500 * M => (5e-5, "Hugging Face Trainer's fine-tuning default"),
            _ => (2e-5, "full fine-tuning of 7-13B Llama models (Alpaca, Vicuna)"),
        }
    } else {
        match params {
            p if p < 20 * M => (3e-3, "tuned for the byte-level tiny-llama runs"),
            p if p < 100 * M => (1e-3, "Pythia-70M"),
            p if p < 250 * M => (6e-4, "GPT-3 Small 125M, Pythia-160M"),
            p if p < 700 * M => (3e-4, "GPT-3 350M, Pythia-410M"),
            p if p < 2 * B => (2e-4, "GPT-3 1.3B, Pythia-1.4B"),
            p if p < 4 * B => (1.6e-4, "GPT-3 2.7B, Pythia-2.8B"),
            p if p < 10 * B => (1.2e-4, "GPT-3 6.7B, Pythia-6.9B"),
            p if p < 50 * B => (1e-4, "GPT-3 13B"),
            _ => (6e-5, "GPT-3 175B"),
        }
    };
    Chosen { value, source }
}

/// The default peak learning rate for training low-rank adapters over a
/// base of `base_params` parameters: 2e-4, the QLoRA paper's rate for
/// 7B–13B Llama models (and what `peft`'s examples use), 1e-4 from 20B
/// parameters on (the paper's rate for 33B and 65B). Adapters start at
/// zero and hold a few million weights, so they take rates ten times those
/// of full fine-tuning.
pub fn default_adapter_lr(base_params: usize) -> Chosen<f64> {
    if base_params < 20_000_000_000 {
        Chosen { value: 2e-4, source: "QLoRA's rate for 7-13B models" }
    } else {
        Chosen { value: 1e-4, source: "QLoRA's rate for 33-65B models" }
    }
}

/// Warm-up steps when `--warmup` is not given: 5% of the run, at least 1
/// and at most 2000 (litgpt's pre-training default `lr_warmup_steps`).
pub fn default_warmup(steps: usize) -> Chosen<usize> {
    Chosen { value: steps.div_ceil(20).clamp(1, 2000).min(steps), source: "5% of the steps, at most 2000 (litgpt)" }
}

/// The cosine floor as a fraction of the peak when neither `--min-lr` nor
/// `--min-lr-ratio` is given: 10%, as in Chinchilla and Llama 2.
pub const DEFAULT_MIN_LR_RATIO: f64 = 0.1;

/// A learning rate as people write it: `3e-3`, `1.2e-4`, `0.01`, `30`.
pub fn short(x: f64) -> String {
    if (1e-2..1e4).contains(&x) {
        return format!("{x}");
    }
    let s = format!("{x:.3e}");
    let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
    let mantissa = mantissa.trim_end_matches('0').trim_end_matches('.');
    if exp == "0" {
        mantissa.to_string()
    } else {
        format!("{mantissa}e{exp}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warm_up_is_linear_and_the_cosine_ends_at_the_floor() {
        let s = LrSchedule::new(1.0, 4, 0.1, 14).unwrap();
        assert_eq!([s.at(1), s.at(2), s.at(4)], [0.25, 0.5, 1.0]);
        // Half-way through the decay the cosine is at the mid-point.
        assert!((s.at(9) - 0.55).abs() < 1e-12, "{}", s.at(9));
        assert_eq!(s.at(14), 0.1);
        // Monotone after the peak, never under the floor.
        let rates: Vec<f64> = (4..=14).map(|t| s.at(t)).collect();
        assert!(rates.windows(2).all(|w| w[1] < w[0]), "{rates:?}");
        assert_eq!(s.at(20), 0.1);
    }

    #[test]
    fn degenerate_schedules_stay_finite() {
        // No warm-up: step 1 starts the decay just under the peak.
        let s = LrSchedule::new(2.0, 0, 0.0, 10).unwrap();
        assert!(s.at(1) < 2.0 && s.at(1) > 1.9);
        // Warm-up as long as the run: it ends at the peak.
        let s = LrSchedule::new(2.0, 5, 0.2, 5).unwrap();
        assert_eq!(s.at(5), 2.0);
        let s = LrSchedule::new(1e-3, 1, 1e-4, 1).unwrap();
        assert_eq!(s.at(1), 1e-3);
    }

    #[test]
    fn bad_schedules_name_the_flag() {
        let e = LrSchedule::new(f64::NAN, 1, 0.0, 10).unwrap_err().to_string();
        assert!(e.contains("--lr") && e.contains("NaN"), "{e}");
        let e = LrSchedule::new(1e-3, 1, 2e-3, 10).unwrap_err().to_string();
        assert!(e.contains("--min-lr") && e.contains("0.002"), "{e}");
        let e = LrSchedule::new(1e-3, 11, 0.0, 10).unwrap_err().to_string();
        assert!(e.contains("--warmup 11") && e.contains("--steps 10"), "{e}");
    }

    #[test]
    fn the_default_rate_falls_with_the_model_size() {
        let sizes = [5e6, 7e7, 1.6e8, 4e8, 1.1e9, 2.8e9, 7e9, 1.3e10, 7e10].map(|p| p as usize);
        let scratch: Vec<f64> = sizes.iter().map(|&p| default_peak_lr(p, false).value).collect();
        assert_eq!(scratch, [3e-3, 1e-3, 6e-4, 3e-4, 2e-4, 1.6e-4, 1.2e-4, 1e-4, 6e-5]);
        // 1-8B pre-training sits in the 1e-4..4e-4 band of the public recipes.
        for p in [1_000_000_000usize, 3_000_000_000, 8_000_000_000] {
            let lr = default_peak_lr(p, false).value;
            assert!((1e-4..=4e-4).contains(&lr), "{p}: {lr}");
        }
        // Fine-tuning is always gentler than pre-training the same model.
        for &p in &sizes {
            assert!(default_peak_lr(p, true).value <= default_peak_lr(p, false).value / 3.0, "{p}");
        }
        assert_eq!(default_peak_lr(7_600_000_000, true).value, 2e-5);
        // tiny-llama keeps the rate tuned for it.
        assert_eq!(default_peak_lr(3_000_000, false).value, 3e-3);
    }

    #[test]
    fn the_default_warm_up_is_a_twentieth_of_the_run() {
        assert_eq!(default_warmup(200).value, 10);
        assert_eq!(default_warmup(1).value, 1);
        assert_eq!(default_warmup(7).value, 1);
        assert_eq!(default_warmup(1_000_000).value, 2000);
    }
}

//! Divergence caught at the step it happens: a band around the run's
//! recent best loss, checked after every step.
//!
//! A run has diverged when either
//! - **its loss rises far above its best**: the mean of the last
//!   [`WINDOW`] losses is above [`RISE_FACTOR`] times the lowest such mean
//!   seen so far *and* at least [`RISE_MARGIN`] nats above it (the margin
//!   keeps a fine-tuning run at loss 0.3 from tripping on a hard batch of
//!   0.7), or
//! - **it collapsed to the uniform model**: the loss is the cross-entropy
//!   of equal logits over the vocabulary, `ln(vocab)`, to within
//!   [`UNIFORM_TOLERANCE`], while the gradient norm is zero. A freshly
//!   initialized model also scores about `ln(vocab)`, but its gradient is
//!   not zero; a model whose weights blew up and saturated has logits that
//!   no longer depend on the input and a gradient of exactly zero.
//!
//! **Where it began.** The divergence is dated from the step of the best
//! smoothed loss: the weights of that step are the last ones known good,
//! so the checkpoint to go back to is the newest one saved at or before it
//! ([`DivergenceMonitor::last_good_step`]), and `--keep` never deletes it.

use std::collections::VecDeque;

/// Losses averaged for the rise test.
pub const WINDOW: usize = 5;
/// The smoothed loss must exceed the best by this factor...
pub const RISE_FACTOR: f64 = 2.0;
/// ... and by this many nats.
pub const RISE_MARGIN: f64 = 1.0;
/// Relative distance to `ln(vocab)` within which a loss is the uniform model's.
pub const UNIFORM_TOLERANCE: f64 = 1e-3;
/// A gradient norm at or below this is zero.
const ZERO_NORM: f64 = 1e-12;

/// Why a run was judged diverged at a step.
#[derive(Clone, Debug, PartialEq)]
pub enum Divergence {
    /// The smoothed loss rose `factor` times above the best (`best`, at step `best_step`).
    Rose { smoothed: f64, best: f64, best_step: usize },
    /// The loss is the uniform model's over `vocab` tokens, with a zero gradient.
    Collapsed { loss: f64, vocab: usize, best: f64, best_step: usize },
}

impl Divergence {
    /// The step whose weights were the last known good.
    pub fn best_step(&self) -> usize {
        match self {
            Divergence::Rose { best_step, .. } | Divergence::Collapsed { best_step, .. } => *best_step,
        }
    }

    /// What happened, in a sentence.
    pub fn describe(&self, step: usize) -> String {
        match self {
            Divergence::Rose { smoothed, best, best_step } => format!(
                "the loss diverged at step {step}: the mean of the last {WINDOW} losses, {smoothed:.4}, is {:.1}x \
                 its best, {best:.4} (at step {best_step})",
                smoothed / best
            ),
            Divergence::Collapsed { loss, vocab, best, best_step } => format!(
                "the model collapsed at step {step}: the loss {loss:.4} is that of equal logits over the {vocab} \
                 tokens (ln {vocab} = {:.4}) and the gradient norm is 0, so nothing will train it further \
                 (its best loss was {best:.4}, at step {best_step})",
                (*vocab as f64).ln()
            ),
        }
    }
}

/// Watches the losses of a run, step by step. Checkpoints carry it, so a
/// resumed run judges its steps exactly as the run never stopped would.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DivergenceMonitor {
    vocab: usize,
    recent: VecDeque<f64>,
    /// The lowest smoothed loss so far and the step it was reached at.
    best: Option<(f64, usize)>,
}

impl DivergenceMonitor {
    /// A monitor for a model whose logits span `vocab` tokens.
    pub fn new(vocab: usize) -> Self {
        DivergenceMonitor { vocab, recent: VecDeque::with_capacity(WINDOW), best: None }
    }

    /// Takes the finite loss of `step` and its gradient norm (when the step
    /// computes one); returns why the run diverged at this step, if it did.
    pub fn observe(&mut self, step: usize, loss: f64, grad_norm: Option<f64>) -> Option<Divergence> {
        if self.recent.len() == WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(loss);
        let smoothed = self.smoothed();
        let (best, best_step) = match self.best {
            Some((b, s)) if b <= smoothed => (b, s),
            _ => {
                self.best = Some((smoothed, step));
                (smoothed, step)
            }
        };
        if smoothed > RISE_FACTOR * best && smoothed > best + RISE_MARGIN {
            return Some(Divergence::Rose { smoothed, best, best_step });
        }
        let uniform = (self.vocab as f64).ln();
        let dead = grad_norm.is_some_and(|g| g <= ZERO_NORM);
        if dead && (loss - uniform).abs() <= UNIFORM_TOLERANCE * uniform {
            return Some(Divergence::Collapsed { loss, vocab: self.vocab, best, best_step });
        }
        None
    }

    /// The mean of the last [`WINDOW`] losses.
    pub fn smoothed(&self) -> f64 {
        self.recent.iter().sum::<f64>() / self.recent.len().max(1) as f64
    }

    /// The step of the best smoothed loss so far: checkpoints saved at or
    /// before it hold weights from before any divergence.
    pub fn last_good_step(&self) -> Option<usize> {
        self.best.map(|(_, s)| s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(losses: &[(f64, Option<f64>)], vocab: usize) -> (Option<(usize, Divergence)>, DivergenceMonitor) {
        let mut m = DivergenceMonitor::new(vocab);
        for (i, &(loss, norm)) in losses.iter().enumerate() {
            if let Some(d) = m.observe(i + 1, loss, norm) {
                return (Some((i + 1, d)), m);
            }
        }
        (None, m)
    }

    #[test]
    fn an_exploding_loss_is_caught_at_the_step_it_explodes() {
        let (hit, _) = run(&[(5.6, Some(2.5)), (4.5e6, Some(3.6e7)), (5.545, Some(0.0))], 256);
        let (step, d) = hit.unwrap();
        assert_eq!(step, 2);
        assert!(matches!(d, Divergence::Rose { best_step: 1, .. }), "{d:?}");
        assert!(d.describe(2).contains("diverged at step 2"), "{}", d.describe(2));
    }

    #[test]
    fn a_dead_uniform_model_is_caught_but_a_fresh_one_is_not() {
        let uniform = 256f64.ln();
        // A fresh model: the uniform loss with a gradient.
        let (hit, _) = run(&[(uniform, Some(2.5)), (uniform - 0.01, Some(2.4))], 256);
        assert_eq!(hit, None);
        // Without a gradient norm there is no telling, and nothing is claimed.
        let (hit, _) = run(&[(uniform, None), (uniform, None)], 256);
        assert_eq!(hit, None);
        // A model that learned a little and then went flat at ln(vocab) with a zero gradient.
        let (hit, _) = run(&[(5.0, Some(2.0)), (4.9, Some(2.0)), (uniform, Some(0.0))], 256);
        let (step, d) = hit.unwrap();
        assert_eq!(step, 3);
        assert!(matches!(d, Divergence::Collapsed { vocab: 256, best_step: 2, .. }), "{d:?}");
    }

    #[test]
    fn noisy_but_healthy_runs_are_not_flagged() {
        // A fine-tuning run at a low loss with a batch twice as hard: the margin holds.
        let losses: Vec<(f64, Option<f64>)> =
            [0.4, 0.35, 0.9, 0.3, 0.32, 0.8, 0.31].iter().map(|&l| (l, Some(1.0))).collect();
        assert_eq!(run(&losses, 32000).0, None);
        // A pre-training run falling from ln(V) with noise.
        let losses: Vec<(f64, Option<f64>)> =
            (0..50).map(|i| (5.5 - 0.05 * i as f64 + if i % 3 == 0 { 0.4 } else { 0.0 }, Some(1.0))).collect();
        assert_eq!(run(&losses, 256).0, None);
    }

    #[test]
    fn a_slow_rise_dates_the_divergence_from_the_best_step() {
        let mut losses: Vec<(f64, Option<f64>)> = (0..10).map(|i| (5.0 - 0.2 * i as f64, Some(1.0))).collect();
        losses.extend((0..20).map(|i| (3.5 + 0.5 * i as f64, Some(5.0))));
        let (hit, m) = run(&losses, 256);
        let (step, d) = hit.unwrap();
        assert!(step > 10, "{step}");
        // The best smoothed loss is reached just as the rise begins.
        assert!((9..=13).contains(&d.best_step()), "{d:?}");
        assert_eq!(m.last_good_step(), Some(d.best_step()));
    }
}

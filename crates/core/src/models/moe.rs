//! What a mixture-of-experts model's step holds for its experts, as `plan`
//! reports it ([`ExpertsReport`]): the expert weights, the routed
//! activations of one sparse layer (every buffer sized for `tokens × k`
//! rows, whatever the router decides, since routing is dropless), and the
//! most rows one expert can receive.

use serde::Serialize;

use super::gpt::ModelSpec;

/// The experts of a [`ModelSpec`] whose config has them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ExpertsReport {
    /// Layers with experts.
    pub sparse_layers: usize,
    /// Experts per sparse layer.
    pub experts: usize,
    /// Experts each token is routed to.
    pub experts_per_token: usize,
    /// Hidden width of one expert's MLP.
    pub expert_width: usize,
    /// Every sparse layer's router and expert matrices (a shared expert's
    /// included), in the model's dtype.
    pub expert_weight_bytes: u64,
    /// Rows one sparse layer routes: tokens × experts per token.
    pub routed_rows: usize,
    /// One sparse layer's routed activations: the gathered inputs, the
    /// gate and up products, their SwiGLU, the down product and the
    /// outputs in token order (each `routed_rows` rows).
    pub routed_bytes_per_layer: u64,
    /// The most rows one expert receives: every token choosing it.
    pub worst_expert_rows: usize,
    /// That expert's activations at the worst split (the same six buffers
    /// over its rows), beside its weights.
    pub worst_expert_bytes: u64,
}

impl ExpertsReport {
    /// The report of `spec`, or `None` for a dense model.
    pub fn of(spec: &ModelSpec) -> Option<ExpertsReport> {
        let cfg = &spec.config;
        let moe = cfg.moe.as_ref()?;
        let size = spec.dtype.size() as u64;
        let (c, f) = (cfg.n_embd as u64, moe.expert_intermediate_size as u64);
        let sparse_layers = moe.sparse_layers(cfg.n_layer);
        let shared = moe.shared_expert.map_or(0, |w| 3 * w as u64 * c + c);
        let per_layer_weights = moe.experts as u64 * (3 * f * c + c) + shared;
        let tokens = spec.batch * spec.seq;
        let routed_rows = tokens * moe.experts_per_token;
        // Per row: the gathered input (C), gate, up and their SwiGLU (3F),
        // the down product and the output back in token order (2C).
        let row_bytes = (3 * c + 3 * f) * size;
        Some(ExpertsReport {
            sparse_layers,
            experts: moe.experts,
            experts_per_token: moe.experts_per_token,
            expert_width: moe.expert_intermediate_size,
            expert_weight_bytes: sparse_layers as u64 * per_layer_weights * size,
            routed_rows,
            routed_bytes_per_layer: routed_rows as u64 * row_bytes,
            worst_expert_rows: tokens,
            worst_expert_bytes: tokens as u64 * row_bytes,
        })
    }
}

impl std::fmt::Display for ExpertsReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gb = |b: u64| b as f64 / 1e9;
        writeln!(
            f,
            "experts: {} sparse layers of {} experts ({} per token, width {}): {:.3} GB of expert and router weights",
            self.sparse_layers,
            self.experts,
            self.experts_per_token,
            self.expert_width,
            gb(self.expert_weight_bytes)
        )?;
        writeln!(
            f,
            "  routed rows per sparse layer: {} (tokens × {}), {:.3} GB of routed activations, whatever the split",
            self.routed_rows,
            self.experts_per_token,
            gb(self.routed_bytes_per_layer)
        )?;
        writeln!(
            f,
            "  one expert takes at most {} rows (every token choosing it): {:.3} GB of activations beside its weights",
            self.worst_expert_rows,
            gb(self.worst_expert_bytes)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::DType;
    use crate::models::LossKind;

    #[test]
    fn qwen3_moe_reports_its_experts_and_routed_rows() {
        let spec = ModelSpec::named("Qwen3-30B-A3B", 1, 4096, DType::BF16, LossKind::CrossEntropy).unwrap();
        let r = ExpertsReport::of(&spec).unwrap();
        assert_eq!((r.sparse_layers, r.experts, r.experts_per_token, r.expert_width), (48, 128, 8, 768));
        // 48 layers × 128 experts × (3 · 768 · 2048 + 2048) × 2 bytes.
        assert_eq!(r.expert_weight_bytes, 48 * 128 * (3 * 768 * 2048 + 2048) * 2);
        assert_eq!((r.routed_rows, r.worst_expert_rows), (4096 * 8, 4096));
        assert_eq!(r.routed_bytes_per_layer, 4096 * 8 * (3 * 2048 + 3 * 768) * 2);
        let text = r.to_string();
        assert!(text.contains("48 sparse layers of 128 experts (8 per token, width 768)"), "{text}");
        let dense = ModelSpec::named("tiny-llama", 1, 64, DType::BF16, LossKind::CrossEntropy).unwrap();
        assert!(ExpertsReport::of(&dense).is_none());
    }
}

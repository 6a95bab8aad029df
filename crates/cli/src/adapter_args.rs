//! The LoRA and QLoRA flags of the commands that build a step (`plan`,
//! `trace`, `train`): whether the model trains low-rank adapters over a
//! frozen base, and how that base is stored.

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};

use stepgraph_core::models::lora::TargetRank;
use stepgraph_core::models::{Adapters, BaseStorage, LoraTarget};

/// How the frozen base of an adapter run is stored.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum BaseDTypeArg {
    /// The model's dtype (--dtype).
    Model,
    /// 4-bit NormalFloat with a scale per 64 weights (QLoRA).
    Nf4,
}

#[derive(Args, Clone, Debug, Default)]
pub struct AdapterArgs {
    /// Train low-rank adapters of this rank beside the chosen linear layers
    /// instead of every weight (LoRA); the base model is frozen.
    #[arg(help_heading = "Adapters (LoRA)", long, value_name = "R")]
    pub lora_rank: Option<usize>,
    /// The adapters' alpha: their product is scaled by alpha / rank [default: twice the rank].
    #[arg(help_heading = "Adapters (LoRA)", long, value_name = "ALPHA", requires = "lora_rank")]
    pub lora_alpha: Option<f64>,
    /// The linear layers that get adapters: comma-separated q, k, v, o, gate, up, down, the
    /// routed experts' experts_gate_up and experts_down (experts: both), router, or all-linear
    /// (every one the model has but the router) [default: all-linear].
    #[arg(help_heading = "Adapters (LoRA)", long, value_name = "LIST", requires = "lora_rank")]
    pub lora_targets: Option<String>,
    /// Dropout on the adapters' inputs while training [default: 0].
    #[arg(help_heading = "Adapters (LoRA)", long, value_name = "P", requires = "lora_rank")]
    pub lora_dropout: Option<f64>,
    /// How the frozen base is stored: the model's dtype, or nf4 (QLoRA: 4-bit NormalFloat,
    /// quantized as it loads) [default: model].
    #[arg(help_heading = "Adapters (LoRA)", long, value_enum)]
    pub base_dtype: Option<BaseDTypeArg>,
    /// With --base-dtype nf4: quantize the block scales too (8 bits per 64 weights' scale,
    /// about 0.37 bits per weight saved).
    #[arg(help_heading = "Adapters (LoRA)", long)]
    pub double_quant: bool,
    /// The ranks an adapter folder gives some targets of its own (peft's
    /// `rank_pattern`); no flag sets them.
    #[arg(skip)]
    pub folder_ranks: Vec<TargetRank>,
}

impl AdapterArgs {
    /// These flags with the settings of an adapter folder filled in: the
    /// folder's rank, alpha, dropout and targets, each of which a flag
    /// given as well must equal.
    pub fn with_folder(&self, folder: &Adapters, dir: &std::path::Path) -> Result<AdapterArgs> {
        let differs = |flag: &str, given: String, folder: String| {
            anyhow::anyhow!(
                "{flag} {given} differs from the {folder} of --adapter {}: drop the flag to continue the folder's \
                 adapters as they are",
                dir.display()
            )
        };
        if let Some(r) = self.lora_rank.filter(|&r| r != folder.rank) {
            return Err(differs("--lora-rank", r.to_string(), format!("rank {}", folder.rank)));
        }
        if let Some(a) = self.lora_alpha.filter(|&a| a != folder.alpha) {
            return Err(differs("--lora-alpha", a.to_string(), format!("alpha {}", folder.alpha)));
        }
        if let Some(d) = self.lora_dropout.filter(|&d| d != folder.dropout) {
            return Err(differs("--lora-dropout", d.to_string(), format!("dropout {}", folder.dropout)));
        }
        let short = |ts: &[LoraTarget]| ts.iter().map(|t| t.short()).collect::<Vec<_>>().join(",");
        if let Some(list) = &self.lora_targets {
            let given = LoraTarget::parse_list(list).map_err(|e| anyhow::anyhow!("--lora-targets: {e}"))?;
            if given != folder.targets {
                return Err(differs("--lora-targets", list.clone(), format!("targets {}", short(&folder.targets))));
            }
        }
        Ok(AdapterArgs {
            lora_rank: Some(folder.rank),
            lora_alpha: Some(folder.alpha),
            lora_targets: Some(short(&folder.targets)),
            lora_dropout: Some(folder.dropout),
            folder_ranks: folder.ranks.clone(),
            ..self.clone()
        })
    }

    /// The adapters these flags ask for; `None` without `--lora-rank`.
    pub fn adapters(&self) -> Result<Option<Adapters>> {
        let Some(rank) = self.lora_rank else {
            if self.double_quant || self.base_dtype.is_some() {
                let flag = if self.double_quant { "--double-quant" } else { "--base-dtype" };
                bail!("{flag} sets how the frozen base of adapters is stored: train adapters with --lora-rank R");
            }
            return Ok(None);
        };
        if rank == 0 {
            bail!("--lora-rank 0 trains nothing: give a rank of at least 1 (8, 16 and 64 are common)");
        }
        let targets = match &self.lora_targets {
            Some(list) => LoraTarget::parse_list(list).map_err(|e| anyhow::anyhow!("--lora-targets: {e}"))?,
            None => LoraTarget::ALL.to_vec(),
        };
        let base = match (self.base_dtype.unwrap_or(BaseDTypeArg::Model), self.double_quant) {
            (BaseDTypeArg::Model, true) => {
                bail!("--double-quant quantizes the scales of an nf4 base: add --base-dtype nf4, or drop it")
            }
            (BaseDTypeArg::Model, false) => BaseStorage::Model,
            (BaseDTypeArg::Nf4, double_quant) => BaseStorage::Nf4 { double_quant },
        };
        let adapters = Adapters {
            rank,
            alpha: self.lora_alpha.unwrap_or(2.0 * rank as f64),
            targets,
            dropout: self.lora_dropout.unwrap_or(0.0),
            base,
            ranks: self.folder_ranks.clone(),
        };
        adapters.validate()?;
        Ok(Some(adapters))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_all_linear_layers_at_alpha_twice_the_rank() {
        let a = AdapterArgs { lora_rank: Some(16), ..Default::default() }.adapters().unwrap().unwrap();
        assert_eq!((a.rank, a.alpha, a.dropout), (16, 32.0, 0.0));
        assert_eq!(a.targets, LoraTarget::ALL.to_vec());
        assert_eq!(a.base, BaseStorage::Model);
        assert!(AdapterArgs::default().adapters().unwrap().is_none());
    }

    #[test]
    fn a_folders_settings_fill_the_flags_and_a_different_flag_is_refused() {
        let folder = Adapters::new(16, 32.0, vec![LoraTarget::Q, LoraTarget::V]).unwrap();
        let dir = std::path::Path::new("adapter");
        let args = AdapterArgs { base_dtype: Some(BaseDTypeArg::Nf4), ..Default::default() };
        let a = args.with_folder(&folder, dir).unwrap().adapters().unwrap().unwrap();
        assert_eq!((a.rank, a.alpha, &a.targets), (16, 32.0, &folder.targets));
        assert_eq!(a.base, BaseStorage::Nf4 { double_quant: false });
        let same = AdapterArgs { lora_rank: Some(16), lora_targets: Some("v,q".into()), ..Default::default() };
        assert!(same.with_folder(&folder, dir).is_ok());
        let e = AdapterArgs { lora_rank: Some(8), ..Default::default() }.with_folder(&folder, dir).unwrap_err();
        assert!(e.to_string().contains("--lora-rank 8 differs from the rank 16"), "{e}");
    }

    #[test]
    fn bad_combinations_say_what_to_change() {
        let e = AdapterArgs { lora_rank: Some(0), ..Default::default() }.adapters().unwrap_err().to_string();
        assert!(e.contains("--lora-rank 0"), "{e}");
        let e = AdapterArgs { lora_rank: Some(8), double_quant: true, ..Default::default() }
            .adapters()
            .unwrap_err()
            .to_string();
        assert!(e.contains("--base-dtype nf4"), "{e}");
        let e = AdapterArgs { lora_rank: Some(8), lora_targets: Some("q,x".into()), ..Default::default() }
            .adapters()
            .unwrap_err()
            .to_string();
        assert!(e.contains("--lora-targets") && e.contains("`x`"), "{e}");
        let e = AdapterArgs { lora_rank: Some(8), lora_dropout: Some(1.5), ..Default::default() }
            .adapters()
            .unwrap_err()
            .to_string();
        assert!(e.contains("--lora-dropout"), "{e}");
        let e = AdapterArgs { base_dtype: Some(BaseDTypeArg::Nf4), ..Default::default() }
            .adapters()
            .unwrap_err()
            .to_string();
        assert!(e.contains("--base-dtype") && e.contains("--lora-rank"), "{e}");
        let nf4 = AdapterArgs {
            lora_rank: Some(8),
            base_dtype: Some(BaseDTypeArg::Nf4),
            double_quant: true,
            ..Default::default()
        };
        assert_eq!(nf4.adapters().unwrap().unwrap().base, BaseStorage::Nf4 { double_quant: true });
    }
}

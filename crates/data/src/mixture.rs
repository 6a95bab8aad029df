//! Mixtures of inputs (`--input a.jsonl:0.7 b.parquet:0.3`): the spelling
//! of a weighted input, and the choice of documents that gives each input
//! its share of the tokens.
//!
//! Input `i`'s share is `w_i / Σw`. The mixture is as large as the input
//! that runs out first allows (the "first exhausted" rule of Hugging Face
//! `datasets`' `interleave_datasets`): all of that input's documents are
//! used, and every other input gives a sample of its documents, drawn
//! without replacement in an order seeded by `--seed`, until its tokens
//! reach its share. A sample ends within half a document of its share, so
//! the shares hold to a fraction of a percent when documents are small next
//! to the mixture. No document is used twice, so the validation split drawn
//! from the mixture never holds a copy of a training document, and the
//! mixture is never larger than its inputs.

use std::path::PathBuf;

use rand::seq::SliceRandom;
use rand::SeedableRng;

use crate::error::{Error, Result};

/// Splits `PATH[:WEIGHT]` on its last `:` when what follows parses as a
/// number, so paths holding `:` still work (`dir:v2/a.jsonl` is a path;
/// `a:1.jsonl:1` is `a:1.jsonl` with weight 1). A weight must be positive
/// and finite.
pub fn parse_input(spec: &str) -> Result<(PathBuf, Option<f64>)> {
    let Some((path, weight)) = spec.rsplit_once(':').and_then(|(p, w)| Some((p, w.trim().parse::<f64>().ok()?))) else {
        return Ok((PathBuf::from(spec), None));
    };
    if path.is_empty() {
        return Err(Error::Options(format!("--input {spec}: no file before the weight (spelled FILE:WEIGHT)")));
    }
    check_weight(weight, spec)?;
    Ok((PathBuf::from(path), Some(weight)))
}

/// Refuses a weight that is zero, negative, infinite or NaN.
pub fn check_weight(weight: f64, input: &str) -> Result<()> {
    if weight.is_finite() && weight > 0.0 {
        Ok(())
    } else {
        Err(Error::Options(format!(
            "--input {input}: a mixture weight must be positive and finite, got {weight} \
             (weights need not add up to 1: they are normalised)"
        )))
    }
}

/// The shares of `weights`, normalised to add up to 1.
pub fn shares(weights: &[f64]) -> Vec<f64> {
    let total: f64 = weights.iter().sum();
    weights.iter().map(|w| w / total).collect()
}

/// For each input (given by its documents' token counts), the indices of
/// the documents the mixture takes, in the order drawn. The seed of input
/// `i` is derived from `seed` and `i`, so adding an input does not change
/// the draw of the others.
pub fn choose(doc_tokens: &[Vec<u64>], weights: &[f64], seed: u64) -> Vec<Vec<usize>> {
    assert_eq!(doc_tokens.len(), weights.len(), "a weight per input");
    let shares = shares(weights);
    let totals: Vec<f64> = doc_tokens.iter().map(|d| d.iter().sum::<u64>() as f64).collect();
    // The token count of the whole mixture: the largest every input can fill.
    let size = totals.iter().zip(&shares).map(|(t, s)| t / s).fold(f64::INFINITY, f64::min);
    doc_tokens
        .iter()
        .zip(&shares)
        .enumerate()
        .map(|(i, (lens, share))| {
            let mut order: Vec<usize> = (0..lens.len()).collect();
            let stream = seed ^ 0x6d69_7874_7572_6500 ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(stream));
            let target = share * size;
            let mut taken = 0.0;
            let mut chosen = Vec::new();
            for d in order {
                let len = lens[d] as f64;
                // Stop where one more document would overshoot the share by
                // more than stopping falls short of it.
                if taken + len - target > target - taken {
                    break;
                }
                taken += len;
                chosen.push(d);
            }
            chosen
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_colon_splits_only_before_a_number() {
        assert_eq!(parse_input("a.jsonl").unwrap(), (PathBuf::from("a.jsonl"), None));
        assert_eq!(parse_input("a.jsonl:0.7").unwrap(), (PathBuf::from("a.jsonl"), Some(0.7)));
        assert_eq!(parse_input("dir:v2/a.jsonl").unwrap(), (PathBuf::from("dir:v2/a.jsonl"), None));
        assert_eq!(parse_input("a:1.jsonl:3").unwrap(), (PathBuf::from("a:1.jsonl"), Some(3.0)));
        assert_eq!(parse_input("c:\\data.txt").unwrap(), (PathBuf::from("c:\\data.txt"), None));
        for bad in ["a.jsonl:0", "a.jsonl:-1", "a.jsonl:inf", "a.jsonl:NaN"] {
            let err = parse_input(bad).unwrap_err().to_string();
            assert!(err.contains("must be positive and finite") && err.contains(bad), "{err}");
        }
        assert!(parse_input(":0.5").unwrap_err().to_string().contains("no file before the weight"));
    }

    #[test]
    fn the_first_exhausted_input_is_used_whole_and_the_others_sampled_to_their_share() {
        let small = vec![10u64; 30]; // 300 tokens
        let large = vec![7u64; 1000]; // 7000 tokens
        let chosen = choose(&[small.clone(), large.clone()], &[0.6, 0.4], 5);
        assert_eq!(chosen[0].len(), 30, "the input that runs out first is used whole");
        let large_tokens: u64 = chosen[1].iter().map(|&d| large[d]).sum();
        assert!((large_tokens as f64 - 200.0).abs() <= 3.5, "{large_tokens}");
        let mut distinct = chosen[1].clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), chosen[1].len(), "no document twice");
        assert_eq!(choose(&[small, large], &[6.0, 4.0], 5), chosen, "weights are normalised; the draw is seeded");
    }
}

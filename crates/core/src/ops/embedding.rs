//! Token embedding: the row gather `table[ids]` ([`Embedding`]) and its
//! backward, the deterministic scatter-add of output cotangents into table
//! rows ([`EmbeddingBackward`]), plus the [`Builder::embedding`] helper.

use num_traits::Zero;
use rayon::prelude::*;

use super::sample::{fixed, ids, normal, Sample};
use super::{expect_float, expect_inputs, no_vjp, Attr, Attrs, OpDef, VjpArgs};
use crate::error::{Error, Result};
use crate::ir::DType;
use crate::ir::{Builder, TensorType, ValueId};
use crate::ops::kernel::{Float, KernelIo};
use crate::with_float;

/// The error for an id outside `[0, rows)`: token ids come from user data, so
/// this is an input error naming the offending value and its flat position.
fn check_ids(ids: &[i64], rows: usize) -> Result<()> {
    match ids.iter().position(|&id| id < 0 || id as u64 >= rows as u64) {
        None => Ok(()),
        Some(pos) => Err(Error::Input {
            name: "token ids".into(),
            reason: format!(
                "token id {} at position {pos} is out of range for an embedding table of {rows} rows",
                ids[pos]
            ),
        }),
    }
}

/// Rows gathered in parallel get at least this many elements each, so that
/// narrow tables do not drown in scheduling overhead.
const MIN_ELEMS_PER_TASK: usize = 1 << 12;

fn min_rows_per_task(width: usize) -> usize {
    (MIN_ELEMS_PER_TASK / width.max(1)).max(1)
}

// ---------------------------------------------------------------- forward

/// `y[..., :] = table[ids[...], :]` for `ids` of any shape (i32 or i64) and a
/// `[V, C]` float table.
#[derive(Clone, PartialEq, Debug)]
pub struct Embedding;

impl OpDef for Embedding {
    /// `embedding_cases` with i32 and i64 ids, and fixed ids with a known
    /// repeat pattern and an unused row.
    fn samples(d: DType) -> Vec<Sample> {
        let mut v = Vec::new();
        for (ids_shape, rows, width) in embedding_cases() {
            for id_dt in [DType::I32, DType::I64] {
                let s = Sample::new(Embedding, vec![ids(id_dt, &ids_shape, rows as i64), normal(d, &[rows, width])]);
                v.push(s.large_over(20_000));
            }
        }
        let pattern = [0.0, 4.0, 4.0, 2.0, 0.0, 4.0, 3.0];
        v.push(Sample::new(Embedding, vec![fixed(DType::I64, &[7], &pattern), normal(d, &[5, 3])]));
        v
    }
    fn name(&self) -> &'static str {
        "embedding"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 2)?;
        let (ids, table) = (inputs[0], inputs[1]);
        if !ids.dtype.is_int() {
            return Err(format!("ids must be an i32 or i64 tensor, got {ids}"));
        }
        expect_float(table, "table")?;
        if table.rank() != 2 {
            return Err(format!("table must be [rows, width], got {table}"));
        }
        let mut shape = ids.shape.clone();
        shape.push(table.shape[1]);
        Ok(vec![table.with_shape(shape)])
    }
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        let Some(g) = args.cotangents[0] else {
            return Ok(vec![None, None]);
        };
        let (ids, table) = (args.inputs[0], args.inputs[1]);
        let num_rows = b.shape(table)[0];
        let gt = b.push1(EmbeddingBackward { num_rows }.into(), &[ids, g])?;
        // Ids are integers: no cotangent.
        Ok(vec![None, Some(gt)])
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let ids = io.ids(0)?;
        let (rows, width) = (io.in_ty(1).shape[0], io.in_ty(1).shape[1]);
        // Validate every id before writing, so a bad batch leaves no partial output behind.
        check_ids(&ids, rows)?;
        if width == 0 {
            return Ok(());
        }
        with_float!(io.in_ty(1).dtype, T => {
            let table = io.input::<T>(1);
            let y = io.output::<T>(0);
            y.par_chunks_mut(width).zip(ids.par_iter()).with_min_len(min_rows_per_task(width)).for_each(|(row, &id)| {
                let src = id as usize * width;
                row.copy_from_slice(&table[src..src + width]);
            });
            Ok(())
        })
    }
    fn parse(name: &str, _a: &mut Attrs) -> Option<Result<Self>> {
        (name == "embedding").then_some(Ok(Embedding))
    }
}

// ---------------------------------------------------------------- backward

/// `gtable[r, :] = Σ_{p : ids[p] = r} gy[p, :]` over a `[num_rows, C]` table,
/// zero for rows no id selects. Inputs: ids and the output cotangent `gy`
/// (`ids.shape + [C]`).
///
/// Deterministic without atomics: positions are bucketed by id with a stable
/// counting sort (ascending within each bucket), then every table row sums
/// its own positions in ascending order, rows in parallel. The result depends
/// only on the values, never on the thread count or scheduling.
#[derive(Clone, PartialEq, Debug)]
pub struct EmbeddingBackward {
    pub num_rows: usize,
}

impl OpDef for EmbeddingBackward {
    /// `embedding_cases` with i32 and i64 ids from the first half of the
    /// rows only (the others must come out zero), and fixed ids with rows
    /// repeated and rows never selected.
    fn samples(d: DType) -> Vec<Sample> {
        let mut v = Vec::new();
        for (ids_shape, rows, width) in embedding_cases() {
            let mut gy = ids_shape.clone();
            gy.push(width);
            for id_dt in [DType::I32, DType::I64] {
                let i = ids(id_dt, &ids_shape, rows.div_ceil(2) as i64);
                v.push(Sample::new(EmbeddingBackward { num_rows: rows }, vec![i, normal(d, &gy)]).large_over(20_000));
            }
        }
        let pattern = [2.0, 2.0, 0.0, 5.0, 2.0, 0.0, 3.0, 2.0];
        let i = fixed(DType::I32, &[2, 4], &pattern);
        v.push(Sample::new(EmbeddingBackward { num_rows: 7 }, vec![i, normal(d, &[2, 4, 3])]));
        let i = fixed(DType::I64, &[6], &[0.0, 1.0, 1.0, 0.0, 0.0, 1.0]);
        v.push(Sample::new(EmbeddingBackward { num_rows: 4 }, vec![i, normal(d, &[6, 5])]));
        v
    }
    fn name(&self) -> &'static str {
        "embedding_backward"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 2)?;
        let (ids, gy) = (inputs[0], inputs[1]);
        if !ids.dtype.is_int() {
            return Err(format!("ids must be an i32 or i64 tensor, got {ids}"));
        }
        expect_float(gy, "the output cotangent")?;
        if gy.rank() != ids.rank() + 1 || gy.shape[..ids.rank()] != ids.shape[..] {
            return Err(format!("the output cotangent {gy} must have the ids' shape {ids} plus a width axis"));
        }
        Ok(vec![gy.with_shape(vec![self.num_rows, gy.shape[ids.rank()]])])
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        no_vjp(self.name())
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let ids = io.ids(0)?;
        let rows = self.num_rows;
        let width = *io.out_ty(0).shape.last().expect("rank-2 output");
        check_ids(&ids, rows)?;
        if width == 0 {
            return Ok(());
        }
        // Stable counting sort of positions by id: bucket r is
        // `order[start[r]..start[r + 1]]`, positions ascending.
        let mut start = vec![0usize; rows + 1];
        for &id in &ids {
            start[id as usize + 1] += 1;
        }
        for r in 0..rows {
            start[r + 1] += start[r];
        }
        let mut next = start.clone();
        let mut order = vec![0usize; ids.len()];
        for (pos, &id) in ids.iter().enumerate() {
            order[next[id as usize]] = pos;
            next[id as usize] += 1;
        }
        with_float!(io.out_ty(0).dtype, T => {
            let gy = io.input::<T>(1);
            let gt = io.output::<T>(0);
            gt.par_chunks_mut(width).enumerate().with_min_len(min_rows_per_task(width)).for_each_init(
                // One accumulator row per task, reset for every table row, so
                // the sums do not depend on which thread handles which row.
                || vec![<T as Float>::Acc::zero(); width],
                |acc, (r, out)| {
                    let bucket = &order[start[r]..start[r + 1]];
                    match bucket {
                        [] => out.fill(T::from_acc(<T as Float>::Acc::zero())),
                        // A single occurrence is a copy: no rounding beyond gy's own.
                        [p] => out.copy_from_slice(&gy[p * width..(p + 1) * width]),
                        _ => {
                            acc.fill(<T as Float>::Acc::zero());
                            for &p in bucket {
                                for (a, g) in acc.iter_mut().zip(&gy[p * width..(p + 1) * width]) {
                                    *a += g.acc();
                                }
                            }
                            for (o, a) in out.iter_mut().zip(acc.iter()) {
                                *o = T::from_acc(*a);
                            }
                        }
                    }
                },
            );
            Ok(())
        })
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        vec![("num_rows", Attr::Int(self.num_rows as i64))]
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "embedding_backward").then(|| Ok(EmbeddingBackward { num_rows: a.usize("num_rows")? }))
    }
}

impl Builder {
    /// `table[ids]`: one row of the `[V, C]` table per id, shaped `ids.shape + [C]`.
    pub fn embedding(&mut self, ids: ValueId, table: ValueId) -> Result<ValueId> {
        self.push1(Embedding.into(), &[ids, table])
    }
}

/// (ids shape, table rows, width) of the embedding samples: one row of one
/// element, ids repeating rows, narrow and wide rows, rows of 16-byte
/// multiples, more ids than one GPU scan tile, a width needing two column
/// passes in the GPU backward (5000 > 512 threads x 8 columns).
fn embedding_cases() -> Vec<(Vec<usize>, usize, usize)> {
    vec![
        (vec![1], 1, 1),
        (vec![7], 5, 3),
        (vec![2, 6], 5, 4),
        (vec![2, 37], 50, 24),
        (vec![4, 16], 11, 64),
        (vec![3000], 7, 8),
        (vec![300], 40, 1000),
        (vec![2, 50], 9, 5000),
    ]
}

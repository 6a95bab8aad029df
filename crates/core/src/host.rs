//! Host tensors: a typed byte buffer in host memory, in any dtype, 8-byte
//! aligned so every dtype can be viewed in place. The currency between the
//! runtime and its users: step inputs written to a session, outputs read
//! back, checkpoint tensors, and test data. Also how much host memory a
//! process may still take, and allocation that fails with an error
//! ([`memory`]).

pub mod memory;

use crate::error::{Error, Result};
use crate::types::{DType, TensorType};

/// A tensor in host memory, 8-byte aligned so every dtype can be viewed in place.
#[derive(Clone, Debug)]
pub struct HostTensor {
    pub ty: TensorType,
    words: Vec<u64>,
}

/// Equal types and equal bytes (the padding of the last word does not count).
impl PartialEq for HostTensor {
    fn eq(&self, other: &Self) -> bool {
        self.ty == other.ty && self.bytes() == other.bytes()
    }
}

impl HostTensor {
    pub fn zeros(ty: TensorType) -> Self {
        let words = vec![0u64; (ty.bytes() as usize).div_ceil(8)];
        HostTensor { ty, words }
    }

    /// [`HostTensor::zeros`] for a buffer the runtime grows with its
    /// inputs (a batch, say): an allocation that fails, or a size past
    /// what this host can address, is an error naming `what`, not an abort.
    pub fn try_zeros(ty: TensorType, what: &str) -> Result<Self> {
        let too_large = || Error::Allocation { what: format!("{what} ({ty})"), bytes: ty.bytes() };
        let bytes = ty.checked_bytes().and_then(|b| usize::try_from(b).ok()).ok_or_else(too_large)?;
        let words = memory::try_vec(bytes.div_ceil(8), 0u64, &format!("{what} ({ty})"))?;
        Ok(HostTensor { ty, words })
    }

    /// [`HostTensor::from_f64`], allocated as [`HostTensor::try_zeros`] is.
    pub fn try_from_f64(ty: TensorType, data: &[f64], what: &str) -> Result<Self> {
        if data.len() != ty.numel() {
            return Err(Error::Input { name: what.to_string(), reason: format!("{} values for {ty}", data.len()) });
        }
        let mut t = HostTensor::try_zeros(ty, what)?;
        t.fill_from_f64(data);
        Ok(t)
    }

    /// Makes this tensor one of type `ty`, reusing its allocation where it
    /// is large enough; the contents are unspecified until written. Lets a
    /// loader stream tensors through one buffer.
    pub fn retype(&mut self, ty: TensorType) {
        self.words.resize((ty.bytes() as usize).div_ceil(8), 0);
        self.ty = ty;
    }

    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.ty.bytes() as usize]
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.ty.bytes() as usize;
        &mut bytemuck::cast_slice_mut(&mut self.words)[..n]
    }

    /// A tensor whose bytes are all 0xFF (NaN in every float type): what a
    /// kernel finds in reused arena memory. Outputs start like this in tests.
    pub fn garbage(ty: TensorType) -> Self {
        let words = vec![u64::MAX; (ty.bytes() as usize).div_ceil(8)];
        HostTensor { ty, words }
    }

    /// Values converted from f64 (rounded to the dtype; ints truncated).
    pub fn from_f64(ty: TensorType, data: &[f64]) -> Self {
        assert_eq!(data.len(), ty.numel(), "data length for {ty}");
        let mut t = HostTensor::zeros(ty);
        t.fill_from_f64(data);
        t
    }

    /// Writes `data` (one value per element) converted to this tensor's dtype.
    fn fill_from_f64(&mut self, data: &[f64]) {
        let dtype = self.ty.dtype;
        let b = self.bytes_mut();
        fn put<T: bytemuck::Pod>(b: &mut [u8], data: &[f64], f: impl Fn(f64) -> T) {
            let s: &mut [T] = bytemuck::cast_slice_mut(b);
            for (o, &x) in s.iter_mut().zip(data) {
                *o = f(x);
            }
        }
        match dtype {
            DType::F32 => put(b, data, |x| x as f32),
            DType::F64 => put(b, data, |x| x),
            DType::BF16 => put(b, data, half::bf16::from_f64),
            DType::F16 => put(b, data, half::f16::from_f64),
            DType::I32 => put(b, data, |x| x as i32),
            DType::I64 => put(b, data, |x| x as i64),
            DType::Bool => put(b, data, |x| (x != 0.0) as u8),
        }
    }

    pub fn to_f64(&self) -> Vec<f64> {
        bytes_to_f64(self.ty.dtype, self.bytes())
    }

    /// The elements as f32 (each as `to_f64()[i] as f32`: exact for every
    /// float dtype but f64, which rounds), converted in parallel without
    /// an f64 copy: what NF4 quantization reads, seven billion weights of
    /// an 8B base as it loads.
    pub fn to_f32(&self) -> Vec<f32> {
        use rayon::prelude::*;
        fn get<T: bytemuck::Pod + Send + Sync>(b: &[u8], f: impl Fn(T) -> f32 + Send + Sync) -> Vec<f32> {
            b.par_chunks_exact(std::mem::size_of::<T>()).map(|c| f(bytemuck::pod_read_unaligned(c))).collect()
        }
        let b = self.bytes();
        match self.ty.dtype {
            DType::F32 => get(b, |x: f32| x),
            DType::F64 => get(b, |x: f64| x as f32),
            DType::BF16 => get(b, |x: half::bf16| x.to_f32()),
            DType::F16 => get(b, |x: half::f16| x.to_f32()),
            DType::I32 => get(b, |x: i32| x as f64 as f32),
            DType::I64 => get(b, |x: i64| x as f64 as f32),
            DType::Bool => get(b, |x: u8| x as f32),
        }
    }

    /// The first element that is NaN or infinite, with its index
    /// ([`first_non_finite`]).
    pub fn first_non_finite(&self) -> Option<(usize, f64)> {
        first_non_finite(self.ty.dtype, self.bytes())
    }
}

/// The first NaN or infinite element of raw bytes of `dtype`, with its
/// index; `None` for integer dtypes. Reads the bits in place (no copy), so
/// checking every tensor a loader reads costs one pass over memory it has
/// just touched.
pub fn first_non_finite(dtype: DType, b: &[u8]) -> Option<(usize, f64)> {
    // A float is NaN or infinite when its exponent bits are all ones.
    fn scan<const N: usize>(b: &[u8], exponent: u64, decode: impl Fn(u64) -> f64) -> Option<(usize, f64)> {
        b.chunks_exact(N).enumerate().find_map(|(i, c)| {
            let mut word = [0u8; 8];
            word[..N].copy_from_slice(c);
            let bits = u64::from_le_bytes(word);
            (bits & exponent == exponent).then(|| (i, decode(bits)))
        })
    }
    match dtype {
        DType::F32 => scan::<4>(b, 0x7f80_0000, |x| f32::from_bits(x as u32) as f64),
        DType::F64 => scan::<8>(b, 0x7ff0_0000_0000_0000, f64::from_bits),
        DType::BF16 => scan::<2>(b, 0x7f80, |x| half::bf16::from_bits(x as u16).to_f64()),
        DType::F16 => scan::<2>(b, 0x7c00, |x| half::f16::from_bits(x as u16).to_f64()),
        DType::I32 | DType::I64 | DType::Bool => None,
    }
}

/// Decodes raw bytes of `dtype` to f64.
pub fn bytes_to_f64(dtype: DType, b: &[u8]) -> Vec<f64> {
    fn get<T: bytemuck::Pod>(b: &[u8], f: impl Fn(T) -> f64) -> Vec<f64> {
        b.chunks_exact(std::mem::size_of::<T>()).map(|c| f(bytemuck::pod_read_unaligned(c))).collect()
    }
    match dtype {
        DType::F32 => get(b, |x: f32| x as f64),
        DType::F64 => get(b, |x: f64| x),
        DType::BF16 => get(b, |x: half::bf16| x.to_f64()),
        DType::F16 => get(b, |x: half::f16| x.to_f64()),
        DType::I32 => get(b, |x: i32| x as f64),
        DType::I64 => get(b, |x: i64| x as f64),
        DType::Bool => get(b, |x: u8| x as f64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn to_f32_is_to_f64_rounded_in_every_dtype() {
        let values: [f64; 10] = [0.0, -1.5, 1e-30, 3.0e38, -0.0, 65504.0, 1.0 / 3.0, 7.0, 1e300, -2.5e-8];
        for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::I64, DType::Bool] {
            let ty = TensorType::new(dtype, [values.len()]);
            let data: Vec<f64> = match dtype {
                DType::I32 | DType::I64 => values.iter().map(|v| v.clamp(-1e9, 1e9).trunc()).collect(),
                DType::Bool => values.iter().map(|&v| (v != 0.0) as u8 as f64).collect(),
                _ => values.to_vec(),
            };
            let t = HostTensor::from_f64(ty, &data);
            let via_f64: Vec<u32> = t.to_f64().iter().map(|&x| (x as f32).to_bits()).collect();
            let direct: Vec<u32> = t.to_f32().iter().map(|x| x.to_bits()).collect();
            assert_eq!(direct, via_f64, "{dtype:?}");
        }
    }

    #[test]
    fn the_first_non_finite_element_is_found_in_every_float_dtype() {
        for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
            let ty = TensorType::new(dtype, [5]);
            let finite = HostTensor::from_f64(ty.clone(), &[0.0, -1.5, 1e-30, 3.0, -0.0]);
            assert_eq!(finite.first_non_finite(), None, "{dtype:?}");
            for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
                let t = HostTensor::from_f64(ty.clone(), &[1.0, 2.0, bad, 4.0, bad]);
                let (i, x) = t.first_non_finite().unwrap_or_else(|| panic!("{dtype:?} {bad}"));
                assert_eq!(i, 2, "{dtype:?}");
                assert!(x.is_nan() == bad.is_nan() && (x.is_nan() || x == bad), "{dtype:?}: {x}");
            }
        }
        // The largest finite values are not flagged.
        let big = HostTensor::from_f64(TensorType::new(DType::F16, [1]), &[65504.0]);
        assert_eq!(big.first_non_finite(), None);
        let ints = HostTensor::from_f64(TensorType::new(DType::I32, [2]), &[-1.0, 7.0]);
        assert_eq!(ints.first_non_finite(), None);
    }
}

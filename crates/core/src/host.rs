//! Host tensors: a typed byte buffer in host memory, in any dtype, 8-byte
//! aligned so every dtype can be viewed in place. The currency between the
//! runtime and its users: step inputs written to a session, outputs read
//! back, checkpoint tensors, and test data.

use crate::ir::{DType, TensorType};

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

    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.ty.bytes() as usize]
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.ty.bytes() as usize;
        &mut bytemuck::cast_slice_mut(&mut self.words)[..n]
    }

    /// Gives the tensor the type `ty`, keeping its allocation where it is
    /// large enough, so one buffer serves tensors of many types in turn.
    /// The bytes are the old ones (zeros where the buffer grew): the caller
    /// overwrites them.
    pub fn retype(&mut self, ty: TensorType) {
        self.words.resize((ty.bytes() as usize).div_ceil(8), 0);
        self.ty = ty;
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
        let mut t = HostTensor::zeros(ty.clone());
        let b = t.bytes_mut();
        fn put<T: bytemuck::Pod>(b: &mut [u8], data: &[f64], f: impl Fn(f64) -> T) {
            let s: &mut [T] = bytemuck::cast_slice_mut(b);
            for (o, &x) in s.iter_mut().zip(data) {
                *o = f(x);
            }
        }
        match ty.dtype {
            DType::F32 => put(b, data, |x| x as f32),
            DType::F64 => put(b, data, |x| x),
            DType::BF16 => put(b, data, half::bf16::from_f64),
            DType::F16 => put(b, data, half::f16::from_f64),
            DType::I32 => put(b, data, |x| x as i32),
            DType::I64 => put(b, data, |x| x as i64),
            DType::Bool => put(b, data, |x| (x != 0.0) as u8),
        }
        t
    }

    pub fn to_f64(&self) -> Vec<f64> {
        bytes_to_f64(self.ty.dtype, self.bytes())
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

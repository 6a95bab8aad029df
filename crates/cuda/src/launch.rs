//! What a lowered node asks the device to do: kernel launches with fixed
//! addresses and scalar arguments, or matrix products. Data only: the
//! session turns these into driver calls, eagerly or under graph capture.

use std::ffi::c_void;

use cudarc::driver::sys;
use cudarc::driver::DriverError;
use stepgraph_core::ir::{DType, TensorType};
use stepgraph_core::ops::fp8::Fp8Format;

/// Launches `f` on `stream` as `cuLaunchKernel` does, or, with `pdl`, with
/// programmatic stream serialization (`cuLaunchKernelEx`): the kernel's
/// blocks may start before the previous kernel in the stream has finished
/// and wait in `sg_pdl_entry()` for its results. Under stream capture the
/// graph records the programmatic edge.
///
/// # Safety
/// As `cuLaunchKernel`: `f` is a loaded function whose parameters
/// `params` fill, every pointer argument valid for what the kernel does;
/// with `pdl`, `f` begins with `sg_pdl_entry()`.
pub unsafe fn launch_kernel(
    f: sys::CUfunction,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    shared_bytes: u32,
    stream: sys::CUstream,
    params: &mut [*mut c_void],
    pdl: bool,
) -> Result<(), DriverError> {
    if !pdl {
        return cudarc::driver::result::launch_kernel(f, grid, block, shared_bytes, stream, params);
    }
    // SAFETY: a plain C struct; the union's field is set below.
    let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block.0,
        blockDimY: block.1,
        blockDimZ: block.2,
        sharedMemBytes: shared_bytes,
        hStream: stream,
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: the caller's contract; `config` and `attr` outlive the call.
    sys::cuLaunchKernelEx(&config, f, params.as_mut_ptr(), std::ptr::null_mut()).result()
}

/// A tensor on the device: its type and its fixed address (from the plan).
#[derive(Clone, Debug, PartialEq)]
pub struct DevTensor {
    pub ty: TensorType,
    pub ptr: u64,
}

/// One kernel argument, passed by value exactly as the CUDA C signature
/// declares it (`Ptr` is any `T*`, `I64` a `long long`, `Struct` a
/// `#[repr(C)]`-compatible struct passed by value, given as its bytes,
/// `TensorMap` a `const __grid_constant__ CUtensorMap`).
#[derive(Clone, Debug, PartialEq)]
pub enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
    F64(f64),
    Struct(Vec<u8>),
    TensorMap(TensorMap),
}

impl Arg {
    /// The bytes the driver copies for this argument. A tensor map is
    /// encoded by the driver here, so it needs one (the other arguments
    /// never fail).
    pub fn bytes(&self) -> Result<Vec<u8>, DriverError> {
        Ok(match self {
            Arg::Ptr(p) => p.to_ne_bytes().to_vec(),
            Arg::I32(x) => x.to_ne_bytes().to_vec(),
            Arg::I64(x) => x.to_ne_bytes().to_vec(),
            Arg::F32(x) => x.to_ne_bytes().to_vec(),
            Arg::F64(x) => x.to_ne_bytes().to_vec(),
            Arg::Struct(b) => b.clone(),
            Arg::TensorMap(m) => m.encode()?.to_vec(),
        })
    }

    /// The argument's size and alignment in the kernel's parameters (a
    /// struct's alignment taken as its widest field's, at most 8 bytes).
    pub fn layout(&self) -> (usize, usize) {
        match self {
            Arg::Ptr(_) | Arg::I64(_) | Arg::F64(_) => (8, 8),
            Arg::I32(_) | Arg::F32(_) => (4, 4),
            Arg::Struct(b) => (b.len(), b.len().min(8)),
            Arg::TensorMap(_) => (TensorMap::BYTES, TensorMap::ALIGN),
        }
    }
}

/// A tensor map for the tensor copy engine (TMA): a tiled view of the
/// 16-bit tensor at `ptr` whose boxes a kernel copies into shared memory
/// by coordinates. Dimensions go innermost first; element 0 of `dims` is
/// contiguous, dimension `i + 1` is `strides[i]` bytes apart. Coordinates
/// outside `dims` read as zeros. The driver encodes it at load time
/// ([`TensorMap::encode`]); [`TensorMap::check`] holds the encoder's rules,
/// so a lowering can choose a path without a driver.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorMap {
    pub ptr: u64,
    pub dims: Vec<u64>,
    pub strides: Vec<u64>,
    pub boxes: Vec<u32>,
    /// 128-byte swizzle (rows of the box's 128-byte inner extent, their
    /// 16-byte chunks permuted within each 1024 bytes), else none.
    pub swizzle_128: bool,
    pub f16: bool,
}

impl TensorMap {
    /// `CUtensorMap`'s size and alignment.
    pub const BYTES: usize = 128;
    pub const ALIGN: usize = 64;

    /// Whether the driver takes this map: a 16-byte-aligned base, strides
    /// multiples of 16 bytes below 2⁴⁰, dimensions in 1..=2³², boxes in
    /// 1..=256 elements (and, swizzled, an inner extent of at most 128 bytes),
    /// rank 1 to 5.
    pub fn check(&self) -> bool {
        let rank = self.dims.len();
        (1..=5).contains(&rank)
            && self.strides.len() + 1 == rank
            && self.boxes.len() == rank
            && self.ptr.is_multiple_of(16)
            && self.dims.iter().all(|&d| (1..=1 << 32).contains(&d))
            && self.strides.iter().all(|&s| s.is_multiple_of(16) && s < 1 << 40)
            && self.boxes.iter().all(|&b| (1..=256).contains(&b))
            && (!self.swizzle_128 || self.boxes[0] * 2 <= 128)
    }

    /// The driver's encoding (`cuTensorMapEncodeTiled`).
    pub fn encode(&self) -> Result<[u8; TensorMap::BYTES], DriverError> {
        use sys::{CUtensorMapDataType as Ty, CUtensorMapSwizzle as Sw};
        let ty = if self.f16 { Ty::CU_TENSOR_MAP_DATA_TYPE_FLOAT16 } else { Ty::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 };
        let swizzle = if self.swizzle_128 { Sw::CU_TENSOR_MAP_SWIZZLE_128B } else { Sw::CU_TENSOR_MAP_SWIZZLE_NONE };
        let elements = vec![1u32; self.dims.len()];
        // SAFETY: a plain C struct the call fills.
        let mut map: sys::CUtensorMap = unsafe { std::mem::zeroed() };
        // SAFETY: every array holds `rank` entries (`strides` rank − 1), as
        // the call reads them; the map is only written.
        unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map,
                ty,
                self.dims.len() as u32,
                self.ptr as *mut c_void,
                self.dims.as_ptr(),
                self.strides.as_ptr(),
                self.boxes.as_ptr(),
                elements.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzle,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
            .result()?;
        }
        let mut bytes = [0u8; TensorMap::BYTES];
        for (chunk, word) in bytes.chunks_exact_mut(8).zip(map.opaque) {
            chunk.copy_from_slice(&word.to_ne_bytes());
        }
        Ok(bytes)
    }
}

/// A kernel launch. `module` names a module of [`crate::kernels::modules`];
/// `function` is an `extern "C" __global__` function in it.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelLaunch {
    pub module: &'static str,
    pub function: String,
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_bytes: u32,
    pub args: Vec<Arg>,
}

/// Element type of a matrix product.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum GemmType {
    F32,
    /// f32 storage whose products run on TF32 tensor cores (`matmul`'s
    /// `tf32`: cuBLASLt's `CUBLAS_COMPUTE_32F_FAST_TF32`).
    Tf32,
    BF16,
    F16,
    /// Operands of 8-bit float codes, scaled by their inverse scales
    /// ([`GemmCall::fp8_scales`]): `matmul_fp8`.
    Fp8(Fp8Gemm),
}

/// The operand formats and output type of an FP8 product
/// ([`stepgraph_core::ops::fp8::MatMulFp8`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Fp8Gemm {
    pub a: Fp8Format,
    pub b: Fp8Format,
    pub out: DType,
}

impl GemmType {
    /// Bytes of one element of the operands `A` and `B`.
    pub fn operand_bytes(self) -> u64 {
        match self {
            GemmType::F32 | GemmType::Tf32 => 4,
            GemmType::BF16 | GemmType::F16 => 2,
            GemmType::Fp8(_) => 1,
        }
    }

    /// Bytes of one element of the output (and of an addend).
    pub fn out_bytes(self) -> u64 {
        match self {
            GemmType::Fp8(f) => f.out.size() as u64,
            t => t.operand_bytes(),
        }
    }

    /// The type's part of a product's profile name: `bf16`, `tf32`,
    /// `fp8_e4m3_e5m2_bf16` (a's format, b's, the output's type).
    pub fn name(self) -> String {
        match self {
            GemmType::Fp8(f) => format!("fp8_{}_{}_{}", f.a.name(), f.b.name(), f.out.name()),
            t => format!("{t:?}").to_lowercase(),
        }
    }
}

/// `C[b] = op(A[b]) · op(B[b])` for row-major matrices, as the CPU's
/// [`stepgraph_core::ops::gemm::GemmDesc`]: `A[b]` is `[m, k]` (`[k, m]`
/// with `trans_a`), `B[b]` is `[k, n]` (`[n, k]` with `trans_b`), `C[b]` is
/// `[m, n]`. A stride of 0 shares one matrix across the batch. With an
/// [`GemmAddend`], a tensor is added to the product before its rounding.
#[derive(Clone, Debug, PartialEq)]
pub struct GemmCall {
    pub ty: GemmType,
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub trans_a: bool,
    pub trans_b: bool,
    pub a: u64,
    pub b: u64,
    pub c: u64,
    /// Element strides between batch entries.
    pub stride_a: i64,
    pub stride_b: i64,
    pub stride_c: i64,
    /// What is added to the product (cuBLASLt's epilogue).
    pub addend: GemmAddend,
    /// For [`GemmType::Fp8`]: the device addresses of `A`'s and `B`'s
    /// inverse scales (one f32 each), which multiply the product.
    pub fp8_scales: Option<[u64; 2]>,
}

/// A tensor a product adds in its epilogue, before the result's one rounding.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum GemmAddend {
    /// Nothing: `C = op(A)·op(B)`, the output overwritten (`beta = 0`).
    None,
    /// A tensor laid out as the output (the same batch stride), at this
    /// address, which may be the output's: `beta = 1`.
    Full(u64),
    /// A row of `n` elements at this address, added to every row of every
    /// batch entry: cuBLASLt's bias epilogue.
    Bias(u64),
}

/// One device operation of a lowered node.
#[derive(Clone, Debug, PartialEq)]
pub enum Launch {
    Kernel(KernelLaunch),
    Gemm(GemmCall),
    /// Fill `bytes` bytes at `ptr` with `value` (a memset node in a graph).
    Memset {
        ptr: u64,
        bytes: u64,
        value: u8,
    },
    /// Copy `bytes` bytes device to device (views that were not aliased).
    Copy {
        dst: u64,
        src: u64,
        bytes: u64,
    },
    /// One bucket of a collective, issued through NCCL on the session's stream.
    Collective(CollectiveCall),
    /// Copy `bytes` bytes between device memory and the plan's page-locked
    /// host memory (both by device address), on the copy stream.
    HostCopy {
        dst: u64,
        src: u64,
        bytes: u64,
    },
}

impl Launch {
    /// The name profiles list this launch under: a kernel's function, a
    /// product's shape ([`crate::blas::shape_name`]), `memset`, `copy`, or
    /// the collective's NCCL call.
    pub fn profile_name(&self) -> String {
        match self {
            Launch::Kernel(k) => k.function.clone(),
            Launch::Gemm(g) => shape_name(g),
            Launch::Memset { .. } => "memset".into(),
            Launch::Copy { .. } => "copy".into(),
            Launch::HostCopy { .. } => "host_copy".into(),
            Launch::Collective(c) => c.op.nccl_name().into(),
        }
    }
}

/// A product's shape as the session's profile names it:
/// `gemm_{dtype}_{m}x{n}x{k}` with `_ta`, `_tb` for transposed operands,
/// `_b{batch}` when batched, and `_acc` or `_bias` for an addend.
pub fn shape_name(g: &GemmCall) -> String {
    format!(
        "gemm_{}_{}x{}x{}{}{}{}{}",
        g.ty.name(),
        g.m,
        g.n,
        g.k,
        if g.trans_a { "_ta" } else { "" },
        if g.trans_b { "_tb" } else { "" },
        if g.batch > 1 { format!("_b{}", g.batch) } else { String::new() },
        match g.addend {
            GemmAddend::None => "",
            GemmAddend::Full(_) => "_acc",
            GemmAddend::Bias(_) => "_bias",
        }
    )
}

/// NCCL's reduction for a collective: `ncclSum`, or `ncclAvg` for a mean.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum NcclRed {
    Sum,
    Avg,
}

/// Element types NCCL reduces and moves for stepgraph.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum NcclType {
    F32,
    BF16,
    F16,
    F64,
}

impl NcclType {
    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            NcclType::F32 => 4,
            NcclType::BF16 | NcclType::F16 => 2,
            NcclType::F64 => 8,
        }
    }
}

/// Which NCCL collective one bucket issues.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum CollectiveOp {
    /// `ncclAllReduce`: `count` elements from `send` reduced into `recv` (equal when in place).
    AllReduce(NcclRed),
    /// `ncclReduceScatter`: `send` holds `world · count` elements; `recv`
    /// gets this rank's `count` of their reduction.
    ReduceScatter(NcclRed),
    /// `ncclAllGather`: `send` holds this rank's `count` elements; `recv`
    /// gets every rank's, `world · count`, in rank order.
    AllGather,
}

impl CollectiveOp {
    pub fn nccl_name(&self) -> &'static str {
        match self {
            CollectiveOp::AllReduce(_) => "ncclAllReduce",
            CollectiveOp::ReduceScatter(_) => "ncclReduceScatter",
            CollectiveOp::AllGather => "ncclAllGather",
        }
    }
}

/// One tensor of a bucket: NCCL's buffers and count (in elements, with
/// NCCL's meaning for the collective: see [`CollectiveOp`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CollectivePart {
    pub send: u64,
    pub recv: u64,
    pub count: usize,
    pub ty: NcclType,
}

/// One bucket: `ncclGroupStart`, one call per part, `ncclGroupEnd`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CollectiveCall {
    pub op: CollectiveOp,
    /// The group size the node was built for.
    pub world: usize,
    pub parts: Vec<CollectivePart>,
}

/// Grid size for `n` work items of `per_block` each.
pub fn blocks(n: usize, per_block: usize) -> u32 {
    n.div_ceil(per_block.max(1)).max(1) as u32
}

/// Appends the bytes of plain values as one `#[repr(C)]` struct argument.
/// Fields must be pushed in declaration order with C alignment; this helper
/// only supports 8-byte fields (`long long`, `double`, pointers), which need
/// no padding.
#[derive(Default)]
pub struct StructArg(Vec<u8>);

impl StructArg {
    pub fn i64(mut self, x: i64) -> Self {
        self.0.extend(x.to_ne_bytes());
        self
    }
    pub fn i64s(mut self, xs: &[i64]) -> Self {
        for x in xs {
            self.0.extend(x.to_ne_bytes());
        }
        self
    }
    pub fn f64(mut self, x: f64) -> Self {
        self.0.extend(x.to_ne_bytes());
        self
    }
    pub fn build(self) -> Arg {
        Arg::Struct(self.0)
    }
}

/// A step's launches in order, each with the first and last node it comes
/// from (one node for a launch as lowered, a run of nodes for a merged
/// one). Built by [`crate::lower::lower_step`]; the merge rules
/// ([`crate::ops::optim::merge_updates`], [`crate::ops::decode::merge_kv_writes`],
/// [`crate::ops::rope::merge_ropes`]) take one and give one.
#[derive(Clone, Debug, Default)]
pub struct LaunchList {
    pub launches: Vec<Launch>,
    /// The last node of each launch (ascending).
    pub last_nodes: Vec<usize>,
    /// The first node of each launch: node ranges must not cut a launch.
    pub first_nodes: Vec<usize>,
}

impl LaunchList {
    /// `launches` as lowered: launch `j` made by node `nodes[j]` alone.
    pub fn one_node_each(launches: Vec<Launch>, nodes: Vec<usize>) -> LaunchList {
        LaunchList { launches, first_nodes: nodes.clone(), last_nodes: nodes }
    }

    /// The launches, their last nodes and their first nodes.
    pub fn into_parts(self) -> (Vec<Launch>, Vec<usize>, Vec<usize>) {
        (self.launches, self.last_nodes, self.first_nodes)
    }

    /// Appends `launch`, made by the nodes `first..=last`.
    pub fn push(&mut self, launch: Launch, first: usize, last: usize) {
        self.launches.push(launch);
        self.first_nodes.push(first);
        self.last_nodes.push(last);
    }

    /// Adjacent launches `j, j + 1` that `pair` makes one launch of,
    /// merged, left to right (a merged launch is not paired again), each
    /// merged pair's nodes spanning both.
    pub(crate) fn merge_adjacent(self, pair: impl Fn(&Launch, &Launch) -> Option<Launch>) -> LaunchList {
        let mut out = LaunchList::default();
        let mut j = 0;
        while j < self.launches.len() {
            if let Some(merged) = self.launches.get(j + 1).and_then(|next| pair(&self.launches[j], next)) {
                out.push(merged, self.first_nodes[j], self.last_nodes[j + 1]);
                j += 2;
            } else {
                out.push(self.launches[j].clone(), self.first_nodes[j], self.last_nodes[j]);
                j += 1;
            }
        }
        out
    }

    /// The launches of the nodes `nodes` (one segment of a trace that holds
    /// several programs, such as a generation bucket's decode step).
    pub fn of_nodes(&self, nodes: std::ops::Range<usize>) -> Vec<&Launch> {
        self.launches.iter().zip(&self.last_nodes).filter(|(_, n)| nodes.contains(n)).map(|(l, _)| l).collect()
    }
}

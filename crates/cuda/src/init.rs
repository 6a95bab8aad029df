//! Initial weights drawn on the GPU, in place: one launch per parameter of
//! `kernels/init.cu`, which evaluates core's counter-based generator
//! ([`stepgraph_core::models::init`]) to the bits the host draws. The
//! per-parameter stream and the scale are computed here on the host, so the
//! kernel repeats only integer mixing and one correctly rounded multiply.
//!
//! Data only, like a lowering: [`init_launch`] says what to launch; the
//! session ([`crate::session::CudaSession`]'s `Session::init_params`) loads
//! the module and issues the launches.

use stepgraph_core::ir::DType;
use stepgraph_core::models::init::{param_stream, ParamInit};

use crate::error::Result;
use crate::kernel_module::KernelModule;
use crate::launch::{Arg, DevTensor, KernelLaunch};

/// The kernel module, compiled with every other (and for sm_90 in CI).
pub const MODULE: KernelModule = KernelModule::plain("init", include_str!("../kernels/init.cu"));

/// The modules the session launches outside any op's lowering.
pub(crate) const KERNELS: &[KernelModule] = &[MODULE];

/// Threads per block: `SG_INIT_THREADS` in `init.cu`.
const THREADS: u32 = 256;

/// Most blocks per launch; the kernel's grid-stride loop covers the rest
/// (4096 blocks of 256 threads fill any current GPU several times over).
const MAX_BLOCKS: u64 = 4096;

/// The launch writing the initial value of the parameter `name` under
/// `seed` into `out` by the rule `init` (`stepgraph_core::models::param_init`
/// of the trace); `None` for a parameter without elements. Refuses a
/// parameter that is not of a float type, naming it.
pub fn init_launch(init: ParamInit, name: &str, out: &DevTensor, seed: u64) -> Result<Option<KernelLaunch>> {
    let dtype = out.ty.dtype;
    let suffix = match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::F64 => "f64",
        DType::I32 | DType::I64 | DType::Bool => {
            return Err(stepgraph_core::Error::Input {
                name: name.into(),
                reason: format!(
                    "a parameter of dtype {dtype} has no initial weights; they are drawn for f32, bf16, f16 and f64"
                ),
            }
            .into())
        }
    };
    let n = out.ty.numel() as u64;
    if n == 0 {
        return Ok(None);
    }
    let blocks = n.div_ceil(THREADS as u64).min(MAX_BLOCKS) as u32;
    Ok(Some(KernelLaunch {
        module: MODULE.name,
        function: format!("init_param_{suffix}"),
        grid: (blocks, 1, 1),
        block: (THREADS, 1, 1),
        shared_bytes: 0,
        args: vec![
            Arg::Ptr(out.ptr),
            Arg::I64(n as i64),
            // The kernel takes it as `unsigned long long`: the same bits.
            Arg::I64(param_stream(seed, name) as i64),
            Arg::I32(init.code()),
            Arg::F32(init.scale()),
        ],
    }))
}

#[cfg(test)]
mod tests {
    use stepgraph_core::ir::TensorType;
    use stepgraph_core::models::init::{MIX64_MULTIPLIERS, SPLITMIX_GAMMA};

    use super::*;
    use stepgraph_core::models::init::irwin_hall_scale;

    /// The rule a parameter called `name` of `t`'s shape follows.
    fn by_name(name: &str, t: &DevTensor) -> ParamInit {
        ParamInit::of(name, &t.ty.shape)
    }

    fn tensor(dtype: DType, n: usize) -> DevTensor {
        DevTensor { ty: TensorType::new(dtype, [n]), ptr: 1 << 40 }
    }

    #[test]
    fn one_launch_per_parameter_with_the_hosts_stream_and_scale() {
        let l = init_launch(
            by_name("model.layers.0.mlp.up_proj.weight", &tensor(DType::BF16, 1000)),
            "model.layers.0.mlp.up_proj.weight",
            &tensor(DType::BF16, 1000),
            3,
        )
        .unwrap()
        .unwrap();
        assert_eq!((l.module, l.function.as_str()), ("init", "init_param_bf16"));
        assert_eq!((l.grid, l.block), ((4, 1, 1), (256, 1, 1)));
        let stream = param_stream(3, "model.layers.0.mlp.up_proj.weight");
        assert_eq!(
            l.args,
            [Arg::Ptr(1 << 40), Arg::I64(1000), Arg::I64(stream as i64), Arg::I32(2), Arg::F32(irwin_hall_scale())]
        );
        // An adapter's A matrix: uniform, its scale from its fan-in (the last dimension).
        let a = DevTensor { ty: TensorType::new(DType::F32, [8, 64]), ptr: 1 << 40 };
        let l = init_launch(by_name("m.q_proj.lora_A.weight", &a), "m.q_proj.lora_A.weight", &a, 3).unwrap().unwrap();
        assert_eq!(l.args[3..], [Arg::I32(3), Arg::F32((1.0 / (8.0 * 8_388_608.0)) as f32)]);
        // Norms and biases by code; the grid stops growing, the loop strides.
        let l = init_launch(
            by_name("model.norm.weight", &tensor(DType::F32, 1 << 30)),
            "model.norm.weight",
            &tensor(DType::F32, 1 << 30),
            3,
        )
        .unwrap()
        .unwrap();
        assert_eq!((l.args[3].clone(), l.grid.0), (Arg::I32(1), 4096));
        let l = init_launch(by_name("lm_head.bias", &tensor(DType::F16, 7)), "lm_head.bias", &tensor(DType::F16, 7), 3)
            .unwrap()
            .unwrap();
        assert_eq!((l.args[3].clone(), l.function.as_str()), (Arg::I32(0), "init_param_f16"));
        assert!(init_launch(by_name("w", &tensor(DType::F64, 0)), "w", &tensor(DType::F64, 0), 3).unwrap().is_none());
        let e =
            init_launch(by_name("w", &tensor(DType::I32, 4)), "w", &tensor(DType::I32, 4), 3).unwrap_err().to_string();
        assert!(e.contains("`w`") && e.contains("dtype i32"), "{e}");
    }

    /// The kernel source spells the generator's constants as core does, so
    /// the two cannot drift apart without this failing (the GPU test
    /// compares the bits themselves).
    #[test]
    fn the_kernel_uses_cores_constants() {
        let src = MODULE.source.to_uppercase();
        for c in [SPLITMIX_GAMMA, MIX64_MULTIPLIERS[0], MIX64_MULTIPLIERS[1]] {
            assert!(src.contains(&format!("0X{c:016X}ULL")), "init.cu lacks {c:#X}");
        }
        assert!(src.contains(&stepgraph_core::models::init::IRWIN_HALL_CENTRE.to_string()));
        assert!(src.contains("__FMUL_RN") && src.contains("__INT2FLOAT_RN"));
        assert!(src.contains(&format!("#DEFINE SG_INIT_THREADS {THREADS}")));
    }

    /// Where NVRTC is installed (CI), every dtype's kernel is in the
    /// module's CUBIN with the parameters the launch fills.
    #[test]
    fn the_launch_fits_the_compiled_kernel() {
        let Some(cubin) = crate::nvrtc::test_cubin(&MODULE) else { return };
        for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            let l =
                init_launch(by_name("w", &tensor(dtype, 1 << 20)), "w", &tensor(dtype, 1 << 20), 1).unwrap().unwrap();
            crate::ops::sweep::check_signature(&format!("init {dtype}"), &cubin, &l);
        }
    }
}

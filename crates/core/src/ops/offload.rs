//! Copies between device memory and the plan's page-locked host memory
//! ([`crate::plan::Region::Host`]).
//!
//! The offload pass ([`crate::passes::offload`]) moves a value that
//! backward reads out of device memory for the stretch between its last
//! forward reader and its first backward one: `to_host` right after the
//! value is written, `to_device` a little before backward needs it. The
//! planner puts every `to_host` output in the host region (with a lifetime,
//! its bytes reused like the arena's), and the CUDA backend issues both
//! copies on a copy stream that the compute stream forks to and joins
//! ([`HostCopy::to_host`] is the only op whose output is host memory).
//!
//! **Invariant:** a copy moves bytes and nothing else: the value read back
//! is the value written, bit for bit, whatever its dtype.

use super::kernel::KernelIo;
use super::sample::{normal, Sample};
use super::{expect_inputs, Attrs, OpDef, VjpArgs};
use crate::error::Result;
use crate::ir::{Builder, DType, TensorType, ValueId};

/// `to_host(x)` (output in page-locked host memory) or `to_device(x)`
/// (output in device memory): the same type, the same bytes.
#[derive(Clone, PartialEq, Debug)]
pub struct HostCopy {
    /// `true`: device to host; `false`: host to device.
    pub to_host: bool,
}

impl OpDef for HostCopy {
    /// Both directions, of a scalar, a vector and a matrix whose size is
    /// no multiple of 16 bytes.
    fn samples(d: DType) -> Vec<Sample> {
        let mut v = Vec::new();
        for to_host in [true, false] {
            for shape in [&[][..], &[5], &[17, 61]] {
                v.push(Sample::new(HostCopy { to_host }, vec![normal(d, shape)]));
            }
        }
        v
    }
    fn name(&self) -> &'static str {
        if self.to_host {
            "to_host"
        } else {
            "to_device"
        }
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 1)?;
        Ok(vec![inputs[0].clone()])
    }
    /// A copy is the identity: its cotangent goes back the other way.
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        let Some(g) = args.cotangents[0] else { return Ok(vec![None]) };
        Ok(vec![Some(b.host_copy(g, !self.to_host)?)])
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let bytes = io.out_ty(0).bytes() as usize;
        // SAFETY: input and output have the same type (the shape rule), so
        // both hold `bytes` bytes, and they never alias (no in-place pair,
        // and they live in different regions).
        unsafe { std::ptr::copy_nonoverlapping(io.inputs[0].ptr, io.outputs[0].ptr, bytes) };
        Ok(())
    }
    fn parse(name: &str, _a: &mut Attrs) -> Option<Result<Self>> {
        match name {
            "to_host" => Some(Ok(HostCopy { to_host: true })),
            "to_device" => Some(Ok(HostCopy { to_host: false })),
            _ => None,
        }
    }
    fn output_on_host(&self) -> bool {
        self.to_host
    }
}

impl Builder {
    /// `x` copied to page-locked host memory (`to_host`) or back to the
    /// device (`!to_host`).
    pub fn host_copy(&mut self, x: ValueId, to_host: bool) -> Result<ValueId> {
        self.push1(HostCopy { to_host }.into(), &[x])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::OutputKind;

    #[test]
    fn copies_print_and_parse_back_in_both_directions() {
        let mut b = Builder::new("t");
        let x = b.input("x", TensorType::new(DType::BF16, [2, 3])).unwrap();
        let h = b.host_copy(x, true).unwrap();
        let y = b.host_copy(h, false).unwrap();
        b.output(OutputKind::Named("y".into()), y);
        let t = b.finish("build").unwrap();
        let text = t.to_string();
        assert!(text.contains("to_host") && text.contains("to_device"), "{text}");
        assert_eq!(crate::ir::parse::parse(&text).unwrap(), t);
        assert_eq!(t.ty(y), t.ty(x));
    }
}

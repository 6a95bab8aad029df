//! Checkpoints: Hugging Face `safetensors` files in and out of stepgraph.
//!
//! - [`read_safetensors`] reads every tensor of a file into a [`HostTensor`]
//!   of the same dtype, streaming each tensor's bytes straight into place
//!   (one copy of the checkpoint in memory, not two).
//! - [`load_params`] matches those tensors to the `Param` leaves of a trace
//!   by their Hugging Face names and checks the whole checkpoint (missing
//!   parameters, unexpected tensors, shapes, dtypes) before returning
//!   anything, so nothing is written into a session from a checkpoint that
//!   does not fit.
//! - [`write_safetensors_atomic`] writes a file that readers (PyTorch's
//!   `safetensors`, this module) accept, through a temporary file in the
//!   same directory that is fsynced and then renamed over the destination:
//!   an interrupted write never leaves a truncated checkpoint in place of a
//!   good one.
//! - [`reference_batch`] turns a Hugging Face `input_ids` tensor into
//!   stepgraph's step inputs, with the cross-entropy targets shifted the way
//!   `labels=input_ids` shifts them inside `transformers`.
//!
//! Errors about the file (unreadable, not safetensors, an unsupported dtype)
//! are [`Error::Io`] naming the path; errors about how a checkpoint fits the
//! model are [`Error::Input`] naming the tensor, since parameters are the
//! leaves a session is written.
//!
//! The format is little-endian, like every target stepgraph runs on; tensor
//! bytes are copied as they are.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;

use super::gpt::{LossKind, IGNORE_INDEX, TARGETS_INPUT, TOKENS_INPUT};
use crate::error::{Error, Result};
use crate::host::HostTensor;
use crate::ir::{DType, TensorType, Trace, ValueId, ValueKind};

// Tensor bytes go to and from the file unchanged, which is only right on a
// little-endian host.
const _: () = assert!(cfg!(target_endian = "little"), "safetensors checkpoints need a little-endian host");

/// The longest header the `safetensors` reference implementation accepts.
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Suffixes of tensors that Hugging Face checkpoints may carry but that are
/// buffers, not parameters: [`load_params`] skips them.
pub const IGNORED_BUFFER_SUFFIXES: &[&str] = &[".rotary_emb.inv_freq"];

/// The name of the token embedding and of the LM head, for tied models.
const EMBED_NAME: &str = "model.embed_tokens.weight";
const HEAD_NAME: &str = "lm_head.weight";

/// How many names an error lists before it says "and N more".
const LIST_AT_MOST: usize = 5;

/// The stepgraph dtype of a safetensors dtype, if stepgraph has it.
pub(crate) fn from_safetensors_dtype(dtype: Dtype) -> Option<DType> {
    Some(match dtype {
        Dtype::F32 => DType::F32,
        Dtype::BF16 => DType::BF16,
        Dtype::F16 => DType::F16,
        Dtype::F64 => DType::F64,
        Dtype::I32 => DType::I32,
        Dtype::I64 => DType::I64,
        Dtype::BOOL => DType::Bool,
        _ => return None,
    })
}

/// The safetensors dtype of a stepgraph dtype (every one has one).
pub(crate) fn to_safetensors_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
        DType::F64 => Dtype::F64,
        DType::I32 => Dtype::I32,
        DType::I64 => Dtype::I64,
        DType::Bool => Dtype::BOOL,
    }
}

/// An [`Error::Io`] on `path` from an I/O error.
fn io_error(path: &Path, source: io::Error) -> Error {
    Error::Io { path: path.display().to_string(), cause: source }
}

/// An [`Error::Io`] on `path` for a file whose contents are wrong.
fn bad_file(path: &Path, reason: impl Into<String>) -> Error {
    io_error(path, io::Error::new(io::ErrorKind::InvalidData, reason.into()))
}

/// An [`Error::Input`] about a checkpoint tensor or parameter.
fn fit_error(name: impl Into<String>, reason: impl Into<String>) -> Error {
    Error::Input { name: name.into(), reason: reason.into() }
}

/// `` `a`, `b`, `c` `` for up to [`LIST_AT_MOST`] names, then "and N more".
fn list_names<S: AsRef<str>>(names: &[S]) -> String {
    let mut text = names.iter().take(LIST_AT_MOST).map(|n| format!("`{}`", n.as_ref())).collect::<Vec<_>>().join(", ");
    if names.len() > LIST_AT_MOST {
        text.push_str(&format!(" and {} more", names.len() - LIST_AT_MOST));
    }
    text
}

/// Reads every tensor of the safetensors file at `path`, in the file's
/// order, each as a [`HostTensor`] of the same dtype and shape.
///
/// Loads F32, BF16, F16, F64, I32, I64 and BOOL tensors; a tensor of any
/// other dtype is an error naming it and its dtype, reported before any
/// tensor data is read. A file that is not a complete safetensors file
/// (short, a header that does not parse, offsets that do not cover the data
/// exactly) is an error too.
pub fn read_safetensors(path: &Path) -> Result<Vec<(String, HostTensor)>> {
    let mut file = File::open(path).map_err(|e| io_error(path, e))?;
    let file_len = file.metadata().map_err(|e| io_error(path, e))?.len();
    if file_len < 8 {
        return Err(bad_file(
            path,
            format!("not a safetensors file: {file_len} bytes, fewer than the 8 that give the header's length"),
        ));
    }
    let mut len_bytes = [0u8; 8];
    file.read_exact(&mut len_bytes).map_err(|e| io_error(path, e))?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER_BYTES || header_len > file_len - 8 {
        return Err(bad_file(
            path,
            format!("not a safetensors file: it gives a header of {header_len} bytes in a file of {file_len} bytes"),
        ));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(|e| io_error(path, e))?;
    let header = std::str::from_utf8(&header)
        .map_err(|e| bad_file(path, format!("not a safetensors file: the header is not UTF-8 ({e})")))?;
    let metadata: Metadata = serde_json::from_str(header)
        .map_err(|e| bad_file(path, format!("not a safetensors file: invalid header: {e}")))?;
    let data_len = file_len - 8 - header_len;
    if metadata.data_len() as u64 != data_len {
        return Err(bad_file(
            path,
            format!(
                "truncated or corrupt safetensors file: the header describes {} bytes of tensor data, the file holds {data_len}",
                metadata.data_len()
            ),
        ));
    }

    let names = metadata.offset_keys();
    let mut types = Vec::with_capacity(names.len());
    for name in &names {
        let info = metadata.info(name).expect("offset_keys names tensors of the header");
        let dtype = from_safetensors_dtype(info.dtype).ok_or_else(|| {
            bad_file(
                path,
                format!(
                    "tensor `{name}` has dtype {:?}, which stepgraph cannot load (it loads F32, BF16, F16, F64, I32, I64 and BOOL)",
                    info.dtype
                ),
            )
        })?;
        types.push(TensorType::new(dtype, info.shape.clone()));
    }
    // The header's offsets are validated to be contiguous from 0 in this
    // order, so the tensors follow one another in the file.
    let mut tensors = Vec::with_capacity(names.len());
    for (name, ty) in names.into_iter().zip(types) {
        let mut tensor = HostTensor::zeros(ty);
        file.read_exact(tensor.bytes_mut()).map_err(|e| io_error(path, e))?;
        tensors.push((name, tensor));
    }
    Ok(tensors)
}

/// Pairs each parameter value of `trace` with its name, as checkpoints key
/// them: turns what [`super::init_params`] returns, or values read back from
/// a session, into the list [`write_safetensors_atomic`] writes.
///
/// Values that are not `Param` leaves of `trace` are an error.
pub fn name_params(trace: &Trace, params: Vec<(ValueId, HostTensor)>) -> Result<Vec<(String, HostTensor)>> {
    params
        .into_iter()
        .map(|(v, t)| match &trace.values.get(v.index()).map(|value| &value.kind) {
            Some(ValueKind::Param { name }) => Ok((name.clone(), t)),
            _ => Err(fit_error(v.to_string(), format!("not a parameter of trace `{}`", trace.name))),
        })
        .collect()
}

/// Matches every `Param` leaf of `trace` with the tensor of the same name in
/// `tensors` and returns the values to write into a session, in the order
/// of [`Trace::params`].
///
/// Every problem is found before anything is returned, and the error names
/// them all (up to a few names of each kind):
/// - a parameter the checkpoint lacks;
/// - a checkpoint tensor the model has no parameter for, except buffers
///   such as `*.rotary_emb.inv_freq` ([`IGNORED_BUFFER_SUFFIXES`]) and, for
///   a model whose LM head is tied to the embedding, an `lm_head.weight`
///   equal to `model.embed_tokens.weight`;
/// - a shape other than the parameter's;
/// - a dtype other than the parameter's, unless `allow_cast`: then float
///   tensors are converted through f64 with one rounding to nearest even,
///   and a finite value that becomes infinite in the narrower type is an
///   error. Integer and bool tensors are never cast to a float parameter.
pub fn load_params(
    trace: &Trace,
    tensors: &[(String, HostTensor)],
    allow_cast: bool,
) -> Result<Vec<(ValueId, HostTensor)>> {
    let mut by_name: HashMap<&str, &HostTensor> = HashMap::with_capacity(tensors.len());
    let mut duplicates = Vec::new();
    for (name, tensor) in tensors {
        if by_name.insert(name.as_str(), tensor).is_some() {
            duplicates.push(name.as_str());
        }
    }
    if !duplicates.is_empty() {
        return Err(fit_error(
            "checkpoint",
            format!("names these tensors more than once: {}", list_names(&duplicates)),
        ));
    }

    let params: Vec<(ValueId, &str)> =
        trace.params().map(|p| (p, trace.value(p).kind.leaf_name().expect("params are leaves"))).collect();
    let param_names: HashSet<&str> = params.iter().map(|(_, name)| *name).collect();
    let tied = !param_names.contains(HEAD_NAME) && param_names.contains(EMBED_NAME);

    let mut problems = Vec::new();
    let missing: Vec<&str> = params.iter().map(|(_, name)| *name).filter(|name| !by_name.contains_key(name)).collect();
    if !missing.is_empty() {
        problems.push(format!(
            "{} parameter{} of the model {} missing from the checkpoint: {}",
            missing.len(),
            if missing.len() == 1 { "" } else { "s" },
            if missing.len() == 1 { "is" } else { "are" },
            list_names(&missing)
        ));
    }
    let mut unexpected = Vec::new();
    for (name, tensor) in tensors {
        let name = name.as_str();
        if param_names.contains(name) || IGNORED_BUFFER_SUFFIXES.iter().any(|s| name.ends_with(s)) {
            continue;
        }
        if tied && name == HEAD_NAME {
            if let Some(embed) = by_name.get(EMBED_NAME) {
                if tensor == *embed {
                    continue;
                }
                problems.push(format!(
                    "`{HEAD_NAME}` differs from `{EMBED_NAME}`, but the model ties its LM head to the embedding"
                ));
                continue;
            }
        }
        unexpected.push(name);
    }
    if !unexpected.is_empty() {
        problems.push(format!(
            "{} checkpoint tensor{} the model has no parameter for: {}",
            unexpected.len(),
            if unexpected.len() == 1 { "" } else { "s" },
            list_names(&unexpected)
        ));
    }

    let mut wrong_shape = Vec::new();
    let mut wrong_dtype = Vec::new();
    for &(p, name) in &params {
        let Some(tensor) = by_name.get(name) else { continue };
        let want = trace.ty(p);
        if tensor.ty.shape != want.shape {
            wrong_shape
                .push(format!("`{name}`: checkpoint has {:?}, the model expects {:?}", tensor.ty.shape, want.shape));
        } else if tensor.ty.dtype != want.dtype {
            if !allow_cast {
                wrong_dtype.push(format!(
                    "`{name}`: checkpoint has dtype {}, the model expects {} (allow casting to convert)",
                    tensor.ty.dtype, want.dtype
                ));
            } else if !tensor.ty.dtype.is_float() || !want.dtype.is_float() {
                wrong_dtype.push(format!(
                    "`{name}`: checkpoint has dtype {}, the model expects {}; only float tensors are cast",
                    tensor.ty.dtype, want.dtype
                ));
            }
        }
    }
    for (what, list) in [("shape", wrong_shape), ("dtype", wrong_dtype)] {
        if list.is_empty() {
            continue;
        }
        let shown = list.iter().take(LIST_AT_MOST).cloned().collect::<Vec<_>>().join("; ");
        let more = if list.len() > LIST_AT_MOST {
            format!(" (and {} more tensors of the wrong {what})", list.len() - LIST_AT_MOST)
        } else {
            String::new()
        };
        problems.push(format!("{shown}{more}"));
    }
    if !problems.is_empty() {
        return Err(fit_error(
            "checkpoint",
            format!("does not fit the parameters of trace `{}`: {}", trace.name, problems.join("; ")),
        ));
    }

    params
        .into_iter()
        .map(|(p, name)| {
            let tensor = by_name[name];
            let want = trace.ty(p);
            let value = if tensor.ty.dtype == want.dtype { tensor.clone() } else { cast(name, tensor, want.dtype)? };
            Ok((p, value))
        })
        .collect()
}

/// `tensor` converted to the float dtype `dtype` through f64, rounding once
/// to nearest even; a finite value that overflows is an error naming `name`.
fn cast(name: &str, tensor: &HostTensor, dtype: DType) -> Result<HostTensor> {
    let values = tensor.to_f64();
    let mut rounded = Vec::with_capacity(values.len());
    for (i, &x) in values.iter().enumerate() {
        let y = round_to(x, dtype);
        if x.is_finite() && !y.is_finite() {
            return Err(fit_error(
                name,
                format!("casting from {} to {dtype} overflows: element {i} is {x}", tensor.ty.dtype),
            ));
        }
        rounded.push(y);
    }
    // Every value is now exactly representable in `dtype`, so `from_f64`
    // stores it without a second rounding.
    Ok(HostTensor::from_f64(tensor.ty.with_dtype(dtype), &rounded))
}

/// `x` rounded to the nearest value of the float dtype `dtype` (ties to
/// even, overflow to infinity), returned as f64.
///
/// The `half` crate's conversions from f64 drop the low 32 bits of the
/// mantissa before rounding, so a value just above a halfway point can round
/// down; this rounds on all the bits.
pub(crate) fn round_to(x: f64, dtype: DType) -> f64 {
    // (explicit mantissa bits, smallest normal exponent, largest exponent)
    let (mantissa, min_exp, max_exp) = match dtype {
        DType::F64 => return x,
        DType::F32 => return x as f32 as f64,
        DType::BF16 => (7, -126, 127),
        DType::F16 => (10, -14, 15),
        DType::I32 | DType::I64 | DType::Bool => return x,
    };
    if !x.is_finite() || x == 0.0 {
        return x;
    }
    let biased = ((x.to_bits() >> 52) & 0x7ff) as i32;
    let exponent = (biased - 1023).max(min_exp);
    // The spacing of `dtype`'s values around `x`: dividing and multiplying
    // by a power of two is exact here.
    let quantum = 2f64.powi(exponent - mantissa);
    let y = (x / quantum).round_ties_even() * quantum;
    let max_finite = (2.0 - 2f64.powi(-mantissa)) * 2f64.powi(max_exp);
    if y.abs() > max_finite {
        f64::INFINITY.copysign(x)
    } else {
        y
    }
}

/// Distinguishes temporary files of concurrent writes in one process.
static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Writes `tensors` as a safetensors file at `path`, atomically: the bytes
/// go to a new temporary file in the same directory (`.NAME.PID.N.tmp`),
/// which is flushed and fsynced and then renamed over `path`, and the
/// directory is fsynced. Readers see the old file or the complete new one,
/// never a truncated one; an existing file keeps its permissions.
///
/// Tensors are laid out as the `safetensors` library lays them out (by
/// decreasing alignment, then by name). Duplicate names are an error, and
/// on any error the temporary file is removed and `path` is untouched.
pub fn write_safetensors_atomic(path: &Path, tensors: &[(String, HostTensor)]) -> Result<()> {
    let mut seen = HashSet::with_capacity(tensors.len());
    let duplicates: Vec<&str> =
        tensors.iter().map(|(name, _)| name.as_str()).filter(|name| !seen.insert(*name)).collect();
    if !duplicates.is_empty() {
        return Err(bad_file(path, format!("cannot write tensors named more than once: {}", list_names(&duplicates))));
    }
    if tensors.iter().any(|(name, _)| name == "__metadata__") {
        return Err(bad_file(path, "`__metadata__` is reserved by the safetensors format, not a tensor name"));
    }

    let mut order: Vec<&(String, HostTensor)> = tensors.iter().collect();
    order
        .sort_by(|(a_name, a), (b_name, b)| b.ty.dtype.size().cmp(&a.ty.dtype.size()).then_with(|| a_name.cmp(b_name)));
    let mut offset = 0usize;
    let mut infos = Vec::with_capacity(order.len());
    for (name, tensor) in &order {
        let n = tensor.bytes().len();
        let info = TensorInfo {
            dtype: to_safetensors_dtype(tensor.ty.dtype),
            shape: tensor.ty.shape.clone(),
            data_offsets: (offset, offset + n),
        };
        infos.push((name.clone(), info));
        offset += n;
    }
    let metadata = Metadata::new(None, infos).map_err(|e| bad_file(path, format!("cannot build the header: {e}")))?;
    let mut header = serde_json::to_vec(&metadata)?;
    // The reference writer pads the header with spaces to 8 bytes, so the
    // data starts aligned.
    header.resize(header.len().next_multiple_of(8), b' ');

    write_atomic(path, |out| {
        out.write_all(&(header.len() as u64).to_le_bytes())?;
        out.write_all(&header)?;
        for (_, tensor) in &order {
            out.write_all(tensor.bytes())?;
        }
        Ok(())
    })
}

/// Writes the file at `path` atomically with what `write` writes: the
/// bytes go to a new temporary file in the same directory
/// (`.NAME.PID.N.tmp`), which is flushed and fsynced and then renamed over
/// `path`, and the directory is fsynced. Readers see the old file or the
/// complete new one, never a truncated one; an existing file keeps its
/// permissions; on any error the temporary file is removed and `path` is
/// untouched. Every file stepgraph writes whole goes through here.
pub fn write_atomic(path: &Path, write: impl FnOnce(&mut dyn Write) -> io::Result<()>) -> Result<()> {
    let (dir, temp, file) = create_temp(path)?;
    let written = (|| -> io::Result<()> {
        let mut out = BufWriter::with_capacity(1 << 20, &file);
        write(&mut out)?;
        out.flush()?;
        drop(out);
        if let Ok(existing) = fs::metadata(path) {
            file.set_permissions(existing.permissions())?;
        }
        file.sync_all()?;
        drop(file);
        fs::rename(&temp, path)
    })();
    if let Err(e) = written {
        // Best effort: the error that matters is the one returned.
        let _ = fs::remove_file(&temp);
        return Err(io_error(path, e));
    }
    // Make the rename itself durable. Some file systems refuse to fsync a
    // directory; the new file is complete and in place either way.
    if let Ok(dir) = File::open(&dir) {
        let _ = dir.sync_all();
    }
    Ok(())
}

/// A new, empty temporary file beside `path`: its directory, its path and
/// the open file.
fn create_temp(path: &Path) -> Result<(PathBuf, PathBuf, File)> {
    let file_name = path
        .file_name()
        .and_then(|name| name.to_str())
        .ok_or_else(|| bad_file(path, "the destination must be a file name"))?;
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    };
    loop {
        let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let temp = dir.join(format!(".{file_name}.{}.{n}.tmp", std::process::id()));
        match OpenOptions::new().write(true).create_new(true).open(&temp) {
            Ok(file) => return Ok((dir, temp, file)),
            // Left over from a process that had this id before: try the next name.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(io_error(&temp, e)),
        }
    }
}

/// stepgraph's step inputs for a Hugging Face batch `ids` (`input_ids`,
/// i64 or i32 of shape `[batch, seq]`): [`TOKENS_INPUT`] as i32 and, for
/// cross-entropy, [`TARGETS_INPUT`]: each row shifted left by one with the
/// last position [`IGNORE_INDEX`], which is what `transformers` computes for
/// `labels=input_ids` (logits `[:, :-1]` against ids `[:, 1:]`, mean over the
/// rest).
///
/// An id that does not fit in i32 is an error naming its position.
pub fn reference_batch(ids: &HostTensor, loss: LossKind) -> Result<Vec<(&'static str, HostTensor)>> {
    let bad = |reason: String| fit_error(TOKENS_INPUT, reason);
    if !matches!(ids.ty.dtype, DType::I64 | DType::I32) || ids.ty.rank() != 2 {
        return Err(bad(format!("expected i64 or i32 ids of shape [batch, seq], got {}", ids.ty)));
    }
    let (batch, seq) = (ids.ty.shape[0], ids.ty.shape[1]);
    let wide: Vec<i64> = match ids.ty.dtype {
        DType::I64 => bytemuck::cast_slice::<u8, i64>(ids.bytes()).to_vec(),
        _ => bytemuck::cast_slice::<u8, i32>(ids.bytes()).iter().map(|&x| i64::from(x)).collect(),
    };
    let mut tokens = Vec::with_capacity(wide.len());
    for (pos, &id) in wide.iter().enumerate() {
        let id = i32::try_from(id).map_err(|_| {
            bad(format!("id {id} at [{}, {}] does not fit in i32 token ids", pos / seq.max(1), pos % seq.max(1)))
        })?;
        tokens.push(id);
    }
    let ty = TensorType::new(DType::I32, [batch, seq]);
    let mut out = vec![(TOKENS_INPUT, i32_tensor(ty.clone(), &tokens))];
    if loss == LossKind::CrossEntropy {
        let ignore = i32::try_from(IGNORE_INDEX).expect("the ignore index fits in i32");
        let mut targets = vec![ignore; tokens.len()];
        for row in 0..batch {
            let (start, end) = (row * seq, (row + 1) * seq);
            if end > start + 1 {
                targets[start..end - 1].copy_from_slice(&tokens[start + 1..end]);
            }
        }
        out.push((TARGETS_INPUT, i32_tensor(ty, &targets)));
    }
    Ok(out)
}

/// An i32 tensor of type `ty` holding `values` exactly.
fn i32_tensor(ty: TensorType, values: &[i32]) -> HostTensor {
    let mut tensor = HostTensor::zeros(ty);
    tensor.bytes_mut().copy_from_slice(bytemuck::cast_slice(values));
    tensor
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Builder;

    /// A fresh, empty directory for one test.
    fn temp_dir(test: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("stepgraph-checkpoint-{}-{test}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn tensor(dtype: DType, shape: &[usize], values: &[f64]) -> HostTensor {
        HostTensor::from_f64(TensorType::new(dtype, shape), values)
    }

    fn ramp(dtype: DType, shape: &[usize]) -> HostTensor {
        let n: usize = shape.iter().product();
        let values: Vec<f64> = (0..n).map(|i| i as f64 * 0.25 - 1.0).collect();
        tensor(dtype, shape, &values)
    }

    /// The message of an error, which every test here asserts on.
    fn message<T: std::fmt::Debug>(result: Result<T>) -> String {
        result.expect_err("expected an error").to_string()
    }

    fn assert_contains(text: &str, needle: &str) {
        assert!(text.contains(needle), "`{text}` lacks `{needle}`");
    }

    /// A trace with the given parameters, each used by one op.
    fn trace_with(params: &[(&str, TensorType)]) -> Trace {
        let mut b = Builder::new("params");
        for (name, ty) in params {
            let p = b.param(name, ty.clone()).unwrap();
            let s = b.sum_all(p).unwrap();
            b.output(crate::ir::OutputKind::Named(format!("s_{name}")), s);
        }
        b.finish("build").unwrap()
    }

    fn f32_ty(shape: &[usize]) -> TensorType {
        TensorType::new(DType::F32, shape)
    }

    #[test]
    fn round_trip_every_dtype() {
        let dir = temp_dir("round-trip");
        let path = dir.join("all.safetensors");
        let tensors: Vec<(String, HostTensor)> = vec![
            ("a.f32".into(), ramp(DType::F32, &[2, 3])),
            ("b.bf16".into(), ramp(DType::BF16, &[5])),
            ("c.f16".into(), ramp(DType::F16, &[3, 1, 2])),
            ("d.f64".into(), tensor(DType::F64, &[2], &[std::f64::consts::PI, -1e300])),
            ("e.i32".into(), tensor(DType::I32, &[3], &[-100.0, 0.0, 2147483647.0])),
            ("f.i64".into(), tensor(DType::I64, &[1, 2], &[-5.0, 151_000.0])),
            ("g.bool".into(), tensor(DType::Bool, &[3], &[1.0, 0.0, 1.0])),
            ("h.scalar".into(), tensor(DType::F32, &[], &[2.5])),
            ("i.empty".into(), tensor(DType::F32, &[0, 4], &[])),
        ];
        write_safetensors_atomic(&path, &tensors).unwrap();
        let mut back = read_safetensors(&path).unwrap();
        back.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(back, tensors);

        // The layout the safetensors library reads too, with the header
        // padded to 8 bytes.
        let bytes = fs::read(&path).unwrap();
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap());
        assert_eq!(header_len % 8, 0);
        let parsed = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let e = parsed.tensor("e.i32").unwrap();
        assert_eq!((e.dtype(), e.shape()), (Dtype::I32, &[3usize][..]));
        assert_eq!(e.data(), tensors[4].1.bytes());
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn reads_a_file_written_by_the_reference_library() {
        let dir = temp_dir("reference-writer");
        let path = dir.join("ref.safetensors");
        let data: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|x| x.to_le_bytes()).collect();
        let ids: Vec<u8> = [7i64, 9].iter().flat_map(|x| x.to_le_bytes()).collect();
        let views = vec![
            ("w", safetensors::tensor::TensorView::new(Dtype::F32, vec![2], &data).unwrap()),
            ("ids", safetensors::tensor::TensorView::new(Dtype::I64, vec![1, 2], &ids).unwrap()),
        ];
        fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
        let back: HashMap<String, HostTensor> = read_safetensors(&path).unwrap().into_iter().collect();
        assert_eq!(back["w"], tensor(DType::F32, &[2], &[1.5, -2.0]));
        assert_eq!(back["ids"], tensor(DType::I64, &[1, 2], &[7.0, 9.0]));
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn read_errors_name_the_file_and_the_problem() {
        let dir = temp_dir("read-errors");
        let missing = dir.join("absent.safetensors");
        assert_contains(&message(read_safetensors(&missing)), "absent.safetensors");

        let short = dir.join("short.safetensors");
        fs::write(&short, [1u8, 2, 3]).unwrap();
        assert_contains(&message(read_safetensors(&short)), "not a safetensors file: 3 bytes");

        let huge_header = dir.join("huge.safetensors");
        fs::write(&huge_header, [0xff; 16]).unwrap();
        assert_contains(&message(read_safetensors(&huge_header)), "it gives a header of");

        let not_json = dir.join("text.safetensors");
        let mut bytes = 8u64.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"not json");
        fs::write(&not_json, &bytes).unwrap();
        assert_contains(&message(read_safetensors(&not_json)), "invalid header");

        // A complete file, then cut short: the header promises more data.
        let good = dir.join("good.safetensors");
        write_safetensors_atomic(&good, &[("w".into(), ramp(DType::F32, &[4, 4]))]).unwrap();
        let mut bytes = fs::read(&good).unwrap();
        bytes.truncate(bytes.len() - 5);
        let cut = dir.join("cut.safetensors");
        fs::write(&cut, &bytes).unwrap();
        let text = message(read_safetensors(&cut));
        assert_contains(&text, "cut.safetensors");
        assert_contains(&text, "the header describes 64 bytes of tensor data, the file holds 59");

        // A dtype stepgraph has no type for, written by the reference library.
        let u8_file = dir.join("u8.safetensors");
        let data = [1u8, 2, 3];
        let views = vec![("model.mask", safetensors::tensor::TensorView::new(Dtype::U8, vec![3], &data).unwrap())];
        fs::write(&u8_file, safetensors::serialize(views, None).unwrap()).unwrap();
        let text = message(read_safetensors(&u8_file));
        assert_contains(&text, "tensor `model.mask` has dtype U8, which stepgraph cannot load");
        fs::remove_dir_all(dir).unwrap();
    }

    /// Names of the files in `dir`, sorted.
    fn files_in(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> =
            fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        names
    }

    #[test]
    fn atomic_write_replaces_and_leaves_no_temporary_files() {
        let dir = temp_dir("atomic");
        let path = dir.join("model.safetensors");
        fs::write(&path, b"an older checkpoint").unwrap();
        let first = vec![("w".to_string(), ramp(DType::F32, &[3]))];
        write_safetensors_atomic(&path, &first).unwrap();
        assert_eq!(read_safetensors(&path).unwrap(), first);
        let second = vec![("w".to_string(), ramp(DType::BF16, &[7])), ("v".to_string(), ramp(DType::F64, &[1]))];
        write_safetensors_atomic(&path, &second).unwrap();
        let mut back = read_safetensors(&path).unwrap();
        back.sort_by(|a, b| b.0.cmp(&a.0));
        assert_eq!(back, second);
        assert_eq!(files_in(&dir), vec!["model.safetensors".to_string()]);

        // A refused write leaves the existing file as it was, and no temp file.
        let before = fs::read(&path).unwrap();
        let twice = vec![("w".to_string(), ramp(DType::F32, &[1])), ("w".to_string(), ramp(DType::F32, &[1]))];
        assert_contains(&message(write_safetensors_atomic(&path, &twice)), "named more than once: `w`");
        let reserved = vec![("__metadata__".to_string(), ramp(DType::F32, &[1]))];
        assert_contains(&message(write_safetensors_atomic(&path, &reserved)), "`__metadata__` is reserved");
        assert_eq!(fs::read(&path).unwrap(), before);
        assert_eq!(files_in(&dir), vec!["model.safetensors".to_string()]);

        // A destination that cannot be renamed over (a directory): the temp
        // file is removed and the error names the destination.
        let blocked = dir.join("blocked");
        fs::create_dir(&blocked).unwrap();
        fs::write(blocked.join("inside"), b"keep").unwrap();
        assert_contains(&message(write_safetensors_atomic(&blocked, &first)), "blocked");
        assert_eq!(files_in(&dir), vec!["blocked".to_string(), "model.safetensors".to_string()]);
        assert_eq!(fs::read(blocked.join("inside")).unwrap(), b"keep");

        // A missing directory is an error, not a panic.
        let nowhere = dir.join("no-such-dir").join("x.safetensors");
        assert_contains(&message(write_safetensors_atomic(&nowhere, &first)), "no-such-dir");
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn load_matches_by_name_in_trace_order() {
        let trace = trace_with(&[("b", f32_ty(&[2])), ("a", f32_ty(&[1, 3]))]);
        let a = ramp(DType::F32, &[1, 3]);
        let b = ramp(DType::F32, &[2]);
        let checkpoint = vec![
            ("a".to_string(), a.clone()),
            ("model.layers.0.self_attn.rotary_emb.inv_freq".to_string(), ramp(DType::F32, &[4])),
            ("b".to_string(), b.clone()),
        ];
        let loaded = load_params(&trace, &checkpoint, false).unwrap();
        let params: Vec<ValueId> = trace.params().collect();
        assert_eq!(loaded, vec![(params[0], b), (params[1], a)]);
    }

    #[test]
    fn load_errors_name_every_problem() {
        let q = "model.layers.0.self_attn.q_proj.weight";
        let trace = trace_with(&[(q, f32_ty(&[28, 28])), ("model.norm.weight", f32_ty(&[28]))]);

        // Missing parameters and unexpected tensors, together.
        let checkpoint =
            vec![(q.to_string(), ramp(DType::F32, &[28, 28])), ("extra".to_string(), ramp(DType::F32, &[1]))];
        let text = message(load_params(&trace, &checkpoint, false));
        assert_contains(&text, "1 parameter of the model is missing from the checkpoint: `model.norm.weight`");
        assert_contains(&text, "1 checkpoint tensor the model has no parameter for: `extra`");

        // Many missing names: a few listed, the rest counted.
        let many: Vec<(&str, TensorType)> =
            ["p0", "p1", "p2", "p3", "p4", "p5", "p6"].iter().map(|n| (*n, f32_ty(&[1]))).collect();
        let text = message(load_params(&trace_with(&many), &[], false));
        assert_contains(
            &text,
            "7 parameters of the model are missing from the checkpoint: `p0`, `p1`, `p2`, `p3`, `p4` and 2 more",
        );

        // Wrong shape, naming the tensor and both shapes.
        let checkpoint = vec![
            (q.to_string(), ramp(DType::F32, &[32, 28])),
            ("model.norm.weight".to_string(), ramp(DType::F32, &[28])),
        ];
        let text = message(load_params(&trace, &checkpoint, true));
        assert_contains(
            &text,
            "`model.layers.0.self_attn.q_proj.weight`: checkpoint has [32, 28], the model expects [28, 28]",
        );

        // Wrong dtype without casting; an integer tensor is refused even with it.
        let checkpoint = vec![
            (q.to_string(), ramp(DType::BF16, &[28, 28])),
            ("model.norm.weight".to_string(), ramp(DType::I64, &[28])),
        ];
        let text = message(load_params(&trace, &checkpoint, false));
        assert_contains(
            &text,
            &format!("`{q}`: checkpoint has dtype bf16, the model expects f32 (allow casting to convert)"),
        );
        let text = message(load_params(&trace, &checkpoint, true));
        assert!(!text.contains(q), "{text}");
        assert_contains(
            &text,
            "`model.norm.weight`: checkpoint has dtype i64, the model expects f32; only float tensors are cast",
        );

        // Duplicate names.
        let twice = vec![("model.norm.weight".to_string(), ramp(DType::F32, &[28])); 2];
        assert_contains(&message(load_params(&trace, &twice, false)), "more than once: `model.norm.weight`");
    }

    #[test]
    fn load_casts_through_f64_with_one_rounding() {
        let trace = trace_with(&[("w", TensorType::new(DType::BF16, [3]))]);
        // 1 + 2^-8 + 2^-30 is just above the halfway point between the bf16
        // values 1 and 1 + 2^-7: it must round up. Rounding the f64 to f32
        // first, or dropping low mantissa bits, lands on the tie and rounds
        // to even (down).
        let above_half = 1.0 + 2f64.powi(-8) + 2f64.powi(-30);
        let checkpoint = vec![("w".to_string(), tensor(DType::F64, &[3], &[above_half, 1.0 + 2f64.powi(-8), -3.0]))];
        let loaded = load_params(&trace, &checkpoint, true).unwrap();
        assert_eq!(loaded[0].1.to_f64(), vec![1.0 + 2f64.powi(-7), 1.0, -3.0]);

        let f16 = trace_with(&[("w", TensorType::new(DType::F16, [2]))]);
        let checkpoint = vec![("w".to_string(), tensor(DType::F32, &[2], &[65504.0, 1e5]))];
        assert_contains(
            &message(load_params(&f16, &checkpoint, true)),
            "casting from f32 to f16 overflows: element 1 is 100000",
        );
    }

    #[test]
    fn round_to_matches_ieee_rounding() {
        // Ties to even, subnormals and overflow for bf16 and f16.
        assert_eq!(round_to(1.0 + 2f64.powi(-8), DType::BF16), 1.0);
        assert_eq!(round_to(1.0 + 3.0 * 2f64.powi(-8), DType::BF16), 1.0 + 2.0 * 2f64.powi(-7));
        assert_eq!(round_to(2f64.powi(-134), DType::BF16), 0.0);
        assert_eq!(round_to(3.0 * 2f64.powi(-134), DType::BF16), 2f64.powi(-132));
        assert_eq!(round_to(65519.0, DType::F16), 65504.0);
        assert_eq!(round_to(65520.0, DType::F16), f64::INFINITY);
        assert_eq!(round_to(-1e40, DType::BF16), f64::NEG_INFINITY);
        assert!(round_to(f64::NAN, DType::F16).is_nan());
        // Agrees with `half` wherever `half` sees every bit (values from f32).
        for bits in (0u32..u32::MAX).step_by(65_537) {
            let x = f32::from_bits(bits);
            if x.is_nan() {
                continue;
            }
            assert_eq!(round_to(x as f64, DType::BF16), half::bf16::from_f32(x).to_f64(), "{x:e}");
            assert_eq!(round_to(x as f64, DType::F16), half::f16::from_f32(x).to_f64(), "{x:e}");
        }
    }

    #[test]
    fn tied_embeddings_accept_an_equal_lm_head() {
        let trace = trace_with(&[(EMBED_NAME, f32_ty(&[4, 2])), ("model.norm.weight", f32_ty(&[2]))]);
        let embed = ramp(DType::F32, &[4, 2]);
        let mut checkpoint = vec![
            (EMBED_NAME.to_string(), embed.clone()),
            ("model.norm.weight".to_string(), ramp(DType::F32, &[2])),
            (HEAD_NAME.to_string(), embed.clone()),
        ];
        let loaded = load_params(&trace, &checkpoint, false).unwrap();
        assert_eq!(loaded[0].1, embed);

        checkpoint[2].1 = tensor(DType::F32, &[4, 2], &[0.0; 8]);
        let text = message(load_params(&trace, &checkpoint, false));
        assert_contains(&text, "`lm_head.weight` differs from `model.embed_tokens.weight`, but the model ties");

        // An untied model has its own head: the same checkpoint lacks nothing.
        let untied = trace_with(&[(EMBED_NAME, f32_ty(&[4, 2])), (HEAD_NAME, f32_ty(&[4, 2]))]);
        let no_norm: Vec<_> = checkpoint.iter().filter(|(n, _)| n != "model.norm.weight").cloned().collect();
        assert_eq!(load_params(&untied, &no_norm, false).unwrap().len(), 2);
    }

    #[test]
    fn name_params_pairs_values_with_names() {
        let trace = trace_with(&[("x", f32_ty(&[1])), ("y", f32_ty(&[2]))]);
        let values: Vec<(ValueId, HostTensor)> =
            trace.params().map(|p| (p, HostTensor::zeros(trace.ty(p).clone()))).collect();
        let named = name_params(&trace, values).unwrap();
        assert_eq!(named.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), vec!["x", "y"]);
        let not_param = trace.value_ids().find(|v| !trace.value(*v).kind.is_leaf()).unwrap();
        assert_contains(&message(name_params(&trace, vec![(not_param, ramp(DType::F32, &[]))])), "not a parameter");
    }

    #[test]
    fn reference_batch_shifts_targets() {
        let ids = tensor(DType::I64, &[2, 3], &[5.0, 6.0, 7.0, 8.0, 9.0, 10.0]);
        let sum = reference_batch(&ids, LossKind::Sum).unwrap();
        assert_eq!(sum.len(), 1);
        assert_eq!(sum[0].0, TOKENS_INPUT);
        assert_eq!(sum[0].1, tensor(DType::I32, &[2, 3], &[5.0, 6.0, 7.0, 8.0, 9.0, 10.0]));

        let ce = reference_batch(&ids, LossKind::CrossEntropy).unwrap();
        assert_eq!(ce[0].1, sum[0].1);
        assert_eq!(ce[1].0, TARGETS_INPUT);
        assert_eq!(ce[1].1, tensor(DType::I32, &[2, 3], &[6.0, 7.0, -100.0, 9.0, 10.0, -100.0]));

        // One token per row: every target ignored. i32 ids are accepted as they are.
        let single = tensor(DType::I32, &[2, 1], &[1.0, 2.0]);
        let ce = reference_batch(&single, LossKind::CrossEntropy).unwrap();
        assert_eq!(ce[1].1, tensor(DType::I32, &[2, 1], &[-100.0, -100.0]));

        let mut wide = tensor(DType::I64, &[1, 2], &[0.0, 0.0]);
        bytemuck::cast_slice_mut::<u8, i64>(wide.bytes_mut())[1] = 1 << 40;
        let text = message(reference_batch(&wide, LossKind::Sum));
        assert_contains(&text, "id 1099511627776 at [0, 1] does not fit in i32");
        let text = message(reference_batch(&tensor(DType::F32, &[2], &[0.0, 1.0]), LossKind::Sum));
        assert_contains(&text, "expected i64 or i32 ids of shape [batch, seq], got f32[2]");
    }
}

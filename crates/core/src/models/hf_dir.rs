//! Hugging Face model folders in and out of a session: the `--init-from`
//! and `--out` halves of a training run.
//!
//! **In.** [`HfModelDir::open`] reads a folder as `transformers` writes it
//! (`config.json`, one `model.safetensors` or the shards listed by
//! `model.safetensors.index.json`), memory-maps every shard and validates
//! every header against its file (a truncated shard is an error naming the
//! file and the tensors it cuts). [`HfModelDir::check`] fits the folder to a
//! trace's parameters by name, shape and dtype, and reports every problem
//! (missing, extra, wrong shape, uncastable dtype) naming the file and the
//! tensor: call it before a session is opened, so nothing is allocated on a
//! device for a checkpoint that does not fit. [`HfModelDir::load_into`]
//! then writes the parameters one by one through one reusable host buffer,
//! cast to the parameter's dtype: the model is never in host memory twice.
//! Each tensor is checked finite on the host before it is written, so a
//! damaged file is named (tensor, file, element) instead of surfacing later
//! as a diverged step or NaN text.
//!
//! **Out.** [`save_hf_dir`] writes a folder that
//! `AutoModelForCausalLM.from_pretrained` loads as it is: `config.json`,
//! safetensors shards (with `model.safetensors.index.json` when there is more
//! than one), and the tokenizer, chat-template and generation files
//! ([`TOKENIZER_FILES`]) copied byte for byte from a source folder. Parameters
//! are read from the session one at a time. The save is atomic; see
//! [`save_hf_dir`] for what a `kill -9` at each moment leaves.
//!
//! **Names.** The trace names parameters Llama-style for every family (see
//! [`super::gpt`]). Each family's [`super::family::Family::rules`] maps its
//! Hugging Face tensors to trace parameters, with any fusion; loading and
//! saving both read it. Llama, Mistral, Qwen2, Qwen3, OLMo 2 and Gemma use
//! the trace's names as they are. GPT-NeoX renames everything and fuses q, k and v into
//! `attention.query_key_value`, interleaved per head as `transformers`
//! views it (`[n_head, 3, head_size, ...]`).
//!
//! **Parameters.** Loading writes and saving reads parameters by name
//! through [`NamedParams`], which every session implements
//! (`crate::session`), so this module does not depend on sessions.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::{self, File};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::Mmap;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;
use serde_json::{json, Map, Value};

use super::checkpoint::{from_safetensors_dtype, round_to, to_safetensors_dtype};
use super::config::Config;
use super::family::{instantiate, ConfigKeys, Join, Unlisted};
use super::lora::{is_adapter_weight, is_quantized_leaf, quantized_weights};
use crate::error::{Error, Result};
use crate::host::{bytes_to_f64, HostTensor};
use crate::ir::{DType, TensorType, Trace};
use crate::ops::rope::RopeScaling;

pub use super::family::HfFamily;

// Tensor bytes are viewed as they are in the file, which is little-endian.
const _: () = assert!(cfg!(target_endian = "little"), "safetensors checkpoints need a little-endian host");

/// The single-file weights of a Hugging Face folder.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded Hugging Face folder.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The model's hyper-parameters.
pub const CONFIG_FILE: &str = "config.json";
/// Files [`save_hf_dir`] copies from the tokenizer folder when present:
/// every file `transformers` reads beside the weights to make the
/// tokenizer (fast or SentencePiece, BPE vocabulary and merges, added and
/// special tokens), its chat template (`chat_template.jinja`, or the older
/// `chat_template.json`) and the generation settings. A folder without one
/// of them would load a different tokenizer, lose its chat template or
/// generate with other settings, and a save back into the source folder
/// would delete the file.
pub const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
];
/// The model's generation settings, one of [`TOKENIZER_FILES`], taken from
/// [`SaveOptions::model_from`] when that folder has it.
pub const GENERATION_FILE: &str = "generation_config.json";
/// The shard size `transformers` uses by default (5 GB).
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// The trace's names of the token embedding and the LM head, whose
/// Hugging Face tensors a tied model may hold the same values in.
const EMBED_PARAM: &str = "model.embed_tokens.weight";
const HEAD_PARAM: &str = "lm_head.weight";

/// The longest header the `safetensors` reference implementation accepts.
const MAX_HEADER_BYTES: u64 = 100_000_000;
/// How many problems an error lists before it says "and N more".
const LIST_AT_MOST: usize = 8;
/// Elements converted per chunk when casting, so a cast needs no f64 copy of
/// a whole tensor.
const CAST_CHUNK: usize = 1 << 16;

/// Parameters held by name, which [`HfModelDir::load_into`] writes and
/// [`save_hf_dir`] reads: a session (every `crate::session::Session` is
/// one), or anything else that holds a trace's parameters.
pub trait NamedParams {
    /// The name of the trace whose parameters these are, for messages.
    fn params_trace_name(&self) -> &str;

    /// Whether a leaf called `name` is held.
    fn has_param(&self, name: &str) -> bool;

    /// The leaf called `name`, read back to the host.
    fn read_param(&mut self, name: &str) -> Result<HostTensor>;

    /// Writes the leaf called `name`.
    fn write_param(&mut self, name: &str, value: &HostTensor) -> Result<()>;
}

/// One Hugging Face tensor of a model and the trace parameters it holds.
#[derive(Clone, Debug)]
struct Mapping {
    hf: String,
    /// The parameters, in the order the join takes them (q, k, v).
    params: Vec<(String, TensorType)>,
    join: Join,
    /// Attention heads, which a per-head join interleaves.
    heads: usize,
    /// The Hugging Face tensor's shape and dtype (the parameters' dtype).
    ty: TensorType,
    /// For a [`Join::Experts`] rule, the expert this tensor is: the
    /// parameter's slice `expert` along its first axis.
    expert: Option<usize>,
}

impl Mapping {
    /// The bytes of this tensor within `stack`, the value of its one
    /// parameter, for an expert's tensor (its slice); the whole value otherwise.
    fn slice_of<'a>(&self, stack: &'a [u8]) -> &'a [u8] {
        match self.expert {
            Some(e) => {
                let n = self.ty.numel() * stack.len() / self.params[0].1.numel().max(1);
                &stack[e * n..][..n]
            }
            None => stack,
        }
    }
}

/// Every weight of the model in `trace` (trained or frozen, adapters
/// aside: a folder holds the base model) mapped to the Hugging Face tensor
/// that holds it, in the trace's order (a fused tensor where its first
/// part is).
fn map_params(family: HfFamily, trace: &Trace, heads: usize) -> Result<Vec<Mapping>> {
    let family = family.family();
    // The weights as a folder holds them: an NF4 weight as the one tensor
    // its leaves stand for.
    let mut params: Vec<(String, TensorType)> = trace
        .weights()
        .map(|p| (trace.value(p).kind.leaf_name().unwrap_or_default().to_string(), trace.ty(p).clone()))
        .filter(|(name, _)| !is_adapter_weight(name) && !is_quantized_leaf(name))
        .collect();
    params.extend(quantized_weights(trace).into_iter().map(|q| (q.name, q.ty)));
    let by_name: HashMap<&str, TensorType> = params.iter().map(|(n, t)| (n.as_str(), t.clone())).collect();
    let internal = |reason: String| Error::Checkpoint { path: format!("trace `{}`", trace.name), reason };
    let mut mappings = Vec::new();
    let mut covered: BTreeSet<&str> = BTreeSet::new();
    for (name, v) in &params {
        if covered.contains(name.as_str()) {
            continue;
        }
        // Any part of a fused tensor finds its rule, whichever the trace lists first.
        let Some((rule, layer)) = family.rule_for_param(name) else {
            if let Unlisted::Refused { title } = family.unlisted() {
                return Err(internal(format!("parameter `{name}` has no {title} name")));
            }
            covered.insert(name);
            mappings.push(Mapping {
                hf: name.clone(),
                params: vec![(name.clone(), v.clone())],
                join: Join::Same,
                heads,
                ty: v.clone(),
                expert: None,
            });
            continue;
        };
        if rule.join == Join::Experts {
            // One tensor per expert, each the parameter's slice along its first axis.
            covered.insert(name);
            let Some((&experts, slice)) = v.shape.split_first() else {
                return Err(internal(format!("parameter `{name}` stacks experts but is a scalar")));
            };
            for e in 0..experts {
                mappings.push(Mapping {
                    hf: super::family::instantiate_expert(rule.hf, layer, e),
                    params: vec![(name.clone(), v.clone())],
                    join: Join::Experts,
                    heads,
                    ty: TensorType::new(v.dtype, slice.to_vec()),
                    expert: Some(e),
                });
            }
            continue;
        }
        let mut parts = Vec::with_capacity(rule.trace.len());
        for pattern in rule.trace {
            let part = instantiate(pattern, layer);
            let Some(pv) = by_name.get(part.as_str()).cloned() else {
                return Err(internal(format!(
                    "parameter `{name}` needs `{part}` beside it to make `{}`",
                    instantiate(rule.hf, layer)
                )));
            };
            parts.push((part, pv));
        }
        for (part, _) in &parts {
            if let Some((n, _)) = params.iter().find(|(n, _)| n == part) {
                covered.insert(n.as_str());
            }
        }
        let ty = match rule.join {
            Join::Same | Join::Experts => parts[0].1.clone(),
            Join::PerHead => {
                let first = &parts[0].1;
                if parts.iter().any(|(_, pv)| pv != first) {
                    return Err(internal(format!(
                        "q, k and v of `{}` must have one type to be fused, got {}",
                        instantiate(rule.hf, layer),
                        parts.iter().map(|(_, pv)| pv.to_string()).collect::<Vec<_>>().join(", ")
                    )));
                }
                if first.shape.first().is_none_or(|&rows| heads == 0 || rows % heads != 0) {
                    return Err(internal(format!(
                        "`{}` cannot be split into {heads} heads: its parts are {first}",
                        instantiate(rule.hf, layer)
                    )));
                }
                let mut shape = first.shape.clone();
                shape[0] *= parts.len();
                TensorType::new(first.dtype, shape)
            }
            Join::Rows => {
                let first = &parts[0].1;
                let trailing = |t: &TensorType| (t.dtype, t.shape.get(1..).map(<[usize]>::to_vec));
                if parts.iter().any(|(_, pv)| trailing(pv) != trailing(first)) {
                    return Err(internal(format!(
                        "the parts of `{}` must differ in rows only to be stacked, got {}",
                        instantiate(rule.hf, layer),
                        parts.iter().map(|(_, pv)| pv.to_string()).collect::<Vec<_>>().join(", ")
                    )));
                }
                let mut shape = first.shape.clone();
                shape[0] = parts.iter().map(|(_, pv)| pv.shape[0]).sum();
                TensorType::new(first.dtype, shape)
            }
        };
        mappings.push(Mapping {
            hf: instantiate(rule.hf, layer),
            params: parts,
            join: rule.join,
            heads,
            ty,
            expert: None,
        });
    }
    Ok(mappings)
}

/// `config.json`'s `torch_dtype` for a parameter dtype.
fn torch_dtype(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::F64 => "float64",
        DType::I32 => "int32",
        DType::I64 => "int64",
        DType::Bool => "bool",
    }
}

fn checkpoint_error(path: &Path, reason: impl Into<String>) -> Error {
    Error::Checkpoint { path: path.display().to_string(), reason: reason.into() }
}

fn io_error(path: &Path, cause: io::Error) -> Error {
    Error::Io { path: path.display().to_string(), cause }
}

/// `problems` joined, at most [`LIST_AT_MOST`] of them, then "and N more".
fn join_problems(problems: &[String]) -> String {
    let mut text = problems.iter().take(LIST_AT_MOST).cloned().collect::<Vec<_>>().join("; ");
    if problems.len() > LIST_AT_MOST {
        text.push_str(&format!("; and {} more problems", problems.len() - LIST_AT_MOST));
    }
    text
}

/// One memory-mapped safetensors shard.
struct Shard {
    path: PathBuf,
    map: Mmap,
    /// Where the tensor data starts in the file (after the header).
    data_start: usize,
}

/// One tensor of a folder: where its bytes are.
#[derive(Clone, Debug)]
struct Entry {
    shard: usize,
    /// The file's dtype, which stepgraph may not have.
    file_dtype: Dtype,
    shape: Vec<usize>,
    /// Byte range in the shard's tensor data.
    begin: usize,
    end: usize,
}

/// Parses and validates the header of the safetensors file `path` mapped at
/// `bytes`: the tensors and where their data starts. Every tensor must lie
/// inside the file with exactly the bytes its dtype and shape need; a
/// truncated file names the tensors it cuts.
fn parse_shard_header(path: &Path, bytes: &[u8]) -> Result<(usize, Vec<(String, TensorInfo)>)> {
    let bad = |reason: String| checkpoint_error(path, reason);
    let file_len = bytes.len() as u64;
    if file_len < 8 {
        return Err(bad(format!(
            "not a safetensors file: {file_len} bytes, fewer than the 8 that give the header's length (truncated?)"
        )));
    }
    let header_len = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    if header_len > MAX_HEADER_BYTES || header_len > file_len - 8 {
        return Err(bad(format!(
            "not a complete safetensors file: it gives a header of {header_len} bytes in a file of {file_len} bytes (truncated?)"
        )));
    }
    let data_start = 8 + header_len as usize;
    let header = std::str::from_utf8(&bytes[8..data_start])
        .map_err(|e| bad(format!("not a safetensors file: the header is not UTF-8 ({e})")))?;
    let metadata: Metadata =
        serde_json::from_str(header).map_err(|e| bad(format!("not a safetensors file: invalid header: {e}")))?;
    let data_len = bytes.len() - data_start;
    let mut tensors: Vec<(String, TensorInfo)> =
        metadata.tensors().into_iter().map(|(name, info)| (name, info.clone())).collect();
    tensors.sort_by_key(|(_, info)| info.data_offsets);
    let mut cut = Vec::new();
    for (name, info) in &tensors {
        let (begin, end) = info.data_offsets;
        let need =
            info.shape.iter().try_fold(info.dtype.bitsize(), |acc, &d| acc.checked_mul(d)).map(|bits| bits.div_ceil(8));
        if begin > end || need != Some(end - begin) {
            return Err(bad(format!(
                "tensor `{name}`: its offsets {begin}..{end} do not hold a {:?} tensor of shape {:?}",
                info.dtype, info.shape
            )));
        }
        if end > data_len {
            cut.push(format!("`{name}` (bytes {begin}..{end})"));
        }
    }
    if !cut.is_empty() {
        let shown = cut.iter().take(LIST_AT_MOST).cloned().collect::<Vec<_>>().join(", ");
        let more =
            if cut.len() > LIST_AT_MOST { format!(" and {} more", cut.len() - LIST_AT_MOST) } else { String::new() };
        return Err(bad(format!(
            "truncated: the file holds {data_len} bytes of tensor data, which cuts tensor {shown}{more}"
        )));
    }
    let described = tensors.last().map_or(0, |(_, info)| info.data_offsets.1);
    if described != data_len || metadata.data_len() != data_len {
        return Err(bad(format!(
            "corrupt: the header describes {} bytes of tensor data, the file holds {data_len}",
            metadata.data_len()
        )));
    }
    Ok((data_start, tensors))
}

/// Whether `name` is the name [`save_hf_dir`] gives its temporary or
/// set-aside folders (`.NAME.tmp-PID-N`, `.NAME.old-PID-N`).
fn is_save_leftover(name: &str) -> bool {
    name.starts_with('.') && (name.contains(".tmp-") || name.contains(".old-"))
}

/// A Hugging Face model folder, open and validated: its config, and its
/// shards memory-mapped. See the module doc.
pub struct HfModelDir {
    dir: PathBuf,
    config: Config,
    family: HfFamily,
    /// `config.json` as it was, so a save keeps what stepgraph does not read
    /// (token ids, the tokenizer's settings, ...).
    raw_config: Map<String, Value>,
    shards: Vec<Shard>,
    tensors: BTreeMap<String, Entry>,
}

impl HfModelDir {
    /// Opens the folder `dir`: reads `config.json` into a [`Config`] (named
    /// after the folder), finds the weights (`model.safetensors.index.json`
    /// and the shards it lists, or `model.safetensors`), memory-maps them
    /// and validates every header.
    ///
    /// Errors name the file and, where there is one, the tensor: no weights,
    /// an index that is not JSON or names a shard that does not exist, a
    /// shard that is truncated or not safetensors, a tensor in two shards or
    /// in a shard the index does not give it. A temporary folder of an
    /// interrupted [`save_hf_dir`] is refused.
    pub fn open(dir: &Path) -> Result<HfModelDir> {
        if let Some(name) = dir.file_name().and_then(|n| n.to_str()) {
            if is_save_leftover(name) {
                return Err(checkpoint_error(
                    dir,
                    "this is the temporary folder of an interrupted or replaced save, not a model; \
                     open the destination the save was writing",
                ));
            }
        }
        if !dir.is_dir() {
            return Err(checkpoint_error(dir, "not a directory (expected a Hugging Face model folder)"));
        }
        let config_path = dir.join(CONFIG_FILE);
        if !config_path.is_file() && dir.join("state.json").is_file() && dir.join("weights.safetensors").is_file() {
            return Err(checkpoint_error(
                dir,
                format!(
                    "is a training checkpoint, not a model folder: `stepgraph export {} --out DIR` writes it as one \
                     (add --init-from with the run's starting folder to keep its tokenizer)",
                    dir.display()
                ),
            ));
        }
        if !config_path.is_file() {
            return Err(checkpoint_error(
                dir,
                format!("has no {CONFIG_FILE} (a Hugging Face model folder holds {CONFIG_FILE} and the safetensors weights)"),
            ));
        }
        let config = Config::from_hf_file(&config_path)?;
        let text = fs::read_to_string(&config_path).map_err(|e| io_error(&config_path, e))?;
        let raw_config = match serde_json::from_str::<Value>(&text) {
            Ok(Value::Object(map)) => map,
            _ => return Err(checkpoint_error(&config_path, "must hold a JSON object")),
        };
        let model_type = raw_config.get("model_type").and_then(Value::as_str).unwrap_or_default();
        let family = HfFamily::from_model_type(model_type)
            .ok_or_else(|| checkpoint_error(&config_path, format!("model_type `{model_type}` is not supported")))?;

        let index_path = dir.join(INDEX_FILE);
        let single_path = dir.join(SINGLE_FILE);
        // The shard files, and for an index the tensors it assigns to each.
        let (files, assigned): (Vec<String>, Option<BTreeMap<String, String>>) = if index_path.exists() {
            let assigned = read_index(&index_path)?;
            let files: BTreeSet<String> = assigned.values().cloned().collect();
            for file in &files {
                if !dir.join(file).is_file() {
                    let tensor = assigned.iter().find(|(_, f)| *f == file).map(|(t, _)| t.as_str()).unwrap_or("");
                    return Err(checkpoint_error(
                        &index_path,
                        format!(
                            "names shard `{file}` (for tensor `{tensor}` and others), which does not exist in {}",
                            dir.display()
                        ),
                    ));
                }
            }
            (files.into_iter().collect(), Some(assigned))
        } else if single_path.exists() {
            (vec![SINGLE_FILE.to_string()], None)
        } else {
            return Err(checkpoint_error(
                dir,
                format!("has neither {SINGLE_FILE} nor {INDEX_FILE}; only safetensors weights load"),
            ));
        };

        let mut shards = Vec::with_capacity(files.len());
        let mut tensors: BTreeMap<String, Entry> = BTreeMap::new();
        for file_name in &files {
            let path = dir.join(file_name);
            let file = File::open(&path).map_err(|e| io_error(&path, e))?;
            // SAFETY: the map is read-only and lives as long as `self`. Like
            // every safetensors loader, this assumes no one truncates or
            // rewrites the file while it is open (stepgraph's own saves never
            // do: they write new files and rename them).
            let map = unsafe { Mmap::map(&file) }.map_err(|e| io_error(&path, e))?;
            let (data_start, header) = parse_shard_header(&path, &map)?;
            let shard = shards.len();
            for (name, info) in header {
                if let Some(assigned) = &assigned {
                    if assigned.get(&name) != Some(file_name) {
                        let said = match assigned.get(&name) {
                            Some(other) => format!("the index puts it in `{other}`"),
                            None => "the index does not list it".to_string(),
                        };
                        return Err(checkpoint_error(
                            &path,
                            format!("holds tensor `{name}`, but {said} ({})", index_path.display()),
                        ));
                    }
                }
                let entry = Entry {
                    shard,
                    file_dtype: info.dtype,
                    shape: info.shape,
                    begin: info.data_offsets.0,
                    end: info.data_offsets.1,
                };
                if let Some(previous) = tensors.insert(name.clone(), entry) {
                    return Err(checkpoint_error(
                        &path,
                        format!("holds tensor `{name}`, which `{}` holds too", shards_path(&shards, previous.shard)),
                    ));
                }
            }
            shards.push(Shard { path, map, data_start });
        }
        if let Some(assigned) = &assigned {
            if let Some((name, file)) = assigned.iter().find(|(name, _)| !tensors.contains_key(*name)) {
                return Err(checkpoint_error(
                    &dir.join(file),
                    format!("lacks tensor `{name}`, which {INDEX_FILE} puts in it"),
                ));
            }
        }
        Ok(HfModelDir { dir: dir.to_path_buf(), config, family, raw_config, shards, tensors })
    }

    /// The model's config, from `config.json`.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The folder's family (its `model_type`).
    pub fn family(&self) -> HfFamily {
        self.family
    }

    /// `config.json` as read, for [`SaveOptions::source_config`].
    pub fn raw_config(&self) -> &Map<String, Value> {
        &self.raw_config
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Names of every tensor in the folder's weights, sorted.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    fn file_of(&self, entry: &Entry) -> &Path {
        &self.shards[entry.shard].path
    }

    fn bytes_of(&self, entry: &Entry) -> &[u8] {
        let shard = &self.shards[entry.shard];
        &shard.map[shard.data_start + entry.begin..shard.data_start + entry.end]
    }

    /// Checks that the folder holds exactly the parameters of `trace`: every
    /// one present with its shape and a float dtype that casts to the
    /// parameter's, no tensor without a parameter (buffers such as
    /// `rotary_emb.inv_freq` aside), and for a tied model an LM head that is
    /// absent or equal to the embedding. Every problem is reported at once,
    /// each naming the file and the tensor. Reads no tensor data except
    /// a tied head's.
    pub fn check(&self, trace: &Trace) -> Result<()> {
        self.check_mappings(trace).map(|_| ())
    }

    fn check_mappings(&self, trace: &Trace) -> Result<Vec<Mapping>> {
        let mappings = map_params(self.family, trace, self.config.n_head)?;
        let mut problems = Vec::new();
        let mut used: BTreeSet<&str> = BTreeSet::new();
        for m in &mappings {
            let Some(entry) = self.tensors.get(&m.hf) else {
                let params = m.params.iter().map(|(n, _)| format!("`{n}`")).collect::<Vec<_>>().join(", ");
                problems.push(format!("tensor `{}` (parameter {params}) is missing", m.hf));
                continue;
            };
            used.insert(&m.hf);
            let file = self.file_of(entry).display();
            if entry.shape != m.ty.shape {
                problems.push(format!(
                    "{file}: tensor `{}` has shape {:?}, the model expects {:?}",
                    m.hf, entry.shape, m.ty.shape
                ));
            }
            match from_safetensors_dtype(entry.file_dtype) {
                Some(d) if d.is_float() => {}
                _ => problems.push(format!(
                    "{file}: tensor `{}` has dtype {:?}, which does not cast to the model's {}; only F32, BF16, F16 and F64 tensors load into parameters",
                    m.hf, entry.file_dtype, m.ty.dtype
                )),
            }
        }
        let family = self.family.family();
        let embed = family.hf_name(EMBED_PARAM).unwrap_or_default();
        let head = family.hf_name(HEAD_PARAM).unwrap_or_default();
        let (embed, head) = (embed.as_str(), head.as_str());
        let tied = !mappings.iter().any(|m| m.hf == head) && mappings.iter().any(|m| m.hf == embed);
        for (name, entry) in &self.tensors {
            if used.contains(name.as_str()) || family.ignored_suffixes().iter().any(|s| name.ends_with(s)) {
                continue;
            }
            let file = self.file_of(entry).display();
            if tied && name == head {
                if let Some(embed_entry) = self.tensors.get(embed) {
                    let equal = embed_entry.file_dtype == entry.file_dtype
                        && embed_entry.shape == entry.shape
                        && self.bytes_of(embed_entry) == self.bytes_of(entry);
                    if !equal {
                        problems.push(format!(
                            "{file}: tensor `{head}` differs from `{embed}`, but the model ties its LM head to the embedding (tie_word_embeddings)"
                        ));
                    }
                }
                continue;
            }
            problems.push(format!("{file}: tensor `{name}` has no parameter in the model"));
        }
        if problems.is_empty() {
            Ok(mappings)
        } else {
            Err(checkpoint_error(
                &self.dir,
                format!("does not fit the parameters of trace `{}`: {}", trace.name, join_problems(&problems)),
            ))
        }
    }

    /// Writes every parameter of `trace` into `session` (by name, so
    /// `trace` may be the forward trace of the session's step), after
    /// [`HfModelDir::check`]. Tensors are converted one at a time into one
    /// reusable host buffer, cast to the parameter's dtype with one rounding
    /// to nearest even; a NaN or an infinity in the file, or a finite value
    /// that overflows the parameter's dtype, is an error naming the file,
    /// the tensor and the element.
    pub fn load_into(&self, trace: &Trace, session: &mut (impl NamedParams + ?Sized)) -> Result<()> {
        // A base weight stored as NF4 is quantized as it loads.
        let quantized = quantized_weights(trace);
        self.load_into_with(trace, &mut |name, t| match quantized.iter().find(|q| q.name == name) {
            Some(q) => q.write(session, t),
            None => session.write_param(name, t),
        })
    }

    /// [`HfModelDir::load_into`] with every parameter handed to `write`
    /// (its name in `trace`, its converted values) instead of written to a
    /// session: a caller whose session holds the parameters differently
    /// (generation's fused projections) places them itself.
    pub fn load_into_with(&self, trace: &Trace, write: &mut dyn FnMut(&str, &HostTensor) -> Result<()>) -> Result<()> {
        let mappings = self.check_mappings(trace)?;
        let mut buffer = HostTensor::zeros(TensorType::new(DType::F32, [0]));
        // A parameter stacking experts, filled one expert's tensor at a
        // time (its tensors are consecutive mappings) and written whole.
        let mut stack: Option<HostTensor> = None;
        for m in &mappings {
            let entry = &self.tensors[&m.hf];
            let src_dtype = from_safetensors_dtype(entry.file_dtype).expect("checked: a float dtype");
            let src = self.bytes_of(entry);
            let file = self.file_of(entry);
            // Checked on the host, where the bytes are anyway, before any
            // reaches the device: a NaN loaded here would surface steps
            // later as an overflow blamed on the learning rate.
            if let Some((at, x)) = first_non_finite(src_dtype, src) {
                return Err(checkpoint_error(
                    file,
                    format!(
                        "tensor `{}` holds {x} at element {at} of {}: the folder is damaged; restore it from a good \
                         copy (download or save it again)",
                        m.hf,
                        src.len() / src_dtype.size()
                    ),
                ));
            }
            if let Some(e) = m.expert {
                let (name, ty) = &m.params[0];
                let whole = stack.get_or_insert_with(|| HostTensor::zeros(ty.clone()));
                let slice = m.slice_of(whole.bytes()).len();
                convert(src_dtype, src, ty.dtype, &mut whole.bytes_mut()[e * slice..][..slice], file, &m.hf)?;
                if e + 1 == ty.shape[0] {
                    write(name, &stack.take().expect("filled above"))?;
                }
                continue;
            }
            // Each part's bytes as the file stores them.
            let sizes: Vec<usize> = m.params.iter().map(|(_, ty)| ty.numel() * src_dtype.size()).collect();
            for (k, (name, ty)) in m.params.iter().enumerate() {
                let ty = ty.clone();
                buffer.retype(ty.clone());
                let dst = buffer.bytes_mut();
                let blocks = m.join.part(src, m.heads, &sizes, k);
                let dst_block = dst.len() / blocks.len();
                for (h, s) in blocks.into_iter().enumerate() {
                    convert(src_dtype, s, ty.dtype, &mut dst[h * dst_block..][..dst_block], file, &m.hf)?;
                }
                write(name, &buffer)?;
            }
        }
        Ok(())
    }
}

/// Hugging Face tensors of `family` (a state dict, or its gradients) under
/// the trace's names, by the same table [`HfModelDir::load_into`] reads:
/// renamed, and fused tensors split into their parts (GPT-NeoX's
/// `query_key_value` into q, k and v of `config`'s heads, Phi-3's
/// `qkv_proj` and `gate_up_proj` by the rows of each part). The inverse of
/// [`to_hf_tensors`]. Buffers that are not parameters are dropped; a
/// tensor no rule names is kept as it is, for the caller's check against
/// the model to report.
pub fn from_hf_tensors(
    family: HfFamily,
    config: &Config,
    tensors: Vec<(String, HostTensor)>,
) -> Result<Vec<(String, HostTensor)>> {
    let family = family.family();
    let n_head = config.n_head;
    let mut out = Vec::with_capacity(tensors.len());
    // Expert tensors by the parameter that stacks them, until all are seen.
    let mut stacks: BTreeMap<String, Vec<Option<HostTensor>>> = BTreeMap::new();
    for (name, tensor) in tensors {
        if family.ignored_suffixes().iter().any(|s| name.ends_with(s)) {
            continue;
        }
        let Some((rule, layer)) = family.rule_for_hf(&name) else {
            out.push((name, tensor));
            continue;
        };
        match rule.join {
            Join::Same => out.push((instantiate(rule.trace[0], layer), tensor)),
            Join::Experts => {
                let experts = config.moe.as_ref().map_or(0, |m| m.experts);
                let expert = super::family::match_numbers(rule.hf, &name).and_then(|(_, e)| e);
                let Some(e) = expert.filter(|&e| e < experts) else {
                    return Err(Error::Input {
                        name,
                        reason: format!("names an expert the model's {experts} experts do not have"),
                    });
                };
                let param = instantiate(rule.trace[0], layer);
                let slots = stacks.entry(param.clone()).or_insert_with(|| vec![None; experts]);
                if let Some(first) = slots.iter().flatten().next() {
                    if first.ty != tensor.ty {
                        return Err(Error::Input {
                            name,
                            reason: format!("is {}, but the other experts of `{param}` are {}", tensor.ty, first.ty),
                        });
                    }
                }
                slots[e] = Some(tensor);
                if slots.iter().all(Option::is_some) {
                    let parts: Vec<HostTensor> =
                        stacks.remove(&param).expect("present").into_iter().flatten().collect();
                    let mut shape = vec![experts];
                    shape.extend(&parts[0].ty.shape);
                    let mut stack = HostTensor::zeros(TensorType::new(parts[0].ty.dtype, shape));
                    let n = parts[0].bytes().len();
                    for (k, p) in parts.iter().enumerate() {
                        stack.bytes_mut()[k * n..][..n].copy_from_slice(p.bytes());
                    }
                    out.push((param, stack));
                }
            }
            Join::PerHead => {
                let parts = rule.trace.len();
                let rows = tensor.ty.shape.first().copied().unwrap_or(0);
                if n_head == 0 || rows == 0 || rows % (parts * n_head) != 0 {
                    return Err(Error::Input {
                        name,
                        reason: format!(
                            "is {}, which does not split into {parts} parts of {n_head} heads (the model's \
                             num_attention_heads)",
                            tensor.ty
                        ),
                    });
                }
                let mut shape = tensor.ty.shape.clone();
                shape[0] = rows / parts;
                for (k, pattern) in rule.trace.iter().enumerate() {
                    let mut part = HostTensor::zeros(TensorType::new(tensor.ty.dtype, shape.clone()));
                    let dst = part.bytes_mut();
                    let mut offset = 0;
                    let sizes = vec![tensor.bytes().len() / parts; parts];
                    for block in rule.join.part(tensor.bytes(), n_head, &sizes, k) {
                        dst[offset..offset + block.len()].copy_from_slice(block);
                        offset += block.len();
                    }
                    out.push((instantiate(pattern, layer), part));
                }
            }
            Join::Rows => {
                let rows: Vec<usize> =
                    rule.trace.iter().map(|p| part_rows(config, p)).collect::<Option<_>>().ok_or_else(|| {
                        Error::Input {
                            name: name.clone(),
                            reason: format!("has parts {:?} whose rows the model does not give", rule.trace),
                        }
                    })?;
                let total: usize = rows.iter().sum();
                if tensor.ty.shape.first() != Some(&total) {
                    return Err(Error::Input {
                        name,
                        reason: format!(
                            "is {}, but its parts {:?} stack {total} rows (the model's config.json)",
                            tensor.ty, rule.trace
                        ),
                    });
                }
                let row_bytes = tensor.bytes().len() / total.max(1);
                let sizes: Vec<usize> = rows.iter().map(|r| r * row_bytes).collect();
                for (k, pattern) in rule.trace.iter().enumerate() {
                    let mut shape = tensor.ty.shape.clone();
                    shape[0] = rows[k];
                    let mut part = HostTensor::zeros(TensorType::new(tensor.ty.dtype, shape));
                    part.bytes_mut().copy_from_slice(rule.join.part(tensor.bytes(), n_head, &sizes, k)[0]);
                    out.push((instantiate(pattern, layer), part));
                }
            }
        }
    }
    if let Some((param, slots)) = stacks.into_iter().next() {
        let missing: Vec<usize> = slots.iter().enumerate().filter(|(_, s)| s.is_none()).map(|(e, _)| e).collect();
        return Err(Error::Input { name: param, reason: format!("has no tensor for experts {missing:?}") });
    }
    Ok(out)
}

/// Rows of the parameter named by the rule pattern `pattern` (the
/// builder's names: q, k and v projections, gate and up projections), as
/// `config` sizes them; `None` for a name a join of rows does not stack.
fn part_rows(config: &Config, pattern: &str) -> Option<usize> {
    let (q, kv) = (config.n_head * config.head_size, config.n_query_groups * config.head_size);
    let part = pattern.rsplit('.').nth(1)?;
    match part {
        "q_proj" => Some(q),
        "k_proj" | "v_proj" => Some(kv),
        "gate_proj" | "up_proj" => Some(config.intermediate_size),
        _ => None,
    }
}

fn shards_path(shards: &[Shard], index: usize) -> String {
    shards.get(index).map_or_else(String::new, |s| s.path.display().to_string())
}

/// `weight_map` of an index file: tensor name → shard file name.
fn read_index(path: &Path) -> Result<BTreeMap<String, String>> {
    let text = fs::read_to_string(path).map_err(|e| io_error(path, e))?;
    let value: Value =
        serde_json::from_str(&text).map_err(|e| checkpoint_error(path, format!("is not valid JSON: {e}")))?;
    let map = value
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| checkpoint_error(path, "has no `weight_map` object (tensor name → shard file)"))?;
    let mut assigned = BTreeMap::new();
    for (name, file) in map {
        let file = file.as_str().ok_or_else(|| {
            checkpoint_error(path, format!("`weight_map` gives tensor `{name}` the shard {file}, not a file name"))
        })?;
        // A shard is a file beside the index, never a path elsewhere.
        if file.contains('/') || file.contains('\\') || file == ".." || file.is_empty() {
            return Err(checkpoint_error(
                path,
                format!("`weight_map` gives tensor `{name}` the shard `{file}`; shards are file names in the folder"),
            ));
        }
        assigned.insert(name.clone(), file.to_string());
    }
    Ok(assigned)
}

/// The first element of `bytes` (little-endian `dtype` values) that is NaN
/// or infinite, with its index and value. Reads only exponent bits, so a
/// whole checkpoint is scanned at memory speed.
fn first_non_finite(dtype: DType, bytes: &[u8]) -> Option<(usize, f64)> {
    fn scan<const N: usize>(bytes: &[u8], bad: impl Fn([u8; N]) -> bool) -> Option<usize> {
        bytes.chunks_exact(N).position(|c| bad(c.try_into().expect("N bytes")))
    }
    let at = match dtype {
        DType::F32 => scan::<4>(bytes, |b| u32::from_le_bytes(b) & 0x7f80_0000 == 0x7f80_0000),
        DType::F64 => scan::<8>(bytes, |b| u64::from_le_bytes(b) & 0x7ff0_0000_0000_0000 == 0x7ff0_0000_0000_0000),
        DType::BF16 => scan::<2>(bytes, |b| u16::from_le_bytes(b) & 0x7f80 == 0x7f80),
        DType::F16 => scan::<2>(bytes, |b| u16::from_le_bytes(b) & 0x7c00 == 0x7c00),
        DType::I32 | DType::I64 | DType::Bool => None,
    }?;
    let size = dtype.size();
    Some((at, bytes_to_f64(dtype, &bytes[at * size..(at + 1) * size])[0]))
}

/// Converts the `from` values in `src` to `to` in `dst` (same element
/// count), rounding once to nearest even; a finite value that becomes
/// infinite is an error naming `file` and `tensor`.
fn convert(from: DType, src: &[u8], to: DType, dst: &mut [u8], file: &Path, tensor: &str) -> Result<()> {
    if from == to {
        dst.copy_from_slice(src);
        return Ok(());
    }
    let (src_size, dst_size) = (from.size(), to.size());
    for (chunk, (s, d)) in src.chunks(CAST_CHUNK * src_size).zip(dst.chunks_mut(CAST_CHUNK * dst_size)).enumerate() {
        let values = bytes_to_f64(from, s);
        for (i, (&x, out)) in values.iter().zip(d.chunks_exact_mut(dst_size)).enumerate() {
            let y = round_to(x, to);
            if x.is_finite() && !y.is_finite() {
                return Err(checkpoint_error(
                    file,
                    format!(
                        "tensor `{tensor}`: casting from {from} to {to} overflows: element {} is {x}",
                        chunk * CAST_CHUNK + i
                    ),
                ));
            }
            encode(to, y, out);
        }
    }
    Ok(())
}

/// Writes `x` (exactly representable in `dtype`) as one element of `dtype`.
fn encode(dtype: DType, x: f64, out: &mut [u8]) {
    match dtype {
        DType::F32 => out.copy_from_slice(&(x as f32).to_le_bytes()),
        DType::F64 => out.copy_from_slice(&x.to_le_bytes()),
        DType::BF16 => out.copy_from_slice(&half::bf16::from_f64(x).to_le_bytes()),
        DType::F16 => out.copy_from_slice(&half::f16::from_f64(x).to_le_bytes()),
        DType::I32 => out.copy_from_slice(&(x as i32).to_le_bytes()),
        DType::I64 => out.copy_from_slice(&(x as i64).to_le_bytes()),
        DType::Bool => out[0] = (x != 0.0) as u8,
    }
}

/// How [`save_hf_dir`] writes a folder.
#[derive(Clone, Debug)]
pub struct SaveOptions<'a> {
    /// Folder whose tokenizer files ([`TOKENIZER_FILES`]) are copied, when
    /// present there.
    pub tokenizer_from: Option<&'a Path>,
    /// The model folder the weights came from: its [`GENERATION_FILE`]
    /// (the model's generation settings, not the tokenizer's) is copied in
    /// preference to one in `tokenizer_from`.
    pub model_from: Option<&'a Path>,
    /// Largest shard in bytes of tensor data; a single tensor larger than
    /// this gets a shard of its own.
    pub max_shard_bytes: u64,
    /// The `model_type` to write; `None` takes [`HfFamily::of_config`].
    /// Must have the config's layout (a Llama config may be `mistral`).
    pub family: Option<HfFamily>,
    /// A `config.json` whose other keys (token ids, ...) are kept; the keys
    /// that describe the network are always written from the [`Config`].
    pub source_config: Option<&'a Map<String, Value>>,
}

impl Default for SaveOptions<'_> {
    fn default() -> Self {
        SaveOptions {
            tokenizer_from: None,
            model_from: None,
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            family: None,
            source_config: None,
        }
    }
}

/// What [`save_hf_dir`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SaveReport {
    /// The destination folder.
    pub dir: PathBuf,
    /// The weight files, in order.
    pub shards: Vec<String>,
    /// Bytes of tensor data over all shards.
    pub tensor_bytes: u64,
    /// Tensors written.
    pub tensors: usize,
    /// Tokenizer files copied.
    pub tokenizer_files: Vec<String>,
}

/// Distinguishes temporary folders of concurrent saves in one process.
static SAVE_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Writes the parameters of `trace` (read from `session` by name, one at a
/// time) as a Hugging Face folder at `out` that
/// `AutoModelForCausalLM.from_pretrained(out)` loads: `config.json`,
/// `model.safetensors` or `model-0000i-of-0000n.safetensors` shards of at
/// most `max_shard_bytes` each with `model.safetensors.index.json`, and the
/// tokenizer files copied from `tokenizer_from`.
///
/// **Atomicity.** Everything is written into a new sibling folder
/// `.NAME.tmp-PID-N`, every file fsynced, then the folder fsynced; then it
/// takes `out`'s place and the parent folder is fsynced. A `kill -9`:
/// - before the swap leaves `out` as it was (the previous complete save, or
///   nothing) plus a partial `.NAME.tmp-*` folder, which [`HfModelDir::open`]
///   refuses and the next save to `out` removes;
/// - on Linux the swap is one `renameat2(RENAME_EXCHANGE)` (or one `rename`
///   when `out` does not exist yet), so `out` is always either the previous
///   save or the new one; after it, the previous save sits at the temporary
///   name until it is removed, and a kill while removing it leaves a partial
///   `.NAME.tmp-*` folder beside the complete new `out`;
/// - where the exchange is not available (another OS, a file system without
///   it) the previous save is first renamed to `.NAME.old-PID-N` and the new
///   one then renamed to `out`: a kill between those two renames leaves no
///   `out`, the previous complete save at `.NAME.old-*` and the new complete
///   one at `.NAME.tmp-*`; the next save to `out` puts the previous save
///   back before it starts.
///
/// One process saves to a given `out` at a time. The config, the family and
/// every parameter are checked before anything is written.
pub fn save_hf_dir(
    out: &Path,
    config: &Config,
    trace: &Trace,
    session: &mut (impl NamedParams + ?Sized),
    options: &SaveOptions,
) -> Result<SaveReport> {
    config.validate()?;
    // The family asked for, when it computes this network (a family held
    // on request only, as Phi-3 holds a partial-RoPE config, has no
    // natural family to fall back on); else the natural one.
    let natural = || HfFamily::of_config(config).map_err(|reason| checkpoint_error(out, reason));
    let family = match options.family {
        Some(family) if family.can_hold(config) => family,
        Some(family) => {
            let layout = match natural() {
                Ok(f) => format!("the layout of `{}`", f.model_type()),
                Err(e) => e.to_string(),
            };
            return Err(checkpoint_error(
                out,
                format!("cannot save as model_type `{}`: the config has {layout}", family.model_type()),
            ));
        }
        None => natural()?,
    };
    if options.max_shard_bytes == 0 {
        return Err(checkpoint_error(out, "the largest shard size must be positive, got 0 bytes"));
    }
    let mappings = map_params(family, trace, config.n_head)?;
    for m in &mappings {
        for (name, _) in &m.params {
            if !session.has_param(name) {
                return Err(checkpoint_error(
                    out,
                    format!("the session's trace `{}` has no parameter `{name}` to save", session.params_trace_name()),
                ));
            }
        }
    }
    let Some(dtype) = mappings.first().map(|m| m.ty.dtype) else {
        return Err(checkpoint_error(out, format!("trace `{}` has no parameters to save", trace.name)));
    };
    let config_json = hf_config_json(config, family, dtype, options.source_config);
    let report = save_folder_atomically(out, |temp| write_folder(temp, &mappings, &config_json, session, options))?;
    Ok(SaveReport { dir: out.to_path_buf(), ..report })
}

/// Makes the folder `out` whole or not at all: `fill` writes (and syncs)
/// every file into a new temporary folder beside `out`, which then takes
/// `out`'s place as [`save_hf_dir`] describes; leftovers of interrupted
/// saves to `out` are cleaned up first, and an error from `fill` removes
/// the temporary folder and leaves `out` as it was.
pub(crate) fn save_folder_atomically<R>(out: &Path, fill: impl FnOnce(&Path) -> Result<R>) -> Result<R> {
    let file_name = out
        .file_name()
        .and_then(|n| n.to_str())
        .filter(|n| !n.is_empty() && !is_save_leftover(n))
        .ok_or_else(|| checkpoint_error(out, "the destination must end in a folder name"))?;
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !parent.is_dir() {
        return Err(checkpoint_error(out, format!("the parent folder {} does not exist", parent.display())));
    }
    if out.exists() && !out.is_dir() {
        return Err(checkpoint_error(out, "exists and is not a folder; refusing to replace it"));
    }
    remove_leftovers(&parent, file_name);
    let n = SAVE_COUNTER.fetch_add(1, Ordering::Relaxed);
    let temp = parent.join(format!(".{file_name}.tmp-{}-{n}", std::process::id()));
    fs::create_dir(&temp).map_err(|e| io_error(&temp, e))?;
    let written = fill(&temp);
    let report = match written {
        Ok(report) => report,
        Err(e) => {
            // Best effort: the error that matters is the one returned.
            let _ = fs::remove_dir_all(&temp);
            return Err(e);
        }
    };
    swap_into_place(&temp, out, &parent, file_name, n)?;
    Ok(report)
}

/// Cleans up after interrupted saves to `parent/NAME`: when `NAME` is
/// missing but a set-aside previous save `.NAME.old-*` exists (a kill
/// between the two renames of the fallback swap), that save is put back as
/// `NAME` first; then the other `.NAME.tmp-*` and `.NAME.old-*` folders are
/// removed. Best effort: a leftover that cannot be removed does not stop a
/// save.
fn remove_leftovers(parent: &Path, file_name: &str) {
    let Ok(entries) = fs::read_dir(parent) else { return };
    let tmp = format!(".{file_name}.tmp-");
    let old = format!(".{file_name}.old-");
    let mut leftovers: Vec<(bool, PathBuf)> = entries
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_str()?.to_string();
            let is_old = name.starts_with(&old);
            (is_old || name.starts_with(&tmp)).then(|| (is_old, entry.path()))
        })
        .collect();
    let out = parent.join(file_name);
    if !out.exists() {
        if let Some(k) = leftovers.iter().position(|(is_old, _)| *is_old) {
            let (_, previous) = leftovers.swap_remove(k);
            let _ = fs::rename(&previous, &out);
        }
    }
    for (_, path) in leftovers {
        let _ = fs::remove_dir_all(path);
    }
}

pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    // Some file systems refuse to fsync a directory; the files are synced
    // either way, so only opening it is an error.
    let handle = File::open(dir).map_err(|e| io_error(dir, e))?;
    let _ = handle.sync_all();
    Ok(())
}

/// Writes the whole folder into `temp`, fsyncing every file and `temp`.
fn write_folder(
    temp: &Path,
    mappings: &[Mapping],
    config_json: &Value,
    session: &mut (impl NamedParams + ?Sized),
    options: &SaveOptions,
) -> Result<SaveReport> {
    // Shards: consecutive tensors, a new shard when the next would overflow.
    let mut groups: Vec<Vec<&Mapping>> = Vec::new();
    let mut group_bytes = 0u64;
    for m in mappings {
        let bytes = m.ty.bytes();
        match groups.last_mut() {
            Some(group) if group_bytes + bytes <= options.max_shard_bytes => {
                group.push(m);
                group_bytes += bytes;
            }
            _ => {
                groups.push(vec![m]);
                group_bytes = bytes;
            }
        }
    }
    let count = groups.len();
    let names: Vec<String> = if count == 1 {
        vec![SINGLE_FILE.to_string()]
    } else {
        (1..=count).map(|i| format!("model-{i:05}-of-{count:05}.safetensors")).collect()
    };
    let mut weight_map = Map::new();
    let mut tensor_bytes = 0u64;
    for (group, name) in groups.iter().zip(&names) {
        let path = temp.join(name);
        tensor_bytes += write_shard(&path, group, session)?;
        for m in group {
            weight_map.insert(m.hf.clone(), Value::String(name.clone()));
        }
    }
    if count > 1 {
        let index = json!({"metadata": {"total_size": tensor_bytes}, "weight_map": weight_map});
        write_synced(&temp.join(INDEX_FILE), &serde_json::to_vec_pretty(&index)?)?;
    }
    write_synced(&temp.join(CONFIG_FILE), &serde_json::to_vec_pretty(config_json)?)?;
    let tokenizer_files = copy_tokenizer_files(temp, options.tokenizer_from, options.model_from)?;
    sync_dir(temp)?;
    Ok(SaveReport { dir: temp.to_path_buf(), shards: names, tensor_bytes, tensors: mappings.len(), tokenizer_files })
}

/// Copies the tokenizer files of `tokenizer_from` into `dir` (and
/// `generation_config.json` from `model_from` when it has one); returns the
/// names copied.
pub(crate) fn copy_tokenizer_files(
    dir: &Path,
    tokenizer_from: Option<&Path>,
    model_from: Option<&Path>,
) -> Result<Vec<String>> {
    let mut copied = Vec::new();
    for file in TOKENIZER_FILES {
        let from_model = model_from.map(|m| m.join(file)).filter(|p| *file == GENERATION_FILE && p.is_file());
        let Some(src) = from_model.or_else(|| tokenizer_from.map(|t| t.join(file))) else { continue };
        if src.is_file() {
            let bytes = fs::read(&src).map_err(|e| io_error(&src, e))?;
            write_synced(&dir.join(file), &bytes)?;
            copied.push(file.to_string());
        }
    }
    Ok(copied)
}

pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let file = File::create(path).map_err(|e| io_error(path, e))?;
    let mut out = BufWriter::new(&file);
    out.write_all(bytes).and_then(|()| out.flush()).map_err(|e| io_error(path, e))?;
    drop(out);
    file.sync_all().map_err(|e| io_error(path, e))
}

/// Writes one safetensors shard: the header for `group`, then each tensor
/// read from `session` (fused ones assembled from their parts); returns the
/// bytes of tensor data.
fn write_shard(path: &Path, group: &[&Mapping], session: &mut (impl NamedParams + ?Sized)) -> Result<u64> {
    let mut infos = Vec::with_capacity(group.len());
    let mut offset = 0usize;
    for m in group {
        let n = m.ty.bytes() as usize;
        infos.push((
            m.hf.clone(),
            TensorInfo {
                dtype: to_safetensors_dtype(m.ty.dtype),
                shape: m.ty.shape.clone(),
                data_offsets: (offset, offset + n),
            },
        ));
        offset += n;
    }
    // `transformers` refuses shards whose metadata does not say their format.
    let format = HashMap::from([("format".to_string(), "pt".to_string())]);
    let metadata = Metadata::new(Some(format), infos)
        .map_err(|e| checkpoint_error(path, format!("cannot build the safetensors header: {e}")))?;
    let mut header = serde_json::to_vec(&metadata)?;
    // The reference writer pads the header with spaces to 8 bytes, so the
    // data starts aligned.
    header.resize(header.len().next_multiple_of(8), b' ');

    let file = File::create(path).map_err(|e| io_error(path, e))?;
    let mut out = BufWriter::with_capacity(1 << 20, &file);
    let io = |e| io_error(path, e);
    out.write_all(&(header.len() as u64).to_le_bytes()).map_err(io)?;
    out.write_all(&header).map_err(io)?;
    // The parameter a run of expert tensors slices, read once for the run.
    let mut last: Option<(String, HostTensor)> = None;
    for m in group {
        if m.expert.is_some() {
            let name = &m.params[0].0;
            if last.as_ref().is_none_or(|(n, _)| n != name) {
                last = Some((name.clone(), session.read_param(name)?));
            }
            let (_, stack) = last.as_ref().expect("read above");
            if stack.ty.dtype != m.ty.dtype {
                return Err(checkpoint_error(
                    path,
                    format!("parameter `{name}` reads back as {}, the model's parameters are {}", stack.ty, m.ty.dtype),
                ));
            }
            out.write_all(m.slice_of(stack.bytes())).map_err(io)?;
            continue;
        }
        let parts: Vec<HostTensor> =
            m.params.iter().map(|(name, _)| session.read_param(name)).collect::<Result<_>>()?;
        for (part, (name, _)) in parts.iter().zip(&m.params) {
            if part.ty.dtype != m.ty.dtype {
                return Err(checkpoint_error(
                    path,
                    format!("parameter `{name}` reads back as {}, the model's parameters are {}", part.ty, m.ty.dtype),
                ));
            }
        }
        for chunk in joined_chunks(m, &parts) {
            out.write_all(chunk).map_err(io)?;
        }
    }
    out.flush().map_err(io)?;
    drop(out);
    file.sync_all().map_err(io)?;
    Ok(offset as u64)
}

/// The bytes of `m`'s Hugging Face tensor, in order, as slices of its
/// parts (see [`Join::chunks`]).
fn joined_chunks<'a>(m: &Mapping, parts: &'a [HostTensor]) -> Vec<&'a [u8]> {
    let parts: Vec<&[u8]> = parts.iter().map(HostTensor::bytes).collect();
    m.join.chunks(&parts, m.heads)
}

/// The Hugging Face tensors of `trace`'s parameters as `family` names and
/// lays them out, each assembled (fused where the family fuses) from the
/// per-parameter tensors `value_of(parameter name)` returns: the
/// parameters themselves, or their gradients, for comparing with PyTorch.
pub fn to_hf_tensors(
    family: HfFamily,
    trace: &Trace,
    n_head: usize,
    mut value_of: impl FnMut(&str) -> Result<HostTensor>,
) -> Result<Vec<(String, HostTensor)>> {
    let mut out = Vec::new();
    let mut last: Option<(String, HostTensor)> = None;
    for m in map_params(family, trace, n_head)? {
        if m.expert.is_some() {
            let name = &m.params[0].0;
            if last.as_ref().is_none_or(|(n, _)| n != name) {
                last = Some((name.clone(), value_of(name)?));
            }
            let (_, stack) = last.as_ref().expect("read above");
            if stack.ty.shape != m.params[0].1.shape {
                return Err(Error::Input {
                    name: name.clone(),
                    reason: format!("got {}, expected {} stacking `{}`", stack.ty, m.params[0].1, m.hf),
                });
            }
            let mut tensor = HostTensor::zeros(m.ty.with_dtype(stack.ty.dtype));
            tensor.bytes_mut().copy_from_slice(m.slice_of(stack.bytes()));
            out.push((m.hf, tensor));
            continue;
        }
        let parts: Vec<HostTensor> = m.params.iter().map(|(name, _)| value_of(name)).collect::<Result<_>>()?;
        let dtype = parts[0].ty.dtype;
        // Each part as its parameter is shaped, all in one dtype.
        if let Some(((name, ty), part)) =
            m.params.iter().zip(&parts).find(|((_, ty), p)| p.ty.shape != ty.shape || p.ty.dtype != dtype)
        {
            return Err(Error::Input {
                name: name.clone(),
                reason: format!("got {}, expected {} as a part of `{}`", part.ty, ty.with_dtype(dtype), m.hf),
            });
        }
        let mut tensor = HostTensor::zeros(m.ty.with_dtype(dtype));
        let mut offset = 0;
        for chunk in joined_chunks(&m, &parts) {
            tensor.bytes_mut()[offset..offset + chunk.len()].copy_from_slice(chunk);
            offset += chunk.len();
        }
        out.push((m.hf, tensor));
    }
    Ok(out)
}

/// Puts the complete folder `temp` at `out` (see [`save_hf_dir`]) and
/// removes the previous save, if any.
fn swap_into_place(temp: &Path, out: &Path, parent: &Path, file_name: &str, n: u64) -> Result<()> {
    if !out.exists() {
        fs::rename(temp, out).map_err(|e| io_error(out, e))?;
        return sync_dir(parent);
    }
    if exchange(temp, out).is_ok() {
        // `temp` now names the previous save.
        sync_dir(parent)?;
        let _ = fs::remove_dir_all(temp);
        return Ok(());
    }
    let old = parent.join(format!(".{file_name}.old-{}-{n}", std::process::id()));
    fs::rename(out, &old).map_err(|e| io_error(out, e))?;
    if let Err(e) = fs::rename(temp, out) {
        // Put the previous save back; the new one stays at `temp` for the error.
        let _ = fs::rename(&old, out);
        return Err(io_error(out, e));
    }
    sync_dir(parent)?;
    let _ = fs::remove_dir_all(&old);
    Ok(())
}

/// Atomically exchanges the directory entries `a` and `b`.
#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let a = CString::new(a.as_os_str().as_bytes()).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let b = CString::new(b.as_os_str().as_bytes()).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // SAFETY: both paths are NUL-terminated strings that outlive the call;
    // renameat2 reads them and touches no other memory.
    let rc = unsafe { libc::renameat2(libc::AT_FDCWD, a.as_ptr(), libc::AT_FDCWD, b.as_ptr(), libc::RENAME_EXCHANGE) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
fn exchange(_a: &Path, _b: &Path) -> io::Result<()> {
    Err(io::Error::new(io::ErrorKind::Unsupported, "no atomic directory exchange on this OS"))
}

/// `config.json` for `config` as `family`, over `source`'s other keys.
///
/// The keys are those `transformers` reads for the family. RoPE is written
/// both the `transformers` 4 way (`rope_theta`, `rope_scaling`, and for
/// GPT-NeoX `rotary_emb_base`/`rotary_pct`) and the `transformers` 5 way
/// (`rope_parameters`), so either version loads the same network.
pub fn hf_config_json(config: &Config, family: HfFamily, dtype: DType, source: Option<&Map<String, Value>>) -> Value {
    let mut keys = ConfigKeys { top: source.cloned().unwrap_or_default(), rope: Map::new() };
    // Keys another version or family may have written, rewritten below.
    for key in
        ["rope_scaling", "rope_parameters", "rope_theta", "rotary_emb_base", "rotary_pct", "partial_rotary_factor"]
    {
        keys.top.remove(key);
    }
    keys.set("architectures", json!([family.architecture()]));
    keys.set("model_type", json!(family.model_type()));
    keys.set("vocab_size", json!(config.padded_vocab_size));
    keys.set("hidden_size", json!(config.n_embd));
    keys.set("intermediate_size", json!(config.intermediate_size));
    keys.set("num_hidden_layers", json!(config.n_layer));
    keys.set("num_attention_heads", json!(config.n_head));
    keys.set("max_position_embeddings", json!(config.block_size));
    keys.set("tie_word_embeddings", json!(config.tie_embeddings));
    keys.set("torch_dtype", json!(torch_dtype(dtype)));
    keys.set("dtype", json!(torch_dtype(dtype)));
    let scaling = config.rope_scaling.as_ref().map(|s| match s {
        RopeScaling::Llama3(s) => json!({
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }),
        RopeScaling::LongRope(s) => {
            // The original context at the top level too: Phi-3's config
            // class prefers its own (4096 by default) to the object's.
            keys.set("original_max_position_embeddings", json!(s.original_max_position_embeddings));
            let mut rope = json!({
                "rope_type": "longrope",
                "short_factor": s.short_factor,
                "long_factor": s.long_factor,
                "attention_factor": s.attention_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            });
            // The extension factor only informs the attention factor, given
            // here; `transformers` warns about one below 1.
            let factor = config.block_size as f64 / s.original_max_position_embeddings as f64;
            if factor >= 1.0 {
                rope["factor"] = json!(factor);
            }
            rope
        }
    });
    keys.rope = match &scaling {
        Some(Value::Object(map)) => map.clone(),
        _ => Map::from_iter([("rope_type".to_string(), json!("default"))]),
    };
    keys.set_rope("rope_theta", json!(config.rope_base));
    keys.set("rope_theta", json!(config.rope_base));
    keys.set("rope_scaling", scaling.unwrap_or(Value::Null));
    family.family().write_config(config, &mut keys);
    let ConfigKeys { mut top, rope } = keys;
    top.insert("rope_parameters".to_string(), Value::Object(rope));
    Value::Object(top)
}

//! TensorBoard event files: the metrics rows as scalars that `tensorboard
//! --logdir DIR` plots, written next to the JSONL metrics file.
//!
//! The event file is named after the metrics file (`metrics.jsonl` gets
//! `metrics.jsonl.tfevents`; TensorBoard reads every file whose name holds
//! `tfevents`), so two runs writing metrics into one folder keep apart.
//! On resume it is rewritten from the metrics rows the resume keeps, into
//! a temporary file renamed over the old one, so the plots never show the
//! steps a killed run did after its last checkpoint, and a kill at any
//! moment leaves a complete file.

use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::Value;
use syntaxdot_summary::SummaryWriter;

/// The scalars of a metrics row, as TensorBoard tags: training numbers
/// under `train/`, validation under `val/`, memory under `memory/`.
pub fn scalars(row: &Value) -> Vec<(String, f32)> {
    let Some(fields) = row.as_object() else { return Vec::new() };
    let mut out = Vec::new();
    for (key, value) in fields {
        let Some(x) = value.as_f64() else { continue };
        let tag = match key.as_str() {
            "step" => continue,
            k if k.starts_with("val_") => format!("val/{}", &k[4..]),
            k if k.ends_with("_bytes") => format!("memory/{}", k.trim_end_matches("_bytes")),
            k => format!("train/{k}"),
        };
        out.push((tag, x as f32));
    }
    out
}

/// The event file of a metrics file.
pub fn events_path(metrics: &Path) -> PathBuf {
    let mut name = metrics.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".tfevents");
    metrics.with_file_name(name)
}

/// An append-only TensorBoard event file.
pub struct EventFile {
    path: PathBuf,
    writer: SummaryWriter<File>,
}

impl EventFile {
    /// Creates the event file of `metrics`, holding `rows` (the rows the
    /// metrics file starts with: none for a new run, those up to the
    /// checkpoint for a resumed one), and opens it for appending.
    pub fn create(metrics: &Path, rows: &[Value]) -> Result<Self> {
        let path = events_path(metrics);
        let context = || format!("writing the TensorBoard event file {}", path.display());
        // Written under a temporary name and renamed once complete; the
        // writer keeps the same open file for the rows that follow.
        let mut temp_name = path.file_name().unwrap_or_default().to_os_string();
        temp_name.push(format!(".tmp-{}", std::process::id()));
        let temp = path.with_file_name(temp_name);
        let file = File::create(&temp).with_context(context)?;
        let synced = file.try_clone().with_context(context)?;
        let mut writer = SummaryWriter::new(file).with_context(context)?;
        for row in rows {
            write_row(&mut writer, row).with_context(context)?;
        }
        synced.sync_all().with_context(context)?;
        std::fs::rename(&temp, &path).with_context(context)?;
        Ok(EventFile { path, writer })
    }

    /// Appends the scalars of one metrics row.
    pub fn write(&mut self, row: &Value) -> Result<()> {
        write_row(&mut self.writer, row)
            .with_context(|| format!("writing the TensorBoard event file {}", self.path.display()))
    }
}

fn write_row<W: std::io::Write>(writer: &mut SummaryWriter<W>, row: &Value) -> std::io::Result<()> {
    let Some(step) = row.get("step").and_then(Value::as_i64) else { return Ok(()) };
    for (tag, x) in scalars(row) {
        writer.write_scalar(tag, step, x)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// CRC-32C (Castagnoli), as TFRecord frames use it, masked.
    fn masked_crc32c(data: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &b in data {
            crc ^= b as u32;
            for _ in 0..8 {
                crc = if crc & 1 == 1 { (crc >> 1) ^ 0x82f6_3b78 } else { crc >> 1 };
            }
        }
        let crc = !crc;
        (crc.rotate_right(15)).wrapping_add(0xa282_ead8)
    }

    fn varint(b: &[u8], at: &mut usize) -> u64 {
        let (mut x, mut shift) = (0u64, 0);
        loop {
            let byte = b[*at];
            *at += 1;
            x |= ((byte & 0x7f) as u64) << shift;
            if byte & 0x80 == 0 {
                return x;
            }
            shift += 7;
        }
    }

    /// Fields of one protobuf message: (field number, wire type, bytes or value).
    fn fields(b: &[u8]) -> Vec<(u64, Vec<u8>)> {
        let (mut out, mut at) = (Vec::new(), 0);
        while at < b.len() {
            let key = varint(b, &mut at);
            let value = match key & 7 {
                0 => varint(b, &mut at).to_le_bytes().to_vec(),
                1 => {
                    at += 8;
                    b[at - 8..at].to_vec()
                }
                2 => {
                    let n = varint(b, &mut at) as usize;
                    at += n;
                    b[at - n..at].to_vec()
                }
                5 => {
                    at += 4;
                    b[at - 4..at].to_vec()
                }
                w => panic!("wire type {w}"),
            };
            out.push((key >> 3, value));
        }
        out
    }

    /// Every (step, tag, value) of an event file, its frames' checksums checked.
    fn read_scalars(path: &Path) -> (usize, Vec<(i64, String, f32)>) {
        let bytes = std::fs::read(path).unwrap();
        let (mut at, mut versions, mut scalars) = (0, 0, Vec::new());
        while at < bytes.len() {
            let len_bytes = &bytes[at..at + 8];
            let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
            assert_eq!(u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap()), masked_crc32c(len_bytes));
            let data = &bytes[at + 12..at + 12 + len];
            assert_eq!(
                u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap()),
                masked_crc32c(data)
            );
            at += 16 + len;
            let event = fields(data);
            let step = event.iter().find(|f| f.0 == 2).map_or(0, |f| i64::from_le_bytes(f.1[..8].try_into().unwrap()));
            for (field, value) in &event {
                match field {
                    3 => {
                        assert_eq!(value, b"brain.Event:2");
                        versions += 1;
                    }
                    5 => {
                        for (_, v) in fields(value).iter().filter(|f| f.0 == 1) {
                            let v = fields(v);
                            let tag = String::from_utf8(v.iter().find(|f| f.0 == 1).unwrap().1.clone()).unwrap();
                            let x = f32::from_le_bytes(v.iter().find(|f| f.0 == 2).unwrap().1[..4].try_into().unwrap());
                            scalars.push((step, tag, x));
                        }
                    }
                    _ => {}
                }
            }
        }
        (versions, scalars)
    }

    #[test]
    fn rows_become_tagged_scalars_that_read_back() {
        let d = tempfile::tempdir().unwrap();
        let metrics = d.path().join("metrics.jsonl");
        let mut events = EventFile::create(&metrics, &[]).unwrap();
        events.write(&json!({"step": 1, "loss": 5.5, "lr": 0.001, "planned_bytes": 1_000_000})).unwrap();
        events.write(&json!({"step": 2, "val_loss": 4.25, "val_ppl": 70.1})).unwrap();
        let (versions, scalars) = read_scalars(&events_path(&metrics));
        assert_eq!(versions, 1);
        assert_eq!(
            scalars,
            [
                (1, "train/loss".to_string(), 5.5),
                (1, "train/lr".to_string(), 0.001),
                (1, "memory/planned".to_string(), 1e6),
                (2, "val/loss".to_string(), 4.25),
                (2, "val/ppl".to_string(), 70.1),
            ]
        );
    }

    /// A resumed run rewrites the file from the rows it keeps: the steps a
    /// killed run did after its checkpoint are gone, and no temporary file
    /// is left.
    #[test]
    fn a_resume_rewrites_the_file_from_the_kept_rows() {
        let d = tempfile::tempdir().unwrap();
        let metrics = d.path().join("metrics.jsonl");
        let mut events = EventFile::create(&metrics, &[]).unwrap();
        for step in 1..=5 {
            events.write(&json!({"step": step, "loss": step as f64})).unwrap();
        }
        drop(events);
        let kept: Vec<Value> = (1..=3).map(|step| json!({"step": step, "loss": step as f64})).collect();
        let mut events = EventFile::create(&metrics, &kept).unwrap();
        events.write(&json!({"step": 4, "loss": 40.0})).unwrap();
        let (versions, scalars) = read_scalars(&events_path(&metrics));
        assert_eq!(versions, 1);
        let steps: Vec<(i64, f32)> = scalars.iter().map(|s| (s.0, s.2)).collect();
        assert_eq!(steps, [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]);
        let names: Vec<String> =
            std::fs::read_dir(d.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into()).collect();
        assert_eq!(names, ["metrics.jsonl.tfevents"]);
    }
}

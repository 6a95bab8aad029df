//! The token file and the batch loader on synthetic documents: the format's
//! validation (every corruption is an error naming the file and position),
//! EOS packing and targets, masks, per-epoch shuffles, exact resume, and the
//! validation split.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use stepgraph_data::token_file::{write_token_file, TokenFileMeta, MAGIC};
use stepgraph_data::{Batch, Batcher, BatcherOptions, DataCursor, Document, Packing, Split, TokenFile, IGNORE_INDEX};

const IGNORE: i32 = IGNORE_INDEX as i32;
const EOS: u32 = 0;

/// Document `d` of `len` tokens: ids `100·(d+1) + i`, then EOS.
fn doc(d: u32, len: u32) -> Document {
    let mut tokens: Vec<u32> = (0..len).map(|i| 100 * (d + 1) + i).collect();
    tokens.push(EOS);
    Document { tokens, loss_mask: None }
}

fn write(dir: &Path, name: &str, vocab: u32, train: &[Document], val: &[Document]) -> PathBuf {
    let path = dir.join(name);
    write_token_file(&path, TokenFileMeta { vocab_size: vocab, eos_id: EOS, tokenizer: None }, train, val).unwrap();
    path
}

fn stream(docs: &[Document]) -> Vec<u32> {
    docs.iter().flat_map(|d| d.tokens.iter().copied()).collect()
}

/// Options of the stream packing, whose batches the older tests describe.
fn opts(batch: usize, seq: usize, seed: u64, split: Split) -> BatcherOptions {
    BatcherOptions { batch, seq, seed, split, packing: Packing::Stream }
}

fn open_err(path: &Path) -> String {
    TokenFile::open(path).expect_err("the file must be refused").to_string()
}

#[test]
fn round_trip_u16_and_u32_with_mask() {
    let dir = tempfile::tempdir().unwrap();
    let mut chat = doc(1, 6);
    chat.loss_mask = Some(vec![false, false, false, true, true, true, true]);
    let train = vec![doc(0, 5), chat.clone()];
    let val = vec![doc(2, 3)];
    for (vocab, bytes) in [(1000, 2), (70_000, 4)] {
        let path = write(dir.path(), &format!("v{vocab}.tokens"), vocab, &train, &val);
        let f = TokenFile::open(&path).unwrap();
        assert_eq!((f.vocab_size(), f.token_bytes(), f.eos_id()), (vocab, bytes, EOS));
        assert_eq!((f.n_docs(), f.n_tokens()), (3, 6 + 7 + 4));
        assert!(f.has_mask());
        assert_eq!(f.split_docs(Split::Train), 0..2);
        assert_eq!(f.split_docs(Split::Validation), 2..3);
        assert_eq!(f.split_tokens(Split::Validation), 13..17);
        let all: Vec<u32> = (0..f.n_tokens()).map(|i| f.token(i)).collect();
        assert_eq!(all, stream(&[train.clone(), val.clone()].concat()));
        let mask: Vec<bool> = (0..f.n_tokens()).map(|i| f.is_target(i)).collect();
        let mut want = vec![true; 6];
        want.extend(chat.loss_mask.as_ref().unwrap());
        want.extend([true; 4]);
        assert_eq!(mask, want);
        assert_eq!(f.doc_tokens(1), 6..13);
        assert_eq!(f.doc_of(12), 1);
        assert_eq!(f.doc_of(13), 2);
    }
    // A mask of all true is not stored.
    let mut all_true = doc(0, 3);
    all_true.loss_mask = Some(vec![true; 4]);
    let path = write(dir.path(), "nomask.tokens", 1000, &[all_true], &[]);
    assert!(!TokenFile::open(&path).unwrap().has_mask());
}

#[test]
fn writing_refuses_ids_outside_the_vocabulary() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.tokens");
    let err = write_token_file(
        &path,
        TokenFileMeta { vocab_size: 300, eos_id: EOS, tokenizer: None },
        &[doc(0, 3), doc(2, 3)],
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("document 1") && err.contains("token id 300") && err.contains("vocabulary size 300"), "{err}");
    assert!(!path.exists(), "nothing is written on error");
}

/// Every kind of damage is refused with the file named and the position given.
#[test]
fn corrupt_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let good = write(dir.path(), "good.tokens", 1000, &[doc(0, 5), doc(1, 5)], &[doc(2, 2)]);
    let bytes = std::fs::read(&good).unwrap();
    let name = good.display().to_string();
    let variant = |tag: &str, edit: &dyn Fn(&mut Vec<u8>)| {
        let mut b = bytes.clone();
        edit(&mut b);
        let p = dir.path().join(format!("{tag}.tokens"));
        std::fs::write(&p, b).unwrap();
        let err = open_err(&p);
        assert!(err.contains(&p.display().to_string()), "{tag}: the file is named: {err}");
        err
    };
    let err = variant("truncated", &|b| b.truncate(b.len() - 3));
    assert!(err.contains("truncated"), "{err}");
    let err = variant("header", &|b| b.truncate(20));
    assert!(err.contains("truncated") && err.contains("20 bytes"), "{err}");
    let err = variant("magic", &|b| b[..8].copy_from_slice(b"GGUF\0\0\0\0"));
    assert!(err.contains("not a stepgraph token file") && err.contains("stepgraph prepare"), "{err}");
    let err = variant("version", &|b| b[8] = 9);
    assert!(err.contains("version 9"), "{err}");
    let err = variant("trailing", &|b| b.extend([0u8; 8]));
    assert!(err.contains("8 bytes after the end"), "{err}");
    let err = variant("flags", &|b| b[12] = 6);
    assert!(err.contains("unknown flags"), "{err}");
    let err = variant("huge", &|b| b[32..40].copy_from_slice(&u64::MAX.to_le_bytes()));
    assert!(err.contains("overflow") || err.contains("truncated"), "{err}");
    // Token 4 (document 0) set to 1000, one past the vocabulary.
    let tokens_at = 64 + 8 * 4;
    let err = variant("id", &|b| b[tokens_at + 8..tokens_at + 10].copy_from_slice(&1000u16.to_le_bytes()));
    assert!(err.contains("token id 1000 at position 4 (document 0)") && err.contains("vocabulary size 1000"), "{err}");
    let err =
        variant("id_late", &|b| b[tokens_at + 2 * 13..tokens_at + 2 * 14].copy_from_slice(&u16::MAX.to_le_bytes()));
    assert!(err.contains("position 13 (document 2)"), "{err}");
    // Document 1's end offset moved before its start.
    let err = variant("offsets", &|b| b[64 + 16..64 + 24].copy_from_slice(&2u64.to_le_bytes()));
    assert!(err.contains("document 1 ends at token 2"), "{err}");
    assert!(!name.is_empty());
    let missing = open_err(&dir.path().join("missing.tokens"));
    assert!(missing.contains("missing.tokens") && missing.contains("opening"), "{missing}");
    assert_eq!(&bytes[..8], &MAGIC);
}

/// Rows in stream order (validation) are the packed stream: inputs cover it
/// in steps of `seq`, targets are the next token, the tail is padded.
#[test]
fn packing_covers_the_stream_with_eos_between_documents() {
    let dir = tempfile::tempdir().unwrap();
    let val = vec![doc(0, 4), doc(1, 6), doc(2, 3)];
    let path = write(dir.path(), "p.tokens", 1000, &[doc(8, 2)], &val);
    let f = TokenFile::open(&path).unwrap();
    let s = stream(&val); // 16 tokens
    let seq = 4;
    let mut b = Batcher::new(&f, opts(2, seq, 0, Split::Validation)).unwrap();
    assert_eq!(b.sequences(), 4, "(16 - 1) / 4 rounded up");
    assert_eq!(b.batches_per_pass(), 2);
    let rows: Vec<Batch> = (0..2).map(|_| b.next_batch().unwrap()).collect();
    let inputs: Vec<i32> = rows.iter().flat_map(|r| r.inputs.clone()).collect();
    let targets: Vec<i32> = rows.iter().flat_map(|r| r.targets.clone()).collect();
    let s: Vec<i32> = s.iter().map(|&t| t as i32).collect();
    assert_eq!(&inputs[..16], &s[..16]);
    assert_eq!(&targets[..15], &s[1..16]);
    assert_eq!(targets[15], IGNORE, "the last token has no successor");
    // Document 0's EOS is an input whose target is document 1's first token.
    assert_eq!(inputs[4], EOS as i32);
    assert_eq!(targets[4], 200);
    assert_eq!(rows[0].loss_tokens + rows[1].loss_tokens, 15);
    assert_eq!(rows[1].epoch, 0);
    assert_eq!(b.next_batch().unwrap(), Batch { index: 2, epoch: 1, ..rows[0].clone() }, "passes repeat");
}

#[test]
fn validation_pads_the_last_batch_with_ignored_rows() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "v.tokens", 1000, &[doc(0, 9)], &[doc(1, 8)]);
    let f = TokenFile::open(&path).unwrap();
    let mut b = Batcher::new(&f, opts(2, 3, 0, Split::Validation)).unwrap();
    assert_eq!(b.sequences(), 3);
    b.next_batch().unwrap();
    let last = b.next_batch().unwrap();
    assert!(last.targets[3..].iter().all(|&t| t == IGNORE), "{:?}", last.targets);
    assert!(last.inputs[3..].iter().all(|&t| t == EOS as i32));
    assert_eq!(last.loss_tokens, 2, "tokens 7 and 8 of 9 are the last targets");
}

#[test]
fn masked_tokens_are_ignored_targets() {
    let dir = tempfile::tempdir().unwrap();
    let mut chat = doc(0, 5);
    chat.loss_mask = Some(vec![false, false, true, true, false, true]);
    let path = write(dir.path(), "m.tokens", 1000, &[chat], &[]);
    let f = TokenFile::open(&path).unwrap();
    let batch = Batcher::new(&f, opts(1, 5, 0, Split::Train)).unwrap().next_batch().unwrap();
    assert_eq!(batch.inputs, vec![100, 101, 102, 103, 104]);
    assert_eq!(batch.targets, vec![IGNORE, 102, 103, IGNORE, EOS as i32]);
    assert_eq!(batch.loss_tokens, 3);
    let [inputs, targets] = batch.host_tensors();
    assert_eq!(inputs.ty.to_string(), "i32[1,5]");
    assert_eq!(targets.to_f64(), vec![-100.0, 102.0, 103.0, -100.0, 0.0]);
}

/// The sequences a training batcher draws in each epoch, by first input.
fn epochs(f: &TokenFile, seed: u64, n: usize) -> Vec<Vec<i32>> {
    let mut b = Batcher::new(f, opts(1, 4, seed, Split::Train)).unwrap();
    let per = b.sequences() as usize;
    (0..n).map(|_| (0..per).map(|_| b.next_batch().unwrap().inputs[0]).collect()).collect()
}

#[test]
fn shuffles_are_permutations_per_epoch_seeded_and_fresh() {
    let dir = tempfile::tempdir().unwrap();
    let docs: Vec<Document> = (0..8).map(|d| doc(d, 7)).collect();
    let path = write(dir.path(), "s.tokens", 1000, &docs, &[]);
    let f = TokenFile::open(&path).unwrap();
    let s = stream(&docs);
    let firsts: BTreeSet<i32> = s.chunks(4).take((s.len() - 1).div_ceil(4)).map(|c| c[0] as i32).collect();
    let e = epochs(&f, 7, 3);
    for (i, epoch) in e.iter().enumerate() {
        assert_eq!(epoch.iter().copied().collect::<BTreeSet<_>>(), firsts, "epoch {i} draws every sequence once");
        assert_eq!(epoch.len(), firsts.len());
    }
    assert_ne!(e[0], e[1], "a fresh order each epoch");
    assert_ne!(e[1], e[2]);
    assert_eq!(e, epochs(&f, 7, 3), "deterministic for a seed");
    assert_ne!(e[0], epochs(&f, 8, 1)[0], "another seed, another order");
    let sorted: Vec<i32> = firsts.iter().copied().collect();
    assert_ne!(e[0], sorted, "shuffled, not stream order");
    // Rows continue across the epoch boundary and report their epoch.
    let mut b = Batcher::new(&f, opts(5, 4, 7, Split::Train)).unwrap();
    let per = b.sequences();
    let epochs_seen: Vec<u64> = (0..2 * per / 5 + 1).map(|_| b.next_batch().unwrap().epoch).collect();
    assert_eq!(epochs_seen[0], 0);
    assert_eq!(*epochs_seen.last().unwrap(), (epochs_seen.len() as u64 - 1) * 5 / per);
}

#[test]
fn resume_from_a_saved_cursor_gives_the_same_batches() {
    let dir = tempfile::tempdir().unwrap();
    let docs: Vec<Document> = (0..6).map(|d| doc(d, 5 + d)).collect();
    let path = write(dir.path(), "r.tokens", 1000, &docs, &[doc(7, 9)]);
    let f = TokenFile::open(&path).unwrap();
    for split in [Split::Train, Split::Validation] {
        let o = opts(3, 4, 11, split);
        let mut whole = Batcher::new(&f, o).unwrap();
        let all: Vec<Batch> = (0..20).map(|_| whole.next_batch().unwrap()).collect();
        let mut first = Batcher::new(&f, o).unwrap();
        for _ in 0..7 {
            first.next_batch().unwrap();
        }
        let saved = serde_json::to_string(&first.cursor()).unwrap();
        drop(first);
        let cursor: DataCursor = serde_json::from_str(&saved).unwrap();
        assert_eq!(cursor.batches, 7);
        // The file is reopened, as after a restart.
        let f2 = TokenFile::open(&path).unwrap();
        let mut resumed = Batcher::resume(&f2, o, &cursor).unwrap();
        let rest: Vec<Batch> = (7..20).map(|_| resumed.next_batch().unwrap()).collect();
        assert_eq!(rest, all[7..], "{split:?}");
        assert_eq!(resumed.cursor(), whole.cursor());
    }
}

#[test]
fn a_cursor_from_another_stream_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "a.tokens", 1000, &[doc(0, 30), doc(1, 3)], &[doc(2, 5)]);
    let other = write(dir.path(), "b.tokens", 1000, &[doc(0, 30), doc(3, 3)], &[doc(2, 5)]);
    let f = TokenFile::open(&path).unwrap();
    let o = opts(2, 4, 1, Split::Train);
    let mut b = Batcher::new(&f, o).unwrap();
    b.next_batch().unwrap();
    let cursor = b.cursor();
    let err = |file: &TokenFile, o: BatcherOptions| Batcher::resume(file, o, &cursor).err().unwrap().to_string();
    assert!(err(&f, opts(2, 4, 2, Split::Train)).contains("seed 1, but this run has 2"));
    assert!(err(&f, opts(2, 8, 1, Split::Train)).contains("batch x seq 2 x 4"));
    assert!(err(&f, opts(2, 4, 1, Split::Validation)).contains("split Train, but this run has Validation"));
    let g = TokenFile::open(&other).unwrap();
    let e = err(&g, o);
    assert!(e.contains("b.tokens") && e.contains("fingerprint"), "{e}");
}

#[test]
fn validation_and_training_draw_from_disjoint_documents() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "d.tokens", 1000, &[doc(0, 6), doc(1, 6)], &[doc(2, 6), doc(3, 3)]);
    let f = TokenFile::open(&path).unwrap();
    let ids = |split: Split| {
        let mut b = Batcher::new(&f, opts(2, 3, 5, split)).unwrap();
        let n = 2 * b.batches_per_pass();
        (0..n).flat_map(|_| b.next_batch().unwrap().inputs).filter(|&t| t != EOS as i32).collect::<BTreeSet<i32>>()
    };
    let (train, val) = (ids(Split::Train), ids(Split::Validation));
    assert!(train.is_disjoint(&val), "{train:?} {val:?}");
    assert!(train.iter().all(|&t| t < 300) && val.iter().all(|&t| t >= 300));
}

#[test]
fn bad_options_and_empty_splits_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "e.tokens", 1000, &[doc(0, 6)], &[]);
    let f = TokenFile::open(&path).unwrap();
    let e = Batcher::new(&f, opts(0, 4, 0, Split::Train)).err().unwrap().to_string();
    assert!(e.contains("batch 0"), "{e}");
    let e = Batcher::new(&f, opts(1, 4, 0, Split::Validation)).err().unwrap().to_string();
    assert!(e.contains("e.tokens") && e.contains("validation split has 0 tokens") && e.contains("--val-docs"), "{e}");
    let e = f.check_vocab(512).unwrap_err().to_string();
    assert!(e.contains("1000 tokens") && e.contains("512") && e.contains("--vocab 1000"), "{e}");
    f.check_vocab(1000).unwrap();
}

/// The header's tokenizer fingerprint round-trips; a file without one (as
/// every file was before it was recorded: 0 in a reserved field) opens
/// with none.
#[test]
fn the_tokenizer_fingerprint_round_trips_and_old_files_have_none() {
    let dir = tempfile::tempdir().unwrap();
    let old = write(dir.path(), "old.tokens", 500, &[doc(0, 4), doc(1, 4)], &[]);
    assert_eq!(TokenFile::open(&old).unwrap().meta().tokenizer, None);
    assert_eq!(std::fs::read(&old).unwrap()[56..64], [0u8; 8], "the field of older files is 0");
    let path = dir.path().join("new.tokens");
    let fp = stepgraph_data::TokenizerFingerprint(0x0123_4567_89ab_cdef);
    let meta = TokenFileMeta { vocab_size: 500, eos_id: EOS, tokenizer: Some(fp) };
    write_token_file(&path, meta, &[doc(0, 4), doc(1, 4)], &[]).unwrap();
    let file = TokenFile::open(&path).unwrap();
    assert_eq!(file.meta(), meta);
}

/// One row of a batch: its inputs, targets and positions (if any).
type Row = (Vec<i32>, Vec<i32>, Option<Vec<i32>>);

/// A batch's rows, in order.
fn rows_of(b: &Batch) -> Vec<Row> {
    (0..b.batch)
        .map(|r| {
            let span = r * b.seq..(r + 1) * b.seq;
            (
                b.inputs[span.clone()].to_vec(),
                b.targets[span.clone()].to_vec(),
                b.positions.as_ref().map(|p| p[span].to_vec()),
            )
        })
        .collect()
}

#[test]
fn document_packing_restarts_positions_and_predicts_nothing_across_a_boundary() {
    let dir = tempfile::tempdir().unwrap();
    // Documents of 3, 1 and 5 tokens plus EOS: 4 + 2 + 6 = 12 tokens.
    let val = vec![doc(0, 3), doc(1, 1), doc(2, 5)];
    let path = write(dir.path(), "docs.tokens", 2000, &[doc(9, 9)], &val);
    let f = TokenFile::open(&path).unwrap();
    let o = BatcherOptions { packing: Packing::Documents, ..opts(1, 5, 0, Split::Validation) };
    let mut b = Batcher::new(&f, o).unwrap();
    let rows: Vec<_> = (0..b.batches_per_pass()).flat_map(|_| rows_of(&b.next_batch().unwrap())).collect();
    let e = EOS as i32;
    // Row 0: 100 101 102 EOS | 200; row 1: EOS | 300 301 302 303; row 2:
    // 304 EOS, padding. Positions count from each document's first token
    // in the row (and from the row's first token); an EOS predicts nothing.
    assert_eq!(rows[0], (vec![100, 101, 102, e, 200], vec![101, 102, e, IGNORE, e], Some(vec![0, 1, 2, 3, 0])));
    assert_eq!(rows[1], (vec![e, 300, 301, 302, 303], vec![IGNORE, 301, 302, 303, 304], Some(vec![0, 0, 1, 2, 3])));
    assert_eq!(rows[2], (vec![304, e, e, e, e], vec![e, IGNORE, IGNORE, IGNORE, IGNORE], Some(vec![0, 1, 0, 0, 0])));
    assert_eq!(rows.len(), 3);
    // The positions tensor has the batch's shape.
    let t = b.next_batch().unwrap().positions_tensor().unwrap();
    assert_eq!(t.ty.shape, vec![1, 5]);
}

#[test]
fn no_packing_gives_each_document_rows_of_its_own() {
    let dir = tempfile::tempdir().unwrap();
    // 3 + 1 tokens: one row; 1 + 1: one row; 5 + 1 at seq 4: two rows
    // (5 targets), the second sharing the first's last token.
    let val = vec![doc(0, 3), doc(1, 1), doc(2, 5)];
    let path = write(dir.path(), "pad.tokens", 2000, &[doc(9, 9)], &val);
    let f = TokenFile::open(&path).unwrap();
    let o = BatcherOptions { packing: Packing::None, ..opts(2, 4, 0, Split::Validation) };
    let mut b = Batcher::new(&f, o).unwrap();
    assert_eq!(b.sequences(), 4);
    let rows: Vec<_> = (0..b.batches_per_pass()).flat_map(|_| rows_of(&b.next_batch().unwrap())).collect();
    let e = EOS as i32;
    assert_eq!(rows[0], (vec![100, 101, 102, e], vec![101, 102, e, IGNORE], None));
    assert_eq!(rows[1], (vec![200, e, e, e], vec![e, IGNORE, IGNORE, IGNORE], None));
    assert_eq!(rows[2], (vec![300, 301, 302, 303], vec![301, 302, 303, 304], None));
    assert_eq!(rows[3], (vec![304, e, e, e], vec![e, IGNORE, IGNORE, IGNORE], None));
    // Training rows are the same sequences, shuffled.
    let o = BatcherOptions { split: Split::Train, ..o };
    let mut t = Batcher::new(&f, o).unwrap();
    assert_eq!(t.sequences(), 3);
    let batch = t.next_batch().unwrap();
    assert!(batch.inputs.iter().all(|&x| x == e || (1000..1009).contains(&x)));
}

#[test]
fn a_cursor_resumes_only_with_its_packing_and_old_cursors_read_as_the_stream() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "p.tokens", 1000, &[doc(0, 30), doc(1, 20)], &[]);
    let f = TokenFile::open(&path).unwrap();
    let o = BatcherOptions { packing: Packing::Documents, ..opts(2, 8, 3, Split::Train) };
    let mut b = Batcher::new(&f, o).unwrap();
    b.next_batch().unwrap();
    let cursor = b.cursor();
    let stream = BatcherOptions { packing: Packing::Stream, ..o };
    let err = Batcher::resume(&f, stream, &cursor).err().expect("another packing is refused").to_string();
    assert!(err.contains("--packing") && err.contains("documents") && err.contains("stream"), "{err}");
    // A cursor saved before packing was a choice has no `packing` field.
    let mut json = serde_json::to_value(&cursor).unwrap();
    json.as_object_mut().unwrap().remove("packing");
    let old: DataCursor = serde_json::from_value(json).unwrap();
    assert_eq!(old.packing, Packing::Stream);
    assert!(Batcher::resume(&f, stream, &old).is_ok());
}

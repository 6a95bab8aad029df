//! `StreamDecoder` against decoding the whole token list, with a byte-level
//! BPE tokenizer trained on `data/tiny.txt`: the streamed text is always a
//! prefix of the whole decode and ends equal to it, for real text with
//! multi-byte characters and for arbitrary ids (whose bytes need not be
//! UTF-8 at all).

use std::path::Path;

use stepgraph_data::fixtures::{self, TemplateStyle};
use stepgraph_data::tokenizer::StreamDecoder;
use stepgraph_data::Tokenizer;

const TINY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/tiny.txt");

fn tokenizer(dir: &Path) -> Tokenizer {
    let path = fixtures::train_tokenizer(Path::new(TINY), &dir.join("tok"), 400, TemplateStyle::ChatMl).unwrap();
    Tokenizer::load(&path).unwrap()
}

/// Streams `ids` and checks the decoder against whole decodes at every step.
fn check(tok: &Tokenizer, ids: &[u32]) {
    let mut dec = StreamDecoder::new();
    for n in 1..=ids.len() {
        let before = dec.push(tok, ids[n - 1]).unwrap();
        let whole = tok.decode(&ids[..n]).unwrap();
        assert!(
            whole.starts_with(dec.text()),
            "ids {:?}: streamed {:?} is not a prefix of {whole:?}",
            &ids[..n],
            dec.text()
        );
        assert!(before <= dec.text().len());
        // Final text holds no trailing incomplete character.
        assert!(!dec.text().ends_with('\u{FFFD}') || whole[dec.text().len()..].is_empty());
    }
    assert_eq!(dec.finish(tok).unwrap(), tok.decode(ids).unwrap(), "ids {ids:?}");
}

#[test]
fn streamed_text_is_the_whole_decode_for_text_and_for_arbitrary_ids() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer(dir.path());
    for text in ["The history of the city begins", "héllo wörld — 日本語 🙂 done", "a\n\n  b\tc 🙂🙂x"] {
        let ids = tok.encode(text, false).unwrap().ids;
        check(&tok, &ids);
        let mut dec = StreamDecoder::new();
        for &id in &ids {
            dec.push(&tok, id).unwrap();
        }
        assert_eq!(dec.finish(&tok).unwrap(), text);
    }
    // Arbitrary ids: bytes cut inside characters, invalid sequences, special tokens.
    let mut state = 0x2545f4914f6cdd1du64;
    let vocab = tok.vocab_size() as u64;
    for len in [1, 2, 7, 40, 200] {
        for _ in 0..20 {
            let ids: Vec<u32> = (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state % vocab) as u32
                })
                .collect();
            check(&tok, &ids);
        }
    }
}

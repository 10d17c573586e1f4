//! Token ids → text as they arrive, with stop strings.
//!
//! Tokens do not map to whole characters (byte-level BPE splits UTF-8 sequences), so each new
//! id goes through the tokenizer's decode stream, which hands out text only once its
//! characters are complete (and without decoding the whole completion again per token). Text
//! that could still become a stop string is held back until it cannot; when a stop string
//! appears, the text ends just before it.

use anneal_data::{DecodeStream, TextTokenizer};

/// What one new token adds.
#[derive(Debug, Default, PartialEq)]
pub struct Piece {
    /// Text that is now final (may be empty while a character or a possible stop string is
    /// incomplete).
    pub text: String,
    /// A stop string completed: the text ends here.
    pub stopped: bool,
}

/// The growing text of one completion.
pub struct TextStream<'a> {
    tokenizer: &'a TextTokenizer,
    stop: &'a [String],
    stream: DecodeStream<'a>,
    ids: Vec<u32>,
    /// Bytes of the decoded text already handed out.
    emitted: usize,
    /// The decoded text of `ids`.
    text: String,
}

impl<'a> TextStream<'a> {
    /// An empty completion that ends at any of `stop` (non-empty strings).
    pub fn new(tokenizer: &'a TextTokenizer, stop: &'a [String]) -> Self {
        TextStream {
            tokenizer,
            stop,
            stream: tokenizer.decode_stream(),
            ids: Vec::new(),
            emitted: 0,
            text: String::new(),
        }
    }

    /// The byte offset in the completion's text where the next token's text starts.
    pub fn offset(&self) -> usize {
        self.text.len()
    }

    /// Adds a token; returns the text that became final and whether a stop string ended it.
    pub fn push(&mut self, id: i64) -> Result<Piece, anneal_data::DataError> {
        let id = u32::try_from(id).unwrap_or(u32::MAX);
        self.ids.push(id);
        // Nothing while the id's bytes end inside a character the next token may complete.
        let Some(chunk) = self.stream.step(id)? else {
            return Ok(Piece::default());
        };
        self.text.push_str(&chunk);
        if let Some(at) = self.find_stop() {
            let piece = self.text[self.emitted..at].to_string();
            self.text.truncate(at);
            self.emitted = at;
            return Ok(Piece {
                text: piece,
                stopped: true,
            });
        }
        let end = self.text.len() - self.held_back();
        let piece = self
            .text
            .get(self.emitted..end)
            .unwrap_or_default()
            .to_string();
        self.emitted = self.emitted.max(end);
        Ok(Piece {
            text: piece,
            stopped: false,
        })
    }

    /// The rest of the text, held back or incomplete, once no more tokens come.
    pub fn finish(&mut self) -> Result<String, anneal_data::DataError> {
        let text = self.tokenizer.decode(&self.ids)?;
        if text.len() >= self.text.len() && text.starts_with(&self.text) {
            self.text = text;
        }
        let rest = self
            .text
            .get(self.emitted..)
            .unwrap_or_default()
            .to_string();
        self.emitted = self.text.len();
        Ok(rest)
    }

    /// The earliest stop string that starts in text not yet handed out.
    fn find_stop(&self) -> Option<usize> {
        self.stop
            .iter()
            .filter_map(|s| {
                // Matches may start before `emitted` only if they were held back, which
                // `held_back` prevents; searching from `emitted` is enough.
                self.text
                    .get(self.emitted..)?
                    .find(s.as_str())
                    .map(|i| self.emitted + i)
            })
            .min()
    }

    /// Bytes at the end of the text that begin some stop string (and so may still grow into
    /// it); they stay unsent.
    fn held_back(&self) -> usize {
        let tail = self.text.get(self.emitted..).unwrap_or_default();
        self.stop
            .iter()
            .filter_map(|s| {
                (1..s.len().min(tail.len() + 1))
                    .rev()
                    .filter(|&n| tail.is_char_boundary(tail.len() - n))
                    .find(|&n| s.starts_with(&tail[tail.len() - n..]))
            })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> TextTokenizer {
        let docs = vec!["héllo wörld, the end. hello world".repeat(4)];
        TextTokenizer::train_bpe_on_texts(&docs, 300).unwrap()
    }

    /// Feeds `text` byte by byte-level token and collects the pieces.
    fn run(tok: &TextTokenizer, text: &str, stop: &[String]) -> (Vec<String>, bool, String) {
        let mut s = TextStream::new(tok, stop);
        let mut pieces = vec![];
        for id in tok.encode(text).unwrap() {
            let p = s.push(id as i64).unwrap();
            pieces.push(p.text);
            if p.stopped {
                return (pieces, true, String::new());
            }
        }
        let rest = s.finish().unwrap();
        (pieces, false, rest)
    }

    #[test]
    fn pieces_join_to_the_text_and_stop_strings_cut_it() {
        let tok = tokenizer();
        let text = "héllo wörld, the end. hello world";
        let (pieces, stopped, rest) = run(&tok, text, &[]);
        assert!(!stopped);
        assert_eq!(pieces.concat() + &rest, text);
        // Never a broken character in a piece.
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')));
        let stop = vec!["the end".to_string(), "zzz".to_string()];
        let (pieces, stopped, _) = run(&tok, text, &stop);
        assert!(stopped);
        assert_eq!(pieces.concat(), "héllo wörld, ");
        // A prefix of a stop string that never completes is released at the end.
        let stop = vec!["world!".to_string()];
        let (pieces, stopped, rest) = run(&tok, text, &stop);
        assert!(!stopped);
        assert_eq!(pieces.concat() + &rest, text);
        assert!(!pieces.concat().ends_with("world"), "{pieces:?}");
    }
}

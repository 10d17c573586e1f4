//! The complete lines of a byte range of a file, read forward in fixed-size blocks, so memory
//! stays one block plus one line however large the file is.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};

/// Bytes read from the file at a time.
pub const BLOCK: usize = 64 * 1024;

/// A line longer than this is skipped (never held whole): `anneal rl` writes one sample per
/// line, so such a line is not one a page could show anyway.
pub const MAX_LINE: usize = 8 << 20;

/// One line of the range: where it starts and ends (after its newline) in the file, and its
/// bytes without the newline, or `None` when it is longer than the reader's limit.
#[derive(Debug, PartialEq)]
pub struct Line<'a> {
    /// Offset of its first byte.
    pub start: u64,
    /// Offset just past its newline.
    pub end: u64,
    /// Its bytes (no newline); `None` for a line over the limit.
    pub text: Option<&'a [u8]>,
}

/// Reads the lines of `[start, end)` of a file. Only lines whose newline lies inside the range
/// come out: a last line without one (a run still writing it) is left for a later read.
pub struct Lines {
    reader: BufReader<std::io::Take<File>>,
    pos: u64,
    max_line: usize,
    line: Vec<u8>,
}

impl Lines {
    /// The lines of `[start, end)` of `file` (a clone of the handle: the caller's position is
    /// left alone), each at most `max_line` bytes.
    pub fn new(file: &File, start: u64, end: u64, max_line: usize) -> std::io::Result<Lines> {
        let mut file = file.try_clone()?;
        file.seek(SeekFrom::Start(start))?;
        Ok(Lines {
            reader: BufReader::with_capacity(BLOCK, file.take(end.saturating_sub(start))),
            pos: start,
            max_line,
            line: Vec::new(),
        })
    }

    /// The next complete line, or `None` at the end of the range.
    pub fn next_line(&mut self) -> std::io::Result<Option<Line<'_>>> {
        self.line.clear();
        let start = self.pos;
        let mut too_long = false;
        loop {
            let block = self.reader.fill_buf()?;
            if block.is_empty() {
                return Ok(None);
            }
            let newline = block.iter().position(|&b| b == b'\n');
            let part = &block[..newline.unwrap_or(block.len())];
            if !too_long && self.line.len() + part.len() > self.max_line {
                too_long = true;
                self.line = Vec::new();
            }
            if !too_long {
                self.line.extend_from_slice(part);
            }
            let used = newline.map_or(part.len(), |i| i + 1);
            self.reader.consume(used);
            self.pos += used as u64;
            if newline.is_some() {
                return Ok(Some(Line {
                    start,
                    end: self.pos,
                    text: (!too_long).then_some(self.line.as_slice()),
                }));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every line of `[start, end)` of a file holding `bytes`, as (start, end, text).
    fn lines_of(bytes: &[u8], start: u64, end: u64, max: usize) -> Vec<(u64, u64, Option<String>)> {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("anneal-lines-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join(format!("{start}-{end}-{max}.txt"));
        std::fs::write(&path, bytes).expect("write");
        let file = File::open(&path).expect("open");
        let mut lines = Lines::new(&file, start, end, max).expect("lines");
        let mut out = Vec::new();
        while let Some(l) = lines.next_line().expect("read") {
            let text = l.text.map(|t| String::from_utf8_lossy(t).into_owned());
            out.push((l.start, l.end, text));
        }
        let _ = std::fs::remove_dir_all(&dir);
        out
    }

    #[test]
    fn an_empty_file_or_range_has_no_line() {
        assert!(lines_of(b"", 0, 0, MAX_LINE).is_empty());
        assert!(lines_of(b"a\nb\n", 2, 2, MAX_LINE).is_empty());
        // A range past the end of the file reads what is there.
        assert_eq!(lines_of(b"a\n", 0, 100, MAX_LINE).len(), 1);
    }

    #[test]
    fn a_last_line_without_a_newline_is_not_a_line_yet() {
        let got = lines_of(b"one\ntwo\nthr", 0, 11, MAX_LINE);
        assert_eq!(
            got,
            [(0, 4, Some("one".into())), (4, 8, Some("two".into()))]
        );
        // Nor is one the range cuts (the file's end as it was when the range was taken).
        let got = lines_of(b"one\ntwo\n", 0, 6, MAX_LINE);
        assert_eq!(got, [(0, 4, Some("one".into()))]);
        // A file that is one half-written line has none.
        assert!(lines_of(b"{\"step\":1,\"rew", 0, 14, MAX_LINE).is_empty());
    }

    #[test]
    fn lines_longer_than_a_block_come_whole() {
        let long = "x".repeat(3 * BLOCK + 17);
        let bytes = format!("a\n{long}\nb\n");
        let got = lines_of(bytes.as_bytes(), 0, bytes.len() as u64, MAX_LINE);
        assert_eq!(got.len(), 3);
        assert_eq!(got[1], (2, 2 + long.len() as u64 + 1, Some(long.clone())));
        assert_eq!(got[2].2.as_deref(), Some("b"));
        // From the middle of the file: offsets stay the file's.
        let got = lines_of(bytes.as_bytes(), 2, bytes.len() as u64, MAX_LINE);
        assert_eq!(got[0].0, 2);
        assert_eq!(got[1], (got[0].1, bytes.len() as u64, Some("b".into())));
    }

    #[test]
    fn a_line_over_the_limit_is_skipped_but_keeps_its_place() {
        let long = "y".repeat(2 * BLOCK);
        let bytes = format!("{long}\nshort\n{long}");
        let got = lines_of(bytes.as_bytes(), 0, bytes.len() as u64, BLOCK);
        let first_end = long.len() as u64 + 1;
        assert_eq!(
            got,
            [
                (0, first_end, None),
                (first_end, first_end + 6, Some("short".into()))
            ]
        );
        // Exactly at the limit is still a line.
        let exact = "z".repeat(BLOCK);
        let got = lines_of(format!("{exact}\n").as_bytes(), 0, BLOCK as u64 + 1, BLOCK);
        assert_eq!(got[0].2.as_deref(), Some(exact.as_str()));
    }
}

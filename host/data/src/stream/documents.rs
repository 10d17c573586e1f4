//! The documents of a streamed corpus, read from any place: plain text in pieces ending at a
//! line end, JSON lines one by one, Parquet and Arrow rows (a columnar file read whole), each
//! with the place it starts at.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::{bad_place, DocPos, PIECE_BYTES};
use crate::corpus::{jsonl_text, kind, record_text, Kind};
use crate::records::read_records;
use crate::{DataError, Result};

/// A piece with no line end this long is cut at a character boundary.
const PIECE_MAX: usize = 4 << 20;

/// One document (or a piece of a plain-text file) as read.
pub(super) struct Doc {
    pub(super) pos: DocPos,
    pub(super) text: String,
    /// Whether EOS follows it (the last piece of a file; every record).
    pub(super) ends: bool,
}

/// A file being read, from a place.
enum Open {
    /// Plain text, read in pieces.
    Text(BufReader<File>, u64),
    /// JSON lines: the reader, the offset of the next line and its 1-based number.
    Lines(BufReader<File>, u64, usize),
    /// Parquet or Arrow rows (a columnar file is read whole), the next one's index.
    Rows(std::vec::IntoIter<(usize, Value)>, u64),
}

/// The documents of the corpus in one file order, from a place.
pub(super) struct Documents<'a> {
    files: &'a [PathBuf],
    text_field: &'a str,
    order: Vec<u32>,
    /// Position in `order` of the file being read (or to open next).
    slot: usize,
    open: Option<(u32, Open)>,
}

impl<'a> Documents<'a> {
    pub(super) fn new(files: &'a [PathBuf], text_field: &'a str, order: Vec<u32>) -> Self {
        Documents {
            files,
            text_field,
            order,
            slot: 0,
            open: None,
        }
    }

    /// Continues from `at` (which must be a document's start in a file of the order).
    pub(super) fn seek(&mut self, at: DocPos) -> Result<()> {
        let slot = self.order.iter().position(|&f| f == at.file);
        let Some(slot) = slot else {
            return Err(bad_place(format!("file {} is not in the corpus", at.file)));
        };
        self.slot = slot;
        self.open = Some((at.file, self.open_at(at.file, at.offset)?));
        Ok(())
    }

    fn open_at(&self, file: u32, offset: u64) -> Result<Open> {
        let path = &self.files[file as usize];
        let io = |e| DataError::io(path, e);
        Ok(match kind(path) {
            Some(Kind::Text) | Some(Kind::Records(crate::records::RecordFile::JsonLines)) => {
                let mut f = File::open(path).map_err(io)?;
                // The line number of `offset`, for error messages.
                let line = match kind(path) {
                    Some(Kind::Text) => 0,
                    _ => 1 + count_lines(&mut f, offset).map_err(io)?,
                };
                f.seek(SeekFrom::Start(offset)).map_err(io)?;
                let reader = BufReader::with_capacity(1 << 16, f);
                match line {
                    0 => Open::Text(reader, offset),
                    n => Open::Lines(reader, offset, n),
                }
            }
            Some(Kind::Records(_)) => {
                let mut rows = read_records(path)?.into_iter();
                for _ in 0..offset {
                    rows.next();
                }
                Open::Rows(rows, offset)
            }
            None => return Err(DataError::UnsupportedFile { path: path.clone() }),
        })
    }

    /// The next non-empty document of the order, or `None` at its end.
    pub(super) fn next(&mut self) -> Result<Option<Doc>> {
        loop {
            let Some((file, open)) = &mut self.open else {
                let Some(&file) = self.order.get(self.slot) else {
                    return Ok(None);
                };
                self.open = Some((file, self.open_at(file, 0)?));
                continue;
            };
            let (file, path) = (*file, &self.files[*file as usize]);
            let found = match open {
                Open::Text(reader, offset) => text_piece(reader, offset, path)?,
                Open::Lines(reader, offset, line) => {
                    json_line(reader, offset, line, path, self.text_field)?
                        .map(|(at, text)| (at, text, true))
                }
                Open::Rows(rows, next) => match rows.next() {
                    Some((number, row)) => {
                        *next += 1;
                        let text = record_text(path, number, &row, self.text_field)?;
                        Some((*next - 1, text, true))
                    }
                    None => None,
                },
            };
            match found {
                Some((offset, text, ends)) if !text.is_empty() => {
                    let pos = DocPos { file, offset };
                    return Ok(Some(Doc { pos, text, ends }));
                }
                Some(_) => {}
                None => {
                    self.open = None;
                    self.slot += 1;
                }
            }
        }
    }
}

/// Newlines in the first `bytes` bytes of `f` (read from its start).
fn count_lines(f: &mut File, bytes: u64) -> std::io::Result<usize> {
    let mut buf = vec![0u8; 1 << 16];
    let (mut left, mut lines) = (bytes, 0);
    let mut f = &*f;
    while left > 0 {
        let n = f.read(&mut buf[..left.min(1 << 16) as usize])?;
        if n == 0 {
            break;
        }
        lines += buf[..n].iter().filter(|&&b| b == b'\n').count();
        left -= n as u64;
    }
    Ok(lines)
}

/// The next piece of a plain-text file: its offset, text, and whether it ends the file.
fn text_piece(
    reader: &mut BufReader<File>,
    offset: &mut u64,
    path: &Path,
) -> Result<Option<(u64, String, bool)>> {
    let io = |e| DataError::io(path, e);
    let mut buf = Vec::new();
    while buf.len() < PIECE_BYTES {
        let room = (PIECE_MAX - buf.len()) as u64;
        let n = reader
            .by_ref()
            .take(room)
            .read_until(b'\n', &mut buf)
            .map_err(io)?;
        if n == 0 || (buf.len() == PIECE_MAX && buf.last() != Some(&b'\n')) {
            break;
        }
    }
    if buf.is_empty() {
        return Ok(None);
    }
    // A piece cut inside a character gives the character's first bytes back.
    if let Err(e) = std::str::from_utf8(&buf) {
        if e.error_len().is_none() {
            let back = buf.len() - e.valid_up_to();
            buf.truncate(e.valid_up_to());
            reader.seek_relative(-(back as i64)).map_err(io)?;
        }
    }
    let at = *offset;
    *offset += buf.len() as u64;
    let text = String::from_utf8(buf).map_err(|e| {
        let message = format!(
            "not UTF-8 text at byte {}",
            at + e.utf8_error().valid_up_to() as u64
        );
        io(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            message,
        ))
    })?;
    let ends = reader.fill_buf().map_err(io)?.is_empty();
    Ok(Some((at, text, ends)))
}

/// The next non-blank line of a JSON lines file: its offset and the text of its field.
fn json_line(
    reader: &mut BufReader<File>,
    offset: &mut u64,
    line: &mut usize,
    path: &Path,
    field: &str,
) -> Result<Option<(u64, String)>> {
    let mut buf = String::new();
    loop {
        buf.clear();
        let n = reader
            .read_line(&mut buf)
            .map_err(|e| DataError::io(path, e))?;
        if n == 0 {
            return Ok(None);
        }
        let (at, number) = (*offset, *line);
        *offset += n as u64;
        *line += 1;
        if !buf.trim().is_empty() {
            return Ok(Some((at, jsonl_text(path, number, buf.trim_end(), field)?)));
        }
    }
}

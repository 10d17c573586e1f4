//! RIFF/WAVE decoding: PCM integer samples of 8 (unsigned), 16, 24 or 32 bits and IEEE float
//! samples of 32 or 64 bits (format tags 1 and 3, and `WAVE_FORMAT_EXTENSIBLE` with either
//! subformat), any number of channels, averaged to mono.
//!
//! Integer samples scale by `2^(bits − 1)` (8-bit ones after removing their offset of 128), as
//! libsndfile (Python's `soundfile`) reads them: a 16-bit `v` is `v / 32768`. Every length a
//! header gives is checked against the bytes there are, so a malformed or cut-off file is an
//! error saying what is wrong, never a panic.

use thiserror::Error;

/// What is wrong with the bytes of a WAV file.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum WavError {
    /// The bytes do not start with a RIFF/WAVE header.
    #[error("not a WAV file ({0})")]
    NotWav(String),
    /// A length in the file reaches past its end.
    #[error("truncated WAV file: {0}")]
    Truncated(String),
    /// The header contradicts itself or lacks a required chunk.
    #[error("malformed WAV file: {0}")]
    Malformed(String),
    /// A valid file in an encoding this decoder does not read.
    #[error(
        "unsupported WAV encoding: {0} (reads PCM integer samples of 8, 16, 24 or 32 bits and \
         IEEE float samples of 32 or 64 bits)"
    )]
    Unsupported(String),
    /// The data chunk holds no samples.
    #[error("the WAV file holds no audio samples")]
    Empty,
    /// A float sample is infinite or not a number.
    #[error("sample frame {0} of the WAV file is not a finite number")]
    NotFinite(usize),
}

/// A decoded WAV file: its rate, its channel count and its samples averaged to mono.
#[derive(Debug, Clone, PartialEq)]
pub struct Wav {
    /// Samples per second of each channel.
    pub sample_rate: u32,
    /// Channels in the file (averaged into `samples`).
    pub channels: u16,
    /// One value per frame, the mean of its channels, in `[-1, 1]` for integer samples.
    pub samples: Vec<f32>,
}

/// How the samples are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Encoding {
    /// Little-endian integers (8-bit ones unsigned) of this many bits.
    Int(u16),
    /// IEEE floats of this many bits.
    Float(u16),
}

/// What the `fmt ` chunk says.
#[derive(Debug, Clone, Copy)]
struct Format {
    encoding: Encoding,
    channels: u16,
    sample_rate: u32,
}

const WAVE_FORMAT_PCM: u16 = 1;
const WAVE_FORMAT_IEEE_FLOAT: u16 = 3;
const WAVE_FORMAT_EXTENSIBLE: u16 = 0xFFFE;
/// The last 14 bytes of every `KSDATAFORMAT_SUBTYPE_*` GUID whose first two bytes are a format tag.
const SUBFORMAT_TAIL: [u8; 14] = [
    0x00, 0x00, 0x00, 0x00, 0x10, 0x00, 0x80, 0x00, 0x00, 0xAA, 0x00, 0x38, 0x9B, 0x71,
];

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// A chunk id for messages (`fmt `, `data`, or its bytes escaped).
fn chunk_name(id: &[u8]) -> String {
    id.iter()
        .flat_map(|&c| std::ascii::escape_default(c))
        .map(char::from)
        .collect()
}

/// Decodes a whole WAV file held in memory.
pub fn decode_wav(bytes: &[u8]) -> Result<Wav, WavError> {
    if bytes.len() >= 4 && &bytes[..4] == b"RF64" {
        return Err(WavError::Unsupported("RF64 (a WAV file over 4 GiB)".into()));
    }
    if bytes.len() < 12 || &bytes[..4] != b"RIFF" || &bytes[8..12] != b"WAVE" {
        let why = if bytes.len() >= 4 && &bytes[..4] == b"RIFF" {
            if bytes.len() < 12 {
                "the RIFF header is cut off"
            } else {
                "a RIFF file, but not of type WAVE"
            }
        } else {
            "no RIFF header"
        };
        return Err(WavError::NotWav(why.into()));
    }
    let (mut format, mut data) = (None, None);
    let mut at = 12;
    while at < bytes.len() && (format.is_none() || data.is_none()) {
        if bytes.len() - at < 8 {
            return Err(WavError::Truncated(format!(
                "a chunk header at byte {at} is cut off"
            )));
        }
        let id = &bytes[at..at + 4];
        let size = u32_at(bytes, at + 4) as usize;
        let body = at + 8;
        let left = bytes.len() - body;
        if size > left {
            return Err(WavError::Truncated(format!(
                "the '{}' chunk declares {size} bytes, the file holds {left} after its header",
                chunk_name(id)
            )));
        }
        let chunk = &bytes[body..body + size];
        match id {
            b"fmt " if format.is_none() => format = Some(parse_format(chunk)?),
            b"data" if data.is_none() => data = Some(chunk),
            _ => {}
        }
        // Chunks of odd size are followed by a pad byte.
        at = body + size + (size & 1);
    }
    let format = format.ok_or_else(|| WavError::Malformed("no 'fmt ' chunk".into()))?;
    let data = data.ok_or_else(|| WavError::Malformed("no 'data' chunk".into()))?;
    decode_samples(&format, data)
}

/// The encoding, channels and rate of a `fmt ` chunk.
fn parse_format(c: &[u8]) -> Result<Format, WavError> {
    if c.len() < 16 {
        return Err(WavError::Malformed(format!(
            "the 'fmt ' chunk has {} bytes, at least 16 expected",
            c.len()
        )));
    }
    let mut tag = u16_at(c, 0);
    let channels = u16_at(c, 2);
    let sample_rate = u32_at(c, 4);
    let block_align = u16_at(c, 12);
    let bits = u16_at(c, 14);
    if tag == WAVE_FORMAT_EXTENSIBLE {
        // cbSize (2 bytes), valid bits (2), channel mask (4), then the subformat GUID (16).
        if c.len() < 40 || u16_at(c, 16) < 22 {
            return Err(WavError::Malformed(
                "a WAVE_FORMAT_EXTENSIBLE 'fmt ' chunk without its 22-byte extension".into(),
            ));
        }
        if c[26..40] != SUBFORMAT_TAIL {
            return Err(WavError::Unsupported(
                "WAVE_FORMAT_EXTENSIBLE with a subformat GUID that is not a format tag".into(),
            ));
        }
        tag = u16_at(c, 24);
    }
    let encoding = match (tag, bits) {
        (WAVE_FORMAT_PCM, 8 | 16 | 24 | 32) => Encoding::Int(bits),
        (WAVE_FORMAT_IEEE_FLOAT, 32 | 64) => Encoding::Float(bits),
        (WAVE_FORMAT_PCM, _) => return Err(WavError::Unsupported(format!("{bits}-bit PCM"))),
        (WAVE_FORMAT_IEEE_FLOAT, _) => {
            return Err(WavError::Unsupported(format!("{bits}-bit float")))
        }
        (other, _) => {
            let name = match other {
                0x0002 => " (Microsoft ADPCM)",
                0x0006 => " (A-law)",
                0x0007 => " (µ-law)",
                0x0011 => " (IMA ADPCM)",
                0x0055 => " (MP3)",
                _ => "",
            };
            return Err(WavError::Unsupported(format!(
                "format tag {other:#06x}{name}"
            )));
        }
    };
    if channels == 0 {
        return Err(WavError::Malformed("0 channels".into()));
    }
    if sample_rate == 0 {
        return Err(WavError::Malformed("a sample rate of 0 Hz".into()));
    }
    let frame = channels as usize * (bits as usize / 8);
    if block_align as usize != frame {
        return Err(WavError::Malformed(format!(
            "a block align of {block_align} bytes, not the {frame} of {channels} channel(s) of \
             {bits} bits"
        )));
    }
    Ok(Format {
        encoding,
        channels,
        sample_rate,
    })
}

/// The frames of `data`, each the mean of its channels.
fn decode_samples(f: &Format, data: &[u8]) -> Result<Wav, WavError> {
    let (Encoding::Int(bits) | Encoding::Float(bits)) = f.encoding;
    let width = bits as usize / 8;
    let channels = f.channels as usize;
    let frame = width * channels;
    if !data.len().is_multiple_of(frame) {
        return Err(WavError::Malformed(format!(
            "the 'data' chunk's {} bytes are not a whole number of {frame}-byte frames",
            data.len()
        )));
    }
    if data.is_empty() {
        return Err(WavError::Empty);
    }
    let sample = |b: &[u8]| -> f32 {
        match f.encoding {
            Encoding::Int(8) => (b[0] as f32 - 128.0) / 128.0,
            Encoding::Int(16) => i16::from_le_bytes([b[0], b[1]]) as f32 / 32_768.0,
            // The three bytes in the top of an i32, shifted back with their sign.
            Encoding::Int(24) => {
                (i32::from_le_bytes([0, b[0], b[1], b[2]]) >> 8) as f32 / 8_388_608.0
            }
            Encoding::Int(_) => {
                i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f32 / 2_147_483_648.0
            }
            Encoding::Float(32) => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            Encoding::Float(_) => {
                f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f32
            }
        }
    };
    let mut samples = Vec::with_capacity(data.len() / frame);
    for (i, fr) in data.chunks_exact(frame).enumerate() {
        let v = if channels == 1 {
            sample(fr)
        } else {
            fr.chunks_exact(width).map(sample).sum::<f32>() / channels as f32
        };
        if !v.is_finite() {
            return Err(WavError::NotFinite(i));
        }
        samples.push(v);
    }
    Ok(Wav {
        sample_rate: f.sample_rate,
        channels: f.channels,
        samples,
    })
}

/// WAV files for the tests.
#[cfg(test)]
pub(crate) mod write {
    /// A RIFF/WAVE file: a 16-byte `fmt ` chunk with `tag`, then `data`.
    pub fn wav(tag: u16, channels: u16, rate: u32, bits: u16, data: &[u8]) -> Vec<u8> {
        let mut fmt = vec![];
        fmt.extend(tag.to_le_bytes());
        fmt.extend(channels.to_le_bytes());
        fmt.extend(rate.to_le_bytes());
        let align = channels * bits / 8;
        fmt.extend((rate * align as u32).to_le_bytes());
        fmt.extend(align.to_le_bytes());
        fmt.extend(bits.to_le_bytes());
        riff(&[(b"fmt ", fmt), (b"data", data.to_vec())])
    }

    /// A WAVE_FORMAT_EXTENSIBLE file whose subformat is `sub` (1 PCM, 3 float).
    pub fn extensible(sub: u16, channels: u16, rate: u32, bits: u16, data: &[u8]) -> Vec<u8> {
        let mut fmt = vec![];
        fmt.extend(0xFFFEu16.to_le_bytes());
        fmt.extend(channels.to_le_bytes());
        fmt.extend(rate.to_le_bytes());
        let align = channels * bits / 8;
        fmt.extend((rate * align as u32).to_le_bytes());
        fmt.extend(align.to_le_bytes());
        fmt.extend(bits.to_le_bytes());
        fmt.extend(22u16.to_le_bytes());
        fmt.extend(bits.to_le_bytes());
        fmt.extend(0u32.to_le_bytes());
        fmt.extend(sub.to_le_bytes());
        fmt.extend(super::SUBFORMAT_TAIL);
        riff(&[(b"fmt ", fmt), (b"data", data.to_vec())])
    }

    /// A RIFF/WAVE file of these chunks, odd ones padded.
    pub fn riff(chunks: &[(&[u8; 4], Vec<u8>)]) -> Vec<u8> {
        let mut body = b"WAVE".to_vec();
        for (id, c) in chunks {
            body.extend(*id);
            body.extend((c.len() as u32).to_le_bytes());
            body.extend(c);
            if c.len() % 2 == 1 {
                body.push(0);
            }
        }
        let mut out = b"RIFF".to_vec();
        out.extend((body.len() as u32).to_le_bytes());
        out.extend(body);
        out
    }

    /// Little-endian 16-bit samples.
    pub fn i16s(v: &[i16]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::write::{extensible, i16s, riff, wav};
    use super::*;

    fn samples(bytes: &[u8]) -> Vec<f32> {
        decode_wav(bytes).unwrap().samples
    }

    #[test]
    fn every_integer_width_scales_by_its_full_range() {
        let w = decode_wav(&wav(1, 1, 24_000, 16, &i16s(&[0, 16_384, -32_768, 32_767]))).unwrap();
        assert_eq!((w.sample_rate, w.channels), (24_000, 1));
        assert_eq!(w.samples, [0.0, 0.5, -1.0, 32_767.0 / 32_768.0]);
        // 8-bit samples are unsigned around 128.
        assert_eq!(
            samples(&wav(1, 1, 8_000, 8, &[128, 192, 0, 255])),
            [0.0, 0.5, -1.0, 127.0 / 128.0]
        );
        // 24-bit: 0x400000, 0x800000 (the most negative), 0xFFFFFF (-1 / 2^23).
        let b24 = [0x00, 0x00, 0x40, 0x00, 0x00, 0x80, 0xFF, 0xFF, 0xFF];
        assert_eq!(
            samples(&wav(1, 1, 24_000, 24, &b24)),
            [0.5, -1.0, -1.0 / 8_388_608.0]
        );
        let b32: Vec<u8> = [1 << 30, i32::MIN, -(1 << 16)]
            .iter()
            .flat_map(|x: &i32| x.to_le_bytes())
            .collect();
        assert_eq!(
            samples(&wav(1, 1, 24_000, 32, &b32)),
            [0.5, -1.0, -1.0 / 32_768.0]
        );
    }

    #[test]
    fn float_samples_are_read_as_they_are() {
        let f32s: Vec<u8> = [0.25f32, -0.75, 1.5]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(samples(&wav(3, 1, 24_000, 32, &f32s)), [0.25, -0.75, 1.5]);
        let f64s: Vec<u8> = [0.125f64, -1.0 / 3.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(
            samples(&wav(3, 1, 24_000, 64, &f64s)),
            [0.125, (-1.0f64 / 3.0) as f32]
        );
        let nan: Vec<u8> = [0.0f32, f32::NAN]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(
            decode_wav(&wav(3, 1, 24_000, 32, &nan)),
            Err(WavError::NotFinite(1))
        );
    }

    #[test]
    fn extensible_files_read_their_subformat() {
        assert_eq!(
            samples(&extensible(1, 1, 24_000, 16, &i16s(&[16_384, -16_384]))),
            [0.5, -0.5]
        );
        let f32s: Vec<u8> = [0.5f32].iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(samples(&extensible(3, 1, 24_000, 32, &f32s)), [0.5]);
        // A GUID that is not a format tag's, and a subformat this decoder does not read.
        let mut odd = extensible(1, 1, 24_000, 16, &i16s(&[0]));
        let guid_tail = 20 + 26;
        odd[guid_tail] ^= 0xFF;
        assert!(matches!(decode_wav(&odd), Err(WavError::Unsupported(m)) if m.contains("GUID")));
        let alaw = extensible(6, 1, 24_000, 8, &[0]);
        assert!(matches!(decode_wav(&alaw), Err(WavError::Unsupported(m)) if m.contains("A-law")));
    }

    #[test]
    fn channels_are_averaged_to_mono() {
        // Stereo frames (0.5, -0.5), (0.5, 0), (-1, -1).
        let st = i16s(&[16_384, -16_384, 16_384, 0, -32_768, -32_768]);
        let w = decode_wav(&wav(1, 2, 24_000, 16, &st)).unwrap();
        assert_eq!(w.channels, 2);
        assert_eq!(w.samples, [0.0, 0.25, -1.0]);
        // Three channels of floats.
        let f: Vec<u8> = [0.25f32, 0.5, 0.75]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(samples(&wav(3, 3, 24_000, 32, &f)), [0.5]);
    }

    #[test]
    fn other_chunks_are_skipped_odd_ones_with_their_pad_byte() {
        let fmt = wav(1, 1, 24_000, 16, &[])[20..36].to_vec();
        let file = riff(&[
            (b"LIST", vec![1, 2, 3]),
            (b"fmt ", fmt),
            (b"junk", vec![]),
            (b"data", i16s(&[8_192])),
            // After the data: not read, even if it makes no sense.
            (b"zzzz", vec![9; 5]),
        ]);
        assert_eq!(samples(&file), [0.25]);
    }

    #[test]
    fn malformed_files_say_what_is_wrong() {
        let good = wav(1, 1, 24_000, 16, &i16s(&[1, 2, 3, 4]));
        let err = |b: &[u8]| decode_wav(b).unwrap_err().to_string();
        assert!(err(b"OggS\0\0\0\0\0\0\0\0").contains("no RIFF header"));
        assert!(err(&good[..10]).contains("cut off"));
        let mut avi = good.clone();
        avi[8..12].copy_from_slice(b"AVI ");
        assert!(err(&avi).contains("not of type WAVE"));
        assert!(err(b"RF64").contains("RF64"));
        // The data chunk cut short, and a chunk header cut off.
        let cut = err(&good[..good.len() - 3]);
        assert!(cut.contains("truncated") && cut.contains("'data'"), "{cut}");
        assert!(err(&good[..40]).contains("truncated"));
        assert!(err(&good[..38]).contains("cut off"));
        // No data chunk, no fmt chunk, a short fmt chunk.
        assert!(err(&good[..36]).contains("no 'data' chunk"));
        let no_fmt = riff(&[(b"data", i16s(&[1]))]);
        assert!(err(&no_fmt).contains("no 'fmt ' chunk"));
        let short = riff(&[(b"fmt ", vec![1, 0, 1, 0]), (b"data", i16s(&[1]))]);
        assert!(err(&short).contains("at least 16"));
        // Encodings this decoder does not read.
        assert!(err(&wav(2, 1, 24_000, 4, &[0; 4])).contains("ADPCM"));
        assert!(err(&wav(7, 1, 8_000, 8, &[0; 4])).contains("µ-law"));
        assert!(err(&wav(1, 1, 24_000, 12, &[0; 4])).contains("12-bit PCM"));
        assert!(err(&wav(3, 1, 24_000, 16, &[0; 4])).contains("16-bit float"));
        // Header fields that contradict each other.
        assert!(err(&wav(1, 0, 24_000, 16, &[0; 4])).contains("0 channels"));
        assert!(err(&wav(1, 1, 0, 16, &[0; 4])).contains("0 Hz"));
        let mut align = good.clone();
        align[32] = 4;
        assert!(err(&align).contains("block align"));
        assert!(err(&wav(1, 2, 24_000, 16, &[0; 6])).contains("whole number"));
        assert_eq!(
            decode_wav(&wav(1, 1, 24_000, 16, &[])),
            Err(WavError::Empty)
        );
    }

    #[test]
    fn damaged_files_never_panic() {
        // Every cut of a stereo 24-bit file, and many random single-byte changes of it.
        let data: Vec<u8> = (0..60u8).collect();
        let good = extensible(1, 2, 24_000, 24, &data);
        for n in 0..good.len() {
            let _ = decode_wav(&good[..n]);
        }
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..20_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let mut bad = good.clone();
            let at = (state % bad.len() as u64) as usize;
            bad[at] = (state >> 32) as u8;
            let _ = decode_wav(&bad);
        }
    }
}

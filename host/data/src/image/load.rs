//! Decoding PNG / JPEG / WebP into [`RgbImage`], with the pixel limit checked from the header
//! before any pixel buffer exists, and transparency composited on white as transformers'
//! `convert_to_rgb` does (PIL's `alpha_composite` over an opaque white background).

use std::fs::File;
use std::io::{BufRead, BufReader, Cursor, ErrorKind, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use ::image::{
    DynamicImage, ImageDecoder, ImageError as CrateError, ImageFormat, ImageReader, Limits,
};

use super::{ImageError, Result, RgbImage};

/// The default most pixels (`width · height`) an image may declare: 8192 × 8192. A decoded RGBA
/// image of this size takes 256 MiB; anything larger is refused from its header. Qwen2-VL's own
/// `max_pixels` (12,845,056) is well under it.
pub const DEFAULT_MAX_PIXELS: u64 = 8192 * 8192;

/// Reads and decodes an image file (PNG, JPEG or WebP, recognised by content, not extension) into
/// RGB, refusing one whose header declares more than [`DEFAULT_MAX_PIXELS`] pixels.
pub fn load_image(path: &Path) -> Result<RgbImage> {
    load_image_with_limit(path, DEFAULT_MAX_PIXELS)
}

/// [`load_image`] with a pixel limit of the caller's choosing.
pub fn load_image_with_limit(path: &Path, max_pixels: u64) -> Result<RgbImage> {
    let file = File::open(path).map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => ImageError::Missing {
            path: path.to_path_buf(),
        },
        _ => ImageError::Io {
            path: path.to_path_buf(),
            source,
        },
    })?;
    decode_from(BufReader::new(file), path, max_pixels)
}

/// Decodes an image held in memory (e.g. a `data:` URL's bytes); `name` is what errors call it.
pub fn decode_image(bytes: &[u8], name: &Path, max_pixels: u64) -> Result<RgbImage> {
    decode_from(Cursor::new(bytes), name, max_pixels)
}

fn decode_from(reader: impl BufRead + Seek, path: &Path, max_pixels: u64) -> Result<RgbImage> {
    let mut reader = ImageReader::new(reader)
        .with_guessed_format()
        .map_err(|e| io_or_corrupt(path, e))?;
    let Some(format) = reader.format() else {
        return Err(ImageError::Unsupported {
            path: path.to_path_buf(),
            detail: "unrecognised content".into(),
        });
    };
    if format == ImageFormat::Jpeg {
        // The JPEG decoder fills a cut-off scan with grey and reports success; PIL refuses such a
        // file ("image file is truncated"), and so do we.
        let mut inner = reader.into_inner();
        let complete = jpeg_is_complete(&mut inner).map_err(|e| io_or_corrupt(path, e))?;
        inner
            .seek(SeekFrom::Start(0))
            .map_err(|e| io_or_corrupt(path, e))?;
        if !complete {
            return Err(ImageError::Corrupt {
                path: path.to_path_buf(),
                message: "JPEG data ends before its end-of-image marker".into(),
            });
        }
        reader = ImageReader::with_format(inner, format);
    }
    // The limit is ours, checked below from the header; the crate's own default limits would
    // refuse some large-but-allowed images with a less precise message.
    reader.no_limits();
    let mut decoder = reader
        .into_decoder()
        .map_err(|e| map_crate_error(path, format!("{format:?}"), e))?;
    let (width, height) = decoder.dimensions();
    if width as u64 * height as u64 > max_pixels {
        return Err(ImageError::TooLarge {
            path: path.to_path_buf(),
            width,
            height,
            limit: max_pixels,
        });
    }
    // Now bound what decoding may allocate: the largest buffer an allowed image needs (4 channels
    // of 16 bits), plus slack for the decoder's own state.
    let mut limits = Limits::no_limits();
    limits.max_alloc = Some(max_pixels.saturating_mul(8).saturating_add(64 << 20));
    decoder
        .set_limits(limits)
        .map_err(|e| map_crate_error(path, format!("{format:?}"), e))?;
    let image = DynamicImage::from_decoder(decoder)
        .map_err(|e| map_crate_error(path, format!("{format:?}"), e))?;
    Ok(to_rgb(image))
}

/// Whether a JPEG stream reaches its end-of-image marker (`FF D9`): the marker segments before
/// the first scan are skipped by their lengths (an EXIF thumbnail inside them has its own markers),
/// then the entropy-coded data, where a data byte `FF` is always followed by `00` or a restart
/// marker, is searched for `FF D9`.
fn jpeg_is_complete(r: &mut impl Read) -> std::io::Result<bool> {
    let mut byte = [0u8; 1];
    let mut next = |r: &mut dyn Read| -> std::io::Result<Option<u8>> {
        match r.read_exact(&mut byte) {
            Ok(()) => Ok(Some(byte[0])),
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => Ok(None),
            Err(e) => Err(e),
        }
    };
    if (next(r)?, next(r)?) != (Some(0xFF), Some(0xD8)) {
        return Ok(false);
    }
    // Marker segments up to the first start-of-scan.
    loop {
        let Some(0xFF) = next(r)? else {
            return Ok(false);
        };
        let mut marker = next(r)?;
        while marker == Some(0xFF) {
            marker = next(r)?; // fill bytes
        }
        match marker {
            None | Some(0xD9) => return Ok(false),
            Some(0x01 | 0xD0..=0xD7) => continue, // markers without a length
            Some(m) => {
                let (Some(hi), Some(lo)) = (next(r)?, next(r)?) else {
                    return Ok(false);
                };
                let len = u16::from_be_bytes([hi, lo]) as u64;
                let skip = len.saturating_sub(2);
                if std::io::copy(&mut r.take(skip), &mut std::io::sink())? < skip {
                    return Ok(false);
                }
                if m == 0xDA {
                    break;
                }
            }
        }
    }
    // Scan data (and any later scans' headers, for progressive files) up to `FF D9`.
    let mut prev_ff = false;
    while let Some(b) = next(r)? {
        if prev_ff && b == 0xD9 {
            return Ok(true);
        }
        prev_ff = b == 0xFF;
    }
    Ok(false)
}

fn io_or_corrupt(path: &Path, e: std::io::Error) -> ImageError {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof => ImageError::Corrupt {
            path: path.to_path_buf(),
            message: "unexpected end of file".into(),
        },
        _ => ImageError::Io {
            path: path.to_path_buf(),
            source: e,
        },
    }
}

fn map_crate_error(path: &Path, format: String, e: CrateError) -> ImageError {
    let path: PathBuf = path.to_path_buf();
    match e {
        CrateError::Unsupported(u) => ImageError::Unsupported {
            path,
            detail: format!("{format}: {u}"),
        },
        CrateError::IoError(io) => io_or_corrupt(&path, io),
        CrateError::Limits(l) => ImageError::Corrupt {
            path,
            message: format!("decoding needs more memory than the image's size allows: {l}"),
        },
        other => ImageError::Corrupt {
            path,
            message: other.to_string(),
        },
    }
}

/// To 8-bit RGB the way transformers' `convert_to_rgb` does it through PIL: images with alpha
/// composited over opaque white, grey replicated, 16-bit samples cut to their high byte (PIL
/// reads 16-bit PNGs as 8-bit that way).
fn to_rgb(image: DynamicImage) -> RgbImage {
    let (width, height) = (image.width(), image.height());
    let pixels = match image {
        DynamicImage::ImageRgb8(buf) => buf.into_raw(),
        DynamicImage::ImageRgba8(buf) => composite_on_white(buf.as_raw().chunks_exact(4)),
        DynamicImage::ImageLuma8(buf) => buf.as_raw().iter().flat_map(|&g| [g, g, g]).collect(),
        DynamicImage::ImageLumaA8(buf) => {
            let rgba: Vec<[u8; 4]> = buf
                .as_raw()
                .chunks_exact(2)
                .map(|p| [p[0], p[0], p[0], p[1]])
                .collect();
            composite_on_white(rgba.iter().map(|p| &p[..]))
        }
        DynamicImage::ImageRgb16(buf) => buf.as_raw().iter().map(|&v| (v >> 8) as u8).collect(),
        DynamicImage::ImageRgba16(buf) => {
            let rgba: Vec<u8> = buf.as_raw().iter().map(|&v| (v >> 8) as u8).collect();
            composite_on_white(rgba.chunks_exact(4))
        }
        DynamicImage::ImageLuma16(buf) => buf
            .as_raw()
            .iter()
            .flat_map(|&g| [(g >> 8) as u8; 3])
            .collect(),
        DynamicImage::ImageLumaA16(buf) => {
            let rgba: Vec<[u8; 4]> = buf
                .as_raw()
                .chunks_exact(2)
                .map(|p| {
                    let g = (p[0] >> 8) as u8;
                    [g, g, g, (p[1] >> 8) as u8]
                })
                .collect();
            composite_on_white(rgba.iter().map(|p| &p[..]))
        }
        // Float images come from none of the enabled decoders; go through RGBA8 all the same.
        other => composite_on_white(other.to_rgba8().as_raw().chunks_exact(4)),
    };
    RgbImage {
        width,
        height,
        pixels,
    }
}

/// PIL's `Image.alpha_composite(white, src)` then `.convert("RGB")`, in PIL's integer arithmetic
/// (libImaging/AlphaComposite.c, 7 extra bits of precision, rounded divisions by 255).
fn composite_on_white<'a>(pixels: impl Iterator<Item = &'a [u8]>) -> Vec<u8> {
    const PRECISION_BITS: u32 = 7;
    let shift_div_255 = |a: u32| ((a >> 8) + a) >> 8;
    let (dst_c, dst_a) = (255u32, 255u32);
    let mut out = Vec::new();
    for p in pixels {
        let a = p[3] as u32;
        if a == 0 {
            out.extend_from_slice(&[255, 255, 255]);
            continue;
        }
        let blend = dst_a * (255 - a);
        let outa255 = a * 255 + blend;
        let coef1 = a * 255 * 255 * (1 << PRECISION_BITS) / outa255;
        let coef2 = 255 * (1 << PRECISION_BITS) - coef1;
        for &c in &p[..3] {
            let tmp = c as u32 * coef1 + dst_c * coef2;
            out.push((shift_div_255(tmp + (0x80 << PRECISION_BITS)) >> PRECISION_BITS) as u8);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jpeg_completeness_skips_segments_and_finds_the_end() {
        // SOI, an APP1 segment whose payload holds FF D9, SOS, scan data with a stuffed FF 00.
        let head = [0xFF, 0xD8, 0xFF, 0xE1, 0x00, 0x06, 0xFF, 0xD9, 0xFF, 0xD9];
        let scan = [0xFF, 0xDA, 0x00, 0x03, 0x01, 0x12, 0xFF, 0x00, 0x34];
        let body = [&head[..], &scan[..]].concat();
        let complete = |b: &[u8]| jpeg_is_complete(&mut Cursor::new(b)).unwrap();
        assert!(!complete(&body));
        assert!(complete(&[&body[..], &[0xFF, 0xD9]].concat()));
        assert!(!complete(&body[..7]));
        assert!(!complete(b"not a jpeg"));
    }

    #[test]
    fn composite_keeps_opaque_and_whitens_transparent() {
        let px = [10u8, 20, 30, 255, 10, 20, 30, 0, 0, 0, 0, 128];
        let out = composite_on_white(px.chunks_exact(4));
        assert_eq!(&out[..6], &[10, 20, 30, 255, 255, 255]);
        // Half-transparent black over white is mid grey.
        assert!(out[6..].iter().all(|&v| v == 127 || v == 128), "{out:?}");
    }
}

//! The image path against transformers' Qwen2-VL image processor, through the fixtures that
//! `tests/reference/make_image_fixtures.py` writes: PIL-decoded pixels, the slow (PIL) processor's
//! `pixel_values` / `image_grid_thw`, and the slow-vs-fast processors' own difference.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::{Path, PathBuf};

use anneal_data::image::{
    decode_image, load_image, load_image_with_limit, ImageError, ImageProcessor, ProcessorConfig,
    RgbImage, DEFAULT_MAX_PIXELS,
};
use safetensors::SafeTensors;
use serde_json::Value;

/// Records the largest single allocation each thread makes, so a test can show that refusing an
/// oversized image allocated no pixel buffer.
struct PeakAlloc;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for PeakAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = LARGEST.try_with(|c| c.set(c.get().max(layout.size())));
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = LARGEST.try_with(|c| c.set(c.get().max(new_size)));
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: PeakAlloc = PeakAlloc;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/images")
}

struct Case {
    name: String,
    file: PathBuf,
    config: ProcessorConfig,
    resized: bool,
    slow_fast: f32,
    decoded: RgbImage,
    pixel_values: Vec<f32>,
    grid: [usize; 3],
}

fn cases() -> Vec<Case> {
    let dir = fixtures();
    let meta: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out = Vec::new();
    for (name, m) in meta.as_object().unwrap() {
        let config_dir = dir.join(m["config"].as_str().unwrap());
        let config =
            ProcessorConfig::from_file(&config_dir.join("preprocessor_config.json")).unwrap();
        let decoded = st.tensor(&format!("{name}.decoded")).unwrap();
        let (h, w) = (decoded.shape()[0] as u32, decoded.shape()[1] as u32);
        let pv = st.tensor(&format!("{name}.pixel_values")).unwrap();
        let grid = st.tensor(&format!("{name}.image_grid_thw")).unwrap();
        let grid: Vec<usize> = grid
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as usize)
            .collect();
        out.push(Case {
            name: name.clone(),
            file: dir.join(m["file"].as_str().unwrap()),
            config,
            resized: m["resized"].as_bool().unwrap(),
            slow_fast: m["slow_fast_max_abs_diff"].as_f64().unwrap() as f32,
            decoded: RgbImage::new(w, h, decoded.data().to_vec()).unwrap(),
            pixel_values: pv
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect(),
            grid: [grid[0], grid[1], grid[2]],
        });
    }
    assert_eq!(out.len(), 10, "cases.json lists the ten fixtures");
    out
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn max_byte_diff(a: &RgbImage, b: &RgbImage) -> u8 {
    assert_eq!((a.width(), a.height()), (b.width(), b.height()));
    let diffs = a.pixels().iter().zip(b.pixels());
    diffs.map(|(x, y)| x.abs_diff(*y)).max().unwrap_or(0)
}

/// On PIL's decoded pixels the processor reproduces the slow processor bit for bit, with and
/// without a resize (PIL's bicubic convolution and rounding are reproduced exactly); the slow-vs-
/// fast figure is printed beside ours.
#[test]
fn pixel_values_match_the_slow_processor() {
    for case in cases() {
        let out = ImageProcessor::new(case.config.clone())
            .process(&case.decoded)
            .unwrap();
        assert_eq!(out.grid_thw, case.grid, "{}", case.name);
        assert_eq!(out.patches, case.grid.iter().product::<usize>());
        assert_eq!(out.patch_dim * out.patches, case.pixel_values.len());
        let ours = max_abs_diff(&out.pixel_values, &case.pixel_values);
        println!(
            "{:18} resized={:5} ours-vs-slow {:e}  fast-vs-slow {:e}",
            case.name, case.resized, ours, case.slow_fast
        );
        assert!(
            ours <= case.slow_fast,
            "{}: {ours} > {}",
            case.name,
            case.slow_fast
        );
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&out.pixel_values),
            bits(&case.pixel_values),
            "{}: not bitwise the slow processor",
            case.name
        );
    }
}

/// The grid and the placeholder count: `t · h · w / merge²`, the same from the size alone.
#[test]
fn grid_and_placeholder_count() {
    for case in cases() {
        let processor = ImageProcessor::new(case.config.clone());
        let out = processor.process(&case.decoded).unwrap();
        let m = case.config.merge_size;
        let expected = case.grid.iter().product::<usize>() / (m * m);
        assert_eq!(out.placeholder_tokens(), expected, "{}", case.name);
        let (h, w) = (case.decoded.height(), case.decoded.width());
        assert_eq!(processor.placeholder_tokens(h, w).unwrap(), expected);
    }
    // 33 x 47 → 56 x 84 under Qwen2-VL's defaults: a 4 x 6 grid, 6 tokens.
    let p = ImageProcessor::default();
    assert_eq!(p.placeholder_tokens(33, 47).unwrap(), 6);
}

/// Decoding: PNG (RGB and RGBA composited on white) is PIL's pixels exactly; lossy JPEG and WebP
/// decoders differ from libjpeg-turbo / libwebp by a few levels (printed), and end to end the
/// processor output then differs by that much.
#[test]
fn decoding_matches_pil() {
    for case in cases() {
        let ours = load_image(&case.file).unwrap();
        let diff = max_byte_diff(&ours, &case.decoded);
        let mean = ours
            .pixels()
            .iter()
            .zip(case.decoded.pixels())
            .map(|(x, y)| x.abs_diff(*y) as f64)
            .sum::<f64>()
            / ours.pixels().len() as f64;
        let out = ImageProcessor::new(case.config.clone())
            .process(&ours)
            .unwrap();
        let end_to_end = max_abs_diff(&out.pixel_values, &case.pixel_values);
        println!(
            "{:18} decode max diff {diff} levels (mean {mean:.3}); end to end vs slow {end_to_end:e}",
            case.name
        );
        let ext = case.file.extension().unwrap().to_str().unwrap();
        if ext == "png" {
            assert_eq!(diff, 0, "{}", case.name);
            assert_eq!(end_to_end, 0.0, "{}", case.name);
        } else {
            assert!(diff <= 8, "{}: decoded {diff} levels from PIL", case.name);
        }
    }
}

#[test]
fn missing_file_is_named() {
    let err = load_image(Path::new("/no/such/image.png")).unwrap_err();
    assert!(matches!(err, ImageError::Missing { .. }), "{err:?}");
    assert_eq!(err.to_string(), "/no/such/image.png: image file not found");
}

#[test]
fn truncated_images_are_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    for file in [
        "rgb_h56_w56.png",
        "photo_h56_w56.jpg",
        "shapes_h60_w90.webp",
    ] {
        let bytes = std::fs::read(fixtures().join(file)).unwrap();
        let path = dir.path().join(format!("cut-{file}"));
        std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
        let err = load_image(&path).unwrap_err();
        assert!(matches!(err, ImageError::Corrupt { .. }), "{file}: {err:?}");
        assert!(
            err.to_string().starts_with(&path.display().to_string()),
            "{err}"
        );
    }
}

#[test]
fn unknown_format_is_unsupported() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notes.png");
    std::fs::write(&path, "just some text, not an image").unwrap();
    let err = load_image(&path).unwrap_err();
    assert!(matches!(err, ImageError::Unsupported { .. }), "{err:?}");
    // A GIF is recognised but its decoder is not built in.
    std::fs::write(&path, b"GIF89a\x01\x00\x01\x00\x00\x00\x00;").unwrap();
    let err = load_image(&path).unwrap_err();
    assert!(matches!(err, ImageError::Unsupported { .. }), "{err:?}");
}

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// A valid PNG header for `width × height` RGB, one tiny IDAT and IEND: a few dozen bytes.
fn png_header_only(width: u32, height: u32) -> Vec<u8> {
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut chunk = |kind: &[u8], data: &[u8]| {
        png.extend_from_slice(&(data.len() as u32).to_be_bytes());
        let mut body = kind.to_vec();
        body.extend_from_slice(data);
        png.extend_from_slice(&body);
        png.extend_from_slice(&crc32(&body).to_be_bytes());
    };
    let mut ihdr = width.to_be_bytes().to_vec();
    ihdr.extend_from_slice(&height.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    chunk(b"IHDR", &ihdr);
    chunk(b"IDAT", &[0x78, 0x9c, 0x03, 0x00, 0x00, 0x00, 0x00, 0x01]);
    chunk(b"IEND", &[]);
    png
}

/// A 20,000 × 20,000 PNG (a 100-byte file) is refused from its header: no allocation anywhere
/// near the 1.2 GB its pixels would take is made.
#[test]
fn oversized_image_is_refused_before_decoding() {
    let png = png_header_only(20_000, 20_000);
    assert!(png.len() < 100);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("huge.png");
    std::fs::write(&path, &png).unwrap();

    LARGEST.with(|c| c.set(0));
    let err = load_image(&path).unwrap_err();
    let largest = LARGEST.with(|c| c.get());
    assert!(largest < 1 << 20, "largest allocation {largest} bytes");
    match &err {
        ImageError::TooLarge {
            width,
            height,
            limit,
            ..
        } => assert_eq!(
            (*width, *height, *limit),
            (20_000, 20_000, DEFAULT_MAX_PIXELS)
        ),
        other => panic!("{other:?}"),
    }
    assert!(err.to_string().contains("20000 x 20000"), "{err}");

    // The same from memory, and a limit of the caller's choosing.
    let err = decode_image(&png, Path::new("upload"), DEFAULT_MAX_PIXELS).unwrap_err();
    assert!(matches!(err, ImageError::TooLarge { .. }), "{err:?}");
    let small = fixtures().join("rgb_h56_w56.png");
    let err = load_image_with_limit(&small, 56 * 56 - 1).unwrap_err();
    assert!(matches!(err, ImageError::TooLarge { .. }), "{err:?}");
    assert!(load_image_with_limit(&small, 56 * 56).is_ok());
}

/// Rewrites the size a JPEG's SOF0 marker or a lossy WebP's VP8 frame header declares.
fn with_declared_size(mut bytes: Vec<u8>, width: u16, height: u16) -> Vec<u8> {
    if let Some(at) = bytes.windows(2).position(|w| w == [0xFF, 0xC0]) {
        // FFC0, length (2), precision (1), height (2, big-endian), width (2).
        bytes[at + 5..at + 7].copy_from_slice(&height.to_be_bytes());
        bytes[at + 7..at + 9].copy_from_slice(&width.to_be_bytes());
    } else {
        // VP8 key frame start code, then 14-bit width and height, little-endian.
        let at = bytes
            .windows(3)
            .position(|w| w == [0x9D, 0x01, 0x2A])
            .unwrap()
            + 3;
        bytes[at..at + 2].copy_from_slice(&width.to_le_bytes());
        bytes[at + 2..at + 4].copy_from_slice(&height.to_le_bytes());
    }
    bytes
}

/// The same refusal from JPEG and WebP headers: the fixtures with their declared size rewritten
/// (16,383 is the most a VP8 frame can declare).
#[test]
fn oversized_jpeg_and_webp_are_refused_before_decoding() {
    for (file, side) in [
        ("photo_h56_w56.jpg", 20_000),
        ("shapes_h60_w90.webp", 16_383),
    ] {
        let bytes = std::fs::read(fixtures().join(file)).unwrap();
        let bytes = with_declared_size(bytes, side, side);
        LARGEST.with(|c| c.set(0));
        let err = decode_image(&bytes, Path::new(file), DEFAULT_MAX_PIXELS).unwrap_err();
        let largest = LARGEST.with(|c| c.get());
        assert!(
            largest < 1 << 20,
            "{file}: largest allocation {largest} bytes"
        );
        match err {
            ImageError::TooLarge { width, height, .. } => {
                assert_eq!((width, height), (side as u32, side as u32), "{file}")
            }
            other => panic!("{file}: {other:?}"),
        }
    }
}

#[test]
fn bad_config_values_name_the_key() {
    let cases = [
        (r#"{"patch_size": "14"}"#, "patch_size"),
        (r#"{"merge_size": 0}"#, "merge_size"),
        (r#"{"size": {"longest_edge": -1}}"#, "size.longest_edge"),
        (r#"{"size": 5}"#, "size"),
        (r#"{"image_mean": [0.5, 0.5]}"#, "image_mean"),
        (r#"{"image_std": [0.5, 0, 0.5]}"#, "image_std"),
        (r#"{"do_resize": "yes"}"#, "do_resize"),
        (r#"{"resample": 2}"#, "resample"),
        (r#"{"min_pixels": 5000, "max_pixels": 4000}"#, "min_pixels"),
        (
            r#"{"size": {"shortest_edge": 4000000000}}"#,
            "size.shortest_edge",
        ),
        (r#"[1, 2]"#, "(file)"),
    ];
    for (json, key) in cases {
        let err = ProcessorConfig::from_json_str(json, "cfg.json").unwrap_err();
        match &err {
            ImageError::BadConfig { key: k, origin, .. } => {
                assert_eq!((k.as_str(), origin.as_str()), (key, "cfg.json"), "{json}")
            }
            other => panic!("{json}: {other:?}"),
        }
        assert!(
            err.to_string().starts_with(&format!("cfg.json: {key}: ")),
            "{err}"
        );
    }
}

#[test]
fn config_fields_and_defaults() {
    // Unknown keys are ignored; top-level min/max_pixels override `size`.
    let c = ProcessorConfig::from_json_str(
        r#"{"size": {"shortest_edge": 10, "longest_edge": 20}, "max_pixels": 30,
            "patch_size": 16, "image_mean": 0.5, "processor_class": "X", "do_normalize": false}"#,
        "cfg",
    )
    .unwrap();
    assert_eq!((c.min_pixels, c.max_pixels, c.patch_size), (10, 30, 16));
    assert_eq!(c.image_mean, [0.5; 3]);
    assert!(!c.do_normalize && c.do_resize);
    assert_eq!(
        ProcessorConfig::from_json_str("{}", "cfg").unwrap(),
        ProcessorConfig::default()
    );
    let qwen3 = ProcessorConfig::from_dir(&fixtures().join("qwen3vl")).unwrap();
    assert_eq!((qwen3.min_pixels, qwen3.max_pixels), (1024, 8192));
}

#[test]
fn shapes_that_cannot_be_processed() {
    let img = RgbImage::new(300, 1, vec![0; 900]).unwrap();
    let err = ImageProcessor::default().process(&img).unwrap_err();
    assert!(err.to_string().contains("aspect ratio"), "{err}");
    let config = ProcessorConfig {
        do_resize: false,
        ..ProcessorConfig::default()
    };
    let img = RgbImage::new(60, 56, vec![0; 60 * 56 * 3]).unwrap();
    let err = ImageProcessor::new(config).process(&img).unwrap_err();
    assert!(matches!(err, ImageError::BadShape { .. }), "{err:?}");
}

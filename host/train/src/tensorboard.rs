//! TensorBoard event files beside `metrics.jsonl`: every numeric field of a metrics row becomes
//! a scalar of the same name at the row's step, so `tensorboard --logdir runs/` shows each run's
//! curves with no conversion step.
//!
//! The format is TensorFlow's: a file of TFRecords (length, masked CRC-32C of the length, the
//! payload, masked CRC-32C of the payload), each payload an `Event` protocol buffer. The first
//! event names the file version; each later one holds a `Summary` of `simple_value` scalars.
//! The few protobuf fields involved are encoded here by hand rather than through a generated
//! schema. Each process that opens a run writes a new file (named by its start time, host and
//! process id, as TensorFlow names them), so a resumed run adds a file and TensorBoard reads
//! them in order.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// Appends scalar events to one `events.out.tfevents.*` file.
pub struct EventWriter {
    path: PathBuf,
    file: BufWriter<File>,
}

impl EventWriter {
    /// Creates a new event file in `dir` and writes its version record.
    pub fn create(dir: &Path) -> std::io::Result<EventWriter> {
        let now = unix_seconds();
        let host = hostname();
        let name = format!(
            "events.out.tfevents.{}.{host}.{}.0",
            now as u64,
            std::process::id()
        );
        let path = dir.join(name);
        let file = BufWriter::new(File::create(&path)?);
        let mut writer = EventWriter { path, file };
        let mut event = event_header(now, 0);
        put_bytes(&mut event, 3, b"brain.Event:2");
        writer.record(&event)?;
        Ok(writer)
    }

    /// The file written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `values` (tag, value) as one event at `step`, then flushes, so TensorBoard (and a
    /// crash) sees whole records only.
    pub fn scalars(&mut self, step: u64, values: &[(String, f64)]) -> std::io::Result<()> {
        if values.is_empty() {
            return Ok(());
        }
        let mut summary = Vec::new();
        for (tag, value) in values {
            let mut v = Vec::new();
            put_bytes(&mut v, 1, tag.as_bytes());
            // simple_value = 2, a 32-bit float (wire type 5).
            v.push((2 << 3) | 5);
            v.extend_from_slice(&(*value as f32).to_le_bytes());
            put_bytes(&mut summary, 1, &v);
        }
        let mut event = event_header(unix_seconds(), step as i64);
        put_bytes(&mut event, 5, &summary);
        self.record(&event)?;
        self.file.flush()
    }

    fn record(&mut self, payload: &[u8]) -> std::io::Result<()> {
        let len = (payload.len() as u64).to_le_bytes();
        self.file.write_all(&len)?;
        self.file.write_all(&masked_crc(&len).to_le_bytes())?;
        self.file.write_all(payload)?;
        self.file.write_all(&masked_crc(payload).to_le_bytes())
    }
}

/// The numeric fields of a metrics row as TensorBoard scalars, named as in `metrics.jsonl`
/// (nested objects joined with `/`); `step` is the event's step, not a scalar.
pub fn scalars_of(row: &serde_json::Value) -> Vec<(String, f64)> {
    let mut out = Vec::new();
    if let serde_json::Value::Object(fields) = row {
        for (key, value) in fields {
            if key != "step" && key != "wall_time" {
                collect(key, value, &mut out);
            }
        }
    }
    out
}

fn collect(tag: &str, value: &serde_json::Value, out: &mut Vec<(String, f64)>) {
    match value {
        serde_json::Value::Number(n) => {
            if let Some(x) = n.as_f64() {
                out.push((tag.to_string(), x));
            }
        }
        serde_json::Value::Object(fields) => {
            for (key, value) in fields {
                collect(&format!("{tag}/{key}"), value, out);
            }
        }
        _ => {}
    }
}

/// An `Event` starting with `wall_time` (field 1, a double) and `step` (field 2, an int64).
fn event_header(wall_time: f64, step: i64) -> Vec<u8> {
    let mut event = vec![(1 << 3) | 1];
    event.extend_from_slice(&wall_time.to_le_bytes());
    event.push(2 << 3);
    put_varint(&mut event, step as u64);
    event
}

/// A length-delimited field (wire type 2): strings and embedded messages.
fn put_bytes(out: &mut Vec<u8>, field: u8, bytes: &[u8]) {
    out.push((field << 3) | 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// TFRecord's checksum: CRC-32C, rotated and offset so a CRC of CRCs does not collide.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// Seconds since the Unix epoch, as TensorBoard's `wall_time`.
pub fn unix_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn hostname() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_default();
    let name: String = name
        .trim()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
        .collect();
    match name.is_empty() {
        true => "localhost".into(),
        false => name,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_crc_matches_tensorflows_known_value() {
        // CRC-32C of "123456789" is 0xe3069283 (RFC 3720's check value); TFRecord's mask,
        // ((crc >> 15) | (crc << 17)) + 0xa282ead8, makes it 0xc78ab0e5.
        assert_eq!(masked_crc(b"123456789"), 0xc78a_b0e5);
    }

    #[test]
    fn varints_and_scalars_are_encoded_as_protobuf() {
        let mut v = Vec::new();
        put_varint(&mut v, 300);
        assert_eq!(v, [0xac, 0x02]);
        let row = serde_json::json!({"step": 3, "loss": 2.5, "note": "x", "aux": {"balance": 1}});
        let mut s = scalars_of(&row);
        s.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            s,
            [("aux/balance".to_string(), 1.0), ("loss".to_string(), 2.5)]
        );
    }
}

// The example reward in AssemblyScript (stub runtime, no imports): 1.0 when the last number in
// the completion equals metadata.answer, plus 0.1 when it contains "Answer:".
// Exports the core-module ABI v1: memory, alloc, score, details_ptr, details_len.

// Allocation: fresh pages at the end of memory (each call runs in a fresh instance).
export function alloc(len: i32): i32 {
  const pages = (len + 65535) >>> 16;
  const old = memory.grow(pages);
  if (old < 0) unreachable();
  return old << 16;
}

function isDigit(c: u8): bool {
  return c >= 48 && c <= 57;
}

function isWs(c: u8): bool {
  return c == 32 || c == 9 || c == 10 || c == 13;
}

function byte(p: i32, i: i32): u8 {
  return load<u8>(<usize>(p + i));
}

// Index of the ASCII `needle` in bytes [p, p+n), or -1.
function find(p: i32, n: i32, needle: string): i32 {
  const m = needle.length;
  for (let i = 0; i + m <= n; i++) {
    let j = 0;
    while (j < m && <i32>byte(p, i + j) == needle.charCodeAt(j)) j++;
    if (j == m) return i;
  }
  return -1;
}

let numStart: i32 = 0;
let ansStart: i32 = 0;

// Length of the last number in [p, p+n) (its start in numStart), or 0.
function lastNumber(p: i32, n: i32): i32 {
  let end = n - 1;
  while (end >= 0 && !isDigit(byte(p, end))) end--;
  if (end < 0) return 0;
  let b = end;
  while (b > 0 && (isDigit(byte(p, b - 1)) || (byte(p, b - 1) == 46 && isDigit(byte(p, b))))) b--;
  if (byte(p, b) == 46) b++;
  if (b > 0 && byte(p, b - 1) == 45) b--;
  numStart = b;
  return end - b + 1;
}

// Length of the "answer" field's value in the JSON [p, p+n) (its start in ansStart), or -1.
function answerField(p: i32, n: i32): i32 {
  const k = find(p, n, '"answer"');
  if (k < 0) return -1;
  let i = k + 8;
  while (i < n && isWs(byte(p, i))) i++;
  if (i >= n || byte(p, i) != 58) return -1;
  i++;
  while (i < n && isWs(byte(p, i))) i++;
  if (i < n && byte(p, i) == 34) {
    const b = i + 1;
    let e = b;
    while (e < n && byte(p, e) != 34) e++;
    if (e >= n) return -1;
    ansStart = b;
    return e - b;
  }
  const b = i;
  while (i < n) {
    const c = byte(p, i);
    if (isWs(c) || c == 44 || c == 125 || c == 93) break;
    i++;
  }
  if (i == b) return -1;
  ansStart = b;
  return i - b;
}

const YES = memory.data<u8>([123, 34, 99, 111, 114, 114, 101, 99, 116, 34, 58, 116, 114, 117, 101, 125]);
const NO = memory.data<u8>([123, 34, 99, 111, 114, 114, 101, 99, 116, 34, 58, 102, 97, 108, 115, 101, 125]);
let detailsPtr: usize = NO;
let detailsLen: i32 = 17;

export function score(pp: i32, pl: i32, cp: i32, cl: i32, mp: i32, ml: i32): f64 {
  const nl = lastNumber(cp, cl);
  const al = answerField(mp, ml);
  let correct = nl > 0 && al == nl;
  for (let i = 0; correct && i < nl; i++) correct = byte(cp, numStart + i) == byte(mp, ansStart + i);
  detailsPtr = correct ? YES : NO;
  detailsLen = correct ? 16 : 17;
  const bonus: f64 = find(cp, cl, "Answer:") >= 0 ? 0.1 : 0.0;
  return (correct ? 1.0 : 0.0) + bonus;
}

export function details_ptr(): i32 {
  return <i32>detailsPtr;
}

export function details_len(): i32 {
  return detailsLen;
}

export function anneal_reward_abi(): i32 {
  return 1;
}

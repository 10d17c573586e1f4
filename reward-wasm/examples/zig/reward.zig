//! The example reward in Zig (wasm32-freestanding, no std): 1.0 when the last number in the
//! completion equals metadata.answer, plus 0.1 when it contains "Answer:".
//! Exports the core-module ABI v1: memory, alloc, score, details_ptr, details_len.

/// Allocation: fresh pages at the end of memory (each call runs in a fresh instance).
export fn alloc(len: i32) i32 {
    const pages: usize = (@as(usize, @intCast(len)) + 65535) / 65536;
    const old = @wasmMemoryGrow(0, pages);
    if (old < 0) unreachable;
    return @intCast(old * 65536);
}

fn isDigit(c: u8) bool {
    return c >= '0' and c <= '9';
}

fn isWs(c: u8) bool {
    return c == ' ' or c == '\t' or c == '\n' or c == '\r';
}

fn find(hay: []const u8, needle: []const u8) ?usize {
    if (needle.len > hay.len) return null;
    var i: usize = 0;
    while (i + needle.len <= hay.len) : (i += 1) {
        var j: usize = 0;
        while (j < needle.len and hay[i + j] == needle[j]) j += 1;
        if (j == needle.len) return i;
    }
    return null;
}

fn lastNumber(s: []const u8) ?[]const u8 {
    var end: usize = s.len;
    while (end > 0 and !isDigit(s[end - 1])) end -= 1;
    if (end == 0) return null;
    var b: usize = end - 1;
    while (b > 0 and (isDigit(s[b - 1]) or (s[b - 1] == '.' and isDigit(s[b])))) b -= 1;
    if (s[b] == '.') b += 1;
    if (b > 0 and s[b - 1] == '-') b -= 1;
    return s[b..end];
}

fn answerField(j: []const u8) ?[]const u8 {
    const key = "\"answer\"";
    var i = (find(j, key) orelse return null) + key.len;
    while (i < j.len and isWs(j[i])) i += 1;
    if (i >= j.len or j[i] != ':') return null;
    i += 1;
    while (i < j.len and isWs(j[i])) i += 1;
    if (i < j.len and j[i] == '"') {
        const b = i + 1;
        var e = b;
        while (e < j.len and j[e] != '"') e += 1;
        if (e >= j.len) return null;
        return j[b..e];
    }
    const b = i;
    while (i < j.len and !isWs(j[i]) and j[i] != ',' and j[i] != '}' and j[i] != ']') i += 1;
    if (i == b) return null;
    return j[b..i];
}

fn eql(a: []const u8, b: []const u8) bool {
    if (a.len != b.len) return false;
    for (a, b) |x, y| if (x != y) return false;
    return true;
}

fn slice(ptr: i32, len: i32) []const u8 {
    if (len <= 0) return &[_]u8{};
    const p: [*]const u8 = @ptrFromInt(@as(usize, @intCast(ptr)));
    return p[0..@intCast(len)];
}

const yes = "{\"correct\":true}";
const no = "{\"correct\":false}";
var details: []const u8 = no;

export fn score(pp: i32, pl: i32, cp: i32, cl: i32, mp: i32, ml: i32) f64 {
    _ = pp;
    _ = pl;
    const c = slice(cp, cl);
    const m = slice(mp, ml);
    var correct = false;
    if (lastNumber(c)) |got| {
        if (answerField(m)) |want| correct = eql(got, want);
    }
    details = if (correct) yes else no;
    const bonus: f64 = if (find(c, "Answer:") != null) 0.1 else 0.0;
    return (if (correct) @as(f64, 1.0) else 0.0) + bonus;
}

export fn details_ptr() i32 {
    return @intCast(@intFromPtr(details.ptr));
}

export fn details_len() i32 {
    return @intCast(details.len);
}

export fn anneal_reward_abi() i32 {
    return 1;
}

//! The calculator environment in Zig (see ENVIRONMENTS.md and envs/calculator): the question
//! as the user message, a `calculator` tool evaluating integer expressions exactly in i128
//! (overflow and division by zero are error texts), reward 1 when the last integer of the
//! final answer equals the task's answer. Exports the core-module environment ABI v1.
//!
//! Memory: `alloc` takes from std.heap.wasm_allocator and the input is freed after its call;
//! the output buffer is reused from call to call.

const std = @import("std");
const gpa = std.heap.wasm_allocator;
const Value = std.json.Value;

var output: std.ArrayList(u8) = .empty;
var answer: []u8 = &.{};

const tool =
    \\{"type":"function","function":{"name":"calculator","description":"Evaluates an integer arithmetic expression exactly.","parameters":{"type":"object","properties":{"expression":{"type":"string","description":"an integer expression, e.g. (12+3)*4"}},"required":["expression"]}}}
;

export fn alloc(len: i32) i32 {
    const buf = gpa.alloc(u8, @intCast(@max(len, 0))) catch unreachable;
    return @intCast(@intFromPtr(buf.ptr));
}

export fn output_ptr() i32 {
    return @intCast(@intFromPtr(output.items.ptr));
}

export fn output_len() i32 {
    return @intCast(output.items.len);
}

export fn anneal_env_abi() i32 {
    return 1;
}

export fn env_close() void {
    gpa.free(answer);
    answer = &.{};
}

fn input(ptr: i32, len: i32) []u8 {
    const p: [*]u8 = @ptrFromInt(@as(usize, @intCast(ptr)));
    return p[0..@intCast(@max(len, 0))];
}

fn out(s: []const u8) void {
    output.appendSlice(gpa, s) catch unreachable;
}

/// `s` as a JSON string, quotes included.
fn outString(s: []const u8) void {
    out("\"");
    for (s) |c| switch (c) {
        '"' => out("\\\""),
        '\\' => out("\\\\"),
        '\n' => out("\\n"),
        0...9, 11...31 => {
            var buf: [6]u8 = undefined;
            out(std.fmt.bufPrint(&buf, "\\u{x:0>4}", .{c}) catch unreachable);
        },
        else => out(&[_]u8{c}),
    };
    out("\"");
}

fn outInt(v: i128) void {
    var buf: [48]u8 = undefined;
    out(std.fmt.bufPrint(&buf, "{d}", .{v}) catch unreachable);
}

/// Runs `f` on the call's input (freed afterwards): status 0 with its JSON, or 1 with the error.
fn run(ptr: i32, len: i32, f: *const fn (Value) anyerror!void) i32 {
    const text = input(ptr, len);
    defer gpa.free(text);
    output.clearRetainingCapacity();
    const parsed = std.json.parseFromSlice(Value, gpa, text, .{}) catch |e| {
        out("the input is not valid JSON: ");
        out(@errorName(e));
        return 1;
    };
    defer parsed.deinit();
    f(parsed.value) catch |e| {
        output.clearRetainingCapacity();
        out(switch (e) {
            error.NoQuestion => "the task has no string `question`",
            error.NoAnswer => "the task has no `answer`",
            else => @errorName(e),
        });
        return 1;
    };
    return 0;
}

fn field(v: Value, key: []const u8) ?Value {
    return switch (v) {
        .object => |o| o.get(key),
        else => null,
    };
}

fn str(v: ?Value) ?[]const u8 {
    return switch (v orelse return null) {
        .string, .number_string => |s| s,
        else => null,
    };
}

export fn env_init(ptr: i32, len: i32) i32 {
    return run(ptr, len, init);
}

fn init(task: Value) !void {
    const question = switch (field(task, "question") orelse return error.NoQuestion) {
        .string => |s| s,
        else => return error.NoQuestion,
    };
    var buf: [48]u8 = undefined;
    const a = switch (field(task, "answer") orelse return error.NoAnswer) {
        .string, .number_string => |s| s,
        .integer => |i| std.fmt.bufPrint(&buf, "{d}", .{i}) catch unreachable,
        else => return error.NoAnswer,
    };
    gpa.free(answer);
    answer = try gpa.dupe(u8, std.mem.trim(u8, a, " "));
    out("{\"messages\":[{\"role\":\"user\",\"content\":");
    outString(question);
    out("}],\"tools\":[" ++ tool ++ "]}");
}

export fn env_step(ptr: i32, len: i32) i32 {
    return run(ptr, len, step);
}

fn step(turn: Value) !void {
    const calls: []const Value = switch (field(turn, "tool_calls") orelse Value.null) {
        .array => |a| a.items,
        else => &.{},
    };
    if (calls.len == 0) {
        if (str(field(turn, "error"))) |e| {
            const text = try std.fmt.allocPrint(gpa, "error: {s}", .{e});
            defer gpa.free(text);
            out("{\"observation\":");
            outString(text);
            out(",\"done\":false}");
            return;
        }
        const ok = correct(str(field(turn, "content")) orelse "");
        out(if (ok)
            "{\"observation\":\"\",\"reward\":1.0,\"done\":true,\"details\":{\"correct\":true}}"
        else
            "{\"observation\":\"\",\"reward\":0.0,\"done\":true,\"details\":{\"correct\":false}}");
        return;
    }
    var obs: std.ArrayList(u8) = .empty;
    defer obs.deinit(gpa);
    for (calls, 0..) |c, k| {
        if (calls.len > 1) {
            if (k > 0) try obs.append(gpa, '\n');
            try obs.appendSlice(gpa, str(field(c, "id")) orelse "");
            try obs.appendSlice(gpa, ": ");
        }
        try call(&obs, c);
    }
    out("{\"observation\":");
    outString(obs.items);
    out(",\"done\":false}");
}

fn call(obs: *std.ArrayList(u8), c: Value) !void {
    const name = str(field(c, "name")) orelse "";
    if (!std.mem.eql(u8, name, "calculator")) {
        try obs.appendSlice(gpa, "error: unknown tool `");
        try obs.appendSlice(gpa, name);
        try obs.appendSlice(gpa, "` (the tool is `calculator`)");
        return;
    }
    const expression = str(field(field(c, "arguments") orelse Value.null, "expression")) orelse {
        try obs.appendSlice(gpa, "error: calculator takes {\"expression\": string}");
        return;
    };
    var e = Expr{ .s = expression };
    var buf: [64]u8 = undefined;
    if (e.evaluate()) |v| {
        try obs.appendSlice(gpa, try std.fmt.bufPrint(&buf, "{d}", .{v}));
    } else |err| {
        try obs.appendSlice(gpa, "error: ");
        try obs.appendSlice(gpa, switch (err) {
            error.Overflow => "overflow",
            error.DivisionByZero => "division by zero",
            error.TooDeep => "expression nested too deeply",
            error.End => "unexpected end of expression",
            error.Unexpected => try std.fmt.bufPrint(&buf, "unexpected `{c}` at {d}", .{ e.s[e.i], e.i }),
            error.Paren => try std.fmt.bufPrint(&buf, "expected `)` at {d}", .{e.i}),
        });
    }
}

/// The last integer of `s` (ASCII digits, with a `-` right before them) equals the answer.
fn correct(s: []const u8) bool {
    var end = s.len;
    while (end > 0 and !std.ascii.isDigit(s[end - 1])) end -= 1;
    if (end == 0) return false;
    var start = end;
    while (start > 0 and std.ascii.isDigit(s[start - 1])) start -= 1;
    if (start > 0 and s[start - 1] == '-') start -= 1;
    const n = s[start..end];
    const a = std.fmt.parseInt(i128, n, 10) catch return std.mem.eql(u8, n, answer);
    const b = std.fmt.parseInt(i128, answer, 10) catch return std.mem.eql(u8, n, answer);
    return a == b;
}

const Error = error{ Overflow, DivisionByZero, TooDeep, End, Unexpected, Paren };

/// An integer expression over `s`: sums of products of unary terms.
const Expr = struct {
    s: []const u8,
    i: usize = 0,
    depth: usize = 0,

    fn evaluate(e: *Expr) Error!i128 {
        const v = try e.sum();
        if (e.peek() != null) return error.Unexpected;
        return v;
    }

    fn peek(e: *Expr) ?u8 {
        while (e.i < e.s.len and std.ascii.isWhitespace(e.s[e.i])) e.i += 1;
        return if (e.i < e.s.len) e.s[e.i] else null;
    }

    fn sum(e: *Expr) Error!i128 {
        var v = try e.product();
        while (e.peek()) |op| {
            if (op != '+' and op != '-') break;
            e.i += 1;
            const r = try e.product();
            const x = if (op == '+') @addWithOverflow(v, r) else @subWithOverflow(v, r);
            if (x[1] != 0) return error.Overflow;
            v = x[0];
        }
        return v;
    }

    fn product(e: *Expr) Error!i128 {
        var v = try e.unary();
        while (e.peek()) |op| {
            if (op != '*' and op != '/' and op != '%') break;
            e.i += 1;
            const r = try e.unary();
            if (op == '*') {
                const x = @mulWithOverflow(v, r);
                if (x[1] != 0) return error.Overflow;
                v = x[0];
            } else {
                if (r == 0) return error.DivisionByZero;
                if (v == std.math.minInt(i128) and r == -1) return error.Overflow;
                v = if (op == '/') @divTrunc(v, r) else @rem(v, r);
            }
        }
        return v;
    }

    fn unary(e: *Expr) Error!i128 {
        e.depth += 1;
        defer e.depth -= 1;
        if (e.depth > 200) return error.TooDeep;
        const c = e.peek() orelse return error.End;
        switch (c) {
            '-' => {
                e.i += 1;
                const v = try e.unary();
                if (v == std.math.minInt(i128)) return error.Overflow;
                return -v;
            },
            '+' => {
                e.i += 1;
                return e.unary();
            },
            '(' => {
                e.i += 1;
                const v = try e.sum();
                if (e.peek() != ')') return error.Paren;
                e.i += 1;
                return v;
            },
            '0'...'9' => {
                const start = e.i;
                while (e.i < e.s.len and std.ascii.isDigit(e.s[e.i])) e.i += 1;
                return std.fmt.parseInt(i128, e.s[start..e.i], 10) catch error.Overflow;
            },
            else => return error.Unexpected,
        }
    }
};

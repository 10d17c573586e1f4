//! The calculator environment in Zig (see ENVIRONMENTS.md and envs/calculator): the question
//! as the user message, a `calculator` tool evaluating integer expressions exactly in i128
//! (overflow and division by zero are error texts), reward 1 when the last integer of the
//! final answer equals the task's answer. Exports the core-module environment ABI v1.
//!
//! Built on the Zig SDK (sdk/zig/anneal_env.zig), which exports the ABI.

const std = @import("std");
const env = @import("anneal_env");
const gpa = env.gpa;
const Value = env.Value;
const str = env.str;
const field = env.field;

const tool =
    \\[{"type":"function","function":{"name":"calculator","description":"Evaluates an integer arithmetic expression exactly.","parameters":{"type":"object","properties":{"expression":{"type":"string","description":"an integer expression, e.g. (12+3)*4"}},"required":["expression"]}}}]
;

const Calculator = struct {
    answer: []u8,

    pub fn init(task: Value) anyerror!Calculator {
        const question = switch (field(task, "question") orelse Value.null) {
            .string => |s| s,
            else => return env.fail("the task has no string `question`"),
        };
        var buf: [48]u8 = undefined;
        const a = switch (field(task, "answer") orelse Value.null) {
            .string, .number_string => |s| s,
            .integer => |i| std.fmt.bufPrint(&buf, "{d}", .{i}) catch unreachable,
            else => return env.fail("the task has no `answer`"),
        };
        env.start(question, tool);
        return .{ .answer = try gpa.dupe(u8, std.mem.trim(u8, a, " ")) };
    }

    pub fn deinit(self: *Calculator) void {
        gpa.free(self.answer);
    }

    pub fn step(self: *Calculator, turn: env.Turn) anyerror!void {
        if (turn.tool_calls.len == 0) {
            if (turn.err) |e| {
                const text = try std.fmt.allocPrint(gpa, "error: {s}", .{e});
                defer gpa.free(text);
                return env.outcome(.{ .observation = text });
            }
            const ok = correct(turn.content, self.answer);
            return env.outcome(.{
                .reward = if (ok) 1.0 else 0.0,
                .done = true,
                .details = if (ok) "{\"correct\":true}" else "{\"correct\":false}",
            });
        }
        var obs: std.ArrayList(u8) = .empty;
        defer obs.deinit(gpa);
        for (0..turn.tool_calls.len) |k| {
            const c = turn.call(k);
            if (turn.tool_calls.len > 1) {
                if (k > 0) try obs.append(gpa, '\n');
                try obs.appendSlice(gpa, c.id);
                try obs.appendSlice(gpa, ": ");
            }
            try call(&obs, c);
        }
        env.outcome(.{ .observation = obs.items });
    }
};

comptime {
    env.exportEnvironment(Calculator);
}

fn call(obs: *std.ArrayList(u8), c: env.ToolCall) !void {
    if (!std.mem.eql(u8, c.name, "calculator")) {
        try obs.appendSlice(gpa, "error: unknown tool `");
        try obs.appendSlice(gpa, c.name);
        try obs.appendSlice(gpa, "` (the tool is `calculator`)");
        return;
    }
    const expression = str(field(c.arguments, "expression")) orelse {
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
fn correct(s: []const u8, answer: []const u8) bool {
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

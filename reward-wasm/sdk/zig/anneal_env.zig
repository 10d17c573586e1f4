//! Anneal RL environments in Zig (wasm32-freestanding): the core-module environment ABI v1 of
//! reward-wasm/ENVIRONMENTS.md.
//!
//! Write a type with
//!   `pub fn init(task: std.json.Value) anyerror!Env` (write the start with `start`),
//!   `pub fn step(self: *Env, turn: Turn) anyerror!void` (write the outcome with `outcome`),
//!   `pub fn deinit(self: *Env) void`,
//! and export it with `comptime { env.exportEnvironment(Env); }`. To fail a call with a message
//! (the host's `env_error`), `return env.fail("why")`.
//!
//! Memory: `alloc` takes from std.heap.wasm_allocator and the input is freed after its call;
//! the output buffer is reused from call to call; the parsed JSON of a call is freed after it.

const std = @import("std");
pub const gpa = std.heap.wasm_allocator;
pub const Value = std.json.Value;

var output: std.ArrayList(u8) = .empty;
var failed = false;

/// One tool call of a turn.
pub const ToolCall = struct {
    id: []const u8,
    name: []const u8,
    arguments: Value,
};

/// One policy turn.
pub const Turn = struct {
    text: []const u8,
    content: []const u8,
    tool_calls: []const Value,
    err: ?[]const u8,

    /// The tool call at `i` (`tool_calls[i]`).
    pub fn call(t: Turn, i: usize) ToolCall {
        const c = t.tool_calls[i];
        return .{
            .id = str(field(c, "id")) orelse "",
            .name = str(field(c, "name")) orelse "",
            .arguments = field(c, "arguments") orelse Value.null,
        };
    }
};

/// The field `key` of an object value.
pub fn field(v: Value, key: []const u8) ?Value {
    return switch (v) {
        .object => |o| o.get(key),
        else => null,
    };
}

/// The text of a string (or big number) value.
pub fn str(v: ?Value) ?[]const u8 {
    return switch (v orelse return null) {
        .string, .number_string => |s| s,
        else => null,
    };
}

/// Appends raw text to the call's output.
pub fn out(s: []const u8) void {
    output.appendSlice(gpa, s) catch unreachable;
}

/// Appends `s` as a JSON string, quotes included.
pub fn outString(s: []const u8) void {
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

/// Writes the init output: one user message `text`, and `tools` (a JSON list as text).
pub fn start(text: []const u8, tools: []const u8) void {
    out("{\"messages\":[{\"role\":\"user\",\"content\":");
    outString(text);
    out("}],\"tools\":");
    out(tools);
    out("}");
}

/// What a step returns.
pub const Outcome = struct {
    observation: []const u8 = "",
    reward: f64 = 0.0,
    done: bool = false,
    /// A JSON object as text.
    details: ?[]const u8 = null,
    role: ?[]const u8 = null,
};

/// Writes the step output.
pub fn outcome(o: Outcome) void {
    var buf: [64]u8 = undefined;
    out("{\"observation\":");
    outString(o.observation);
    out(std.fmt.bufPrint(&buf, ",\"reward\":{d},\"done\":{}", .{ o.reward, o.done }) catch unreachable);
    if (o.role) |r| {
        out(",\"role\":");
        outString(r);
    }
    if (o.details) |d| {
        out(",\"details\":");
        out(d);
    }
    out("}");
}

/// Fails the call with `message` (the host's `env_error`).
pub fn fail(message: []const u8) error{EnvError} {
    output.clearRetainingCapacity();
    out(message);
    failed = true;
    return error.EnvError;
}

fn input(ptr: i32, len: i32) []u8 {
    const p: [*]u8 = @ptrFromInt(@as(usize, @intCast(ptr)));
    return p[0..@intCast(@max(len, 0))];
}

/// Exports `Env` under the environment ABI v1 (call inside `comptime { }`).
pub fn exportEnvironment(comptime Env: type) void {
    const Abi = struct {
        var state: ?Env = null;

        fn alloc(len: i32) callconv(.c) i32 {
            const buf = gpa.alloc(u8, @intCast(@max(len, 0))) catch unreachable;
            return @intCast(@intFromPtr(buf.ptr));
        }

        fn outputPtr() callconv(.c) i32 {
            return @intCast(@intFromPtr(output.items.ptr));
        }

        fn outputLen() callconv(.c) i32 {
            return @intCast(output.items.len);
        }

        fn abi() callconv(.c) i32 {
            return 1;
        }

        fn close() callconv(.c) void {
            if (state) |*s| s.deinit();
            state = null;
            output.clearRetainingCapacity();
        }

        /// Runs `f` on the call's parsed input (both freed afterwards): status 0, or 1 with
        /// the error message as output.
        fn run(ptr: i32, len: i32, comptime f: fn (Value) anyerror!void) i32 {
            const text = input(ptr, len);
            defer gpa.free(text);
            output.clearRetainingCapacity();
            failed = false;
            const parsed = std.json.parseFromSlice(Value, gpa, text, .{}) catch |e| {
                out("the input is not valid JSON: ");
                out(@errorName(e));
                return 1;
            };
            defer parsed.deinit();
            f(parsed.value) catch |e| {
                if (!failed) {
                    output.clearRetainingCapacity();
                    out(@errorName(e));
                }
                return 1;
            };
            return 0;
        }

        fn initWith(task: Value) anyerror!void {
            close();
            state = try Env.init(task);
        }

        fn stepWith(v: Value) anyerror!void {
            const s = if (state) |*s| s else return fail("step before init");
            try s.step(.{
                .text = str(field(v, "text")) orelse "",
                .content = str(field(v, "content")) orelse "",
                .tool_calls = switch (field(v, "tool_calls") orelse Value.null) {
                    .array => |a| a.items,
                    else => &.{},
                },
                .err = str(field(v, "error")),
            });
        }

        fn envInit(ptr: i32, len: i32) callconv(.c) i32 {
            return run(ptr, len, initWith);
        }

        fn envStep(ptr: i32, len: i32) callconv(.c) i32 {
            return run(ptr, len, stepWith);
        }
    };
    @export(&Abi.alloc, .{ .name = "alloc" });
    @export(&Abi.envInit, .{ .name = "env_init" });
    @export(&Abi.envStep, .{ .name = "env_step" });
    @export(&Abi.close, .{ .name = "env_close" });
    @export(&Abi.outputPtr, .{ .name = "output_ptr" });
    @export(&Abi.outputLen, .{ .name = "output_len" });
    @export(&Abi.abi, .{ .name = "anneal_env_abi" });
}

// Anneal RL environments in freestanding C (clang --target=wasm32 -nostdlib, no libc):
// the core-module environment ABI v1 of reward-wasm/ENVIRONMENTS.md.
//
// Include this header in exactly one .c file and define:
//   int  anneal_env_init(const char *task, int len);  // the task JSON; write the init JSON
//   int  anneal_env_step(const char *turn, int len);  // the turn JSON; write the step JSON
//   void anneal_env_close(void);                      // the episode is over
// Each returns 0 after writing its JSON with the anneal_out_* functions, or
// `return anneal_error("why");`. The header defines the exports (alloc, env_init, env_step,
// env_close, output_ptr, output_len, anneal_env_abi).
//
// Memory: one input buffer, reused by every call (grown with memory.grow when an input is
// longer; the old one is then abandoned, so memory grows at most to twice the longest input);
// one static output buffer of ANNEAL_ENV_OUTPUT_MAX bytes (an output that does not fit is cut,
// and the host then reports invalid JSON). The input is only valid during its call.
//
// JSON: anneal_json_field / anneal_json_item find values in the raw text without copying;
// string values are left escaped, which is what anneal_out_raw_string writes back.
#ifndef ANNEAL_ENV_H
#define ANNEAL_ENV_H

#ifndef ANNEAL_ENV_OUTPUT_MAX
#define ANNEAL_ENV_OUTPUT_MAX 65536
#endif

#define ANNEAL_EXPORT(name) __attribute__((export_name(name)))

int anneal_env_init(const char *task, int len);
int anneal_env_step(const char *turn, int len);
void anneal_env_close(void);

// ---- Memory and exports -------------------------------------------------------------------

static char *anneal_in_buf;
static int anneal_in_cap;
static char anneal_out_buf[ANNEAL_ENV_OUTPUT_MAX];
static int anneal_out_n;

ANNEAL_EXPORT("alloc") int alloc(int len) {
    if (len <= anneal_in_cap) return (int)(long)anneal_in_buf;
    long pages = ((long)len + 65535) / 65536;
    long old = __builtin_wasm_memory_grow(0, pages);
    if (old < 0) __builtin_trap();
    anneal_in_buf = (char *)(old * 65536);
    anneal_in_cap = (int)(pages * 65536);
    return (int)(long)anneal_in_buf;
}

ANNEAL_EXPORT("env_init") int env_init(int ptr, int len) {
    anneal_out_n = 0;
    return anneal_env_init((const char *)(long)ptr, len);
}

ANNEAL_EXPORT("env_step") int env_step(int ptr, int len) {
    anneal_out_n = 0;
    return anneal_env_step((const char *)(long)ptr, len);
}

ANNEAL_EXPORT("env_close") void env_close(void) { anneal_env_close(); }

ANNEAL_EXPORT("output_ptr") int output_ptr(void) { return (int)(long)anneal_out_buf; }

ANNEAL_EXPORT("output_len") int output_len(void) { return anneal_out_n; }

ANNEAL_EXPORT("anneal_env_abi") int anneal_env_abi(void) { return 1; }

// ---- Output -------------------------------------------------------------------------------

static void anneal_out(const char *s, int n) {
    for (int i = 0; i < n && anneal_out_n < ANNEAL_ENV_OUTPUT_MAX; i++) anneal_out_buf[anneal_out_n++] = s[i];
}

static int anneal_strlen(const char *s) {
    int n = 0;
    while (s[n]) n++;
    return n;
}

__attribute__((unused)) static void anneal_out_cstr(const char *s) { anneal_out(s, anneal_strlen(s)); }

// A JSON string of raw text: quotes added, `"`, `\` and control characters escaped.
__attribute__((unused)) static void anneal_out_json_string(const char *s, int n) {
    static const char hex[] = "0123456789abcdef";
    anneal_out("\"", 1);
    for (int i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') {
            char e[2] = {'\\', (char)c};
            anneal_out(e, 2);
        } else if (c == '\n') {
            anneal_out("\\n", 2);
        } else if (c < 0x20) {
            char e[6] = {'\\', 'u', '0', '0', hex[c >> 4], hex[c & 15]};
            anneal_out(e, 6);
        } else {
            anneal_out((const char *)&c, 1);
        }
    }
    anneal_out("\"", 1);
}

// A JSON string whose content is already escaped (a string value found in the input).
__attribute__((unused)) static void anneal_out_raw_string(const char *s, int n) {
    anneal_out("\"", 1);
    anneal_out(s, n);
    anneal_out("\"", 1);
}

__attribute__((unused)) static void anneal_out_i64(long long v) {
    char digits[24];
    int n = 0;
    unsigned long long u = v < 0 ? 0ull - (unsigned long long)v : (unsigned long long)v;
    do {
        digits[n++] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0) anneal_out("-", 1);
    while (n) anneal_out(&digits[--n], 1);
}

// Writes `message` as the call's error; returns the nonzero status to return.
__attribute__((unused)) static int anneal_error(const char *message) {
    anneal_out_n = 0;
    anneal_out_cstr(message);
    return 1;
}

// ---- JSON reading -------------------------------------------------------------------------

static int anneal_ws(const char *s, int n, int i) {
    while (i < n && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) i++;
    return i;
}

// The index after the string starting at s[i] == '"', or -1.
static int anneal_skip_string(const char *s, int n, int i) {
    for (i++; i < n; i++) {
        if (s[i] == '\\') i++;
        else if (s[i] == '"') return i + 1;
    }
    return -1;
}

// The index after the JSON value starting at s[i] (after whitespace), or -1.
static int anneal_skip_value(const char *s, int n, int i) {
    i = anneal_ws(s, n, i);
    if (i >= n) return -1;
    if (s[i] == '"') return anneal_skip_string(s, n, i);
    if (s[i] == '{' || s[i] == '[') {
        int depth = 0;
        while (i < n) {
            char c = s[i];
            if (c == '"') {
                i = anneal_skip_string(s, n, i);
                if (i < 0) return -1;
                continue;
            }
            if (c == '{' || c == '[') depth++;
            if (c == '}' || c == ']') {
                if (--depth == 0) return i + 1;
            }
            i++;
        }
        return -1;
    }
    while (i < n && s[i] != ',' && s[i] != '}' && s[i] != ']' && s[i] != ' ' && s[i] != '\n') i++;
    return i;
}

// The raw value of top-level field `key` of the object s[0..n): sets [*vs, *ve) and returns 1,
// or returns 0.
__attribute__((unused)) static int anneal_json_field(const char *s, int n, const char *key, int *vs, int *ve) {
    int klen = anneal_strlen(key);
    int i = anneal_ws(s, n, 0);
    if (i >= n || s[i] != '{') return 0;
    i++;
    for (;;) {
        i = anneal_ws(s, n, i);
        if (i >= n || s[i] != '"') return 0;
        int ks = i + 1, ke = anneal_skip_string(s, n, i);
        if (ke < 0) return 0;
        i = anneal_ws(s, n, ke);
        if (i >= n || s[i] != ':') return 0;
        int start = anneal_ws(s, n, i + 1), end = anneal_skip_value(s, n, start);
        if (end < 0) return 0;
        int match = ke - 1 - ks == klen;
        for (int k = 0; match && k < klen; k++) match = s[ks + k] == key[k];
        if (match) {
            *vs = start;
            *ve = end;
            return 1;
        }
        i = anneal_ws(s, n, end);
        if (i >= n || s[i] != ',') return 0;
        i++;
    }
}

// The next item of the array s[0..n) after *pos (0 to start): sets [*vs, *ve), returns 1, or 0
// at the end.
__attribute__((unused)) static int anneal_json_item(const char *s, int n, int *pos, int *vs, int *ve) {
    int i = anneal_ws(s, n, *pos);
    if (i >= n) return 0;
    if (*pos == 0) {
        if (s[i] != '[') return 0;
        i = anneal_ws(s, n, i + 1);
    } else if (s[i] == ',') {
        i = anneal_ws(s, n, i + 1);
    }
    if (i >= n || s[i] == ']') return 0;
    int end = anneal_skip_value(s, n, i);
    if (end < 0) return 0;
    *vs = i;
    *ve = end;
    *pos = end;
    return 1;
}

// A string field's content (still escaped, without quotes): returns 1, or 0 when the field is
// missing or not a string.
__attribute__((unused)) static int anneal_json_string(const char *s, int n, const char *key, int *cs, int *ce) {
    int vs, ve;
    if (!anneal_json_field(s, n, key, &vs, &ve) || s[vs] != '"') return 0;
    *cs = vs + 1;
    *ce = ve - 1;
    return 1;
}

#endif

// The example reward in freestanding C (clang --target=wasm32, no libc): 1.0 when the last
// number in the completion equals metadata.answer, plus 0.1 when it contains "Answer:".
// Exports the core-module ABI v1: memory, alloc, score, details_ptr, details_len.

typedef unsigned long size_t;

#define EXPORT(name) __attribute__((export_name(name)))

// Allocation: fresh pages at the end of memory (each call runs in a fresh instance).
EXPORT("alloc") int alloc(int len) {
    size_t pages = ((size_t)len + 65535) / 65536;
    long old = __builtin_wasm_memory_grow(0, pages);
    if (old < 0) __builtin_trap();
    return (int)(old * 65536);
}

static int is_digit(char c) { return c >= '0' && c <= '9'; }
static int is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// Index of `needle` in `hay`, or -1.
static int find(const char *hay, int n, const char *needle, int m) {
    for (int i = 0; i + m <= n; i++) {
        int j = 0;
        while (j < m && hay[i + j] == needle[j]) j++;
        if (j == m) return i;
    }
    return -1;
}

// The last number of `s`: sets *start and returns its length, or 0 if there is none.
static int last_number(const char *s, int n, int *start) {
    int end = n - 1;
    while (end >= 0 && !is_digit(s[end])) end--;
    if (end < 0) return 0;
    int b = end;
    while (b > 0 && (is_digit(s[b - 1]) || (s[b - 1] == '.' && is_digit(s[b])))) b--;
    if (s[b] == '.') b++;
    if (b > 0 && s[b - 1] == '-') b--;
    *start = b;
    return end - b + 1;
}

// The value of the top-level "answer" field: sets *start and returns its length, or -1.
static int answer_field(const char *j, int n, int *start) {
    int k = find(j, n, "\"answer\"", 8);
    if (k < 0) return -1;
    int i = k + 8;
    while (i < n && is_ws(j[i])) i++;
    if (i >= n || j[i] != ':') return -1;
    i++;
    while (i < n && is_ws(j[i])) i++;
    if (i < n && j[i] == '"') {
        int b = i + 1, e = b;
        while (e < n && j[e] != '"') e++;
        if (e >= n) return -1;
        *start = b;
        return e - b;
    }
    int b = i;
    while (i < n && !is_ws(j[i]) && j[i] != ',' && j[i] != '}' && j[i] != ']') i++;
    if (i == b) return -1;
    *start = b;
    return i - b;
}

static const char *details = "{\"correct\":false}";
static int details_n = 17;

EXPORT("score")
double score(const char *p, int pl, const char *c, int cl, const char *m, int ml) {
    (void)p; (void)pl;
    int ns = 0, as = 0;
    int nl = last_number(c, cl, &ns);
    int al = answer_field(m, ml, &as);
    int correct = nl > 0 && al == nl;
    for (int i = 0; correct && i < nl; i++) correct = c[ns + i] == m[as + i];
    if (correct) { details = "{\"correct\":true}"; details_n = 16; }
    double bonus = find(c, cl, "Answer:", 7) >= 0 ? 0.1 : 0.0;
    return (correct ? 1.0 : 0.0) + bonus;
}

EXPORT("details_ptr") int details_ptr(void) { return (int)(size_t)details; }
EXPORT("details_len") int details_len(void) { return details_n; }
EXPORT("anneal_reward_abi") int anneal_reward_abi(void) { return 1; }

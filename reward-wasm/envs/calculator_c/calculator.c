// The calculator environment in freestanding C (see ENVIRONMENTS.md and envs/calculator): the
// question as the user message, a `calculator` tool evaluating integer expressions exactly
// (here in 64-bit integers: overflow and division by zero are error texts), reward 1 when the
// last integer of the final answer equals the task's answer.
#include "../../sdk/c/anneal_env.h"

#define MAX_I64 9223372036854775807LL
#define MIN_I64 (-MAX_I64 - 1)

static char answer[64];
static int answer_len;

static const char TOOL[] =
    "{\"type\":\"function\",\"function\":{\"name\":\"calculator\",\"description\":\"Evaluates an "
    "integer arithmetic expression exactly.\",\"parameters\":{\"type\":\"object\",\"properties\":"
    "{\"expression\":{\"type\":\"string\",\"description\":\"an integer expression, e.g. "
    "(12+3)*4\"}},\"required\":[\"expression\"]}}}";

int anneal_env_init(const char *task, int len) {
    int qs, qe, as, ae;
    if (!anneal_json_string(task, len, "question", &qs, &qe))
        return anneal_error("the task has no string `question`");
    if (!anneal_json_field(task, len, "answer", &as, &ae)) return anneal_error("the task has no `answer`");
    if (task[as] == '"') as++, ae--;
    if (ae - as > (int)sizeof answer) return anneal_error("the task's `answer` is too long");
    answer_len = 0;
    for (int i = as; i < ae; i++) answer[answer_len++] = task[i];
    anneal_out_cstr("{\"messages\":[{\"role\":\"user\",\"content\":");
    anneal_out_raw_string(task + qs, qe - qs);
    anneal_out_cstr("}],\"tools\":[");
    anneal_out_cstr(TOOL);
    anneal_out_cstr("]}");
    return 0;
}

void anneal_env_close(void) {}

// ---- The expression evaluator: a recursive descent over s[0..n) ---------------------------

typedef struct {
    const char *s;
    int n, i, depth;
    const char *error;  // set on the first error
    char bad;           // the unexpected character, when the error names one
    int at;
} Expr;

static int fail(Expr *e, const char *why) {
    if (!e->error) e->error = why, e->at = e->i;
    return 0;
}

static char peek(Expr *e) {
    while (e->i < e->n && (e->s[e->i] == ' ' || e->s[e->i] == '\t' || e->s[e->i] == '\n')) e->i++;
    return e->i < e->n ? e->s[e->i] : 0;
}

static int checked(Expr *e, char op, long long a, long long b, long long *r) {
    unsigned long long ua = (unsigned long long)a, ub = (unsigned long long)b;
    switch (op) {
    case '+':
        if ((b > 0 && a > MAX_I64 - b) || (b < 0 && a < MIN_I64 - b)) return fail(e, "overflow");
        *r = (long long)(ua + ub);
        return 1;
    case '-':
        if ((b < 0 && a > MAX_I64 + b) || (b > 0 && a < MIN_I64 + b)) return fail(e, "overflow");
        *r = (long long)(ua - ub);
        return 1;
    case '*':
        if (a == 0 || b == 0) return *r = 0, 1;
        // CERT INT32-C: bounds by division (a check after the product would compile to a
        // 128-bit multiply, which needs compiler-rt).
        if (a > 0 ? (b > 0 ? a > MAX_I64 / b : b < MIN_I64 / a)
                  : (b > 0 ? a < MIN_I64 / b : b < MAX_I64 / a))
            return fail(e, "overflow");
        *r = (long long)(ua * ub);
        return 1;
    default:  // '/' and '%'
        if (b == 0) return fail(e, "division by zero");
        if (a == MIN_I64 && b == -1) return fail(e, "overflow");
        *r = op == '/' ? a / b : a % b;
        return 1;
    }
}

static int sum(Expr *e, long long *v);

static int unary(Expr *e, long long *v) {
    if (++e->depth > 200) return fail(e, "expression nested too deeply");
    char c = peek(e);
    int ok = 1;
    if (c == '-' || c == '+') {
        e->i++;
        ok = unary(e, v) && (c == '+' || checked(e, '-', 0, *v, v));
    } else if (c == '(') {
        e->i++;
        ok = sum(e, v);
        if (ok && peek(e) != ')') ok = fail(e, "expected `)`");
        if (ok) e->i++;
    } else if (c >= '0' && c <= '9') {
        *v = 0;
        while (ok && e->i < e->n && e->s[e->i] >= '0' && e->s[e->i] <= '9')
            ok = checked(e, '*', *v, 10, v) && checked(e, '+', *v, e->s[e->i++] - '0', v);
    } else if (c) {
        e->bad = c;
        ok = fail(e, "unexpected");
    } else {
        ok = fail(e, "unexpected end of expression");
    }
    e->depth--;
    return ok;
}

static int product(Expr *e, long long *v) {
    if (!unary(e, v)) return 0;
    for (char op; (op = peek(e)) == '*' || op == '/' || op == '%';) {
        long long r;
        e->i++;
        if (!unary(e, &r) || !checked(e, op, *v, r, v)) return 0;
    }
    return 1;
}

static int sum(Expr *e, long long *v) {
    if (!product(e, v)) return 0;
    for (char op; (op = peek(e)) == '+' || op == '-';) {
        long long r;
        e->i++;
        if (!product(e, &r) || !checked(e, op, *v, r, v)) return 0;
    }
    return 1;
}

// Writes the value of s[0..n) (JSON-escaped text) or "error: ...", as observation text.
static void evaluate(const char *s, int n) {
    Expr e = {s, n, 0, 0, 0, 0, 0};
    long long v;
    if (sum(&e, &v) && peek(&e)) {
        e.bad = s[e.i];
        fail(&e, "unexpected");
    }
    if (!e.error) return anneal_out_i64(v);
    anneal_out_cstr("error: ");
    anneal_out_cstr(e.error);
    if (e.bad) {
        anneal_out_cstr(" `");
        anneal_out(&e.bad, 1);
        anneal_out_cstr("`");
    }
    if (e.bad || (e.error[0] == 'e' && e.error[1] == 'x')) {
        anneal_out_cstr(" at ");
        anneal_out_i64(e.at);
    }
}

// ---- Steps ---------------------------------------------------------------------------------

// One tool call's result, written as observation text.
static void call(const char *c, int n) {
    int ns, ne, xs, xe, as, ae;
    if (!anneal_json_string(c, n, "name", &ns, &ne)) ns = ne = 0;
    const char *name = "calculator";
    int match = ne - ns == 10;
    for (int k = 0; match && k < 10; k++) match = c[ns + k] == name[k];
    if (!match) {
        anneal_out_cstr("error: unknown tool `");
        anneal_out(c + ns, ne - ns);
        anneal_out_cstr("` (the tool is `calculator`)");
        return;
    }
    if (!anneal_json_field(c, n, "arguments", &as, &ae) ||
        !anneal_json_string(c + as, ae - as, "expression", &xs, &xe)) {
        anneal_out_cstr("error: calculator takes {\\\"expression\\\": string}");
        return;
    }
    evaluate(c + as + xs, xe - xs);
}

// The last integer of s[0..n) (ASCII digits, with a `-` right before them) equals the answer.
static int correct(const char *s, int n) {
    int end = n;
    while (end > 0 && !(s[end - 1] >= '0' && s[end - 1] <= '9')) end--;
    if (end == 0) return 0;
    int start = end;
    while (start > 0 && s[start - 1] >= '0' && s[start - 1] <= '9') start--;
    if (start > 0 && s[start - 1] == '-') start--;
    // As integers when both parse (leading zeros and "+" aside, the texts then compare).
    Expr a = {s + start, end - start, 0, 0, 0, 0, 0}, b = {answer, answer_len, 0, 0, 0, 0, 0};
    long long x, y;
    if (unary(&a, &x) && a.i == a.n && unary(&b, &y) && peek(&b) == 0) return x == y;
    if (end - start != answer_len) return 0;
    for (int i = 0; i < answer_len; i++)
        if (s[start + i] != answer[i]) return 0;
    return 1;
}

int anneal_env_step(const char *turn, int len) {
    int ts, te, vs, ve, pos = 0, count = 0;
    int has_calls = anneal_json_field(turn, len, "tool_calls", &ts, &te) &&
                    anneal_json_item(turn + ts, te - ts, &pos, &vs, &ve);
    if (!has_calls) {
        int es, ee, cs, ce;
        if (anneal_json_string(turn, len, "error", &es, &ee)) {
            anneal_out_cstr("{\"observation\":\"error: ");
            anneal_out(turn + es, ee - es);
            anneal_out_cstr("\",\"done\":false}");
            return 0;
        }
        if (!anneal_json_string(turn, len, "content", &cs, &ce)) cs = ce = 0;
        int ok = correct(turn + cs, ce - cs);
        anneal_out_cstr(ok ? "{\"observation\":\"\",\"reward\":1.0,\"done\":true,\"details\":{\"correct\":true}}"
                           : "{\"observation\":\"\",\"reward\":0.0,\"done\":true,\"details\":{\"correct\":false}}");
        return 0;
    }
    for (pos = 0; anneal_json_item(turn + ts, te - ts, &pos, &vs, &ve);) count++;
    anneal_out_cstr("{\"observation\":\"");
    pos = 0;
    for (int k = 0; anneal_json_item(turn + ts, te - ts, &pos, &vs, &ve); k++) {
        const char *c = turn + ts + vs;
        int n = ve - vs, is, ie;
        if (count > 1) {
            if (k > 0) anneal_out_cstr("\\n");
            if (anneal_json_string(c, n, "id", &is, &ie)) anneal_out(c + is, ie - is);
            anneal_out_cstr(": ");
        }
        call(c, n);
    }
    anneal_out_cstr("\",\"done\":false}");
    return 0;
}

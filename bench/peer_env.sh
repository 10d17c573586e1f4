# Sourced by the benchmarks that run a Python peer: `need_venv MODULE...` makes sure $VENV
# (default .venv) can import them, creating it once; `cpu_features` prints the CPU line every
# benchmark reports next to its figures. Expects $REPO.
VENV="${VENV:-$REPO/.venv}"

need_venv() {
    local imports
    imports="$(IFS=,; echo "$*")"
    if ! "$VENV/bin/python" -c "import $imports" 2>/dev/null; then
        echo "creating $VENV with $* (one time, a few minutes)" >&2
        python3 -m venv "$VENV"
        "$VENV/bin/pip" install --quiet "$@"
    fi
}

cpu_features() {
    echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|avx512f|avx512_bf16|amx_bf16|amx_tile)$' | tr '\n' ' ')"
}

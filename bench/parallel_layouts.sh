#!/usr/bin/env bash
# Parallel layouts side by side on the debug Llama (hidden 256, FFN 1024, vocab 8192) with its
# 4 blocks and a 16-block variant: one process, FSDP(2), PP(2) 1F1B, PP(2) zero bubble (ZB-H1,
# pp2zb), PP(2) interleaved (2 virtual stages per rank), PP(2) ZBV (2 stages per rank in V
# order, pp2zbv) and interleaved zero bubble (pp2zbi), PP(2) x DDP(2), PP(2) x FSDP(2), TP(2), TP(2) with sequence
# parallelism (tp2_sp), TP(2) x FSDP(2) (tp2_fsdp2), PP(2) x TP(2) with and without SP (pp2_tp2,
# pp2_tp2_sp), PP(2) x TP(2) x FSDP(2) with and without SP on 8 ranks (pp2_tp2_fsdp2,
# pp2_tp2_fsdp2_sp), CP(2), CP(2) x FSDP(2), CP(2) x TP(2) (cp2_tp2: each rank's ring carries
# its half of the KV heads), PP(2) x CP(2) and PP(2) x TP(2) x CP(2) with and
# without SP (pp2_tp2_cp2, pp2_tp2_cp2_sp; 8 ranks), one compute thread per rank, a global
# batch of 8 x 256 in micro-batches of 1 sequence (8 micro-batches: 4 per data-parallel rank
# under PP(2) x DDP(2), PP(2) x FSDP(2), TP(2) x FSDP(2), PP(2) x TP(2) x FSDP(2) and
# CP(2) x FSDP(2)); and on the debug
# Qwen3-MoE (8 experts) FSDP(2), EP(2), CP(2) x EP(2) and PP(2) x EP(2) (the experts split over
# dp_shard 2; no balancing bias, as docs/distributed.md's figures were measured) and TP(2) (moe_tp2:
# every expert's width split over 2 ranks) and TP(2) x EP(2) (moe_tp2xep2, 4 ranks: half the
# width of half the experts on each).
# For each: `anneal plan`'s bytes and peak beside the measured ones (the last table; the plan
# counts MoE expert exchanges at an even routing, so EP layouts' bytes are not exact), the
# median tokens/s after WARMUP steps, the largest per-rank tensor peak
# (mem_peak_bytes), the bytes rank 0 handed to collectives and sends per step (comm_bytes)
# next to the theoretical traffic, and for pipelines the measured bubble (pp_bubble) next to
# the schedule's theory (pp_bubble_theory).
# - Zero-bubble pipelines: with a forward, an input-gradient and a weight-gradient pass costing
#   the same the bubble is (p - 1) / (3 v m + p - 1) (1F1B: (p - 1) / (v m + p - 1)); each rank
#   keeps at most 1F1B's first rank's micro-batches (p; under zbv 2p half-size chunks), but a
#   deferred weight pass keeps its products' inputs and output gradients (the head's logits'
#   gradient included) until it runs, so the peak is compared with 1F1B's beside it. Under zbv
#   rank 0 holds stages 0 and 3 and sends one activation (0 -> 1) and one gradient (3 -> 2) per
#   micro-batch.
# - Pipelines: each stage boundary moves micro_batch x seq_len x dim f32 forward and the same
#   backward, per micro-batch (data-parallel gradient sums not counted in the theory).
# - TP: the theory counts what the counter counts: an all-reduce its buffer once, an all-gather
#   its send, a reduce-scatter its whole input. Per micro-batch of A = seq_len x dim f32 and L
#   blocks: TP(2) all-reduces 4 per block (2 forward after o and down, 2 backward before q/k/v
#   and gate/up) plus the embedding's and the head's, (4L + 2) A; with SP each block gathers
#   A/2 and scatters A twice forward and the mirror backward, plus the embedding's and head's,
#   (6L + 3) A (on the wire, for 2 ranks, both move (4L + 2) A: a ring all-reduce sends its
#   buffer's two halves). The loss adds 12 bytes per token.
# - TP(2) x FSDP(2): TP(2)'s traffic for its 4 micro-batches plus FSDP's on the local slices
#   (each rank's P_outer + L P_block f32 of its tp slices): per micro-batch the outer unit is
#   gathered once and each block twice (forward; again for its backward), a gather counted as
#   its send (half the unit), and every unit's gradients reduce-scattered (its whole input):
#   (1.5 P_outer + 2 L P_block) x 4 bytes. The step's flags, losses and norm sums are left out.
# - PP(2) x TP(2): rank 0 is stage 0's first tp rank: its stage's TP traffic (the embedding's
#   all-reduce and 4 per block for its L/2 blocks, (2L + 1) A per micro-batch; with SP 1.5 A
#   for the embedding and 6 A per block) plus the pipeline's sends (one activation per
#   micro-batch: A, or A/2 under SP, where each tp rank sends its share of the sequence).
# - PP(2) x TP(2) x FSDP(2): rank 0's PP(2) x TP(2) traffic for its 4 micro-batches plus FSDP's
#   on its stage's slices once per step (gathered once and kept through the schedule): the
#   gather counted as its send (half of the stage's P_stage f32: the embedding's vocab slice and
#   L/2 blocks' slices) and the reduce-scatter as its whole input, 1.5 P_stage x 4 bytes. The
#   flags, losses, norm sums and SP's replicated-gradient sums are left out.
# - CP: the bytes rank 0's attention ring sent per step (cp_ring_bytes) next to the ring's
#   theory: per block and micro-batch, cp - 1 forward passes of keys, values (f32) and their
#   i64 positions for seq_len / cp rows, and cp backward passes that add the keys' and values'
#   f32 gradients. PP(2) x CP(2): rank 0's ring over its stage's blocks, and each stage boundary
#   moves micro_batch x seq_len / cp x dim f32 forward and back per micro-batch.
# - PP(2) x TP(2) x CP(2): rank 0 (stage 0, cp 0, tp 0) sends PP(2) x TP(2)'s traffic on its
#   cp part (A = seq_len / cp x dim f32: (2L + 1) A of TP collectives and A across the
#   boundary per micro-batch; under SP (3L + 1.5) A and A/2), its ring over its stage's L/2
#   blocks with its tp share of the KV heads (kv / tp), and its stage slices' gradient sum over
#   the 2 cp ranks (a reduce-scatter of the whole buffer and an all-gather of half: 1.5 x
#   (vocab x dim / 2 + L/2 blocks' slices) f32); under SP also the norms' gradient sum over tp.
# - EP: the bytes rank 0 sent in expert exchanges per step (ep_a2a_bytes) next to their
#   theory for an even routing: per MoE layer and micro-batch, the per-expert counts (an i64
#   per expert for each of the two halves, forward), this rank's routed rows (tokens x top-k
#   of dim f32, its own experts' included) out and their gradients back, and the rows its
#   experts drew returned and their gradients sent back: 2 x (routed + drawn) x dim x 4 bytes,
#   drawn = routed when the routing is even (the measured figure moves with rank 0's experts'
#   share); under CP(2) x EP(2) a rank routes seq_len / cp tokens per micro-batch, under
#   PP(2) x EP(2) rank 0 runs its stage's layers only.
# - MoE TP(2): dense TP(2)'s (4L + 2) A per micro-batch (the MoE layer all-reduces its combined
#   output forward and its input's gradient backward, as the dense feed-forward does) plus,
#   per layer, the routing weights' gradient (tokens x top-k f32) summed backward.
# - MoE TP(2) x EP(2) (dp_shard 2, 4 ranks): its theory column is the expert exchanges' as
#   under EP(2) (each tp rank sends its dp share's whole sequence to the expert group of its
#   tp coordinate); its comm also holds TP(2)'s and FSDP(2)'s traffic, which the plan table
#   below counts term by term.
# The PyTorch peer (bench/parallel_layouts_torch.py: torch.distributed.pipelining and DTensor
# tensor parallelism over gloo, same shapes, batch and thread count) runs the pipeline and
# tensor-parallel layouts next to ours; PEER=0 skips it. ONLY=tp2 (a name prefix) runs a subset
# of our layouts.
#   bash bench/parallel_layouts.sh           # STEPS=12 WARMUP=4 PEER=1
# Needs the corpus of configs/llama3_debug.toml (bash scripts/setup.sh) and MPI
# (scripts/setup-mpi.sh).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
STEPS="${STEPS:-12}" WARMUP="${WARMUP:-4}" PEER="${PEER:-1}" ONLY="${ONLY:-}"
cargo build --release --quiet -p anneal -p anneal-plugin-llama -p anneal-plugin-adamw
BIN="${CARGO_TARGET_DIR:-$REPO/target}/release/anneal"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); load $(cut -d' ' -f1-3 /proc/loadavg)"
COMMON=(--set training.threads=1 --set training.micro_batch_size=1 --set training.steps="$STEPS"
    --set metrics.log_freq=1 --set metrics.eval_freq=0 --set checkpoint.interval=0
    --set metrics.progress_bar=false)
run() { # name layers nproc extra-sets...
    local name="$1" layers="$2" n="$3"
    shift 3
    case "$name" in "$ONLY"*) ;; *) return 0 ;; esac
    local sets=("${COMMON[@]}" --set model.args.n_layers="$layers")
    for s in "$@"; do sets+=(--set "$s"); done
    "$BIN" plan configs/llama3_debug.toml "${sets[@]}" --nproc "$n" --device cpu --json \
        >"$OUT/$name.plan.json" 2>/dev/null || rm -f "$OUT/$name.plan.json"
    if [ "$n" = 1 ]; then
        "$BIN" train configs/llama3_debug.toml --run-dir "$OUT/$name" "${sets[@]}" \
            >"$OUT/$name.log" 2>&1 || { echo "$name failed:"; tail -5 "$OUT/$name.log"; exit 1; }
    else
        mpiexec -n "$n" "$BIN" train configs/llama3_debug.toml --run-dir "$OUT/$name" "${sets[@]}" \
            >"$OUT/$name.log" 2>&1 || { echo "$name failed:"; tail -5 "$OUT/$name.log"; exit 1; }
    fi
}
for layers in 4 16; do
    run "single-$layers" "$layers" 1
    run "fsdp2-$layers" "$layers" 2 parallelism.dp_shard=2
    run "pp2-$layers" "$layers" 2 parallelism.pp=2
    run "pp2zb-$layers" "$layers" 2 parallelism.pp=2 parallelism.pp_schedule=zero_bubble
    run "pp2i-$layers" "$layers" 2 parallelism.pp=2 parallelism.pp_schedule=interleaved_1f1b \
        parallelism.pp_virtual_stages=2
    run "pp2zbv-$layers" "$layers" 2 parallelism.pp=2 parallelism.pp_schedule=zbv \
        parallelism.pp_virtual_stages=2
    run "pp2zbi-$layers" "$layers" 2 parallelism.pp=2 parallelism.pp_schedule=zero_bubble \
        parallelism.pp_virtual_stages=2
    run "pp2xddp2-$layers" "$layers" 4 parallelism.pp=2 parallelism.dp_replicate=2
    run "pp2xfsdp2-$layers" "$layers" 4 parallelism.pp=2 parallelism.dp_shard=2
    run "tp2-$layers" "$layers" 2 parallelism.tp=2
    run "tp2_sp-$layers" "$layers" 2 parallelism.tp=2 parallelism.tp_sequence=true
    run "tp2_fsdp2-$layers" "$layers" 4 parallelism.tp=2 parallelism.dp_shard=2
    run "pp2_tp2-$layers" "$layers" 4 parallelism.pp=2 parallelism.tp=2
    run "pp2_tp2_sp-$layers" "$layers" 4 parallelism.pp=2 parallelism.tp=2 parallelism.tp_sequence=true
    run "pp2_tp2_fsdp2-$layers" "$layers" 8 parallelism.pp=2 parallelism.tp=2 parallelism.dp_shard=2
    run "pp2_tp2_fsdp2_sp-$layers" "$layers" 8 parallelism.pp=2 parallelism.tp=2 parallelism.dp_shard=2 \
        parallelism.tp_sequence=true
    run "cp2-$layers" "$layers" 2 parallelism.cp=2
    run "cp2_fsdp2-$layers" "$layers" 4 parallelism.cp=2 parallelism.dp_shard=2
    run "cp2_tp2-$layers" "$layers" 4 parallelism.cp=2 parallelism.tp=2
    run "pp2xcp2-$layers" "$layers" 4 parallelism.pp=2 parallelism.cp=2
    run "pp2_tp2_cp2-$layers" "$layers" 8 parallelism.pp=2 parallelism.tp=2 parallelism.cp=2
    run "pp2_tp2_cp2_sp-$layers" "$layers" 8 parallelism.pp=2 parallelism.tp=2 parallelism.cp=2 \
        parallelism.tp_sequence=true
done
# The MoE layouts: 4 blocks, no balancing bias (as docs/distributed.md's figures were measured).
run_moe() { # name nproc extra-sets...
    local name="$1" n="$2"
    shift 2
    case "$name" in "$ONLY"*) ;; *) return 0 ;; esac
    local sets=("${COMMON[@]}" --set model.args.moe.balance_rate=0.0)
    for s in "$@"; do sets+=(--set "$s"); done
    "$BIN" plan configs/qwen3_moe_debug.toml "${sets[@]}" --nproc "$n" --device cpu --json \
        >"$OUT/$name.plan.json" 2>/dev/null || rm -f "$OUT/$name.plan.json"
    mpiexec -n "$n" "$BIN" train configs/qwen3_moe_debug.toml --run-dir "$OUT/$name" "${sets[@]}" \
        >"$OUT/$name.log" 2>&1 || { echo "$name failed:"; tail -5 "$OUT/$name.log"; exit 1; }
}
run_moe moe_fsdp2 2 parallelism.dp_shard=2
run_moe moe_ep2 2 parallelism.dp_shard=2 parallelism.ep=2
run_moe moe_cp2xep2 4 parallelism.cp=2 parallelism.dp_shard=2 parallelism.ep=2
run_moe moe_pp2xep2 4 parallelism.pp=2 parallelism.dp_shard=2 parallelism.ep=2
run_moe moe_tp2 2 parallelism.tp=2
run_moe moe_tp2xep2 4 parallelism.tp=2 parallelism.dp_shard=2 parallelism.ep=2
if [ "$PEER" = 1 ]; then
    source bench/peer_env.sh
    need_venv torch
    for layers in 4 16; do
        for layout in pp pp_inter tp tp_sp; do
            OMP_NUM_THREADS=1 "$VENV/bin/torchrun" --nproc_per_node 2 bench/parallel_layouts_torch.py \
                --layout "$layout" --layers "$layers" --steps "$STEPS" --warmup "$WARMUP" 2>"$OUT/torch-$layout-$layers.err" |
                tail -1 >"$OUT/torch-$layout-$layers.json" ||
                { echo "torch $layout ($layers blocks) failed, its row is left out:"; tail -5 "$OUT/torch-$layout-$layers.err"; }
        done
    done
fi
python3 - "$OUT" "$WARMUP" <<'PY'
import json, os, statistics, sys
out, warmup = sys.argv[1], int(sys.argv[2])
dim, seq, micro = 256, 256, 8
ffn, vocab, kv = 1024, 8192, 256
print(f"{'layout':>16} {'tok/s':>7} {'peak MiB':>9} {'comm MB/step':>13} {'theory MB':>10} {'bubble':>7} {'theory':>7}")
for layers in (4, 16):
    for name, boundaries, per_rank in (("single", 0, micro), ("fsdp2", 0, micro), ("pp2", 1, micro),
                                        ("pp2zb", 1, micro), ("pp2i", 3, micro),
                                        ("pp2zbv", 2, micro), ("pp2zbi", 3, micro),
                                        ("pp2xddp2", 1, micro // 2),
                                        ("pp2xfsdp2", 1, micro // 2), ("tp2", 0, micro),
                                        ("tp2_sp", 0, micro), ("tp2_fsdp2", 0, micro // 2),
                                        ("pp2_tp2", 1, micro), ("pp2_tp2_sp", 1, micro),
                                        ("pp2_tp2_fsdp2", 1, micro // 2),
                                        ("pp2_tp2_fsdp2_sp", 1, micro // 2)):
        path = f"{out}/{name}-{layers}/metrics.jsonl"
        if not os.path.exists(path):
            continue
        rows = [json.loads(l) for l in open(path)]
        tps = statistics.median(r["tokens_per_s"] for r in rows[warmup:])
        peak = max(r["mem_peak_bytes"] for r in rows) / 2**20
        comm = statistics.median(r.get("comm_bytes") or 0 for r in rows[warmup:]) / 1e6
        # Rank 0 sends forward on each of its boundaries and backward on the others': in all,
        # every boundary moves one activation and one gradient per micro-batch, split over 2 ranks.
        theory = boundaries * 2 * per_rank * seq * dim * 4 / 2 / 1e6 if boundaries else float("nan")
        if name == "pp2zbv":
            # The V: rank 0 sends stage 0's activation and stage 3's gradient per micro-batch.
            theory = 2 * per_rank * seq * dim * 4 / 1e6
        act = seq * dim * 4
        if name == "tp2":
            theory = micro * ((4 * layers + 2) * act + 12 * seq) / 1e6
        if name == "tp2_sp":
            theory = micro * ((6 * layers + 3) * act + 12 * seq) / 1e6
        if name == "tp2_fsdp2":
            block = (2 * dim * dim + 2 * dim * kv + 3 * dim * ffn) / 2 + 2 * dim
            outer = 2 * vocab * dim / 2 + dim
            fsdp = (1.5 * outer + 2 * layers * block) * 4
            theory = per_rank * ((4 * layers + 2) * act + 12 * seq + fsdp) / 1e6
        if name == "pp2_tp2":
            # Rank 0 (stage 0, first tp rank) sends each micro-batch's activation forward and
            # runs the embedding's and its L/2 blocks' TP collectives; the loss is stage 1's.
            theory = micro * ((4 * (layers // 2) + 1) * act + act) / 1e6
        if name == "pp2_tp2_sp":
            # Under SP the boundary carries half the sequence; the embedding scatters (A) and
            # gathers back (A/2), each block 6 A as in tp2_sp.
            theory = micro * ((6 * (layers // 2) + 1.5) * act + act / 2) / 1e6
        if name.startswith("pp2_tp2_fsdp2"):
            # Rank 0 (stage 0, shard 0, first tp rank): pp2_tp2's traffic for its 4 micro-batches,
            # plus FSDP's on its stage's slices once per step: the gather counted as its send
            # (half the stage) and the gradients' reduce-scatter as its whole input.
            block = (2 * dim * dim + 2 * dim * kv + 3 * dim * ffn) / 2 + 2 * dim
            stage = vocab * dim / 2 + (layers // 2) * block
            if name == "pp2_tp2_fsdp2":
                tp = (4 * (layers // 2) + 1) * act + act
            else:
                tp = (6 * (layers // 2) + 1.5) * act + act / 2
            theory = (per_rank * tp + 1.5 * stage * 4) / 1e6
        bub = [r["pp_bubble"] for r in rows[warmup:] if "pp_bubble" in r]
        th = rows[-1].get("pp_bubble_theory")
        print(f"{name + '-' + str(layers):>16} {tps:>7.0f} {peak:>9.0f} {comm:>13.2f} {theory:>10.2f} "
              f"{(statistics.median(bub) if bub else float('nan')):>7.3f} {(th if th is not None else float('nan')):>7.3f}")
# Context parallelism: the debug Llama has 4 KV heads of 64 (kv = 256 features per token).
kv, cp = 256, 2
print(f"\n{'layout':>16} {'tok/s':>7} {'peak MiB':>9} {'comm MB/step':>13} {'ring MB/step':>13} {'theory MB':>10}")
for layers in (4, 16):
    for name, per_rank, blocks in (("single", micro, layers), ("cp2", micro, layers),
                                   ("cp2_fsdp2", micro // 2, layers), ("cp2_tp2", micro, layers),
                                   ("pp2xcp2", micro, layers // 2),
                                   ("pp2_tp2_cp2", micro, layers // 2),
                                   ("pp2_tp2_cp2_sp", micro, layers // 2)):
        path = f"{out}/{name}-{layers}/metrics.jsonl"
        if not os.path.exists(path):
            continue
        rows = [json.loads(l) for l in open(path)]
        tps = statistics.median(r["tokens_per_s"] for r in rows[warmup:])
        peak = max(r["mem_peak_bytes"] for r in rows) / 2**20
        comm = statistics.median(r.get("comm_bytes") or 0 for r in rows[warmup:]) / 1e6
        ring = statistics.median(r.get("cp_ring_bytes") or 0 for r in rows[warmup:]) / 1e6
        t = seq // cp
        # Under tp each rank's ring carries its share of the KV heads.
        kv_here = kv // 2 if "tp2" in name else kv
        fwd = (cp - 1) * (2 * t * kv_here * 4 + t * 8)
        bwd = cp * (4 * t * kv_here * 4 + t * 8)
        theory = blocks * per_rank * (fwd + bwd) / 1e6 if name != "single" else float("nan")
        extra = ""
        if name.startswith("pp2_tp2_cp2"):
            act = t * dim * 4
            sp = name.endswith("_sp")
            # `blocks` is the stage's L/2: (2L + 1) A, or (3L + 1.5) A under SP.
            tp_bytes = per_rank * ((6 * blocks + 1.5) * act if sp else (4 * blocks + 1) * act)
            boundary = per_rank * (act / 2 if sp else act)
            block = (2 * dim * dim + 2 * dim * kv + 3 * dim * ffn) / 2 + 2 * dim
            grads = 1.5 * (vocab * dim / 2 + blocks * block) * 4 + (blocks * 2 * dim * 4 if sp else 0)
            total = (tp_bytes + boundary + grads) / 1e6 + theory
            extra = f"  (all in theory {total:.2f} MB: tp {tp_bytes / 1e6:.2f} + boundary " \
                    f"{boundary / 1e6:.2f} + ring + cp grad sum {grads / 1e6:.2f}; bubble " \
                    f"{statistics.median(r['pp_bubble'] for r in rows[warmup:]):.3f}, theory " \
                    f"{rows[-1]['pp_bubble_theory']:.3f})"
        if name == "pp2xcp2":
            # The stage boundary's activations and gradients, split over the 2 stages' ranks.
            extra = f"  (+ boundary {2 * per_rank * t * dim * 4 / 2 / 1e6:.2f} MB; bubble " \
                    f"{statistics.median(r['pp_bubble'] for r in rows[warmup:]):.3f}, theory " \
                    f"{rows[-1]['pp_bubble_theory']:.3f})"
        print(f"{name + '-' + str(layers):>16} {tps:>7.0f} {peak:>9.0f} {comm:>13.2f} {ring:>13.2f} {theory:>10.2f}{extra}")
# Expert parallelism on the debug Qwen3-MoE: 4 blocks, 8 experts, top 2, hidden 256.
moe_layers, experts, top_k = 4, 8, 2
print(f"\n{'layout':>16} {'tok/s':>7} {'peak MiB':>9} {'comm MB/step':>13} {'a2a MB/step':>12} {'theory MB':>10}")
for name, per_rank, tokens, layers_here, ep in (("moe_fsdp2", micro // 2, seq, moe_layers, 1),
                                               ("moe_ep2", micro // 2, seq, moe_layers, 2),
                                               ("moe_cp2xep2", micro // 2, seq // 2, moe_layers, 2),
                                               ("moe_pp2xep2", micro // 2, seq, moe_layers // 2, 2),
                                               ("moe_tp2", micro, seq, moe_layers, 1),
                                               ("moe_tp2xep2", micro // 2, seq, moe_layers, 2)):
    path = f"{out}/{name}/metrics.jsonl"
    if not os.path.exists(path):
        continue
    rows = [json.loads(l) for l in open(path)]
    tps = statistics.median(r["tokens_per_s"] for r in rows[warmup:])
    peak = max(r["mem_peak_bytes"] for r in rows) / 2**20
    comm = statistics.median(r.get("comm_bytes") or 0 for r in rows[warmup:]) / 1e6
    a2a = statistics.median(r.get("ep_a2a_bytes") or 0 for r in rows[warmup:]) / 1e6
    counts = 2 * experts * 8
    theory = (layers_here * per_rank * (counts + 4 * tokens * top_k * dim * 4) / 1e6
              if ep > 1 else float("nan"))
    if name == "moe_tp2":
        act = seq * dim * 4
        theory = micro * ((4 * moe_layers + 2) * act + moe_layers * seq * top_k * 4
                          + 12 * seq) / 1e6
    print(f"{name:>16} {tps:>7.0f} {peak:>9.0f} {comm:>13.2f} {a2a:>12.2f} {theory:>10.2f}")
# `anneal plan` (computed from the config and the spec before anything is allocated) beside
# what each run measured: rank 0's bytes per step and the busiest rank's peak.
print(f"\n{'layout':>18} {'comm B/step':>12} {'plan B':>12} {'exact':>6} {'peak MiB':>9} {'plan MiB':>9} {'plan/peak':>9}")
for path in sorted(os.listdir(out)):
    if not path.endswith(".plan.json"):
        continue
    name = path[: -len(".plan.json")]
    try:
        rows = [json.loads(l) for l in open(f"{out}/{name}/metrics.jsonl")]
    except OSError:
        continue
    plan = json.load(open(f"{out}/{path}"))
    comm = statistics.median(r.get("comm_bytes") or 0 for r in rows[warmup:])
    peak = max(r["mem_peak_bytes"] for r in rows)
    planned, ppeak = plan["comm"]["total"], plan["memory"]["peak"]
    print(f"{name:>18} {comm:>12.0f} {planned:>12} {('yes' if planned == comm else 'no'):>6} "
          f"{peak / 2**20:>9.1f} {ppeak / 2**20:>9.1f} {ppeak / peak:>9.3f}")
# PyTorch on the same shapes: our layout's tokens/s over the peer's (above 1: we are faster).
ours_for = {"pp": "pp2", "pp_inter": "pp2i", "tp": "tp2", "tp_sp": "tp2_sp"}
peer_rows = []
for layers in (4, 16):
    for layout, ours in ours_for.items():
        try:
            peer = json.load(open(f"{out}/torch-{layout}-{layers}.json"))
        except (OSError, ValueError):
            continue
        try:
            rows = [json.loads(l) for l in open(f"{out}/{ours}-{layers}/metrics.jsonl")]
            mine = statistics.median(r["tokens_per_s"] for r in rows[warmup:])
        except OSError:
            mine = float("nan")
        peer_rows.append((f"{layout}-{layers}", peer["tokens_per_s"], max(peer["peak_rss_mib"]), mine))
if peer_rows:
    print(f"\n{'pytorch layout':>16} {'tok/s':>7} {'peak RSS MiB':>13} {'ours / pytorch':>15}")
    for name, tps, rss, mine in peer_rows:
        print(f"{name:>16} {tps:>7.0f} {rss:>13.0f} {mine / tps:>15.2f}")
PY

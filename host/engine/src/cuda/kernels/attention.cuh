// Shared by attention.cu (exact) and flash.cu (tiled): the dims and mask of one attention call,
// in the layout of `AttnDims` in attention.rs.

struct AttnDims {
    i64 b, hq, hkv, tq, tk, d, dv;
    float scale, softcap; // softcap 0: none
    int causal;           // 1: keys after the query are masked
    i64 window;           // 0: none; else keys at or before q_pos - window are masked
    int has_sinks;
};

__device__ __forceinline__ bool visible(const AttnDims& a, i64 qp, i64 kp) {
    bool causal = a.causal || a.window > 0;
    return (!causal || kp <= qp) && (a.window == 0 || kp > qp - a.window);
}

"""Scaled dot-product attention: causal, GQA/MQA, sliding window, soft-capping, sinks, decode
with a KV cache, explicit positions. References are an explicit masked softmax in float64
(cast to f32), with gradients from autograd for a fixed upstream gradient `<case>.go`; the
`sdpa` case is PyTorch's own `F.scaled_dot_product_attention`.

Case parameters are mirrored in tests/attention.rs.
"""
import math

import torch
import torch.nn.functional as F


def reference(q, k, v, scale=None, causal=False, window=None, softcap=None, sinks=None,
              q_pos=None, k_pos=None):
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if q_pos is None:
        q_pos = torch.arange(tq) + max(tk - tq, 0)
    if k_pos is None:
        k_pos = torch.arange(tk)
    kk = k.repeat_interleave(hq // hkv, dim=1)
    vv = v.repeat_interleave(hq // hkv, dim=1)
    s = (q @ kk.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    mask = torch.ones(tq, tk, dtype=torch.bool)
    if causal or window is not None:
        mask &= k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, hq, 1, 1).expand(b, hq, tq, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)
    if sinks is not None:
        p = p[..., :-1]
    return p @ vv


CASES = {
    # name: (B, Hq, Hkv, Tq, Tk, D, Dv, options)
    "causal": (2, 2, 2, 13, 13, 8, 8, dict(causal=True)),
    "long": (1, 2, 2, 150, 150, 16, 16, dict(causal=True)),
    "gqa": (1, 4, 2, 10, 12, 8, 6, dict()),
    "window": (1, 2, 1, 100, 100, 8, 8, dict(causal=True, window=7)),
    "softcap": (2, 2, 2, 20, 20, 8, 8, dict(causal=True, softcap=2.0, scale=0.7)),
    "sinks": (2, 4, 1, 70, 70, 8, 8, dict(causal=True, sinks=True)),
    "decode": (1, 4, 2, 3, 90, 8, 8, dict(causal=True)),
    "positions": (1, 2, 2, 5, 80, 8, 8, dict(window=30, positions=True)),
}


def make():
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    t = {}
    for name, (b, hq, hkv, tq, tk, d, dv, opt) in CASES.items():
        q, k, v = r(b, hq, tq, d), r(b, hkv, tk, d), r(b, hkv, tk, dv)
        # Larger logits make soft-capping matter.
        if "softcap" in opt:
            q = q * 3.0
        kw = dict(scale=opt.get("scale"), causal=opt.get("causal", False),
                  window=opt.get("window"), softcap=opt.get("softcap"))
        inputs = [q, k, v]
        if opt.get("sinks"):
            sinks = r(hq)
            inputs.append(sinks)
        if opt.get("positions"):
            # Keys with a gap in positions (e.g. an evicted span), queries at the end.
            k_pos = torch.cat([torch.arange(0, 40), torch.arange(60, 100)])
            q_pos = torch.tensor([100, 101, 102, 103, 104]) - 5
            kw["k_pos"], kw["q_pos"] = k_pos, q_pos
            t[f"{name}.k_pos"], t[f"{name}.q_pos"] = k_pos, q_pos
        for x in inputs:
            x.requires_grad_(True)
        if opt.get("sinks"):
            kw["sinks"] = inputs[3]
        out = reference(*inputs[:3], **kw)
        go = r(*out.shape)
        grads = torch.autograd.grad(out, inputs, go)
        for key, x in zip(["q", "k", "v", "sinks"], inputs):
            t[f"{name}.{key}"] = x.detach().float()
        t[f"{name}.go"] = go.float()
        t[f"{name}.out"] = out.detach().float()
        for key, gx in zip(["dq", "dk", "dv", "dsinks"], grads):
            t[f"{name}.{key}"] = gx.float()
    # PyTorch's own fused op, causal.
    q, k, v = r(2, 3, 17, 16).float(), r(2, 3, 17, 16).float(), r(2, 3, 17, 16).float()
    t["sdpa.q"], t["sdpa.k"], t["sdpa.v"] = q, k, v
    t["sdpa.out"] = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return t

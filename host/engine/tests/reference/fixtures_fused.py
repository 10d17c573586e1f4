"""Fused transformer ops: softmax, log_softmax, rms_norm, layer_norm, rope, embedding,
cross-entropy. Inputs are stored next to outputs and input gradients (of sum(out * proj))."""
import math

import torch
import torch.nn.functional as F


def grads(out, inputs, g):
    """Gradients of sum(out * proj) w.r.t. inputs, with a random projection `proj`."""
    proj = torch.randn(out.shape, generator=g)
    return proj, torch.autograd.grad((out * proj).sum(), inputs)


def rope_inv_freq(rot_dim, theta, scaling=None):
    """HF transformers' default / llama3 inverse frequencies, in float64."""
    inv = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    if scaling is None:
        return inv
    factor, low, high, old = scaling
    low_wl, high_wl = old / low, old / high
    wavelen = 2 * math.pi / inv
    inv_l = torch.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
    return torch.where(medium, smoothed, inv_l)


def rope_ref(x, cos, sin, interleaved):
    """Rotates the first 2R features of x [B, H, T, D] with cos/sin [T, R]."""
    r = cos.shape[-1]
    xr, rest = x[..., : 2 * r], x[..., 2 * r:]
    if interleaved:  # Meta's reference: complex multiply of (x[2i], x[2i+1])
        xc = torch.view_as_complex(xr.reshape(*xr.shape[:-1], r, 2).contiguous())
        rot = torch.view_as_real(xc * torch.complex(cos, sin)).flatten(-2)
    else:  # HF rotate_half
        c, s = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        x1, x2 = xr[..., :r], xr[..., r:]
        rot = xr * c + torch.cat([-x2, x1], -1) * s
    return torch.cat([rot, rest], -1)


def make():
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g)
    t = {}

    # softmax / log_softmax over the last dim and a middle dim
    for name, fn in [("softmax", torch.softmax), ("log_softmax", torch.log_softmax)]:
        for dim in [-1, 1]:
            x = (r(3, 5, 37) * 3).requires_grad_()
            out = fn(x, dim)
            proj, (gx,) = grads(out, [x], g)
            k = f"{name}.d{dim}"
            t[f"{k}.x"], t[f"{k}.out"], t[f"{k}.proj"], t[f"{k}.gx"] = x, out, proj, gx

    # rms_norm (weight, no weight) and layer_norm (weight+bias, none)
    x = r(4, 6, 48).requires_grad_()
    w = (1 + 0.1 * r(48)).requires_grad_()
    out = F.rms_norm(x, (48,), w, 1e-5)
    proj, (gx, gw) = grads(out, [x, w], g)
    t.update({"rms.x": x, "rms.w": w, "rms.out": out, "rms.proj": proj, "rms.gx": gx, "rms.gw": gw})
    out = F.rms_norm(x, (48,), None, 1e-6)
    t["rms_nw.out"] = out
    b = (0.1 * r(48)).requires_grad_()
    out = F.layer_norm(x, (48,), w, b, 1e-5)
    proj, (gx, gw, gb) = grads(out, [x, w, b], g)
    t.update({"ln.b": b, "ln.out": out, "ln.proj": proj, "ln.gx": gx, "ln.gw": gw, "ln.gb": gb})
    t["ln_nw.out"] = F.layer_norm(x, (48,), None, None, 1e-5)

    # rope: tables from the reference formula, interleaved, half-split, partial, llama3-scaled
    T, D = 11, 16
    pos = torch.arange(T, dtype=torch.int64) * 3 + 2
    t["rope.pos"] = pos
    for k, rot, theta, sc in [
        ("plain", 16, 10000.0, None),
        ("partial", 8, 500.0, None),
        ("llama3", 16, 500000.0, (8.0, 1.0, 4.0, 16)),
    ]:
        inv = rope_inv_freq(rot, theta, sc)
        ang = pos.double()[:, None] * inv[None, :]
        t[f"rope.{k}.cos"], t[f"rope.{k}.sin"] = ang.cos().float(), ang.sin().float()
    x = r(2, 3, T, D).requires_grad_()
    t["rope.x"] = x
    for k in ["plain", "partial", "llama3"]:
        for style, inter in [("inter", True), ("half", False)]:
            out = rope_ref(x, t[f"rope.{k}.cos"], t[f"rope.{k}.sin"], inter)
            proj, (gx,) = grads(out, [x], g)
            n = f"rope.{k}.{style}"
            t[f"{n}.out"], t[f"{n}.proj"], t[f"{n}.gx"] = out, proj, gx
    # An HF-style float32 table for the llama3 case (inv_freq and angles in f32).
    inv32 = rope_inv_freq(16, 500000.0, (8.0, 1.0, 4.0, 16)).float()
    t["rope.llama3.cos_f32"] = (pos.float()[:, None] * inv32[None, :]).cos()

    # embedding with repeated ids
    w = r(13, 10).requires_grad_()
    ids = torch.tensor([[3, 0, 12, 3], [7, 3, 0, 5]], dtype=torch.int64)
    out = F.embedding(ids, w)
    proj, (gw,) = grads(out, [w], g)
    t.update({"emb.w": w, "emb.ids": ids, "emb.out": out, "emb.proj": proj, "emb.gw": gw})

    # cross-entropy: plain mean, ignore_index, label smoothing, sum, none, long rows
    x = (r(9, 50) * 2).requires_grad_()
    tg = torch.randint(0, 50, (9,), generator=g)
    tg[2] = -100
    tg[6] = -100
    t["ce.x"], t["ce.t"] = x, tg
    for k, kw in [
        ("mean", dict()),
        ("smooth", dict(label_smoothing=0.1)),
        ("sum", dict(reduction="sum")),
        ("none", dict(reduction="none", label_smoothing=0.2)),
    ]:
        out = F.cross_entropy(x, tg, **kw)
        proj, (gx,) = grads(out, [x], g)
        t[f"ce.{k}.out"], t[f"ce.{k}.proj"], t[f"ce.{k}.gx"] = out, proj, gx
    xl = (r(3, 1500) * 4).requires_grad_()
    tl = torch.tensor([0, 777, 1499])
    out = F.cross_entropy(xl, tl)
    (gx,) = torch.autograd.grad(out, [xl])
    t.update({"ce_long.x": xl, "ce_long.t": tl, "ce_long.out": out, "ce_long.gx": gx})
    return t

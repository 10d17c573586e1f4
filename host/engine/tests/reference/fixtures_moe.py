"""Mixture-of-experts layer pieces: routers (softmax and sigmoid, bias steering the choice, top-k
renormalisation, route scale), a whole dropless MoE feed-forward with a shared expert and the
auxiliary load-balancing loss (written the usual way: a loop over experts, index_add back),
and the aux-loss-free bias update. Gradients come from autograd."""
import torch
import torch.nn.functional as F


def router(logits, bias, k, score, renorm, scale):
    s = logits.float().softmax(-1) if score == "softmax" else logits.float().sigmoid()
    choice = s.detach() + (bias if bias is not None else 0)
    idx = torch.topk(choice, k, dim=-1).indices
    w = s.gather(1, idx)
    if renorm:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale, idx, s


def aux_loss(scores, idx, n_experts):
    # Hugging Face's load_balancing_loss_func for one layer: E * sum_e f_e * P_e.
    mask = F.one_hot(idx, n_experts).float()  # [N, k, E]
    f = mask.mean(0)  # [k, E]
    p = scores.mean(0)
    return (f * p.unsqueeze(0)).sum() * n_experts


def make():
    g = torch.Generator().manual_seed(14)
    r = lambda *s: torch.randn(*s, generator=g)
    t = {}

    # Routers: the weights' gradient flows back to the logits.
    for name, score, renorm, scale in [("softmax", "softmax", True, 1.5), ("sigmoid", "sigmoid", True, 2.5),
                                       ("plain", "softmax", False, 1.0)]:
        logits = r(10, 6).requires_grad_()
        bias = r(6) * 0.3
        w, idx, _ = router(logits, bias, 2, score, renorm, scale)
        gw = r(*w.shape)
        w.backward(gw)
        p = f"router_{name}."
        t[p + "logits"], t[p + "bias"], t[p + "grad"] = logits, bias, gw
        t[p + "weights"], t[p + "experts"], t[p + "grad_logits"] = w, idx, logits.grad

    # A whole layer: N tokens, hidden D, E experts, top-k, expert width Fe, shared width Fs.
    n, d, e, k, fe, fs, coef = 24, 8, 4, 2, 6, 5, 0.01
    x = r(2, n // 2, d).requires_grad_()
    wr = (r(d, e) * 0.5).requires_grad_()
    bias = r(e) * 0.05
    gate, up, down = (r(e, d, fe) * 0.4).requires_grad_(), (r(e, d, fe) * 0.4).requires_grad_(), (r(e, fe, d) * 0.4).requires_grad_()
    sg, su, sd = (r(d, fs) * 0.4).requires_grad_(), (r(d, fs) * 0.4).requires_grad_(), (r(fs, d) * 0.4).requires_grad_()
    x2 = x.reshape(n, d)
    w, idx, scores = router(x2 @ wr, bias, k, "softmax", True, 1.0)
    out = torch.zeros(n, d)
    for ex in range(e):
        tok, slot = torch.nonzero(idx == ex, as_tuple=True)
        h = F.silu(x2[tok] @ gate[ex]) * (x2[tok] @ up[ex])
        out = out.index_add(0, tok, (h @ down[ex]) * w[tok, slot, None])
    out = out + (F.silu(x2 @ sg) * (x2 @ su)) @ sd
    aux = aux_loss(scores, idx, e) * coef
    gout = r(n, d)
    ((out * gout).sum() + aux).backward()
    p = "layer."
    for name, v in [("x", x), ("router", wr), ("bias", bias), ("gate", gate), ("up", up), ("down", down),
                    ("shared_gate", sg), ("shared_up", su), ("shared_down", sd)]:
        t[p + name] = v
        if v.grad is not None:
            t[p + "grad_" + name] = v.grad
    t[p + "out"], t[p + "aux_loss"], t[p + "grad_out"] = out.reshape(x.shape), aux, gout
    t[p + "counts"] = torch.bincount(idx.flatten(), minlength=e)

    # A GPT-OSS-style layer: router with a logit bias, softmax over the top-k logits, per-expert
    # biases, the clamped SwiGLU (a small limit so that some values clamp).
    n, d, e, k, fe, alpha, limit = 20, 8, 4, 2, 6, 1.702, 1.0
    x = r(n, d).requires_grad_()
    wr, br = (r(d, e) * 0.5).requires_grad_(), (r(e) * 0.1).requires_grad_()
    gate, up, down = (r(e, d, fe) * 0.4).requires_grad_(), (r(e, d, fe) * 0.4).requires_grad_(), (r(e, fe, d) * 0.4).requires_grad_()
    bg, bu, bd = (r(e, fe) * 0.1).requires_grad_(), (r(e, fe) * 0.1).requires_grad_(), (r(e, d) * 0.1).requires_grad_()
    top, idx = torch.topk(x @ wr + br, k, dim=-1)
    w = top.softmax(-1)
    out = torch.zeros(n, d)
    for ex in range(e):
        tok, slot = torch.nonzero(idx == ex, as_tuple=True)
        gt = (x[tok] @ gate[ex] + bg[ex]).clamp(max=limit)
        ut = (x[tok] @ up[ex] + bu[ex]).clamp(-limit, limit)
        h = (ut + 1) * (gt * torch.sigmoid(gt * alpha))
        out = out.index_add(0, tok, (h @ down[ex] + bd[ex]) * w[tok, slot, None])
    gout = r(n, d)
    (out * gout).sum().backward()
    p = "gptoss."
    for name, v in [("x", x), ("router", wr), ("router_bias", br), ("gate", gate), ("up", up), ("down", down),
                    ("gate_bias", bg), ("up_bias", bu), ("down_bias", bd)]:
        t[p + name], t[p + "grad_" + name] = v, v.grad
    t[p + "out"], t[p + "grad_out"] = out, gout

    # Aux-loss-free bias update (TorchTitan's form), u = 1e-3.
    counts = torch.tensor([7.0, 1.0, 3.0, 3.0, 0.0, 10.0])
    b = r(6) * 0.01
    delta = 1e-3 * torch.sign(counts.mean() - counts)
    delta = delta - delta.mean()
    t["bias_update.counts"], t["bias_update.bias"], t["bias_update.out"] = counts.long(), b, b + delta
    return t

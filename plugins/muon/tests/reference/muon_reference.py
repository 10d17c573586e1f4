"""Reference Muon steps in PyTorch, written from Keller Jordan's Muon and Moonlight's scaling,
with AdamW for the parameters Muon leaves out; Newton-Schulz in bf16 (the default) or f32, on a
matrix or batched over a stack of them. Writes ../fixtures/muon_steps.json,
which host/runtime/tests/muon.rs replays through the built plugin.

    /work/main/.venv/bin/python plugins/muon/tests/reference/muon_reference.py
"""
import json
import math
import pathlib

import torch

NS = (3.4445, -4.7750, 2.0315)
DEFAULTS = dict(
    momentum=0.95,
    nesterov=True,
    ns_steps=5,
    eps=1e-7,
    weight_decay=0.1,
    adjust_lr="match_rms_adamw",
    adamw_betas=(0.9, 0.95),
    adamw_eps=1e-8,
    exclude=["embed", "output", "lm_head", "router"],
    muon_ranks=[2, 3],
    ns_dtype="bfloat16",
)


def newton_schulz(u, steps, eps, dtype):
    """Quintic Newton-Schulz: X <- aX + (bA + cA^2)X with A = X X^T, per matrix of the last two
    dims, normalized in f32 and iterated in `dtype`."""
    a, b, c = NS
    tall = u.shape[-2] > u.shape[-1]
    x = u.mT if tall else u
    x = x / (torch.sqrt((x * x).sum(dim=(-2, -1), keepdim=True)) + eps)
    x = x.to(torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    x = x.float()
    return x.mT if tall else x


def muon_step(p, g, m, lr, h):
    mu = h["momentum"]
    m.copy_(mu * m + (1 - mu) * g)
    u = (1 - mu) * g + mu * m if h["nesterov"] else m
    o = newton_schulz(u, h["ns_steps"], h["eps"], h["ns_dtype"])
    rows, cols = p.shape[-2:]
    if h["adjust_lr"] == "match_rms_adamw":
        s = 0.2 * math.sqrt(max(rows, cols))
    else:
        s = math.sqrt(max(1.0, rows / cols))
    p.copy_(p * (1 - lr * h["weight_decay"]) - (lr * s) * o)


def adamw_step(p, g, m, v, t, lr, h):
    b1, b2 = h["adamw_betas"]
    m.copy_(b1 * m + (1 - b1) * g)
    v.copy_(b2 * v + (1 - b2) * g * g)
    mhat = m / (1 - b1**t)
    vhat = v / (1 - b2**t)
    p.copy_(p * (1 - lr * h["weight_decay"]) - lr * mhat / (torch.sqrt(vhat) + h["adamw_eps"]))


def is_muon(name, shape, h):
    return len(shape) in h["muon_ranks"] and not any(x in name for x in h["exclude"])


def case(args, shapes, lrs, seed):
    h = {**DEFAULTS, **args}
    gen = torch.Generator().manual_seed(seed)
    params = {n: torch.randn(s, generator=gen) * 0.5 for n, s in shapes.items()}
    init = {n: p.clone() for n, p in params.items()}
    m = {n: torch.zeros(s) for n, s in shapes.items()}
    v = {n: torch.zeros(s) for n, s in shapes.items()}
    steps = []
    for t, lr in enumerate(lrs, start=1):
        grads = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
        for n, s in shapes.items():
            if is_muon(n, s, h):
                muon_step(params[n], grads[n], m[n], lr, h)
            else:
                adamw_step(params[n], grads[n], m[n], v[n], t, lr, h)
        steps.append(
            dict(
                lr=lr,
                grads={n: g.flatten().tolist() for n, g in grads.items()},
                params={n: p.flatten().tolist() for n, p in params.items()},
            )
        )
    return dict(
        args=args,
        shapes={n: list(s) for n, s in shapes.items()},
        init={n: p.flatten().tolist() for n, p in init.items()},
        steps=steps,
    )


def main():
    torch.set_default_dtype(torch.float32)
    shapes = {
        "layers.0.attention.wq.weight": (6, 10),  # wide
        "layers.0.feed_forward.w2.weight": (12, 5),  # tall: orthogonalized transposed
        "layers.0.attention_norm.weight": (5,),  # a vector: AdamW
        "tok_embeddings.weight": (9, 4),  # excluded by name: AdamW
        "layers.0.feed_forward.experts.w1": (3, 7, 4),  # a stack of expert matrices: batched
        "layers.0.feed_forward.router.weight": (3, 4),  # excluded by name: AdamW
    }
    f32 = dict(ns_dtype="float32")
    cases = [
        case(f32, shapes, [1e-2, 2e-2, 5e-3], seed=1),
        case(
            dict(adjust_lr="original", nesterov=False, momentum=0.9, weight_decay=0.0, ns_steps=3, **f32),
            shapes,
            [2e-2, 2e-2],
            seed=2,
        ),
        case(dict(exclude=["wq"], **f32), shapes, [1e-2, 1e-2], seed=3),
        case(dict(ns_dtype="bfloat16"), shapes, [1e-2, 2e-2, 5e-3], seed=4),
        case(dict(muon_ranks=[2], ns_dtype="bfloat16"), shapes, [1e-2, 1e-2], seed=5),
    ]
    out = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "muon_steps.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(dict(torch=torch.__version__, cases=cases)) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

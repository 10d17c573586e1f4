"""The gated delta rule against transformers' reference implementations: Qwen3.5's
`torch_chunk_gated_delta_rule` (decay per head, grouped value heads) and Kimi Linear's
`chunk_kimi_delta_attention` (decay per key channel). Inputs are stored next to the output, the
final state and the input gradients of sum(out * proj) + sum(state * sproj)."""
import torch
from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule


def make():
    g = torch.Generator().manual_seed(11)
    r = lambda *s: torch.randn(*s, generator=g)
    u = lambda *s: torch.rand(*s, generator=g)
    t = {}
    cases = [
        # name, fn, B, T, Hk, Hv, Dk, Dv, per_channel, l2norm, initial state
        ("gdn", torch_chunk_gated_delta_rule, 2, 100, 2, 4, 16, 8, False, True, True),
        ("gdn_plain", torch_chunk_gated_delta_rule, 1, 64, 1, 1, 8, 8, False, False, False),
        ("kda", chunk_kimi_delta_attention, 1, 77, 3, 3, 8, 16, True, True, True),
    ]
    for name, fn, b, n, hk, hv, dk, dv, per_channel, l2, with_state in cases:
        q, k = r(b, n, hk, dk), r(b, n, hk, dk) * (1.0 if l2 else 0.4)
        v = r(b, n, hv, dv)
        gl = -u(b, n, hv, dk) if per_channel else -u(b, n, hv) * 0.5
        beta = u(b, n, hv)
        s0 = r(b, hv, dk, dv) if with_state else None
        leaves = [x.requires_grad_() for x in (q, k, v, gl, beta)]
        if s0 is not None:
            leaves.append(s0.requires_grad_())
        out, state = fn(q, k, v, gl, beta, initial_state=s0, output_final_state=True,
                        use_qk_l2norm_in_kernel=l2)
        proj, sproj = r(*out.shape), r(*state.shape)
        grads = torch.autograd.grad((out * proj).sum() + (state * sproj).sum(), leaves)
        names = ["q", "k", "v", "g", "beta", "s0"]
        for nm, x, gx in zip(names, leaves, grads):
            t[f"{name}.{nm}"] = x
            t[f"{name}.d{nm}"] = gx
        t[f"{name}.out"], t[f"{name}.state"] = out, state
        t[f"{name}.proj"], t[f"{name}.sproj"] = proj, sproj
    return t

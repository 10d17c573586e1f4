"""Matrix products: plain, batched, broadcast batch, transposed operands."""
import torch


def make():
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g)
    t = {}
    t["mm.a"], t["mm.b"] = r(37, 64), r(64, 29)
    t["mm.out"] = t["mm.a"] @ t["mm.b"]
    t["bmm.a"], t["bmm.b"] = r(3, 17, 40), r(3, 40, 9)
    t["bmm.out"] = t["bmm.a"] @ t["bmm.b"]
    t["linear.x"], t["linear.w"] = r(2, 11, 48), r(24, 48)
    t["linear.out"] = t["linear.x"] @ t["linear.w"].T
    t["bcast.a"], t["bcast.b"] = r(5, 1, 6, 8), r(4, 8, 3)
    t["bcast.out"] = t["bcast.a"] @ t["bcast.b"]
    return t

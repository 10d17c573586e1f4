"""Indexing, shape and MoE ops: topk, gather, scatter_add, index_select, where, masked_fill,
cat/stack, and the grouped (per-expert) matmul with its gradients."""
import torch


def make():
    g = torch.Generator().manual_seed(2)
    r = lambda *s: torch.randn(*s, generator=g)
    ri = lambda hi, *s: torch.randint(0, hi, s, generator=g)
    t = {}

    t["topk.x"] = r(4, 10)
    t["topk.values"], t["topk.indices"] = torch.topk(t["topk.x"], 3, dim=1, largest=True, sorted=True)
    t["topk_min.x"] = r(6, 5)
    t["topk_min.values"], t["topk_min.indices"] = torch.topk(t["topk_min.x"], 2, dim=0, largest=False)

    t["gather.x"], t["gather.idx"] = r(3, 5, 4), ri(5, 3, 2, 4)
    t["gather.out"] = torch.gather(t["gather.x"], 1, t["gather.idx"])
    # An index smaller than the input in the other dims.
    t["gather_small.x"], t["gather_small.idx"] = r(3, 5, 4), ri(3, 2, 7, 3)
    t["gather_small.out"] = torch.gather(t["gather_small.x"], 1, t["gather_small.idx"])

    t["scatter_add.x"], t["scatter_add.idx"], t["scatter_add.src"] = r(4, 6), ri(4, 3, 6), r(5, 6)
    t["scatter_add.out"] = t["scatter_add.x"].scatter_add(0, t["scatter_add.idx"], t["scatter_add.src"])
    t["scatter_add1.x"], t["scatter_add1.idx"], t["scatter_add1.src"] = r(2, 3, 5), ri(5, 2, 3, 7), r(2, 4, 8)
    t["scatter_add1.out"] = t["scatter_add1.x"].scatter_add(2, t["scatter_add1.idx"], t["scatter_add1.src"])

    t["index_select.x"] = r(5, 3, 4)
    t["index_select.idx0"] = torch.tensor([4, 0, 2, 2, 1])
    t["index_select.out0"] = torch.index_select(t["index_select.x"], 0, t["index_select.idx0"])
    t["index_select.idx2"] = torch.tensor([3, 0, 3], dtype=torch.int32)
    t["index_select.out2"] = torch.index_select(t["index_select.x"], 2, t["index_select.idx2"].long())

    t["where.cond"] = (r(3, 1) > 0).float()
    t["where.a"], t["where.b"] = r(3, 4), r(4)
    t["where.out"] = torch.where(t["where.cond"] != 0, t["where.a"], t["where.b"])
    t["masked_fill.x"] = r(2, 3, 4)
    t["masked_fill.mask"] = ri(2, 3, 1)
    t["masked_fill.out"] = t["masked_fill.x"].masked_fill(t["masked_fill.mask"] != 0, -1.5)

    t["cat.a"], t["cat.b"], t["cat.c"] = r(2, 3), r(2, 1), r(2, 4)
    t["cat.out"] = torch.cat([t["cat.a"], t["cat.b"], t["cat.c"]], dim=1)
    t["stack.out"] = torch.stack([t["cat.a"], t["cat.a"] * 2, t["cat.a"] - 1], dim=1)

    # Grouped matmul: rows sorted by expert, reference loops over experts.
    counts = [4, 0, 6, 3]
    x = r(sum(counts), 8).requires_grad_()
    w = r(len(counts), 8, 6).requires_grad_()
    outs, start = [], 0
    for e, c in enumerate(counts):
        outs.append(x[start:start + c] @ w[e])
        start += c
    out = torch.cat(outs)
    grad = r(*out.shape)
    out.backward(grad)
    t["gmm.x"], t["gmm.w"], t["gmm.counts"] = x, w, torch.tensor(counts)
    t["gmm.out"], t["gmm.grad"] = out, grad
    t["gmm.grad_x"], t["gmm.grad_w"] = x.grad, w.grad
    return t

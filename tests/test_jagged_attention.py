"""Jagged causal attention (length buckets, no B x Lmax padding) equals the padded-and-masked reference and each
sequence alone, forward and backward (float32, atol 1e-5), for SASRec's softmax attention and HSTU's pointwise one."""

import pytest
import torch

from lightning_rec.models.jagged_attention import (
    causal_softmax_attend,
    jagged_attention,
    per_sequence_reference,
)
from lightning_rec.models.sequential import HSTUAttend, positions_from_end, time_bucket

TOL = dict(atol=1e-5, rtol=1e-5)


def _inputs(lengths, H=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    qkv = [torch.randn(T, H, d, generator=g, dtype=torch.float32, requires_grad=True) for _ in range(3)]
    times = torch.cumsum(torch.randint(0, 5000, (T,), generator=g), 0)
    return qkv, torch.tensor(lengths), times


def _hstu(lengths_B, max_len=64, H=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    pos_w = torch.randn(2 * max_len - 1, generator=g).requires_grad_()
    ts_w = torch.randn(129, generator=g).requires_grad_()
    return HSTUAttend(pos_w, ts_w, max_len, 128), (pos_w, ts_w)


def _grads(out, tensors):
    ramp = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)
    return torch.autograd.grad((out * ramp).sum(), tensors)


@pytest.mark.parametrize("lengths", [[5, 50, 3, 1, 17, 0, 32], [1], [7, 7, 7], [2, 40]])
@pytest.mark.parametrize("kind", ["softmax", "hstu"])
def test_bucketed_equals_padded_and_per_sequence(lengths, kind):
    (q, k, v), lengths_B, times = _inputs(lengths)
    params = (q, k, v)
    if kind == "softmax":
        attend, extras = causal_softmax_attend, ()
    else:
        attend, weights = _hstu(lengths_B)
        params = params + weights
        extras = (times, torch.repeat_interleave(lengths_B, lengths_B))
    outs = [jagged_attention(q, k, v, lengths_B, attend, extras, bucketed=True),
            jagged_attention(q, k, v, lengths_B, attend, extras, bucketed=False)]
    if kind == "softmax":  # HSTU's `attend` reads each position's own length from extras: padded form only
        outs.append(per_sequence_reference(q, k, v, lengths_B, attend))
    for out in outs[1:]:
        torch.testing.assert_close(outs[0], out, **TOL)
    grads = [_grads(out, params) for out in outs]
    for g in grads[1:]:
        for a, b in zip(grads[0], g):
            torch.testing.assert_close(a, b, **TOL)


def test_hstu_attention_matches_a_loop():
    """HSTU's attention as the paper writes it, one query at a time:
    out_i = sum_{j<=i} SiLU(q_i.k_j + p[j-i] + t[bucket(time_{i+1} - time_j)]) / N v_j."""
    (q, k, v), lengths_B, times = _inputs([6, 3], H=1, d=4)
    attend, (pos_w, ts_w) = _hstu(lengths_B, max_len=8)
    out = jagged_attention(q, k, v, lengths_B, attend, (times, torch.repeat_interleave(lengths_B, lengths_B)))
    start = 0
    for n in lengths_B.tolist():
        for i in range(n):
            t_next = times[start + min(i + 1, n - 1)]
            acc = torch.zeros(4)
            for j in range(i + 1):
                s = (q[start + i, 0] @ k[start + j, 0] + pos_w[8 - 1 + j - i]
                     + ts_w[time_bucket(t_next - times[start + j], 128)])
                acc = acc + torch.nn.functional.silu(s) / 8 * v[start + j, 0]
            torch.testing.assert_close(out[start + i, 0], acc, **TOL)
        start += n


def test_empty_batch_keeps_the_graph():
    (q, k, v), lengths_B, _ = _inputs([])
    out = jagged_attention(q, k, v, lengths_B)
    assert out.shape == (0, 2, 8)
    out.sum().backward()  # no error: an empty batch still backpropagates (zeros)
    assert q.grad is not None


def test_positions_from_end():
    assert positions_from_end(torch.tensor([3, 1, 2])).tolist() == [2, 1, 0, 0, 1, 0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("lengths", [[5, 50, 3, 1, 17, 0, 32], [1], [7, 7, 7], [2, 300]])
def test_cuda_nested_tensor_attention_equals_each_sequence_alone_on_the_cpu(lengths):
    """On CUDA softmax attention runs on torch's jagged nested tensors (no padding at all): forward and backward
    against each sequence alone on the CPU. 1e-4: the GPU's SDPA kernels sum in their own order."""
    from lightning_rec.models.jagged_attention import _nested_sdpa_ok

    (q, k, v), lengths_B, _ = _inputs(lengths)
    gpu = [x.detach().cuda().requires_grad_() for x in (q, k, v)]
    assert _nested_sdpa_ok(gpu[0]), "this torch cannot run causal SDPA on jagged nested tensors on CUDA"
    out_gpu = jagged_attention(*gpu, lengths_B.cuda())
    out_cpu = per_sequence_reference(q, k, v, lengths_B)
    torch.testing.assert_close(out_gpu.cpu(), out_cpu, atol=1e-4, rtol=1e-4)
    for a, b in zip(_grads(out_gpu, gpu), _grads(out_cpu, (q, k, v))):
        torch.testing.assert_close(a.cpu(), b, atol=1e-4, rtol=1e-4)

"""DLRM's dot interaction as one CPU kernel (csrc/interaction_cpu.cpp), with its autograd and fake kernels (so the
op also runs under torch.compile, torch.export and on the meta device).

Legend: B batch, F sparse features, N = F + 1 vectors, D dim, P = N (N - 1) / 2 pairs.

    dot_interaction(dense_BD, sparse_BFD) -> [B, D + P]   = cat([dense, (V V^T)[triu_indices(N, N, 1)]])

InteractionArch calls the dot kernel through `use_fused`: eager CPU float32 / float64 with the extension built
(forward + backward 2.7x-3.2x the composed ops at B 2048, F 26, D 64 / 128 on one thread: benchmarks/interaction.py).
Anywhere else (a GPU, another dtype, torch.compile or torch.export tracing) it keeps the composed ops, so that
Inductor fuses its own way and an exported serving package needs only torch and fbgemm, not this library's kernels.
DCNv2's cross layers keep torch's ops: their time is the GEMMs, and a one-pass epilogue x0 * (z + b) + x did not beat
mul + add on the CPU (three layers forward + backward 0.94x-1.01x)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_rec._native import native_kernel_available

# an extension built before these kernels existed has none of them: the composed ops run
_BUILT = native_kernel_available() and hasattr(torch.ops.lightning_rec, "dot_interaction")
_DTYPES = (torch.float32, torch.float64)


def fused_interaction_available() -> bool:
    """True when the extension with the interaction kernel is built."""
    return _BUILT


def use_fused(*tensors: Tensor) -> bool:
    """Whether the fused kernel takes these tensors: built, eager (not traced), CPU, all float32 or all float64."""
    if not _BUILT or torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return False
    dtype = tensors[0].dtype
    return dtype in _DTYPES and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)


def dot_interaction(dense_BD: Tensor, sparse_BFD: Tensor) -> Tensor:
    """[B, D + P]: the dense vector, then the pairwise dot products of the N vectors (dense first), i < j row-major."""
    return torch.ops.lightning_rec.dot_interaction(dense_BD, sparse_BFD)


def _fake_dot(dense_BD, sparse_BFD):
    B, D = dense_BD.shape
    N = sparse_BFD.shape[1] + 1
    return dense_BD.new_empty((B, D + N * (N - 1) // 2))


def _fake_dot_backward(grad, dense_BD, sparse_BFD):
    return torch.empty_like(dense_BD), torch.empty_like(sparse_BFD)


def _save_inputs(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


# Grad mode on in a backward means create_graph=True: the gradient must be differentiable itself, and the backward
# kernels have no autograd of their own, so the composed ops compute it then.
def _dot_backward(ctx, grad_BO):
    dense_BD, sparse_BFD = ctx.saved_tensors
    if not torch.is_grad_enabled():
        return tuple(torch.ops.lightning_rec.dot_interaction_backward(grad_BO, dense_BD, sparse_BFD))
    B, D = dense_BD.shape
    N = sparse_BFD.shape[1] + 1
    rows, cols = torch.triu_indices(N, N, offset=1, device=dense_BD.device)
    pairs_BNN = grad_BO.new_zeros(B, N * N).index_copy(1, rows * N + cols, grad_BO[:, D:]).view(B, N, N)
    vectors_BND = torch.cat([dense_BD.unsqueeze(1), sparse_BFD], dim=1)
    grad_BND = torch.bmm(pairs_BNN + pairs_BNN.transpose(1, 2), vectors_BND)
    return grad_BO[:, :D] + grad_BND[:, 0], grad_BND[:, 1:]


if _BUILT:
    for _name, _fake in (("dot_interaction", _fake_dot), ("dot_interaction_backward", _fake_dot_backward)):
        torch.library.register_fake(f"lightning_rec::{_name}")(_fake)
    torch.library.register_autograd("lightning_rec::dot_interaction", _dot_backward, setup_context=_save_inputs)

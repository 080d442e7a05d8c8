"""The fused CPU dot interaction (csrc/interaction_cpu.cpp) against the composed ops they replace: outputs and
gradients, odd sizes, strided inputs, their registrations (fake, autograd, torch.compile, torch.export, meta), and a
DLRM training run that gives the same losses either way (DLRM-DCNv2 keeps the composed ops: fused_interaction.py).

Tolerances: float32 sums in another order than bmm / torch's reductions, so 1e-6 relative to the largest magnitude
of the compared tensor; float64 to 1e-12."""

import pytest
import torch

from lightning_rec.models import DLRM, InteractionArch
from lightning_rec.models.fused_interaction import (
    dot_interaction,
    fused_interaction_available,
    use_fused,
)

pytestmark = pytest.mark.skipif(not fused_interaction_available(), reason="the C++ extension is not built")


def close(actual, expected):
    tol = 1e-6 if expected.dtype == torch.float32 else 1e-12
    scale = max(expected.abs().amax().item() if expected.numel() else 0.0, 1.0)
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * scale)


def composed_dot(dense_BD, sparse_BFD):
    return InteractionArch(sparse_BFD.shape[1], fused=False)(dense_BD, sparse_BFD)


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def check_against_composed(fused_fn, composed_fn, inputs):
    """Forward and every input's gradient (a random output gradient), fused vs composed."""
    a, b = leaves(*inputs), leaves(*inputs)
    out_a, out_b = fused_fn(*a), composed_fn(*b)
    close(out_a, out_b)
    grad = torch.randn_like(out_b)
    out_a.backward(grad)
    out_b.backward(grad)
    for x, y in zip(a, b):
        close(x.grad, y.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("B", "F", "D"), [(1, 1, 1), (1, 26, 64), (3, 1, 5), (5, 4, 17), (7, 26, 128),
                                           (2, 3, 33), (0, 3, 8)])
def test_dot_interaction_matches_the_composed_ops(B, F, D, dtype):
    g = torch.Generator().manual_seed(B * 100 + F * 10 + D)
    dense, sparse = torch.randn(B, D, generator=g, dtype=dtype), torch.randn(B, F, D, generator=g, dtype=dtype)
    check_against_composed(dot_interaction, composed_dot, (dense, sparse))


def test_dot_interaction_reads_strided_inputs():
    """A transposed sparse block and a column-sliced dense block: the kernel copies them contiguous once."""
    g = torch.Generator().manual_seed(1)
    sparse = torch.randn(6, 16, 5, generator=g).transpose(1, 2)  # [6, 5, 16], not contiguous
    dense = torch.randn(6, 32, generator=g)[:, ::2]
    assert not (sparse.is_contiguous() or dense.is_contiguous())
    close(dot_interaction(dense, sparse), composed_dot(dense, sparse))
    a, b = (sparse.detach().requires_grad_(), dense.detach().requires_grad_())
    grad = torch.randn(6, 16 + 15, generator=g).t().contiguous().t()  # a strided output gradient too
    dot_interaction(b, a).backward(grad)
    ga, gb = a.grad, b.grad
    a.grad = b.grad = None
    composed_dot(b, a).backward(grad)
    close(ga, a.grad)
    close(gb, b.grad)


def test_dot_interaction_gradcheck():
    g = torch.Generator().manual_seed(2)
    dense = torch.randn(3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    sparse = torch.randn(3, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(dot_interaction, (dense, sparse))


def test_second_derivatives_are_right():
    """create_graph=True: the gradient is differentiable (through the composed ops), not silently a constant."""
    g = torch.Generator().manual_seed(6)
    dense = torch.randn(3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    sparse = torch.randn(3, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(dot_interaction, (dense, sparse))


def test_kernels_refuse_bad_input_by_name():
    with pytest.raises(RuntimeError, match=r"dense must be \[B, D\] and sparse \[B, F, D\]"):
        dot_interaction(torch.randn(2, 4), torch.randn(2, 3, 5))
    with pytest.raises(RuntimeError, match="must both be float32 or both float64"):
        dot_interaction(torch.randn(2, 4), torch.randn(2, 3, 4, dtype=torch.float64))


def test_registrations_pass_torch_library_opcheck():
    """Schema, fake kernel, autograd registration and AOT dispatch, as torch.compile and torch.export use them."""
    g = torch.Generator().manual_seed(4)
    dense, sparse = torch.randn(3, 6, generator=g, requires_grad=True), torch.randn(3, 2, 6, generator=g,
                                                                                     requires_grad=True)
    torch.library.opcheck(torch.ops.lightning_rec.dot_interaction.default, (dense, sparse))


def test_ops_run_on_meta_tensors_and_under_torch_compile():
    dense, sparse = torch.empty(4, 8, device="meta"), torch.empty(4, 26, 8, device="meta")
    assert dot_interaction(dense, sparse).shape == (4, 8 + 27 * 26 // 2)

    def both(dense, sparse):
        return dot_interaction(dense, sparse).square().sum()

    g = torch.Generator().manual_seed(5)
    inputs = [torch.randn(5, 4, generator=g), torch.randn(5, 3, 4, generator=g)]
    a, b = leaves(*inputs), leaves(*inputs)
    compiled = torch.compile(both, backend="aot_eager", fullgraph=True)
    compiled(*a).backward()
    both(*b).backward()
    for x, y in zip(a, b):
        close(x.grad, y.grad)


def test_export_and_compile_keep_the_composed_ops():
    """A serving package (torch.export, then AOTInductor) must load with torch and fbgemm alone, and Inductor fuses
    its own way: traced, the archs take the composed ops; eager CPU takes the kernels."""
    arch = InteractionArch(3)
    dense, sparse = torch.randn(4, 8), torch.randn(4, 3, 8)
    assert use_fused(dense, sparse) and not use_fused(dense.double(), sparse)
    program = torch.export.export(arch, (dense, sparse), strict=False)
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not any("lightning_rec" in t for t in targets), targets
    close(program.module()(dense, sparse), arch(dense, sparse))
    compiled = torch.compile(arch, backend="aot_eager", fullgraph=True)
    close(compiled(dense, sparse), arch(dense, sparse))


def test_dlrm_training_losses_are_the_same_fused_or_composed():
    """Five SGD steps (dense) with row-wise Adagrad tables, from the same initial weights and batches."""
    from tests.test_models import ebc, kjt

    losses = {}
    for fused in (True, False):
        torch.manual_seed(0)
        model = DLRM(ebc(dim=8), dense_in_features=5, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[8, 1])
        model.inter_arch.fused = fused
        dense_params = [p for n, p in model.named_parameters() if not n.startswith("sparse_arch.")]
        opt = torch.optim.SGD(dense_params, lr=0.1)
        torch.manual_seed(1)
        losses[fused] = []
        for _ in range(5):
            dense, sparse, labels = torch.randn(13, 5), kjt(13, ids_per_feature=2), torch.randint(0, 2, (13,))
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, sparse).squeeze(1),
                                                                        labels.float())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[fused].append(loss.item())
    # float32, another summation order in the interaction: the losses agree to a few ulps after five updates
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), rtol=1e-6, atol=1e-7)

"""Gradient accumulation through fused tables: what k = 4 micro-batches cost against one batch, and what they hold.

    python benchmarks/accumulation.py            # 4 tables x 100k rows x 64, batch 4096, 5 rounds (CPU, native kernel)
    python benchmarks/accumulation.py --smoke    # seconds: tiny tables, 1 round

One process, one EmbeddingBagCollection (fused row-wise Adagrad) and a small dense MLP. Each round times, alternating:
  k1: one step on a batch of B (forward, backward with the fused update, dense optimizer step);
  plain4: 4 ordinary steps on the same B samples as 4 micro-batches of B/4 (what accumulation replaces);
  k4: the 4 micro-batches, the first 3 under gather_fused_gradients (each backward adds its rows' gradients to the
      kernels' buffers of unique rows: one C++ pass, csrc/gather_rows_cpu.cpp), the 4th applying them in one update;
  k4_torch: k4 with the buffer kept by torch ops (unique + index_add_: the path off CPU or without the extension).
Figures are medians over the rounds; ratios.step_k4_vs_k1 = median k4 step / median k1 step, step_k4_vs_plain4 the
same against the 4 plain steps.

figures.max_rel_diff_k4_vs_one_step: the largest relative difference (max |diff| / max |value| per tensor) between the
tables and fused optimizer state after one step on B and after 4 accumulated micro-batches of B/4, over the 5 CPU
fused optimizers (sgd, adagrad, rowwise_adagrad, adam, partial_rowwise_adam).
figures.extra_bytes_vs_bound: the buffers' bytes after the 3 gathered micro-batches and the 4th's gradients (the most
they hold: gradients in float32 and each row's int64 id) over the bound (unique rows touched) x dim x 4 bytes;
figures.grad_bytes_vs_bound is the gradients' part alone. A busy machine moves the times, not these.

Last line: {"benchmark": "accumulation", "results": [...], "ratios": {...}, "figures": {...}}.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import time
from unittest import mock

import torch

from lightning_rec import lookup
from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_rec.optim import FusedOptimizer, FusedOptimizerConfig, gather_fused_gradients
from lightning_rec.sparse import KeyedJaggedTensor

K = 4
OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam", "partial_rowwise_adam")


def _batch(tables: int, rows: int, B: int, ids_per_bag: int, seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 2 * ids_per_bag, (tables * B,), generator=g)
    # skewed ids, as real categorical features are: a few hot rows, a long tail
    values = (torch.rand(int(lengths.sum()), generator=g) ** 3 * rows).long()
    return KeyedJaggedTensor.from_lengths_sync([f"f{t}" for t in range(tables)], values, lengths)


def _bags(kjt: KeyedJaggedTensor, lo: int, hi: int) -> KeyedJaggedTensor:
    vals, lens = [], []
    for jt in kjt.to_dict().values():
        off = jt.offsets()
        vals.append(jt.values()[off[lo] : off[hi]])
        lens.append(jt.lengths()[lo:hi])
    return KeyedJaggedTensor.from_lengths_sync(kjt.keys(), torch.cat(vals), torch.cat(lens))


class _Model(torch.nn.Module):
    def __init__(self, tables: int, rows: int, dim: int, optimizer: str) -> None:
        super().__init__()
        configs = [EmbeddingBagConfig(name=f"t{t}", num_embeddings=rows, embedding_dim=dim, feature_names=[f"f{t}"])
                   for t in range(tables)]
        self.ebc = EmbeddingBagCollection(configs, optimizer=FusedOptimizerConfig(optimizer, lr=0.05))
        self.mlp = torch.nn.Sequential(torch.nn.Linear(tables * dim, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))

    def loss(self, kjt: KeyedJaggedTensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.mlp(self.ebc(kjt).values()).squeeze(1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)


def _step(model: _Model, dense: torch.optim.Optimizer, kjt, labels, k: int) -> None:
    """One optimizer step over the batch as k micro-batches (Lightning's loss / k scaling)."""
    b = labels.numel() // k
    for m in range(k):
        with gather_fused_gradients(model) if m < k - 1 else contextlib.nullcontext():
            (model.loss(_bags(kjt, m * b, (m + 1) * b), labels[m * b : (m + 1) * b]) / k).backward()
    dense.step()
    dense.zero_grad()


def _plain_steps(model: _Model, dense: torch.optim.Optimizer, kjt, labels, k: int) -> None:
    """k ordinary steps on the batch's k micro-batches (what accumulation replaces)."""
    b = labels.numel() // k
    for m in range(k):
        model.loss(_bags(kjt, m * b, (m + 1) * b), labels[m * b : (m + 1) * b]).backward()
        dense.step()
        dense.zero_grad()


def _step_torch_buffer(model: _Model, dense: torch.optim.Optimizer, kjt, labels, k: int) -> None:
    """_step with the buffer kept by torch ops (the path off CPU, or without the compiled extension)."""
    with mock.patch.object(lookup, "native_op", lambda name: None):
        _step(model, dense, kjt, labels, k)


VARIANTS = {"k1": (_step, 1), "plain4": (_plain_steps, K), "k4": (_step, K), "k4_torch": (_step_torch_buffer, K)}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    if not b.numel():
        return 0.0
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def max_rel_diff(tables: int, rows: int, dim: int, B: int, ids_per_bag: int) -> dict[str, float]:
    """Per optimizer: tables and fused state after one step on B vs 4 accumulated micro-batches of B/4."""
    out = {}
    kjt = _batch(tables, rows, B, ids_per_bag, seed=7)
    labels = (torch.rand(B, generator=torch.Generator().manual_seed(8)) < 0.25).float()
    for opt in OPTIMIZERS:
        torch.manual_seed(0)
        one = _Model(tables, rows, dim, opt)
        acc = copy.deepcopy(one)
        for model, k in ((one, 1), (acc, K)):
            _step(model, torch.optim.SGD(model.mlp.parameters(), lr=0.05), kjt, labels, k)
        worst = max(_relative(acc.ebc.state_dict()[n], w) for n, w in one.ebc.state_dict().items())
        s1, s2 = FusedOptimizer(one.ebc).state_dict()["state"], FusedOptimizer(acc.ebc).state_dict()["state"]
        out[opt] = max([worst] + [_relative(s2[n], s1[n]) for n in s1])
    return out


def held_bytes(model: _Model, kjt: KeyedJaggedTensor, labels: torch.Tensor, dim: int) -> tuple[int, int, int]:
    """(bytes the buffers hold with all 4 micro-batches gathered, their gradients' part, the bound)."""
    b = labels.numel() // K
    kernels = model.ebc.fused_kernels()
    with gather_fused_gradients(model):
        for m in range(K):
            (model.loss(_bags(kjt, m * b, (m + 1) * b), labels[m * b : (m + 1) * b]) / K).backward()
    held = sum(k.gathered_bytes() for k in kernels)
    grads = sum(g.numel() * 4 for k in kernels for _, g in k._gathered.values())
    unique = sum(int(jt.values().unique().numel()) for jt in kjt.to_dict().values())
    FusedOptimizer(model.ebc).step()  # applies them
    return held, grads, unique * dim * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--ids-per-bag", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds; figures are medians")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round and variant")
    parser.add_argument("--smoke", action="store_true", help="tiny tables, 1 round: checks the code path")
    args = parser.parse_args()
    if args.smoke:
        args.tables, args.rows, args.dim, args.batch, args.rounds, args.steps = 2, 500, 8, 64, 1, 2

    torch.manual_seed(0)
    model = _Model(args.tables, args.rows, args.dim, "rowwise_adagrad")
    dense = torch.optim.SGD(model.mlp.parameters(), lr=0.05)
    batches = [(_batch(args.tables, args.rows, args.batch, args.ids_per_bag, seed=s),
                (torch.rand(args.batch, generator=torch.Generator().manual_seed(100 + s)) < 0.25).float())
               for s in range(args.steps)]
    for fn, k in VARIANTS.values():  # warm-up, every path
        fn(model, dense, *batches[0], k)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, (fn, k) in VARIANTS.items():
            for kjt, labels in batches:
                start = time.perf_counter()
                fn(model, dense, kjt, labels, k)
                times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(v) for name, v in times.items()}
    ratio = med["k4"] / med["k1"]

    held, grads, bound = held_bytes(model, *batches[0], args.dim)
    parity_rows = min(args.rows, 20_000)  # five optimizers' copies of the tables
    diffs = max_rel_diff(args.tables, parity_rows, args.dim, min(args.batch, 1024), args.ids_per_bag)

    print(f"{args.tables} tables x {args.rows} rows x {args.dim}, batch {args.batch}, {args.rounds} rounds "
          f"x {args.steps} steps (median step times)")
    b = args.batch // K
    print(f"  k1        one step on a batch of {args.batch}:                 {med['k1'] * 1e3:8.2f} ms")
    print(f"  plain4    {K} plain steps on micro-batches of {b}:           {med['plain4'] * 1e3:8.2f} ms   "
          f"({med['plain4'] / med['k1']:.2f}x k1)")
    print(f"  k4        {K} micro-batches of {b} accumulated, one update: {med['k4'] * 1e3:8.2f} ms   "
          f"({ratio:.2f}x k1, {med['k4'] / med['plain4']:.2f}x plain4)")
    print(f"  k4_torch  the same, buffer kept by torch ops:           {med['k4_torch'] * 1e3:8.2f} ms   "
          f"({med['k4_torch'] / med['k1']:.2f}x k1)")
    print(f"  buffers after {K} micro-batches: {held / 2**20:.2f} MiB held, bound (unique rows x dim x 4) "
          f"{bound / 2**20:.2f} MiB: {held / bound:.3f}x (gradients alone {grads / bound:.3f}x; the rest is ids)")
    for opt, d in diffs.items():
        print(f"  {opt:22s} max relative diff, {K} micro-batches vs one step: {d:.3g}")
    figures = {"step_k1_ms": round(med["k1"] * 1e3, 3), "step_k4_ms": round(med["k4"] * 1e3, 3),
               "max_rel_diff_k4_vs_one_step": max(diffs.values()),
               "max_rel_diff_per_optimizer": {k: float(f"{v:.3g}") for k, v in diffs.items()},
               "extra_bytes": held, "bound_bytes": bound, "extra_bytes_vs_bound": round(held / bound, 4),
               "grad_bytes_vs_bound": round(grads / bound, 4)}
    results = [{"variant": name, "micro_batch": args.batch // k, "median_step_ms": round(med[name] * 1e3, 3),
                "steps": len(times[name])} for name, (_, k) in VARIANTS.items()]
    ratios = {"step_k4_vs_k1": round(ratio, 3), "step_k4_vs_plain4": round(med["k4"] / med["plain4"], 3),
              "step_plain4_vs_k1": round(med["plain4"] / med["k1"], 3),
              "step_k4_torch_vs_k1": round(med["k4_torch"] / med["k1"], 3)}
    print(json.dumps({"benchmark": "accumulation", "results": results, "ratios": ratios, "figures": figures}))


if __name__ == "__main__":
    main()

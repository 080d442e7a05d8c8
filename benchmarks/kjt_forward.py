"""Per-batch cost of a KeyedJaggedTensor built as a data loader builds it, and of the collection's forward on it.

    python benchmarks/kjt_forward.py [--rounds 7] [--rows 100000] [--threads 1]
    python benchmarks/kjt_forward.py --smoke          # seconds: 1,000-row tables, 2 rounds

Per batch size (2048, and 128 where per-batch overhead dominates), two variants over the same pre-made
tensors (26 features like Criteo, one id each, int64 values and lengths, as the Criteo readers hand them over):

    construct   KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, stride=B): the batch a loader yields
    forward     the same construction + an unsharded EmbeddingBagCollection forward (26 tables x --rows x dim 64,
                fused row-wise Adagrad, the default kernel, training mode, no backward)

Variants and batch sizes alternate over --rounds rounds (the order swaps every round); each figure is the median
over rounds of the microseconds per batch. Only public names are used (lightning_rec.KeyedJaggedTensor,
EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig), so the same file measures an older checkout
(PYTHONPATH=that/checkout python benchmarks/kjt_forward.py) in the same minutes, for a before / after.
Last line: {"benchmark": "kjt_forward", "results": [...], "ratios": {"kjt_construct_share_b<B>"},
"figures": {"kjt_construct_us": {"<B>": us}, "ebc_forward_us": {"<B>": us}, "lightning_rec": the package measured}}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

NUM_TABLES, DIM = 26, 64
KEYS = [f"C{i + 1}" for i in range(NUM_TABLES)]


def make_inputs(batch: int, rows: int, count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` distinct batches of (values, lengths): key-major, one id per feature per sample."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, rows, (NUM_TABLES * batch,), generator=g),
             torch.ones(NUM_TABLES * batch, dtype=torch.int64)) for _ in range(count)]


def build_collection(rows: int):
    from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig

    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=DIM, feature_names=[key])
              for i, key in enumerate(KEYS)]
    return EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig("rowwise_adagrad", lr=0.01))


def variants(ebc, batch: int):
    from lightning_rec import KeyedJaggedTensor

    def construct(values: torch.Tensor, lengths: torch.Tensor):
        return KeyedJaggedTensor.from_lengths_sync(KEYS, values, lengths, stride=batch)

    def forward(values: torch.Tensor, lengths: torch.Tensor):
        return ebc(construct(values, lengths)).values()

    return {"construct": construct, "forward": forward}


def us_per_batch(step, inputs: list, iters: int) -> float:
    start = time.perf_counter()
    for i in range(iters):
        step(*inputs[i % len(inputs)])
    return (time.perf_counter() - start) / iters * 1e6


def measure(args) -> dict[tuple[int, str], list[float]]:
    """Microseconds per batch of each (batch size, variant), one entry per round."""
    ebc = build_collection(args.rows)
    cells = {}
    for batch in args.batches:
        inputs = make_inputs(batch, args.rows, 8, seed=batch)
        iters = max(args.min_iters, args.samples // batch)
        for name, step in variants(ebc, batch).items():
            us_per_batch(step, inputs, max(3, iters // 10))  # warm-up: first calls, allocator, kernels
            cells[(batch, name)] = (step, inputs, iters)
    times: dict[tuple[int, str], list[float]] = {key: [] for key in cells}
    order = list(cells)
    for r in range(args.rounds):  # alternating: the machine drifts, both variants see the same minutes
        for key in order if r % 2 == 0 else order[::-1]:
            step, inputs, iters = cells[key]
            times[key].append(us_per_batch(step, inputs, iters))
    return times


def report(args, times: dict[tuple[int, str], list[float]]) -> None:
    med = {key: statistics.median(v) for key, v in times.items()}
    print(f"KJT construction + EmbeddingBagCollection forward: {NUM_TABLES} tables x {args.rows:,} rows x dim {DIM}, "
          f"{torch.get_num_threads()} thread(s), median of {args.rounds} alternating rounds (us per batch)")
    print(f"{'batch':>6}{'construct':>12}{'construct+forward':>20}{'construct share':>17}")
    figures: dict = {"kjt_construct_us": {}, "ebc_forward_us": {}}
    ratios, results = {}, []
    for batch in args.batches:
        construct, forward = med[(batch, "construct")], med[(batch, "forward")]
        print(f"{batch:>6}{construct:>12.1f}{forward:>20.1f}{construct / forward:>17.3f}")
        figures["kjt_construct_us"][str(batch)] = round(construct, 2)
        figures["ebc_forward_us"][str(batch)] = round(forward, 2)
        ratios[f"kjt_construct_share_b{batch}"] = round(construct / forward, 4)
        for name in ("construct", "forward"):
            results.append({"batch": batch, "variant": name, "median_us": round(med[(batch, name)], 2),
                            "per_round_us": [round(t, 2) for t in times[(batch, name)]]})
    import lightning_rec

    figures |= {"rows": args.rows, "tables": NUM_TABLES, "dim": DIM, "threads": torch.get_num_threads(),
                "rounds": args.rounds, "lightning_rec": str(Path(lightning_rec.__file__).parent)}  # which checkout
    print(json.dumps({"benchmark": "kjt_forward", "results": results, "ratios": ratios, "figures": figures}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--rows", type=int, default=100_000, help="rows per table")
    parser.add_argument("--batches", default="2048,128", help="batch sizes")
    parser.add_argument("--samples", type=int, default=200_000, help="samples per timed block (per variant)")
    parser.add_argument("--min-iters", type=int, default=20, help="batches per timed block, at least")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="seconds: 1,000-row tables, 2 short rounds")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.rounds, args.samples, args.min_iters = 1000, 2, 4096, 4
    args.batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    report(args, measure(args))


if __name__ == "__main__":
    main()

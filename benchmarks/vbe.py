"""Variable batch per feature (TorchRec's VBE) against the same batch expanded, 2 ranks (gloo), same run.

    python benchmarks/vbe.py [--batch 2048] [--per-request 32] [--steps 10] [--rounds 5]
    python benchmarks/vbe.py --smoke      # seconds: tiny tables, 2 steps, 1 round

A ranking batch per rank: `--batch` candidate rows, one request (user) row per `--per-request` candidates.
Features: 12 user histories (10..30 ids), 12 single-id user features, 2 candidate features (item id, item
category), one table each (50,000 rows x dim 32; smoke: 1,000 x 8), table-wise over the 2 ranks, fused row-wise
Adagrad, sum pooling, a linear layer over the pooled output. The VBE batch gives each user feature one bag per
request (`stride_per_key_per_rank`, `inverse_indices` mapping candidates to requests); the expanded batch gives every
candidate its request's bags (what a batch without VBE must hold). Both give the same output (checked first).

Bytes: what each rank sends through the id all-to-alls (counts, lengths + ids) and the pooled embedding all-to-all
(forward and backward) in one training step, counted at lightning_rec.input_dist.all_to_all over gloo
(DistributedModelParallel(shared_memory=False), where every exchange goes through it). Step time: forward + backward
+ fused update through the default transport (shared memory on one host), 1 thread per rank, the two batches in
alternating rounds of `--steps` steps; medians over rounds.
Last line: {"benchmark": "vbe", "results": [...], "ratios": {"a2a_bytes_expanded_vs_vbe" (id + pooled bytes,
expanded / VBE), "id_a2a_bytes_expanded_vs_vbe", "pooled_a2a_bytes_expanded_vs_vbe", "vbe_step_vs_expanded"
(expanded step time / VBE step time: > 1 is VBE faster)}, "figures": {"vbe_step_ms", "expanded_step_ms",
"vbe_a2a_bytes", "expanded_a2a_bytes", "ranks"}}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from dist_utils import collect_rows, free_port  # noqa: E402  (tests/dist_utils.py)

HISTORY = [f"user_history_{i}" for i in range(12)]
SINGLE = [f"user_{i}" for i in range(12)]
CANDIDATE = ["item_id", "item_category"]
KEYS = CANDIDATE + HISTORY + SINGLE
WORLD = 2


def _model(rows: int, dim: int):
    from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingBagConfig
    from lightning_rec.optim import FusedOptimizerConfig

    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t_{k}", num_embeddings=rows, embedding_dim=dim, feature_names=[k])
              for k in KEYS]
    ebc = EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig("rowwise_adagrad", lr=0.01))
    return torch.nn.ModuleDict({"ebc": ebc, "dense": torch.nn.Linear(dim * len(KEYS), 1)})


def _forward(dmp, kjt) -> torch.Tensor:
    return dmp.module["dense"](dmp.module["ebc"](kjt).values())


def _batches(rank: int, candidates: int, per_request: int, rows: int):
    """(VBE batch, the same batch expanded) of this rank."""
    from lightning_rec.sparse import KeyedJaggedTensor

    g = torch.Generator().manual_seed(rank)
    requests = candidates // per_request
    strides = [candidates if k in CANDIDATE else requests for k in KEYS]
    lengths = torch.cat([torch.randint(10, 31, (s,), generator=g) if k in HISTORY else torch.ones(s, dtype=torch.long)
                         for k, s in zip(KEYS, strides)])
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
    request_of = torch.arange(candidates) // per_request
    inverse = torch.stack([torch.arange(candidates) if k in CANDIDATE else request_of for k in KEYS])
    vbe = KeyedJaggedTensor(KEYS, values, lengths=lengths, stride_per_key_per_rank=[[s] for s in strides],
                            inverse_indices=(KEYS, inverse))
    full_l, full_v = [], []
    for k, row in zip(KEYS, inverse):  # each candidate given its request's bag (gathered by offsets)
        jt = vbe[k]
        lens = jt.lengths()[row]
        starts = torch.repeat_interleave(jt.offsets()[:-1][row] - (torch.cumsum(lens, 0) - lens), lens)
        full_l.append(lens)
        full_v.append(jt.values()[torch.arange(int(lens.sum())) + starts])
    full = KeyedJaggedTensor.from_lengths_sync(KEYS, torch.cat(full_v), torch.cat(full_l))
    return vbe.validate(), full


def _step(dmp, kjt) -> None:
    loss = _forward(dmp, kjt).sum()
    loss.backward()
    dmp.module["dense"].zero_grad(set_to_none=True)


def _count_bytes(dmp, kjt) -> dict[str, int]:
    """Bytes this rank sends per all-to-all kind in one step (forward + backward)."""
    import lightning_rec.input_dist as input_dist
    import lightning_rec.output_dist as output_dist

    sent: dict[str, int] = {"ids": 0, "pooled": 0}
    real = input_dist.all_to_all

    def counting(pg, out, inp, *args, **kwargs):
        what = args[2]
        sent["pooled" if "pooled" in what else "ids"] += inp.numel() * inp.element_size()
        return real(pg, out, inp, *args, **kwargs)

    input_dist.all_to_all = output_dist.all_to_all = counting
    try:
        _step(dmp, kjt)
    finally:
        input_dist.all_to_all = output_dist.all_to_all = real
    return sent


def _time_steps(dmp, kjt, steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        _step(dmp, kjt)
    dist.barrier()
    return (time.perf_counter() - start) / steps * 1e3


def rank_main(rank: int, port: int, args, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from lightning_rec.model_parallel import DistributedModelParallel, construct_module_sharding_plan, table_wise
    from lightning_rec.types import ShardingPlan

    vbe, full = _batches(rank, args.batch, args.per_request, args.rows)
    dmps = {}
    for transport in ("gloo", "default"):
        model = _model(args.rows, args.dim)
        layout = {f"t_{k}": table_wise(rank=i % WORLD) for i, k in enumerate(KEYS)}
        plan = ShardingPlan({"ebc": construct_module_sharding_plan(model["ebc"], layout, world_size=WORLD)})
        dmps[transport] = DistributedModelParallel(model, plan=plan, device="cpu", timeout=120,
                                                   shared_memory=False if transport == "gloo" else None)
    with torch.no_grad():  # the same output from both batches
        torch.testing.assert_close(_forward(dmps["gloo"], vbe), _forward(dmps["gloo"], full), atol=1e-5, rtol=0)
    sent = {"vbe": _count_bytes(dmps["gloo"], vbe), "expanded": _count_bytes(dmps["gloo"], full)}
    dmp = dmps["default"]
    _step(dmp, vbe)  # warm-up
    _step(dmp, full)
    times: dict[str, list[float]] = {"vbe": [], "expanded": []}
    for r in range(args.rounds):  # alternate (and swap which goes first), so both see the same machine
        for mode in ("vbe", "expanded") if r % 2 == 0 else ("expanded", "vbe"):
            times[mode].append(_time_steps(dmp, vbe if mode == "vbe" else full, args.steps))
    queue.put([(sent, times, vbe.values().numel(), full.values().numel())] if rank == 0 else [])
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=2048, help="candidate rows per rank")
    parser.add_argument("--per-request", type=int, default=32, help="candidate rows per request (user) row")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--smoke", action="store_true", help="seconds: tiny tables, 2 steps, 1 round")
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.steps, args.rounds, args.rows, args.dim = 128, 2, 1, 1000, 8
    port = free_port()
    if args.smoke:  # fork: the ranks start with torch and lightning_rec imported once (spawn: seconds a rank)
        import lightning_rec.model_parallel  # noqa: F401
    ctx = mp.get_context("fork" if args.smoke else "spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, port, args, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    (sent, times, ids_vbe, ids_full), = collect_rows(queue, procs)  # a rank that dies ends the run
    for p in procs:
        p.join()
    median = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    total = {k: v["ids"] + v["pooled"] for k, v in sent.items()}
    ratios = {
        "a2a_bytes_expanded_vs_vbe": round(total["expanded"] / total["vbe"], 2),
        "id_a2a_bytes_expanded_vs_vbe": round(sent["expanded"]["ids"] / sent["vbe"]["ids"], 2),
        "pooled_a2a_bytes_expanded_vs_vbe": round(sent["expanded"]["pooled"] / sent["vbe"]["pooled"], 2),
        "vbe_step_vs_expanded": round(median["expanded"] / median["vbe"], 2),
    }
    print(f"{WORLD} ranks x 1 thread; per rank {args.batch} candidate rows, 1 request row per {args.per_request}; "
          f"{len(KEYS)} features ({len(HISTORY)} histories, {len(SINGLE)} single-id, {len(CANDIDATE)} candidate); "
          f"ids per rank: VBE {ids_vbe}, expanded {ids_full}")
    print(f"{'batch':<10}{'id a2a bytes':>14}{'pooled a2a bytes':>18}{'step ms (median)':>18}   rounds")
    for mode in ("expanded", "vbe"):
        print(f"{mode:<10}{sent[mode]['ids']:>14}{sent[mode]['pooled']:>18}{median[mode]:>18.2f}   "
              f"{[round(t, 2) for t in times[mode]]}")
    print(f"expanded / VBE: a2a bytes x{ratios['a2a_bytes_expanded_vs_vbe']} "
          f"(ids x{ratios['id_a2a_bytes_expanded_vs_vbe']}, pooled x{ratios['pooled_a2a_bytes_expanded_vs_vbe']}), "
          f"step time x{ratios['vbe_step_vs_expanded']}")
    results = [dict(batch=mode, id_a2a_bytes=sent[mode]["ids"], pooled_a2a_bytes=sent[mode]["pooled"],
                    step_ms=round(median[mode], 3), round_ms=[round(t, 3) for t in times[mode]]) for mode in sent]
    figures = {"vbe_step_ms": round(median["vbe"], 3), "expanded_step_ms": round(median["expanded"], 3),
               "vbe_a2a_bytes": total["vbe"], "expanded_a2a_bytes": total["expanded"], "ranks": WORLD}
    print(json.dumps({"benchmark": "vbe", "results": results, "ratios": ratios, "figures": figures}))


if __name__ == "__main__":
    main()

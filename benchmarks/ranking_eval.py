"""Full-ranking evaluation of MovieLens-100K: ours (top-k per user batch) vs one users x items matrix scored
by torchmetrics.retrieval, the same embeddings, the same excluded items; and peak memory with users x10.

    flock /tmp/lightning_rec_bench.lock .venv/bin/python benchmarks/ranking_eval.py [--data-dir ...] [--rounds 5]
    .venv/bin/python benchmarks/ranking_eval.py --smoke      # seconds: 20 users, one round, memory in this process

Both variants rank every item for every user of the RO 8:1:1 validation split (943 users x 1,682 items,
training items excluded) from the same random D=64 embeddings (the cost does not depend on training),
alternating over rounds; the table shows medians. "ours" is what TwoTowerModule's validation does:
users in batches of --batch-users, [U, I] scores per batch, top-k, RankingMetrics at k = 10 and 20 (all 5
metrics). "torchmetrics" builds the whole [users, items] matrix and feeds the non-excluded entries to
the 5 torchmetrics.retrieval metrics at k = 10 and 20. Their values must agree (printed).

Memory: each scale (users x1 and x10, by repeating the users) runs in a fresh process that samples its
resident memory every millisecond during the evaluation; "peak above start" is the growth over the
memory held before the evaluation starts (data and embeddings). Without ml-100k, a synthetic set with
its shape is used (noted in the output). The last line is one JSON object: {"benchmark": "ranking_eval", "results":
[...], "ratios": {"torchmetrics_over_ours_time", "ours_peak_mem_x10_over_x1", "torchmetrics_peak_mem_x10_over_x1"},
"figures": {"full_ranking_eval_s_ml100k", "ours_peak_above_start_mb_x1", "ours_peak_above_start_mb_x10", ...}}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "movielens" / "ml-100k"
KS = (10, 20)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class PeakRSS:
    """Samples this process's resident memory every millisecond while active."""

    def __enter__(self):
        self.start, self.peak, self._stop = _rss_mb(), _rss_mb(), False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, _rss_mb())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()
        self.peak = max(self.peak, _rss_mb())


def load(data_dir: Path, scale: int, max_users: int = 0):
    """The validation users (the first `max_users` of them, 0: all; repeated `scale` times) as a UserRankingDataset, and
    embeddings."""
    from lightning_rec.data.movielens import MovieLensDataModule, UserRankingDataset

    if (data_dir / "u.data").is_file():
        dm = MovieLensDataModule(str(data_dir), side_features=False)
        dm.setup()
        val = dm.datasets["val"]
        num_users, num_items, source = dm.num_users, dm.num_items, "ml-100k"
    else:  # same shape, synthetic: 943 users x 1,682 items, 106 interactions per user
        from lightning_rec.data.movielens import FeatureTable, _csr_by_user

        g = torch.Generator().manual_seed(0)
        num_users, num_items, source = 943, 1682, "synthetic (ml-100k not found)"
        user = torch.arange(num_users).repeat_interleave(106)
        item = torch.randint(num_items, user.shape, generator=g)
        part = torch.rand(user.shape, generator=g)
        users = FeatureTable({"user_id": (torch.arange(num_users), num_users)}, {})
        val = UserRankingDataset(torch.arange(num_users), users, _csr_by_user(user[part < 0.1], item[part < 0.1],
                                 num_users), _csr_by_user(user[part >= 0.2], item[part >= 0.2], num_users))
    users_U = torch.arange(min(max_users, num_users) if max_users else num_users).repeat(scale)
    dataset = UserRankingDataset(users_U, val.users, val.target, val.exclude)
    g = torch.Generator().manual_seed(1)
    return dataset, torch.randn(num_users, 64, generator=g), torch.randn(num_items, 64, generator=g), source


def eval_ours(dataset, user_emb, item_emb, batch_users: int) -> dict[str, float]:
    from lightning_rec.metrics import RankingMetrics

    metric = RankingMetrics(ks=KS)
    for start in range(0, len(dataset), batch_users):
        batch = dataset.__getitems__(list(range(start, min(start + batch_users, len(dataset)))))
        scores_UI = user_emb[batch.user_index] @ item_emb.t()  # one batch of users, never all of them
        metric.update_full(scores_UI, batch.target_offsets, batch.target_items, batch.exclude_offsets,
                           batch.exclude_items)
    return {k: float(v) for k, v in metric.compute().items()}


def eval_torchmetrics(dataset, user_emb, item_emb) -> dict[str, float]:
    from torchmetrics import retrieval as tr

    batch = dataset.__getitems__(list(range(len(dataset))))
    scores_UI = user_emb[batch.user_index] @ item_emb.t()  # the whole users x items matrix
    num_users, num_items = scores_UI.shape
    target_UI = torch.zeros(num_users, num_items, dtype=torch.bool)
    rows = torch.repeat_interleave(torch.arange(num_users), batch.target_offsets.diff())
    target_UI[rows, batch.target_items] = True
    keep_UI = torch.ones(num_users, num_items, dtype=torch.bool)
    rows = torch.repeat_interleave(torch.arange(num_users), batch.exclude_offsets.diff())
    keep_UI[rows, batch.exclude_items] = False
    keep_UI |= target_UI
    index_UI = torch.arange(num_users).unsqueeze(1).expand(num_users, num_items)
    preds, target, indexes = scores_UI[keep_UI], target_UI[keep_UI], index_UI[keep_UI]
    out = {}
    for k in KS:
        for name, cls in (("ndcg", tr.RetrievalNormalizedDCG), ("recall", tr.RetrievalRecall),
                          ("precision", tr.RetrievalPrecision), ("mrr", tr.RetrievalMRR),
                          ("hit_rate", tr.RetrievalHitRate)):
            out[f"{name}@{k}"] = float(cls(top_k=k, empty_target_action="skip")(preds, target, indexes=indexes))
    return out


def memory_child(data_dir: Path, scale: int, batch_users: int, variant: str, users: int = 0) -> dict[str, float]:
    from lightning_rec.data.movielens import UserRankingDataset

    dataset, user_emb, item_emb, _ = load(data_dir, scale, users)
    # warm-up on 8 users (lazy imports, first-call costs), not on all: a full warm-up would leave the
    # allocator holding the peak and hide it
    few = UserRankingDataset(dataset.users_U[:8], dataset.users, dataset.target, dataset.exclude)
    eval_ours(few, user_emb, item_emb, batch_users)
    eval_torchmetrics(few, user_emb, item_emb)
    with PeakRSS() as mem:
        if variant == "ours":
            eval_ours(dataset, user_emb, item_emb, batch_users)
        else:
            eval_torchmetrics(dataset, user_emb, item_emb)
    return {"start_mb": mem.start, "peak_mb": mem.peak}


def measure_memory(data_dir: Path, scale: int, batch_users: int, variant: str, smoke: bool,
                   users: int) -> dict[str, float]:
    if smoke:  # in this process: a process per measure costs seconds (the peak above start is then approximate)
        return memory_child(data_dir, scale, batch_users, variant, users)
    out = subprocess.run([sys.executable, __file__, "--memory-child", str(scale), "--variant", variant,
                          "--data-dir", str(data_dir), "--batch-users", str(batch_users), "--users", str(users)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-users", type=int, default=256)
    parser.add_argument("--memory-child", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="ours", help=argparse.SUPPRESS)
    parser.add_argument("--users", type=int, default=0, help="evaluate the first N validation users only (0: all)")
    parser.add_argument("--smoke", action="store_true", help="seconds: 20 users, one round, memory in this process")
    args = parser.parse_args()
    if args.memory_child:
        print(json.dumps(memory_child(args.data_dir, args.memory_child, args.batch_users, args.variant, args.users)))
        return
    if args.smoke:
        args.users, args.rounds = 20, 1

    dataset, user_emb, item_emb, source = load(args.data_dir, 1, args.users)
    print(f"data: {source}; {len(dataset)} users x {item_emb.shape[0]} items; torch threads {torch.get_num_threads()}")
    times: dict[str, list[float]] = {"ours": [], "torchmetrics": []}
    values = {}
    for _ in range(args.rounds):  # alternating: the machine's drift hits both alike
        for name, fn in (("ours", lambda: eval_ours(dataset, user_emb, item_emb, args.batch_users)),
                         ("torchmetrics", lambda: eval_torchmetrics(dataset, user_emb, item_emb))):
            t0 = time.perf_counter()
            values[name] = fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    max_diff = max(abs(values["ours"][k] - values["torchmetrics"][k]) for k in values["ours"])

    memory = {(variant, scale): measure_memory(args.data_dir, scale, args.batch_users, variant, args.smoke, args.users)
              for variant in ("ours", "torchmetrics") for scale in (1, 10)}
    growth = {key: m["peak_mb"] - m["start_mb"] for key, m in memory.items()}

    print(f"\n{'variant':<14}{'median s':>10}{'min s':>9}{'peak above start, users x1':>30}{'x10':>9}")
    for name in ("ours", "torchmetrics"):
        print(f"{name:<14}{med[name]:>10.3f}{min(times[name]):>9.3f}{growth[(name, 1)]:>27.1f} MB"
              f"{growth[(name, 10)]:>6.1f} MB")
    print(f"values: ours vs torchmetrics, max |difference| over {len(values['ours'])} metric@k = {max_diff:.2e}")
    print(f"ours: ndcg@10 {values['ours']['ndcg@10']:.4f} recall@10 {values['ours']['recall@10']:.4f} "
          f"(random embeddings)")
    results = [{"variant": name, "median_s": med[name], "times_s": times[name],
                "peak_above_start_mb_x1": growth[(name, 1)], "peak_above_start_mb_x10": growth[(name, 10)]}
               for name in ("ours", "torchmetrics")]
    print(json.dumps({
        "benchmark": "ranking_eval",
        "results": results,
        "ratios": {
            "torchmetrics_over_ours_time": med["torchmetrics"] / med["ours"],
            "ours_peak_mem_x10_over_x1": growth[("ours", 10)] / max(growth[("ours", 1)], 1e-9),
            "torchmetrics_peak_mem_x10_over_x1": growth[("torchmetrics", 10)] / max(growth[("torchmetrics", 1)], 1e-9),
        },
        "figures": {
            "full_ranking_eval_s_ml100k": med["ours"],
            "ours_peak_above_start_mb_x1": growth[("ours", 1)],
            "ours_peak_above_start_mb_x10": growth[("ours", 10)],
            "max_abs_diff_vs_torchmetrics": max_diff,
            "users": len(dataset), "items": int(item_emb.shape[0]), "data": source,
        },
    }))


if __name__ == "__main__":
    main()

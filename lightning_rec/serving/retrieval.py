"""A retrieval export for two-tower / matrix-factorisation models: the whole catalogue embedded by the item tower
into a FAISS index (`items.faiss`), the user tower as a `.pt2` package (`user_tower.pt2`), and `retrieval.json`
(the index kind, dim, item count). "Top 10 items for this user" is the user tower's vector searched in the index.

Index kinds: "flat" (exact inner product, faiss.IndexFlatIP), "ivf" (IndexIVFFlat, nlist = 4 sqrt(items), nprobe =
nlist / 4, for big catalogues), "hnsw" (IndexHNSWFlat, 32 links, efSearch 128). Cosine models' vectors are unit
length already, so inner product ranks as the model scores. Needs `pip install faiss-cpu` (the `serving` extra).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

INDEX_KINDS = ("flat", "ivf", "hnsw")
INDEX_FILE, PACKAGE_FILE, CONFIG_FILE = "items.faiss", "user_tower.pt2", "retrieval.json"


def _faiss():
    try:
        import faiss
    except ImportError as e:
        raise ImportError("a retrieval index needs faiss: pip install faiss-cpu (or lightning_rec[serving])") from e
    return faiss


def build_index(items_ID: Tensor, kind: str = "flat", seed: int = 0) -> Any:
    """A FAISS inner-product index over the rows of `items_ID` (row i is item i)."""
    faiss = _faiss()
    if kind not in INDEX_KINDS:
        raise ValueError(f"index={kind!r}: give one of {', '.join(INDEX_KINDS)}")
    vectors = items_ID.detach().float().cpu().contiguous().numpy()
    n, d = vectors.shape
    if kind == "flat":
        index = faiss.IndexFlatIP(d)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(d, 32, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efSearch = 128
    else:
        nlist = max(1, min(n // 39, int(4 * math.sqrt(n))))  # faiss wants >= 39 training points a list
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(d), d, nlist, faiss.METRIC_INNER_PRODUCT)
        index.cp.seed = seed
        index.train(vectors)
        index.nprobe = max(1, nlist // 4)
    index.add(vectors)
    return index


def export_retrieval(module: Any, datamodule: Any, out: str | os.PathLike, index: str = "flat",
                     tables: str = "fp32", overwrite: bool = False, package: bool = True) -> Path:
    """Write `out/items.faiss` (the catalogue, `module.embed_catalog(datamodule)`), `out/user_tower.pt2` (the user
    tower, lightning_rec.serving.package; package=False leaves it out) and `out/retrieval.json`."""
    from lightning_rec.serving.package import export_package

    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"retrieval export's output {out} exists and is not empty: give a new directory, or pass "
                         f"overwrite=True (--overwrite)")
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            items_ID = module.embed_catalog(datamodule).float()
    finally:
        module.train(was_training)
    built = build_index(items_ID, index)
    out.mkdir(parents=True, exist_ok=True)
    _faiss().write_index(built, str(out / INDEX_FILE))
    if package:
        export_package(module, out / PACKAGE_FILE, tables, tower="user", overwrite=True)
    config = {"index": index, "dim": int(items_ID.shape[1]), "num_items": int(items_ID.shape[0]),
              "metric": "inner_product", "score": getattr(getattr(module, "model", module), "score", "dot"),
              "user_tower": PACKAGE_FILE if package else None, "tables": tables}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def load_index(path: str | os.PathLike, user_dim: int | None = None) -> Any:
    """The FAISS index at `path` (a file, or a retrieval export's directory); with `user_dim` (the user tower's
    output dim), refused unless the index holds vectors of that dim."""
    path = Path(path)
    file = path / INDEX_FILE if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{file} is not a FAISS index: write one with export_retrieval(module, datamodule, OUT)")
    index = _faiss().read_index(str(file))
    if user_dim is not None and index.d != user_dim:
        raise ValueError(f"the index {file} holds {index.d}-dim item vectors but the user tower gives {user_dim}-dim "
                         f"vectors: export the index and the user tower from the same model")
    return index


def search(index: Any, user_UD: Tensor, k: int = 10, exclude: list[Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Each user's top k items (scores [U, k], items [U, k], best first; -1 where fewer remain), leaving out
    `exclude[u]` (e.g. the items a user has seen)."""
    extra = 0 if exclude is None else max((len(e) for e in exclude), default=0)
    want = min(k + extra, index.ntotal)
    scores, items = index.search(user_UD.detach().float().cpu().contiguous().numpy(), want)
    scores, items = torch.from_numpy(scores), torch.from_numpy(items)
    if exclude is None:
        return scores[:, :k], items[:, :k]
    out_s, out_i = torch.full((len(items), k), float("-inf")), torch.full((len(items), k), -1, dtype=torch.long)
    for u, seen in enumerate(exclude):
        keep = ~torch.isin(items[u], seen.long()) & (items[u] >= 0)
        s, i = scores[u][keep][:k], items[u][keep][:k]
        out_s[u, : len(s)], out_i[u, : len(i)] = s, i
    return out_s, out_i


@torch.no_grad()
def evaluate_index(module: Any, batches: Any, index: Any) -> dict[str, Tensor]:
    """The module's ranking metrics (RankingMetrics of its ks) with each user's items found in `index` instead of
    scored against the whole catalogue: the evaluation's batches (user features, targets, seen items excluded)."""
    metric = module._ranking_metrics()
    net = getattr(module, "model", module)
    k = max(metric.ks)
    for batch in batches:
        user_UD = net.user_embeddings(batch.user_features)
        ex = batch.exclude_offsets.tolist()
        exclude = [batch.exclude_items[a:b] for a, b in zip(ex, ex[1:])]
        _, items_UK = search(index, user_UD, k, exclude)
        to = batch.target_offsets.tolist()
        hits = torch.stack([torch.isin(items_UK[u], batch.target_items[a:b]) & (items_UK[u] >= 0)
                            for u, (a, b) in enumerate(zip(to, to[1:]))])
        metric.update_topk(hits, batch.target_offsets.diff())
    return metric.compute()

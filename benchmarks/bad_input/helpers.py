"""What the cases share: tensors, small collections, a plain-torch reference, Criteo rows, paths."""

from __future__ import annotations

import os
from pathlib import Path

from .registry import expect

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(os.environ.get("LIGHTNING_REC_SHARED_DATA", ROOT.parent / "shared" / "data"))  # as tests/conftest.py


def _t():
    import torch
    return torch


def T(data, dtype=None):
    torch = _t()
    return torch.tensor(data, dtype=dtype)


def KJT(*a, **k):
    from lightning_rec import KeyedJaggedTensor
    return KeyedJaggedTensor(*a, **k)


def read(kjt):
    """What a collection does with a batch first: the KJT's checks (its constructor only assigns), then the ids'."""
    make_ebc(weighted=kjt.weights_or_none() is not None)(kjt)
    return kjt


def KJT_read(*a, **k):
    return read(KJT(*a, **k))


def kjt_lengths(keys, values, lengths, weights=None):
    from lightning_rec import KeyedJaggedTensor
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=T(values) if isinstance(values, list) else values,
                                               lengths=T(lengths) if isinstance(lengths, list) else lengths,
                                               weights=weights)


def bag_cfg(name, rows, dim, feats, **kw):
    from lightning_rec import EmbeddingBagConfig
    return EmbeddingBagConfig(name=name, num_embeddings=rows, embedding_dim=dim, feature_names=feats, **kw)


def seq_cfg(name, rows, dim, feats, **kw):
    from lightning_rec import EmbeddingConfig
    return EmbeddingConfig(name=name, num_embeddings=rows, embedding_dim=dim, feature_names=feats, **kw)


def make_ebc(opt="sgd", lr=0.1, kernel="auto", weighted=False, pooling="sum", rows=(10, 6), dims=(4, 4), **kw):
    from lightning_rec import EmbeddingBagCollection, FusedOptimizerConfig
    _t().manual_seed(0)
    tables = [bag_cfg("t_a", rows[0], dims[0], ["a"], pooling=pooling),
              bag_cfg("t_b", rows[1], dims[1], ["b"], pooling=pooling)]
    optimizer = FusedOptimizerConfig(opt, lr=lr) if opt else None
    return EmbeddingBagCollection(tables, is_weighted=weighted, optimizer=optimizer, kernel=kernel, **kw)


def make_ec(opt="sgd", kernel="auto", rows=(10, 6), dim=4):
    from lightning_rec import EmbeddingCollection, FusedOptimizerConfig
    _t().manual_seed(0)
    tables = [seq_cfg("t_a", rows[0], dim, ["a"]), seq_cfg("t_b", rows[1], dim, ["b"])]
    return EmbeddingCollection(tables, optimizer=FusedOptimizerConfig(opt, lr=0.1) if opt else None, kernel=kernel)


def tables_of(module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def unchanged(module, before: dict, what: str = "tables"):
    torch = _t()

    def check():
        now = module.state_dict()
        for k, v in before.items():
            expect(torch.equal(now[k], v), f"{what}: {k} changed although the input was refused")
    return check


def good_batch():
    # a: bags [1, 2] [3]; b: [0] []
    return kjt_lengths(["a", "b"], [1, 2, 3, 0], [2, 1, 1, 0])


def ref_pooled(weights: dict, kjt, dims: dict, table_of: dict, mean: bool = False, weighted: bool = False):
    """[B, sum D] pooled embeddings computed with plain torch (per-bag sums of rows)."""
    torch = _t()
    B = kjt.stride()
    cols = []
    d = kjt.to_dict()
    for key in dims:
        w = weights[table_of[key]]
        jt = d[key]
        out = torch.zeros(B, w.shape[1], dtype=torch.float64)
        vals, lens = jt.values().long(), jt.lengths().long()
        ws = jt.weights_or_none()
        start = 0
        for b in range(B):
            n = int(lens[b])
            for j in range(start, start + n):
                out[b] += w[vals[j]].double() * (float(ws[j]) if (weighted and ws is not None) else 1.0)
            if mean and n:
                out[b] /= n
            start += n
        cols.append(out)
    return torch.cat(cols, dim=1)


def ebc_weights(ebc) -> dict:
    return {k.split(".")[-2]: v.detach().clone() for k, v in ebc.state_dict().items()}


def check_ebc(ebc, kjt, mean=False, weighted=False, atol=1e-5):
    torch = _t()
    w = ebc_weights(ebc)
    table_of = {f: c.name for c in ebc.embedding_bag_configs() for f in c.feature_names}
    out = ebc(kjt)
    dims = dict(zip(out.keys(), out.length_per_key()))
    ref = ref_pooled(w, kjt, dims, table_of, mean=mean, weighted=weighted)
    expect(out.values().shape == ref.shape, f"output shape {tuple(out.values().shape)} != {tuple(ref.shape)}")
    expect(torch.allclose(out.values().double(), ref, atol=atol), "pooled embeddings differ from the torch reference")
    return out


def write(path: Path, data, mode="w") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        with open(path, mode, newline="") as f:
            f.write(data)
    return path


def criteo_row(label="0", dense=None, cats=None, sep="\t") -> str:
    dense = dense if dense is not None else [str(i) for i in range(13)]
    cats = cats if cats is not None else [f"{i + 1:08x}" for i in range(26)]
    fields = ([label] if label is not None else []) + list(dense) + list(cats)
    return sep.join(fields)


def criteo_text(n=20, **kw) -> str:
    return "".join(criteo_row(label=str(i % 2), **kw) + "\n" for i in range(n))


def parse_all(path, **kw):
    """Every row of a Criteo file through the public reader, as one Arrow table + the report."""
    import pyarrow as pa

    from lightning_rec.data.criteo_parse import read_criteo
    tables, report = [], None
    for table, rep in read_criteo(path, **kw):
        tables.append(table)
        report = rep
    return (pa.concat_tables(tables) if tables else None), report


def torch_isfinite(t):
    return _t().isfinite(t).all()


class CLIError(Exception):
    """The CLI exited with an error; the message is what it printed."""

"""A battery of bad and edge inputs across the public surface (issue 15): every case a clear error or a correct result.

    flock /tmp/lightning_rec_bench.lock .venv/bin/python benchmarks/bad_input_battery.py --threads 2
    flock /tmp/lightning_rec_bench.lock .venv/bin/python benchmarks/bad_input_battery.py --threads 16
    .venv/bin/python benchmarks/bad_input_battery.py --only kjt.      # the cases whose name contains "kjt."

Written from the README and the public API as a new user would try it, independently of
tests/test_bad_input*.py. Each case declares what correct behaviour is:

- `error=(ExceptionType, [words])`: the call must raise that type (or a subclass) and the message must
  contain every word (case-insensitive): the feature / table / file:line / argument the user wrote and
  the fix. `ctx.after(check)` registers a check that nothing was lost (weights, optimizer state, files),
  run after the error.
- no `error`: the case runs to the end and checks the result itself (`expect(...)`, against a plain
  torch reference where there is one). `ok=True` on an error case: a correct result is accepted too
  (inputs a library may either accept or refuse; the case then checks the result).

Classes: clear (the expected error with the words), unclear (an error of another type, or without
the words), correct (no error, the check passed), silent (no error where one was due, a failed
check, or state changed by a refused input), crash (the worker process died), hang (over the case's
time limit). Cases run in sequence in a worker process (torch imported once); a crash or hang
kills that worker and a new one takes the next case. Two-rank cases spawn their ranks with real
torch.distributed (tests/dist_utils.py) inside the case.

Output: one line per case (name, class, seconds, the first 160 characters of the message), then,
LAST, one JSON line {"benchmark": "bad_input_battery", "results": [...], "figures": {...}}.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DATA = Path(os.environ.get("LIGHTNING_REC_SHARED_DATA", ROOT.parent / "shared" / "data"))  # as tests/conftest.py

CLASSES = ("clear", "correct", "unclear", "silent", "crash", "hang", "skipped")


# --------------------------------------------------------------------------------------------------
# case registry

@dataclass
class Case:
    name: str
    fn: object
    error: type | tuple | None = None
    words: tuple = ()
    ok: bool = False  # an error case whose input may also be accepted (then fn checks the result)
    timeout: float = 20.0
    legit: str = ""  # why a correct result is right, for inputs some would call bad


CASES: dict[str, Case] = {}


def case(name: str, error=None, words=(), ok: bool = False, timeout: float = 20.0, legit: str = ""):
    def deco(fn):
        assert name not in CASES, name
        CASES[name] = Case(name, fn, error, tuple(words), ok, timeout, legit)
        return fn
    return deco


def simple(name: str, thunk, error, words, **kw):
    """A one-call case: thunk() must raise `error` naming `words`."""
    case(name, error, words, **kw)(lambda ctx: thunk())


class Silent(AssertionError):
    """A check failed: a wrong result, or state changed by a refused input."""


class Skipped(Exception):
    """The case reads real data (../shared/data) that is absent here."""


class Hang(Exception):
    pass


class Crash(Exception):
    pass


class RemoteError(Exception):
    """An exception raised on a rank: its class names (MRO) and message."""

    def __init__(self, names, message):
        super().__init__(message)
        self.names = list(names)


def expect(cond, what: str) -> None:
    if not cond:
        raise Silent(what)


class Ctx:
    def __init__(self) -> None:
        self.afters = []
        self.tmp = Path(tempfile.mkdtemp(prefix="battery_"))

    def after(self, fn) -> None:
        self.afters.append(fn)


# --------------------------------------------------------------------------------------------------
# shared helpers (torch imported lazily so that the parent process stays light)

def _t():
    import torch
    return torch


def T(data, dtype=None):
    torch = _t()
    return torch.tensor(data, dtype=dtype)


def KJT(*a, **k):
    from lightning_rec import KeyedJaggedTensor
    return KeyedJaggedTensor(*a, **k)


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


def files_intact(paths):
    saved = {p: Path(p).read_bytes() for p in paths}

    def check():
        for p, b in saved.items():
            expect(Path(p).exists() and Path(p).read_bytes() == b, f"{p} was changed by a refused call")
    return check


# ==================================================================================================
# KeyedJaggedTensor / JaggedTensor / KeyedTensor

def _kjt_cases():
    torch = _t()
    from lightning_rec import JaggedTensor, KeyedJaggedTensor, KeyedTensor

    simple("kjt.values_float64_with_offsets",
           lambda: KJT(["a"], T([1.0, 2.0], torch.float64), offsets=T([0, 2])), ValueError, ["integers", "long()"])
    simple("kjt.values_bool", lambda: KJT(["a"], T([True, False]), lengths=T([2])), ValueError, ["bool", "long()"])
    simple("kjt.values_complex", lambda: KJT(["a"], torch.tensor([1 + 0j]), lengths=T([1])), ValueError, ["integers"])
    simple("kjt.values_2d_matrix", lambda: KJT(["a"], T([[1, 2], [3, 4]]), lengths=T([2])), ValueError, ["1-d"])
    simple("kjt.values_scalar", lambda: KJT(["a"], T(3), lengths=T([1])), ValueError, ["values"])
    simple("kjt.lengths_float16", lambda: KJT(["a"], T([1, 2]), lengths=T([2.0], torch.float16)), ValueError,
           ["lengths", "integer"])
    simple("kjt.lengths_negative_sum_ok", lambda: KJT(["a", "b"], T([1, 2]), lengths=T([3, -1])), ValueError,
           ["lengths", ">= 0"])
    simple("kjt.lengths_matrix", lambda: KJT(["a", "b"], T([1, 2]), lengths=T([[1], [1]])), ValueError, ["1-d"])
    simple("kjt.lengths_three_for_two_keys", lambda: KJT(["a", "b"], T([1, 2, 3]), lengths=T([1, 1, 1])), ValueError,
           ["multiple", "key-major"])
    simple("kjt.lengths_sum_too_small", lambda: KJT(["a"], T([1, 2, 3, 4]), lengths=T([1, 2])), ValueError,
           ["add up", "4 values"])
    simple("kjt.offsets_start_at_two", lambda: KJT(["a"], T([5, 6, 7, 8]), offsets=T([2, 3, 4])), ValueError,
           ["start at 2", "rebase"])
    simple("kjt.offsets_go_down", lambda: KJT(["a", "b"], T([5, 6, 7]), offsets=T([0, 3, 1, 3, 3])), ValueError,
           ["never decrease"])
    simple("kjt.offsets_end_short", lambda: KJT(["a"], T([5, 6, 7]), offsets=T([0, 1, 2])), ValueError,
           ["end at 2", "3 values"])
    simple("kjt.offsets_float32", lambda: KJT(["a"], T([5, 6]), offsets=T([0.0, 2.0])), ValueError,
           ["offsets", "integer"])
    simple("kjt.offsets_empty", lambda: KJT(["a"], T([], torch.int64), offsets=T([], torch.int64)), ValueError,
           ["offsets"])
    simple("kjt.keys_one_string", lambda: kjt_lengths("user", [1], [1]), ValueError, ["keys=['user']"])
    simple("kjt.keys_repeated", lambda: kjt_lengths(["a", "a"], [1, 2], [1, 1]), ValueError, ["duplicate", "a"])
    simple("kjt.keys_are_ints", lambda: kjt_lengths([0, 1], [1, 2], [1, 1]), ValueError, ["str"])
    simple("kjt.keys_none", lambda: kjt_lengths(None, [1, 2], [1, 1]), ValueError, ["keys"])
    simple("kjt.weights_int64", lambda: kjt_lengths(["a"], [1, 2], [2], weights=T([1, 2])), ValueError,
           ["floating", "weights.float()"])
    simple("kjt.weights_one_short", lambda: kjt_lengths(["a"], [1, 2], [2], weights=T([1.0])), ValueError,
           ["one weight per id"])
    simple("kjt.weights_column_vector", lambda: kjt_lengths(["a"], [1, 2], [2], weights=T([[1.0], [2.0]])),
           ValueError, ["weights"])
    simple("kjt.stride_disagrees_with_lengths",
           lambda: KJT(["a", "b"], T([1, 2, 3, 4]), lengths=T([1, 1, 1, 1]), stride=3), ValueError,
           ["stride 3", "one length per key per sample"])
    simple("kjt.values_python_list", lambda: KeyedJaggedTensor.from_lengths_sync(["a"], [1, 2], T([2])),
           ValueError, ["values", "tensor"])
    simple("kjt.lengths_python_list", lambda: KeyedJaggedTensor(["a"], T([1, 2]), lengths=[2]), ValueError,
           ["lengths", "tensor"])

    @case("kjt.lengths_and_offsets_disagree", ValueError, ["lengths", "offsets"])
    def _(ctx):
        # both given and they describe different bags: one of the two would silently win
        kjt = KJT(["a", "b"], T([1, 2, 3]), lengths=T([1, 2]), offsets=T([0, 2, 3]))
        ebc = make_ebc()
        ebc(kjt)

    @case("kjt.noncontiguous_values_view", legit="a strided view of ids is a valid tensor: same ids, same result")
    def _(ctx):
        ids = (torch.arange(20) % 6)[::3][:4]  # a strided view: [0, 3, 0, 3]
        kjt = kjt_lengths(["a", "b"], ids, [2, 1, 1, 0])
        expect(not kjt.values().is_contiguous(), "setup: view should be non-contiguous")
        check_ebc(make_ebc(), kjt)

    @case("kjt.sliced_values_from_bigger_batch", legit="values[3:7] with matching lengths is a complete batch")
    def _(ctx):
        big = T([9, 9, 9, 1, 2, 3, 0, 9])
        check_ebc(make_ebc(), kjt_lengths(["a", "b"], big[3:7], [2, 1, 1, 0]))

    @case("kjt.int32_ids_int64_lengths", legit="TorchRec accepts int32 ids")
    def _(ctx):
        check_ebc(make_ebc(), kjt_lengths(["a", "b"], T([1, 2, 3, 0], torch.int32), [2, 1, 1, 0]))

    @case("kjt.int64_ids_int32_lengths", legit="int32 lengths are TorchRec's usual dtype")
    def _(ctx):
        check_ebc(make_ebc(), kjt_lengths(["a", "b"], T([1, 2, 3, 0]), T([2, 1, 1, 0], torch.int32)))

    @case("kjt.int8_ids", ValueError, ["int8"], ok=True, legit="int8 ids may be widened: the result must be right")
    def _(ctx):
        check_ebc(make_ebc(), kjt_lengths(["a", "b"], T([1, 2, 3, 0], torch.int8), [2, 1, 1, 0]))

    @case("kjt.uint8_ids", ValueError, ["uint8"], ok=True)
    def _(ctx):
        check_ebc(make_ebc(), kjt_lengths(["a", "b"], T([1, 2, 3, 0], torch.uint8), [2, 1, 1, 0]))

    @case("kjt.int16_lengths", ValueError, ["int16"], ok=True)
    def _(ctx):
        check_ebc(make_ebc(), kjt_lengths(["a", "b"], T([1, 2, 3, 0]), T([2, 1, 1, 0], torch.int16)))

    @case("kjt.batch_of_zero_samples", legit="an empty batch gives a [0, D] output")
    def _(ctx):
        out = make_ebc()(kjt_lengths(["a", "b"], T([], torch.int64), T([], torch.int64)))
        expect(tuple(out.values().shape) == (0, 8), f"shape {tuple(out.values().shape)}")

    @case("kjt.every_bag_empty", legit="empty bags pool to zeros")
    def _(ctx):
        out = check_ebc(make_ebc(), kjt_lengths(["a", "b"], T([], torch.int64), [0, 0, 0, 0]))
        expect(bool((out.values() == 0).all()), "empty bags not zero")

    @case("kjt.id_2_pow_40", ValueError, ["'a'", "t_a", "2^40" if False else "1099511627776"])
    def _(ctx):
        ebc = make_ebc()
        before = tables_of(ebc)
        ctx.after(unchanged(ebc, before))
        ebc(kjt_lengths(["a", "b"], T([1, 2 ** 40, 3, 0]), [2, 1, 1, 0])).values().sum().backward()

    @case("kjt.id_minus_one_second_feature", ValueError, ["'b'", "t_b", "-1"])
    def _(ctx):
        ebc = make_ebc()
        ctx.after(unchanged(ebc, tables_of(ebc)))
        ebc(kjt_lengths(["a", "b"], T([1, 2, 3, -1]), [2, 1, 1, 0])).values().sum().backward()

    @case("kjt.id_equal_to_rows", ValueError, ["'b'", "t_b", "6"])
    def _(ctx):
        ebc = make_ebc()
        ctx.after(unchanged(ebc, tables_of(ebc)))
        ebc(kjt_lengths(["a", "b"], T([1, 2, 3, 6]), [2, 1, 1, 0])).values().sum().backward()

    @case("kjt.split_segments_too_many", ValueError, ["segments"])
    def _(ctx):
        good_batch().split([3])

    @case("kjt.split_negative_segment", ValueError, ["segments"])
    def _(ctx):
        good_batch().split([3, -1])

    @case("kjt.permute_index_out_of_range", ValueError, ["permute", "5"])
    def _(ctx):
        good_batch().permute([0, 5])

    @case("kjt.permute_negative_index", ValueError, ["permute", "-1"], ok=True,
          legit="a negative index may count from the end as in Python")
    def _(ctx):
        p = good_batch().permute([-1, 0])
        expect(p.keys() == ["b", "a"], f"keys {p.keys()}")
        expect(p.values().tolist() == [0, 1, 2, 3], f"values {p.values().tolist()}")

    @case("kjt.permute_reorders_correctly")
    def _(ctx):
        p = good_batch().permute([1, 0])
        expect(p.keys() == ["b", "a"] and p.lengths().tolist() == [1, 0, 2, 1] and p.values().tolist() == [0, 1, 2, 3],
               f"permute gave {p.keys()} {p.lengths().tolist()} {p.values().tolist()}")

    @case("kjt.concat_different_batch_sizes", ValueError, ["stride"])
    def _(ctx):
        KeyedJaggedTensor.concat([kjt_lengths(["a"], [1], [1]), kjt_lengths(["b"], [1, 2], [1, 1])])

    @case("kjt.concat_same_key_twice", ValueError, ["duplicate", "a"])
    def _(ctx):
        KeyedJaggedTensor.concat([kjt_lengths(["a"], [1], [1]), kjt_lengths(["a"], [2], [1])])

    @case("kjt.concat_weighted_with_unweighted", ValueError, ["weight"])
    def _(ctx):
        KeyedJaggedTensor.concat([kjt_lengths(["a"], [1], [1], weights=T([1.0])), kjt_lengths(["b"], [2], [1])])

    @case("kjt.from_jt_dict_different_batch_sizes", ValueError, ["'b'", "batch"])
    def _(ctx):
        KeyedJaggedTensor.from_jt_dict({"a": JaggedTensor(T([1]), lengths=T([1])),
                                        "b": JaggedTensor(T([1, 2]), lengths=T([1, 0, 1]))})

    @case("kjt.getitem_unknown_key", KeyError, ["'zz'", "'a'"])
    def _(ctx):
        good_batch()["zz"]

    @case("kjt.to_dict_round_trip_weights")
    def _(ctx):
        k = kjt_lengths(["a", "b"], [1, 2, 3, 0], [2, 1, 1, 0], weights=T([0.5, 1.0, 2.0, 3.0]))
        d = k.to_dict()
        expect(d["b"].values().tolist() == [0] and d["b"].weights().tolist() == [3.0]
               and d["a"].lengths().tolist() == [2, 1] and d["a"].weights().tolist() == [0.5, 1.0, 2.0],
               "to_dict split the wrong ids or weights")
        back = KeyedJaggedTensor.from_jt_dict(d)
        expect(back.values().tolist() == [1, 2, 3, 0] and back.weights().tolist() == [0.5, 1.0, 2.0, 3.0],
               "from_jt_dict(to_dict()) changed the batch")

    @case("kjt.values_and_lengths_on_different_devices", ValueError, ["device"])
    def _(ctx):
        KJT(["a"], T([1, 2]).to("meta"), lengths=T([2]))

    @case("kjt.weights_nan_weighted_ebc", ValueError, ["'a'", "t_a", "nan"])
    def _(ctx):
        ebc = make_ebc(weighted=True)
        ctx.after(unchanged(ebc, tables_of(ebc)))
        k = kjt_lengths(["a", "b"], [1, 2, 3, 0], [2, 1, 1, 0], weights=T([1.0, float("nan"), 1.0, 1.0]))
        ebc(k).values().sum().backward()

    @case("kjt.weights_neg_inf_second_feature", ValueError, ["'b'", "t_b", "inf"])
    def _(ctx):
        ebc = make_ebc(weighted=True, opt="adagrad")
        ctx.after(unchanged(ebc, tables_of(ebc)))
        k = kjt_lengths(["a", "b"], [1, 2, 3, 0], [2, 1, 1, 0], weights=T([1.0, 1.0, 1.0, -float("inf")]))
        ebc(k).values().sum().backward()

    @case("kjt.weights_float64_weighted_ebc", ValueError, ["float64"], ok=True,
          legit="double weights may be cast: the result must equal the float32 reference")
    def _(ctx):
        k = kjt_lengths(["a", "b"], [1, 2, 3, 0], [2, 1, 1, 0], weights=T([0.5, 2.0, 1.0, -1.0], torch.float64))
        check_ebc(make_ebc(weighted=True), k, weighted=True)

    # JaggedTensor
    simple("jt.neither_lengths_nor_offsets", lambda: JaggedTensor(T([1, 2])), ValueError, ["lengths", "offsets"])
    simple("jt.offsets_start_at_one", lambda: JaggedTensor(T([1, 2, 3]), offsets=T([1, 2, 3])), ValueError,
           ["start at 1"])
    simple("jt.weights_too_long", lambda: JaggedTensor(T([1, 2]), weights=T([1.0, 1.0, 1.0]), lengths=T([2])),
           ValueError, ["one weight per id"])
    simple("jt.lengths_negative", lambda: JaggedTensor(T([1, 2]), lengths=T([3, -1])), ValueError, [">= 0"])

    @case("jt.to_padded_dense_negative_length", ValueError, ["desired_length"])
    def _(ctx):
        JaggedTensor(T([1, 2, 3]), lengths=T([2, 1])).to_padded_dense(desired_length=-1)

    @case("jt.to_padded_dense_truncates")
    def _(ctx):
        out = JaggedTensor(T([1, 2, 3]), lengths=T([2, 1])).to_padded_dense(desired_length=1)
        expect(out.tolist() == [[1], [3]], f"to_padded_dense(1) = {out.tolist()}")

    @case("jt.to_dense_and_from_dense")
    def _(ctx):
        jt = JaggedTensor.from_dense([T([1, 2]), T([], torch.int64), T([7])])
        expect(jt.lengths().tolist() == [2, 0, 1] and [t.tolist() for t in jt.to_dense()] == [[1, 2], [], [7]],
               "from_dense/to_dense round trip")

    # KeyedTensor
    simple("kt.widths_do_not_add_up", lambda: KeyedTensor(["a", "b"], [2, 2], torch.zeros(3, 5)), ValueError,
           ["5 columns", "4"])
    simple("kt.more_keys_than_widths", lambda: KeyedTensor(["a", "b"], [5], torch.zeros(3, 5)), ValueError,
           ["2 keys", "1 widths"])
    simple("kt.key_dim_out_of_range", lambda: KeyedTensor(["a"], [5], torch.zeros(3, 5), key_dim=2), ValueError,
           ["key_dim"])
    simple("kt.duplicate_keys", lambda: KeyedTensor(["a", "a"], [2, 3], torch.zeros(3, 5)), ValueError,
           ["duplicate", "a"])
    simple("kt.negative_width", lambda: KeyedTensor(["a", "b"], [-1, 6], torch.zeros(3, 5)), ValueError,
           ["-1"])

    @case("kt.getitem_unknown", KeyError, ["'c'", "'a'"])
    def _(ctx):
        KeyedTensor(["a", "b"], [2, 3], torch.zeros(3, 5))["c"]

    @case("kt.regroup_unknown_key", KeyError, ["'zz'"])
    def _(ctx):
        KeyedTensor.regroup([KeyedTensor(["a"], [2], torch.zeros(3, 2))], [["a", "zz"]])

    @case("kt.from_tensor_list_batch_mismatch", ValueError, ["'b'", "batch"])
    def _(ctx):
        KeyedTensor.from_tensor_list(["a", "b"], [torch.zeros(3, 2), torch.zeros(4, 2)])

    @case("kt.regroup_correct")
    def _(ctx):
        kt1 = KeyedTensor(["a", "b"], [1, 2], T([[1.0, 2.0, 3.0]]))
        kt2 = KeyedTensor(["c"], [1], T([[4.0]]))
        g = KeyedTensor.regroup([kt1, kt2], [["c", "a"], ["b"]])
        expect(g[0].tolist() == [[4.0, 1.0]] and g[1].tolist() == [[2.0, 3.0]], f"regroup gave {g}")


# ==================================================================================================
# configs and collections

def _config_cases():
    torch = _t()
    from lightning_rec import EmbeddingBagCollection, EmbeddingCollection, FusedOptimizerConfig

    simple("cfg.rows_zero", lambda: bag_cfg("t", 0, 4, ["f"]), ValueError, ["'t'", "num_embeddings"])
    simple("cfg.rows_float", lambda: bag_cfg("t", 10.0, 4, ["f"]), ValueError, ["'t'", "num_embeddings", "10.0"])
    simple("cfg.rows_numpy_int", lambda: bag_cfg("t", __import__("numpy").int64(10), 4, ["f"]), ValueError,
           ["num_embeddings"], ok=True, legit="a numpy integer is an integer")
    simple("cfg.dim_negative", lambda: bag_cfg("t", 10, -4, ["f"]), ValueError, ["'t'", "embedding_dim", "-4"])
    simple("cfg.dim_string", lambda: bag_cfg("t", 10, "8", ["f"]), ValueError,
           ["embedding_dim", "write embedding_dim=8"])
    simple("cfg.name_empty", lambda: bag_cfg("", 10, 4, ["f"]), ValueError, ["name"])
    simple("cfg.name_with_dot", lambda: bag_cfg("user.id", 10, 4, ["f"]), ValueError, ["'user.id'", "dots"])
    simple("cfg.name_none", lambda: bag_cfg(None, 10, 4, ["f"]), ValueError, ["name"])
    simple("cfg.feature_empty_string", lambda: bag_cfg("t", 10, 4, [""]), ValueError, ["'t'", "feature"])
    simple("cfg.feature_twice", lambda: bag_cfg("t", 10, 4, ["f", "f"]), ValueError, ["'t'", "twice"])
    simple("cfg.feature_names_tuple", lambda: bag_cfg("t", 10, 4, ("f", "g")), ValueError, ["feature"], ok=True,
           legit="a tuple of names is a sequence of names")
    simple("cfg.pooling_max", lambda: bag_cfg("t", 10, 4, ["f"], pooling="max"), ValueError,
           ["'t'", "max", "sum", "mean"])
    simple("cfg.pooling_none_on_bag", lambda: bag_cfg("t", 10, 4, ["f"], pooling="none"), ValueError,
           ["EmbeddingConfig"])
    simple("cfg.data_type_bfloat16", lambda: bag_cfg("t", 10, 4, ["f"], data_type=torch.bfloat16), ValueError,
           ["'t'", "float32", "float16"])
    simple("cfg.data_type_int8_name", lambda: bag_cfg("t", 10, 4, ["f"], data_type="int8"), ValueError,
           ["'int8'", "float32"])
    simple("cfg.init_min_above_max", lambda: make_table_init(0.5, -0.5), ValueError,
           ["weight_init_min", "weight_init_max"])
    simple("cfg.init_nan", lambda: make_table_init(float("nan"), 0.1), ValueError, ["weight_init_min", "nan"])
    simple("cfg.init_inf", lambda: make_table_init(-0.1, float("inf")), ValueError, ["weight_init_max", "inf"])
    simple("cfg.sequence_config_with_pooling", lambda: seq_cfg("t", 10, 4, ["f"], pooling="sum"), TypeError,
           ["pooling"])

    @case("cfg.rows_astronomical", (ValueError, MemoryError, RuntimeError), ["'t_huge'"], timeout=30)
    def _(ctx):
        EmbeddingBagCollection([bag_cfg("t_huge", 10 ** 13, 16, ["f"])], optimizer=FusedOptimizerConfig("sgd"))

    simple("coll.no_tables", lambda: EmbeddingBagCollection([]), ValueError, ["at least one table"])
    simple("coll.two_tables_same_name",
           lambda: EmbeddingBagCollection([bag_cfg("t", 5, 4, ["f"]), bag_cfg("t", 5, 4, ["g"])]), ValueError,
           ["unique", "t"])
    simple("coll.feature_read_by_two_tables",
           lambda: EmbeddingBagCollection([bag_cfg("t1", 5, 4, ["f"]), bag_cfg("t2", 9, 4, ["f"])]), ValueError,
           ["'f'", "t1", "t2"])
    simple("coll.ec_feature_read_by_two_tables",
           lambda: EmbeddingCollection([seq_cfg("t1", 5, 4, ["f"]), seq_cfg("t2", 9, 4, ["f"])]), ValueError,
           ["'f'", "t1", "t2"])
    simple("coll.ebc_given_sequence_config", lambda: EmbeddingBagCollection([seq_cfg("t", 5, 4, ["f"])]), ValueError,
           ["EmbeddingCollection", "'t'"])
    simple("coll.ec_given_bag_config", lambda: EmbeddingCollection([bag_cfg("t", 5, 4, ["f"])]), ValueError,
           ["EmbeddingBagCollection", "'t'"])
    simple("coll.ebc_given_dict_not_config",
           lambda: EmbeddingBagCollection([{"name": "t", "num_embeddings": 5, "embedding_dim": 4}]), ValueError,
           ["EmbeddingBagConfig"])
    simple("coll.kernel_unknown", lambda: make_ebc(kernel="cuda_fast"), ValueError, ["cuda_fast", "native", "fbgemm"])
    simple("coll.device_cuda_without_gpu", lambda: make_ebc(device="cuda"), ValueError, ["cuda"], ok=False)
    simple("coll.device_mps", lambda: make_ebc(device="mps"), ValueError, ["mps", "cpu"])

    @case("coll.device_meta_plans_without_memory", legit="device='meta' builds tables without allocating them, "
          "to plan a model bigger than this machine (tests/test_bad_input_distributed.py does)")
    def _(ctx):
        from lightning_rec import EmbeddingShardingPlanner, Topology
        ebc = EmbeddingBagCollection([bag_cfg("t_big", 10 ** 9, 128, ["f"])], device="meta",
                                     optimizer=FusedOptimizerConfig("rowwise_adagrad"))
        plan = EmbeddingShardingPlanner(Topology(world_size=64, local_world_size=8, ddr_cap=1 << 40),
                                        print_stats=False).plan(ebc)
        expect("t_big" in plan.plan[""], f"plan {plan}")
    simple("coll.optimizer_as_string", lambda: make_ebc_opt("adam"), ValueError, ["FusedOptimizerConfig"])
    simple("coll.optimizer_torch_class", lambda: make_ebc_opt(torch.optim.Adam), ValueError, ["FusedOptimizerConfig"])
    simple("coll.ec_on_native_kernel", lambda: EmbeddingCollection(
        [seq_cfg("t1", 5, 4, ["f"]), seq_cfg("t2", 5, 6, ["g"])], optimizer=FusedOptimizerConfig("sgd"),
        kernel="native"), ValueError, ["native", "kernel='fbgemm'"])

    @case("coll.ec_dims_differ_auto", legit="sequence tables of different dims in one collection are allowed")
    def _(ctx):
        ec = EmbeddingCollection([seq_cfg("t1", 5, 4, ["f"]), seq_cfg("t2", 5, 6, ["g"])],
                                 optimizer=FusedOptimizerConfig("sgd"))
        w = {k.split(".")[-2]: v.clone() for k, v in ec.state_dict().items()}
        out = ec(kjt_lengths(["f", "g"], [1, 4, 2], [2, 0, 1, 0]))
        expect(torch.equal(out["g"].values(), w["t2"][T([2])]) and torch.equal(out["f"].values(), w["t1"][T([1, 4])]),
               "sequence rows of mixed dims wrong")

    for bad in ("training", "forward", "type", "_modules", "keys", "state_dict", "cuda"):
        @case(f"coll.table_named_{bad}", legit="any name without dots is a valid table name (TorchRec allows it)")
        def _(ctx, bad=bad):
            ebc = EmbeddingBagCollection([bag_cfg(bad, 10, 4, ["x"]), bag_cfg("t_b", 6, 4, ["b"])],
                                         optimizer=FusedOptimizerConfig("sgd", lr=0.1))
            check_ebc(ebc, kjt_lengths(["x", "b"], [1, 2, 3, 0], [2, 1, 1, 0]))
            expect(ebc.training, "the module's training flag was overwritten")
            sd = ebc.state_dict()
            expect(f"embedding_bags.{bad}.weight" in sd, f"state dict keys {list(sd)}")

    @case("coll.missing_feature_in_batch", ValueError, ["'b'", "t_b"])
    def _(ctx):
        make_ebc()(kjt_lengths(["a"], [1, 2], [1, 1]))

    @case("coll.extra_feature_warns_result_right",
          legit="a feature no table reads is dropped with a warning (README 'Bad input')")
    def _(ctx):
        ebc = make_ebc()
        k = kjt_lengths(["a", "zzz", "b"], [1, 2, 5, 3, 0], [1, 1, 1, 0, 1, 1])
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = ebc(k)
        expect(any("zzz" in str(x.message) for x in w), "no warning naming the unread feature 'zzz'")
        ref = ebc(kjt_lengths(["a", "b"], [1, 2, 3, 0], [1, 1, 1, 1]))
        expect(torch.equal(out.values(), ref.values()), "dropping the extra feature changed the output")

    @case("coll.weights_to_unweighted_warns", legit="weights given to an unweighted collection: warning, ignored")
    def _(ctx):
        ebc = make_ebc()
        k = kjt_lengths(["a", "b"], [1, 2, 3, 0], [2, 1, 1, 0], weights=T([9.0, 9.0, 9.0, 9.0]))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = ebc(k)
        expect(any("weight" in str(x.message).lower() for x in w), "no warning about ignored weights")
        ref = ebc(good_batch())
        expect(torch.equal(out.values(), ref.values()), "weights were used by an unweighted collection")

    @case("coll.weighted_without_weights", ValueError, ["weight"])
    def _(ctx):
        make_ebc(weighted=True)(good_batch())

    @case("coll.keys_in_other_order", legit="KJT key order need not match table order")
    def _(ctx):
        ebc = make_ebc(dims=(4, 3))
        out = check_ebc(ebc, kjt_lengths(["b", "a"], [0, 1, 2, 3], [1, 0, 2, 1]))
        expect(out.keys() == ["a", "b"] or out.keys() == ["b", "a"], f"keys {out.keys()}")

    @case("coll.mean_pooling_with_empty_bag")
    def _(ctx):
        for kernel in ("native", "fbgemm"):
            check_ebc(make_ebc(pooling="mean", kernel=kernel), good_batch(), mean=True)

    @case("coll.ec_keys_reordered_values_right")
    def _(ctx):
        ec = make_ec()
        w = {k.split(".")[-2]: v.clone() for k, v in ec.state_dict().items()}
        out = ec(kjt_lengths(["b", "a"], [5, 1, 2, 3], [1, 0, 2, 1]))
        expect(torch.equal(out["b"].values(), w["t_b"][T([5])]), "EC feature b rows wrong")
        expect(torch.equal(out["a"].values(), w["t_a"][T([1, 2, 3])]), "EC feature a rows wrong")

    @case("coll.ec_out_of_range", ValueError, ["'a'", "t_a", "10"])
    def _(ctx):
        ec = make_ec()
        ctx.after(unchanged(ec, tables_of(ec)))
        for v in ec(kjt_lengths(["a", "b"], [10, 1], [1, 0, 1, 0])).values():
            v.values().sum().backward()

    @case("coll.forward_given_dense_tensor", (TypeError, ValueError), ["KeyedJaggedTensor"])
    def _(ctx):
        make_ebc()(torch.tensor([[1, 2]]))

    @case("coll.forward_given_dict", (TypeError, ValueError), ["KeyedJaggedTensor"])
    def _(ctx):
        make_ebc()({"a": T([1]), "b": T([2])})

    @case("coll.load_state_dict_wrong_shape", RuntimeError, ["t_a", "size mismatch"])
    def _(ctx):
        ebc = make_ebc()
        ctx.after(unchanged(ebc, tables_of(ebc)))
        sd = ebc.state_dict()
        sd["embedding_bags.t_a.weight"] = torch.zeros(11, 4)
        ebc.load_state_dict(sd)

    @case("coll.load_state_dict_nan_rows", ValueError, ["t_a", "nan"], ok=True,
          legit="loading weights is the user's choice; a NaN table then gives NaN outputs, not a corrupt other table")
    def _(ctx):
        ebc = make_ebc()
        sd = ebc.state_dict()
        sd["embedding_bags.t_a.weight"] = torch.full((10, 4), float("nan"))
        ebc.load_state_dict(sd)
        out = ebc(good_batch()).values()
        expect(bool(out[:, :4].isnan().all()) and bool(out[:, 4:].isfinite().all()), "NaN did not stay in t_a")

    @case("coll.validate_ids_off_out_of_range_is_memory_safe", ValueError, ["t_a"], ok=True, timeout=30,
          legit="validate_ids=False: the user opted out; the kernels must stay memory-safe (README)")
    def _(ctx):
        for kernel in ("native", "fbgemm"):
            ebc = make_ebc(kernel=kernel, validate_ids=False)
            ebc(kjt_lengths(["a", "b"], [1, 10 ** 9, 3, -5], [2, 1, 1, 0])).values().sum().backward()


def make_table_init(lo, hi):
    from lightning_rec import EmbeddingBagCollection
    return EmbeddingBagCollection([bag_cfg("t", 10, 4, ["f"], weight_init_min=lo, weight_init_max=hi)])


def make_ebc_opt(optimizer):
    from lightning_rec import EmbeddingBagCollection
    return EmbeddingBagCollection([bag_cfg("t", 10, 4, ["f"])], optimizer=optimizer)


# ==================================================================================================
# fused optimizers and kernels

def _optim_cases():
    torch = _t()
    from lightning_rec import (
        FusedOptimizer,
        FusedOptimizerConfig,
        combined_optimizer,  # noqa: F401
    )

    F = FusedOptimizerConfig
    simple("opt.name_adamw", lambda: F("adamw"), ValueError, ["adamw", "rowwise_adagrad"])
    simple("opt.name_none", lambda: F(None), ValueError, ["None", "sgd"])
    simple("opt.name_enum_case", lambda: F("SGD"), ValueError, ["SGD"], ok=True, legit="names are case-insensitive")
    for name in ("sgd", "adagrad", "rowwise_adagrad", "adam", "partial_rowwise_adam", "lamb", "lars_sgd"):
        simple(f"opt.{name}.lr_negative", lambda n=name: F(n, lr=-0.1), ValueError, ["lr", ">= 0"])
    simple("opt.lr_nan", lambda: F("sgd", lr=float("nan")), ValueError, ["lr", "finite"])
    simple("opt.lr_text_not_number", lambda: F("sgd", lr="fast"), ValueError, ["lr='fast'", "lr=0.01"])
    simple("opt.lr_text_number", lambda: _expect_lr(F("sgd", lr="0.5"), 0.5), ValueError, ["lr"], ok=True,
           legit="YAML gives numbers as text: '0.5' is 0.5")
    simple("opt.lr_bool", lambda: F("sgd", lr=True), ValueError, ["lr", "True"])
    simple("opt.lr_tensor", lambda: F("sgd", lr=torch.tensor(0.1)), ValueError, ["lr"], ok=True,
           legit="a 0-d tensor learning rate is a number")
    simple("opt.eps_negative", lambda: F("adagrad", eps=-1e-8), ValueError, ["eps", ">= 0"])
    simple("opt.eps_inf", lambda: F("adam", eps=float("inf")), ValueError, ["eps", "finite"])
    simple("opt.weight_decay_negative", lambda: F("adam", weight_decay=-0.01), ValueError, ["weight_decay"])
    simple("opt.beta1_one", lambda: F("adam", beta1=1.0), ValueError, ["beta1", "[0, 1)"])
    simple("opt.beta2_above_one", lambda: F("partial_rowwise_adam", beta2=1.5), ValueError, ["beta2"])
    simple("opt.momentum_negative", lambda: F("lars_sgd", momentum=-0.5), ValueError, ["momentum"])
    simple("opt.unknown_keyword", lambda: F("adam", bettas=(0.9, 0.99)), TypeError, ["bettas"])

    @case("opt.torch_style_betas", ok=True, legit="torch.optim.Adam's betas=(b1, b2) is accepted as beta1 / beta2")
    def _(ctx):
        c = F("adam", betas=(0.8, 0.99))
        expect((c.beta1, c.beta2) == (0.8, 0.99), f"betas=(0.8, 0.99) gave beta1={c.beta1}, beta2={c.beta2}")
    simple("opt.lamb_on_cpu", lambda: make_ebc(opt="lamb"), ValueError, ["lamb", "GPU"])
    simple("opt.lars_on_cpu_fbgemm", lambda: make_ebc(opt="lars_sgd", kernel="fbgemm"), ValueError, ["lars_sgd"])
    simple("opt.adam_on_fbgemm_cpu", lambda: make_ebc(opt="adam", kernel="fbgemm"), ValueError, ["adam", "native"])

    @case("opt.scheduler_sets_nan_lr", ValueError, ["learning rate", "nan"])
    def _(ctx):
        ebc = make_ebc(lr=0.1)
        opt = FusedOptimizer(ebc)

        def next_step_uses_old_rate():  # the refused rate must not stay in the group nor reach the kernels
            lr = opt.param_groups[0]["lr"]
            expect(abs(lr - 0.1) < 1e-6, f"param group lr is {lr} after refusal")
            w0 = ebc_weights(ebc)["t_b"].clone()
            ebc(good_batch()).values().sum().backward()
            expect(torch.allclose(w0[0] - ebc_weights(ebc)["t_b"][0], torch.full((4,), 0.1)), "rate changed")
        ctx.after(next_step_uses_old_rate)
        opt.param_groups[0]["lr"] = float("nan")

    @case("opt.scheduler_sets_negative_lr", ValueError, ["learning rate", "-0.5"])
    def _(ctx):
        ebc = make_ebc()
        opt = FusedOptimizer(ebc)
        opt.param_groups[0]["lr"] = -0.5

    @case("opt.scheduler_sets_text_lr", ValueError, ["lr"], ok=True, legit="'0.2' is the number 0.2")
    def _(ctx):
        ebc = make_ebc(lr=0.1)
        opt = FusedOptimizer(ebc)
        opt.param_groups[0]["lr"] = "0.2"
        w0 = ebc_weights(ebc)["t_b"].clone()
        ebc(good_batch()).values().sum().backward()
        w1 = ebc_weights(ebc)["t_b"]
        expect(torch.allclose(w0[0] - w1[0], torch.full((4,), 0.2)), "fused SGD did not use lr 0.2")

    @case("opt.fused_optimizer_of_plain_module", ValueError, ["fused"])
    def _(ctx):
        FusedOptimizer(torch.nn.Linear(2, 2))

    @case("opt.load_state_from_other_tables", (ValueError, KeyError), ["t_"])
    def _(ctx):
        a = make_ebc(opt="adagrad")
        from lightning_rec import EmbeddingBagCollection
        b = EmbeddingBagCollection([bag_cfg("t_zz", 10, 4, ["a"])], optimizer=F("adagrad"))
        FusedOptimizer(b).load_state_dict(FusedOptimizer(a).state_dict())

    # kernels: parity with torch.optim on duplicate ids (edge: one row twice in a bag and across bags)
    for kernel in ("native", "fbgemm"):
        for opt_name in (("sgd", "adagrad", "rowwise_adagrad") if kernel == "fbgemm"
                         else ("sgd", "adagrad", "rowwise_adagrad", "adam", "partial_rowwise_adam")):
            @case(f"kernel.{kernel}.{opt_name}.duplicate_ids_parity")
            def _(ctx, kernel=kernel, opt_name=opt_name):
                _parity(kernel, opt_name)

    @case("kernel.native_int32_ids_near_int_max", ValueError, ["'a'", "t_a", "2147483647"])
    def _(ctx):
        ebc = make_ebc(kernel="native")
        ctx.after(unchanged(ebc, tables_of(ebc)))
        ebc(kjt_lengths(["a", "b"], T([2 ** 31 - 1, 2, 3, 0], torch.int32), [2, 1, 1, 0])).values().sum().backward()

    @case("kernel.fbgemm_bad_id_many_threads", ValueError, ["'b'", "t_b"])
    def _(ctx):
        torch.set_num_threads(max(torch.get_num_threads(), 16))
        ebc = make_ebc(kernel="fbgemm", opt="rowwise_adagrad")
        ctx.after(unchanged(ebc, tables_of(ebc)))
        ids = torch.randint(0, 6, (4000,))
        ids[3999] = 60
        ebc(kjt_lengths(["a", "b"], ids, [1000, 1000, 1000, 1000])).values().sum().backward()

    @case("kernel.native_bad_id_big_batch", ValueError, ["'a'", "t_a"])
    def _(ctx):
        ebc = make_ebc(kernel="native", opt="adam")
        ctx.after(unchanged(ebc, tables_of(ebc)))
        ids = torch.randint(0, 6, (40000,))
        ids[1234] = 10_000
        ebc(kjt_lengths(["a", "b"], ids, [10000] * 4)).values().sum().backward()

    @case("kernel.fp16_table_native_sgd")
    def _(ctx):
        from lightning_rec import EmbeddingBagCollection
        ebc = EmbeddingBagCollection([bag_cfg("t_a", 10, 4, ["a"], data_type="fp16"),
                                      bag_cfg("t_b", 6, 4, ["b"], data_type="fp16")],
                                     optimizer=F("sgd", lr=0.1), kernel="native")
        check_ebc(ebc, good_batch(), atol=1e-2)

    @case("kernel.weighted_mean_native_vs_fbgemm")
    def _(ctx):
        k = kjt_lengths(["a", "b"], [1, 2, 3, 0], [2, 1, 1, 0], weights=T([0.5, 2.0, -1.0, 3.0]))
        for kernel in ("native", "fbgemm"):
            check_ebc(make_ebc(kernel=kernel, weighted=True, pooling="mean"), k, mean=True, weighted=True)


def _expect_lr(cfg, lr):
    expect(cfg.lr == lr, f"lr {cfg.lr!r} != {lr}")


def _decay_parity(kernel: str, opt_name: str) -> None:
    """One fused step with weight_decay == torch.optim's step on the touched rows (L2: g + wd * w)."""
    torch = _t()
    from lightning_rec import EmbeddingBagCollection, FusedOptimizerConfig
    lr, wd, eps = 0.1, 0.5, 1e-8
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection([bag_cfg("t_a", 10, 4, ["a"])], kernel=kernel,
                                 optimizer=FusedOptimizerConfig(opt_name, lr=lr, weight_decay=wd, eps=eps))
    w0 = ebc_weights(ebc)["t_a"].clone()
    ebc(kjt_lengths(["a"], [3, 3, 4], [2, 1])).values().sum().backward()
    got = ebc_weights(ebc)["t_a"]
    g = torch.zeros_like(w0)
    g[3], g[4] = 2.0, 1.0
    touched = g.abs().sum(1, keepdim=True) > 0
    g = torch.where(touched, g + wd * w0, g)
    if opt_name == "sgd":
        ref = w0 - lr * g
    elif opt_name == "adagrad":
        ref = w0 - lr * g / (g.abs() + eps)
    else:
        ref = w0 - lr * g / ((g * g).mean(1, keepdim=True).sqrt() + eps)
    ref = torch.where(touched, ref, w0)
    expect(torch.allclose(got, ref, atol=1e-5), f"{kernel} {opt_name} weight_decay={wd}: max |diff| "
           f"{float((got - ref).abs().max()):.3g} vs torch.optim")


def _parity(kernel: str, opt_name: str) -> None:
    """One fused step with duplicate ids == the same step by torch.optim on a plain nn.Parameter."""
    torch = _t()
    from lightning_rec import EmbeddingBagCollection, FusedOptimizerConfig
    lr, eps = 0.1, 1e-8
    torch.manual_seed(1)
    ebc = EmbeddingBagCollection([bag_cfg("t_a", 8, 4, ["a"])],
                                 optimizer=FusedOptimizerConfig(opt_name, lr=lr, eps=eps), kernel=kernel)
    w0 = ebc_weights(ebc)["t_a"].clone()
    k = kjt_lengths(["a"], [3, 3, 5, 3, 7], [3, 0, 2])  # row 3 three times, over two bags
    g_B = torch.randn(3, 4)
    (ebc(k).values() * g_B).sum().backward()
    got = ebc_weights(ebc)["t_a"]
    w = torch.nn.Parameter(w0.double().clone())
    rows = [[3, 3, 5], [], [3, 7]]
    pooled = torch.stack([w[r].sum(0) if r else torch.zeros(4, dtype=torch.float64) for r in rows])
    (pooled * g_B.double()).sum().backward()
    g = w.grad.clone()
    with torch.no_grad():
        if opt_name == "sgd":
            ref = w - lr * g
        elif opt_name == "adagrad":
            ref = w - lr * g / (g * g).sqrt().clamp_min(0).add(eps)
            ref = torch.where(g == 0, w, ref)
        elif opt_name == "rowwise_adagrad":
            acc = (g * g).mean(1, keepdim=True)
            ref = torch.where(g.abs().sum(1, keepdim=True) == 0, w, w - lr * g / (acc.sqrt() + eps))
        elif opt_name == "adam":
            m = 0.1 * g
            v = 0.001 * g * g
            ref = w - lr * (m / 0.1) / ((v / 0.001).sqrt() + eps)
            ref = torch.where(g.abs().sum(1, keepdim=True) == 0, w, ref)
        else:  # partial_rowwise_adam: second moment per row
            m = 0.1 * g
            v = 0.001 * (g * g).mean(1, keepdim=True)
            ref = w - lr * (m / 0.1) / ((v / 0.001).sqrt() + eps)
            ref = torch.where(g.abs().sum(1, keepdim=True) == 0, w, ref)
    expect(torch.allclose(got.double(), ref, atol=1e-4), f"{kernel} {opt_name}: max |diff| "
           f"{float((got.double() - ref).abs().max()):.3g} vs the torch reference")


# ==================================================================================================
# planner and plans

def _planner_cases():
    torch = _t()
    from lightning_rec import (
        EmbeddingBagCollection,
        EmbeddingCollection,
        EmbeddingShardingPlanner,
        ParameterConstraints,
        PlannerError,
        Topology,
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )

    simple("plan.topology_world_zero", lambda: Topology(world_size=0), ValueError, ["world_size", "0"])
    simple("plan.topology_world_float", lambda: Topology(world_size=2.0), ValueError, ["world_size"], ok=True,
           legit="2.0 ranks may be read as 2")
    simple("plan.topology_local_not_divisor", lambda: Topology(world_size=4, local_world_size=3), ValueError,
           ["local_world_size=3", "divide"])
    simple("plan.topology_device_tpu", lambda: Topology(world_size=2, compute_device="tpu"), ValueError,
           ["'tpu'", "cpu", "cuda"])
    simple("plan.topology_negative_bw", lambda: Topology(world_size=2, intra_host_bw=-1.0), ValueError,
           ["intra_host_bw"])
    simple("plan.topology_cuda_no_gpu", lambda: Topology(world_size=2, compute_device="cuda"), ValueError,
           ["hbm_cap"])
    simple("plan.constraints_unknown_sharding", lambda: ParameterConstraints(sharding_types=["diagonal"]),
           ValueError, ["diagonal", "row_wise"])
    simple("plan.constraints_unknown_kernel", lambda: ParameterConstraints(compute_kernels=["turbo"]),
           ValueError, ["turbo", "fused"])
    simple("plan.constraints_cache_factor_two", lambda: ParameterConstraints(cache_load_factor=2.0), ValueError,
           ["cache_load_factor"])
    simple("plan.constraints_min_partition_zero", lambda: ParameterConstraints(min_partition=0), ValueError,
           ["min_partition"])
    simple("plan.constraints_sharding_string", lambda: ParameterConstraints(sharding_types="row_wise"), ValueError,
           ["sharding"], ok=True, legit="one sharding type as a string is a list of one")
    simple("plan.planner_batch_zero", lambda: EmbeddingShardingPlanner(Topology(world_size=2), batch_size=0),
           ValueError, ["batch_size"])
    simple("plan.planner_constraint_dict", lambda: EmbeddingShardingPlanner(
        Topology(world_size=2), constraints={"t_a": {"sharding_types": ["row_wise"]}}), ValueError,
        ["'t_a'", "ParameterConstraints"])

    def _ebc_big():
        return EmbeddingBagCollection([bag_cfg("t_a", 1000, 16, ["a"]), bag_cfg("t_b", 600, 16, ["b"])])

    @case("plan.constraint_for_unknown_table", ValueError, ["t_zz", "t_a"])
    def _(ctx):
        EmbeddingShardingPlanner(Topology(world_size=2), constraints={"t_zz": ParameterConstraints(
            sharding_types=["row_wise"])}, print_stats=False).plan(_ebc_big())

    @case("plan.constraints_pooling_negative", ValueError, ["t_a", "pooling factor"])
    def _(ctx):
        EmbeddingShardingPlanner(Topology(world_size=2), constraints={"t_a": ParameterConstraints(
            pooling_factors=-1.0)}, print_stats=False).plan(_ebc_big())

    @case("plan.nothing_fits_tiny_memory", PlannerError, ["t_a", "ddr_cap"])
    def _(ctx):
        EmbeddingShardingPlanner(Topology(world_size=2, ddr_cap=1000), print_stats=False).plan(_ebc_big())

    @case("plan.column_wise_min_partition_above_dim", (PlannerError, ValueError), ["t_a", "min_partition"])
    def _(ctx):
        EmbeddingShardingPlanner(Topology(world_size=2), constraints={"t_a": ParameterConstraints(
            sharding_types=["column_wise"], min_partition=64)}, print_stats=False).plan(_ebc_big())

    @case("plan.no_sharding_types_allowed", (PlannerError, ValueError), ["sharding type=[]", "leave it out"])
    def _(ctx):
        EmbeddingShardingPlanner(Topology(world_size=2), constraints={"t_a": ParameterConstraints(
            sharding_types=[])}, print_stats=False).plan(_ebc_big())

    @case("plan.module_without_tables", (PlannerError, ValueError), ["EmbeddingBagCollection"])
    def _(ctx):
        EmbeddingShardingPlanner(Topology(world_size=2), print_stats=False).plan(torch.nn.Linear(3, 3))

    @case("plan.sequence_tables_two_hosts_only_valid_types")
    def _(ctx):
        from lightning_rec.types import SEQUENCE_SHARDING_TYPES
        ec = EmbeddingCollection([seq_cfg(f"t{i}", 50_000, 32, [f"f{i}"]) for i in range(6)])
        plan = EmbeddingShardingPlanner(Topology(world_size=8, local_world_size=4), print_stats=False).plan(ec)
        types = {str(ps.sharding_type) for mp in plan.plan.values() for ps in mp.values()}
        allowed = {str(t) for t in SEQUENCE_SHARDING_TYPES}
        expect(types <= allowed, f"planner gave sequence tables {types - allowed}")

    @case("plan.ec_forced_grid", (PlannerError, ValueError), ["grid", "t0"])
    def _(ctx):
        ec = EmbeddingCollection([seq_cfg("t0", 5000, 32, ["f0"])])
        EmbeddingShardingPlanner(Topology(world_size=4, local_world_size=2), constraints={
            "t0": ParameterConstraints(sharding_types=["grid_shard"])}, print_stats=False).plan(ec)

    @case("plan.verb_rank_beyond_world", ValueError, ["t_a", "rank 5"])
    def _(ctx):
        ebc = make_ebc()
        construct_module_sharding_plan(ebc, {"t_a": table_wise(rank=5), "t_b": table_wise(rank=0)}, world_size=2)

    @case("plan.verb_for_unknown_table", ValueError, ["t_zz"])
    def _(ctx):
        construct_module_sharding_plan(make_ebc(), {"t_a": row_wise(), "t_b": row_wise(), "t_zz": row_wise()},
                                       world_size=2)

    @case("plan.verb_missing_table", ValueError, ["t_b", "no entry"],
          legit="construct_module_sharding_plan builds partial plans as TorchRec's does; the plan check that "
          "DistributedModelParallel runs names the missing table")
    def _(ctx):
        from lightning_rec.model_parallel import validate_module_plan
        ebc = make_ebc()
        plan = construct_module_sharding_plan(ebc, {"t_a": row_wise()}, world_size=2)
        validate_module_plan("", ebc, plan, 2)

    @case("plan.verb_not_a_verb", ValueError, ["t_a"])
    def _(ctx):
        construct_module_sharding_plan(make_ebc(), {"t_a": "row_wise", "t_b": row_wise()}, world_size=2)


# ==================================================================================================
# metrics

def _metric_cases():
    torch = _t()
    from lightning_rec import AUC, CTR, NDCG, BinnedAUC, LogLoss, NormalizedEntropy, RankingMetrics, Recall

    def upd(m, p, lab):
        m.update(p, lab)
        return m.compute()

    simple("metric.auc_label_two", lambda: upd(AUC(), T([0.1, 0.2, 0.3]), T([0, 1, 2])), ValueError,
           ["0", "1", "label"])
    simple("metric.auc_label_half", lambda: upd(AUC(), T([0.1, 0.2]), T([0.5, 1.0])), ValueError, ["label"])
    simple("metric.auc_label_minus_one", lambda: upd(AUC(), T([0.1, 0.2]), T([-1, 1])), ValueError, ["label"])
    simple("metric.ne_label_two", lambda: upd(NormalizedEntropy(), T([0.1, 0.2]), T([2.0, 1.0])), ValueError, ["label"])
    simple("metric.logloss_label_nan", lambda: upd(LogLoss(), T([0.1, 0.2]), T([float("nan"), 1.0])), ValueError,
           ["label"])
    simple("metric.ctr_labels_bool", lambda: _expect_close(upd(CTR(), T([0.1, 0.2]), T([True, False])), 0.5),
           ValueError, ["label"], ok=True, legit="bool labels are 0/1")
    simple("metric.binned_auc_label_three", lambda: upd(BinnedAUC(), T([0.1, 0.2]), T([3, 1])), ValueError, ["label"])
    simple("metric.auc_shape_mismatch", lambda: upd(AUC(), T([0.1, 0.2, 0.3]), T([0, 1])), ValueError, ["shape"])
    simple("metric.binned_auc_zero_thresholds", lambda: BinnedAUC(num_thresholds=0), ValueError, ["num_thresholds"])

    @case("metric.auc_nan_score", ValueError, ["nan"], ok=True,
          legit="a NaN score makes the AUC undefined: NaN out is honest")
    def _(ctx):
        v = upd(AUC(from_logits=False), T([0.1, float("nan"), 0.3, 0.9]), T([0, 1, 0, 1]))
        expect(bool(torch.isnan(v)), f"AUC with a NaN score is {float(v)}, a number that looks valid")

    @case("metric.auc_ties_correct")
    def _(ctx):
        # all scores tied: AUC 0.5; mixed ties: Mann-Whitney with half credit
        v = upd(AUC(), T([0.3, 0.3, 0.3, 0.3]), T([0, 1, 0, 1]))
        expect(abs(float(v) - 0.5) < 1e-6, f"tied AUC {float(v)}")
        v = upd(AUC(), T([0.1, 0.4, 0.4, 0.8]), T([0, 0, 1, 1]))
        expect(abs(float(v) - 0.875) < 1e-6, f"AUC {float(v)} != 0.875")

    @case("metric.auc_one_class_nan", legit="one class only: AUC undefined, NaN with a warning")
    def _(ctx):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            v = upd(AUC(), T([0.1, 0.2]), T([1, 1]))
        expect(bool(torch.isnan(v)), f"one-class AUC {float(v)}")

    simple("metric.ndcg_k_zero", lambda: NDCG(ks=0), ValueError, ["k"])
    simple("metric.recall_k_negative", lambda: Recall(ks=[5, -1]), ValueError, ["-1"])
    simple("metric.ranking_unknown_metric", lambda: RankingMetrics(metrics=["ndcg", "f1"]), ValueError,
           ["'f1'", "ndcg"])
    simple("metric.ndcg_k_float", lambda: NDCG(ks=2.5), ValueError, ["2.5"])

    @case("metric.ndcg_target_shape_mismatch", ValueError, ["shape"])
    def _(ctx):
        m = NDCG(ks=2)
        m.update(torch.rand(3, 5), torch.zeros(3, 4, dtype=torch.bool))
        m.compute()

    @case("metric.full_target_item_out_of_range", ValueError, ["item", "5"])
    def _(ctx):
        m = NDCG(ks=2)
        m.update_full(torch.rand(2, 5), T([0, 1, 2]), T([1, 5]))
        m.compute()

    @case("metric.full_target_offsets_decreasing", ValueError, ["offsets"])
    def _(ctx):
        m = Recall(ks=2)
        m.update_full(torch.rand(2, 5), T([0, 2, 1]), T([1, 2]))
        m.compute()

    @case("metric.full_offsets_wrong_count", ValueError, ["offsets", "users"])
    def _(ctx):
        m = Recall(ks=2)
        m.update_full(torch.rand(3, 5), T([0, 1, 2]), T([1, 2]))
        m.compute()

    @case("metric.ndcg_matches_torchmetrics")
    def _(ctx):
        from torchmetrics.retrieval import RetrievalNormalizedDCG
        torch.manual_seed(0)
        preds, target = torch.rand(4, 6), torch.rand(4, 6) > 0.6
        target[:, 0] = True
        m = NDCG(ks=3)
        m.update(preds, target)
        ours = m.compute()
        ref = RetrievalNormalizedDCG(top_k=3)
        ref.update(preds.flatten(), target.flatten(), indexes=torch.arange(4).repeat_interleave(6))
        ours = ours if isinstance(ours, torch.Tensor) else next(iter(ours.values()))
        expect(torch.allclose(ours.float(), ref.compute().float(), atol=1e-5), f"NDCG {ours} vs {ref.compute()}")

    @case("metric.recall_user_without_relevant", legit="torchmetrics' default: such users are left out or count 0;"
          " documented either way, never NaN")
    def _(ctx):
        m = Recall(ks=2)
        m.update(T([[0.9, 0.1, 0.5], [0.2, 0.3, 0.1]]), T([[True, False, False], [False, False, False]]))
        v = m.compute()
        v = v if isinstance(v, torch.Tensor) else next(iter(v.values()))
        expect(bool(torch.isfinite(v)), f"recall {v}")


def _expect_close(v, x):
    expect(abs(float(v) - x) < 1e-6, f"{float(v)} != {x}")


# ==================================================================================================
# Criteo files, MovieLens folders

def _data_cases():
    from lightning_rec import CriteoDataModule, MovieLensDataModule

    @case("criteo.empty_file", ValueError, ["empty.tsv", "empty"])
    def _(ctx):
        parse_all(write(ctx.tmp / "empty.tsv", ""))

    @case("criteo.thirty_columns", ValueError, ["cols.tsv", ":3"])
    def _(ctx):
        text = criteo_text(2) + criteo_row(cats=[f"{i:08x}" for i in range(30)]) + "\n"
        parse_all(write(ctx.tmp / "cols.tsv", text))

    @case("criteo.non_hex_category", ValueError, ["nonhex.tsv", ":2", "C3"])
    def _(ctx):
        cats = [f"{i + 1:08x}" for i in range(26)]
        cats[2] = "zz!top"
        parse_all(write(ctx.tmp / "nonhex.tsv", criteo_text(1) + criteo_row(cats=cats) + "\n"))

    @case("criteo.dense_text", ValueError, ["dtext.tsv", ":1", "I4"])
    def _(ctx):
        dense = [str(i) for i in range(13)]
        dense[3] = "abc"
        parse_all(write(ctx.tmp / "dtext.tsv", criteo_row(dense=dense) + "\n" + criteo_text(1)))

    @case("criteo.label_two", ValueError, ["lab.tsv", ":2", "label"])
    def _(ctx):
        parse_all(write(ctx.tmp / "lab.tsv", criteo_text(1) + criteo_row(label="2") + "\n"))

    @case("criteo.crlf_lines", legit="Windows line ends are the same rows")
    def _(ctx):
        table, rep = parse_all(write(ctx.tmp / "crlf.tsv", criteo_text(5).replace("\n", "\r\n")))
        ref, _ = parse_all(write(ctx.tmp / "lf.tsv", criteo_text(5)))
        expect(table.num_rows == 5 and table.equals(ref), "CRLF rows differ from LF rows")

    @case("criteo.gz_file", legit=".gz is read as is (README)")
    def _(ctx):
        p = ctx.tmp / "rows.tsv.gz"
        p.write_bytes(gzip.compress(criteo_text(7).encode()))
        table, _ = parse_all(p)
        ref, _ = parse_all(write(ctx.tmp / "rows.tsv", criteo_text(7)))
        expect(table.equals(ref), "gz rows differ")

    @case("criteo.gz_truncated", (ValueError, OSError, EOFError), ["cut.tsv.gz"])
    def _(ctx):
        data = gzip.compress(criteo_text(400).encode())
        p = ctx.tmp / "cut.tsv.gz"
        p.write_bytes(data[: len(data) // 2])
        parse_all(p)

    @case("criteo.bad_byte_skip_mode_keeps_rest", legit="on_bad_row='skip': the row is counted and skipped, "
          "the rest kept, with a warning")
    def _(ctx):
        text = criteo_text(3).encode() + criteo_row(cats=["\xff\xfe"] + [f"{i:08x}" for i in range(25)]).encode(
            "latin-1") + b"\n" + criteo_text(2).encode()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            table, rep = parse_all(write(ctx.tmp / "byte.tsv", text), on_bad_row="skip")
        expect(table.num_rows == 5, f"{table.num_rows} rows kept, expected 5")
        expect(rep.num_skipped_rows == 1, f"skipped {rep.num_skipped_rows}")

    @case("criteo.bad_byte_error_mode", ValueError, ["byte.tsv", ":4"])
    def _(ctx):
        text = criteo_text(3).encode() + b"0\t\xff" + b"\t1" * 38 + b"\n"
        parse_all(write(ctx.tmp / "byte.tsv", text))

    def criteo_parquet(path: Path, n: int = 20, change=None) -> Path:
        """Criteo rows as a Parquet table (int counts, hash strings), `change(table)` applied first."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        cols = {"label": pa.array([i % 2 for i in range(n)])}
        cols |= {f"I{j + 1}": pa.array([j] * n) for j in range(13)}
        cols |= {f"C{j + 1}": pa.array([f"{j + 1:08x}"] * n) for j in range(26)}
        table = pa.table(cols)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(change(table) if change else table, path)
        return path

    def criteo_table_module(path: Path, ctx, **kw):
        path = str(path) if isinstance(path, Path) else path  # or a datasets.Dataset
        dm = CriteoDataModule(train_path=path, batch_size=8, cache_dir=str(ctx.tmp / "c"),
                              num_embeddings_per_feature=100, **kw)
        dm.prepare_data()
        dm.setup("fit")
        return dm

    @case("criteo.parquet_label_two", ValueError, ["lab.parquet", "row 3", "label", "on_bad_row"])
    def _(ctx):
        import pyarrow as pa

        labels = pa.array([0, 1, 0, 2] + [0] * 16)
        criteo_table_module(criteo_parquet(ctx.tmp / "lab.parquet", change=lambda t: t.set_column(0, "label", labels)),
                            ctx)

    @case("criteo.parquet_missing_columns", ValueError, ["cols.parquet", "'C26'", "rename"])
    def _(ctx):
        criteo_table_module(criteo_parquet(ctx.tmp / "cols.parquet", change=lambda t: t.drop_columns(["C26"])), ctx)

    @case("criteo.parquet_streaming_bad_row", ValueError, ["stream.parquet", "row 17", "label", "on_bad_row"])
    def _(ctx):
        import pyarrow as pa

        labels = pa.array([0] * 17 + [3] + [1] * 2)
        dm = criteo_table_module(criteo_parquet(ctx.tmp / "stream.parquet",
                                                change=lambda t: t.set_column(0, "label", labels)), ctx, streaming=True)
        list(dm.train_dataloader())

    @case("criteo.parquet_negative_id", ValueError, ["neg.parquet", "row 0", "C1", "-5"])
    def _(ctx):
        import pyarrow as pa

        ids = pa.array([-5] + [1] * 19)
        criteo_table_module(criteo_parquet(ctx.tmp / "neg.parquet", change=lambda t: t.set_column(14, "C1", ids)), ctx)

    @case("criteo.parquet_same_as_text", legit="a table holds the same rows as the text file")
    def _(ctx):
        text = criteo_table_module(write(ctx.tmp / "rows.tsv", criteo_text(20)), ctx)
        table = criteo_table_module(criteo_parquet(ctx.tmp / "rows.parquet"), ctx)
        a, b = (next(iter(m.train_dataloader())) for m in (text, table))
        expect(a.labels.tolist() == b.labels.tolist() and a.sparse_features.values().tolist()
               == b.sparse_features.values().tolist(), "the Parquet rows differ from the text rows")

    @case("criteo.directory_as_file", ValueError, ["directory"])
    def _(ctx):
        (ctx.tmp / "dir.tsv").mkdir()
        parse_all(ctx.tmp / "dir.tsv")

    @case("criteo.missing_file", (ValueError, FileNotFoundError), ["nope.tsv"])
    def _(ctx):
        parse_all(ctx.tmp / "nope.tsv")

    @case("criteo.kaggle_header_only", ValueError, ["hdr.csv"], ok=True,
          legit="a header without rows is an empty split: zero rows")
    def _(ctx):
        hdr = "Id,Label," + ",".join(f"I{i}" for i in range(1, 14)) + "," + ",".join(f"C{i}" for i in range(1, 27))
        table, rep = parse_all(write(ctx.tmp / "hdr.csv", hdr + "\n"))
        expect(table is None or table.num_rows == 0, "rows from a header-only file")

    @case("criteo.negative_dense_values_stay_finite",
          legit="Criteo's dense columns hold -1/-2: the transform must stay finite")
    def _(ctx):
        from lightning_rec.data.criteo import CriteoDataset, build_criteo_cache
        dense = ["-2", "-1", "0", "1e12"] + [str(i) for i in range(9)]
        p = write(ctx.tmp / "neg.tsv", "".join(criteo_row(label=str(i % 2), dense=dense) + "\n" for i in range(4)))
        arrow, _ = build_criteo_cache(p, cache_dir=ctx.tmp / "cache")
        ds = CriteoDataset(arrow, 100)
        b = ds.__getitems__([0, 1, 2, 3])
        expect(bool(torch_isfinite(b.dense_features)), f"dense features {b.dense_features[0].tolist()}")

    @case("criteo.short_last_line_warns", legit="a short last row (no trailing separator): padded with missing "
          "values, counted and warned (criteo.py: trailing empty fields stripped, as in some copies of train.txt)")
    def _(ctx):
        text = criteo_text(3) + "1\t1\t2\t3"
        import logging
        records = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = records.append
        logger = logging.getLogger("lightning_rec")
        logger.addHandler(handler)
        try:
            table, rep = parse_all(write(ctx.tmp / "cut.tsv", text), on_bad_row="skip")
            rep.log_skips()  # what the data modules call at the end of a file
        finally:
            logger.removeHandler(handler)
        expect((table.num_rows, rep.num_skipped_rows) == (3, 1) or (table.num_rows, rep.num_padded_rows) == (4, 1),
               f"{table.num_rows} rows, report {rep}")
        expect(any("cut.tsv" in r.getMessage() for r in records), "no logged warning naming the cut file")

    @case("criteo.last_line_cut_after_tab", ValueError, ["cutab.tsv", ":4"])
    def _(ctx):
        parse_all(write(ctx.tmp / "cutab.tsv", criteo_text(3) + "1\t1\t2\t"))

    simple("criteo.dm_on_bad_row_drop", lambda: CriteoDataModule(on_bad_row="drop"), ValueError, ["'drop'", "skip"])
    simple("criteo.dm_missing_categorical_bad", lambda: CriteoDataModule(missing_categorical="zero"), ValueError,
           ["'zero'", "reserved_id"])
    simple("criteo.dm_25_table_sizes", lambda: CriteoDataModule(num_embeddings_per_feature=[10] * 25), ValueError,
           ["26", "25"])
    simple("criteo.dm_parser_unknown", lambda: CriteoDataModule(parser="rust"), ValueError, ["'rust'", "native"])
    simple("criteo.dm_batch_size_zero", lambda: CriteoDataModule(batch_size=0), ValueError, ["batch_size"])
    simple("criteo.dm_table_size_zero", lambda: CriteoDataModule(num_embeddings_per_feature=0), ValueError,
           ["num_embeddings"])

    @case("criteo.dm_unlabelled_train_file", ValueError, ["label", "train"], timeout=40)
    def _(ctx):
        p = write(ctx.tmp / "test_nolabel.tsv", "".join(criteo_row(label=None) + "\n" for _ in range(8)))
        dm = CriteoDataModule(train_path=str(p), batch_size=4, cache_dir=str(ctx.tmp / "c"),
                              num_embeddings_per_feature=100)
        dm.setup("fit")
        next(iter(dm.train_dataloader()))

    @case("criteo.dm_train_path_missing", (ValueError, FileNotFoundError), ["missing.tsv"], timeout=40)
    def _(ctx):
        dm = CriteoDataModule(train_path=str(ctx.tmp / "missing.tsv"), batch_size=4, cache_dir=str(ctx.tmp / "c"))
        dm.prepare_data()
        dm.setup("fit")

    @case("criteo.real_sample_streaming_equals_cached", timeout=60)
    def _(ctx):
        src = DATA / "criteo" / "criteo_kaggle_valid_sample.tsv"
        if not src.exists():
            raise Skipped(f"{src} is absent")
        lines = src.read_text().splitlines(keepends=True)[:300]
        p = write(ctx.tmp / "s.tsv", "".join(lines))
        out = []
        for streaming in (False, True):
            dm = CriteoDataModule(train_path=str(p), batch_size=64, cache_dir=str(ctx.tmp / "c"), streaming=streaming,
                                  shuffle=False, num_embeddings_per_feature=1000)
            dm.prepare_data()
            dm.setup("fit")
            out.append(sum(int(b.labels.numel()) for b in dm.train_dataloader()))
        expect(out[0] == out[1] == 300, f"rows cached / streaming {out}")

    # MovieLens
    @case("ml.empty_folder", (ValueError, FileNotFoundError), ["u.data", "ratings"])
    def _(ctx):
        (ctx.tmp / "ml").mkdir()
        MovieLensDataModule(str(ctx.tmp / "ml")).setup("fit")

    simple("ml.split_unknown", lambda: MovieLensDataModule("x", split="80/20"), ValueError, ["'80/20'", "ro_811"])
    simple("ml.negatives_two", lambda: MovieLensDataModule("x", num_negatives=2), ValueError, ["num_negatives=2"])
    simple("ml.batch_size_zero", lambda: MovieLensDataModule("x", batch_size=0), ValueError, ["batch_size"])

    @case("ml.udata_bad_row", ValueError, ["u.data", ":3"], timeout=40)
    def _(ctx):
        d = ctx.tmp / "ml-bad"
        write(d / "u.data", "1\t1\t5\t881250949\n2\t3\t4\t881250950\nx\ty\tz\tw\n")
        MovieLensDataModule(str(d), side_features=False).setup("fit")

    @case("ml.ratings_csv_missing_column", ValueError, ["ratings.csv", "movieId"], timeout=40)
    def _(ctx):
        d = ctx.tmp / "ml-csv"
        write(d / "ratings.csv", "userId,rating,timestamp\n1,5,1\n2,4,2\n")
        MovieLensDataModule(str(d), side_features=False).setup("fit")

    @case("ml.leave_one_out_without_timestamps", ValueError, ["split='loo'", "no timestamp", "ro_811"], timeout=40)
    def _(ctx):
        d = ctx.tmp / "ml-untimed"
        write(d / "ratings.csv", "user,item,rating\n1,2,5\n1,3,4\n1,4,5\n")
        MovieLensDataModule(str(d), split="loo", side_features=False).setup("fit")

    @case("ml.parquet_list_ids", ValueError, ["ratings.parquet", "'item'", "integers or strings"], timeout=40)
    def _(ctx):
        import pyarrow as pa
        import pyarrow.parquet as pq

        d = ctx.tmp / "ml-pq"
        d.mkdir()
        pq.write_table(pa.table({"user": [1, 1, 2], "item": [[1], [2], [1]]}), d / "ratings.parquet")
        MovieLensDataModule(str(d), side_features=False).setup("fit")

    @case("ml.string_ids", legit="shop logs name users and items by strings: kept as the data's own ids")
    def _(ctx):
        d = ctx.tmp / "ml-str"
        write(d / "ratings.csv", "user,item,rating\n" + "".join(f"u{u},B0{i:03d},1\n" for u in range(6)
                                                                 for i in range(u, u + 5)))
        dm = MovieLensDataModule(str(d), side_features=False)
        dm.setup("fit")
        expect(dm.user_ids.tolist() == [f"u{u}" for u in range(6)] and dm.report.num_interactions == 30,
               f"ids {dm.user_ids.tolist()}, {dm.report.num_interactions} interactions")

    @case("criteo.parquet_hub_data_folder", ValueError, ["several splits", "train-*.parquet"])
    def _(ctx):
        d = ctx.tmp / "data"
        for name in ("train-00000-of-00001.parquet", "test-00000-of-00001.parquet"):
            criteo_parquet(d / name)
        criteo_table_module(d, ctx)

    def criteo_dataset(ctx, n: int = 20):
        import datasets
        import pyarrow.parquet as pq

        return datasets.Dataset(pq.read_table(criteo_parquet(ctx.tmp / "dataset.parquet", n)))

    @case("criteo.dataset_dict_object", ValueError, ["DatasetDict", "pass one split", "ds['train']"])
    def _(ctx):
        import datasets

        CriteoDataModule(train_path=datasets.DatasetDict({"train": criteo_dataset(ctx), "test": criteo_dataset(ctx)}))

    @case("criteo.iterable_dataset_object", ValueError, ["IterableDataset", "pass its files", "streaming=True"])
    def _(ctx):
        CriteoDataModule(train_path=criteo_dataset(ctx).to_iterable_dataset())

    @case("criteo.dataset_object_bad_label", ValueError, ["data.parquet", "row 3", "label", "on_bad_row"])
    def _(ctx):
        ds = criteo_dataset(ctx)
        criteo_table_module(ds.map(lambda r, i: {"label": 2 if i == 3 else r["label"]}, with_indices=True), ctx)

    @case("criteo.dataset_object_same_as_text", legit="a datasets.Dataset gives the rows of its text file")
    def _(ctx):
        text = criteo_table_module(write(ctx.tmp / "rows.tsv", criteo_text(20)), ctx)
        rows = criteo_dataset(ctx).add_column("row", list(range(20)))
        table = criteo_table_module(rows.shuffle(seed=0).sort("row"), ctx)  # two index mappings: the same order
        a, b = (next(iter(m.train_dataloader())) for m in (text, table))
        expect(a.labels.tolist() == b.labels.tolist() and a.sparse_features.values().tolist()
               == b.sparse_features.values().tolist(), "the Dataset's rows differ from the text rows")

    @case("ml.dataset_dict_object", ValueError, ["data_dir", "DatasetDict", "pass one split"])
    def _(ctx):
        import datasets

        rows = datasets.Dataset.from_dict({"user": [1, 2], "item": [3, 4]})
        MovieLensDataModule(datasets.DatasetDict({"train": rows}))

    @case("ml.given_without_test_file", ValueError, ["split='given'", "train and a test file", "(no test file)"])
    def _(ctx):
        d = ctx.tmp / "given"
        write(d / "shop.train.csv", "user,item,rating\n1,2,5\n")
        write(d / "shop.valid.csv", "user,item,rating\n1,3,5\n")
        MovieLensDataModule(str(d), split="given", side_features=False).setup("fit")

    @case("ml.given_name_says_two_splits", ValueError, ["train_test.csv", "more than one split", "rename"])
    def _(ctx):
        d = ctx.tmp / "given2"
        write(d / "train_test.csv", "user,item,rating\n1,2,5\n")
        write(d / "test.csv", "user,item,rating\n1,3,5\n")
        MovieLensDataModule(str(d), split="given", side_features=False).setup("fit")

    @case("ml.given_holds_out_the_test_file", legit="split='given' holds out exactly the test file's new pairs")
    def _(ctx):
        d = ctx.tmp / "given3"
        trained = "".join(f"{u},{i},5\n" for u in range(4) for i in range(u, u + 4))
        write(d / "train.csv", "user,item,rating\n" + trained)
        write(d / "test.csv", "user,item,rating\n0,9,5\n1,1,5\n2,8,4\n")  # (1, 1) was trained on: dropped
        dm = MovieLensDataModule(str(d), split="given", side_features=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dm.setup("fit")
        offsets, items = dm.datasets["test"].target
        got = {(int(dm.user_ids[u]), int(dm.item_ids[i])) for u in range(dm.num_users)
               for i in items[offsets[u]:offsets[u + 1]].tolist()}
        expect(got == {(0, 9), (2, 8)}, f"held out {got}")

    @case("ml.min_rating_above_scale", ValueError, ["min_rating"], timeout=60)
    def _(ctx):
        src = DATA / "movielens" / "ml-100k"
        if not (src / "u.data").exists():
            raise Skipped(f"{src} is absent")
        MovieLensDataModule(str(src), min_rating=6, side_features=False).setup("fit")


def torch_isfinite(t):
    return _t().isfinite(t).all()


# ==================================================================================================
# models, CLI, checkpoints

def _model_cli_ckpt_cases():
    torch = _t()
    from lightning_rec import DLRMModule
    from lightning_rec.data import Batch

    SMALL = dict(num_embeddings_per_feature=20, embedding_dim=4, sparse_feature_names=["c1", "c2"],
                 dense_arch_layer_sizes=[8, 4], over_arch_layer_sizes=[8, 1], dense_in_features=3)

    def batch(B=4, dense=3, labels=None):
        k = kjt_lengths(["c1", "c2"], torch.arange(2 * B) % 20, [1] * (2 * B))
        lab = labels if labels is not None else (torch.arange(B) % 2).float()
        return Batch(dense_features=torch.rand(B, dense), sparse_features=k, labels=lab)

    simple("model.dlrm_interaction_cat", lambda: DLRMModule(**SMALL, interaction="cat"), ValueError, ["'cat'", "dot"])
    simple("model.dlrm_dense_opt_lbfgs", lambda: DLRMModule(**SMALL, dense_optimizer="lbfgs"), ValueError, ["'lbfgs'"])
    simple("model.dlrm_over_arch_two_logits", lambda: DLRMModule(**{**SMALL, "over_arch_layer_sizes": [8, 2]}),
           ValueError, ["over_arch_layer_sizes", "end in 1"])
    simple("model.dlrm_sizes_list_wrong_length",
           lambda: DLRMModule(**{**SMALL, "num_embeddings_per_feature": [20, 20, 20]}), ValueError, ["3", "2"])
    simple("model.dlrm_sparse_lr_nan", lambda: DLRMModule(**SMALL, sparse_lr=float("nan")), ValueError, ["lr"])
    simple("model.dlrm_dense_last_not_dim", lambda: DLRMModule(**{**SMALL, "dense_arch_layer_sizes": [8, 5]}),
           ValueError, ["embedding_dim", "4"])

    @case("model.dlrm_wrong_dense_width", ValueError, ["dense_in_features", "5"])
    def _(ctx):
        m = DLRMModule(**SMALL)
        m.training_step(batch(dense=5), 0)

    @case("model.dlrm_nan_labels_training", ValueError, ["label"])
    def _(ctx):
        m = DLRMModule(**SMALL)
        ctx.after(unchanged(m, tables_of(m), "DLRM weights"))
        m.training_step(batch(labels=torch.tensor([0.0, float("nan"), 1.0, 0.0])), 0).backward()

    @case("model.dlrm_labels_two", ValueError, ["label"])
    def _(ctx):
        m = DLRMModule(**SMALL)
        ctx.after(unchanged(m, tables_of(m), "DLRM weights"))
        m.training_step(batch(labels=torch.tensor([0.0, 2.0, 1.0, 0.0])), 0).backward()

    @case("model.dlrm_labels_shape", ValueError, ["label"])
    def _(ctx):
        m = DLRMModule(**SMALL)
        m.training_step(batch(labels=torch.zeros(3)), 0)

    # CLI (in process; argparse/jsonargparse errors exit with a message on stderr)
    def cli(*args, entry="fit"):
        from lightning_rec import cli as cli_mod
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                if entry == "export":
                    return cli_mod.export_main(list(args))
                if entry == "preprocess":
                    from lightning_rec.cli import preprocess_main
                    return preprocess_main(list(args))
                return cli_mod.run_cli([entry, *args])
            except SystemExit as e:
                if e.code in (0, None):
                    return None
                raise CLIError(err.getvalue()[-2000:] or f"exit {e.code}") from None

    simple("cli.fit_config_missing", lambda: cli("--config", "/nonexistent/cfg.yaml"), CLIError, ["cfg.yaml"])
    simple("cli.fit_max_steps_text", lambda: cli("--config", str(ROOT / "recipes/configs/dlrm_synthetic.yaml"),
                                                  "--trainer.max_steps=abc"), CLIError, ["max_steps", "abc"],
           timeout=60)
    simple("cli.fit_unknown_model_class", lambda: cli("--model=lightning_rec.NoSuchModel"), CLIError,
           ["NoSuchModel"], timeout=60)
    simple("cli.fit_negative_sparse_lr", lambda: cli("--config", str(ROOT / "recipes/configs/dlrm_synthetic.yaml"),
                                                      "--model.init_args.sparse_lr=-1", "--trainer.max_steps=1"),
           CLIError, ["sparse_lr=-1", ">= 0"], timeout=60)
    simple("cli.export_missing_checkpoint", lambda: cli("/nonexistent/x.ckpt", "/tmp/out_never", entry="export"),
           (CLIError, ValueError, FileNotFoundError), ["x.ckpt"])
    simple("cli.preprocess_26_sizes_wrong", lambda: cli("--input", str(ROOT / "README.md"), "--output_dir",
                                                         "/tmp/battery_never",
                                                         "--num_embeddings", "1,2,3", entry="preprocess"),
           (CLIError, ValueError), ["26", "num_embeddings"])
    simple("cli.preprocess_missing_input", lambda: cli("--input", "/nonexistent/day_0.gz", "--output_dir",
                                                        "/tmp/battery_never", entry="preprocess"),
           (CLIError, ValueError, FileNotFoundError), ["day_0.gz"])
    simple("cli.preprocess_rows_per_shard_zero", lambda: cli("--input", str(ROOT / "README.md"), "--output_dir",
                                                              "/tmp/battery_never", "--rows_per_shard", "0",
                                                              entry="preprocess"),
           (CLIError, ValueError), ["rows_per_shard"])

    # checkpoints (single process: the unsharded module, DCP format)
    from lightning_rec import checkpoint as ck

    def saved(ctx, module=None):
        module = module or make_ebc(opt="adagrad")
        path = ctx.tmp / "ck"
        ck.save({"state_dict": module.state_dict()}, path)
        return module, path

    @case("ckpt.load_missing_dir", (ValueError, FileNotFoundError), ["nowhere"])
    def _(ctx):
        ck.load_model(make_ebc(), ctx.tmp / "nowhere")

    @case("ckpt.metadata_truncated", (ValueError, OSError), ["ck"])
    def _(ctx):
        m, path = saved(ctx)
        md = path / ".metadata"
        md.write_bytes(md.read_bytes()[:20])
        fresh = make_ebc(opt="adagrad")
        with torch.no_grad():
            for p in fresh.parameters():
                p.add_(1.0)
        ctx.after(unchanged(fresh, tables_of(fresh), "module"))
        ck.load_model(fresh, path)

    @case("ckpt.data_file_truncated", (ValueError, OSError, RuntimeError), ["ck"])
    def _(ctx):
        m, path = saved(ctx)
        for f in path.glob("*.distcp"):
            f.write_bytes(f.read_bytes()[:16])
        ck.load_model(make_ebc(opt="adagrad"), path)

    @case("ckpt.other_tables", ValueError, ["t_zz"])
    def _(ctx):
        from lightning_rec import EmbeddingBagCollection
        m, path = saved(ctx)
        other = EmbeddingBagCollection([bag_cfg("t_zz", 10, 4, ["a"])])
        ck.load_model(other, path)

    @case("ckpt.other_dim", ValueError, ["t_a"])
    def _(ctx):
        m, path = saved(ctx)
        other = make_ebc(opt="adagrad", dims=(8, 4))
        ctx.after(unchanged(other, tables_of(other), "module"))
        ck.load_model(other, path)

    @case("ckpt.round_trip_exact")
    def _(ctx):
        m, path = saved(ctx)
        fresh = make_ebc(opt="adagrad")
        with torch.no_grad():
            for p in fresh.parameters():
                p.zero_()
        ck.load_model(fresh, path)
        for k, v in m.state_dict().items():
            expect(torch.equal(fresh.state_dict()[k], v), f"{k} differs after load")

    @case("ckpt.export_not_a_checkpoint", (ValueError, FileNotFoundError), ["notckpt"])
    def _(ctx):
        (ctx.tmp / "notckpt").mkdir()
        ck.export(ctx.tmp / "notckpt", ctx.tmp / "out")

    @case("ckpt.load_exported_missing_config", (ValueError, FileNotFoundError), ["config.json"])
    def _(ctx):
        (ctx.tmp / "exp").mkdir()
        (ctx.tmp / "exp" / "model.safetensors").write_bytes(b"")
        ck.load_exported(ctx.tmp / "exp")

    @case("ckpt.load_file_truncated", (ValueError, OSError, RuntimeError), ["one.ckpt"])
    def _(ctx):
        p = ctx.tmp / "one.ckpt"
        ck.save_file({"state_dict": make_ebc().state_dict()}, p)
        p.write_bytes(p.read_bytes()[:100])
        ck.load_file(p)


class CLIError(Exception):
    """The CLI exited with an error; the message is what it printed."""


# ==================================================================================================
# strategy, pipeline (constructors), and two-rank cases

def _strategy_cases():
    from lightning_rec import RecStrategy

    simple("strategy.dense_zero", lambda: RecStrategy(dense="zero"), ValueError, ["'zero'", "ddp", "fsdp"])
    simple("strategy.checkpoint_format_pickle", lambda: RecStrategy(checkpoint_format="pickle"), ValueError,
           ["'pickle'", "dcp"])
    simple("strategy.timeout_negative", lambda: RecStrategy(embedding_timeout=-5), ValueError, ["embedding_timeout"])
    simple("strategy.timeout_text", lambda: RecStrategy(embedding_timeout="soon"), ValueError, ["embedding_timeout"])
    simple("strategy.pipeline_text", lambda: RecStrategy(pipeline="yes"), ValueError, ["pipeline"])
    simple("strategy.plan_wrong_type", lambda: RecStrategy(plan={"t_a": "row_wise"}), ValueError, ["ShardingPlan"])

    @case("strategy.rec_one_device_trains", timeout=90, legit="strategy='rec' on one process is a valid run")
    def _(ctx):
        import lightning.pytorch as L

        from lightning_rec import DLRMModule, SyntheticCriteoDataModule
        torch = _t()
        L.seed_everything(0)
        data = SyntheticCriteoDataModule(num_train_samples=256, num_val_samples=128, batch_size=64,
                                         num_embeddings_per_feature=32)
        m = DLRMModule(num_embeddings_per_feature=32, embedding_dim=4, dense_arch_layer_sizes=[8, 4],
                       over_arch_layer_sizes=[8, 1])
        before = {k: v.clone() for k, v in m.state_dict().items()}
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            trainer = L.Trainer(strategy="rec", accelerator="cpu", devices=1, max_epochs=1, logger=False,
                                enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
            trainer.fit(m, data)
        expect(trainer.global_step == 4, f"global_step {trainer.global_step}")
        changed = any(not torch.equal(v, m.state_dict()[k]) for k, v in before.items() if k in m.state_dict())
        expect(changed, "no weight changed")


# -- two ranks -------------------------------------------------------------------------------------

def _threads():
    _t().set_num_threads(int(os.environ.get("BATTERY_THREADS", "1")))


def _outcome(fn):
    start = time.monotonic()
    try:
        value = fn()
    except BaseException as e:  # noqa: BLE001 - sent back to the case
        return ("error", [k.__name__ for k in type(e).__mro__], f"{type(e).__name__}: {e}", time.monotonic() - start)
    return ("ok", value, "", time.monotonic() - start)


def _fast_guard():
    from lightning_rec import collective_guard
    collective_guard.GRACE_S = 1.0


def _dmp_of(ebc, verbs, W, shared_memory, timeout=20.0):
    from lightning_rec import DistributedModelParallel, ShardingPlan, construct_module_sharding_plan
    plan = ShardingPlan({"": construct_module_sharding_plan(ebc, verbs, world_size=W)})
    return DistributedModelParallel(ebc, plan=plan, device="cpu", timeout=timeout, shared_memory=shared_memory)


def _verbs(kind="tw"):
    from lightning_rec import column_wise, row_wise, table_wise
    return {"tw": {"t_a": table_wise(rank=0), "t_b": table_wise(rank=1)},
            "rw": {"t_a": row_wise(), "t_b": row_wise()},
            "cw": {"t_a": column_wise(ranks=[0, 1]), "t_b": table_wise(rank=0)}}[kind]


def _rank_batches(rank):
    # rank 0: B=2, rank 1: B=3 (different batch sizes per rank)
    if rank == 0:
        return kjt_lengths(["a", "b"], [1, 2, 3, 0], [2, 1, 1, 0])
    return kjt_lengths(["a", "b"], [9, 4, 5, 5, 1], [1, 0, 2, 1, 0, 1])


def rank_uneven_batches(rank, W, kind, shm):
    """Each rank's output must equal the unsharded module on its own batch; after one SGD step the
    gathered tables must equal the unsharded step on both batches."""
    _threads()
    torch = _t()
    ebc = make_ebc()
    ref = make_ebc()
    dmp = _dmp_of(ebc, _verbs(kind), W, shm)

    def go():
        k = _rank_batches(rank)
        out = dmp(k)
        expect(torch.allclose(out.values(), ref(k).values(), atol=1e-6), f"rank {rank} output differs from unsharded")
        return True
    return _outcome(go)


def rank_one_bad_id(rank, W, shm):
    _threads()
    _fast_guard()
    ebc = make_ebc()
    dmp = _dmp_of(ebc, _verbs("rw"), W, shm)

    def go():
        k = _rank_batches(0)
        if rank == 1:
            k = kjt_lengths(["a", "b"], [1, 2, 3, 99], [2, 1, 1, 0])
        dmp(k).values().sum().backward()
    return _outcome(go)


def rank_one_raises_then_barrier(rank, W, shm):
    _threads()
    _fast_guard()
    import torch.distributed as dist
    ebc = make_ebc()
    dmp = _dmp_of(ebc, _verbs("tw"), W, shm, timeout=60)

    def go():
        if rank == 1:
            try:
                raise RuntimeError("user code failed on rank 1")
            except RuntimeError:
                pass
            dist.barrier()
            return "rank 1 at its barrier"
        dmp(_rank_batches(0)).values().sum().backward()
    return _outcome(go)


def rank_one_exits(rank, W, shm):
    _threads()
    ebc = make_ebc()
    dmp = _dmp_of(ebc, _verbs("tw"), W, shm, timeout=60)
    if rank == 1:
        os._exit(3)

    def go():
        dmp(_rank_batches(0)).values().sum().backward()
    return _outcome(go)


def rank_different_plans(rank, W, shm):
    _threads()
    ebc = make_ebc()
    return _outcome(lambda: _dmp_of(ebc, _verbs("tw" if rank == 0 else "rw"), W, shm))


def rank_different_tables(rank, W, shm):
    _threads()
    ebc = make_ebc(rows=(10, 6) if rank == 0 else (10, 7))
    return _outcome(lambda: _dmp_of(ebc, _verbs("tw"), W, shm))


def rank_missing_feature(rank, W, shm):
    _threads()
    _fast_guard()
    ebc = make_ebc()
    dmp = _dmp_of(ebc, _verbs("tw"), W, shm)

    def go():
        k = _rank_batches(0) if rank == 0 else kjt_lengths(["a"], [1, 2], [1, 1])
        dmp(k).values().sum().backward()
    return _outcome(go)


def rank_extra_step(rank, W, shm):
    _threads()
    _fast_guard()
    import torch.distributed as dist
    dmp = _dmp_of(make_ebc(), _verbs("rw"), W, shm, timeout=60)

    def go():
        for _ in range(2 if rank == 0 else 1):
            dmp(_rank_batches(rank)).values().sum().backward()
        dist.barrier()
    return _outcome(go)


def rank_empty_batch(rank, W, shm):
    _threads()
    torch = _t()
    ebc, ref = make_ebc(), make_ebc()
    dmp = _dmp_of(ebc, _verbs("rw"), W, shm)

    def go():
        k = _rank_batches(0) if rank == 0 else kjt_lengths(["a", "b"], T([], torch.int64), T([], torch.int64))
        out = dmp(k)
        expect(torch.allclose(out.values(), ref(k).values()), f"rank {rank} output wrong")
        out.values().sum().backward()
        return tuple(out.values().shape)
    return _outcome(go)


def rank_nan_weight(rank, W, shm):
    _threads()
    _fast_guard()
    dmp = _dmp_of(make_ebc(weighted=True), _verbs("tw"), W, shm)

    def go():
        w = T([1.0, 1.0, 1.0, float("nan") if rank == 1 else 1.0])
        dmp(kjt_lengths(["a", "b"], [1, 2, 3, 0], [2, 1, 1, 0], weights=w)).values().sum().backward()
    return _outcome(go)


def rank_bad_timeout(rank, W, shm):
    _threads()
    from lightning_rec import DistributedModelParallel, ShardingPlan, construct_module_sharding_plan
    ebc = make_ebc()
    plan = ShardingPlan({"": construct_module_sharding_plan(ebc, _verbs("tw"), world_size=W)})
    return _outcome(lambda: DistributedModelParallel(ebc, plan=plan, device="cpu", timeout=-1, shared_memory=shm))


def rank_plan_rank_out_of_world(rank, W, shm):
    _threads()
    from lightning_rec import table_wise
    return _outcome(lambda: _dmp_of(make_ebc(), {"t_a": table_wise(rank=0), "t_b": table_wise(rank=3)}, W, shm))


def rank_pipeline_bad_model_output(rank, W, shm):
    _threads()
    torch = _t()
    from lightning_rec import TrainPipelineSparseDist
    from lightning_rec.data import Batch

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = make_ebc()

        def forward(self, batch):
            return self.ebc(batch.sparse_features).values().sum()  # not (loss, output)

    from lightning_rec import DistributedModelParallel, ShardingPlan, construct_module_sharding_plan
    m = M()
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(m.ebc, _verbs("tw"), world_size=W)})
    dmp = DistributedModelParallel(m, plan=plan, device="cpu", timeout=20, shared_memory=shm, dense=None)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    batches = [Batch(dense_features=torch.zeros(2, 1), sparse_features=_rank_batches(0), labels=torch.zeros(2))] * 2

    def go():
        with TrainPipelineSparseDist(dmp, opt, "cpu") as p:
            it = iter(batches)
            p.progress(it)
    return _outcome(go)


def rank_trainer_uneven_loaders(rank, W, pipeline=False):
    """Trainer(strategy='rec') at 2 ranks, rank 1's loader 2 batches shorter: the epoch ends together."""
    _threads()
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    from lightning_rec import DLRMModule
    from lightning_rec.data import Batch
    torch = _t()

    class DM(L.LightningDataModule):
        def train_dataloader(self):
            n = 6 if rank == 0 else 4
            g = torch.Generator().manual_seed(rank)
            batches = []
            for _ in range(n):
                k = kjt_lengths(["c1", "c2"], torch.randint(0, 20, (16,), generator=g), [1] * 16)
                batches.append(Batch(torch.rand(8, 3, generator=g), k, (torch.rand(8, generator=g) > 0.5).float()))
            return DataLoader(batches, batch_size=None)

    m = DLRMModule(num_embeddings_per_feature=20, embedding_dim=4, sparse_feature_names=["c1", "c2"],
                   dense_arch_layer_sizes=[8, 4], over_arch_layer_sizes=[8, 1], dense_in_features=3)

    def go():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                from lightning_rec import RecStrategy
                trainer = L.Trainer(strategy=RecStrategy(pipeline=pipeline), accelerator="cpu", devices=W,
                                    max_epochs=1, logger=False,
                                    enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
                trainer.fit(m, DM())
        return trainer.global_step
    return _outcome(go)


def rank_trainer_uneven_pipelined(rank, W):
    """The same with RecStrategy(pipeline=True): the feeder keeps the ranks stepping together."""
    return rank_trainer_uneven_loaders(rank, W, pipeline=True)


def rank_mixed_id_dtypes(rank, W, kind, shm):
    """Rank 0 sends int64 ids, rank 1 int32 (and keys in another order): outputs equal the unsharded module."""
    _threads()
    torch = _t()
    ebc, ref = make_ebc(), make_ebc()
    dmp = _dmp_of(ebc, _verbs(kind), W, shm)

    def go():
        if rank == 0:
            k = kjt_lengths(["a", "b"], T([1, 2, 3, 0]), [2, 1, 1, 0])
        else:
            k = kjt_lengths(["b", "a"], T([5, 9, 4, 4], torch.int32), T([1, 0, 2, 1], torch.int32))
        out = dmp(k)
        r = ref(k)
        for key in ("a", "b"):
            expect(torch.allclose(out[key], r[key], atol=1e-6), f"rank {rank}: feature {key} differs from unsharded")
        return True
    return _outcome(go)


def rank_save_checkpoint(rank, W, path, kind):
    """Two ranks save a sharded checkpoint (plan `kind`) after one step; returns the whole tables."""
    _threads()
    from lightning_rec import checkpoint as ck
    ebc = make_ebc(opt="adagrad")
    dmp = _dmp_of(ebc, _verbs(kind), W, True)
    dmp(_rank_batches(rank)).values().sum().backward()
    ck.save({"state_dict": dmp.module.state_dict()}, path)


def saved_whole(path):
    """The whole tables of a checkpoint, read in this (non-distributed) process."""
    from lightning_rec.checkpoint import full_state_dict
    return {k: v.clone() for k, v in full_state_dict(path).items()}


def rank_load_checkpoint(rank, W, path, kind, whole):
    _threads()
    torch = _t()
    from lightning_rec import checkpoint as ck
    ebc = make_ebc(opt="adagrad")
    dmp = _dmp_of(ebc, _verbs(kind), W, True)

    def go():
        ck.load_model(dmp.module, path)
        for key, st in dmp.module.state_dict().items():
            pieces = getattr(st, "local_shards", None)
            if pieces is None:  # a replicated or plain tensor: whole
                expect(torch.equal(whole[key], st), f"rank {rank}: {key} differs")
                continue
            for meta, t in (pieces() if callable(pieces) else pieces):
                (r, c), (nr, nc) = meta.shard_offsets, meta.shard_sizes
                expect(torch.equal(whole[key][r:r + nr, c:c + nc], t), f"rank {rank}: {key} piece differs")
        return True
    return _outcome(go)


def rank_trainer_rank_raises(rank, W):
    """Rank 1's training_step raises at step 2: rank 0 must hear of it within seconds, not wait 300 s."""
    _threads()
    _fast_guard()
    import lightning.pytorch as L

    from lightning_rec import DLRMModule, SyntheticCriteoDataModule

    class Raises(DLRMModule):
        def training_step(self, batch, batch_idx):
            if rank == 1 and batch_idx == 2:
                raise RuntimeError("rank 1's training_step failed (user code)")
            return super().training_step(batch, batch_idx)

    L.seed_everything(0)
    data = SyntheticCriteoDataModule(num_train_samples=1024, num_val_samples=128, batch_size=64,
                                     num_embeddings_per_feature=32)
    m = Raises(num_embeddings_per_feature=32, embedding_dim=4, dense_arch_layer_sizes=[8, 4],
               over_arch_layer_sizes=[8, 1])

    def go():
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            trainer = L.Trainer(strategy="rec", accelerator="cpu", devices=W, max_epochs=1, logger=False,
                                enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                                num_sanity_val_steps=0, limit_val_batches=0)
            trainer.fit(m, data)
    out = _outcome(go)
    if rank == 1:
        os._exit(0)  # as a crashed rank would: gone without a goodbye
    return out


def rank_trainer_planner_impossible(rank, W):
    _threads()
    import lightning.pytorch as L

    from lightning_rec import DLRMModule, EmbeddingShardingPlanner, RecStrategy, SyntheticCriteoDataModule, Topology
    data = SyntheticCriteoDataModule(num_train_samples=256, num_val_samples=64, batch_size=64,
                                     num_embeddings_per_feature=1000)
    m = DLRMModule(num_embeddings_per_feature=1000, embedding_dim=8, dense_arch_layer_sizes=[8],
                   over_arch_layer_sizes=[8, 1])
    planner = EmbeddingShardingPlanner(Topology(world_size=W, ddr_cap=10_000), print_stats=False)

    def go():
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            trainer = L.Trainer(strategy=RecStrategy(planner=planner), accelerator="cpu", devices=W, max_steps=1,
                                logger=False, enable_progress_bar=False, enable_model_summary=False,
                                enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0)
            trainer.fit(m, data)
    return _outcome(go)


def run_two_ranks(fn, *args, timeout=50.0, W=2):
    sys.path.insert(0, str(ROOT / "tests"))
    from dist_utils import RankFailed, run_ranks
    try:
        return run_ranks(fn, W, *args, timeout=timeout, pg_timeout=timeout, allow_missing=True)
    except RankFailed as e:
        text = str(e)
        if "still running after" in text:
            raise Hang(text) from None
        raise


def raise_first_error(outcomes, need_all=False, max_s=None):
    """Re-raise the first rank's error here (names and message); need_all: every live rank must raise."""
    errs = [(r, o) for r, o in enumerate(outcomes) if o is not None and o[0] == "error"]
    if max_s is not None:
        slow = [(r, o[3]) for r, o in enumerate(outcomes) if o is not None and o[3] > max_s]
        if slow:
            raise Hang(f"rank(s) took {slow} s (> {max_s} s) to notice")
    if need_all:
        oks = [r for r, o in enumerate(outcomes) if o is not None and o[0] == "ok"]
        if oks and errs:
            raise RemoteError(["Silent"], f"ranks {oks} went on without an error while rank {errs[0][0]} raised: "
                              f"{errs[0][1][2]}")
    if errs:
        r, o = errs[0]
        raise RemoteError(o[1], " | ".join(f"rank {rr}: {oo[2]}" for rr, oo in errs))
    return [o[1] if o is not None else None for o in outcomes]


def _dist_cases():
    for shm in (False, True):
        tag = "shm" if shm else "gloo"

        for kind in ("tw", "rw", "cw"):
            @case(f"dmp.{tag}.{kind}.different_batch_sizes_per_rank", timeout=60,
                  legit="ranks may have different batch sizes (TorchRec's variable stride across ranks)")
            def _(ctx, shm=shm, kind=kind):
                raise_first_error(run_two_ranks(rank_uneven_batches, kind, shm))

        @case(f"dmp.{tag}.rank1_bad_id", ValueError, ["'b'", "t_b", "99"], timeout=60)
        def _(ctx, shm=shm):
            out = run_two_ranks(rank_one_bad_id, shm)
            raise_first_error(out, need_all=True, max_s=15)

        @case(f"dmp.{tag}.rank1_raises_then_barrier", Exception, ["rank 1", "barrier"], timeout=60)
        def _(ctx, shm=shm):
            out = run_two_ranks(rank_one_raises_then_barrier, shm)
            raise_first_error(out, max_s=20)

        @case(f"dmp.{tag}.rank1_exits", Exception, ["rank 1"], timeout=60)
        def _(ctx, shm=shm):
            out = run_two_ranks(rank_one_exits, shm)
            raise_first_error(out, max_s=20)

        @case(f"dmp.{tag}.different_plans", ValueError, ["t_a"], timeout=60)
        def _(ctx, shm=shm):
            raise_first_error(run_two_ranks(rank_different_plans, shm), need_all=True)

        @case(f"dmp.{tag}.rank1_missing_feature", ValueError, ["'b'"], timeout=60)
        def _(ctx, shm=shm):
            raise_first_error(run_two_ranks(rank_missing_feature, shm), need_all=True, max_s=15)

        @case(f"dmp.{tag}.rank0_extra_step", Exception, ["rank"], timeout=60)
        def _(ctx, shm=shm):
            raise_first_error(run_two_ranks(rank_extra_step, shm), max_s=20)

        @case(f"dmp.{tag}.rank1_nan_weight", ValueError, ["'b'", "t_b", "nan"], timeout=60)
        def _(ctx, shm=shm):
            raise_first_error(run_two_ranks(rank_nan_weight, shm), need_all=True, max_s=15)

    @case("dmp.gloo.different_table_sizes", ValueError, ["t_b", "6", "7"], timeout=60)
    def _(ctx):
        raise_first_error(run_two_ranks(rank_different_tables, False), need_all=True)

    @case("dmp.shm.empty_batch_on_one_rank", ValueError, ["batch"], ok=True, timeout=60,
          legit="a rank with no samples this step is a valid (if odd) step: [0, D] out")
    def _(ctx):
        raise_first_error(run_two_ranks(rank_empty_batch, True))

    @case("dmp.gloo.negative_timeout", ValueError, ["timeout"], timeout=60)
    def _(ctx):
        raise_first_error(run_two_ranks(rank_bad_timeout, False))

    @case("dmp.gloo.plan_rank_out_of_world", ValueError, ["t_b", "3"], timeout=60)
    def _(ctx):
        raise_first_error(run_two_ranks(rank_plan_rank_out_of_world, False))

    @case("pipeline.model_returns_scalar", (ValueError, TypeError), ["(loss, output)"], timeout=60)
    def _(ctx):
        raise_first_error(run_two_ranks(rank_pipeline_bad_model_output, True))

    @case("trainer.rec_loaders_end_at_different_steps", timeout=120,
          legit="README: the epoch ends for all ranks when one runs out, with a warning")
    def _(ctx):
        steps = raise_first_error(run_two_ranks(rank_trainer_uneven_loaders, timeout=110))
        # Lightning's distributed sampler splits each rank's list again: 3 and 2 batches; both stop at 2
        expect(steps[0] == steps[1] == 2, f"global steps {steps}")

    @case("trainer.rec_pipelined_loaders_end_at_different_steps", timeout=120,
          legit="README: the pipeline's feeder keeps the ranks stepping together")
    def _(ctx):
        steps = raise_first_error(run_two_ranks(rank_trainer_uneven_pipelined, timeout=110))
        expect(steps[0] == steps[1] == 2, f"global steps {steps}")


def _more_cases():
    """Second wave: edges of the numbers, the files and the optimizers."""
    torch = _t()
    from lightning_rec import NDCG, BinnedAUC, EmbeddingBagCollection, FusedOptimizerConfig, KeyedJaggedTensor

    simple("more.lengths_huge_few_values", lambda: KJT(["a"], T([1, 2]), lengths=T([2 ** 40])), ValueError,
           ["add up to 1099511627776", "2 values"])
    simple("more.offsets_int32_huge_end", lambda: KJT(["a"], T([1, 2]), offsets=T([0, 2 ** 31 - 1], torch.int32)),
           ValueError, ["end at 2147483647"])
    simple("more.kjt_to_cuda_without_gpu", lambda: good_batch().to("cuda"), ValueError, ["needs a CUDA GPU"])

    @case("more.keys_as_tuple", legit="any sequence of names is keys")
    def _(ctx):
        check_ebc(make_ebc(), KeyedJaggedTensor.from_lengths_sync(("a", "b"), T([1, 2, 3, 0]), T([2, 1, 1, 0])))

    @case("more.one_row_one_dim_tables", legit="num_embeddings=1 and embedding_dim=1 are valid sizes")
    def _(ctx):
        for kernel in ("native", "fbgemm"):
            ebc = EmbeddingBagCollection([bag_cfg("t_a", 1, 1, ["a"]), bag_cfg("t_b", 1, 1, ["b"])],
                                         optimizer=FusedOptimizerConfig("rowwise_adagrad"), kernel=kernel)
            check_ebc(ebc, kjt_lengths(["a", "b"], [0, 0, 0], [2, 0, 1, 0]))

    @case("more.dim_3_fbgemm_cpu", legit="any dim on CPU")
    def _(ctx):
        check_ebc(make_ebc(kernel="fbgemm", dims=(3, 5), opt="adagrad"), good_batch())

    @case("more.lr_zero_changes_nothing", legit="lr=0 is a frozen table")
    def _(ctx):
        for kernel, opt in (("native", "adam"), ("fbgemm", "rowwise_adagrad"), ("native", "sgd")):
            ebc = make_ebc(opt=opt, lr=0.0, kernel=kernel)
            before = tables_of(ebc)
            ebc(good_batch()).values().sum().backward()
            unchanged(ebc, before, f"{kernel} {opt} lr=0")()

    for opt_name in ("adagrad", "rowwise_adagrad", "adam", "partial_rowwise_adam"):
        @case(f"more.{opt_name}_eps_zero_zero_gradient", ValueError, ["eps", opt_name], ok=True,
              legit="eps=0 is allowed if a row with zero gradient stays finite")
        def _(ctx, opt_name=opt_name):
            for kernel in (("native", "fbgemm") if opt_name in ("adagrad", "rowwise_adagrad") else ("native",)):
                from lightning_rec import EmbeddingBagCollection as EBC
                ebc = EBC([bag_cfg("t_a", 10, 4, ["a"])], optimizer=FusedOptimizerConfig(opt_name, lr=0.1, eps=0.0),
                          kernel=kernel)
                # row 3 is looked up but its bag's output is multiplied by 0: a zero gradient
                (ebc(kjt_lengths(["a"], [3, 4], [1, 1])).values() * T([[0.0], [1.0]])).sum().backward()
                w = ebc_weights(ebc)["t_a"]
                expect(bool(torch.isfinite(w).all()), f"{kernel} {opt_name} eps=0: NaN rows after a zero gradient")

    for kernel in ("native", "fbgemm", "auto"):
        for opt_name in ("sgd", "adagrad", "rowwise_adagrad"):
            @case(f"more.{opt_name}_weight_decay_vs_torch.{kernel}", ValueError, ["weight_decay", "native"], ok=True,
                  legit="weight decay as torch.optim applies it (L2 on the rows a batch touches)")
            def _(ctx, kernel=kernel, opt_name=opt_name):
                _decay_parity(kernel, opt_name)

    @case("more.ec_sgd_weight_decay", ValueError, ["weight_decay", "GPU"], ok=True)
    def _(ctx):
        from lightning_rec import EmbeddingCollection as EC
        ec = EC([seq_cfg("t_a", 10, 4, ["a"])], optimizer=FusedOptimizerConfig("sgd", lr=0.1, weight_decay=0.5))
        w0 = {k: v.clone() for k, v in ec.state_dict().items()}["embeddings.t_a.weight"]
        ec(kjt_lengths(["a"], [3], [1]))["a"].values().sum().backward()
        w1 = ec.state_dict()["embeddings.t_a.weight"]
        expect(torch.allclose(w1[3], w0[3] - 0.1 * (1 + 0.5 * w0[3]), atol=1e-6), "EC SGD ignored weight_decay")

    @case("more.ndcg_k_above_items", legit="k larger than the candidate list: all of it is ranked")
    def _(ctx):
        from torchmetrics.retrieval import RetrievalNormalizedDCG
        preds, target = T([[0.9, 0.1, 0.5], [0.2, 0.3, 0.1]]), T([[True, False, True], [False, True, False]])
        m = NDCG(ks=100)
        m.update(preds, target)
        v = m.compute()
        v = v if isinstance(v, torch.Tensor) else next(iter(v.values()))
        ref = RetrievalNormalizedDCG(top_k=100)
        ref.update(preds.flatten(), target.flatten(), indexes=torch.arange(2).repeat_interleave(3))
        expect(abs(float(v) - float(ref.compute())) < 1e-5, f"NDCG@100 {float(v)} vs {float(ref.compute())}")

    @case("more.binned_auc_nan_scores", ValueError, ["nan"], ok=True, legit="NaN out for NaN scores is honest")
    def _(ctx):
        m = BinnedAUC(num_thresholds=100, from_logits=False)
        m.update(T([0.1, float("nan"), 0.3, 0.9]), T([0, 1, 0, 1]))
        v = m.compute()
        expect(bool(torch.isnan(v)), f"BinnedAUC with a NaN score is {float(v)}")

    @case("more.ranking_topk_hits_shape", ValueError, ["hits"])
    def _(ctx):
        m = NDCG(ks=2)
        m.update_topk(torch.ones(3, 2, dtype=torch.bool), T([1, 1]))
        m.compute()

    # files
    @case("more.criteo_binary_file", ValueError, ["junk.bin"])
    def _(ctx):
        import random
        rnd = random.Random(0)
        parse_all(write(ctx.tmp / "junk.bin", bytes(rnd.randrange(256) for _ in range(5000))))

    @case("more.criteo_nul_bytes", ValueError, ["nul.tsv", ":2"])
    def _(ctx):
        second = criteo_row().replace("\t3\t", "\t\x00\t", 1)
        parse_all(write(ctx.tmp / "nul.tsv", (criteo_text(1) + second + "\n").encode()))

    @case("more.criteo_one_10mb_line", ValueError, ["long.tsv", ":1"], timeout=30)
    def _(ctx):
        parse_all(write(ctx.tmp / "long.tsv", "0\t" + "1" * (10 << 20) + "\n"))

    @case("more.criteo_bom_first_line", ValueError, ["bom.tsv"], ok=True,
          legit="a UTF-8 byte-order mark before the first row may be skipped: same rows")
    def _(ctx):
        table, _ = parse_all(write(ctx.tmp / "bom.tsv", b"\xef\xbb\xbf" + criteo_text(3).encode()))
        ref, _ = parse_all(write(ctx.tmp / "ref.tsv", criteo_text(3)))
        expect(table.equals(ref), "rows after a BOM differ")

    @case("more.criteo_label_float_text", ValueError, ["lf.tsv", "label"], ok=True,
          legit="'1.0' is the label 1")
    def _(ctx):
        table, _ = parse_all(write(ctx.tmp / "lf.tsv", criteo_row(label="1.0") + "\n" + criteo_row(label="0.0") + "\n"))
        ref, _ = parse_all(write(ctx.tmp / "ref.tsv", criteo_row(label="1") + "\n" + criteo_row(label="0") + "\n"))
        expect(table.equals(ref), "labels '1.0'/'0.0' read differently from 1/0")

    @case("more.criteo_kaggle_quoted_csv", ValueError, ["q.csv", "quoted", "sed"], ok=True,
          legit="quoted rows may be read as unquoted (same rows), or refused with the fix (the project's choice)")
    def _(ctx):
        hdr = "Id,Label," + ",".join(f"I{i}" for i in range(1, 14)) + "," + ",".join(f"C{i}" for i in range(1, 27))
        row = ",".join(f'"{x}"' for x in ["10000000", "1"] + [str(i) for i in range(13)] +
                       [f"{i + 1:08x}" for i in range(26)])
        table, _ = parse_all(write(ctx.tmp / "q.csv", hdr + "\n" + row + "\n"))
        plain = ",".join(["10000000", "1"] + [str(i) for i in range(13)] + [f"{i + 1:08x}" for i in range(26)])
        ref, _ = parse_all(write(ctx.tmp / "p.csv", hdr + "\n" + plain + "\n"))
        expect(table.equals(ref), "quoted Kaggle CSV rows differ from unquoted")

    @case("more.preprocess_vocab_from_missing", CLIError, ["--vocab_from", "nowhere_vocab", "vocab.npz"])
    def _(ctx):
        from lightning_rec.cli import preprocess_main
        p = write(ctx.tmp / "d.tsv", criteo_text(10))
        ctx.after(lambda: expect(not (ctx.tmp / "o").exists(), "a refused run left an output directory"))
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                preprocess_main(["--input", str(p), "--output_dir", str(ctx.tmp / "o"), "--num_embeddings", "100",
                                 "--vocab_from", str(ctx.tmp / "nowhere_vocab")])
            except SystemExit as e:  # the command's one-line error, as the user sees it
                raise CLIError(err.getvalue() or f"exit {e.code}") from None

    @case("more.preprocess_then_train_shapes", timeout=60, legit="preprocess -> CriteoDataModule on the directory")
    def _(ctx):
        from lightning_rec import CriteoDataModule
        from lightning_rec.cli import preprocess_main
        p = write(ctx.tmp / "d.tsv", criteo_text(50))
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            preprocess_main(["--input", str(p), "--output_dir", str(ctx.tmp / "o"), "--num_embeddings", "100"])
        dm = CriteoDataModule(train_path=str(ctx.tmp / "o"), batch_size=16, num_embeddings_per_feature=100)
        dm.setup("fit")
        n = sum(int(b.labels.numel()) for b in dm.train_dataloader())
        expect(n == 50, f"{n} rows from 50")

    @case("more.movielens_ml1m_colons", timeout=40, legit="ml-1m's '::' separator")
    def _(ctx):
        from lightning_rec.data.movielens import read_ratings
        p = write(ctx.tmp / "ratings.dat", "1::10::5::978300760\n2::20::3::978302109\n")
        t = read_ratings(p)
        expect(t.column("item_id").to_pylist() == [10, 20] and t.column("rating").to_pylist() == [5.0, 3.0],
               f"ml-1m rows {t.to_pylist()}")


def _dist_more_cases():
    for kind in ("tw", "rw", "cw"):
        @case(f"dmp.shm.{kind}.int32_ids_and_other_key_order_on_one_rank", timeout=60,
              legit="each rank's KJT is valid on its own: id dtype and key order may differ between ranks")
        def _(ctx, kind=kind):
            raise_first_error(run_two_ranks(rank_mixed_id_dtypes, kind, True))

    @case("dmp.gloo.rw.int32_ids_and_other_key_order_on_one_rank", timeout=60,
          legit="each rank's KJT is valid on its own")
    def _(ctx):
        raise_first_error(run_two_ranks(rank_mixed_id_dtypes, "rw", False))

    for save_kind, load_kind in (("tw", "rw"), ("rw", "cw")):
        @case(f"ckpt.2ranks_{save_kind}_to_{load_kind}_exact", timeout=90,
              legit="README: checkpoints load into another plan")
        def _(ctx, save_kind=save_kind, load_kind=load_kind):
            path = str(ctx.tmp / "ck")
            run_two_ranks(rank_save_checkpoint, path, save_kind)
            raise_first_error(run_two_ranks(rank_load_checkpoint, path, load_kind, saved_whole(path)))

    @case("ckpt.2ranks_to_one_process_exact", timeout=90, legit="README: into the unsharded module on one process")
    def _(ctx):
        torch = _t()
        from lightning_rec import checkpoint as ck
        path = str(ctx.tmp / "ck")
        run_two_ranks(rank_save_checkpoint, path, "rw")
        whole = saved_whole(path)
        m = make_ebc(opt="adagrad")
        ck.load_model(m, path)
        for k, v in m.state_dict().items():
            expect(torch.equal(v, whole[k]), f"{k} differs after loading 2 ranks' checkpoint in one process")

    @case("ckpt.2ranks_one_rank_file_missing", ValueError, ["missing", ".distcp"], timeout=90)
    def _(ctx):
        from lightning_rec import checkpoint as ck
        path = ctx.tmp / "ck"
        run_two_ranks(rank_save_checkpoint, str(path), "tw")
        files = sorted(path.glob("*.distcp"))
        files[-1].unlink()
        m = make_ebc(opt="adagrad")
        ctx.after(unchanged(m, tables_of(m), "module"))
        ck.load_model(m, path)

    @case("ckpt.export_real_checkpoint_cli", timeout=90, legit="lightning-rec export of a 2-rank DCP checkpoint")
    def _(ctx):
        torch = _t()
        from lightning_rec import checkpoint as ck
        from lightning_rec import cli as cli_mod
        path = ctx.tmp / "ck"
        run_two_ranks(rank_save_checkpoint, str(path), "cw")
        whole = saved_whole(path)
        with contextlib.redirect_stdout(io.StringIO()):
            cli_mod.export_main([str(path), str(ctx.tmp / "out")])
        from safetensors.torch import load_file
        got = load_file(str(ctx.tmp / "out" / "model.safetensors"))
        for k, v in whole.items():
            expect(k in got and torch.equal(got[k], v), f"exported {k} differs")
        expect(ck is not None, "")

    @case("trainer.rank1_raises_in_training_step", Exception, ["rank 1"], timeout=120)
    def _(ctx):
        out = run_two_ranks(rank_trainer_rank_raises, timeout=110)
        r0 = out[0]
        expect(r0 is not None and r0[0] == "error", f"rank 0 went on without an error: {r0}")
        raise_first_error([r0], max_s=60)

    @case("trainer.planner_cannot_fit", ValueError, ["t_C", "ddr_cap"], timeout=120)
    def _(ctx):
        raise_first_error(run_two_ranks(rank_trainer_planner_impossible, timeout=110), need_all=True)


def register_all() -> None:
    if CASES:
        return
    for group in (_kjt_cases, _config_cases, _optim_cases, _planner_cases, _metric_cases, _data_cases,
                  _model_cli_ckpt_cases, _strategy_cases, _more_cases, _dist_cases, _dist_more_cases):
        group()


# ==================================================================================================
# running: worker side

def classify(c: Case, fn) -> tuple[str, str]:
    ctx = Ctx()
    exc = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn(ctx)
    except Silent as e:
        return "silent", str(e)
    except Skipped as e:  # the real data it reads is absent (never counted as clear or correct)
        return "skipped", str(e)
    except Hang as e:
        return "hang", str(e)
    except RemoteError as e:
        if e.names == ["Silent"]:
            return "silent", str(e)
        exc = (e.names, str(e))
    except BaseException as e:  # noqa: BLE001 - classified
        exc = ([k.__name__ for k in type(e).__mro__], f"{type(e).__name__}: {e}")
    finally:
        import shutil
        shutil.rmtree(ctx.tmp, ignore_errors=True) if exc is None else None
    if exc is None:
        if c.error is not None and not c.ok:
            return "silent", f"no error: expected {_names(c.error)} naming {list(c.words)}"
        return "correct", ""
    names, msg = exc
    for check in ctx.afters:
        try:
            check()
        except Silent as e:
            return "silent", f"{e} (after: {msg})"
    expected = c.error if isinstance(c.error, tuple) else (c.error,) if c.error else ()
    type_ok = any(t.__name__ in names for t in expected)
    missing = [w for w in c.words if w.lower() not in msg.lower()]
    if type_ok and not missing:
        return "clear", msg
    if not c.error:
        why = "an error where a result was due"
    else:
        why = f"expected {_names(c.error)}" if not type_ok else f"message lacks {missing}"
    return "unclear", f"[{why}] {msg}"


def _names(error) -> str:
    if error is None:
        return "no error"
    return "/".join(t.__name__ for t in (error if isinstance(error, tuple) else (error,)))


def worker_main() -> None:
    threads = int(os.environ.get("BATTERY_THREADS", "2"))
    out = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(2, 1)  # noise from cases goes to the log, never into the result pipe
    os.close(devnull)
    import faulthandler
    faulthandler.enable()
    import torch
    torch.set_num_threads(threads)
    import lightning.pytorch  # noqa: F401  (imported once for every case)

    import lightning_rec  # noqa: F401
    register_all()
    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        name = line.strip()
        if not name:
            continue
        c = CASES[name]
        torch.set_num_threads(threads)
        start = time.monotonic()
        try:
            cls, msg = classify(c, c.fn)
        except BaseException as e:  # noqa: BLE001
            cls, msg = "unclear", f"battery error: {e}\n{traceback.format_exc()}"
        out.write(json.dumps({"name": name, "class": cls, "seconds": round(time.monotonic() - start, 2),
                              "message": msg[:2000]}) + "\n")


# ==================================================================================================
# running: parent side

class Worker:
    def __init__(self, threads: int, log_path: Path) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                   BATTERY_THREADS=str(threads), WANDB_MODE="offline", PYTHONFAULTHANDLER="1")
        self.log = open(log_path, "ab")
        code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); sys.path.insert(0, {str(ROOT / 'tests')!r}); "
                "import bad_input_battery as b; b.worker_main()")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, cwd=str(ROOT), env=env, start_new_session=True)
        self.buf = b""
        ready = self.read(180)
        if not ready or not json.loads(ready).get("ready"):
            self.kill()
            raise RuntimeError(f"the worker did not start; see {log_path}")

    def read(self, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            r, _, _ = select.select([self.proc.stdout], [], [], left)
            if r:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    return None  # EOF: the worker died
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def run(self, name: str, timeout: float) -> dict | None:
        self.proc.stdin.write((name + "\n").encode())
        self.proc.stdin.flush()
        line = self.read(timeout)
        return json.loads(line) if line else None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the worker and the rank processes it started
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()


def _tail(path: Path, n: int = 600) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default=None, help="run the cases whose name contains this")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--log", default=None, help="worker stderr (default: a temp file)")
    args = ap.parse_args()
    register_all()
    names = [n for n in CASES if args.only is None or args.only in n]
    if args.list:
        print("\n".join(names))
        return
    log = Path(args.log or tempfile.mkstemp(prefix="battery_worker_", suffix=".log")[1])
    results, worker = [], None
    t_all = time.monotonic()
    for name in names:
        c = CASES[name]
        if worker is None:
            worker = Worker(args.threads, log)
        mark = log.stat().st_size if log.exists() else 0
        start = time.monotonic()
        r = worker.run(name, c.timeout)
        if r is None:
            died = not worker.alive()
            if not died:
                time.sleep(0.2)
                died = not worker.alive()
            code = worker.proc.poll()
            worker.kill()
            worker = None
            tail = log.read_bytes()[mark:][-800:].decode(errors="replace")
            r = {"name": name, "class": "crash" if died else "hang", "seconds": round(time.monotonic() - start, 2),
                 "message": (f"worker died (exit {code}): " if died else f"over {c.timeout} s: ") + tail}
        r["legit"] = c.legit
        results.append(r)
        msg = " ".join(r["message"].split())[:160]
        print(f"{r['name']:<58} {r['class']:<8} {r['seconds']:6.2f}s  {msg}", flush=True)
    if worker is not None:
        worker.kill()
    figures = {"cases": len(results), "threads": args.threads}
    for cls in CLASSES:
        figures[cls] = sum(r["class"] == cls for r in results)
    figures["seconds"] = round(time.monotonic() - t_all, 1)
    bad = [r["name"] for r in results if r["class"] not in ("clear", "correct", "skipped")]
    print(f"\n{figures['cases']} cases at {args.threads} threads: " +
          ", ".join(f"{figures[c]} {c}" for c in CLASSES) + f" ({figures['seconds']} s); not clear/correct: {bad}")
    print(json.dumps({"benchmark": "bad_input_battery", "results": results, "ratios": {}, "figures": figures}))


if __name__ == "__main__":
    main()

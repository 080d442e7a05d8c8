"""Criteo-shaped synthetic click data with a planted signal, generated whole with torch ops.

Shapes: N samples of a split, B samples in a batch, D dense features (13), F sparse features
(26), L the longest bag (ids per feature per sample, padded), S features that carry signal.

How a sample is drawn (seeded; train, val and test are different draws of one distribution):

    dense_ND      log(1 + c), c = floor(exp(Normal(1, 1.5))) clipped at 0: Criteo-like counts
    ids_NFL       power-law ids: rank = floor(n_f * u^zipf_exponent), scattered over the table by a
                  multiplicative hash, so a few ids are hot (as in real logs) and rows spread out
    lengths_NF    ids_per_feature[f], or uniform in 0..2*ids_per_feature[f] (variable_length)
    logit_N       bias + sum over the first S features of the bag mean of w_f(id)
                  + standardized dense @ v, with w_f(id) a fixed pseudo-random function of
                  (feature, id) and v fixed random weights; bias calibrated so that the mean
                  click rate is `ctr`
    label_N       Bernoulli(sigmoid(logit_N))

The latent weights depend only on `seed`, so per-id embeddings learned on train improve AUC on val (the Bayes AUC,
`dataset.logits` against labels, is about 0.87)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_rec.data.batch import Batch, make_eval_loader, make_train_loader, worker_options
from lightning_rec.data.criteo.schema import resolve_num_embeddings
from lightning_rec.errors import is_int
from lightning_rec.sparse import KeyedJaggedTensor

_HASH_PRIME = 2_147_483_647  # 2^31 - 1: (id * a + b) mod p is a cheap per-id pseudo-random number
_SCATTER = 2_654_435_761  # Knuth's multiplicative hash constant, prime: a bijection mod n_f


def _per_id_weight(ids: Tensor, a_F: Tensor, b_F: Tensor, feature_dim: int) -> Tensor:
    """w_f(id) in [-sqrt(3), sqrt(3)) (unit variance), a deterministic function of (f, id). ids: [..., F, ...] int64
    with F at `feature_dim`; a_F, b_F: [F] int64 < 2^31."""
    shape = [1] * ids.dim()
    shape[feature_dim] = -1
    # ids < 2^32 and a < 2^31, so the product fits in int64 without wrapping
    u = ((ids * a_F.view(shape) + b_F.view(shape)) % _HASH_PRIME).double() / _HASH_PRIME
    return ((u - 0.5) * math.sqrt(12.0)).float()


class SyntheticCriteoDataset(Dataset):
    """One split of synthetic data in memory; one item = one Batch (see `make_batch_loader`)."""

    def __init__(self, dense_ND: Tensor, ids_NFL: Tensor, lengths_NF: Tensor, labels_N: Tensor,
                 logits_N: Tensor, keys: Sequence[str]) -> None:
        self.dense_ND, self.ids_NFL, self.lengths_NF = dense_ND, ids_NFL, lengths_NF
        self.labels_N, self.logits = labels_N, logits_N
        self.keys = list(keys)
        # Every bag full (fixed length): the padded ids are the KJT values as they are.
        self._full = bool((lengths_NF == ids_NFL.shape[2]).all())
        self.fingerprint: str | None = None  # set by the data module: what a saved loader position belongs to

    def __len__(self) -> int:
        return self.labels_N.shape[0]

    def __getitems__(self, indices: Sequence[int]) -> Batch:
        idx_B = torch.as_tensor(indices, dtype=torch.int64)
        idx_B = idx_B[idx_B != -1]  # -1: an evaluation share's padding (EvalDistributedSampler), no row
        ids_FBL = self.ids_NFL[idx_B].permute(1, 0, 2)
        lengths_FB = self.lengths_NF[idx_B].t()
        if self._full:
            values_N = ids_FBL.reshape(-1)
        else:
            longest = ids_FBL.shape[2]
            mask_FBL = torch.arange(longest) < lengths_FB.unsqueeze(-1)
            values_N = ids_FBL[mask_FBL]  # boolean mask keeps [F, B, L] order: key-major
        kjt = KeyedJaggedTensor.from_lengths_sync(
            self.keys, values_N.contiguous(), lengths_FB.reshape(-1), stride=idx_B.shape[0]
        )
        return Batch(dense_features=self.dense_ND[idx_B], sparse_features=kjt, labels=self.labels_N[idx_B])

    def __getitem__(self, index: int | Sequence[int]) -> Batch:
        return self.__getitems__([index] if isinstance(index, int) else index)


class SyntheticCriteoDataModule(pl.LightningDataModule):
    """Criteo-shaped data with a learnable signal, fast to build (100k samples well under a second).

    Args:
        num_train_samples: rows of the train split.
        num_val_samples: rows of the validation split.
        num_test_samples: rows of the test split (0: test and predict read the validation split).
        batch_size: rows per training batch (per rank).
        val_batch_size: rows per evaluation batch (None: batch_size).
        num_dense_features: dense inputs per row (13, as Criteo).
        num_sparse_features: sparse features per row (26, as Criteo).
        num_embeddings_per_feature: ids per feature, one int for all or one per feature (equal to the model's).
        sparse_feature_names: the KJT keys (None: C1..C26).
        ids_per_feature: ids in each feature's bag, one int for all or one per feature.
        variable_length: bags of 0..2 x ids_per_feature ids, uniformly (False: exactly ids_per_feature).
        num_signal_features: how many sparse features (the first ones) carry the planted signal.
        signal_scale: the ids' share of the click logit (0: only the dense features carry signal).
        zipf_exponent: how skewed the ids are (higher: more of the rows read a few hot ids).
        ctr: the mean click rate.
        seed: draws the distribution and each split (train, val and test are different draws of it).
        shuffle: shuffle the training rows each epoch.
        drop_last: drop the last, smaller training batch.
        num_workers: DataLoader worker processes (0: load in the main process).
        pin_memory: pin batches in host memory for the copy to a GPU.
        prefetch_factor: batches each worker loads ahead (None: torch's default).
        persistent_workers: keep the workers between epochs (None: whenever there are any)."""

    def __init__(self, num_train_samples: int = 65_536, num_val_samples: int = 16_384, num_test_samples: int = 0,
                 batch_size: int = 512, val_batch_size: int | None = None, num_dense_features: int = 13,
                 num_sparse_features: int = 26, num_embeddings_per_feature: int | list[int] = 1000,
                 sparse_feature_names: list[str] | None = None, ids_per_feature: int | list[int] = 1,
                 variable_length: bool = False, num_signal_features: int = 8, signal_scale: float = 1.0,
                 zipf_exponent: float = 3.0, ctr: float = 0.25, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False, num_workers: int = 0, pin_memory: bool = False,
                 prefetch_factor: int | None = None, persistent_workers: bool | None = None) -> None:
        super().__init__()
        # said here, not when the first loader is built
        worker_options("SyntheticCriteoDataModule", num_workers, pin_memory, prefetch_factor, persistent_workers)
        self.prefetch_factor, self.persistent_workers = prefetch_factor, persistent_workers
        self.save_hyperparameters()
        for name, value in (("batch_size", batch_size), ("val_batch_size", val_batch_size)):
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(f"SyntheticCriteoDataModule {name}={value!r}: give a positive number of samples "
                                 f"per batch")
        if min(num_train_samples, num_val_samples, num_test_samples) < 0:
            raise ValueError("sample counts must be >= 0")
        if num_dense_features < 1 or num_sparse_features < 1:
            raise ValueError("need at least one dense and one sparse feature")
        self.num_dense_features = num_dense_features
        self.num_embeddings_per_feature = resolve_num_embeddings(num_embeddings_per_feature, num_sparse_features)
        default_names = [f"C{i}" for i in range(1, num_sparse_features + 1)]
        self.sparse_feature_names = list(sparse_feature_names or default_names)
        if len(self.sparse_feature_names) != num_sparse_features:
            raise ValueError(f"sparse_feature_names has {len(self.sparse_feature_names)} names for "
                             f"num_sparse_features={num_sparse_features}")
        if isinstance(ids_per_feature, int):
            ids_per_feature = [ids_per_feature] * num_sparse_features
        if len(ids_per_feature) != num_sparse_features or min(ids_per_feature) < 1:
            raise ValueError(f"ids_per_feature must be one int >= 1 or {num_sparse_features} of them, "
                             f"got {ids_per_feature}")
        if not 0 <= num_signal_features <= num_sparse_features:
            raise ValueError(f"num_signal_features must be in 0..{num_sparse_features}, got {num_signal_features}")
        if not 0.0 < ctr < 1.0:
            raise ValueError(f"ctr must be in (0, 1), got {ctr}")
        self.ids_per_feature = list(ids_per_feature)
        self.variable_length = variable_length
        self.num_signal_features = num_signal_features
        self.signal_scale, self.zipf_exponent, self.ctr = signal_scale, zipf_exponent, ctr
        self.sizes = {"train": num_train_samples, "val": num_val_samples, "test": num_test_samples}
        self.batch_size, self.val_batch_size = batch_size, val_batch_size or batch_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.datasets: dict[str, SyntheticCriteoDataset] = {}
        self._init_latent()

    def _init_latent(self) -> None:
        """The distribution itself: per-feature hash constants and dense weights, from `seed` only."""
        g = torch.Generator().manual_seed(self.seed)
        num_sparse = len(self.num_embeddings_per_feature)
        self._a_F = torch.randint(1, _HASH_PRIME, (num_sparse,), generator=g)
        self._b_F = torch.randint(0, _HASH_PRIME, (num_sparse,), generator=g)
        dense_v_D = torch.randn(self.num_dense_features, generator=g)
        self._dense_v_D = dense_v_D / math.sqrt(self.num_dense_features)
        self._bias = 0.0
        logits = self._draw(8192, torch.Generator().manual_seed(self.seed + 1_000_003))[4]
        # bisection on the bias so that mean(sigmoid(logit + bias)) = ctr (a 40-step loop, not per sample)
        lo, hi = -20.0, 20.0
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if torch.sigmoid(logits + mid).mean() < self.ctr else (lo, mid)
        self._bias = (lo + hi) / 2

    def _draw(self, n: int, g: torch.Generator) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        num_sparse = len(self.num_embeddings_per_feature)
        counts_ND = torch.exp(torch.randn(n, self.num_dense_features, generator=g) * 1.5 + 1.0).floor()
        dense_ND = torch.log1p(counts_ND).float()

        max_len_F = torch.tensor([2 * k if self.variable_length else k for k in self.ids_per_feature])
        longest = int(max_len_F.max())
        if self.variable_length:
            lengths_NF = (torch.rand(n, num_sparse, generator=g) * (max_len_F + 1)).floor().long()
        else:
            lengths_NF = max_len_F.expand(n, num_sparse).clone()
        rows_F = torch.tensor(self.num_embeddings_per_feature, dtype=torch.int64)
        u_NFL = torch.rand(n, num_sparse, longest, generator=g, dtype=torch.float64)
        rank_NFL = (rows_F.view(1, -1, 1) * u_NFL.pow(self.zipf_exponent)).long()
        ids_NFL = (rank_NFL * _SCATTER + torch.arange(num_sparse).view(1, -1, 1)) % rows_F.view(1, -1, 1)
        mask_NFL = torch.arange(longest) < lengths_NF.unsqueeze(-1)
        ids_NFL = ids_NFL * mask_NFL  # padding slots hold id 0, never read

        s = self.num_signal_features
        w_NSL = _per_id_weight(ids_NFL[:, :s], self._a_F[:s], self._b_F[:s], feature_dim=1)
        bag_mean_NS = (w_NSL * mask_NFL[:, :s]).sum(-1) / lengths_NF[:, :s].clamp(min=1)
        dense_std_ND = (dense_ND - 1.34) / 1.15  # measured mean and std of these log counts
        logits_N = self.signal_scale * (bag_mean_NS.sum(-1) / math.sqrt(max(s, 1))) * 1.5
        logits_N = logits_N + dense_std_ND @ self._dense_v_D + self._bias
        labels_N = torch.bernoulli(torch.sigmoid(logits_N), generator=g).float()
        return dense_ND, ids_NFL, lengths_NF, labels_N, logits_N

    def make_split(self, split: str) -> SyntheticCriteoDataset:
        # a different stream per split: the same distribution, different samples
        offset = {"train": 1, "val": 2, "test": 3}[split]
        g = torch.Generator().manual_seed(self.seed * 7919 + offset)
        dense, ids, lengths, labels, logits = self._draw(self.sizes[split], g)
        dataset = SyntheticCriteoDataset(dense, ids, lengths, labels, logits, self.sparse_feature_names)
        dataset.fingerprint = f"synthetic:{split}:seed={self.seed}:n={self.sizes[split]}"
        return dataset

    def setup(self, stage: str | None = None) -> None:
        # only what the stage reads (test and predict read the test split, or val when it has no samples)
        evaluated = ("test",) if self.sizes["test"] > 0 else ("val",)
        splits = {"fit": ("train", "val"), "validate": ("val",), "test": evaluated, "predict": evaluated}
        for split in splits.get(getattr(stage, "value", stage), ("train", "val", "test")):  # Lightning: a TrainerFn
            if split not in self.datasets and self.sizes[split] > 0:
                self.datasets[split] = self.make_split(split)

    def _loader_options(self) -> dict:
        # read at each loader (not kept from __init__): a data module's num_workers may be set after construction
        return worker_options("SyntheticCriteoDataModule", self.num_workers, self.pin_memory, self.prefetch_factor,
                              self.persistent_workers)

    def _loader(self, split: str) -> DataLoader:
        if split not in self.datasets:
            if self.sizes[split] == 0:
                raise ValueError(f"num_{split}_samples=0: set it > 0 to use the {split} loop")
            raise ValueError(f"SyntheticCriteoDataModule.setup() has not run for {split}: call setup() first")
        if split != "train":  # every row once at any world size (Lightning's DistributedSampler repeats some)
            return make_eval_loader(self.datasets[split], self.val_batch_size, **self._loader_options())
        return make_train_loader(self.datasets[split], self.batch_size, shuffle=self.shuffle,
                                 drop_last=self.drop_last, seed=self.seed, trainer=self.trainer,
                                 # a hand loop seeds each rank's rows itself
                                 shard_outside_trainer=False, **self._loader_options())

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader | list:
        # num_val_samples=0: an empty list tells Lightning there is no validation loop
        return self._loader("val") if self.sizes["val"] > 0 else []

    def test_dataloader(self) -> DataLoader:
        if self.sizes["test"] == 0 and not getattr(self, "_said_test_is_val", False):
            # the test_* metrics would be those of the rows validation scores: say so, once
            self._said_test_is_val = True
            warnings.warn("SyntheticCriteoDataModule: num_test_samples=0, so the test loop scores the validation split "
                          "(its test_* metrics are the val_* ones): set num_test_samples > 0 (e.g. "
                          "--data.num_test_samples=65536) for rows of its own", stacklevel=2)
        return self._loader("test" if self.sizes["test"] > 0 else "val")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("test" if self.sizes["test"] > 0 else "val")

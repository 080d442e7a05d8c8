"""TorchRec's examples run with only their import prefix changed (`torchrec.` -> `lightning_rec.torchrec.`).

tests/torchrec_examples/ holds examples/golden_training/train_dlrm.py and examples/retrieval/ (two_tower_train.py with
its data, modules and knn_index files) as TorchRec ships them, but for that prefix. Each runs through its own
`train(...)` on 1 and 2 CPU ranks (gloo), with the small sizes TorchRec's own tests of them pass (plus a small
`num_embeddings`: the default is 1M rows per table). The examples init the process group themselves, so each rank
leaves the one run_ranks made and the example makes its own on a fresh port. faiss is not a dependency: the retrieval
example's index is an exact stand-in (torchrec_examples/faiss_stand_in.py).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
from dist_utils import free_port, run_ranks


def _own_process_group(port: int) -> None:
    """The example calls init_process_group() itself (env://): leave run_ranks' group, point env:// at a new port."""
    dist.barrier()
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)


def _train_dlrm_worker(rank: int, world_size: int, port: int) -> list[float]:
    from torchrec_examples.golden_training import train_dlrm

    losses: list[float] = []

    class Recording(train_dlrm.TrainPipelineSparseDist):  # the example's own pipeline, its losses kept
        def progress(self, it):
            out = super().progress(it)
            losses.append(float(out[0]))
            return out

    train_dlrm.TrainPipelineSparseDist = Recording
    _own_process_group(port)
    train_dlrm.train(num_embeddings=5000, embedding_dim=16, num_iterations=10)
    return losses


@pytest.mark.parametrize("world_size", [1, 2])
def test_golden_training_train_dlrm_runs_as_ported(world_size):
    for losses in run_ranks(_train_dlrm_worker, world_size, free_port(), timeout=120):
        assert len(losses) == 10 and all(math.isfinite(x) for x in losses)


def _two_tower_worker(rank: int, world_size: int, port: int) -> dict:
    from torchrec_examples import faiss_stand_in

    faiss_stand_in.install()
    from torchrec_examples.retrieval import two_tower_train

    seen: dict = {}
    gather = two_tower_train.state_dict_gather

    def recording_gather(src, dst):  # the example's own call, with what it gathered kept for the check below
        gather(src, dst)
        if rank == 0:
            seen["dst"] = {k: v.clone() for k, v in dst.items()}
        seen["src"] = {k: [(m, t.clone()) for m, t in v.local_shards] if hasattr(v, "local_shards") else v.clone()
                       for k, v in src.items()}

    two_tower_train.state_dict_gather = recording_gather
    _own_process_group(port)
    two_tower_train.train(num_embeddings=5000, embedding_dim=16, layer_sizes=[16], num_iterations=10)
    return seen


@pytest.mark.parametrize("world_size", [1, 2])
def test_retrieval_two_tower_train_runs_as_ported(world_size):
    """Trains, gathers the sharded model to one CPU model on rank 0 (state_dict_to_device + state_dict_gather), and
    indexes its item embeddings: the gathered tables are every rank's pieces put together, the dense layers rank 0's."""
    results = run_ranks(_two_tower_worker, world_size, free_port(), timeout=120)
    gathered, src = results[0]["dst"], results[0]["src"]
    assert any("embedding_bags" in k for k in gathered) and any("proj" in k for k in gathered)
    for key, value in gathered.items():
        if isinstance(src[key], torch.Tensor):  # dense layers, replicated tables
            torch.testing.assert_close(value, src[key], rtol=0, atol=0)
            continue
        covered = torch.zeros(value.shape, dtype=torch.bool)
        for result in results:
            for meta, piece in result["src"][key]:
                (r, c), (nr, nc) = meta.shard_offsets, meta.shard_sizes
                torch.testing.assert_close(value[r:r + nr, c:c + nc], piece, rtol=0, atol=0)
                covered[r:r + nr, c:c + nc] = True
        assert covered.all()

"""The feeder's collectives: a process group of its own (+ a shared-memory group), under a guard of its own."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_rec.collective_guard import CollectiveGuard, guard_of
from lightning_rec.comm import agree
from lightning_rec.sharded_embedding import _ShardedCollectionBase
from lightning_rec.shm_transport import SharedMemoryGroup


class _Channel:
    """The feeder's collectives: a process group of its own (+ a shared-memory group when the model uses one).

    Its own group, so the feeder's all-to-alls never interleave with the step's (each channel keeps
    one order on every rank). Built collectively; kept in a pool on the collections' ShardingEnv.
    """

    def __init__(self, env) -> None:
        ranks = dist.get_process_group_ranks(env.pg)
        timeout = None if env.timeout_s is None else timedelta(seconds=env.timeout_s)
        self.pg = dist.new_group(ranks=ranks, backend=dist.get_backend(env.pg), timeout=timeout)
        self.transport = SharedMemoryGroup.create(self.pg, env.timeout_s) if env.transport is not None else None
        self.comm = self.transport if self.transport is not None else self.pg
        # under a guard of its own, as the model's collectives are (collective_guard.py): a peer that
        # exited is named, a timeout names the model's setting; its entries live in their own slot,
        # since the feeder thread waits while the step's thread may wait elsewhere
        model_guard = guard_of(env.pg, enabled_only=False)
        setting = model_guard.setting if model_guard is not None else "DistributedModelParallel(timeout=...)"
        self.guard = CollectiveGuard(self.pg, "pipeline", env.timeout_s or 1800.0, setting,
                                     enabled=model_guard.enabled if model_guard is not None else None,
                                     slot="pipeline")
        if self.transport is not None:
            self.transport.timeout_setting = setting
            self.transport.guard = self.guard if self.guard.enabled else None
        self.rank, self.world_size = env.rank, env.world_size
        self.device, self.timeout_s = env.device, env.timeout_s
        self._a2a: dict[int, Any] = {}

    def waits_for_the_step(self, in_step_order: bool) -> None:
        """in_step_order (and inline): the feeder's collectives run only while the step's thread waits for them, so its
        waits are the step's, published in the main thread's slot: a peer whose step waits in an embedding exchange
        then names the mismatch (a step that raised and went on) instead of timing out."""
        self.guard.publish_as("" if in_step_order else "pipeline")

    def ids_all_to_all(self, module: _ShardedCollectionBase):
        a2a = self._a2a.get(id(module))
        if a2a is None:
            a2a = self._a2a[id(module)] = module.ids_all_to_all(self.comm)
        return a2a

    def agree(self, missing: bool, failed: bool, stream: Any = None, stop: int = 0, unused: int = 0,
              length: int = -1) -> tuple[list[int], list[int], dict[int, int], list[int], list[int]]:
        """Collective: the ranks without a batch, the ranks whose loader raised, the signals the ranks were sent
        ({rank: bits}, RecStrategy's: 1 a SIGTERM, 2 SLURM's requeue signal; carried here so that every rank acts on
        them at the same batch, with no collective of their own), each rank's `unused` (the batches its steps
        left unused, see _Feeder) and each rank's `length` (its batches left, -1 unknown), in group-rank order.

        stream: a side CUDA stream (the feeder's) for the NCCL flags: on the current (compute) stream the
        all-reduce would wait for every queued step, and reading the flags back would drain the GPU.
        """
        rows = agree([int(missing), int(failed), int(stop), unused, length], self.pg, self.transport,
                     device=self.device, stream=stream, tag="pipeline: every rank has a batch")
        return ([r for r, (m, *_) in enumerate(rows) if m], [r for r, (_, f, *_) in enumerate(rows) if f],
                {dist.get_global_rank(self.pg, r): x for r, (_, _, x, *_) in enumerate(rows) if x},  # as users know it
                [u for *_, u, _ in rows], [n for *_, n in rows])

    @staticmethod
    def acquire(env) -> _Channel:
        """A free channel of `env`'s pool, else a new one (collective). Deterministic on every rank."""
        pool = env.__dict__.setdefault("_pipeline_channels", [])
        return pool.pop() if pool else _Channel(env)

    @staticmethod
    def release(env, channel: _Channel) -> None:
        env.__dict__.setdefault("_pipeline_channels", []).append(channel)

"""TrainPipelineSparseDist: the next batch is read, copied and routed while this one computes.

Legend: i the batch the step computes, K the depth (batches routed ahead, 1 by default).

    feeder thread (one per pass over a loader)          main thread (the step)
      read batch i+1 from the loader                      batch i: lookup (fused TBE) ->
      agree: does every rank have one? (tiny all-reduce)  output_dist -> dense forward ->
      copy to the device (GPU: side stream, pinned)       backward (fused update inside) ->
      input_dist(i+1): check, route, ids all-to-all       optimizer.step
        (GPU: on its own stream; always over the
         pipeline's own channel)

So the loader, the host-to-device copy and the id routing (its local work and its all-to-all)
leave the step's critical path. Batches come out in order; the last ones are drained. Under
RecStrategy, "copy" is Lightning's three batch hooks (_strategy/loaders.py `batch_hooks_for`), so the ids
routed are those of the batch the hooks return.

No tracing. The first batch of a pipeline runs plainly while the pipeline records which input each
sharded collection is called with: a KeyedJaggedTensor found, by identity, inside the batch (a
dataclass field, a dict entry, a tuple item, ...) gets a path such as `batch.sparse_features`.
(A step that calls no collection, a dense warm-up step, leaves the recording to the next step that does.)
From the next batch on, the feeder routes the KJT at each recorded path for its collection, and the
collection's `input_dist` hands that result back when it is called with that very object. Whatever
Python the forward runs around the embeddings does not matter. A collection called with a KJT
that is not in the batch (computed inside the model) cannot be routed ahead: the pipeline says so
once, naming the collection and the reason, and that collection routes its ids inside the step, as
in the plain loop (the others stay pipelined).

Agreement, and why nothing hangs (each channel also waits through a CollectiveGuard of its own, in a
slot of its own: a peer that exits is named within seconds, a timeout names the model's setting).
Each channel carries the same collectives in the same order on every rank: the step's run on the
model's channel (main thread), the feeder's on the pipeline's own (a second process group, plus a
second shared-memory group on CPU). The feeder starts batch k only while k < taken + K (taken:
batches the loop has taken), the same on every rank, so whenever a pass stops (end of data, an
exception in the step, a loop cut short) every rank's feeder has run the same collectives and stops
at the same point. A rank whose loader ends first ends the pass for all (the step-together rule of
_strategy/loaders.py), except in evaluation, where it steps on with its dataset's empty batches until all have
ended; a batch whose features do not match raises the same ValueError on every rank at that
batch; an exception in one rank's loader stops every rank there.

Variants are a field (`PipelineConfig.variant`), not subclasses: "sparse_dist" runs read, copy and
input_dist ahead (TorchRec's TrainPipelineSparseDist). A semi-synchronous variant would add the
next batch's lookup to the feeder's stages (embeddings one update stale); a fused-lookup one would
start the lookup from the routed ids in the same stage: another entry of `_STAGES_AHEAD`.

GPU (parity tested at one GPU, both collective orders): the copy runs on a side stream from pinned
memory (pinned here when the loader did not), input_dist on a second stream that waits for the
copy's event; the step's stream waits for each event before using a batch or its routed ids, and
every tensor crossing streams is `record_stream`-ed so the caching allocator keeps it until the
step is done. The feeder's all-to-alls are NCCL calls on the pipeline's own communicator. Two
threads launching on two communicators would launch them in another order on each rank (shown on
shared memory: `tests/test_pipeline.py`, the launch-order test, differs between ranks in every run
with "concurrent"), which NCCL calls deadlock-prone when the kernels cannot all be resident or a
device sync intervenes. So on NCCL with several ranks (`PipelineConfig.feeder_collectives="auto"`;
one rank runs "concurrent": no other rank to agree with) the feeder runs batch k's collectives (the
agreement, the counts and id all-to-alls) only while the step's thread waits in `next()` for batch k
("in_step_order"): both threads' launches come in one order on every rank, as TorchRec gets by
launching from one thread. Reading, pinning, copying and checking stay ahead of the step; the id
payload still runs on the side stream beside the compute; what the step's thread waits for is the
small counts exchange. On gloo / shared memory every group is independent and the feeder
runs them as soon as a batch is read ("concurrent"), which is what takes the routing off a CPU step.

Memory: with depth K the step holds 1 + K batches' routed ids (Lightning's loop takes one more
batch ahead: 2 + K); the planner counts them (`planner.CostModel(pipelined=K)`).
"""

from __future__ import annotations

from lightning_rec.pipeline.batch import find_kjts, move_to_device, path_name
from lightning_rec.pipeline.config import PipelineConfig
from lightning_rec.pipeline.lightning import base_loader_class, wrap_loader
from lightning_rec.pipeline.train_pipeline import InputPipeline, TrainPipelineSparseDist

__all__ = ["InputPipeline", "PipelineConfig", "TrainPipelineSparseDist", "base_loader_class", "find_kjts",
           "move_to_device", "path_name", "wrap_loader"]

"""DLRM training throughput on one GPU: a plain loop and Trainer(strategy="rec"), fp32 / TF32 / bf16 autocast.

    python benchmarks/dlrm_gpu.py [--steps 50] [--rounds 3] [--modes fp32,tf32,bf16]
    python benchmarks/dlrm_gpu.py --smoke [--pipeline] [--device cpu]   # seconds: 1,000-row tables, 3 steps, 1 round

Model: 13 dense features -> dense arch 512-256-128; 26 tables x 1M rows x dim 128,
sum pooling, one id per feature, fused row-wise Adagrad (lr 0.01); dot interaction; over arch
1024-1024-512-256-1; torch Adagrad for the dense layers; batch 16,384.

- loop: batches already on the GPU (dense [B, 13], KJT, labels), forward, BCE loss, backward (the
  fused update happens there), dense step. Synchronised only at the ends of timed blocks.
- trainer: the same model and batches through `Trainer(strategy="rec", accelerator="gpu", devices=1)`,
  timed from the end of the warm-up steps to the end of fit by a callback that synchronises.
Modes: fp32 (TF32 off), tf32 (matmul and cuDNN TF32 on), bf16 (the dense part under
torch.autocast(bfloat16); the tables stay fp32). Modes and variants alternate over rounds; figures
are medians. Prints a table, then one JSON line with figures.dlrm_samples_s_fp32,
figures.dlrm_samples_s_tf32, figures.dlrm_samples_s_bf16, ratios.trainer_vs_loop_cuda and the peak
GPU memory per mode.

    python benchmarks/dlrm_gpu.py --pipeline [--modes fp32,tf32] [--rounds 3]

`--pipeline`: the same model as a one-rank DistributedModelParallel (NCCL on GPU, gloo on
CPU), batches from pinned host memory through a DataLoader, trained by the plain loop (each batch
copied with .to(device, non_blocking=True) in the step) and by TrainPipelineSparseDist (the copy on a
side stream, input_dist on its own stream, one batch ahead), alternating within each round over the
same model. JSON: ratios.pipelined_vs_plain_cuda (median pipelined / median plain samples/s of the
first mode), figures.pipelined_samples_s_<mode>, figures.plain_host_samples_s_<mode>, and TorchRec
1.6.1's pipelined figures on an H100 for the same shapes (1.67M fp32 / 1.83M TF32) as
figures.torchrec_pipelined_samples_s_<mode> for comparison. The pipeline runs with its default
PipelineConfig (feeder_collectives="auto": "concurrent" at one rank, NCCL included) and, in the same
rounds, with the order NCCL needs at several ranks (figures.pipelined_in_step_order_samples_s_<mode>) and
semi-synchronously (PipelineConfig(semi_sync=True): figures.pipelined_semi_sync_samples_s_<mode>,
ratios.semi_sync_vs_sparse_dist[_cuda] of the first mode).

    python benchmarks/dlrm_gpu.py --pipeline --compile-dense {default,cuda_graphs}

`--compile-dense`: a second model of the same shapes, its dense layers compiled
(DistributedModelParallel(compile_dense=True), or cuda_graphs=True: CUDA graphs through
mode="reduce-overhead"), pipelined in the same rounds: figures.pipelined_compiled_samples_s_<mode>,
ratios.compiled_vs_eager[_cuda] (pipelined, first mode). Compiling happens in the warm-up steps.

    python benchmarks/dlrm_gpu.py --uvm-cache 0.2 --prefetch [--modes tf32] [--rounds 3]   # a CUDA device only

`--uvm-cache LF --prefetch`: every table in host memory behind a device cache of LF of its rows
(compute_kernel fused_uvm_caching, cache_load_factor LF), one-rank DistributedModelParallel, batches from
pinned host memory; TrainPipelineSparseDist without and with PipelineConfig(prefetch=True) (batch i+1's rows
fetched into the cache while batch i computes), two models of the same values (a cache in prefetch mode
stays so), alternating first and second over rounds. JSON: ratios.prefetch_vs_none (median samples/s of
the first mode), figures.uvm_cache_<none|prefetch>_samples_s_<mode>, figures.uvm_cache_load_factor.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
import torch.nn.functional as F

NUM_TABLES, DENSE_IN = 26, 13
DENSE_ARCH, OVER_ARCH = [512, 256, 128], [1024, 1024, 512, 256, 1]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def set_mode(mode: str) -> contextlib.AbstractContextManager:
    tf32 = mode in ("tf32", "bf16")
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    if mode == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def make_batches(args, device: torch.device):
    from lightning_rec.data.batch import Batch
    from lightning_rec.sparse import KeyedJaggedTensor

    g = torch.Generator().manual_seed(0)
    keys = [f"C{i + 1}" for i in range(NUM_TABLES)]
    lengths = torch.ones(NUM_TABLES * args.batch, dtype=torch.int64, device=device)
    out = []
    for _ in range(args.batches):
        ids = torch.randint(0, args.rows, (NUM_TABLES * args.batch,), generator=g).to(device)
        kjt = KeyedJaggedTensor(keys, ids, lengths=lengths, stride=args.batch)
        dense = torch.rand(args.batch, DENSE_IN, generator=g).to(device)
        labels = torch.randint(0, 2, (args.batch,), generator=g).float().to(device)
        out.append(Batch(dense, kjt, labels))
    return keys, out


def build_module(args, keys, embedding_device: str = "cpu"):
    """embedding_device="meta" where the module is sharded (Trainer, pipeline): each shard drawn on the GPU, no
    13 GB host copy to initialise first; the plain loop moves an unsharded module, built on the host."""
    from lightning_rec.models.dlrm_module import DLRMModule

    torch.manual_seed(0)
    return DLRMModule(num_embeddings_per_feature=args.rows, embedding_dim=DENSE_ARCH[-1], sparse_feature_names=keys,
                      dense_in_features=DENSE_IN, dense_arch_layer_sizes=DENSE_ARCH, over_arch_layer_sizes=OVER_ARCH,
                      sparse_optimizer="rowwise_adagrad", sparse_lr=0.01, dense_optimizer="adagrad", dense_lr=0.01,
                      embedding_device=embedding_device)


def run_loop(args, mode: str, device: torch.device, keys, batches) -> tuple[float, float]:
    """samples/s and peak memory (MB) of the hand-written loop."""
    if getattr(args, "_loop_model", None) is None:
        # built once (26M rows initialised on the host take ~20 s) and trained on in every mode and round: a step's
        # speed does not depend on the values in the tables
        module = build_module(args, keys)
        module.configure_model()
        args._loop_model = module.model.to(device)
    model = args._loop_model
    dense_opt = torch.optim.Adagrad([p for p in model.parameters() if p.requires_grad], lr=0.01)
    autocast = set_mode(mode)

    def step(b) -> None:
        with autocast:
            logits = model(b.dense_features, b.sparse_features).squeeze(1)
        loss = F.binary_cross_entropy_with_logits(logits.float(), b.labels)
        loss.backward()
        dense_opt.step()
        dense_opt.zero_grad(set_to_none=True)

    for b in batches[:3]:
        step(b)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(args.steps):
        step(batches[i % len(batches)])
    sync(device)
    elapsed = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
    if args.profile and not getattr(args, "_profiled", set()) >= {mode}:
        from gpu_profile import print_profile  # this folder

        args._profiled = getattr(args, "_profiled", set()) | {mode}
        print_profile(f"loop {mode}", lambda i: step(batches[i % len(batches)]))
    return args.batch * args.steps / elapsed, peak


def run_trainer(args, mode: str, device: torch.device, keys, batches) -> float:
    """samples/s of Trainer(strategy="rec") over the same batches, timed after 3 warm-up steps."""
    import lightning.pytorch as pl

    warmup = 3
    # --profile: 5 more steps under torch.profiler, after the timed ones (once a mode)
    profiled = 5 if args.profile and mode not in getattr(args, "_trainer_profiled", set()) else 0
    total = warmup + args.steps + profiled

    class Timer(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == warmup:
                sync(device)
                self.t0 = time.perf_counter()
            elif batch_idx == warmup + args.steps:
                self._stop()

        def on_train_end(self, trainer, pl_module):
            if not hasattr(self, "elapsed"):
                self._stop()

        def _stop(self):
            sync(device)
            self.elapsed = time.perf_counter() - self.t0

    class Loader:
        def __iter__(self):
            return (batches[i % len(batches)] for i in range(total))

        def __len__(self):
            return total

    # one module for every round: a later Trainer finds its tables sharded as the first left them (on the device)
    module = args._trainer_module = getattr(args, "_trainer_module", None) or build_module(args, keys, "meta")
    timer = Timer()
    callbacks = [timer]
    if profiled:
        from gpu_profile import trainer_step_profile  # this folder

        args._trainer_profiled = getattr(args, "_trainer_profiled", set()) | {mode}
        callbacks.append(trainer_step_profile(mode, warmup + args.steps, profiled))
    set_mode(mode)
    trainer = pl.Trainer(strategy="rec", accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
                         max_steps=total, precision="bf16-mixed" if mode == "bf16" else "32-true",
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks)
    trainer.fit(module, train_dataloaders=Loader())
    return args.batch * args.steps / timer.elapsed


TORCHREC_PIPELINED = {"fp32": 1.67e6, "tf32": 1.83e6}  # TorchRec 1.6.1 TrainPipelineSparseDist on an H100


def pipelined_samples_s(model_and_opt, device: torch.device, config, loader, steps: int, warmup: int,
                        batch: int) -> float:
    """Samples/s of TrainPipelineSparseDist over `loader`: `steps` timed steps after `warmup` untimed ones."""
    from lightning_rec.pipeline import TrainPipelineSparseDist

    with TrainPipelineSparseDist(*model_and_opt, device, config) as pipeline:
        it = iter(loader)
        for i in range(steps + warmup):
            if i == warmup:
                sync(device)
                t0 = time.perf_counter()
            pipeline.progress(it)
        sync(device)
        return batch * steps / (time.perf_counter() - t0)


def run_pipeline_compare(args, modes, device: torch.device) -> dict[str, dict[str, list[float]]]:
    """samples/s per mode of the plain loop and the pipeline over the same pinned host batches."""
    from dlrm_distributed import TrainStep  # the same step as the CPU pipeline benchmark (this folder)
    from torch.utils.data import DataLoader

    from lightning_rec.model_parallel import DistributedModelParallel
    from lightning_rec.optim import CombinedOptimizer
    from lightning_rec.pipeline import PipelineConfig

    one_rank_world(device)
    keys, host = make_batches(args, torch.device("cpu"))
    if device.type == "cuda":
        host = [b.pin_memory() for b in host]
    steps, warmup = args.steps, 3
    loader = DataLoader([host[i % len(host)] for i in range(steps + warmup)], batch_size=None)

    def build(**compile_args):
        module = build_module(args, keys, "meta")
        module.configure_model()
        dmp = DistributedModelParallel(TrainStep(module.model), device=device, **compile_args)
        dense = torch.optim.Adagrad([p for p in dmp.parameters() if p.requires_grad], lr=0.01)
        return dmp, CombinedOptimizer([("fused", dmp.fused_optimizer), ("dense", dense)])

    dmp, opt = build()
    compiled = None
    if args.compile_dense:
        compiled = build(**({"cuda_graphs": True} if args.compile_dense == "cuda_graphs" else {"compile_dense": True}))
    # the default pipeline (feeder_collectives="auto": concurrent at one rank) and the order several NCCL ranks use
    other = "in_step_order"
    kinds = ["plain", "pipelined", f"pipelined_{other}", "pipelined_semi_sync"]
    kinds += ["pipelined_compiled"] if compiled else []
    out = {m: {k: [] for k in kinds} for m in modes}

    def plain() -> float:
        for i, b in enumerate(loader):
            if i == warmup:
                sync(device)
                t0 = time.perf_counter()
            b = b.to(device, non_blocking=True)
            opt.zero_grad()
            loss, _ = dmp(b)
            loss.backward()
            opt.step()
        sync(device)
        return args.batch * steps / (time.perf_counter() - t0)

    def pipelined(feeder_collectives: str = "auto", semi_sync: bool = False, model=None) -> float:
        config = PipelineConfig(feeder_collectives=feeder_collectives, semi_sync=semi_sync)
        return pipelined_samples_s(model or (dmp, opt), device, config, loader, steps, warmup, args.batch)

    for r in range(args.rounds):
        for mode in modes:
            with set_mode(mode):
                runs = {"plain": plain, "pipelined": pipelined, f"pipelined_{other}": lambda: pipelined(other),
                        "pipelined_semi_sync": lambda: pipelined(semi_sync=True),
                        "pipelined_compiled": lambda: pipelined(model=compiled)}
                runs = {k: runs[k] for k in kinds}
                for kind in list(runs) if r % 2 == 0 else list(runs)[::-1]:
                    out[mode][kind].append(runs[kind]())
    return out


def pipeline_main(args, modes, device: torch.device) -> None:
    runs = run_pipeline_compare(args, modes, device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"DLRM on {name}, one rank, batches from pinned host memory through a DataLoader: {NUM_TABLES} tables x "
          f"{args.rows} rows x dim {DENSE_ARCH[-1]}, batch {args.batch}, median of {args.rounds} rounds of "
          f"{args.steps} steps")
    print(f"{'mode':<8}{'plain samples/s':>18}{'pipelined samples/s':>22}{'ratio':>8}{'TorchRec pipelined':>20}")
    figures, results = {}, []
    for mode in modes:
        pl_, pi = statistics.median(runs[mode]["plain"]), statistics.median(runs[mode]["pipelined"])
        ref = TORCHREC_PIPELINED.get(mode) if device.type == "cuda" else None
        print(f"{mode:<8}{pl_:>18,.0f}{pi:>22,.0f}{pi / pl_:>8.3f}{(ref or float('nan')):>20,.0f}")
        figures[f"plain_host_samples_s_{mode}"] = pl_
        figures[f"pipelined_samples_s_{mode}"] = pi
        if ref is not None and device.type == "cuda":
            figures[f"torchrec_pipelined_samples_s_{mode}"] = ref
            figures[f"pipelined_vs_torchrec_{mode}"] = pi / ref
        other = next(k for k in runs[mode] if k.startswith("pipelined_in"))
        po, semi = statistics.median(runs[mode][other]), statistics.median(runs[mode]["pipelined_semi_sync"])
        print(f"{'':<8}{other + ' (feeder_collectives)':>48}{po:>12,.0f}{po / pl_:>8.3f}")
        print(f"{'':<8}{'pipelined_semi_sync':>48}{semi:>12,.0f}{semi / pl_:>8.3f}")
        figures[f"{other}_samples_s_{mode}"] = po
        figures[f"pipelined_semi_sync_samples_s_{mode}"] = semi
        if "pipelined_compiled" in runs[mode]:
            comp = statistics.median(runs[mode]["pipelined_compiled"])
            print(f"{'':<8}{'pipelined_compiled (' + args.compile_dense + ')':>48}{comp:>12,.0f}{comp / pl_:>8.3f}")
            figures[f"pipelined_compiled_samples_s_{mode}"] = comp
        results.append({"mode": mode, "plain_samples_per_s": pl_, "pipelined_samples_per_s": pi,
                        f"{other}_samples_per_s": po, "per_round_plain": runs[mode]["plain"],
                        "per_round_pipelined": runs[mode]["pipelined"], f"per_round_{other}": runs[mode][other],
                        "per_round_semi_sync": runs[mode]["pipelined_semi_sync"],
                        "per_round_compiled": runs[mode].get("pipelined_compiled")})
    first = modes[0]
    key = "pipelined_vs_plain_cuda" if device.type == "cuda" else "pipelined_vs_plain"
    sparse_dist = statistics.median(runs[first]["pipelined"])
    semi_key = "semi_sync_vs_sparse_dist" + ("_cuda" if device.type == "cuda" else "")
    ratios = {key: sparse_dist / statistics.median(runs[first]["plain"]),
              semi_key: statistics.median(runs[first]["pipelined_semi_sync"]) / sparse_dist}
    if "pipelined_compiled" in runs[first]:
        ratios["compiled_vs_eager" + ("_cuda" if device.type == "cuda" else "")] = (
            statistics.median(runs[first]["pipelined_compiled"]) / sparse_dist)
    print(json.dumps({"benchmark": "dlrm_gpu", "results": results, "ratios": ratios, "figures": figures}))


def run_prefetch_compare(args, modes, device: torch.device) -> dict[str, dict[str, list[float]]]:
    """samples/s per mode of the pipeline over fused_uvm_caching tables, without and with the prefetch stage."""
    from dlrm_distributed import TrainStep  # this folder
    from torch.utils.data import DataLoader

    from lightning_rec.model_parallel import DistributedModelParallel, construct_module_sharding_plan, table_wise
    from lightning_rec.optim import CombinedOptimizer
    from lightning_rec.pipeline import PipelineConfig
    from lightning_rec.types import ComputeKernel, ShardingPlan

    one_rank_world(device)
    keys, host = make_batches(args, torch.device("cpu"))
    host = [b.pin_memory() for b in host]
    steps, warmup = args.steps, 3
    loader = DataLoader([host[i % len(host)] for i in range(steps + warmup)], batch_size=None)

    def build():
        module = build_module(args, keys, "meta")
        module.configure_model()
        step = TrainStep(module.model)
        path = "dlrm.sparse_arch.embedding_bag_collection"
        caching = table_wise(rank=0, compute_kernel=ComputeKernel.FUSED_UVM_CACHING)
        plan = ShardingPlan({path: construct_module_sharding_plan(
            module.model.sparse_arch.embedding_bag_collection, {f"t_{k}": caching for k in keys},
            world_size=1, local_size=1)})
        for sharding in plan.plan[path].values():
            sharding.cache_load_factor = args.uvm_cache
        dmp = DistributedModelParallel(step, plan=plan, device=device)
        dense = torch.optim.Adagrad([p for p in dmp.parameters() if p.requires_grad], lr=0.01)
        return dmp, CombinedOptimizer([("fused", dmp.fused_optimizer), ("dense", dense)])

    models = {"none": build(), "prefetch": build()}
    out = {m: {k: [] for k in models} for m in modes}

    def pipelined(kind: str) -> float:
        config = PipelineConfig(prefetch=kind == "prefetch")
        return pipelined_samples_s(models[kind], device, config, loader, steps, warmup, args.batch)

    for r in range(args.rounds):
        for mode in modes:
            with set_mode(mode):
                for kind in list(models) if r % 2 == 0 else list(models)[::-1]:
                    out[mode][kind].append(pipelined(kind))
    return out


def prefetch_main(args, modes, device: torch.device) -> None:
    runs = run_prefetch_compare(args, modes, device)
    print(f"DLRM on {torch.cuda.get_device_name()}, one rank, pinned host batches: {NUM_TABLES} tables x {args.rows} "
          f"rows x dim {DENSE_ARCH[-1]} in host memory behind a device cache of {args.uvm_cache:.0%} of their rows "
          f"(fused_uvm_caching), batch {args.batch}, median of {args.rounds} rounds of {args.steps} steps")
    print(f"{'mode':<8}{'pipelined samples/s':>22}{'+ prefetch samples/s':>22}{'ratio':>8}")
    figures, results = {"uvm_cache_load_factor": args.uvm_cache}, []
    for mode in modes:
        none, pre = (statistics.median(runs[mode][k]) for k in ("none", "prefetch"))
        print(f"{mode:<8}{none:>22,.0f}{pre:>22,.0f}{pre / none:>8.3f}")
        figures[f"uvm_cache_none_samples_s_{mode}"] = none
        figures[f"uvm_cache_prefetch_samples_s_{mode}"] = pre
        results.append({"mode": mode, "none_samples_per_s": none, "prefetch_samples_per_s": pre,
                        "per_round_none": runs[mode]["none"], "per_round_prefetch": runs[mode]["prefetch"]})
    first = modes[0]
    ratios = {"prefetch_vs_none": statistics.median(runs[first]["prefetch"]) / statistics.median(runs[first]["none"])}
    print(json.dumps({"benchmark": "dlrm_gpu", "results": results, "ratios": ratios, "figures": figures}))


def one_rank_world(device: torch.device) -> None:
    """A one-rank process group (NCCL on GPU, gloo on CPU): DistributedModelParallel and the pipeline need one."""
    import os
    import socket

    import torch.distributed as dist

    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=16_384)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batches", type=int, default=8, help="distinct batches cycled through")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default="fp32,tf32,bf16")
    parser.add_argument("--no-trainer", action="store_true")
    parser.add_argument("--profile", action="store_true", help="also print where a loop step's time goes (once a mode)")
    parser.add_argument("--pipeline", action="store_true",
                        help="plain loop vs TrainPipelineSparseDist over pinned host batches (see the module doc)")
    parser.add_argument("--compile-dense", choices=["default", "cuda_graphs"], default=None,
                        help="--pipeline: also a model with compiled dense layers (see the module doc)")
    parser.add_argument("--uvm-cache", type=float, default=None, metavar="LF",
                        help="tables in host memory behind a device cache of LF of their rows (with --prefetch)")
    parser.add_argument("--prefetch", action="store_true",
                        help="--uvm-cache: the pipeline without and with PipelineConfig(prefetch=True) (module doc)")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds: 1,000-row tables, batch 1024, 3 steps, one round (every mode and variant)")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.batch, args.steps, args.batches, args.rounds = 1000, 1024, 3, 2, 1
    device = torch.device(args.device)
    modes = args.modes.split(",")
    if device.type != "cuda":
        modes = [m for m in modes if m != "bf16"]
    if args.prefetch or args.uvm_cache is not None:
        if not (args.prefetch and args.uvm_cache is not None and 0 < args.uvm_cache <= 1):
            parser.error("--uvm-cache LF (0 < LF <= 1) and --prefetch go together: --uvm-cache 0.2 --prefetch")
        if device.type != "cuda":
            parser.error("--uvm-cache / --prefetch need a CUDA device: a device cache over host memory is a GPU's")
        prefetch_main(args, [m for m in modes if m != "bf16"] or ["fp32"], device)
        return
    if args.pipeline:
        pipeline_main(args, [m for m in modes if m != "bf16"] or ["fp32"], device)
        return
    keys, batches = make_batches(args, device)
    loop: dict[str, list[float]] = {m: [] for m in modes}
    peaks: dict[str, list[float]] = {m: [] for m in modes}
    trainer: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode in modes:
            sps, peak = run_loop(args, mode, device, keys, batches)
            loop[mode].append(sps)
            peaks[mode].append(peak)
            if not args.no_trainer and mode == modes[0]:
                trainer[mode].append(run_trainer(args, mode, device, keys, batches))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"DLRM on {name}: {NUM_TABLES} tables x {args.rows} rows x dim {DENSE_ARCH[-1]}, batch {args.batch}, "
          f"median of {args.rounds} rounds of {args.steps} steps")
    print(f"{'mode':<8}{'loop samples/s':>16}{'trainer samples/s':>20}{'peak GPU MB':>14}")
    figures, results = {}, []
    for mode in modes:
        lo = statistics.median(loop[mode])
        tr = statistics.median(trainer[mode]) if trainer[mode] else float("nan")
        pk = statistics.median(peaks[mode])
        print(f"{mode:<8}{lo:>16,.0f}{tr:>20,.0f}{pk:>14,.0f}")
        figures[f"dlrm_samples_s_{mode}"] = lo
        figures[f"peak_gpu_mb_{mode}"] = pk
        results.append({"mode": mode, "loop_samples_per_s": lo, "trainer_samples_per_s": tr, "peak_gpu_mb": pk})
    ratios = {}
    if trainer[modes[0]]:
        ratios["trainer_vs_loop_cuda" if device.type == "cuda" else "trainer_vs_loop"] = (
            statistics.median(trainer[modes[0]]) / statistics.median(loop[modes[0]]))
    for k, v in ratios.items():
        print(f"{k:<24}{v:.3f}")
    clean = lambda x: None if isinstance(x, float) and x != x else x  # NaN is not JSON  # noqa: E731
    results = [{k: clean(v) for k, v in r.items()} for r in results]
    figures = {k: clean(v) for k, v in figures.items()}
    print(json.dumps({"benchmark": "dlrm_gpu", "results": results, "ratios": ratios, "figures": figures}))


if __name__ == "__main__":
    main()

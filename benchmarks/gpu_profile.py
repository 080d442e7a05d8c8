"""A short torch.profiler look at a GPU step, printed by the GPU benchmarks under --profile.

When a figure falls short, the same run's log should already say where the step's time goes. Prints host
(CPU) time per step against GPU kernel time per step, the host-device syncs and copies per step (each one
a stall of the host-bound step), and the ops that cost the host most.

    python benchmarks/gpu_profile.py [--device cuda] [--rows 1000000] [--dim 128] [--batch 16384]
    python benchmarks/gpu_profile.py --smoke      # seconds: 1,000-row tables, batch 1024, 3 steps

run alone, profiles one EmbeddingBagCollection step (26 tables, one id per feature, fused row-wise Adagrad,
batches already on the device, the id check on) and ends with one JSON line {"benchmark": "gpu_profile",
"device": ..., "results": [...], "ratios": {}, "figures": {...}}: figures.host_ms_per_step, wall_ms_per_step,
gpu_kernel_ms_per_step and syncs_per_step (the SYNC_EVENTS counted per step).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync",
               "cudaMemcpy", "aten::item", "aten::_local_scalar_dense", "aten::nonzero")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def print_profile(label: str, step: Callable[[int], None], steps: int = 5, top: int = 18) -> dict:
    import time

    from torch.profiler import ProfilerActivity, profile

    for i in range(2):
        step(i)
    _sync()
    t0 = time.perf_counter()
    for i in range(steps):
        step(i)
    host_s = time.perf_counter() - t0  # the host's enqueue time: the wall time when the step is host-bound
    _sync()
    wall_s = time.perf_counter() - t0
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for i in range(steps):
            step(i)
        _sync()
    return _print_events(label, prof.key_averages(), steps, host_s, wall_s, top)


def _print_events(label: str, events, steps: int, host_s: float | None, wall_s: float | None, top: int = 18) -> dict:
    """Prints the table; returns its figures (per step)."""
    gpu_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)) for e in events)
    timing = (f"unprofiled: host {host_s / steps * 1e3:.2f} ms/step, wall {wall_s / steps * 1e3:.2f} ms/step; "
              if host_s is not None else "")
    print(f"--- profile {label}: {steps} steps; {timing}profiled GPU kernel time {gpu_us / steps / 1e3:.2f} ms/step")
    for e in events:
        if e.key in SYNC_EVENTS:
            print(f"    {e.key:<28}{e.count / steps:>6.1f} per step  {e.cpu_time_total / steps:>9.0f} us host per step")
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    print(f"    {'op (by self host time)':<52}{'calls/step':>10}{'self host us/step':>18}{'GPU us/step':>12}")
    for e in rows:
        dev = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))
        print(f"    {e.key[:52]:<52}{e.count / steps:>10.1f}{e.self_cpu_time_total / steps:>18.0f}{dev / steps:>12.0f}")
    return {"host_ms_per_step": None if host_s is None else host_s / steps * 1e3,
            "wall_ms_per_step": None if wall_s is None else wall_s / steps * 1e3,
            "gpu_kernel_ms_per_step": gpu_us / steps / 1e3,
            "syncs_per_step": {e.key: e.count / steps for e in events if e.key in SYNC_EVENTS}}


def trainer_step_profile(label: str, start: int, steps: int = 5):
    """A Lightning callback: torch.profiler over batches start..start+steps-1 of a Trainer run, printed as
    print_profile's table, so that the Trainer's step can be set beside the hand loop's (syncs, host ops)."""
    import lightning.pytorch as pl
    from torch.profiler import ProfilerActivity, profile

    class StepProfile(pl.Callback):
        prof = None

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == start:
                _sync()
                cuda = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
                self.prof = profile(activities=[ProfilerActivity.CPU, *cuda])
                self.prof.__enter__()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == start + steps - 1 and self.prof is not None:
                _sync()
                self.prof.__exit__(None, None, None)
                _print_events(f"trainer {label}", self.prof.key_averages(), steps, None, None)

    return StepProfile()


def print_python_profile(label: str, step: Callable[[int], None], steps: int, top: int = 22) -> None:
    """cProfile of `steps` steps: which Python functions (ours, fbgemm's, torch's) spend the host's time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(steps):
        step(i)
    _sync()
    profiler.disable()
    print(f"--- python profile {label}: {steps} steps (tottime, cumtime: seconds over all steps)")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def main() -> None:
    import argparse
    import json

    from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig, KeyedJaggedTensor

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16_384)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="seconds: 1,000-row tables, batch 1024, 3 steps")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.batch, args.steps = 1000, 1024, 3
    T, dev = 26, torch.device(args.device)
    keys = [f"f{t}" for t in range(T)]
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name=f"t{t}", num_embeddings=args.rows, embedding_dim=args.dim,
                                                     feature_names=[keys[t]]) for t in range(T)],
                                 optimizer=FusedOptimizerConfig("rowwise_adagrad", lr=0.01), device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    lengths = torch.ones(T * args.batch, dtype=torch.int64, device=dev)
    kjts = [KeyedJaggedTensor(keys, torch.randint(0, args.rows, (T * args.batch,), device=dev, generator=g),
                              lengths=lengths, stride=args.batch) for _ in range(args.steps)]
    figures = print_profile(f"EmbeddingBagCollection on {args.device}",
                            lambda i: ebc(kjts[i % len(kjts)]).values().sum().backward(), steps=args.steps)
    results = [{"step": "EmbeddingBagCollection forward + backward", "rows": args.rows, "dim": args.dim,
                "batch": args.batch, "steps": args.steps}]
    print(json.dumps({"benchmark": "gpu_profile", "device": args.device, "results": results, "ratios": {},
                      "figures": figures}))


if __name__ == "__main__":
    main()

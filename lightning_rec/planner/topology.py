"""The hardware the planner plans for: ranks, hosts, memory per rank, bandwidths.

Memory in bytes, bandwidth in bytes per second, per rank. On CPU the tables live in host DDR (`hbm_cap` is 0); on
CUDA in HBM (`fused`), in DDR through unified memory (`fused_uvm`), or in DDR with an HBM cache (`fused_uvm_caching`).
Defaults come from the machine where it can tell; bandwidths default to conservative figures."""

from __future__ import annotations

import os
from dataclasses import dataclass

GB = 1024**3

# GPU defaults: TorchRec's planner constants (an A100-class node on 100 Gbit/s networking).
_CUDA_HBM_BW = 897e9  # effective bandwidth of random row gathers, not the HBM peak
_CUDA_DDR_BW = 51e9
_CUDA_INTRA_HOST_BW = 600e9  # NVLink
_CUDA_INTER_HOST_BW = 12.5e9  # 100 Gbit/s per rank
_CUDA_PCIE_BW = 32e9  # UVM reads cross PCIe gen4 x16
# CPU defaults: ranks of one host exchange through shared memory (shm_transport.py)
_CPU_DDR_BW = 20e9  # random 128-512 B row gathers from one core's share of DDR
_CPU_INTRA_HOST_BW = 6.5e9
_CPU_INTER_HOST_BW = 1.25e9  # 10 Gbit/s ethernet

COMPUTE_DEVICES = ("cpu", "cuda")
# Slower than any real link of its kind, in bytes per second (TorchRec's are per millisecond: 1000x below these)
_BW_FLOORS = {"hbm_mem_bw": (1e10, "GPU memory"), "ddr_mem_bw": (1e9, "host memory"),
              "intra_host_bw": (1e9, "GPU link between ranks of one host"),
              "inter_host_bw": (1e8, "network between hosts"),
              "pcie_bw": (1e9, "host-device link")}
_CPU_INTRA_HOST_FLOOR = (1e8, "link between ranks of one host")  # gloo's loopback TCP on a slow host: under 1e9
# TorchRec's Topology fields that this planner does not model: what does their job here
_TORCHREC_REFUSED = {
    "bwd_compute_multiplier": "the backward is priced from the bytes it moves (the gradient, each row and its optimizer"
                              " state read and written) at ddr_mem_bw / hbm_mem_bw: lower those to make lookups dearer",
    "weighted_feature_bwd_compute_multiplier": "weighted ids are priced by their extra bytes (ParameterConstraints("
                                               "is_weighted=True), or read from the collection)",
    "uneven_sharding_perf_multiplier": "uneven shards are priced by their own rows and columns",
    "custom_topology_data": "every rank gets the same hbm_cap / ddr_cap: pass the smallest rank's",
    "generalized_comms_bandwidths": "communication is priced with intra_host_bw and inter_host_bw (bytes per second "
                                    "per rank)",
}


def host_memory_bytes() -> int:
    """Physical RAM of this host, 0 where the OS does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def gpu_memory_bytes() -> int:
    """Memory of GPU 0, 0 where no GPU is visible."""
    import torch

    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.get_device_properties(0).total_memory)


def _size(nbytes: float) -> str:
    """GB to one decimal; below 1 GB in MB or KB (a small test cluster read "ddr 0.0 GB per rank")."""
    for unit, scale in (("GB", GB), ("MB", 1024**2), ("KB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} bytes"


@dataclass
class Topology:
    """World size, ranks per host, compute device, memory and bandwidth per rank; unset fields come from the machine
    (GPU 0's memory, host RAM shared by the host's ranks) or from the defaults above."""

    # TorchRec's field order, so that its positional calls read the same
    world_size: int
    compute_device: str = "cpu"
    hbm_cap: int | None = None  # device memory per rank; 0 on CPU
    ddr_cap: int | None = None  # host memory per rank
    local_world_size: int | None = None  # ranks per host; default: all ranks on one host
    hbm_mem_bw: float | None = None
    ddr_mem_bw: float | None = None
    intra_host_bw: float | None = None  # per rank, to ranks on the same host
    inter_host_bw: float | None = None  # per rank, to ranks on other hosts
    pcie_bw: float | None = None  # host <-> device, what UVM lookups go through
    # TorchRec's names: hbm_to_ddr_mem_bw is read into pcie_bw, the others refused unless None (_TORCHREC_REFUSED)
    hbm_to_ddr_mem_bw: float | None = None
    bwd_compute_multiplier: float | None = None
    custom_topology_data: object | None = None
    weighted_feature_bwd_compute_multiplier: float | None = None
    uneven_sharding_perf_multiplier: float | None = None
    generalized_comms_bandwidths: object | None = None

    def __post_init__(self) -> None:
        self._take_torchrec_names()
        self.compute_device = str(self.compute_device).lower()
        if self.compute_device not in COMPUTE_DEVICES:
            raise ValueError(f"Topology compute_device={self.compute_device!r} is not supported: use 'cpu' or 'cuda'")
        if not isinstance(self.world_size, int) or self.world_size <= 0:
            raise ValueError(f"Topology world_size must be a positive number of ranks, got {self.world_size!r}")
        if self.local_world_size is None:
            self.local_world_size = self.world_size
        if self.local_world_size <= 0 or self.world_size % self.local_world_size:
            raise ValueError(f"Topology local_world_size={self.local_world_size} must be positive and divide "
                             f"world_size={self.world_size}: set it to the number of ranks per host")
        self._resolve_memory()
        self._resolve_bandwidths()

    def _take_torchrec_names(self) -> None:
        for name, instead in _TORCHREC_REFUSED.items():
            value = getattr(self, name)
            if value is not None:
                raise ValueError(f"Topology({name}={value!r}) is TorchRec's; this planner does not model it: "
                                 f"{instead}; leave it out")
        if self.hbm_to_ddr_mem_bw is not None:
            if self.pcie_bw is not None and self.pcie_bw != self.hbm_to_ddr_mem_bw:
                raise ValueError(f"Topology hbm_to_ddr_mem_bw={self.hbm_to_ddr_mem_bw} (TorchRec's name) disagrees "
                                 f"with pcie_bw={self.pcie_bw}: they are the same link; pass one of them")
            self.pcie_bw = self.hbm_to_ddr_mem_bw

    def _resolve_memory(self) -> None:
        cuda = self.compute_device == "cuda"
        if self.hbm_cap is None:
            self.hbm_cap = gpu_memory_bytes() if cuda else 0
            if cuda and not self.hbm_cap:
                raise ValueError("Topology(compute_device='cuda') could not read GPU memory (no GPU visible here): "
                                 "pass hbm_cap=<bytes per rank>, e.g. hbm_cap=80 * GB")
        if self.ddr_cap is None:
            self.ddr_cap = host_memory_bytes() // self.local_world_size
        if cuda and self.hbm_cap <= 0:
            raise ValueError(f"Topology hbm_cap={self.hbm_cap} leaves no device memory per rank: pass the GPU's "
                             f"memory in bytes (hbm_cap=80 * GB), or plan for compute_device='cpu'")
        if not cuda and self.hbm_cap:
            raise ValueError(f"Topology hbm_cap={self.hbm_cap} is set for compute_device='cpu', which has no device "
                             f"memory: leave hbm_cap out and size host memory with ddr_cap")
        if self.ddr_cap <= 0:
            raise ValueError(f"Topology ddr_cap={self.ddr_cap} leaves no host memory per rank: pass ddr_cap=<bytes "
                             f"per rank> (e.g. ddr_cap=64 * GB)")

    def _resolve_bandwidths(self) -> None:
        cuda = self.compute_device == "cuda"
        pcie_name = "pcie_bw" if self.hbm_to_ddr_mem_bw is None else "hbm_to_ddr_mem_bw"
        defaults = {"hbm_mem_bw": _CUDA_HBM_BW if cuda else 0.0, "ddr_mem_bw": _CUDA_DDR_BW if cuda else _CPU_DDR_BW,
                    "intra_host_bw": _CUDA_INTRA_HOST_BW if cuda else _CPU_INTRA_HOST_BW,
                    "inter_host_bw": _CUDA_INTER_HOST_BW if cuda else _CPU_INTER_HOST_BW,
                    "pcie_bw": _CUDA_PCIE_BW if cuda else 0.0}
        for name, default in defaults.items():
            value = getattr(self, name)
            floor, what = _BW_FLOORS[name] if cuda or name != "intra_host_bw" else _CPU_INTRA_HOST_FLOOR
            if value is None:
                setattr(self, name, float(default))
            elif value <= 0 and default > 0:
                raise ValueError(f"Topology {name}={value} must be positive (bytes per second)")
            elif default > 0 and value < floor:
                name = pcie_name if name == "pcie_bw" else name
                raise ValueError(
                    f"Topology {name}={value:g} is {_size(value)}/s, slower than any {what} (>= {floor:g} bytes/s): "
                    f"bandwidths here are bytes per second, and TorchRec's are bytes per millisecond: multiply a "
                    f"TorchRec figure by 1000 ({name}={value * 1000:g})"
                )

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def device_mem_bw(self) -> float:
        """Bandwidth of lookups into the memory the fused kernel uses (HBM, or DDR on CPU)."""
        return self.hbm_mem_bw if self.compute_device == "cuda" else self.ddr_mem_bw

    def describe(self) -> str:
        mem = f"ddr {_size(self.ddr_cap)}"
        if self.compute_device == "cuda":
            mem = f"hbm {_size(self.hbm_cap)}, " + mem
        return (
            f"{self.world_size} ranks ({self.num_hosts} host(s) x {self.local_world_size}), "
            f"{self.compute_device}, {mem} per rank"
        )

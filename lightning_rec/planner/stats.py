"""What a plan costs, per rank and per table: printed once after planning, and returned as data."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from lightning_rec.planner.topology import _size

GB = 1024**3


@dataclass
class RankStats:
    rank: int
    hbm_used: float  # bytes
    hbm_cap: float  # bytes usable by tables (after the reserved share)
    ddr_used: float
    ddr_cap: float
    compute_ms: float
    comm_ms: float
    shards: dict[str, int] = field(default_factory=dict)  # sharding type -> shards on this rank

    @property
    def total_ms(self) -> float:
        return self.compute_ms + self.comm_ms


@dataclass
class TableStats:
    path: str
    name: str
    sharding_type: str
    compute_kernel: str
    ranks: list[int]
    hbm_bytes: float
    ddr_bytes: float
    ms: float  # summed over the table's shards


@dataclass
class PlanStats:
    topology: str
    ranks: list[RankStats]
    tables: list[TableStats]
    proposals: int  # proposals partitioned
    proposer: str  # which proposer found the kept plan
    seconds: float  # planning wall time

    @property
    def max_ms(self) -> float:
        return max(r.total_ms for r in self.ranks)

    @property
    def mean_ms(self) -> float:
        return sum(r.total_ms for r in self.ranks) / len(self.ranks)

    @property
    def imbalance(self) -> float:
        """Slowest rank over the mean: 1.0 is perfectly balanced."""
        return self.max_ms / self.mean_ms if self.mean_ms > 0 else 1.0

    RANK_COLUMNS = (
        "rank",
        "hbm_used_gb",
        "hbm_cap_gb",
        "ddr_used_gb",
        "ddr_cap_gb",
        "compute_ms",
        "comm_ms",
        "total_ms",
        "shards",
    )

    def rank_rows(self) -> tuple[list[str], list[list]]:
        """(columns, rows) for a logger table, e.g. `wandb.Table(columns=c, data=rows)`."""
        rows = [
            [
                r.rank,
                round(r.hbm_used / GB, 3),
                round(r.hbm_cap / GB, 3),
                round(r.ddr_used / GB, 3),
                round(r.ddr_cap / GB, 3),
                round(r.compute_ms, 4),
                round(r.comm_ms, 4),
                round(r.total_ms, 4),
                _shards_text(r.shards),
            ]
            for r in self.ranks
        ]
        return list(self.RANK_COLUMNS), rows

    def to_dict(self) -> dict:
        return {"topology": self.topology, "proposals": self.proposals, "proposer": self.proposer,
                "seconds": self.seconds, "max_ms": self.max_ms, "mean_ms": self.mean_ms, "imbalance": self.imbalance,
                "ranks": [asdict(r) | {"total_ms": r.total_ms} for r in self.ranks],
                "tables": [asdict(t) for t in self.tables]}

    def __str__(self) -> str:
        # memory in a unit per cell (KB of tables would read 0.00 in a GB column); on CPU no HBM columns
        with_hbm = any(r.hbm_cap > 0 or r.hbm_used > 0 for r in self.ranks)
        header = ["rank", *(["HBM used/cap"] if with_hbm else []), "DDR used/cap", "compute ms", "comm ms",
                  "total ms", "shards"]
        body = [
            [
                str(r.rank),
                *([f"{_size(r.hbm_used)}/{_size(r.hbm_cap)}"] if with_hbm else []),
                f"{_size(r.ddr_used)}/{_size(r.ddr_cap)}",
                f"{r.compute_ms:.3f}",
                f"{r.comm_ms:.3f}",
                f"{r.total_ms:.3f}",
                _shards_text(r.shards),
            ]
            for r in self.ranks
        ]
        widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
        last = len(header) - 1  # the shards column, left-aligned
        fmt = lambda cells: "  ".join(c.rjust(w) if i < last else c for i, (c, w) in enumerate(zip(cells, widths)))
        lines = [
            f"planner: {self.topology}; {len(self.tables)} tables; {self.proposals} proposals in "
            f"{self.seconds:.2f} s (kept: {self.proposer}); slowest rank {self.max_ms:.3f} ms = "
            f"{self.imbalance:.3f} x mean",
            fmt(header),
        ]
        lines += [fmt(b) for b in body]
        return "\n".join(lines)


def _shards_text(shards: dict[str, int]) -> str:
    return ", ".join(f"{k}:{v}" for k, v in sorted(shards.items())) or "-"

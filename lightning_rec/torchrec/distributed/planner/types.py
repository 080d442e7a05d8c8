"""`torchrec.distributed.planner.types`: ParameterConstraints, Topology, PlannerError."""

from lightning_rec.planner import ParameterConstraints, PlannerError, Topology

__all__ = ["ParameterConstraints", "PlannerError", "Topology"]

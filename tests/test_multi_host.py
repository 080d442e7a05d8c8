"""Two hosts of two ranks, as torchrun starts them (one `torchrun --nnodes 2 --node_rank N` per host), on 127.0.0.1:
the recipe trains, checkpoints into the directory both hosts see, and the checkpoint resumes in one process."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_utils import free_port

ROOT = Path(__file__).resolve().parents[1]
# one row-wise table (rows over all 4 ranks: both hosts), two table-row-wise (rows over one host's 2 ranks)
PLANNER = """trainer:
  strategy:
    class_path: lightning_rec.strategy.RecStrategy
    init_args:
      planner:
        class_path: lightning_rec.planner.EmbeddingShardingPlanner
        init_args:
          constraints:
            t_C1: {sharding_types: [row_wise]}
            t_C2: {sharding_types: [table_row_wise]}
            t_C3: {sharding_types: [table_row_wise]}
            t_C4: {sharding_types: [table_row_wise]}
"""


def _wait(host: subprocess.Popen, deadline: float) -> int | str:
    """The host's exit code; past the deadline it is stopped with its workers (its own process group)."""
    try:
        return host.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        os.killpg(host.pid, signal.SIGKILL)
        host.wait()
        return "timed out"


def _fit(tmp_path: Path, *extra: str) -> list[str]:
    return ["-m", "lightning_rec.cli", "fit", "--config", "recipes/configs/dlrm_synthetic.yaml", "--config",
            str(tmp_path / "planner.yaml"), f"--trainer.default_root_dir={tmp_path / 'run'}",
            "--data.num_train_samples=2048", "--data.num_val_samples=512", "--data.batch_size=128",
            "--model.num_embeddings_per_feature=64", "--data.num_embeddings_per_feature=64",
            "--trainer.val_check_interval=2", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", *extra]


@pytest.mark.slow
def test_two_hosts_of_two_ranks_train_checkpoint_and_resume_in_one_process(tmp_path):
    (tmp_path / "planner.yaml").write_text(PLANNER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    port = free_port()
    logs = [tmp_path / f"host{node}.log" for node in (0, 1)]
    outs = [log.open("w") for log in logs]
    hosts = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
         "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
         *_fit(tmp_path, "--trainer.devices=2", "--trainer.num_nodes=2", "--trainer.max_steps=4")],
        cwd=ROOT, env=env, stdout=outs[node], stderr=subprocess.STDOUT, start_new_session=True)
        for node in (0, 1)]
    deadline = time.monotonic() + 240
    codes = [_wait(host, deadline) for host in hosts]
    for out in outs:
        out.close()
    said = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n".join(f"host {i} ({c}):\n{s[-3000:]}" for i, (c, s) in enumerate(zip(codes, said)))
    out = said[0]
    # the plan spans the hosts: the row-wise table on ranks of both, each table-row-wise one on one host's two
    plan = out[out.index("lightning_rec sharding plan (4 ranks)"):].splitlines()  # a line per table
    ranks = {t: sorted({int(r) for r in re.findall(r"rank (\d+):", next(line for line in plan
                                                                          if re.match(rf"\s+{t}\s", line)))})
             for t in ("t_C1", "t_C2", "t_C3", "t_C4")}
    assert ranks["t_C1"] == [0, 1, 2, 3], ranks
    hosts_of = [{r // 2 for r in ranks[t]} for t in ("t_C2", "t_C3", "t_C4")]
    assert all(len(h) == 1 and len(ranks[t]) == 2 for h, t in zip(hosts_of, ("t_C2", "t_C3", "t_C4"))), ranks
    assert set().union(*hosts_of) == {0, 1}, ranks  # placed on both hosts
    assert "lightning_rec transport: 4 ranks on 2 host(s) of 2: " in out, out[-3000:]
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert (last / "lightning.pt").is_file()
    # the sharded checkpoint of 4 ranks on 2 hosts, resumed in one process
    one = _fit(tmp_path, "--trainer.devices=1", "--trainer.max_steps=6", "--ckpt_path=last")
    resumed = subprocess.run([sys.executable, *one], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "final validation:" in resumed.stdout and "(step 6)" in resumed.stdout, resumed.stdout[-3000:]

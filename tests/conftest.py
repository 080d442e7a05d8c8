"""Shared test fixtures: where ../shared/data lives, and quiet, offline runs."""

import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# ../shared/data beside the checkout; a copy of the checkout elsewhere (.ci/torch-range) names it
SHARED_DATA = Path(os.environ.get("LIGHTNING_REC_SHARED_DATA", REPO.parent / "shared" / "data"))

# `pytest -n W`: each worker (and the rank processes it starts) gets its share of the cores. torch's default, one
# thread per core in every worker, oversubscribed a 16-core machine 8 times under -n 8: a 20 s recipe test ran past
# 150 s there. An OMP_NUM_THREADS the caller set is kept (the 16-thread native kernel runs set it on purpose).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
# Tests and the processes they start (benchmark smokes, recipes, ranks) may ask for 2+ threads while the other
# workers keep the cores busy: GNU OpenMP's threads then spin-wait on cores another worker needs (a recipe fit of 3 s
# took 11-25 s beside a busy worker). PASSIVE: they sleep instead, with the same results. Set before torch loads
# OpenMP, which reads it once; a policy the caller set is kept.
if _WORKERS > 1:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    import torch

    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture
def shared_data() -> Path:
    """../shared/data, or skip: the licences forbid copying it into the repo."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data not found at {SHARED_DATA}")
    return SHARED_DATA


ML100K = SHARED_DATA / "movielens" / "ml-100k"
needs_ml100k = pytest.mark.skipif(not (ML100K / "u.data").is_file(), reason="shared ml-100k not present")


def fit_movielens_recipe_briefly(recipe: str, tmp_path: Path, *extra: str):
    """A MovieLens recipe as users start it (its header says how), fitted 3 steps on ml-100k: the LightningCLI."""
    from lightning_rec.cli import run_cli

    first = open(REPO / recipe).read().splitlines()
    assert first[0].startswith("# lightning-rec fit --config " + recipe) and first[1].startswith("# Hardware:")
    return run_cli(["fit", "--config", recipe, f"--data.init_args.data_dir={ML100K}", "--trainer.logger=false",
                    f"--trainer.default_root_dir={tmp_path}", "--trainer.max_epochs=1",
                    "--trainer.limit_train_batches=3", "--trainer.enable_progress_bar=false",
                    "--trainer.enable_model_summary=false", "--data.init_args.eval_test_in_fit=false", *extra])


# W&B is installed by the project's own files; a machine that lacks it (no network to install it) skips the
# tests that log to it instead of failing them.
needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="needs wandb (pip install wandb)")


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """A Trainer fit in the test process (strategy="rec" at devices=1) leaves its one-rank process group
    initialized, as Lightning's DDP strategies do; the tests after it in that process (under pytest-xdist, in any
    order) that check a path without torch.distributed would find it. Destroyed after each test.

    Lightning also leaves its rendezvous in this process's environment (MASTER_ADDR / MASTER_PORT, and LOCAL_RANK /
    WORLD_SIZE / NODE_RANK once its launcher has run): a later test's script launched with that environment took a
    port that could still be taken (EADDRINUSE), or, with LOCAL_RANK set, believed its ranks were started for it and
    waited forever for rank 1. The whole environment is put back as it was before the test."""
    before = dict(os.environ)
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key in set(os.environ) - set(before) - {"PYTEST_CURRENT_TEST"}:  # pytest's own, set per phase
        del os.environ[key]
    os.environ.update({k: v for k, v in before.items() if k != "PYTEST_CURRENT_TEST"})


# ranker_package's raw ids of feature a (large, as production ids are): the first 30 hold rows, the rest never came
RANKER_RAW_IDS = [2**40 + 7919 * k for k in range(60)]


@pytest.fixture(scope="session")
def ranker_package(tmp_path_factory):
    """The run's one compiled `.pt2` package, as `lightning-rec export CKPT OUT --tables int8 --package` writes it
    for a small multi-task ranker (click, purchase through ESMM, rating; PLE; dense inputs; feature a's raw ids
    through a managed-collision id map, RANKER_RAW_IDS[:30] admitted in training-mode passes): (model, OUT). An
    AOTInductor compile takes a minute or two on a busy 2-core machine, so the tests that need a compiled package
    (tests/test_serving_package.py, the serving benchmark's smoke) share this one; under pytest-xdist the first worker
    to ask compiles it, in the run's directory, for all."""
    import torch
    from filelock import FileLock

    from lightning_rec import checkpoint as ckpt
    from lightning_rec.cli import export_main
    from lightning_rec.models import MultiTaskModule
    from lightning_rec.sparse import KeyedJaggedTensor

    torch.manual_seed(0)  # every worker builds the same model
    model = MultiTaskModule(task_names=["click", "buy", "rating"], task_types=["binary", "binary", "regression"],
                            mix="ple", esmm=True, num_embeddings_per_feature={"a": 40, "b": 30, "c": 20},
                            embedding_dim=8, dense_in_features=4, dense_arch_layer_sizes=[8], expert_layer_sizes=[8],
                            tower_layer_sizes=[4], managed_collision={}, managed_collision_features=["a"])
    g, b = torch.Generator().manual_seed(0), 16
    with torch.no_grad():  # training-mode passes admit raw ids to a's map (evaluation admits none); no update
        for step in range(3):
            a = torch.tensor(RANKER_RAW_IDS[10 * step:10 * step + 10] * 2)[:b]  # 10 new ids a pass, a row each
            kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b", "c"], torch.cat(
                [a, torch.randint(0, 20, (2 * b,), generator=g)]), torch.ones(3 * b, dtype=torch.int64))
            model.train()(torch.randn(b, 4, generator=g), kjt)
    model.eval()
    # the workers' base directories share the run's; without xdist the parent is shared by every run: a fresh one
    shared = "PYTEST_XDIST_WORKER" in os.environ
    tmp = tmp_path_factory.getbasetemp().parent / "ranker_package" if shared else tmp_path_factory.mktemp("ranker")
    tmp.mkdir(exist_ok=True)
    with FileLock(str(tmp / "lock")):
        if not (tmp / "out" / "model.pt2").is_file():
            ckpt.save_file({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams),
                            "lightning_rec": {"module_class": "lightning_rec.models.MultiTaskModule"}},
                           tmp / "c.ckpt")
            export_main([str(tmp / "c.ckpt"), str(tmp / "out"), "--tables", "int8", "--package", "--overwrite"])
    return model, tmp / "out"

"""The recipe CLI, run for real: the default synthetic job and the Criteo recipe on real samples."""

import logging
import re
from pathlib import Path

import pytest
from conftest import needs_wandb

from lightning_rec.cli import run_cli

QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


def val(cli, name):
    return float(cli.trainer.callback_metrics[name])


def test_default_synthetic_recipe_learns(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    cli = run_cli(["fit", "--config", "recipes/configs/dlrm_synthetic.yaml",
                   f"--trainer.default_root_dir={tmp_path}", *QUIET])
    said = [r.getMessage() for r in caplog.records]
    # ("[rank: 0] Seed set to 0" once an earlier test in this process ran ranks: Lightning then names the rank)
    assert any(m.endswith("Seed set to 0") for m in said) and not [m for m in said if "litlogger" in m]  # its advert
    assert val(cli, "val_auc") > 0.7  # planted signal: a model that learns nothing sits at 0.5
    assert val(cli, "val_ne") < 1.0


def test_criteo_recipe_reaches_auc_on_real_samples(shared_data, tmp_path):
    criteo = shared_data / "criteo"
    cli = run_cli(["fit", "--config", "recipes/configs/dlrm_criteo_kaggle.yaml",
                   f"--data.init_args.train_path={criteo / 'criteo_kaggle_train_sample.tsv'}",
                   f"--data.init_args.val_path={criteo / 'criteo_kaggle_valid_sample.tsv'}",
                   f"--data.init_args.cache_dir={tmp_path / 'cache'}",
                   f"--trainer.default_root_dir={tmp_path}", *QUIET])
    assert val(cli, "val_auc") >= 0.70  # hashed logistic regression: about 0.69


def test_a_fit_without_validation_says_nothing_of_it(shared_data, tmp_path, capsys):
    import warnings

    criteo = shared_data / "criteo"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_cli(["fit", "--config", "recipes/configs/dlrm_criteo_kaggle.yaml",
                 f"--data.init_args.train_path={criteo / 'criteo_kaggle_train_sample.tsv'}", "--data.val_path=null",
                 f"--data.init_args.cache_dir={tmp_path / 'cache'}", "--trainer.max_steps=2",
                 f"--trainer.default_root_dir={tmp_path}", *QUIET])
    said = [str(w.message) for w in caught]
    assert not [m for m in said if "across ranks is zero" in m], said  # Lightning's word on the empty val list
    assert not [m for m in said if "could not find the monitored key" in m], said  # the recipe's ModelCheckpoint's
    assert "final validation" not in capsys.readouterr().out  # nor ours that none ran: there is nothing to run


def test_a_fit_whose_model_checkpoint_saved_nothing_says_so(tmp_path, capsys):
    # 1 epoch of a recipe that validates every 3 (the MovieLens recipes validate every 40): Lightning's
    # ModelCheckpoint waits for a validation that never comes, and said nothing
    args = ["fit", "--config", "recipes/configs/dlrm_synthetic.yaml", f"--trainer.default_root_dir={tmp_path}",
            "--trainer.max_epochs=1", "--trainer.check_val_every_n_epoch=3", "--trainer.limit_train_batches=4",
            "--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}", *QUIET]
    with pytest.warns(UserWarning, match=r"saved no checkpoint in this fit: it saves after validation, which runs "
                                         r"every 3 epochs here and did not run in 1 epoch\(s\). Add "
                                         r"--trainer.callbacks.save_last=true"):
        run_cli([*args, "--trainer.num_sanity_val_steps=0"])  # no sanity check either (as the MovieLens recipes)
    assert not (tmp_path / "ckpt").exists()
    # nor did it say that no validation ran, though the sanity check had read validation batches
    assert ("final validation: none ran (it runs every 3 epochs here and this fit ran 1): set "
            "--trainer.check_val_every_n_epoch") in capsys.readouterr().out
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the advice taken: a last.ckpt, and no word
        warnings.filterwarnings("ignore", message=r"(?!.*saved no checkpoint)")
        run_cli([*args, "--trainer.callbacks.save_last=true"])
    assert (tmp_path / "ckpt" / "last.ckpt").exists()



def test_a_default_model_checkpoint_that_saved_nothing_gives_advice_that_parses(tmp_path):
    # Lightning's own ModelCheckpoint (enable_checkpointing=true, no callback given): the advice
    # --trainer.callbacks.save_last=true was refused by the parser ("Option 'save_last' is not accepted")
    import warnings

    args = ["fit", "--config", "recipes/configs/dlrm_synthetic.yaml", f"--trainer.default_root_dir={tmp_path}",
            "--trainer.max_epochs=1", "--trainer.check_val_every_n_epoch=3", "--trainer.limit_train_batches=4",
            "--trainer.num_sanity_val_steps=0", "--trainer.enable_checkpointing=true", "--trainer.callbacks=[]",
            *QUIET]  # (without the recipe's ModelCheckpoint)
    with pytest.warns(UserWarning, match=r"saved no checkpoint .* Add (--trainer\.callbacks\+=ModelCheckpoint "
                                         r"--trainer\.callbacks\.save_last=true)") as caught:
        run_cli(args)
    advice = next(w for w in caught if "saved no checkpoint" in str(w.message))
    said = re.search(r"Add (\S+) (\S+) \(", str(advice.message)).groups()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*saved no checkpoint")
        run_cli([*args, *said, f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}"])
    assert (tmp_path / "ckpt" / "last.ckpt").exists()


@needs_wandb
def test_wandb_logger_offline(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    save_dir = tmp_path / "not_yet_made"  # (wandb said "git root ... does not exist" of it)
    cli = run_cli(["fit", "--config", "recipes/configs/dlrm_synthetic.yaml",
                   "--trainer.logger=lightning.pytorch.loggers.WandbLogger",
                   "--trainer.logger.offline=true", "--trainer.logger.project=lightning_rec_test",
                   f"--trainer.logger.save_dir={save_dir}",
                   "--trainer.max_steps=8", "--trainer.limit_val_batches=2",
                   "--trainer.val_check_interval=4", f"--trainer.default_root_dir={tmp_path}", *QUIET])
    assert "val_auc" in cli.trainer.callback_metrics
    (run,) = save_dir.glob("wandb/offline-run-*")
    said = capfd.readouterr()
    # W&B's two warnings at every start, and metrics.csv beside its files, the curves in its run too
    assert "anonymous setting has no effect" not in said.err + said.out and "git root" not in said.err + said.out
    assert (save_dir / "lightning_logs" / "version_0" / "metrics.csv").is_file()
    assert f"W&B: {run} (upload: wandb sync {run})" in said.out, said.out
    assert list(run.glob("files/media/images/learning_curves*.png")), sorted(run.rglob("*"))


def test_unknown_model_argument_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_cli(["fit", "--config", "recipes/configs/dlrm_synthetic.yaml", "--model.init_args.no_such_arg=1"])
    assert "no_such_arg" in capsys.readouterr().err


@pytest.mark.parametrize("wrong, meant", [
    (["--trainer.max_epocs=1"], "did you mean --trainer.max_epochs instead of --trainer.max_epocs?"),
    (["--model.init_args.embeding_dim=8"],
     "did you mean embedding_dim (an argument of lightning_rec.models.DLRMModule) instead of embeding_dim?"),
    (["--data.init_args.batch_sise=8"],
     "did you mean batch_size (an argument of lightning_rec.data.SyntheticCriteoDataModule) instead of batch_sise?"),
    ("config", "did you mean trainer.max_epochs instead of trainer.max_epocs?"),
    (["--model.class_path=lightning_rec.models.DLRMModul"],
     "did you mean lightning_rec.models.DLRMModule instead of DLRMModul?"),
    (["--model=DLRMModul"], "did you mean DLRMModule instead of DLRMModul?"),
    (["--data=SyntheticCriteoDataModul"],
     "did you mean SyntheticCriteoDataModule instead of SyntheticCriteoDataModul?"),
    (["--trainer.strategy=recc"], "--trainer.strategy=recc is not a strategy name: did you mean rec?"),
    (["--trainer.strategy=rec", "--trainer.strategy.pipeline=true"],
     "--trainer.strategy=RecStrategy --trainer.strategy.pipeline=... (the short name 'rec' takes none)"),
])
def test_a_misspelt_option_names_the_one_meant(tmp_path, capsys, wrong, meant):
    if wrong == "config":  # the same misspelling as a key of the recipe file
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(Path("recipes/configs/dlrm_synthetic.yaml").read_text().replace("max_epochs:", "max_epocs:"))
        wrong = ["--config", str(recipe)]
    with pytest.raises(SystemExit) as e:  # (a strategy name is refused after parsing: one line, SystemExit's)
        run_cli(["fit", "--config", "recipes/configs/dlrm_synthetic.yaml", *wrong])
    assert meant in capsys.readouterr().err + str(e.value)


def test_a_misspelt_command_names_every_command_and_errors_are_short(capsys):
    with pytest.raises(SystemExit):
        run_cli(["exprt"])
    err = capsys.readouterr().err
    assert "did you mean export instead of exprt?" in err and "preprocess" in err
    with pytest.raises(SystemExit):
        run_cli(["fit", "--config", "recipes/configs/dlrm_synthetic.yaml", "--trainer.max_epocs=1"])
    err = capsys.readouterr().err
    # the usage line, --help's tip, the error and the guess: not fit's 50-line option list before them
    assert len(err.splitlines()) <= 5 and "fit --help" in err, err
    with pytest.raises(SystemExit):
        run_cli(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the description
    assert "lightning-rec preprocess --help" in out and "lightning-rec export --help" in out


@pytest.mark.parametrize("recipe, wrong, said", [
    ("dlrm_synthetic", "--model.sparse_optimizer=rowwise_adagard",
     "unknown fused optimizer 'rowwise_adagard': choose one of"),
    ("dlrm_synthetic", "--data.batch_size=0", "SyntheticCriteoDataModule batch_size=0: give a positive number"),
    # a missing folder is found in the constructor, on every rank before any process group: found in
    # prepare_data (local rank 0 only), it left rank 1's gloo "Connection closed by peer" traceback last on screen
    # (this recipe logs to W&B: without wandb installed the logger's requirement is the first refusal)
    pytest.param("two_tower_movielens", "--data.data_dir=/no/such/ml-100k",
                 "MovieLens data_dir /no/such/ml-100k is not a folder", marks=needs_wandb),
])
def test_a_constructor_refusal_is_one_line(recipe, wrong, said):
    with pytest.raises(SystemExit) as e:  # (jsonargparse wrapped it in two tracebacks and its Union report)
        run_cli(["fit", "--config", f"recipes/configs/{recipe}.yaml", wrong])
    assert str(e.value).startswith("lightning-rec: error: ") and said in str(e.value), e.value


@pytest.mark.parametrize("command, wrong", [("fit", "--data.train_path=/no/such/train.txt"),
                                            ("predict", "--data.predict_path=/no/such/train.txt")])
def test_a_missing_criteo_file_is_one_line_before_the_trainer_starts(command, wrong):
    # found in prepare_data (local rank 0 only), it left rank 1's gloo "Connection closed by peer" traceback last
    # on the screen at 2 ranks; only the stage's own files are checked (predict needs no training file)
    with pytest.raises(SystemExit) as e:
        run_cli([command, "--config", "recipes/configs/dlrm_criteo_kaggle.yaml", "--trainer.devices=2",
                 "--trainer.strategy=rec", "--data.val_path=/no/such/valid.txt", wrong])
    split = wrong.split(".")[1].split("=")[0]
    assert str(e.value) == (f"lightning-rec {command}: error: CriteoDataModule {split} /no/such/train.txt does not "
                            f"exist: check the path (--data.{split} on the command line)"), e.value


def test_a_bad_row_found_while_training_is_one_line(shared_data, tmp_path, monkeypatch):
    """A malformed row of the training file (found when the cache is built) ended `lightning-rec fit` in a 45-line
    traceback; predict said the same error in one line. Every Trainer command now does."""
    import sys

    from lightning_rec.cli import main

    rows = (shared_data / "criteo" / "criteo_kaggle_train_sample.tsv").read_text().splitlines(keepends=True)[:40]
    bad = tmp_path / "train.tsv"
    bad.write_text("".join(rows[:2]) + "7" + rows[2][1:] + "".join(rows[3:]))
    monkeypatch.setattr(sys, "argv", ["lightning-rec", "fit", "--config", "recipes/configs/dlrm_criteo_kaggle.yaml",
                                      f"--data.train_path={bad}", f"--data.cache_dir={tmp_path / 'cache'}",
                                      f"--trainer.default_root_dir={tmp_path}", *QUIET])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == (f"lightning-rec fit: error: {bad}:3: label must be 0 or 1, got '7'. Fix the file, or pass "
                            f"on_bad_row='skip' to drop such rows (they are counted and logged, never shifted)")


def test_an_option_like_no_other_gets_no_guess(capsys):
    with pytest.raises(SystemExit):
        run_cli(["fit", "--config", "recipes/configs/dlrm_synthetic.yaml", "--zzzz=1"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zzzz=1" in err and "did you mean" not in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_gpu_accelerator_without_cuda_says_what_is_missing(tmp_path):
    with pytest.raises(SystemExit) as e:
        run_cli(["fit", "--config", "recipes/configs/dlrm_synthetic.yaml", "--trainer.accelerator=gpu",
                 f"--trainer.default_root_dir={tmp_path}"])
    text = str(e.value)
    # CI's CPU build of torch, or a CUDA build on a machine with no GPU visible
    missing = "CPU build" if __import__("torch").version.cuda is None else "finds no CUDA device"
    assert "needs a CUDA GPU" in text and missing in text and "--trainer.accelerator=cpu" in text, text


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_a_gpu_recipe_without_cuda_says_so_before_building_its_tables(tmp_path):
    # the 1TB recipe's tables (26 x 40M x 128) do not fit a CPU's memory: the missing GPU is the news, not that
    with pytest.raises(SystemExit) as e:
        run_cli(["fit", "--config", "recipes/configs/dlrm_criteo_1tb.yaml", f"--trainer.default_root_dir={tmp_path}"])
    text = str(e.value)
    assert "needs a CUDA GPU" in text and "--trainer.accelerator=cpu" in text and "memory" not in text, text


@needs_wandb
@pytest.mark.parametrize("recipe", ["two_tower_movielens", "matrix_factorization_movielens"])
def test_recipe_logger_leaves_wandb_mode_to_the_user(recipe, monkeypatch, capsys):
    """The CLI makes W&B offline by default; WANDB_MODE=online (the README's way to upload) must win."""
    import os

    import yaml
    from lightning.pytorch.loggers import WandbLogger

    logger = yaml.safe_load(Path(f"recipes/configs/{recipe}.yaml").read_text())["trainer"]["logger"]
    assert logger["class_path"].endswith("WandbLogger")
    # WandbLogger(offline=True) sets WANDB_MODE=dryrun when its run starts, over the user's WANDB_MODE=online
    # (a run cannot start here: no network); the CLI's default is WANDB_MODE=offline when the user sets none
    assert not WandbLogger(**logger["init_args"])._offline
    monkeypatch.delenv("WANDB_MODE")
    with pytest.raises(SystemExit):  # (--print_config: parse, print, exit)
        run_cli(["fit", "--config", f"recipes/configs/{recipe}.yaml", "--print_config"])
    assert os.environ["WANDB_MODE"] == "offline"


def test_sharded_checkpoint_without_rec_names_the_strategy(tmp_path):
    # the directory strategy=rec writes (lightning.pt beside the DCP shards); Lightning's own strategies
    # would torch.load() it and fail with "IsADirectoryError: [Errno 21] Is a directory"
    sharded = tmp_path / "epoch=0-step=8.ckpt"
    sharded.mkdir()
    (sharded / "lightning.pt").write_bytes(b"")
    with pytest.raises(SystemExit) as e:
        run_cli(["fit", "--config", "recipes/configs/dlrm_synthetic.yaml", f"--ckpt_path={sharded}",
                 "--trainer.strategy=ddp", f"--trainer.default_root_dir={tmp_path}", *QUIET])
    assert "is a sharded checkpoint" in str(e.value) and "--trainer.strategy=ddp cannot resume from" in str(e.value) \
        and "--trainer.strategy=rec" in str(e.value), e.value


def test_data_and_model_table_sizes_are_compared_before_training(tmp_path):
    args = ["fit", "--config", "recipes/configs/dlrm_synthetic.yaml", "--trainer.max_steps=1",
            "--trainer.limit_val_batches=1", f"--trainer.default_root_dir={tmp_path}", *QUIET]
    # tables larger than the data's id range: fine (Lightning refused the two differing hparams when logging)
    cli = run_cli([*args, "--data.num_embeddings_per_feature=500"])
    assert cli.trainer.global_step == 1
    with pytest.raises(ValueError, match=r"feature C1's ids from 2000 values but the model's table for it has 1000"):
        run_cli([*args, "--data.num_embeddings_per_feature=2000"])


def test_an_added_model_checkpoint_is_the_ask_for_checkpoints(tmp_path):
    # every recipe says enable_checkpointing: false; the README's way to ask for checkpoints on the command line
    # (adding a ModelCheckpoint) was refused by Lightning with a MisconfigurationException traceback
    run_cli(["fit", "--config", "recipes/configs/dlrm_synthetic.yaml", f"--trainer.default_root_dir={tmp_path}",
             "--data.init_args.num_train_samples=1024", "--trainer.max_epochs=1", "--trainer.limit_val_batches=1",
             "--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={tmp_path / 'ck'}",
             "--trainer.callbacks.save_last=true", *QUIET])
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]


@needs_wandb
def test_a_recipes_wandb_logs_go_under_the_runs_root_dir(tmp_path):
    # the recipes named a save_dir of their own: --trainer.default_root_dir moved checkpoints and predictions but
    # left W&B's files (and Lightning's checkpoints under a logger) in ./runs/<recipe>
    if not Path("../shared/data/movielens/ml-100k").is_dir():
        pytest.skip("needs ../shared/data/movielens/ml-100k")
    cli = run_cli(["validate", "--config", "recipes/configs/matrix_factorization_movielens.yaml",
                   f"--trainer.default_root_dir={tmp_path}", "--trainer.limit_val_batches=1"])
    assert Path(cli.trainer.logger.save_dir) == tmp_path  # (a run another test left open keeps its own files)


def test_a_wandb_recipe_without_wandb_installed_says_how_to_run_without_it(monkeypatch):
    # Lightning's "Requirement 'wandb>=0.12.10' not met" named pip only: the MovieLens recipes log to W&B
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # what an environment without wandb finds
    with pytest.raises(SystemExit) as e:
        run_cli(["fit", "--config", "recipes/configs/matrix_factorization_movielens.yaml"])
    said = str(e.value)
    assert "wandb is not installed" in said and "pip install wandb" in said and "--trainer.logger=false" in said, said


def test_the_loggers_get_the_runs_seed_and_trainer_settings(tmp_path):
    # they got the model's and the data's hyperparameters only: a W&B run could not say its seed, epochs, devices,
    # strategy or precision (the config.yaml beside the run is not part of it)
    import yaml

    run_cli(["fit", "--config", "recipes/configs/dlrm_synthetic.yaml", "--seed_everything=7",
             "--trainer.logger=CSVLogger", f"--trainer.logger.save_dir={tmp_path}", "--trainer.max_steps=2",
             "--trainer.limit_val_batches=1", f"--trainer.default_root_dir={tmp_path}", *QUIET])
    (hparams,) = tmp_path.glob("lightning_logs/version_*/hparams.yaml")
    logged = yaml.safe_load(hparams.read_text())
    assert logged["seed_everything"] == 7 and logged["trainer"]["max_steps"] == 2, logged
    assert logged["trainer"]["accelerator"] == "cpu" and "embedding_dim" in logged  # and the model's, as before


@pytest.mark.parametrize("optimizer", [[], ["--optimizer=SGD", "--optimizer.lr=0.3"]])
def test_cli_optimizer_and_lr_scheduler_drive_the_fused_tables_and_the_dense_layers(tmp_path, optimizer):
    # --lr_scheduler without --optimizer did nothing, silently; --optimizer replaced DLRMModule's combined optimizer
    # with one over model.parameters(): the tables' rate never followed the scheduler (nor their state the checkpoint)
    cli = run_cli(["fit", "--config", "recipes/configs/dlrm_synthetic.yaml", f"--trainer.default_root_dir={tmp_path}",
                   "--data.init_args.num_train_samples=1024", "--trainer.max_epochs=2",
                   "--trainer.limit_train_batches=1", "--trainer.limit_val_batches=0", *optimizer,
                   "--lr_scheduler=StepLR", "--lr_scheduler.step_size=1", "--lr_scheduler.gamma=0.5", *QUIET])
    parts = dict(cli.trainer.optimizers[0].optimizers)
    dense_class, dense_lr = ("SGD", 0.3) if optimizer else ("Adagrad", 0.02)  # the recipe's dense_optimizer, dense_lr
    assert type(parts["dense"]).__name__ == dense_class
    assert parts["dense"].param_groups[0]["lr"] == pytest.approx(dense_lr * 0.25)  # two epochs' StepLR
    assert parts["fused"].param_groups[0]["lr"] == pytest.approx(0.05 * 0.25)  # the recipe's sparse_lr


def test_cli_lr_scheduler_with_the_modules_warmup_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"--lr_scheduler=StepLR .* --model.warmup_steps=0"):
        run_cli(["fit", "--config", "recipes/configs/dlrm_synthetic.yaml", f"--trainer.default_root_dir={tmp_path}",
                 "--trainer.max_steps=1", "--trainer.limit_val_batches=0", "--model.warmup_steps=10",
                 "--lr_scheduler=StepLR", "--lr_scheduler.step_size=1", *QUIET])


def test_cli_one_cycle_lr_names_cycle_momentum_false(tmp_path):
    # OneCycleLR's default cycle_momentum=True said only torch's "optimizer must support momentum or beta1 with
    # `cycle_momentum` option enabled", naming neither the combined optimizer nor the flag that fixes it
    args = ["fit", "--config", "recipes/configs/dlrm_synthetic.yaml", f"--trainer.default_root_dir={tmp_path}",
            "--trainer.max_steps=1", "--trainer.limit_val_batches=0", "--model.warmup_steps=0",
            "--lr_scheduler=OneCycleLR", "--lr_scheduler.max_lr=0.1", "--lr_scheduler.total_steps=10", *QUIET]
    with pytest.raises(ValueError, match=r"--lr_scheduler=OneCycleLR cycles the momentum .* "
                                         r"add --lr_scheduler.cycle_momentum=false") as caught:
        run_cli(args)
    assert "OneCycleLR(..., cycle_momentum=False)" not in str(caught.value)  # the flag, not the Python argument
    run_cli([*args, "--lr_scheduler.cycle_momentum=false"])  # the fix


def test_the_1tb_recipe_draws_its_tables_where_their_shards_live():
    # embedding_device was left at "cpu": the recipe's 26 x 40M x 128 tables (532 GB) were drawn in host memory
    # before strategy=rec sharded them onto the GPUs (an OOM on any host with less)
    import yaml

    config = yaml.safe_load(Path("recipes/configs/dlrm_criteo_1tb.yaml").read_text())
    assert config["trainer"]["strategy"] == "rec"  # "meta" needs it: the strategy draws each shard
    assert config["model"]["init_args"]["embedding_device"] == "meta"


def test_a_sharded_checkpoint_rebuilds_the_model_with_its_own_hyperparameters(tmp_path, capsys):
    # Lightning reads --ckpt_path's hyperparameters from a file only: a strategy=rec checkpoint (a directory) built
    # the model from the recipe instead, and a fit with --model.embedding_dim=8 then failed to predict on the shapes
    args = ["--config", "recipes/configs/dlrm_synthetic.yaml", f"--trainer.default_root_dir={tmp_path}",
            "--trainer.strategy=rec", "--data.init_args.num_train_samples=256", "--data.init_args.num_val_samples=0",
            "--data.init_args.num_test_samples=32", "--trainer.logger=false", *QUIET]
    run_cli(["fit", *args, "--trainer.max_steps=1", "--model.init_args.embedding_dim=8",
             "--model.init_args.dense_arch_layer_sizes=[16,8]", "--trainer.callbacks+=ModelCheckpoint",
             f"--trainer.callbacks.dirpath={tmp_path / 'ck'}", "--trainer.callbacks.filename=last"])
    assert (tmp_path / "ck" / "last.ckpt" / "lightning.pt").is_file()  # the sharded format
    with pytest.warns(UserWarning, match=r"--model.embedding_dim=4 is not used: --ckpt_path rebuilds the model "
                                         r"with the checkpoint's own hyperparameters \(embedding_dim=8\)"):
        cli = run_cli(["predict", *args, f"--ckpt_path={tmp_path / 'ck' / 'last.ckpt'}",
                       "--model.init_args.embedding_dim=4"])
    assert cli.model.hparams.embedding_dim == 8 and cli.model.hparams.dense_arch_layer_sizes == [16, 8]
    assert f"predictions: 32 rows written to {tmp_path / 'predictions.csv'}" in capsys.readouterr().out


def test_a_checkpoint_of_another_model_is_refused_naming_both_before_anything_is_built(tmp_path):
    # predict with the two-tower recipe and a DLRM fit's checkpoint rebuilt the model as DLRMModule (the
    # checkpoint's class wins) and failed inside predict_step: 'RankingBatch' object has no attribute 'dense_features'
    run_cli(["fit", "--config", "recipes/configs/dlrm_synthetic.yaml", f"--trainer.default_root_dir={tmp_path}",
             "--data.init_args.num_train_samples=64", "--data.init_args.num_val_samples=0", "--trainer.logger=false",
             "--trainer.max_steps=1", "--trainer.callbacks+=ModelCheckpoint",
             f"--trainer.callbacks.dirpath={tmp_path / 'ck'}", "--trainer.callbacks.filename=last", *QUIET])
    checkpoint = tmp_path / "ck" / "last.ckpt"
    with pytest.raises(SystemExit) as refused:
        run_cli(["predict", "--config", "recipes/configs/two_tower_movielens.yaml", "--trainer.logger=false",
                 f"--data.data_dir={tmp_path / 'no_such_ml-100k'}", f"--ckpt_path={checkpoint}"])
    assert str(refused.value) == (
        f"lightning-rec predict: error: --ckpt_path {checkpoint} holds a DLRMModule (lightning_rec.models.DLRMModule), "
        f"but the recipe builds a TwoTowerModule on MovieLensDataModule: give the recipe (--config) that trained the "
        f"checkpoint, or a checkpoint of a TwoTowerModule fit")


def test_short_class_names_of_the_library_resolve_in_a_fresh_process():
    # `--model=DLRMModule` (LightningCLI's short form) failed in a fresh `lightning-rec` with "DLRMModule either not
    # accessible or invalid", and the hint said "did you mean DLRMModule instead of DLRMModule?" (in this pytest process
    # an earlier import of lightning_rec.models made it resolve, hence the subprocess)
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "lightning_rec.cli", "fit", "--model=DLRMModule",
                           "--data=SyntheticCriteoDataModule", "--print_config"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"class_path: lightning_rec\.(models\.)?DLRMModule\n", done.stdout), done.stdout
    assert re.search(r"class_path: lightning_rec\.(data\.)?SyntheticCriteoDataModule\n", done.stdout), done.stdout


def test_a_logger_without_its_save_dir_says_which_option_to_add(capsys):
    # --trainer.logger=CSVLogger (the way off W&B that the wandb-missing error names): jsonargparse's 13-line Union
    # report ended in "the following arguments are required: save_dir", naming neither the option nor a folder
    with pytest.raises(SystemExit):
        run_cli(["fit", "--config", "recipes/configs/dlrm_synthetic.yaml", "--trainer.logger=CSVLogger"])
    assert ("CSVLogger needs save_dir: add --trainer.logger.save_dir=... (a folder: the run's is "
            "--trainer.default_root_dir)") in capsys.readouterr().err


def test_a_misspelt_planner_constraint_in_a_recipe_names_the_field(tmp_path, capsys):
    # RecStrategy's planner was typed Any: jsonargparse, refusing the class_path's init_args, handed the dict on, and
    # the fit failed in setup with "AttributeError: 'dict' object has no attribute 'collective_plan'"
    recipe = tmp_path / "planner.yaml"
    recipe.write_text("trainer:\n  strategy:\n    class_path: lightning_rec.strategy.RecStrategy\n    init_args:\n"
                      "      planner:\n        class_path: lightning_rec.planner.EmbeddingShardingPlanner\n"
                      "        init_args:\n          constraints:\n            t_C1: {sharding_type: [row_wise]}\n")
    with pytest.raises(SystemExit):
        run_cli(["fit", "--config", "recipes/configs/dlrm_synthetic.yaml", "--config", str(recipe),
                 "--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path}", *QUIET])
    assert "did you mean sharding_types (an argument of lightning_rec.ParameterConstraints) instead of sharding_type?" \
        in capsys.readouterr().err


@pytest.mark.parametrize("wrong, said", [
    ("--trainer.strategy.dense=ddpp", "RecStrategy(dense='ddpp'): use 'ddp' or 'fsdp'"),
    ("--trainer.strategy.pipeline=0", "PipelineConfig(depth=0): use depth >= 1"),
])
def test_a_strategy_refusal_is_its_own_sentence(wrong, said):
    # the strategy's Union (a name or a Strategy) chains jsonargparse's "Expected a <class 'str'>": that, and the
    # Namespace it was given, was the whole message, without the strategy's own sentence
    with pytest.raises(SystemExit) as e:
        run_cli(["fit", "--config", "recipes/configs/dlrm_synthetic.yaml", "--trainer.strategy=RecStrategy", wrong,
                 "--trainer.max_steps=1"])
    assert str(e.value).startswith(f"lightning-rec: error: {said}"), e.value


def test_an_option_before_the_config_that_sets_it_is_said(capsys):
    # arguments apply in order: `fit --trainer.max_epochs=1 --config recipe.yaml` trained the recipe's 2 epochs
    import warnings

    recipe = "recipes/configs/dlrm_synthetic.yaml"
    with pytest.warns(UserWarning, match=r"--trainer.max_epochs comes before --config recipes/configs/dlrm_synthetic"
                                         r".yaml, which sets trainer.max_epochs again.*Put --trainer.max_epochs after"):
        with pytest.raises(SystemExit):
            run_cli(["fit", "--trainer.max_epochs=1", "--trainer.max_steps=3", "--config", recipe, "--print_config"])
    assert "max_epochs: 2" in capsys.readouterr().out  # the file's value: what the warning says
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # after --config, or a key the file does not set: nothing to say
        warnings.filterwarnings("ignore", message=r"(?!.*comes before --config)")
        with pytest.raises(SystemExit):
            run_cli(["fit", "--trainer.max_steps=3", "--config", recipe, "--trainer.max_epochs=1", "--print_config"])


@pytest.mark.parametrize("args, said", [
    ([], "(the commands are fit, validate, test, predict, preprocess and export), e.g. lightning-rec fit --config "
         "recipes/configs/dlrm_synthetic.yaml"),
    (["validate"], "a recipe gives both: lightning-rec validate --config recipes/configs/dlrm_synthetic.yaml"),
    (["fit", "--config", "recipes/configs/dlrm_synthetic"], "did you mean recipes/configs/dlrm_synthetic.yaml?"),
])
def test_a_first_command_without_a_recipe_names_one(capsys, args, said):
    # `lightning-rec` alone named only LightningCLI's four commands; `lightning-rec validate` said "the following
    # arguments are required: validate.data, validate.model"; a recipe without its .yaml, only that it did not exist
    with pytest.raises(SystemExit):
        run_cli(args)
    assert said in capsys.readouterr().err


def test_evaluating_without_a_checkpoint_says_the_model_is_untrained(tmp_path):
    # each command builds the model anew: `predict` without --ckpt_path wrote a file of an untrained model's
    # probabilities, and `validate` its metrics, without a word
    with pytest.warns(UserWarning, match=r"lightning-rec validate without --ckpt_path evaluates with the model as the "
                                         r"recipe builds it, untrained: pass --ckpt_path=CHECKPOINT"):
        run_cli(["validate", "--config", "recipes/configs/dlrm_synthetic.yaml", "--data.num_val_samples=512",
                 "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}", *QUIET])


@pytest.mark.parametrize("strategy", ["auto", "rec"])
def test_ckpt_path_last_rebuilds_the_model_with_the_checkpoints_hyperparameters(tmp_path, strategy):
    # --ckpt_path=last (the README's resume) was not read for hyperparameters, as a path is: a fit with
    # --model.embedding_dim=8, validated with the recipe's 16, failed on every table's shape
    args = ["--config", "recipes/configs/dlrm_synthetic.yaml", f"--trainer.strategy={strategy}",
            "--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}",
            "--trainer.callbacks.save_last=true", "--data.num_train_samples=1024", "--data.num_val_samples=512",
            "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}", *QUIET]
    fit = run_cli(["fit", *args, "--trainer.max_epochs=1", "--model.embedding_dim=8",
                   "--model.dense_arch_layer_sizes=[64, 8]"])
    cli = run_cli(["validate", *args, "--ckpt_path=last"])
    assert cli.model.hparams.embedding_dim == 8
    assert val(cli, "val_auc") == val(fit, "val_auc")


def test_ckpt_path_last_with_nothing_saved_yet(tmp_path, caplog):
    # validate --ckpt_path=last before any fit saved one: Lightning warned, then scored the model as built, untrained;
    # the first fit of the README's resumable command was told "HINT: Set `ModelCheckpoint(..., save_last=True)`",
    # which the command sets
    import warnings

    caplog.set_level(logging.INFO)
    args = ["--config", "recipes/configs/dlrm_synthetic.yaml", "--trainer.callbacks+=ModelCheckpoint",
            f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}", "--trainer.callbacks.save_last=true",
            "--ckpt_path=last", "--data.num_train_samples=1024", "--data.num_val_samples=512", "--trainer.logger=false",
            f"--trainer.default_root_dir={tmp_path}", *QUIET]
    with pytest.raises(SystemExit) as e:
        run_cli(["validate", *args])
    said = str(e.value)  # (in the recipe's checkpoints folder, or in the one added)
    assert "--ckpt_path=last found no last checkpoint (last*.ckpt) in " in said and str(tmp_path / "ckpt") in said, said
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_cli(["fit", *args, "--trainer.max_epochs=1"])
    assert not [w for w in caught if "HINT: Set `ModelCheckpoint" in str(w.message)]
    assert any("this fit starts from the beginning" in r.getMessage() for r in caplog.records)
    assert (tmp_path / "ckpt" / "last.ckpt").exists()


def test_ckpt_path_best_in_a_new_command_names_the_saved_checkpoints(tmp_path):
    # Lightning said "`ModelCheckpoint` is not configured to save the best model": a new process knows no best model
    saved = tmp_path / "ckpt" / "epoch=0-step=8.ckpt"
    saved.parent.mkdir()
    saved.write_bytes(b"")
    with pytest.raises(SystemExit) as e:
        run_cli(["validate", "--config", "recipes/configs/dlrm_synthetic.yaml", "--trainer.callbacks+=ModelCheckpoint",
                 f"--trainer.callbacks.dirpath={saved.parent}", "--ckpt_path=best", "--trainer.logger=false",
                 f"--trainer.default_root_dir={tmp_path}", *QUIET])
    assert "each lightning-rec command starts a new one: give the checkpoint's path, --ckpt_path=CHECKPOINT " \
           f"({saved})" in str(e.value), e.value


def test_a_sharded_checkpoint_picks_the_rec_strategy_itself(tmp_path, caplog):
    # validate / test / predict --ckpt_path=<a strategy=rec checkpoint> under the recipe's strategy (auto) was
    # refused until --trainer.strategy=rec was added: the checkpoint says what loads it, and the run says so
    caplog.set_level(logging.INFO)
    args = ["--config", "recipes/configs/dlrm_synthetic.yaml", f"--trainer.default_root_dir={tmp_path}",
            "--data.num_train_samples=1024", "--data.num_val_samples=512", "--trainer.logger=false", *QUIET]
    fit = run_cli(["fit", *args, "--trainer.strategy=rec", "--trainer.max_epochs=1",
                   "--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={tmp_path / 'ck'}",
                   "--trainer.callbacks.filename=last"])
    sharded = tmp_path / "ck" / "last.ckpt"
    assert (sharded / "lightning.pt").is_file()
    cli = run_cli(["validate", *args, f"--ckpt_path={sharded}"])
    assert type(cli.trainer.strategy).__name__ == "RecStrategy"
    assert val(cli, "val_auc") == val(fit, "val_auc")
    assert any(f"{sharded} is a sharded checkpoint: loading it with --trainer.strategy=rec" in r.getMessage()
               for r in caplog.records)
    # the class, without options, is a strategy too (Lightning refused "recstrategy is not a strategy name")
    cli = run_cli(["validate", *args, f"--ckpt_path={sharded}", "--trainer.strategy=RecStrategy"])
    assert type(cli.trainer.strategy).__name__ == "RecStrategy" and val(cli, "val_auc") == val(fit, "val_auc")
    # a strategy the user names is kept: the library's modules read the tables whole under it to evaluate
    cli = run_cli(["validate", *args, f"--ckpt_path={sharded}", "--trainer.strategy=ddp"])
    assert type(cli.trainer.strategy).__name__ == "DDPStrategy" and val(cli, "val_auc") == val(fit, "val_auc")


def test_a_planner_constraints_refusal_is_its_own_sentence(tmp_path):
    # the constraint's sentence sits three Unions down (strategy, planner, constraints): the whole 20-line
    # jsonargparse report was shown, the sentence on line 10 of it
    config = tmp_path / "planner.yaml"
    config.write_text("trainer:\n  strategy:\n    class_path: lightning_rec.strategy.RecStrategy\n    init_args:\n"
                      "      planner:\n        class_path: lightning_rec.planner.EmbeddingShardingPlanner\n"
                      "        init_args:\n          constraints: {t_C1: {sharding_types: [row_wize]}}\n")
    with pytest.raises(SystemExit) as e:
        run_cli(["fit", "--config", "recipes/configs/dlrm_synthetic.yaml", "--config", str(config),
                 "--trainer.max_steps=1"])
    assert str(e.value).startswith("lightning-rec: error: ParameterConstraints: unknown sharding type 'row_wize' "
                                   "(did you mean 'row_wise'?)"), e.value


@pytest.mark.parametrize("wrong, said", [
    ("--trainer.devices=two", "--trainer.devices=two: `devices` selected with `CPUAccelerator` should be an int > 0"),
    ("--trainer.max_epochs=-5", "--trainer.max_epochs=-5: `max_epochs` must be a non-negative integer or -1"),
])
def test_a_trainer_option_lightning_refuses_is_one_line(wrong, said):
    # Lightning's refusal (a MisconfigurationException, or a TypeError from its device parsing) came after a
    # 40-line traceback
    with pytest.raises(SystemExit) as e:
        run_cli(["fit", "--config", "recipes/configs/dlrm_synthetic.yaml", wrong, *QUIET])
    assert str(e.value).startswith(f"lightning-rec: error: {said}"), e.value


def test_preprocess_and_export_name_the_option_meant(tmp_path, capsys):
    # their argparse parsers said "unrecognized arguments: --num_embedings 10" alone; and export's two spellings of
    # one option made its prefix `--fp16` "ambiguous option: --fp16 could match --fp16-tables, --fp16_tables"
    from lightning_rec.cli import export_main, preprocess_main

    with pytest.raises(SystemExit):
        preprocess_main(["--input", "x.tsv", "--output_dir", str(tmp_path / "out"), "--num_embedings", "10"])
    assert "did you mean --num_embeddings instead of --num_embedings?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        export_main([str(tmp_path / "ckpt"), str(tmp_path / "out"), "--fp16-tabels"])
    assert "did you mean --fp16-tables instead of --fp16-tabels?" in capsys.readouterr().err
    for spelling in ("--fp16", "--fp16_tables"):  # parsed: the refusal is the missing checkpoint's
        with pytest.raises(SystemExit):
            export_main([str(tmp_path / "ckpt"), str(tmp_path / "out"), spelling])
        said = capsys.readouterr().err
        assert "ambiguous" not in said and "does not exist" in said, said


@pytest.mark.parametrize("inside", ["", "export"])
def test_export_into_its_own_checkpoint_is_refused_before_writing(tmp_path, capsys, inside):
    # `lightning-rec export CKPT CKPT` wrote model.safetensors and config.json into the checkpoint, which resume,
    # load_model and load_from_checkpoint then refused as "an export directory"
    import shutil

    from lightning_rec.cli import export_main

    checkpoint = tmp_path / "last.ckpt"
    shutil.copytree(Path(__file__).parent / "fixtures" / "tiny.ckpt", checkpoint)
    before = sorted(p.relative_to(checkpoint) for p in checkpoint.rglob("*"))
    with pytest.raises(SystemExit) as refused:
        export_main([str(checkpoint), str(checkpoint / inside)])
    said = capsys.readouterr().err
    assert refused.value.code == 2 and f"output {checkpoint / inside} is the checkpoint {checkpoint} or inside " \
        f"it" in said and f"outside it, e.g. {tmp_path / 'export'}" in said, said
    assert sorted(p.relative_to(checkpoint) for p in checkpoint.rglob("*")) == before


def test_fused_tables_at_two_devices_under_auto_pick_the_rec_strategy(caplog):
    # `fit --config dlrm_synthetic.yaml --trainer.devices=2` (the recipe's strategy is auto): Lightning picked DDP and
    # each rank refused it, "use --trainer.strategy=rec"; auto now means rec for fused tables at 2+ ranks. (The run
    # stops at the missing data file, after the Trainer is built and before the ranks start.)
    caplog.set_level(logging.INFO)
    with pytest.raises(SystemExit) as e:
        run_cli(["fit", "--config", "recipes/configs/dlrm_criteo_kaggle.yaml", "--trainer.devices=2",
                 "--data.train_path=/no/such/train.txt"])
    assert "CriteoDataModule train_path /no/such/train.txt does not exist" in str(e.value), e.value
    assert any("DLRMModule trains its tables with a fused optimizer, which only --trainer.strategy=rec keeps in step "
               "over 2 processes: using it" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("wrong, said", [
    ("--trainer.logger=wandb", "did you mean WandbLogger (--trainer.logger=WandbLogger) instead of wandb?"),
    ("--trainer.logger=CSVLoger", "did you mean CSVLogger (--trainer.logger=CSVLogger) instead of CSVLoger?"),
    ("--trainer.callbacks+=ModelCheckpiont",
     "did you mean ModelCheckpoint (--trainer.callbacks+=ModelCheckpoint) instead of ModelCheckpiont?"),
    ("--optimizer=adamw", "did you mean AdamW (--optimizer=AdamW) instead of adamw?"),
    ("--lr_scheduler=CosineAnealingLR",
     "did you mean CosineAnnealingLR (--lr_scheduler=CosineAnnealingLR) instead of CosineAnealingLR?"),
])
def test_a_misspelt_logger_or_callback_class_names_the_one_meant(capsys, wrong, said):
    # jsonargparse's report ("Expected a dot import path string: wandb", and the Union's four other refusals)
    # named no class
    with pytest.raises(SystemExit):
        run_cli(["fit", "--config", "recipes/configs/dlrm_synthetic.yaml", wrong])
    assert said in capsys.readouterr().err


@pytest.mark.parametrize("module", ["DLRMModule", "TwoTowerModule"])
def test_every_model_option_has_its_help(capsys, module):
    # arguments documented together in the docstring ("sparse_optimizer / sparse_lr / ...: the fused update") had no
    # help in `--model.help`: only "(type: str, default: rowwise_adagrad)", not the optimizers to choose from
    with pytest.raises(SystemExit):
        run_cli(["fit", "--model.help", module])
    out = capsys.readouterr().out
    bare = re.findall(r"^  (--model\.\w+)[^\n]*\n\s+\(type:", out, re.MULTILINE)
    assert not bare, f"no help for {bare}"
    assert "sgd, adagrad, rowwise_adagrad, adam" in " ".join(out.split())


def test_a_misspelt_choice_names_the_one_meant(capsys):
    # jsonargparse listed every allowed precision in four Literal refusals, and named none as meant
    with pytest.raises(SystemExit):
        run_cli(["fit", "--config", "recipes/configs/dlrm_synthetic.yaml", "--trainer.precision=bf16-mix"])
    assert "did you mean bf16-mixed (--trainer.precision=bf16-mixed) instead of bf16-mix?" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["SyntheticCriteoDataModule", "CriteoDataModule", "MovieLensDataModule"])
def test_every_data_option_has_its_help(capsys, module):
    # `--data.help CriteoDataModule` (and the default recipe's SyntheticCriteoDataModule) had no line for any
    # argument: only each one's type and default
    with pytest.raises(SystemExit):
        run_cli(["fit", "--data.help", module])
    bare = re.findall(r"^  (--data\.\w+)[^\n]*\n\s+\(type:", capsys.readouterr().out, re.MULTILINE)
    assert not bare, f"no help for {bare}"


def test_a_config_file_that_is_not_yaml_is_named(tmp_path, capsys):
    # yaml's error said '"<unicode string>", line 3, column 11': with the recipe and a file of one's own, not which
    bad = tmp_path / "mine.yaml"
    bad.write_text("trainer:\n  max_epochs: 1\n   devices: 2\n")
    with pytest.raises(SystemExit):
        run_cli(["fit", "--config", "recipes/configs/dlrm_synthetic.yaml", "--config", str(bad)])
    assert f"in {bad}, line 3, column 11: mapping values are not allowed here" in capsys.readouterr().err


def test_a_value_of_the_wrong_type_in_a_config_file_names_the_file(tmp_path, capsys):
    # "Parser key "data": ... Parser key "batch_size": Expected a <class 'int'>. Got value: 5x12", not where it was set
    mine = tmp_path / "mine.yaml"
    mine.write_text("data:\n  init_args:\n    batch_size: 5x12\n")
    with pytest.raises(SystemExit):
        run_cli(["fit", "--config", "recipes/configs/dlrm_synthetic.yaml", "--config", str(mine)])
    assert f"data.batch_size is set in {mine}" in capsys.readouterr().err


def test_a_fit_ends_with_the_last_steps_metrics_and_where_everything_went(tmp_path, capsys):
    # `make train` with max_steps between two validation points printed the metrics of step 6 as "final validation"
    # while training went on to step 10 (the saved model scored better than the line said), and said nothing of
    # where its logs and checkpoints went; nor did it leave anything to look at
    import csv

    cli = run_cli(["fit", "--config", "recipes/configs/dlrm_synthetic.yaml", f"--trainer.default_root_dir={tmp_path}",
                   "--trainer.max_steps=10", "--trainer.val_check_interval=6", "--trainer.limit_val_batches=2",
                   "--trainer.log_every_n_steps=2", *QUIET])
    out = capsys.readouterr().out
    final = re.search(r"final validation: .*val_auc=(\S+).*\(step (\d+)\)", out)
    assert final and int(final[2]) == cli.trainer.global_step == 10, out
    assert float(final[1]) == pytest.approx(val(cli, "val_auc"), abs=1e-4)
    (run,) = tmp_path.glob("lightning_logs/version_*")
    assert f"logs: {run} (metrics.csv, summary.md, learning_curves.png)" in out, out
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    assert [int(r["step"]) + 1 for r in rows if r.get("val_auc")] == [6, 10]  # (Lightning writes step - 1)
    assert any(r.get("train_loss") for r in rows)
    summary = (run / "summary.md").read_text()
    assert "final metrics from the validation at step 10" in summary and "![learning curves]" in summary, summary
    assert (run / "learning_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    best = next(c for c in cli.trainer.checkpoint_callbacks if c.monitor == "val_auc")
    assert f"checkpoint, best (val_auc={float(best.best_model_score):.4f}): {best.best_model_path}" in out
    assert f"checkpoint, last: {tmp_path / 'checkpoints' / 'last.ckpt'}" in out
    assert Path(best.best_model_path).parent == tmp_path / "checkpoints"


def test_a_resume_keeps_the_better_checkpoint_of_the_run_before(tmp_path):
    # the README's resume kept only the newest checkpoint: on the Kaggle recipe (whose second epoch overfits) a resume
    # deleted the epoch-0 checkpoint (val_auc 0.722) and kept 0.669. The recipes keep the best by val_auc and the last
    import csv

    args = ["fit", "--config", "recipes/configs/dlrm_synthetic.yaml", f"--trainer.default_root_dir={tmp_path}",
            "--data.num_train_samples=4096", "--trainer.limit_val_batches=2", "--trainer.val_check_interval=4", *QUIET]
    first = run_cli([*args, "--trainer.max_epochs=1", "--data.signal_scale=3"])
    best_before = next(c for c in first.trainer.checkpoint_callbacks if c.monitor == "val_auc").best_model_path
    # the resumed epoch scores worse (the planted signal reversed: AUC under 0.5)
    resumed = run_cli([*args, "--trainer.max_epochs=2", "--ckpt_path=last", "--data.signal_scale=-3"])
    assert resumed.trainer.global_step == 16
    scores = [float(r["val_auc"]) for run in sorted(tmp_path.glob("lightning_logs/version_*"))
              for r in csv.DictReader(open(run / "metrics.csv")) if r.get("val_auc")]
    assert len(scores) == 4 and max(scores[2:]) < max(scores[:2]), scores
    callback = next(c for c in resumed.trainer.checkpoint_callbacks if c.monitor == "val_auc")
    assert callback.best_model_path == best_before and float(callback.best_model_score) == max(scores[:2])
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == sorted([Path(best_before).name,
                                                                                 "last.ckpt"])


def test_the_learning_curves_group_splits_cutoffs_and_tasks(tmp_path):
    # one panel per metric: its splits, @K and tasks as lines (retrieval: NDCG@K and Recall@K first)
    from lightning_rec.cli.run_summary import _panels, plot_curves, read_metrics

    (tmp_path / "metrics.csv").write_text(
        "epoch,step,train_loss,val_auc/click,val_auc/like,val_mrr@10,val_recall@10,test_recall@20,val_ndcg@10,"
        "val_ctr,mem/rank0_max_rss_mb,val/buy/auc,val/buy/calibration\n0,9,0.5,,,,,,,,,,\n"
        "0,9,,0.7,0.6,0.2,0.3,0.35,0.25,0.25,100,0.8,1.1\n")
    series = read_metrics(tmp_path / "metrics.csv")
    assert series["train_loss"] == [(10, 0.5)]  # the step the Trainer counts (Lightning writes it before the +1)
    assert _panels(series) == {"train loss": ["train_loss"], "auc": ["val_auc/click", "val_auc/like", "val/buy/auc"],
                               "ndcg": ["val_ndcg@10"], "recall": ["val_recall@10", "test_recall@20"],
                               "mrr": ["val_mrr@10"], "calibration": ["val/buy/calibration"]}
    assert plot_curves(series, tmp_path / "curves.png") and (tmp_path / "curves.png").stat().st_size > 1000

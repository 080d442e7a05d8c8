"""DLRMModule's arguments and batches, RecStrategy's arguments, strategy='rec' on one process."""

from __future__ import annotations

import contextlib
import io

from .helpers import _t, kjt_lengths, tables_of, unchanged
from .registry import case, expect, simple

SMOKE = ("model.dlrm_interaction_cat", "model.dlrm_labels_two", "strategy.dense_zero")


SMALL = dict(num_embeddings_per_feature=20, embedding_dim=4, sparse_feature_names=["c1", "c2"],
             dense_arch_layer_sizes=[8, 4], over_arch_layer_sizes=[8, 1], dense_in_features=3)


def batch(B=4, dense=3, labels=None):
    from lightning_rec.data import Batch

    torch = _t()
    k = kjt_lengths(["c1", "c2"], torch.arange(2 * B) % 20, [1] * (2 * B))
    lab = labels if labels is not None else (torch.arange(B) % 2).float()
    return Batch(dense_features=torch.rand(B, dense), sparse_features=k, labels=lab)


def dlrm_module_cases() -> None:
    """DLRMModule: arguments, dense widths, labels."""
    torch = _t()
    from lightning_rec import DLRMModule

    simple("model.dlrm_interaction_cat", lambda: DLRMModule(**SMALL, interaction="cat"), ValueError, ["'cat'", "dot"])
    simple("model.dlrm_dense_opt_lbfgs", lambda: DLRMModule(**SMALL, dense_optimizer="lbfgs"), ValueError, ["'lbfgs'"])
    simple("model.dlrm_over_arch_two_logits", lambda: DLRMModule(**{**SMALL, "over_arch_layer_sizes": [8, 2]}),
           ValueError, ["over_arch_layer_sizes", "end in 1"])
    simple("model.dlrm_sizes_list_wrong_length",
           lambda: DLRMModule(**{**SMALL, "num_embeddings_per_feature": [20, 20, 20]}), ValueError, ["3", "2"])
    simple("model.dlrm_sparse_lr_nan", lambda: DLRMModule(**SMALL, sparse_lr=float("nan")), ValueError, ["lr"])
    simple("model.dlrm_dense_lr_nan", lambda: DLRMModule(**SMALL, dense_lr=float("nan")), ValueError,
           ["dense_lr=nan", "finite"])
    simple("model.two_tower_temperature_nan", lambda: __import__("lightning_rec").TwoTowerModule(
        temperature=float("nan")), ValueError, ["temperature=nan", "finite"])
    simple("model.dlrm_dense_last_not_dim", lambda: DLRMModule(**{**SMALL, "dense_arch_layer_sizes": [8, 5]}),
           ValueError, ["embedding_dim", "4"])

    @case("model.dlrm_wrong_dense_width", ValueError, ["dense_in_features", "5"])
    def _(ctx):
        m = DLRMModule(**SMALL)
        m.training_step(batch(dense=5), 0)

    @case("model.dlrm_nan_labels_training", ValueError, ["label"])
    def _(ctx):
        m = DLRMModule(**SMALL)
        ctx.after(unchanged(m, tables_of(m), "DLRM weights"))
        m.training_step(batch(labels=torch.tensor([0.0, float("nan"), 1.0, 0.0])), 0).backward()

    @case("model.dlrm_labels_two", ValueError, ["label"])
    def _(ctx):
        m = DLRMModule(**SMALL)
        ctx.after(unchanged(m, tables_of(m), "DLRM weights"))
        m.training_step(batch(labels=torch.tensor([0.0, 2.0, 1.0, 0.0])), 0).backward()

    @case("model.dlrm_labels_shape", ValueError, ["label"])
    def _(ctx):
        m = DLRMModule(**SMALL)
        m.training_step(batch(labels=torch.zeros(3)), 0)


def strategy_cases() -> None:
    """RecStrategy's arguments; strategy='rec' on one device trains."""
    from lightning_rec import RecStrategy

    simple("strategy.dense_zero", lambda: RecStrategy(dense="zero"), ValueError, ["'zero'", "ddp", "fsdp"])
    simple("strategy.checkpoint_format_pickle", lambda: RecStrategy(checkpoint_format="pickle"), ValueError,
           ["'pickle'", "dcp"])
    simple("strategy.timeout_negative", lambda: RecStrategy(embedding_timeout=-5), ValueError, ["embedding_timeout"])
    simple("strategy.timeout_text", lambda: RecStrategy(embedding_timeout="soon"), ValueError, ["embedding_timeout"])
    simple("strategy.pipeline_text", lambda: RecStrategy(pipeline="yes"), ValueError, ["pipeline"])
    simple("strategy.plan_wrong_type", lambda: RecStrategy(plan={"t_a": "row_wise"}), ValueError, ["ShardingPlan"])

    @case("strategy.rec_one_device_trains", timeout=90, legit="strategy='rec' on one process is a valid run")
    def _(ctx):
        import lightning.pytorch as L

        from lightning_rec import DLRMModule, SyntheticCriteoDataModule
        torch = _t()
        L.seed_everything(0)
        data = SyntheticCriteoDataModule(num_train_samples=256, num_val_samples=128, batch_size=64,
                                         num_embeddings_per_feature=32)
        m = DLRMModule(num_embeddings_per_feature=32, embedding_dim=4, dense_arch_layer_sizes=[8, 4],
                       over_arch_layer_sizes=[8, 1])
        before = {k: v.clone() for k, v in m.state_dict().items()}
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            trainer = L.Trainer(strategy="rec", accelerator="cpu", devices=1, max_epochs=1, logger=False,
                                enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
            trainer.fit(m, data)
        expect(trainer.global_step == 4, f"global_step {trainer.global_step}")
        changed = any(not torch.equal(v, m.state_dict()[k]) for k, v in before.items() if k in m.state_dict())
        expect(changed, "no weight changed")


    @case("strategy.rec_one_device_shuffle_false_keeps_order", timeout=90,
          legit="shuffle=False under strategy='rec' on one device: the data module's order is the order trained")
    def _(ctx):
        import lightning.pytorch as L

        from lightning_rec import DLRMModule, SyntheticCriteoDataModule
        torch = _t()

        class Recorded(DLRMModule):
            def training_step(self, batch, batch_idx):
                seen.append(batch.dense_features)
                return super().training_step(batch, batch_idx)

        seen = []
        data = SyntheticCriteoDataModule(num_train_samples=256, num_val_samples=64, batch_size=64,
                                         num_embeddings_per_feature=32, shuffle=False)
        m = Recorded(num_embeddings_per_feature=32, embedding_dim=4, dense_arch_layer_sizes=[8, 4],
                     over_arch_layer_sizes=[8, 1])
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            L.Trainer(strategy="rec", accelerator="cpu", devices=1, max_epochs=1, logger=False, limit_val_batches=0,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False).fit(m, data)
        expect(torch.equal(torch.cat(seen), data.datasets["train"].dense_ND), "trained another order than the data "
               "module's (shuffle=False)")


CASES = (dlrm_module_cases, strategy_cases)

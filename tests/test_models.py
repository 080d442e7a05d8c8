"""DLRM / DLRM-DCNv2 and DLRMModule: shapes, errors, empty batches, checkpoints through Lightning."""

import lightning.pytorch as L
import pytest
import torch

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig, KeyedJaggedTensor
from lightning_rec.data import Batch, SyntheticCriteoDataModule
from lightning_rec.models import DLRM, DLRM_DCN, DLRMModule, DLRMTrain
from lightning_rec.optim import FusedOptimizer

KEYS = ["a", "b", "c"]


def ebc(dim=8):
    return EmbeddingBagCollection(
        [EmbeddingBagConfig(name=f"t_{k}", num_embeddings=20, embedding_dim=dim, feature_names=[k]) for k in KEYS],
        optimizer=FusedOptimizerConfig("rowwise_adagrad", lr=0.1),
    )


def kjt(B, ids_per_feature=1):
    values = torch.randint(0, 20, (len(KEYS) * B * ids_per_feature,))
    return KeyedJaggedTensor.from_lengths_sync(KEYS, values, torch.full((len(KEYS) * B,), ids_per_feature))


@pytest.mark.parametrize("cls", [DLRM, DLRM_DCN])
def test_dlrm_shapes_and_backward(cls):
    model = cls(ebc(), dense_in_features=5, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[8, 1])
    logits = model(torch.randn(6, 5), kjt(6, ids_per_feature=2))
    assert logits.shape == (6, 1)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.dense_arch.parameters())


@pytest.mark.parametrize("cls", [DLRM, DLRM_DCN])
def test_dense_device_places_the_dense_layers_as_torchrec(cls):
    """TorchRec's DLRM(..., dense_device=device): the dense layers go there, the tables stay where they are."""
    model = cls(ebc(), dense_in_features=5, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[8, 1],
                dense_device=torch.device("meta"))  # meta: a device other than the default, on any machine
    dense = [p for n, p in model.named_parameters() if not n.startswith("sparse_arch.")]
    assert dense and all(p.device.type == "meta" for p in dense)
    assert model.sparse_arch.embedding_bag_collection.embedding_bags["t_a"].weight.device.type == "cpu"


def test_dlrm_train_returns_torchrecs_loss_and_outputs():
    """DLRMTrain(dlrm)(batch) -> (loss, (loss, logits, labels)): mean BCE-with-logits, as TorchRec's."""
    torch.manual_seed(0)
    model = DLRM(ebc(), 5, [16, 8], [8, 1])
    batch = Batch(dense_features=torch.randn(4, 5), sparse_features=kjt(4), labels=torch.tensor([0, 1, 1, 0]))
    loss, (loss_d, logits, labels) = DLRMTrain(model)(batch)
    expected_logits = model(batch.dense_features, batch.sparse_features).squeeze(-1)
    torch.testing.assert_close(logits, expected_logits.detach())
    torch.testing.assert_close(loss, torch.nn.functional.binary_cross_entropy_with_logits(
        expected_logits, batch.labels.float()))
    assert loss.requires_grad and not (loss_d.requires_grad or logits.requires_grad)
    assert labels.dtype == torch.float32 and labels.tolist() == [0.0, 1.0, 1.0, 0.0]


def test_dot_interaction_is_pairwise_dots():
    model = DLRM(ebc(), 5, [16, 8], [8, 1])
    dense, sparse = torch.randn(2, 8), torch.randn(2, 3, 8)
    out = model.inter_arch(dense, sparse)
    vectors = torch.cat([dense.unsqueeze(1), sparse], 1)
    assert out.shape == (2, 8 + 6)
    torch.testing.assert_close(out[:, 8], (vectors[:, 0] * vectors[:, 1]).sum(-1))  # (dense, a)
    torch.testing.assert_close(out[:, -1], (vectors[:, 2] * vectors[:, 3]).sum(-1))  # (b, c)


def test_dlrm_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="must equal the embedding_dim 8"):
        DLRM(ebc(), 5, [16, 4], [8, 1])
    with pytest.raises(ValueError, match="unknown dense_optimizer 'lbfgs'"):
        DLRMModule(dense_optimizer="lbfgs")
    with pytest.raises(ValueError, match="unknown fused optimizer 'adamax'"):
        DLRMModule(sparse_optimizer="adamax")
    with pytest.raises(ValueError, match="2 entries for 26 sparse features"):
        DLRMModule(num_embeddings_per_feature=[10, 10])
    with pytest.raises(ValueError, match=r"DLRMModule\(dense_lr=-0.1, warmup_steps=-5\): must be >= 0"):
        DLRMModule(dense_lr=-0.1, warmup_steps=-5)  # said at fit by torch.optim (lr), or not at all (warm-up)
    with pytest.raises(ValueError, match=r"with interaction='dot'.* set interaction: dcn"):
        DLRMModule(dcn_num_layers=5)  # trained the dot model: the cross layers' sizes did nothing
    with pytest.raises(ValueError, match=r"DLRMModule\(embedding_kernel='dense'\).*use embedding_kernel='auto'"):
        DLRMModule(embedding_kernel="dense", num_embeddings_per_feature=10)  # said: "drop optimizer=..."


def test_over_arch_may_end_in_several_logits_as_torchrecs():
    """TorchRec's OverArch ends in any size (logits [B, K], e.g. one per task); DLRM refused all but 1."""
    model = DLRM(ebc(), 5, [16, 8], [8, 3])
    assert model(torch.randn(4, 5), kjt(4)).shape == (4, 3)


def test_sparse_arch_has_torchrecs_sparse_feature_names():
    """TorchRec's SparseArch.sparse_feature_names (read by subclasses of its DLRM) was an AttributeError."""
    shared = EmbeddingBagCollection([EmbeddingBagConfig(name="t0", num_embeddings=5, embedding_dim=4,
                                                        feature_names=["b", "a"]),
                                     EmbeddingBagConfig(name="t1", num_embeddings=5, embedding_dim=4,
                                                        feature_names=["c"])])
    assert DLRM(shared, 3, [4], [1]).sparse_arch.sparse_feature_names == ["b", "a", "c"]  # the output's order


@pytest.mark.parametrize("cls", [DLRM, DLRM_DCN])
def test_interaction_archs_take_torchrecs_keywords(cls):
    """TorchRec's DLRM.forward calls self.inter_arch(dense_features=..., sparse_features=...); ours took
    (dense_BD, sparse_BFD): a TorchRec-style forward in a subclass was a TypeError."""
    model = cls(ebc(), 5, [16, 8], [8, 1])
    dense, sparse = torch.randn(2, 8), torch.randn(2, 3, 8)
    torch.testing.assert_close(model.inter_arch(dense_features=dense, sparse_features=sparse),
                               model.inter_arch(dense, sparse))


def test_dlrm_module_checks_layer_sizes_before_drawing_its_tables(monkeypatch):
    """A dense arch not ending in embedding_dim was refused by DLRM after every table was drawn (26 x 40M rows:
    minutes, and most of the host memory, before a one-line config error); an over arch not ending in 1 is refused
    by DLRMModule (one click logit, BCE), no longer by DLRM."""
    import lightning_rec.models.dlrm_module as dlrm_module

    def drawn(*args, **kwargs):
        raise AssertionError("the tables were drawn before the layer sizes were checked")

    monkeypatch.setattr(dlrm_module, "EmbeddingBagCollection", drawn)
    with pytest.raises(ValueError, match=r"dense_arch_layer_sizes=\[16, 4\] must end in embedding_dim=8"):
        DLRMModule(embedding_dim=8, dense_arch_layer_sizes=[16, 4])
    with pytest.raises(ValueError, match=r"over_arch_layer_sizes=\[8, 2\] must end in 1"):
        DLRMModule(embedding_dim=8, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[8, 2])


def test_dense_and_sparse_batch_sizes_that_differ_are_named():
    """torch.cat's 'Sizes of tensors must match except in dimension 1' from inside the interaction, before."""
    model = DLRM(ebc(), 5, [16, 8], [8, 1])
    with pytest.raises(ValueError, match="3 rows of dense features but 2 samples of sparse features"):
        model(torch.randn(3, 5), kjt(2))


def small_module(**kw):
    return DLRMModule(num_embeddings_per_feature=50, embedding_dim=8, dense_arch_layer_sizes=[16, 8],
                      over_arch_layer_sizes=[16, 1], sparse_lr=0.05, **kw)


def test_empty_batch_and_all_empty_features_train():
    module = small_module()
    opt = module.configure_optimizers()
    names = [f"C{i}" for i in range(1, 27)]
    empty = Batch(torch.zeros(0, 13), KeyedJaggedTensor.from_lengths_sync(
        names, torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)), torch.zeros(0))
    no_ids = Batch(torch.randn(4, 13), KeyedJaggedTensor.from_lengths_sync(
        names, torch.empty(0, dtype=torch.long), torch.zeros(26 * 4, dtype=torch.long)), torch.ones(4))
    for batch in (empty, no_ids):
        loss = module.training_step(batch, 0)
        assert torch.isfinite(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()


def trainer(tmp_path, **kw):
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=tmp_path, **kw)


def test_test_logs_test_loss_as_validate_logs_val_loss(tmp_path):
    """trainer.test logged test_logloss but no test_loss, while validation logs val_loss (both the mean BCE)."""
    data = SyntheticCriteoDataModule(num_train_samples=64, num_val_samples=64, num_test_samples=64, batch_size=32,
                                     num_embeddings_per_feature=50)
    module = small_module()
    val = trainer(tmp_path).validate(module, data, verbose=False)[0]
    test = trainer(tmp_path).test(module, data, verbose=False)[0]
    assert test["test_loss"] == pytest.approx(test["test_logloss"])
    assert val["val_loss"] == pytest.approx(val["val_logloss"])


def test_checkpoint_restores_tables_and_fused_state(tmp_path):
    data = SyntheticCriteoDataModule(num_train_samples=2048, num_val_samples=512, batch_size=256,
                                     num_embeddings_per_feature=50)
    module = small_module(warmup_steps=4)
    t = trainer(tmp_path, max_steps=6, enable_checkpointing=True, num_sanity_val_steps=0)
    t.fit(module, data)
    path = tmp_path / "last.ckpt"
    t.save_checkpoint(path)
    fused_lr = module.model.sparse_arch.embedding_bag_collection.fused_kernels()[0].get_learning_rate()
    assert fused_lr == pytest.approx(0.05, rel=1e-5)  # warm-up finished: the scheduler reached the kernel

    restored = small_module(warmup_steps=4)
    t2 = trainer(tmp_path, max_steps=6, num_sanity_val_steps=0)
    t2.fit(restored, data, ckpt_path=path)  # max_steps already reached: restores, trains nothing
    for name, w in module.model.state_dict().items():
        torch.testing.assert_close(restored.model.state_dict()[name], w, msg=name)
    old = FusedOptimizer(module.model).table_states()
    new = FusedOptimizer(restored.model).table_states()
    for table, states in old.items():
        torch.testing.assert_close(new[table]["sum"], states["sum"])


def test_lr_find_on_sparse_lr_reaches_the_fused_tables(tmp_path):
    """Tuner.lr_find(module, attr_name="sparse_lr") said "Learning rate set to ..." and wrote hparams.sparse_lr, but
    the tables' fused configs kept the rate given to __init__: the fit after it trained the tables at the old rate."""
    from lightning.pytorch.tuner import Tuner

    data = SyntheticCriteoDataModule(num_train_samples=2048, num_val_samples=0, batch_size=64, num_sparse_features=2,
                                     num_embeddings_per_feature=50, num_signal_features=2)
    module = small_module(sparse_feature_names=["C1", "C2"])
    kw = dict(max_epochs=1, limit_val_batches=0)
    found = Tuner(trainer(tmp_path, **kw)).lr_find(module, datamodule=data, attr_name="sparse_lr", num_training=24,
                                                   early_stop_threshold=None)
    assert found.suggestion() is not None and module.hparams.sparse_lr == found.suggestion() != 0.05
    fit = trainer(tmp_path, max_steps=1, **kw)
    fit.fit(module, data)
    fused = dict(fit.optimizers[0].optimizers)["fused"]
    assert [g["lr"] for g in fused.param_groups] == [module.hparams.sparse_lr]


def test_model_feature_names_beside_the_datas_default_are_logged(tmp_path):
    """--model.sparse_feature_names=[C1, C2] beside the data's default (None: the same names) stopped every fit with a
    logger at Lightning's "Error while merging hparams: the keys ['sparse_feature_names'] ... different values"."""
    from lightning.pytorch.loggers import CSVLogger

    data = SyntheticCriteoDataModule(num_train_samples=256, num_val_samples=0, batch_size=128, num_sparse_features=2,
                                     num_embeddings_per_feature=50, num_signal_features=2)
    module = small_module(sparse_feature_names=["C1", "C2"])
    t = L.Trainer(accelerator="cpu", max_steps=1, limit_val_batches=0, logger=CSVLogger(tmp_path),
                  enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    t.fit(module, data)
    assert t.global_step == 1
    logged = t.logger.experiment.hparams
    assert logged["sparse_feature_names"] == ["C1", "C2"] and "data_sparse_feature_names" in logged


@pytest.mark.parametrize("labels", [torch.tensor([0, 1, 1, 0]), torch.tensor([False, True, True, False]),
                                    torch.tensor([[0.0], [1.0], [1.0], [0.0]])], ids=["int64", "bool", "column"])
def test_click_labels_as_integers_bools_or_a_column_give_the_float_loss(labels):
    """DLRMModule's loss crashed on int64 labels ("result type Float can't be cast to ... Long"), on bool labels, and
    on a [B, 1] column (which its shape check let through); DLRMTrain took them. Each now gives the float loss."""
    torch.manual_seed(0)
    module = small_module(sparse_feature_names=KEYS)
    batch = Batch(dense_features=torch.randn(4, 13), sparse_features=kjt(4), labels=labels)
    expected = torch.nn.functional.binary_cross_entropy_with_logits(
        module(batch.dense_features, batch.sparse_features), torch.tensor([0.0, 1.0, 1.0, 0.0]))
    torch.testing.assert_close(module._loss(batch)[0], expected)


def test_several_validation_and_test_loaders_get_their_own_metrics(tmp_path):
    """trainer.validate / test with two dataloaders (a val and a holdout set) was refused by Lightning: DLRMModule's
    validation_step took no dataloader_idx. Each loader now has its own metrics: the first under the plain names
    (what checkpoints monitor), the second with Lightning's '/dataloader_idx_1', each equal to that loader alone."""
    data = SyntheticCriteoDataModule(num_train_samples=64, num_val_samples=96, num_test_samples=64, batch_size=32,
                                     num_embeddings_per_feature=50)
    data.setup("fit")
    data.setup("test")
    module = small_module()
    first, second = data.val_dataloader(), data.test_dataloader()
    alone = [trainer(tmp_path).validate(module, loader, verbose=False)[0] for loader in (first, second)]
    both = trainer(tmp_path).validate(module, [first, second], verbose=False)
    merged = {**both[0], **both[1]}
    for name in ("val_auc", "val_logloss", "val_loss"):
        assert merged[name] == pytest.approx(alone[0][name], rel=1e-6)
        assert merged[f"{name}/dataloader_idx_1"] == pytest.approx(alone[1][name], rel=1e-6)
    assert alone[0]["val_auc"] != pytest.approx(alone[1]["val_auc"], rel=1e-6)
    tested = trainer(tmp_path).test(module, [second, first], verbose=False)
    assert {**tested[0], **tested[1]}["test_auc/dataloader_idx_1"] == pytest.approx(alone[0]["val_auc"], rel=1e-6)

"""Managed-collision (ZCH) tables: remapping, batched eviction, re-initialised rows, resume, bad input."""

import warnings
from unittest.mock import patch

import numpy as np
import pytest
import torch

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_rec._native import native_op
from lightning_rec.managed_collision import (
    DistanceLFU_EvictionPolicy,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    MCHManagedCollisionModule,
)
from lightning_rec.managed_collision.mch import KeySpans, MCHEvictionPolicy, TableGroup, remap_tables
from lightning_rec.optim.config import FusedOptimizerConfig
from lightning_rec.sparse import KeyedJaggedTensor


def _mc_ebc(rows=8, zch=8, interval=1, policy="lfu", seed=0, **kw):
    torch.manual_seed(seed)
    tables = [EmbeddingBagConfig(name="t", num_embeddings=rows, embedding_dim=4, feature_names=["f", "g"])]
    ebc = EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig("rowwise_adagrad", lr=0.1))
    mcc = ManagedCollisionCollection({"t": MCHManagedCollisionModule(zch, eviction_policy=policy,
                                                                     eviction_interval=interval, **kw)}, tables)
    return ManagedCollisionEmbeddingBagCollection(ebc, mcc, return_remapped_features=True)


def _kjt(f, g):
    return KeyedJaggedTensor.from_lengths_sync(["f", "g"], torch.tensor(f + g),
                                               torch.tensor([len(f), 0, len(g), 0]))


def test_new_ids_take_distinct_rows_and_keep_them():
    m = MCHManagedCollisionModule(5).train()
    rows = m(torch.tensor([2**62, 7, 2**62, 123456789012]))
    assert rows[0] == rows[2] and len({int(r) for r in rows}) == 3 and int(rows.max()) < 4
    assert torch.equal(m(torch.tensor([7, 2**62])), rows[[1, 0]])
    ids, where = m.id_map()
    assert ids.tolist() == sorted([7, 123456789012, 2**62])


def test_full_table_reads_unknown_row_until_eviction_run():
    m = MCHManagedCollisionModule(3, eviction_interval=2).train()  # 2 managed rows, row 2 unknown
    assert m(torch.tensor([1, 2])).tolist() == [0, 1]
    assert m(torch.tensor([9, 9, 9, 1])).tolist() == [1, 1, 1, 0]  # the run at step 2 evicts 2 (LFU) for 9
    assert m(torch.tensor([4, 4, 4, 4])).tolist() == [2, 2, 2, 2]  # full, step 3: 4 waits on the unknown row
    assert m.take_reused_rows().tolist() == [0, 1]
    assert m.metrics()["evictions_per_interval"] == 1.0


@pytest.mark.parametrize("policy, evicted_id", [("lfu", 1), ("lru", 2), (DistanceLFU_EvictionPolicy(2.0), 2)])
def test_policies_choose_their_victim(policy, evicted_id):
    m = MCHManagedCollisionModule(3, eviction_policy=policy, eviction_interval=4).train()
    m(torch.tensor([1, 2, 2, 2, 2]))  # 2 is frequent but old
    m(torch.tensor([1]))
    m(torch.tensor([1]))
    m(torch.tensor([5, 5, 5, 5, 5, 5]))  # step 4: candidate 5 replaces one resident
    ids, _ = m.id_map()
    assert evicted_id not in ids.tolist() and 5 in ids.tolist()


def test_admission_threshold_reads_unknown_row():
    m = MCHManagedCollisionModule(4, min_count_to_admit=2, eviction_interval=100).train()
    assert m(torch.tensor([10])).tolist() == [3]
    assert m(torch.tensor([10])).tolist() != [3]  # second sight: admitted to a free row


def test_eval_reads_without_admitting():
    m = MCHManagedCollisionModule(4).eval()
    assert m(torch.tensor([10, 11])).tolist() == [3, 3]
    assert m.id_map()[0].numel() == 0


def test_matches_a_dict_reference_before_the_table_fills():
    mc = _mc_ebc(rows=64, zch=64)
    ref = {}
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        f = torch.randint(0, 2**40, (6,), generator=g).tolist()
        _, remapped = mc(_kjt(f, f[:2]))
        for i, r in zip(f + f[:2], remapped.values().tolist()):
            assert ref.setdefault(i, r) == r
    assert len(set(ref.values())) == len(ref)


def test_evicted_row_is_reinitialised_with_optimizer_state():
    mc = _mc_ebc(rows=3, zch=3, interval=1)  # 2 managed rows
    out, _ = mc(_kjt([1, 2, 1], []))
    out.values().sum().backward()
    kernel = mc._embedding_module.lookup.fused_kernels()[0]
    state = kernel.optimizer_states()[0]["sum"]
    assert bool((state[:2] > 0).all())
    w = mc._embedding_module.table_parameters()["t"]
    before = w.detach().clone()
    mc(_kjt([7, 7, 7, 7], []))  # 7 outscores 2 (LFU) and takes its row
    row = int(mc(_kjt([7], []))[1].values())
    assert state[row] == 0 and not torch.equal(w[row], before[row])
    other = 1 - row
    assert torch.equal(w[other], before[other])


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam", "partial_rowwise_adam"])
def test_a_row_handed_to_a_new_id_starts_afresh_under_every_cpu_optimizer(optimizer):
    """Every fused optimizer the CPU kernels run: the evicted row's weights are re-drawn and each of its per-row
    state tensors zeroed; the other row keeps its weights and state, and the new id then trains its row."""
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name="t", num_embeddings=3, embedding_dim=4, feature_names=["f", "g"])]
    ebc = EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig(optimizer, lr=0.1))
    mc = ManagedCollisionEmbeddingBagCollection(
        ebc, ManagedCollisionCollection({"t": MCHManagedCollisionModule(3, eviction_interval=1)}, tables),
        return_remapped_features=True)  # 2 managed rows
    for _ in range(2):
        mc(_kjt([1, 2, 1], []))[0].values().sum().backward()

    def per_row():
        states = ebc.lookup.fused_kernels()[0].optimizer_states()[0]
        return {k: v.clone() for k, v in states.items() if v.dim() and v.shape[0] == 3}

    w, state = ebc.table_parameters()["t"].detach().clone(), per_row()
    assert len(state) == {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 1}.get(optimizer, 2)  # adam's: both moments
    assert all(bool((v[:2].reshape(2, -1) != 0).any(1).all()) for v in state.values())  # both rows trained
    mc(_kjt([7, 7, 7, 7], []))  # 7 outscores 2 (LFU) and takes its row
    row = int(mc(_kjt([7], []))[1].values())
    now, after = ebc.table_parameters()["t"].detach().clone(), per_row()
    assert not torch.equal(now[row], w[row]) and torch.equal(now[1 - row], w[1 - row])
    assert all(bool((v[row] == 0).all()) and torch.equal(v[1 - row], state[k][1 - row]) for k, v in after.items())
    mc(_kjt([7], []))[0].values().sum().backward()
    assert not torch.equal(ebc.table_parameters()["t"].detach()[row], now[row])


def test_rows_are_redrawn_in_the_lookup_that_replaced_the_old_one():
    """Re-initialising rows looks a collection's weight views and optimizer state up once and keeps them while its
    kernels live. use_fused_optimizer builds new kernels (new storage): a row handed out afterwards is re-drawn and
    its state zeroed there, as in a collection never rebuilt, not in the storage of the kernels it replaced."""
    got = {}
    for rebuild in (False, True):
        mc = _mc_ebc(rows=3, zch=3, interval=1)  # 2 managed rows
        mc(_kjt([1, 2, 1], []))[0].values().sum().backward()  # rows handed to 1 and 2: the views looked up
        ebc = mc._embedding_module
        if rebuild:
            ebc.use_fused_optimizer(FusedOptimizerConfig("rowwise_adagrad", lr=0.1))
        mc(_kjt([1, 2], []))[0].values().sum().backward()
        before = ebc.table_parameters()["t"].detach().clone()
        mc(_kjt([7, 7, 7, 7], []))  # 7 outscores 2 (LFU) and takes its row
        row = int(mc(_kjt([7], []))[1].values())
        got[rebuild] = row, before, ebc.table_parameters()["t"].detach().clone(), \
            ebc.lookup.fused_kernels()[0].optimizer_states()[0]["sum"].clone()
    row, before, w, state = got[True]
    assert row == got[False][0] and not torch.equal(w[row], before[row])
    assert torch.equal(w[row], got[False][2][row]) and torch.equal(w[1 - row], before[1 - row])
    assert state[row] == 0 and state[1 - row] > 0


def test_state_dict_resumes_exactly():
    a, b = _mc_ebc(rows=6, zch=6, interval=2), _mc_ebc(rows=6, zch=6, interval=2, seed=3)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 20, (8,), generator=g).tolist() for _ in range(8)]
    for f in batches[:4]:
        a(_kjt(f, []))[0].values().sum().backward()
    b.load_state_dict(a.state_dict())
    kb = b._embedding_module.lookup.fused_kernels()[0]
    for name, v in a._embedding_module.lookup.fused_kernels()[0].optimizer_states()[0].items():
        kb.optimizer_states()[0][name].copy_(v)
    for f in batches[4:]:
        torch.manual_seed(5)
        a(_kjt(f, []))[0].values().sum().backward()
        torch.manual_seed(5)
        b(_kjt(f, []))[0].values().sum().backward()
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_metrics_fill_evictions_and_reused_share():
    mc = _mc_ebc(rows=3, zch=3, interval=1)
    mc(_kjt([1, 2], []))
    assert mc.metrics()["mc/t/fill_ratio"] == 1.0
    mc(_kjt([9, 9, 9], []))
    mc(_kjt([9, 1], []))
    m = mc.metrics()
    assert m["mc/t/reused_row_lookup_share"] > 0 and "mc/t/evictions_per_interval" in m


# -- bad input -----------------------------------------------------------------------------------------------------
def test_negative_ids_refused():
    with pytest.raises(ValueError, match="negative ids"):
        MCHManagedCollisionModule(4).train()(torch.tensor([3, -5]))


@pytest.mark.parametrize("zch", [0, 1])
def test_zch_size_zero_refused(zch):
    with pytest.raises(ValueError, match="zch_size"):
        MCHManagedCollisionModule(zch)


def test_zch_size_larger_than_table_refused():
    tables = [EmbeddingBagConfig(name="t", num_embeddings=4, embedding_dim=4, feature_names=["f"])]
    with pytest.raises(ValueError, match="zch_size <= 4"):
        ManagedCollisionCollection({"t": MCHManagedCollisionModule(5)}, tables)


def test_eviction_interval_zero_refused():
    with pytest.raises(ValueError, match="eviction_interval"):
        MCHManagedCollisionModule(4, eviction_interval=0)


def test_checkpoint_with_id_map_into_table_without_one_and_reverse():
    mc = _mc_ebc()
    plain = mc._embedding_module
    with pytest.raises(RuntimeError, match="_managed_collision_collection"):
        plain.load_state_dict(mc.state_dict())  # unexpected keys: the id map is named
    with pytest.raises(RuntimeError, match="_row_ids"):
        mc.load_state_dict({"_embedding_module." + k: v for k, v in plain.state_dict().items()})


def test_zch_size_mismatch_on_load_named():
    a, b = MCHManagedCollisionModule(4), MCHManagedCollisionModule(6)
    with pytest.raises(ValueError, match="zch_size=4"):
        b.load_state_dict(a.state_dict())


def test_every_id_new_every_batch_warns_and_stays_consistent():
    mc = _mc_ebc(rows=5, zch=5, interval=1, policy="lru")  # new ids are the most recent: all residents go
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(6):
            ids = list(range(100 * step, 100 * step + 6)) * 2
            mc(_kjt(ids, []))[0].values().sum().backward()
    assert any("churns" in str(w.message) for w in caught)
    m = mc._managed_collision_collection.modules_by_table()["t"]
    row_ids = m._row_ids
    assert len(set(row_ids.tolist())) == row_ids.numel()  # one id per row
    ids, rows = m.id_map()
    assert torch.equal(row_ids[rows], ids) and bool(torch.isfinite(mc._embedding_module.table_parameters()["t"]).all())


def test_lightning_module_logs_the_metrics(tmp_path):
    import lightning.pytorch as L

    from lightning_rec.models.module_hooks import RecModuleHooks

    class Module(RecModuleHooks, L.LightningModule):
        def __init__(self):
            super().__init__()
            self.mc = _mc_ebc(rows=4, zch=4, interval=1)
            self.dense = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            loss = self.dense(self.mc(_kjt(batch.tolist(), []))[0].values()).sum()
            self.log_train_loss(loss, batch_size=1)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.dense.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.arange(24).view(6, 4) % 7, batch_size=None)
    trainer = L.Trainer(max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path, accelerator="cpu", devices=1)
    trainer.fit(Module(), data)
    logged = trainer.logged_metrics
    assert {"mc/t/fill_ratio", "mc/t/evictions_per_interval", "mc/t/reused_row_lookup_share"} <= set(logged)
    assert float(logged["mc/t/fill_ratio"]) == 1.0


@pytest.mark.parametrize("policy", ["lfu", "lru", "distance_lfu"])
def test_sorted_map_stays_consistent_under_churn(policy):
    """The map is merged, not re-sorted, at each admission: it must stay sorted and agree with the rows."""
    m = MCHManagedCollisionModule(17, eviction_policy=policy, eviction_interval=3, max_candidates=8).train()
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(60):
            ids = torch.randint(0, 60, (12,), generator=g) ** 3
            rows = m(ids)
            ids_sorted, where = m.id_map()
            assert bool((ids_sorted[1:] > ids_sorted[:-1]).all())
            assert torch.equal(m._row_ids[where], ids_sorted)
            assert ids_sorted.numel() == int((m._row_ids != -1).sum())
            owned = rows != m.unknown_row
            assert torch.equal(m._row_ids[rows[owned]], ids[owned])


def test_the_empty_slot_id_refused():
    with pytest.raises(ValueError, match="empty slot"):
        MCHManagedCollisionModule(4).train()(torch.tensor([2**63 - 1]))


def test_movielens_and_sequences_hand_raw_ids_to_a_managed_collision_table():
    """hash_ids=False (the Criteo readers' contract): MovieLens' user_id / item_id features and a sequence's input
    items are the log's own ids, which a ManagedCollisionCollection maps to rows; rows stay what ranks."""
    from conftest import SHARED_DATA

    from lightning_rec.data import MovieLensDataModule
    from lightning_rec.data.movielens.side import raw_ids
    from lightning_rec.data.sequence import SequenceDataModule

    ml = SHARED_DATA / "movielens" / "ml-100k"
    if not (ml / "u.data").is_file():
        pytest.skip("shared ml-100k not present")
    dm = MovieLensDataModule(str(ml), batch_size=256, hash_ids=False, side_features=False)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    users, items = batch.user_features["user_id"].values(), batch.item_features["item_id"].values()
    assert torch.equal(users, torch.as_tensor(dm.user_ids)[batch.user_index])
    assert torch.equal(items, torch.as_tensor(dm.item_ids)[batch.item_index])
    tables = [EmbeddingBagConfig(name="t_user", num_embeddings=dm.num_users, embedding_dim=4,
                                 feature_names=["user_id"])]
    mcc = ManagedCollisionCollection({"t_user": MCHManagedCollisionModule(dm.num_users)}, tables).train()
    rows = mcc(batch.user_features)["user_id"].values()
    pairs = torch.unique(torch.stack([rows, users]), dim=1).shape[1]
    assert pairs == users.unique().numel() == rows.unique().numel() and int(rows.max()) < dm.num_users
    seq = SequenceDataModule(str(ml), hash_ids=False, max_len=10_000)  # inputs: the whole history before the target
    seq.setup()
    val = seq.datasets["val"][list(range(64))]
    assert torch.equal(val.item_ids, torch.as_tensor(seq.item_ids)[val.exclude_items])  # exclusions stay rows
    hashed = raw_ids(np.array(["B00X", "B00Y", "B00X"]))  # string ids (ASINs): stable, non-negative int64
    assert hashed[0] == hashed[2] != hashed[1] and bool((hashed >= 0).all())


@pytest.mark.filterwarnings("ignore:managed-collision table")  # 12 ids churn through 4 rows: meant
def test_export_serves_raw_ids_through_the_id_map(tmp_path):
    """`lightning-rec export` of a trained DLRMModule(managed_collision=...): the id map travels with the tables;
    the loaded module and the serving module (what `--package` compiles, traced by torch.export) take raw ids and
    match the eager model, ids never seen reading the unknown row."""
    from lightning_rec import checkpoint as ckpt
    from lightning_rec.checkpoint import load_exported
    from lightning_rec.cli import export_main
    from lightning_rec.models import DLRMModule
    from lightning_rec.serving.package import serving_module

    names = ["s0", "s1"]
    torch.manual_seed(0)
    model = DLRMModule(num_embeddings_per_feature=[6, 5], embedding_dim=4, sparse_feature_names=names,
                       dense_in_features=3, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1], sparse_lr=0.1,
                       managed_collision={"eviction_policy": "lru", "eviction_interval": 2})
    pool = torch.randint(0, 2**62, (12,), generator=torch.Generator().manual_seed(1))  # more ids than rows

    def batch(seed, ids):
        g = torch.Generator().manual_seed(seed)
        values = ids[torch.randint(0, ids.numel(), (16,), generator=g)]
        return torch.randn(8, 3, generator=g), values, torch.ones(16, dtype=torch.int64)

    for step in range(6):  # the fused update runs in backward; evictions every 2 steps
        dense, values, lengths = batch(step, pool)
        model(dense, KeyedJaggedTensor.from_lengths_sync(names, values, lengths)).sum().backward()
    mc = model.model.sparse_arch.embedding_bag_collection._managed_collision_collection
    assert mc.modules_by_table()["t_s0"]._evictions_total > 0
    model.eval()
    ckpt.save_file({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams),
                    "lightning_rec": {"module_class": "lightning_rec.models.dlrm_module.DLRMModule"}},
                   tmp_path / "c.ckpt")
    assert export_main([str(tmp_path / "c.ckpt"), str(tmp_path / "out")]) == 0
    loaded = load_exported(tmp_path / "out")
    dense, values, lengths = batch(99, torch.cat([pool, torch.tensor([3, 2**61 + 5])]))  # two ids never seen
    kjt = KeyedJaggedTensor.from_lengths_sync(names, values, lengths)
    with torch.no_grad():
        expected = model(dense, kjt)
        assert torch.equal(loaded(dense, kjt), expected)
        module, meta = serving_module(loaded, "fp32")
        served = torch.export.export(module, (dense, values, lengths), strict=False).module()
        torch.testing.assert_close(served(dense, values, lengths), expected, atol=1e-6, rtol=1e-6)  # fp32, same sums
    assert [f["raw_ids"] for f in meta["sparse_features"]] == [True, True]
    rows = mc(kjt).values()
    assert bool((rows == 4).any() or (rows == 5).any())  # some ids read an unknown row


def test_dlrm_module_refuses_an_unknown_managed_collision_argument():
    from lightning_rec.models import DLRMModule

    with pytest.raises(ValueError, match=r"\['zch'\] are not MCHManagedCollisionModule arguments: give any of "
                                         r"eviction_policy"):
        DLRMModule(num_embeddings_per_feature=4, embedding_dim=4, sparse_feature_names=["a"], dense_in_features=1,
                   dense_arch_layer_sizes=[4], over_arch_layer_sizes=[1], managed_collision={"zch": 3})


def test_dlrm_module_refuses_raw_ids_from_the_data_without_id_maps(tmp_path):
    """The data module's hash_ids=False (CriteoDataModule's) into tables without maps: named at setup, as
    MultiTaskModule's and TwoTowerModule's (RecModuleHooks.check_raw_ids)."""
    import lightning.pytorch as L

    from lightning_rec.models import DLRMModule

    class RawIds(L.LightningDataModule):
        hash_ids = False

        def train_dataloader(self):
            raise AssertionError("refused before any batch")

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    model = DLRMModule(num_embeddings_per_feature=4, embedding_dim=4, sparse_feature_names=["a"], dense_in_features=1,
                       dense_arch_layer_sizes=[4], over_arch_layer_sizes=[1])
    with pytest.raises(ValueError, match=r"RawIds\(hash_ids=False\) hands the raw ids, which its tables would read as "
                                         r"rows: give DLRMModule\(managed_collision=\{\}\)"):
        trainer.fit(model, RawIds())


class _OddFirst(MCHEvictionPolicy):
    """A policy of the user's (scored in Python, placed by the C++ run): odd counts stay before even ones."""

    def scores(self, counts, last_seen, step):
        return (counts % 2).double() * 1000 + last_seen.double()


def _tables(seed):
    """Tables of several shapes: small full ones, one with an admission threshold, one with few candidate slots;
    every policy: those the C++ run scores itself (lfu, lru, distance-lfu of decay 1) and those it is given scores
    of (another decay, a user's)."""
    specs = [dict(zch_size=5, eviction_interval=2), dict(zch_size=9, eviction_interval=3, eviction_policy="lru"),
             dict(zch_size=33, eviction_interval=4, min_count_to_admit=2, eviction_policy="distance_lfu"),
             dict(zch_size=12, eviction_interval=1, max_candidates=3), dict(zch_size=2, eviction_interval=5),
             dict(zch_size=7, eviction_interval=2, eviction_policy=DistanceLFU_EvictionPolicy(0.5)),
             dict(zch_size=6, eviction_interval=3, eviction_policy=_OddFirst())]
    return [MCHManagedCollisionModule(**s, name=f"t{i}").train() for i, s in enumerate(specs)]


@pytest.mark.skipif(not native_op("mch_profile_remap"), reason="needs the C++ extension (csrc/mch_cpu.cpp)")
@pytest.mark.parametrize("counted", [False, True])
@pytest.mark.parametrize("builtin", [False, True])
def test_fused_pass_matches_each_tables_torch_path(counted, builtin):
    """csrc/mch_cpu.cpp profiles and remaps every table of a step in one call; each table's torch ops are the
    reference: rows, every buffer, rows to re-draw and reused-row lookups equal bit for bit, step after step, through
    new ids, full tables, candidate overflow, admission thresholds and eviction runs (counted: distinct ids with
    counts, as a process group profiles)."""
    fused, torch_path = _tables(0), _tables(0)
    if builtin:  # policies the C++ pass scores itself: profile, eviction runs and remap in one call
        fused, torch_path = fused[:5], torch_path[:5]
    group, keyed = TableGroup(fused), KeySpans([[2 * i, 2 * i + 1] for i in range(len(fused))])
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the small tables churn
        for step in range(40):
            n = torch.randint(0, 7, (len(fused) * 2,), generator=g)  # two features per table, some empty
            values = (torch.randint(0, 40 if step < 20 else 400, (int(n.sum()),), generator=g) ** 2) * 7919
            cuts = [0, *torch.cumsum(n, 0).tolist()]
            spans = [[(cuts[2 * i], cuts[2 * i + 1]), (cuts[2 * i + 1], cuts[2 * i + 2])] for i in range(len(fused))]
            profile = (values, None, spans)
            if counted:
                counted_ids = [torch.unique(torch.cat([values[a:b] for a, b in s]), return_counts=True) for s in spans]
                sizes = [0, *np.cumsum([u.numel() for u, _ in counted_ids]).tolist()]
                profile = (torch.cat([u for u, _ in counted_ids]), torch.cat([c for _, c in counted_ids]),
                           [[(sizes[i], sizes[i + 1])] for i in range(len(fused))])
            training = step % 9 != 8  # an eval step now and then: remap only
            outs = []
            # spans as keys of a batch of one sample a key (its lengths int64 or int32), or given
            key_lengths = n.view(-1, 1).to(torch.int32 if step % 2 else torch.int64)
            key_profile = (values, None, keyed) if not counted else profile
            for maps, native in ((group, True), (torch_path, False)):
                out = torch.full_like(values, -5)
                remap_tables(maps, values, out, keyed if step % 3 else spans, key_profile if training else None,
                             training, native=native, key_lengths=key_lengths)
                outs.append(out)
            assert torch.equal(outs[0], outs[1]), step
            for a, b in zip(fused, torch_path):
                for name, buf in a.state_dict().items():
                    assert torch.equal(buf, b.state_dict()[name]), (step, a._name, name)
                ra, rb = a.take_reused_rows(), b.take_reused_rows()
                assert (ra is None) == (rb is None) and (ra is None or torch.equal(ra, rb)), (step, a._name)
                assert a._now() == b._host.step == int(b._step)
                assert a.metrics() == b.metrics(), (step, a._name)
    full = [m._name for m in fused if bool((m._row_ids != -1).all())]
    assert len(full) >= len(fused) - 1 and all(int(m._evictions_total) > 0 for m in fused if m._name in full), full


def test_owner_of_native_pass_routes_every_id_as_the_torch_ops_do():
    """Ranks route raw ids with owner_of and owners re-home them with it: the C++ pass (CPU) and the torch ops (any
    other device) must agree bit for bit, or an id would be remapped by a shard that does not hold it."""
    from lightning_rec.managed_collision import mch

    assert native_op("mch_owner_of") is not None, "the C++ extension is built for the suite"
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.randint(-2**63, 2**63 - 1, (50_000,), generator=g), torch.arange(64),
                     torch.tensor([-1, -2**63, 2**63 - 1])])
    per_id = torch.randint(1, 9, (ids.numel(),), generator=g)
    for owners in (2, 3, 5, per_id):
        native = mch.owner_of(ids, owners)
        with patch.object(mch, "native_op", lambda name: None):
            torch_ops = mch.owner_of(ids, owners)
        assert torch.equal(native, torch_ops)
        assert int(native.min()) == 0 and bool((native < (owners if isinstance(owners, int) else per_id)).all())


@pytest.mark.parametrize(("saved", "built"), [(None, {}), ({}, None)])
def test_a_trainer_checkpoint_with_other_id_maps_is_refused_by_the_hyperparameters_not_a_wall_of_keys(
        tmp_path, saved, built):
    """Resuming a checkpoint of tables without id maps into a module with them (or the reverse) listed some 30 KB of
    missing and unexpected keys (11 buffers a table) and no fix."""
    import lightning.pytorch as L

    from lightning_rec import DLRMModule
    from lightning_rec.data import SyntheticCriteoDataModule

    kw = dict(num_embeddings_per_feature=50, embedding_dim=4, dense_arch_layer_sizes=[8, 4],
              over_arch_layer_sizes=[4, 1])
    dm = SyntheticCriteoDataModule(num_train_samples=64, num_val_samples=32, batch_size=32,
                                   num_embeddings_per_feature=50)
    quiet = dict(default_root_dir=tmp_path, enable_progress_bar=False, enable_model_summary=False, logger=False,
                 enable_checkpointing=False, limit_val_batches=0)
    first = L.Trainer(max_steps=1, **quiet)
    first.fit(DLRMModule(**kw, managed_collision=saved), dm)
    first.save_checkpoint(tmp_path / "m.ckpt")
    module = DLRMModule(**kw, managed_collision=built)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(ValueError, match=rf"saved by a DLRMModule\(managed_collision={saved!r}\), and this one is "
                                         rf"built with managed_collision={built!r}: .*load_from_checkpoint"):
        L.Trainer(max_steps=2, **quiet).fit(module, dm, ckpt_path=tmp_path / "m.ckpt")
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())

"""Checkpoints: DCP directories and one-file checkpoints, broken or from other models; at two ranks."""

from __future__ import annotations

import contextlib
import io
import os
import warnings

from .helpers import _t, bag_cfg, make_ebc, tables_of, unchanged
from .ranks import _dmp_of, _outcome, _rank_batches, _threads, _verbs, raise_first_error, run_two_ranks
from .registry import case, expect

SMOKE = ("ckpt.load_missing_dir", "ckpt.other_tables", "ckpt.round_trip_exact")


def saved(ctx, module=None):
    from lightning_rec import checkpoint as ck

    module = module or make_ebc(opt="adagrad")
    path = ctx.tmp / "ck"
    ck.save({"state_dict": module.state_dict()}, path)
    return module, path


def checkpoint_load_cases() -> None:
    """Loads from a missing or truncated checkpoint, into other tables or dims."""
    torch = _t()
    from lightning_rec import checkpoint as ck

    @case("ckpt.load_missing_dir", (ValueError, FileNotFoundError), ["nowhere"])
    def _(ctx):
        ck.load_model(make_ebc(), ctx.tmp / "nowhere")

    @case("ckpt.metadata_truncated", (ValueError, OSError), ["ck"])
    def _(ctx):
        m, path = saved(ctx)
        md = path / ".metadata"
        md.write_bytes(md.read_bytes()[:20])
        fresh = make_ebc(opt="adagrad")
        with torch.no_grad():
            for p in fresh.parameters():
                p.add_(1.0)
        ctx.after(unchanged(fresh, tables_of(fresh), "module"))
        ck.load_model(fresh, path)

    @case("ckpt.data_file_truncated", (ValueError, OSError, RuntimeError), ["ck"])
    def _(ctx):
        m, path = saved(ctx)
        for f in path.glob("*.distcp"):
            f.write_bytes(f.read_bytes()[:16])
        ck.load_model(make_ebc(opt="adagrad"), path)

    @case("ckpt.other_tables", ValueError, ["t_zz"])
    def _(ctx):
        from lightning_rec import EmbeddingBagCollection
        m, path = saved(ctx)
        other = EmbeddingBagCollection([bag_cfg("t_zz", 10, 4, ["a"])])
        ck.load_model(other, path)

    @case("ckpt.other_dim", ValueError, ["t_a"])
    def _(ctx):
        m, path = saved(ctx)
        other = make_ebc(opt="adagrad", dims=(8, 4))
        ctx.after(unchanged(other, tables_of(other), "module"))
        ck.load_model(other, path)


def checkpoint_file_cases() -> None:
    """A round trip; export and the one-file format from the wrong files."""
    torch = _t()
    from lightning_rec import checkpoint as ck

    @case("ckpt.round_trip_exact")
    def _(ctx):
        m, path = saved(ctx)
        fresh = make_ebc(opt="adagrad")
        with torch.no_grad():
            for p in fresh.parameters():
                p.zero_()
        ck.load_model(fresh, path)
        for k, v in m.state_dict().items():
            expect(torch.equal(fresh.state_dict()[k], v), f"{k} differs after load")

    @case("ckpt.export_not_a_checkpoint", (ValueError, FileNotFoundError), ["notckpt"])
    def _(ctx):
        (ctx.tmp / "notckpt").mkdir()
        ck.export(ctx.tmp / "notckpt", ctx.tmp / "out")

    @case("ckpt.load_exported_missing_config", (ValueError, FileNotFoundError), ["config.json"])
    def _(ctx):
        (ctx.tmp / "exp").mkdir()
        (ctx.tmp / "exp" / "model.safetensors").write_bytes(b"")
        ck.load_exported(ctx.tmp / "exp")

    @case("ckpt.load_file_truncated", (ValueError, OSError, RuntimeError), ["one.ckpt"])
    def _(ctx):
        p = ctx.tmp / "one.ckpt"
        ck.save_file({"state_dict": make_ebc().state_dict()}, p)
        p.write_bytes(p.read_bytes()[:100])
        ck.load_file(p)


def rank_save_checkpoint(rank, W, path, kind):
    """Two ranks save a sharded checkpoint (plan `kind`) after one step; returns the whole tables."""
    _threads()
    from lightning_rec import checkpoint as ck
    ebc = make_ebc(opt="adagrad")
    dmp = _dmp_of(ebc, _verbs(kind), W, True)
    dmp(_rank_batches(rank)).values().sum().backward()
    ck.save({"state_dict": dmp.module.state_dict()}, path)


def saved_whole(path):
    """The whole tables of a checkpoint, read in this (non-distributed) process."""
    from lightning_rec.checkpoint import full_state_dict
    return {k: v.clone() for k, v in full_state_dict(path).items()}


def rank_load_checkpoint(rank, W, path, kind, whole):
    _threads()
    torch = _t()
    from lightning_rec import checkpoint as ck
    ebc = make_ebc(opt="adagrad")
    dmp = _dmp_of(ebc, _verbs(kind), W, True)

    def go():
        ck.load_model(dmp.module, path)
        for key, st in dmp.module.state_dict().items():
            pieces = getattr(st, "local_shards", None)
            if pieces is None:  # a replicated or plain tensor: whole
                expect(torch.equal(whole[key], st), f"rank {rank}: {key} differs")
                continue
            for meta, t in (pieces() if callable(pieces) else pieces):
                (r, c), (nr, nc) = meta.shard_offsets, meta.shard_sizes
                expect(torch.equal(whole[key][r:r + nr, c:c + nc], t), f"rank {rank}: {key} piece differs")
        return True
    return _outcome(go)


def two_rank_checkpoint_cases() -> None:
    """Two ranks save; another plan, one process or the exporter loads."""
    for save_kind, load_kind in (("tw", "rw"), ("rw", "cw")):
        @case(f"ckpt.2ranks_{save_kind}_to_{load_kind}_exact", timeout=90,
              legit="README: checkpoints load into another plan")
        def _(ctx, save_kind=save_kind, load_kind=load_kind):
            path = str(ctx.tmp / "ck")
            run_two_ranks(rank_save_checkpoint, path, save_kind)
            raise_first_error(run_two_ranks(rank_load_checkpoint, path, load_kind, saved_whole(path)))

    @case("ckpt.2ranks_to_one_process_exact", timeout=90, legit="README: into the unsharded module on one process")
    def _(ctx):
        torch = _t()
        from lightning_rec import checkpoint as ck
        path = str(ctx.tmp / "ck")
        run_two_ranks(rank_save_checkpoint, path, "rw")
        whole = saved_whole(path)
        m = make_ebc(opt="adagrad")
        ck.load_model(m, path)
        for k, v in m.state_dict().items():
            expect(torch.equal(v, whole[k]), f"{k} differs after loading 2 ranks' checkpoint in one process")

    @case("ckpt.2ranks_one_rank_file_missing", ValueError, ["missing", ".distcp"], timeout=90)
    def _(ctx):
        from lightning_rec import checkpoint as ck
        path = ctx.tmp / "ck"
        run_two_ranks(rank_save_checkpoint, str(path), "tw")
        files = sorted(path.glob("*.distcp"))
        files[-1].unlink()
        m = make_ebc(opt="adagrad")
        ctx.after(unchanged(m, tables_of(m), "module"))
        ck.load_model(m, path)

    @case("ckpt.export_real_checkpoint_cli", timeout=90, legit="lightning-rec export of a 2-rank DCP checkpoint")
    def _(ctx):
        torch = _t()
        from lightning_rec import checkpoint as ck
        from lightning_rec import cli as cli_mod
        path = ctx.tmp / "ck"
        run_two_ranks(rank_save_checkpoint, str(path), "cw")
        whole = saved_whole(path)
        with contextlib.redirect_stdout(io.StringIO()):
            cli_mod.export_main([str(path), str(ctx.tmp / "out")])
        from safetensors.torch import load_file
        got = load_file(str(ctx.tmp / "out" / "model.safetensors"))
        for k, v in whole.items():
            expect(k in got and torch.equal(got[k], v), f"exported {k} differs")
        expect(ck is not None, "")


def _own_pieces(dmp, optimizer):
    """This rank's table pieces and fused state pieces, by name and place."""
    out = {}
    for k, v in dmp.module.state_dict().items():
        for m, t in getattr(v, "local_shards", [(None, v)]):
            out[f"{k}@{None if m is None else m.shard_offsets}"] = t.detach().clone()
    for k, (_, parts) in optimizer.global_state_pieces().items():
        out.update({f"{k}@{None if m is None else m.shard_offsets}": t.clone() for m, t in parts})
    return out


def rank_resume_column_wise(rank, W, path):
    """Rowwise Adagrad on a column-wise table: save, one more step; then a fresh model loads and takes that step."""
    _threads()
    torch = _t()
    from lightning_rec import checkpoint as ck
    from lightning_rec.optim import FusedOptimizer

    def built():
        dmp = _dmp_of(make_ebc(opt="rowwise_adagrad"), _verbs("cw"), W, False)
        return dmp, FusedOptimizer(dmp)

    def go():
        def step(dmp, batch_of):  # squared: each column gets its own gradient (a plain sum gives every column ones)
            (dmp(_rank_batches(batch_of)).values() ** 2).sum().backward()

        dmp, optimizer = built()
        step(dmp, rank)
        ck.save({"state_dict": dmp.module.state_dict()}, path, optimizers=[optimizer])
        step(dmp, 1 - rank)
        want = _own_pieces(dmp, optimizer)
        dmp, optimizer = built()
        ck.load_model(dmp.module, path)
        ck.load_optimizer(optimizer, path)
        step(dmp, 1 - rank)
        got = _own_pieces(dmp, optimizer)
        for k, v in want.items():
            expect(torch.equal(got[k], v), f"rank {rank}: {k} differs from the uninterrupted run's after resuming")
        return True
    return _outcome(go)


def rank_zero_reads_whole(rank, W, path, done):
    """Rank 0 alone reads the checkpoint whole while rank 1 goes on (no collective) until it is done."""
    import time

    import torch.distributed as dist
    _threads()
    rank_save_checkpoint(rank, W, path, "cw")
    if rank == 1:
        deadline = time.monotonic() + 40
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
        dist.barrier()
        return ("ok", None, "", 0.0)
    from lightning_rec.checkpoint import full_state_dict
    try:
        out = _outcome(lambda: sorted(full_state_dict(path)))
    finally:
        open(done, "w").close()
    dist.barrier()
    return out


def rank_saves_to_its_own_disk(rank, W, root):
    """Each rank's `last.ckpt` is another directory (its own disk): the save must refuse on every rank."""
    _threads()
    own = os.path.join(root, f"host{rank}")
    os.makedirs(own)
    os.chdir(own)
    from lightning_rec import checkpoint as ck
    dmp = _dmp_of(make_ebc(opt="adagrad"), _verbs("rw"), W, False)
    return _outcome(lambda: ck.save({"state_dict": dmp.module.state_dict()}, "last.ckpt"))


def resume_and_cut_short_cases() -> None:
    """An exact resume of a column-wise table, whole reads on one rank, node-local disks, files cut short."""
    torch = _t()
    from lightning_rec import checkpoint as ck

    @case("ckpt.2ranks_cw_rowwise_adagrad_resume_bitwise", timeout=90,
          legit="README: a resume is bitwise (each column shard keeps its own row-wise state)")
    def _(ctx):
        raise_first_error(run_two_ranks(rank_resume_column_wise, str(ctx.tmp / "ck")))

    @case("ckpt.2ranks_full_state_dict_on_rank_zero_only", timeout=90,
          legit="full_state_dict is one process's read: rank 0 alone may call it inside a job")
    def _(ctx):
        names = raise_first_error(run_two_ranks(rank_zero_reads_whole, str(ctx.tmp / "ck"), str(ctx.tmp / "done")),
                                  max_s=10)[0]
        expect(names == ["embedding_bags.t_a.weight", "embedding_bags.t_b.weight"], f"full_state_dict gave {names}")

    @case("ckpt.2ranks_save_to_node_local_disks", ValueError, ["rank(s) [1]", "shared storage"], timeout=90)
    def _(ctx):
        raise_first_error(run_two_ranks(rank_saves_to_its_own_disk, str(ctx.tmp)), need_all=True)

    @case("ckpt.one_file_cut_short_load_from_checkpoint", ValueError, ["cut.ckpt", "incomplete", "copy it again"])
    def _(ctx):
        from lightning_rec.models.dlrm_module import DLRMModule
        p = ctx.tmp / "cut.ckpt"
        torch.save({"state_dict": make_ebc().state_dict(), "pytorch-lightning_version": "2.6.0"}, p)
        p.write_bytes(p.read_bytes()[:-64])
        DLRMModule.load_from_checkpoint(p)

    for name in ("config.json", "model.safetensors"):
        @case(f"ckpt.export_{name.replace('.', '_')}_cut_short", ValueError, [name, "incomplete", "export again"])
        def _(ctx, name=name):
            ck.save_file({"state_dict": make_ebc().state_dict()}, ctx.tmp / "one.ckpt")
            with warnings.catch_warnings():  # (it names no LightningModule class: module= below)
                warnings.simplefilter("ignore")
                out = ck.export(ctx.tmp / "one.ckpt", ctx.tmp / "out")
            whole = (out / name).read_bytes()
            (out / name).write_bytes(whole[: len(whole) // 2])
            ck.load_exported(out, module=make_ebc())


CASES = (checkpoint_load_cases, checkpoint_file_cases, two_rank_checkpoint_cases, resume_and_cut_short_cases)

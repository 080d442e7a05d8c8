"""Checkpoints: DCP directories and one-file checkpoints, broken or from other models; at two ranks."""

from __future__ import annotations

import contextlib
import io

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


CASES = (checkpoint_load_cases, checkpoint_file_cases, two_rank_checkpoint_cases)

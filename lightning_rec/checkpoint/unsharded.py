"""A checkpoint read whole on one process (no torch.distributed): the state dict, Lightning's one-file dict, the
LightningModule rebuilt from it, and an export for inference (`model.safetensors` + `config.json`)."""

from __future__ import annotations

import importlib
import io
import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_rec.checkpoint.format import module_class as _checkpoint_class
from lightning_rec.checkpoint.paths import readable_path
from lightning_rec.checkpoint.reader import full_model_state


def _existing(path: str | os.PathLike) -> Path:
    path = readable_path(path)
    if not path.exists():
        raise ValueError(f"checkpoint {path} does not exist")
    return path


def full_state_dict(path: str | os.PathLike) -> dict[str, Tensor]:
    """The model's state dict with every table whole (CPU), from a DCP directory or a gathered file.

    One process, no torch.distributed; it holds the whole model (for inspection, comparison, export). Inside a job
    any one rank may call it alone: it reads the files without the other ranks.
    """
    return full_model_state(_existing(path))[0]


def lightning_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint at `path` as the dict a one-file Lightning checkpoint holds (what `torch.load` of one
    gives): every table whole (CPU) in "state_dict", and Lightning's other keys (epoch, global_step,
    hyper_parameters, loops, callbacks). No optimizer state, and no rank's dataloader position or random
    number generators: for weights and evaluation, not for resuming (`Trainer(strategy="rec")` resumes).

    One process, no torch.distributed; it holds the whole model.
    """
    state, meta = full_model_state(_existing(path))
    drop = ("state_dict", "optimizer_states", "lightning_rec")
    out = {**{k: v for k, v in meta.items() if k not in drop}, "state_dict": state}
    if "pytorch-lightning_version" not in out:  # written by save() from a hand loop: Lightning's readers need it
        import lightning

        out["pytorch-lightning_version"] = lightning.__version__
    return out


def load_from_checkpoint(cls: type, path: str | os.PathLike, map_location: Any = None, hparams_file: Any = None,
                         strict: bool | None = None, weights_only: bool | None = None, **kwargs: Any) -> Any:
    """`cls.load_from_checkpoint(path, ...)` for a checkpoint directory that `strategy="rec"` wrote: the
    LightningModule rebuilt from its hyperparameters, unsharded, on one process (no torch.distributed).

    Lightning's `load_from_checkpoint` reads one file (`torch.load`), so it fails on a directory
    (IsADirectoryError); this hands it the whole checkpoint instead and keeps all of its behaviour
    (`**kwargs` override hyperparameters, `strict`, `map_location`, `on_load_checkpoint`).
    DLRMModule.load_from_checkpoint and TwoTowerModule.load_from_checkpoint call it themselves.
    """
    checkpoint = lightning_checkpoint(path)
    hparams = checkpoint.get("hyper_parameters") or {}
    if hparams.get("embedding_device") == "meta" and "embedding_device" not in kwargs:
        kwargs["embedding_device"] = "cpu"  # one unsharded module: its tables take the checkpoint's values
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    # a file-like object: RecModuleHooks' load_from_checkpoint passes it on to Lightning's
    return cls.load_from_checkpoint(buffer, map_location=map_location, hparams_file=hparams_file, strict=strict,
                                    weights_only=weights_only, **kwargs)


def _is_table(key: str) -> bool:
    return ".embedding_bags." in key or ".embeddings." in key


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _write_weights(state: Mapping[str, Tensor], out: Path, tables: str) -> None:
    from safetensors.torch import save_file

    from lightning_rec.serving.quant import quantize_state

    tensors = quantize_state(state, tables)  # a dim the kernel cannot take is refused before anything is written
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    # safetensors creates the file 0600; an export is meant to be served, so the user's umask decides, as for
    # config.json
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(out / "model.safetensors", 0o666 & ~mask)


def _class_name(cls: type | str | None) -> str | None:
    return cls if cls is None or isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"


def _resolved(class_path: str) -> Any:
    """The class a dotted path names (a re-exported one, lightning_rec.models.DLRMModule, included), else the path."""
    mod_name, _, cls_name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(mod_name), cls_name)
    except (ImportError, AttributeError, ValueError):
        return class_path


def _check_output(checkpoint: Path, out: Path, overwrite: bool) -> None:
    if checkpoint.resolve() in (out.resolve(), *out.resolve().parents):
        # its two files in a checkpoint directory made resume and load_from_checkpoint take it for an export
        raise ValueError(f"export's output {out} is the checkpoint {checkpoint} or inside it: its model.safetensors "
                         f"and config.json would make the checkpoint read as an export (resume and loading refuse "
                         f"it); give export a directory outside it, e.g. {checkpoint.parent / 'export'}")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file: give export a directory to write model.safetensors and config.json in")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"export's output {out} exists and is not empty: give a new directory, or pass "
                         f"overwrite=True (--overwrite) to replace what an earlier export wrote there")


def export(checkpoint: str | os.PathLike, out: str | os.PathLike, fp16_tables: bool = False, *,
           tables: str | None = None, overwrite: bool = False, module_class: type | str | None = None,
           package: bool = False) -> Path:
    """Write an unsharded model for inference: `out/model.safetensors` + `out/config.json`.

    Reads a DCP checkpoint directory (or an old gathered file) on one process, without
    torch.distributed. `config.json` holds the LightningModule's class and init arguments;
    `load_exported(out)` rebuilds the module on CPU and loads the weights. tables: how embedding tables are
    stored, "fp32" (default), "fp16" (half the size; loading casts them back), "int8" or "int4" (row-wise
    quantized, a float16 scale and bias per row: loading serves them with fbgemm's integer kernel, see
    lightning_rec.serving). fp16_tables=True is tables="fp16". An `out` that exists and is not empty is refused
    unless overwrite=True. module_class: the LightningModule class expected (refused if the checkpoint names
    another). package: also `out/model.pt2` (a DLRM or multi-task ranker) or `out/user_tower.pt2` +
    `out/item_tower.pt2` (a two-tower model), the network compiled by AOTInductor for a process without
    lightning_rec (lightning_rec.serving.package).
    """
    from lightning_rec.serving.quant import TABLE_TYPES

    if tables is None:
        tables = "fp16" if fp16_tables else "fp32"
    elif fp16_tables and tables != "fp16":
        raise ValueError(f"fp16_tables=True and tables={tables!r} disagree: give one of them")
    if tables not in TABLE_TYPES:
        raise ValueError(f"tables={tables!r}: give one of {', '.join(TABLE_TYPES)}")
    checkpoint, out = _existing(checkpoint), Path(out)
    _check_output(checkpoint, out, overwrite)
    state, meta = full_model_state(checkpoint)
    class_path = _checkpoint_class(meta)
    expected = _class_name(module_class)
    if expected is not None and class_path is not None and _resolved(class_path) is not _resolved(expected):
        raise ValueError(f"{checkpoint} is a checkpoint of {class_path}, not of {expected}: export it as "
                         f"{class_path.rpartition('.')[2]}, or give the checkpoint {expected} wrote")
    _write_weights(state, out, tables)
    # LightningCLI adds its own keys (`_class_path`, `_instantiator`): not init arguments
    hparams = {k: v for k, v in (meta.get("hyper_parameters") or {}).items() if not str(k).startswith("_")}
    if hparams.get("embedding_device") == "meta":
        hparams["embedding_device"] = "cpu"  # an export is one unsharded module: its tables are the file's values
    if class_path is None:
        warnings.warn(f"{checkpoint} does not say which LightningModule wrote it (saved by plain Lightning from "
                      f"Python, without strategy='rec', or by checkpoint.save(...) without module_class='pkg.Module'): "
                      f"{out}/config.json names no class, so load it with "
                      f"load_exported({str(out)!r}, module=YourModule(...))", stacklevel=2)
    config = {"class_path": class_path, "init_args": _jsonable(hparams), "tables": tables,
              "fp16_tables": tables == "fp16", "source": str(checkpoint), "epoch": meta.get("epoch"),
              "global_step": meta.get("global_step")}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if package:
        _write_packages(out, class_path, hparams, state, tables)
    return out


def _write_packages(out: Path, class_path: str | None, hparams: dict, state: Mapping[str, Tensor],
                    tables: str) -> None:
    from lightning_rec.serving.package import export_package

    if class_path is None:
        raise ValueError(f"a package needs the model's class, which the checkpoint does not name: build the module "
                         f"and call lightning_rec.serving.package.export_package(module, {str(out / 'model.pt2')!r})")
    module = _resolved(class_path)(**hparams)
    module.load_state_dict(state)
    net = getattr(module, "model", module)
    if hasattr(net, "user_tower"):
        for tower in ("user", "item"):
            export_package(module, out / f"{tower}_tower.pt2", tables, tower=tower, overwrite=True)
    else:
        export_package(module, out / "model.pt2", tables, overwrite=True)


def _damaged_export(file: Path, error: BaseException, source: Any) -> str:
    return (f"export file {file} ({file.stat().st_size} bytes) is incomplete or damaged ({type(error).__name__}: "
            f"{error}): it was probably cut short by an interrupted copy or export (a full disk). Copy the export "
            f"again from where it was written, or export again: lightning-rec export {source or 'CHECKPOINT'} "
            f"{file.parent}")


def load_exported(path: str | os.PathLike, module: torch.nn.Module | None = None) -> torch.nn.Module:
    """The module of an `export` directory, on CPU, in eval mode (no torch.distributed needed). An int8 / int4
    export's tables are QuantEmbeddingBagCollections (lightning_rec.serving) holding the stored rows."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file as load_safetensors

    path = Path(path)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise ValueError(f"{path} is not an export directory (needs config.json and model.safetensors): "
                         f"write one with `lightning-rec export CHECKPOINT {path}`")
    try:
        config = json.loads((path / "config.json").read_text())
    except (ValueError, OSError) as e:  # (JSONDecodeError and UnicodeDecodeError are ValueErrors)
        raise ValueError(_damaged_export(path / "config.json", e, None)) from e
    if module is None:
        if not config.get("class_path"):
            raise ValueError(f"{path}/config.json names no LightningModule class (its checkpoint did not say): pass "
                             f"the module to load into, load_exported({str(path)!r}, module=YourModule(...))")
        mod_name, _, cls_name = config["class_path"].rpartition(".")
        cls = getattr(importlib.import_module(mod_name), cls_name)
        module = cls(**config["init_args"])
    try:
        state = load_safetensors(str(path / "model.safetensors"))
    except (SafetensorError, OSError) as e:
        raise ValueError(_damaged_export(path / "model.safetensors", e, config.get("source"))) from e
    tables = config.get("tables", "fp16" if config.get("fp16_tables") else "fp32")
    if tables in ("int8", "int4"):  # served from the stored rows by fbgemm's integer kernel
        from lightning_rec.serving.quant import load_quantized_state

        return load_quantized_state(module, state, tables).eval()
    live = module.state_dict()
    state = {k: v.to(live[k].dtype) if k in live and v.dtype != live[k].dtype else v for k, v in state.items()}
    module.load_state_dict(state)
    return module.eval()


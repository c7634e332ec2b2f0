"""LoRA's files (Plan.lora; docs/lora.md): a training checkpoint of the adapters alone (fp32
adapters with their AdamW m and v in one safetensors file, the step, the optimizer and schedule,
and the base model's identity: its config hash and source directory), the PEFT adapter
directory (adapter_config.json + adapter_model.safetensors, loadable by peft's
PeftModel.from_pretrained) and merged Hugging Face weights. Every directory is written in a
hidden temporary beside its place and renamed in whole, so an error leaves nothing half-written.
Never decides placement and never touches a device (the Engine reads and writes the state)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np

from dataflow import checkpoint as ckpt
from dataflow.checkpoint_dir import check_checkpoint_root
from dataflow.lr_schedule import schedule_from_dict, schedule_to_dict
from dataflow.memplan.plan.lora import HF_NAMES, Lora
from dataflow.kernels.reference.lora import merged_weight
from dataflow.models.errors import ConfigError
from dataflow.models.layout import BlockKind, layer_layout
from dataflow.models.safetensors_io import SafetensorsFile, save_file
from dataflow.models.serial import from_dict, stable_hash, to_dict

FORMAT = "dataflow-lora-checkpoint"
FORMAT_VERSION = 1
META = "lora_checkpoint.json"
STATE = "lora_state.safetensors"


def base_identity(eng) -> dict:
    """What names the base model a LoRA run trains on: its config's hash (and the config), the
    directory it came from, when it came from one, and its storage ('bf16', or 'fp8': the
    FP8-rounded base the adapters were trained against, Lora.base)."""
    cfg = eng.plan.model
    source = getattr(eng, "model_source", None)
    return {"config_hash": stable_hash(cfg), "model": cfg.name,
            "source": None if source is None else str(source.path),
            "storage": eng.plan.lora.base.value}


def save_lora_checkpoint(eng, root, *, data=None, rng=None, extra=None, keep=None,
                         force_dir: bool = False) -> Path:
    """Write `root/step_<step>`: lora_state.safetensors (every adapter's a / b and its AdamW m
    and v, fp32, Engine.lora_state's names) and lora_checkpoint.json (step, Lora, optimizer,
    schedule, base identity, data / rng / extra), then its seal; returns the path."""
    keep, rng = ckpt.checked_keep(keep), ckpt.rng_state(rng)
    check_checkpoint_root(str(root), force=force_dir, way_out="pass force_dir=True")
    root, step, opt = Path(root), eng.optimizer.step_count, eng.optimizer
    state = {k: v for k, v in eng.lora_state().items() if not k.endswith(".grad")}
    tmp = ckpt.new_temp_dir(root, step)
    try:
        save_file(state, tmp / STATE)
        meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": step,
                "lora": to_dict(eng.plan.lora), "base": base_identity(eng),
                "plan_hash": eng.plan.hash, "optimizer": to_dict(opt.config),
                "schedule": None if opt.schedule is None else schedule_to_dict(opt.schedule),
                "data": data, "rng": rng, "extra": extra,
                "state_sha256": ckpt._hash_file(tmp / STATE)}
        body = (json.dumps(meta, indent=1, sort_keys=True) + "\n").encode()
        sha = ckpt.write_bytes(tmp / META, body)
        ckpt.write_bytes(tmp / ckpt.SEAL, (sha + "\n").encode())
        final = root / ckpt.step_dir_name(step)
        ckpt.move_into_place(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    ckpt.finish(root, final, keep)
    return final


def is_lora_checkpoint(path) -> bool:
    return (Path(path) / META).is_file()


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LoraCheckpointInfo:
    """What load_lora_checkpoint restored (the fields dataflow.checkpoint.CheckpointInfo's
    readers use)."""

    path: str
    step: int
    plan_hash: str
    base: dict
    """The base model's identity (base_identity) the adapters were trained on."""
    data: object = None
    rng: object = None
    extra: object = None


def load_lora_checkpoint(eng, path) -> LoraCheckpointInfo:
    """Restore adapters, their AdamW m and v, the step count and the schedule from a
    checkpoint written by save_lora_checkpoint (a step directory, or the newest under a root).
    Refused by name, with nothing written: another base model (config hash), another base
    storage (bf16 / fp8), another Lora, a damaged state file."""
    path = ckpt.resolve_checkpoint(path) if not is_lora_checkpoint(path) else Path(path)
    meta_file = path / META
    if not meta_file.is_file():
        raise ConfigError(f"{path} holds no {META}: not a LoRA checkpoint (a full one loads "
                          "with load_checkpoint on an engine without lora=)")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"{meta_file}: format {meta.get('format')!r} v"
                          f"{meta.get('format_version')} is not {FORMAT} v{FORMAT_VERSION}")
    ours = base_identity(eng)
    if meta["base"]["config_hash"] != ours["config_hash"]:
        raise ConfigError(f"LoRA checkpoint {path} was trained on base model "
                          f"'{meta['base']['model']}' (config {meta['base']['config_hash']}, "
                          f"from {meta['base']['source']}); this engine's base is "
                          f"'{ours['model']}' (config {ours['config_hash']}); build the engine "
                          "from that base")
    theirs = meta["base"].get("storage", "bf16")  # written before fp8 bases: bf16
    if theirs != ours["storage"]:
        raise ConfigError(f"LoRA checkpoint {path} was trained on the {theirs} base storage; "
                          f"this engine stores its base in {ours['storage']} (the FP8-rounded "
                          "base is another model); build the engine with "
                          f"lora=dict(..., base='{theirs}') or --lora-base {theirs}")
    saved = from_dict(Lora, meta["lora"], where="checkpoint lora")
    if saved != eng.plan.lora:
        raise ConfigError(f"LoRA checkpoint {path} holds adapters {saved}; this engine has "
                          f"{eng.plan.lora}; build it with lora=dict(rank={saved.rank}, "
                          f"alpha={saved.alpha:g}, targets='{saved.spec()}')")
    if ckpt._hash_file(path / STATE) != meta["state_sha256"]:
        raise ConfigError(f"{path / STATE} does not match its sha256 in {META}: damaged; "
                          "resume from another checkpoint")
    f = SafetensorsFile(path / STATE)
    eng.load_lora_state({k: np.array(f.tensor(k)) for k in f.names()})
    eng.optimizer.step_count = int(meta["step"])
    if meta.get("schedule") is not None and eng.optimizer.schedule is None:
        eng.optimizer.schedule = schedule_from_dict(meta["schedule"])
    return LoraCheckpointInfo(path=str(path), step=int(meta["step"]),
                              plan_hash=meta["plan_hash"], base=meta["base"],
                              data=meta.get("data"), rng=meta.get("rng"),
                              extra=meta.get("extra"))


# -- PEFT export --------------------------------------------------------------------------
def peft_config(lora: Lora, base_model: str) -> dict:
    """adapter_config.json's fields, as peft's LoraConfig.save_pretrained writes them."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": 0.0, "bias": "none",
            "target_modules": sorted(HF_NAMES[t].split(".")[1] for t in lora.targets),
            "base_model_name_or_path": base_model, "fan_in_fan_out": False,
            "init_lora_weights": True, "inference_mode": True, "use_rslora": False,
            "use_dora": False, "modules_to_save": None, "layers_to_transform": None,
            "rank_pattern": {}, "alpha_pattern": {}, "revision": None}


def peft_tensors(lora: Lora, n_layers: int, adapters: dict) -> dict[str, np.ndarray]:
    """adapter_model.safetensors' tensors: base_model.model.model.layers.{i}.<module>.lora_A /
    lora_B.weight, A (r, in) and B (out, r) in fp32."""
    out = {}
    for i in range(n_layers):
        for t in lora.targets:
            stem = f"base_model.model.model.layers.{i}.{HF_NAMES[t]}"
            out[f"{stem}.lora_A.weight"] = np.ascontiguousarray(adapters[f"layers.{i}.{t}.a"],
                                                                np.float32)
            out[f"{stem}.lora_B.weight"] = np.ascontiguousarray(adapters[f"layers.{i}.{t}.b"],
                                                                np.float32)
    return out


def _atomic_dir(path: Path, write, overwrite: bool) -> Path:
    """Run write(tmp) on a hidden temporary beside `path`, then rename it into place."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise ConfigError(f"{path} exists; pass overwrite=True or choose a new directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{np.random.default_rng().integers(1 << 30):x}"
    tmp.mkdir()
    try:
        write(tmp)
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def export_peft(eng, path, *, base_model: str | None = None, overwrite: bool = False) -> Path:
    """Write the engine's adapters as a PEFT adapter directory at `path` (atomic).
    base_model: adapter_config.json's base_model_name_or_path (default: the directory the
    base came from, else its name)."""
    lora = eng.plan.lora
    if lora is None:
        raise ConfigError("export_peft: this engine has no LoRA adapters; build it with lora=R")
    ident = base_identity(eng)
    base = base_model or ident["source"] or ident["model"]
    tensors = peft_tensors(lora, eng.plan.model.n_layers, eng.lora_state())

    def write(tmp: Path) -> None:
        (tmp / "adapter_config.json").write_text(
            json.dumps(peft_config(lora, base), indent=2, sort_keys=True) + "\n")
        save_file(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
    return _atomic_dir(path, write, overwrite)


def merged_blocks(cfg, lora: Lora, blocks, adapters: dict):
    """(kind, layer, weights) of `blocks` (Engine's pretrained blocks) with every adapted linear
    of each layer replaced by w + s b a in bf16 (PEFT's merge_and_unload), one block at a time."""
    lay = layer_layout(cfg)
    for kind, layer, block in blocks:
        if kind is BlockKind.LAYER:
            block = np.array(block)
            views = lay.views(block)
            for t in lora.targets:
                name = HF_NAMES[t]
                views[name][...] = merged_weight(views[name], adapters[f"layers.{layer}.{t}.a"],
                                                 adapters[f"layers.{layer}.{t}.b"], lora.scale)
        yield kind, layer, block

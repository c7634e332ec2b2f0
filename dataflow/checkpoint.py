"""Training checkpoints: weights, AdamW m and v, step, lr schedule, data position, RNG state,
plan hash and config, written block by block through the Engine's public block API (so host
memory grows by one block, never by the model) into a temporary directory that is renamed into
place only when complete, with a sha256 per file. Never damages an existing checkpoint, never
deletes a directory it did not name, and never loads bytes that disagree with their checksum.

Layout of one checkpoint, `<root>/step_00000042/`:
    embed.bin, layer_000.bin, ..., head.bin       weights: together with config.json and
                                                  manifest.json a dataflow.models.storage model directory
    embed.m.bin, embed.v.bin, layer_000.m.bin ... AdamW m and v, same layout as the weights
    checkpoint.json                               step, plan, optimizer, schedule, data, rng, and
                                                  every file above with its size and sha256
    source/config.json, source/tokenizer.json ... the Hugging Face files of the directory the
                                                  model was imported from (models.hf_export
                                                  SOURCE_FILES that existed), byte for byte, so
                                                  dataflow-export writes a loadable directory
                                                  after the source moved; absent otherwise
    checkpoint.json.sha256                        sha256 of checkpoint.json: written last, so a
                                                  checkpoint without it was never sealed
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from dataflow.blocks import block_parts
from dataflow.checkpoint_dir import STEP_DIR, TEMP_DIR, check_checkpoint_root
from dataflow.lr_schedule import schedule_from_dict, schedule_to_dict
from dataflow.optimizer import AdamWConfig
from dataflow.models.atomic_io import write_hashed
from dataflow.models.config import ModelConfig
from dataflow.models.errors import ChecksumError, ConfigError
from dataflow.models.hf_config import is_hf_dir
from dataflow.models.hf_export import ModelSource, read_source
from dataflow.models.init import BF16
from dataflow.models.layout import BlockKind
from dataflow.models.serial import from_dict, to_dict, to_json
from dataflow.models.storage import FORMAT as MODEL_FORMAT
from dataflow.models.storage import FORMAT_VERSION as MODEL_FORMAT_VERSION
from dataflow.models.storage import block_file

log = logging.getLogger(__name__)

FORMAT = "dataflow-checkpoint"
FORMAT_VERSION = 1
META = "checkpoint.json"
SEAL = "checkpoint.json.sha256"
_PIECE_BYTES = 64 << 20
"""Files are read and hashed in 64 MiB pieces (hashlib releases the GIL on them); written in
dataflow.models.atomic_io's pieces of the same size."""
_STEP_DIR, _TEMP_DIR = STEP_DIR, TEMP_DIR
_DTYPES = {"bfloat16": BF16, "float32": np.dtype(np.float32)}
SOURCE_DIR = "source"
"""The checkpoint's copy of its model's Hugging Face files (see the layout above)."""


class ModelMismatchError(ConfigError):
    """A checkpoint of another model than the engine's: `checkpoint_model` and `engine_model`
    (ModelConfigs), and the fields where they differ."""

    def __init__(self, path: Path, checkpoint_model: ModelConfig, engine_model: ModelConfig):
        self.path, self.checkpoint_model, self.engine_model = path, checkpoint_model, engine_model
        ours, theirs = to_dict(engine_model), to_dict(checkpoint_model)
        self.differences = [f"{k} {theirs.get(k)!r} vs {ours.get(k)!r}"
                            for k in sorted(set(ours) | set(theirs))
                            if k != "name" and ours.get(k) != theirs.get(k)]
        super().__init__(f"checkpoint {path} is for model '{checkpoint_model.name}', this engine "
                         f"runs '{engine_model.name}' ({'; '.join(self.differences[:4])}); "
                         f"build the Engine for '{checkpoint_model.name}' (or from the "
                         "checkpoint itself), or save to another checkpoint directory")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointInfo:
    """What a checkpoint holds besides the arrays (returned by load_checkpoint)."""

    path: str
    step: int
    """Optimizer steps taken when it was saved; the next train_step is step + 1."""
    plan_hash: str
    """Hash of the plan it was saved under (a different plan may load it)."""
    model: ModelConfig
    optimizer: AdamWConfig
    schedule: dict | None
    """The lr schedule as dataflow.lr_schedule.schedule_to_dict wrote it, or None."""
    data: dict | None
    """The data source's position (its state()), as the caller passed it."""
    rng: dict | None
    """A NumPy bit generator's state, as the caller passed it."""
    extra: dict | None


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Sealed checkpoints under `root`, oldest step first (unsealed or temporary ones skipped)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and p.is_dir() and (p / SEAL).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory itself, or the newest sealed one under a checkpoint root."""
    path = Path(path)
    if (path / META).is_file() or (path / SEAL).is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise ConfigError(f"no checkpoint at {path}: it holds neither {META} nor sealed step_* "
                          "directories; pass a directory written by save_checkpoint")
    return latest


# -- saving -------------------------------------------------------------------------------------
def save_checkpoint(eng, root: str | Path, *, data: dict | None = None, rng=None,
                    extra: dict | None = None, keep: int | None = None,
                    force_dir: bool = False, failed_step: dict | None = None) -> Path:
    """Write the engine's state to `root/step_<step>` and return that path.

    data: the data source's state() (JSON-able). rng: a numpy Generator (its bit generator's
    state is stored) or such a state dict. extra: any JSON-able dict. keep: afterwards delete
    the oldest sealed checkpoints under root so that `keep` remain. A save that fails or is
    killed leaves at most a hidden `.step_*.tmp-*` directory, removed by a later save.
    A root that holds anything but checkpoints (a model, other files) is refused, nothing
    written, unless force_dir. failed_step: the failed step a forced save comes after
    ({"step", "reason"}), recorded in checkpoint.json so a load can warn."""
    keep, rng = checked_keep(keep), rng_state(rng)
    check_checkpoint_root(str(root), force=force_dir, way_out="pass force_dir=True")
    root = Path(root)
    step = eng.optimizer.step_count
    tmp = new_temp_dir(root, step)
    try:
        files, manifest_blocks = write_block_files(eng, eng.block_refs(), tmp)
        meta = checkpoint_meta(eng.optimizer, eng.plan, step, data, rng, extra)
        if failed_step is not None:
            meta["failed_step"] = failed_step
        seal(tmp, eng.plan.model, files, manifest_blocks, meta, source=eng.model_source)
        final = root / step_dir_name(step)
        move_into_place(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finish(root, final, keep)
    return final


def checked_keep(keep):
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ConfigError(f"keep must be a positive integer or None, got {keep!r}")
    return keep


def rng_state(rng) -> dict | None:
    """A numpy Generator's bit generator state, or the state dict itself, or None."""
    return rng if rng is None or isinstance(rng, dict) else rng.bit_generator.state


def temp_dir_name(step: int, pid: int, tag: str) -> str:
    """`.step_<step>.tmp-<pid>-<tag>`: hidden, and removable once process `pid` is gone."""
    return f".{step_dir_name(step)}.tmp-{pid}-{tag}"


def new_temp_dir(root: Path, step: int, pid: int | None = None, tag: str | None = None) -> Path:
    """Create `root` if needed, remove temporaries that dead saves left there, and create this
    save's temporary directory (named for process `pid`, default this one)."""
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(root)
    tmp = root / temp_dir_name(step, os.getpid() if pid is None else pid,
                               uuid.uuid4().hex[:8] if tag is None else tag)
    tmp.mkdir()
    return tmp


def write_block_files(eng, refs, directory: Path) -> tuple[list[dict], list[dict]]:
    """Write weights, m and v of each block of `refs` (through eng.read_block, one block in host
    memory at a time) into `directory`: (file entries for checkpoint.json, weight entries for
    the model manifest), in the order of `refs`."""
    files, manifest_blocks = [], []
    for ref in refs:
        lay = eng.layout(ref)
        base = block_file(ref.kind, ref.layer)
        for part in block_parts(_plan_of(eng), ref.kind, ref.layer):  # frozen: weights alone
            array = eng.read_block(ref, part)
            name = base if part == "weights" else base.replace(".bin", f".{part}.bin")
            nbytes, sha = _write_file(directory / name, array)
            files.append({"file": name, "block": ref.name, "part": part,
                          "dtype": _dtype_name(array.dtype, name), "numel": int(array.size),
                          "nbytes": nbytes, "sha256": sha})
            if part == "weights":
                manifest_blocks.append(_manifest_entry(lay, ref.layer, nbytes, sha))
            del array
    return files, manifest_blocks


def checkpoint_meta(optimizer, plan, step: int, data, rng, extra) -> dict:
    """checkpoint.json's fields besides the file list."""
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "step": step,
            "plan_hash": plan.hash, "plan": json.loads(plan.to_json()),
            "frozen": plan.frozen.spec(),
            "optimizer": to_dict(optimizer.config),
            "schedule": _schedule_record(optimizer.schedule),
            "data": data, "rng": rng, "extra": extra}


def seal(tmp: Path, cfg: ModelConfig, files: list[dict], manifest_blocks: list[dict],
         meta: dict, source: ModelSource | None = None) -> None:
    """Complete a checkpoint whose block files are in `tmp`: write config.json and manifest.json
    (the weights then form a dataflow.models.storage model directory), the `source` files under
    source/ (its path in checkpoint.json's "source"), checkpoint.json with `meta`, the model and
    every file's size and sha256, and last the seal."""
    manifest = {"format": MODEL_FORMAT, "format_version": MODEL_FORMAT_VERSION,
                "byte_order": "little", "blocks": manifest_blocks}
    files = list(files)
    written = [("config.json", (to_json(cfg) + "\n").encode()),
               ("manifest.json", (json.dumps(manifest, indent=1) + "\n").encode())]
    if source is not None:
        (tmp / SOURCE_DIR).mkdir()
        written += [(f"{SOURCE_DIR}/{name}", body) for name, body in source.files]
    for name, body in written:
        files.append({"file": name, "nbytes": len(body), "sha256": write_bytes(tmp / name,
                                                                               body)})
    meta = {**meta, "model": to_dict(cfg), "files": files,
            **({} if source is None else {"source": {"path": source.path}})}
    body = (json.dumps(meta, indent=1, sort_keys=True) + "\n").encode()
    sha = write_bytes(tmp / META, body)
    write_bytes(tmp / SEAL, (sha + "\n").encode())  # last: the checkpoint is now whole
    _fsync_dir(tmp)


def finish(root: Path, final: Path, keep: int | None) -> None:
    """After `final` is in place: make the rename durable, then keep the newest `keep`."""
    _fsync_dir(root)
    if keep is not None:
        for old in list_checkpoints(root)[:-keep]:
            if old != final:
                shutil.rmtree(old)


def _schedule_record(schedule) -> dict | None:
    try:
        return schedule_to_dict(schedule)
    except ConfigError:
        # A plain callable cannot be stored; record what it was so a resume can say so.
        return {"kind": "callable", "repr": repr(schedule)}


def _dtype_name(dtype, name: str) -> str:
    for key, dt in _DTYPES.items():
        if np.dtype(dtype) == dt:
            return key
    raise ConfigError(f"block file {name}: dtype {dtype} cannot be checkpointed; "
                      f"supported: {sorted(_DTYPES)}")


def _manifest_entry(lay, layer, nbytes: int, sha: str) -> dict:
    """One block entry of dataflow.models.storage's manifest.json (so the weights form a model dir)."""
    return {"file": block_file(lay.kind, layer), "kind": lay.kind.value, "layer": layer,
            "nbytes": nbytes, "sha256": sha,
            "tensors": [{"name": lay.full_name(t.name, layer), "offset_bytes": 2 * t.offset,
                         "shape": list(t.shape), "dtype": "bfloat16"} for t in lay.tensors]}


def _write_file(path: Path, array: np.ndarray) -> tuple[int, str]:
    """Write an array's bytes, fsync, and return (nbytes, sha256)."""
    data = memoryview(np.ascontiguousarray(array).view(np.uint8).reshape(-1))
    return len(data), write_hashed(path, data)


def write_bytes(path: Path, body: bytes) -> str:
    """Write `body`, fsync, and return its sha256 (checkpoint.json, its seal, the JSON files)."""
    return write_hashed(path, memoryview(body))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def move_into_place(tmp: Path, final: Path) -> None:
    """Rename tmp to final; an existing checkpoint of the same step is moved aside first and
    deleted only once the new one is in place."""
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        final.rename(old)
    tmp.rename(final)
    if old is not None:
        shutil.rmtree(old)


def _remove_stale_temporaries(root: Path) -> None:
    """Delete `.step_*.tmp-<pid>-*` / `.old-<pid>-*` left by a save whose process is gone."""
    for p in root.iterdir():
        m = _TEMP_DIR.match(p.name)
        if m and p.is_dir() and not _alive(int(m.group(2))):
            log.info("removing %s, left by an interrupted save", p)
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- reading ------------------------------------------------------------------------------------
def read_checkpoint(path: str | Path) -> tuple[Path, dict]:
    """(directory, checkpoint.json contents) of a sealed checkpoint, the seal checked; the
    listed files are checked for presence and size (not content: see verify_files)."""
    path = resolve_checkpoint(path)
    seal, meta_file = path / SEAL, path / META
    for f in (seal, meta_file):
        if not f.is_file():
            raise ChecksumError(f"checkpoint file {f} is missing; the checkpoint was not "
                                "completely written: load an older one", path=str(f),
                                expected="present", actual="missing")
    body = meta_file.read_bytes()
    want = seal.read_text().strip()
    got = hashlib.sha256(body).hexdigest()
    if got != want:
        raise ChecksumError(f"checkpoint file {meta_file} fails its checksum: sha256 {got}, "
                            f"{SEAL} says {want}; the file is corrupt, load an older checkpoint",
                            path=str(meta_file), expected=want, actual=got)
    meta = json.loads(body)
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"{meta_file} is format {meta.get('format')!r} version "
                          f"{meta.get('format_version')!r}; this version reads {FORMAT} "
                          f"{FORMAT_VERSION}")
    for entry in meta["files"]:
        f = path / entry["file"]
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            raise ChecksumError(f"checkpoint file {f} is missing (expected {entry['nbytes']} "
                                "bytes); re-copy the checkpoint or load an older one",
                                path=str(f), expected=f"{entry['nbytes']} bytes",
                                actual="missing") from None
        if size != entry["nbytes"]:
            how = "truncated" if size < entry["nbytes"] else "oversized"
            raise ChecksumError(f"checkpoint file {f} is {how}: {size} bytes, {META} says "
                                f"{entry['nbytes']}; re-copy it or load an older checkpoint",
                                path=str(f), expected=f"{entry['nbytes']} bytes",
                                actual=f"{size} bytes")
    return path, meta


def verify_files(path: Path, meta: dict) -> None:
    """Hash every listed file (on a thread pool) and refuse the first that disagrees."""
    def check(entry):
        f = path / entry["file"]
        got = _hash_file(f)
        if got != entry["sha256"]:
            raise ChecksumError(f"checkpoint file {f} fails its checksum: sha256 {got}, {META} "
                                f"says {entry['sha256']}; the file is corrupt, re-copy it or "
                                "load an older checkpoint", path=str(f),
                                expected=entry["sha256"], actual=got)

    with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
        for fut in [pool.submit(check, e) for e in meta["files"]]:
            fut.result()


def _hash_file(f: Path) -> str:
    digest = hashlib.sha256()
    with open(f, "rb") as fh:
        while piece := fh.read(_PIECE_BYTES):
            digest.update(piece)
    return digest.hexdigest()


def _read_array(f: Path, entry: dict) -> np.ndarray:
    out = np.empty(entry["numel"], _DTYPES[entry["dtype"]])
    view = memoryview(out.view(np.uint8))
    with open(f, "rb", buffering=0) as fh:
        for start in range(0, len(view), _PIECE_BYTES):
            piece = view[start:start + _PIECE_BYTES]
            if fh.readinto(piece) != len(piece):
                raise ChecksumError(f"checkpoint file {f} ended early near byte {start}",
                                    path=str(f), expected=f"{entry['nbytes']} bytes",
                                    actual="fewer")
    return out


def iter_weight_blocks(path: str | Path, *, verify: bool = True):
    """(kind, layer, array) for each weight block of a checkpoint, one at a time, in model order
    (for export without an Engine)."""
    path, meta = read_checkpoint(path)
    cfg = from_dict(ModelConfig, meta["model"], where=f"{path / META} model")
    weights = [e for e in meta["files"] if e.get("part") == "weights"]
    if verify:
        verify_files(path, {"files": weights})
    kinds = [(BlockKind.EMBED, None)] + [(BlockKind.LAYER, i) for i in range(cfg.n_layers)]
    kinds.append((BlockKind.HEAD, None))
    for (kind, layer), entry in zip(kinds, weights):
        yield kind, layer, _read_array(path / entry["file"], entry)


def checkpoint_model(path: str | Path) -> ModelConfig:
    _, meta = read_checkpoint(path)
    return from_dict(ModelConfig, meta["model"], where="checkpoint model")


# -- loading into an engine ---------------------------------------------------------------------
def load_checkpoint(eng, path: str | Path, *, verify: bool = True, allow_changes: bool = False,
                    before_writes=None) -> CheckpointInfo:
    """Restore weights, m, v, step and schedule of `eng` from a checkpoint (a step directory, or
    the newest under a root). The plan may differ (placement does not change values); the model
    must match, and so must the optimizer settings and the schedule unless allow_changes (the
    config's lr is judged only where the run uses it: ignored under a schedule, else a different
    one warns, since set_lr and a step's lr= override it). With
    verify every file is hashed BEFORE anything is written into the engine, so a damaged
    checkpoint is refused with the engine untouched. An engine built without a schedule adopts
    the checkpoint's. before_writes: called once everything is checked, before the first write
    (the Engine discards a failed step's state there)."""
    path, meta = read_checkpoint(path)
    adopt = check_settings(path, meta, eng.plan.model, eng.optimizer, allow_changes)
    check_frozen(path, meta, _plan_of(eng))
    todo = block_entries(path, meta, eng, eng.block_refs())
    if verify:
        verify_files(path, meta)
    if before_writes is not None:
        before_writes()
    return apply(eng, path, meta, todo, adopt, eng.plan.hash)


def check_settings(path: Path, meta: dict, model: ModelConfig, optimizer,
                   allow_changes: bool):
    """Refuse a checkpoint of another model, or (unless allow_changes) of other optimizer
    settings or another lr schedule; returns the schedule an engine built without one adopts
    (None: keep the engine's)."""
    where = str(path / META)
    cfg = from_dict(ModelConfig, meta["model"], where=f"{where} model")
    if dataclasses.replace(cfg, name=model.name) != model:
        raise ModelMismatchError(path, cfg, model)
    opt = from_dict(AdamWConfig, meta["optimizer"], where=f"{where} optimizer")
    stored, schedule = meta.get("schedule"), optimizer.schedule
    adopt = None
    changes = []
    if schedule is None and stored is not None and stored.get("kind") != "callable":
        adopt = schedule_from_dict(stored)
    elif stored is None or stored.get("kind") != "callable":
        changes += _differences(stored, _schedule_record(schedule), "schedule")
    else:
        log.warning("checkpoint %s was trained with an lr schedule that could not be stored "
                    "(%s); the engine's own schedule continues from step %d", path,
                    stored.get("repr"), meta["step"])
    # Judge only what the resumed run uses. With a schedule (the engine's or the adopted one)
    # the config's lr is never read. Without one it is only the lr of steps that pass no lr=
    # (set_lr and a step's own lr= override it), so a different one is reported, not refused.
    ours = dataclasses.replace(optimizer.config, lr=opt.lr)
    changes = _differences(to_dict(opt), to_dict(ours), "optimizer") + changes
    if schedule is None and adopt is None and opt.lr != optimizer.config.lr \
            and not allow_changes:
        warnings.warn(f"checkpoint {path} was trained with lr {opt.lr:g}; this engine's lr is "
                      f"{optimizer.config.lr:g}, which steps that pass no lr= will use (pass "
                      f"lr={opt.lr:g} to continue as saved, or set_lr / train_step(lr=) to "
                      "choose)", UserWarning, stacklevel=3)
    if changes and not allow_changes:
        raise ConfigError(f"checkpoint {path} was trained with different settings: "
                          f"{'; '.join(changes)}; construct the Engine with the checkpoint's "
                          "settings for an exact resume, or pass allow_changes=True")
    return adopt


def _plan_of(eng):
    """The plan of an Engine, or of a ring rank (its RankPlan's), whose blocks are saved."""
    return eng.plan if hasattr(eng, "plan") else eng.rp.plan


def check_frozen(path: Path, meta: dict, plan) -> None:
    """Refuse a checkpoint trained with another frozen set (Plan.frozen; a checkpoint from
    before frozen blocks froze nothing): a frozen block's file holds weights only, and a
    trained one's AdamW state would be lost or invented."""
    saved, ours = meta.get("frozen", ""), plan.frozen.spec()
    if saved != ours:
        raise ConfigError(f"checkpoint {path} was trained with frozen blocks "
                          f"'{saved or 'none'}', this engine freezes '{ours or 'none'}'; "
                          f"resume with freeze='{saved}' (--freeze {saved or chr(39) * 2}), or "
                          "load its weights alone into a new run (weights=, load_state_dict "
                          "with weights_only=True)")


def block_entries(path: Path, meta: dict, eng, refs) -> list[tuple]:
    """(ref, part, file entry) for weights, m and v of each block of `refs`, each checked
    against the block's element count (eng.layout)."""
    by_name = {(e["block"], e["part"]): e for e in meta["files"] if "part" in e}
    todo = []
    for ref in refs:
        numel = eng.layout(ref).numel
        for part in block_parts(_plan_of(eng), ref.kind, ref.layer):
            entry = by_name.get((ref.name, part))
            if entry is None or entry["numel"] != numel or entry["dtype"] not in _DTYPES:
                raise ConfigError(f"checkpoint {path} has no valid {part} of block {ref.name} "
                                  f"({numel} elements); {META} is inconsistent, re-save it")
            todo.append((ref, part, entry))
    return todo


def apply(eng, path: Path, meta: dict, todo: list[tuple], adopt, plan_hash: str) -> CheckpointInfo:
    """Write the checked blocks of `todo` into `eng` (eng.write_block), set its step count and
    adopt the schedule; the CheckpointInfo of `meta`."""
    for ref, part, entry in todo:
        eng.write_block(ref, _read_array(path / entry["file"], entry), part)
    eng.optimizer.step_count = int(meta["step"])
    if adopt is not None:
        eng.optimizer.schedule = adopt
    if meta.get("failed_step") is not None:
        failed = meta["failed_step"]
        log.warning("checkpoint %s was saved by force after step %s failed (%s): its weights "
                    "or AdamW state may be half-updated", path, failed.get("step"),
                    failed.get("reason"))
    if meta["plan_hash"] != plan_hash:
        log.info("checkpoint %s was saved under plan %s; resuming under plan %s", path,
                 meta["plan_hash"], plan_hash)
    return CheckpointInfo(path=str(path), step=int(meta["step"]), plan_hash=meta["plan_hash"],
                          model=from_dict(ModelConfig, meta["model"], where="checkpoint model"),
                          optimizer=from_dict(AdamWConfig, meta["optimizer"],
                                              where="checkpoint optimizer"),
                          schedule=meta.get("schedule"), data=meta.get("data"),
                          rng=meta.get("rng"), extra=meta.get("extra"))


def _differences(a, b, label: str) -> list[str]:
    if a == b:
        return []
    if isinstance(a, dict) and isinstance(b, dict) and "params" not in a | b:
        return [f"{label}.{k}: checkpoint {a.get(k)!r}, engine {b.get(k)!r}"
                for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return [f"{label}: checkpoint {a!r}, engine {b!r}"]



# -- the model's source -------------------------------------------------------------------------
def model_source(resume: Path | None, weights) -> ModelSource | None:
    """The Hugging Face files an engine's model came from, read once when it is built: a
    resumed checkpoint's source/ copy, else the Hugging Face directory its weights are loaded
    from, else None (a zoo model, a config, a saved model directory)."""
    if resume is not None:
        return checkpoint_source(resume)
    if isinstance(weights, (str, Path)) and is_hf_dir(weights):
        return read_source(weights)
    return None


def checkpoint_source(path: str | Path) -> ModelSource | None:
    """The source/ files a checkpoint stored (each checked against its sha256), or None for a
    checkpoint of a model that came from no Hugging Face directory (or saved before checkpoints
    stored sources)."""
    path, meta = read_checkpoint(path)
    record = meta.get("source")
    if not isinstance(record, dict):
        return None
    files = []
    for entry in meta["files"]:
        name = entry["file"]
        if not name.startswith(f"{SOURCE_DIR}/"):
            continue
        body = (path / name).read_bytes()
        got = hashlib.sha256(body).hexdigest()
        if got != entry["sha256"]:
            raise ChecksumError(f"checkpoint file {path / name} fails its checksum: sha256 "
                                f"{got}, {META} says {entry['sha256']}; re-copy the checkpoint",
                                path=str(path / name), expected=entry["sha256"], actual=got)
        files.append((name[len(SOURCE_DIR) + 1:], body))
    return ModelSource(path=str(record.get("path")), files=tuple(files))

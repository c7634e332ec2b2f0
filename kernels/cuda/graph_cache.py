"""On-disk cache of built cuDNN frontend graphs (the SDPA forward and backward of
dataflow.kernels.cuda.attention), so a later process deserialises an execution plan instead of building it
(heuristics query, plan build, and whatever kernel compilation cuDNN does inside build_plans).
An entry is keyed by the caller's graph key together with everything that can make a plan
invalid: cuDNN's backend version, the frontend's version, the device's name and compute
capability. A missing, stale or unreadable entry is a miss, never an error: the caller builds the
graph and stores it. Never builds a graph itself and never touches device memory.

Where: `root`, the value of DATAFLOW_CUDNN_CACHE_DIR its caller was given (a CudaContext's
cudnn_cache_dir, from dataflow.settings; this module reads no environment), else
~/.cache/dataflow/cudnn; the value "off" turns the cache off (every graph is built). Clearing the
directory is always safe.

Use (dataflow.kernels.cuda.attention._graph, around the build):
    env = graph_cache.environment(cudnn, device_id)
    g = graph_cache.load(key, cudnn.pygraph, env, root, handle)
    if g is None:
        g = <build>                        # validate ... build_plans
        graph_cache.store(key, g, env, root)
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


def cache_dir(root: str | None) -> Path | None:
    """The directory of serialised graphs (created on first store) for `root` (the value of
    DATAFLOW_CUDNN_CACHE_DIR, None when unset), or None when the cache is off (root "off")."""
    if root is not None and root.strip().lower() == "off":
        return None
    return Path(root) if root else Path.home() / ".cache" / "dataflow" / "cudnn"


def environment(cudnn, device_id: int) -> tuple:
    """(cuDNN backend version, frontend version, device name, compute capability): a plan
    serialised under one of these is not loaded under another."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return (int(cudnn.backend_version()), str(getattr(cudnn, "__version__", "?")), name,
            (int(props["major"]), int(props["minor"])))


def entry_path(key: tuple, env: tuple, root: str | None) -> Path | None:
    """The file of (key, env) under cache_dir(root): a hash of their repr, so any field change is
    a new entry (None when the cache is off)."""
    folder = cache_dir(root)
    if folder is None:
        return None
    digest = hashlib.sha256(repr((tuple(key), tuple(env))).encode()).hexdigest()[:32]
    return folder / f"{digest}.cudnn"


def load(key: tuple, new_graph, env: tuple, root: str | None, handle=None):
    """A graph deserialised from the entry of (key, env) into `new_graph()` (an empty
    cudnn.pygraph), through `handle` when given (cuDNN then takes the device's properties from
    it), or None on a miss, with the cache off, or on any failure to deserialise."""
    path = entry_path(key, env, root)
    if path is None:
        return None
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        g = new_graph()
        blob = list(data)  # pybind11 takes a list of ints for std::vector<uint8_t>
        if handle is None:
            g.deserialize(blob)
        else:
            g.deserialize(handle, blob)
        return g
    except Exception as exc:  # noqa: BLE001 - a stale or foreign entry is only a miss
        log.info("cuDNN graph cache entry %s not usable (%s); rebuilding", path.name, exc)
        return None


def store(key: tuple, graph, env: tuple, root: str | None) -> bool:
    """Serialise a built graph into the entry of (key, env), atomically; False (logged) when
    this cuDNN cannot serialise the graph or the directory is not writable."""
    path = entry_path(key, env, root)
    if path is None:
        return False
    try:
        data = bytes(graph.serialize())
        path.parent.mkdir(parents=True, exist_ok=True)
    except Exception as exc:  # noqa: BLE001 - the cache is an optimisation, never a failure
        log.info("cannot cache cuDNN graph %s: %s", key, exc)
        return False
    tmp = None
    try:
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as tmp:
            tmp.write(data)
        os.replace(tmp.name, path)  # readers see the whole entry or none
        return True
    except Exception as exc:  # noqa: BLE001
        log.info("cannot cache cuDNN graph %s: %s", key, exc)
        if tmp is not None:
            Path(tmp.name).unlink(missing_ok=True)
        return False

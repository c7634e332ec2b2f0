"""dataflow.kernels.cuda.graph_cache without a GPU (fake graphs): a stored graph's bytes come back through
deserialize for the same key and environment only; a corrupt entry, an unserialisable graph or
an unwritable directory is a miss, never an error. The directory is the `root` each call is given
(the DATAFLOW_CUDNN_CACHE_DIR value a CudaContext was made with, read through dataflow.settings)."""

import importlib.util
from pathlib import Path

# kernels/cuda/__init__ imports CuPy; graph_cache itself does not (but in environment()), so
# load the file alone and test it on any machine.
_SPEC = importlib.util.spec_from_file_location(
    "graph_cache", Path(__file__).resolve().parents[2] / "kernels" / "cuda" / "graph_cache.py")
graph_cache = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(graph_cache)


class _FakeGraph:
    def __init__(self, data=None, fail_deserialize=False):
        self.data, self.fail = data, fail_deserialize

    def serialize(self):
        if self.data is None:
            raise RuntimeError("serialization not supported for this graph")
        return list(self.data)

    def deserialize(self, data):
        if self.fail:
            raise RuntimeError("cudnn version mismatch")
        self.data = bytes(data)


ENV = (91000, "1.32.0", "NVIDIA H100 80GB HBM3", (9, 0))


def test_store_then_load_round_trips_the_serialised_bytes(tmp_path, rng):
    """The same key and environment give back the stored bytes; another device or another key
    is a miss."""
    root = str(tmp_path)
    payload = bytes(rng.integers(0, 256, 1000, dtype="uint8"))
    key = (0, "fwd", 8192, 8192, 32, 8, 128, "top_left", True)
    assert graph_cache.store(key, _FakeGraph(payload), ENV, root)
    g = graph_cache.load(key, _FakeGraph, ENV, root)
    assert g is not None and g.data == payload
    assert graph_cache.load(key, _FakeGraph, ENV[:2] + ("NVIDIA H200", (9, 0)), root) is None
    assert graph_cache.load(key[:-1] + (False,), _FakeGraph, ENV, root) is None


def test_unserialisable_graph_and_undeserialisable_entry_are_misses(tmp_path):
    """A graph cuDNN cannot serialise is not stored; an entry cuDNN refuses loads as None."""
    root = str(tmp_path)
    key = ("bwd",)
    assert not graph_cache.store(key, _FakeGraph(None), ENV, root)
    assert graph_cache.store(key, _FakeGraph(b"abc"), ENV, root)
    assert graph_cache.load(key, lambda: _FakeGraph(fail_deserialize=True), ENV, root) is None


def test_off_stores_nothing_and_loads_nothing(tmp_path):
    """root "off" (DATAFLOW_CUDNN_CACHE_DIR=off): no directory, every store refused, every load a
    miss, in any case."""
    assert graph_cache.cache_dir("off") is None
    assert not graph_cache.store(("fwd",), _FakeGraph(b"abc"), ENV, "off")
    assert graph_cache.load(("fwd",), _FakeGraph, ENV, "off") is None
    assert graph_cache.store(("fwd",), _FakeGraph(b"abc"), ENV, str(tmp_path))
    assert graph_cache.load(("fwd",), _FakeGraph, ENV, "OFF") is None

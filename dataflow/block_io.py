"""Reading and writing one block's persistent parts (weights, AdamW m and v) wherever the plan
put them: the home copy in pinned host memory, the device copy, or both (a resident block's
device copy is the live one; a streamed block's device region is only a slot). Shared by the
Engine and a ring's ranks, so checkpoints and state loading see every block the same way. Never
runs or drops a pending deferred update (callers settle first) and never decides placement."""

from __future__ import annotations

import numpy as np

from dataflow.backend import Stream
from dataflow.kernels.host.memory import copy_into


def is_host_array(view) -> bool:
    return isinstance(view, np.ndarray) and view.flags.c_contiguous


def host_copy(dst, array) -> None:
    """dst[...] = array, in parallel when both are contiguous host arrays of one dtype."""
    if is_host_array(dst) and is_host_array(array) and array.dtype == dst.dtype \
            and array.size == dst.size:
        copy_into(dst, array)
    else:
        dst[...] = array


def read_part(ex, be, b, part: str) -> np.ndarray:
    """A host copy of block `b`'s `part` ('weights', 'm' or 'v'), synchronous."""
    if b.resident or b.home(part) is None:
        return ex.download(b.device(part))
    be.synchronize()  # a queued copy may still write this home copy
    return np.array(b.home(part), copy=True)


def write_part(ex, be, b, array: np.ndarray, part: str = "weights") -> None:
    """Overwrite block `b`'s `part` with `array` (its numel elements) in every place it lives.
    The device copy is written from the pinned home copy (asynchronous: synchronise before
    relying on it) or, without one, through the executor's io staging (synchronous)."""
    home, dev = b.home(part), b.device(part)
    if home is not None:
        be.synchronize()  # a queued copy may still read or write this home copy
        host_copy(home, array)
    # A HOME block's device weights region is only a slot (the head's): the home copy rules.
    if dev is not None and (home is None or part != "weights" or b.resident):
        if is_host_array(home):
            be.copy(dev, home, Stream.H2D, name="upload")  # pinned: async, no staging
        else:
            ex.upload(dev, array)

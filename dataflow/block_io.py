"""Reading and writing one block's persistent parts (weights, AdamW m and v) wherever the plan
put them: the home copy in pinned host memory, the device copy, or both (a resident block's
device copy is the live one; a streamed block's device region is only a slot). Shared by the
Engine and a ring's ranks, so checkpoints and state loading see every block the same way. Never
runs or drops a pending deferred update (callers settle first) and never decides placement."""

from __future__ import annotations

import numpy as np

from dataflow.backend import Stream
from dataflow.kernels.host.memory import copy_into, zero_fill


def is_host_array(view) -> bool:
    return isinstance(view, np.ndarray) and view.flags.c_contiguous


def host_copy(dst, array) -> None:
    """dst[...] = array, in parallel when both are contiguous host arrays of one dtype."""
    if is_host_array(dst) and is_host_array(array) and array.dtype == dst.dtype \
            and array.size == dst.size:
        copy_into(dst, array)
    else:
        dst[...] = array


def host_zero(view) -> None:
    """view[...] = 0; a contiguous host array in parallel, page by page, leaving pages that
    already read as zero unwritten (a fresh slab is then neither written nor faulted in)."""
    if is_host_array(view):
        zero_fill(view)
    else:
        view[...] = 0


def zero_state(be, b) -> None:
    """Zero block `b`'s gradients and AdamW m and v wherever they live: a device copy by a fill
    on the compute stream (in parallel on the host where the device is host memory), a home
    copy by host_zero. The caller synchronises first: nothing queued may touch this state."""
    for part in ("grads", "m", "v"):
        dev, home = b.device(part), b.home(part)
        if dev is not None:
            if be.device_is_host_memory and is_host_array(dev):
                zero_fill(dev)
            else:
                be.launch(Stream.COMPUTE, "fill_", dev, 0.0, name="init.zero")
        if home is not None:
            host_zero(home)


def init_weights(ex, be, b, fill) -> None:
    """Initialise block `b`'s weights straight into where they live: its home copy, else its
    device copy where the device is host memory, else the pinned io staging region (sized for
    the largest block) and one H2D copy from there. `fill(out)` writes the initial values into
    `out`, a 1-D bf16 host array of b.numel elements, and returns it (dataflow.models.init's
    init_*_block with out=); fill(None) must allocate. No block passes through a temporary: a
    model-sized block allocated beside the pinned slab would add its bytes (two blocks', while
    a loop still holds the previous one) to the process's RSS, outside the plan. The copy from
    home is asynchronous: synchronise before relying on the device copy."""
    home, dev = b.home("weights"), b.device("weights")
    to_device = dev is not None and (home is None or b.resident)
    if home is not None:
        out = home
    elif be.device_is_host_memory:
        out, to_device = dev, False
    else:
        be.synchronize()  # the previous block's copy may still read the staging
        out = ex.host.view("io_staging", (b.numel,), "bf16")
    if is_host_array(out):
        fill(out)
        if to_device:
            be.copy(dev, out, Stream.H2D, name="upload")
    else:  # views that hold no bytes (the null backend): the general path
        write_part(ex, be, b, fill(None))


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

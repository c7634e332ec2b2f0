"""The CuPy backend's 'register' pinning path without a GPU: an anonymous mapping that reads as
zero, registered in the asked pieces (fake register/unregister calls), unregistered and unmapped
exactly once when freed or when its last view dies; DATAFLOW_PIN parsing names bad values."""

import gc

import numpy as np
import pytest

from dataflow.backend import BackendError
from dataflow.backends.cupy_backend import MappedHostMemory, piece_bounds, pin_options


class _FakeCuda:
    """Records cudaHostRegister / cudaHostUnregister calls; optionally fails the k-th register."""

    def __init__(self, fail_at: int | None = None):
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []
        self.calls = 0
        self.fail_at = fail_at

    def register(self, ptr: int, n: int) -> None:
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            raise OSError("fake cudaErrorMemoryAllocation")
        self.registered[ptr] = n

    def unregister(self, ptr: int) -> None:
        assert ptr in self.registered, "unregistered a pointer that was never registered"
        self.unregistered.append(ptr)


@pytest.mark.parametrize("populate", ["touch", "populate", "none"])
@pytest.mark.parametrize("pieces", [1, 3])
def test_mapped_memory_reads_zero_and_registers_contiguous_pieces(populate, pieces):
    """Every populate mode gives zero bytes; the registered pieces tile [ptr, ptr + nbytes)
    without gap or overlap, each starting on a 2 MiB boundary of the slab."""
    nbytes = (5 << 20) + 12345
    fake = _FakeCuda()
    mem = MappedHostMemory(nbytes, fake.register, fake.unregister, pieces=pieces,
                           populate=populate)
    a = np.asarray(mem)
    assert a.size == nbytes and a.dtype == np.uint8 and not a.any()
    spans = sorted(fake.registered.items())
    assert spans[0][0] == mem.ptr
    assert sum(n for _, n in spans) == nbytes
    for (p0, n0), (p1, _) in zip(spans, spans[1:]):
        assert p0 + n0 == p1 and (p1 - mem.ptr) % (2 << 20) == 0
    assert mem.registered_pieces == len(spans) == min(pieces, 3)
    assert set(mem.seconds) >= {"map", "register"}
    del a
    mem.free()
    assert sorted(fake.unregistered) == sorted(fake.registered)


def test_views_keep_the_mapping_alive_and_the_last_one_frees_it(rng):
    """A view's base chain holds the memory: data written through it survives the owner's name
    going away, and unregistering happens once, when the last view dies."""
    fake = _FakeCuda()
    mem = MappedHostMemory(1 << 20, fake.register, fake.unregister)
    whole = np.asarray(mem)
    assert whole.base is mem
    values = rng.integers(0, 256, 100, dtype=np.uint8)
    part = whole[1000:1100]
    part[...] = values
    del mem, whole
    gc.collect()
    assert fake.unregistered == []
    assert np.array_equal(part, values)
    del part
    gc.collect()
    assert len(fake.unregistered) == 1


def test_a_failed_registration_unregisters_what_was_pinned_and_raises():
    """When the second of three pieces fails, the pieces already pinned are unregistered and the
    error reaches the caller (the backend then falls back to cudaHostAlloc)."""
    fake = _FakeCuda(fail_at=2)
    with pytest.raises(OSError, match="fake"):
        MappedHostMemory(6 << 20, fake.register, fake.unregister, pieces=3)
    assert sorted(fake.unregistered) == sorted(fake.registered)


def test_free_is_idempotent_and_a_freed_memory_refuses_new_views():
    """free() twice unregisters once; np.asarray after free raises instead of pointing at
    unmapped memory."""
    fake = _FakeCuda()
    mem = MappedHostMemory(4096, fake.register, fake.unregister)
    mem.free()
    mem.free()
    assert len(fake.unregistered) == 1
    with pytest.raises(ValueError, match="freed"):
        np.asarray(mem)


def test_zero_byte_slab_maps_registers_nothing_and_frees():
    """A 0-byte host budget gets an empty array and no registration call."""
    fake = _FakeCuda()
    mem = MappedHostMemory(0, fake.register, fake.unregister)
    assert np.asarray(mem).size == 0 and fake.calls == 0
    mem.free()


def test_pin_options_default_register_and_reject_bad_values():
    """DATAFLOW_PIN defaults to register; a typo or bad piece count is named with the choices."""
    assert pin_options({}) == ("register", 1)
    assert pin_options({"DATAFLOW_PIN": "ALLOC", "DATAFLOW_PIN_PIECES": "1"}) == ("alloc", 1)
    with pytest.raises(BackendError, match="in pieces failed"):
        pin_options({"DATAFLOW_PIN_PIECES": "4"})
    with pytest.raises(BackendError, match="'register'"):
        pin_options({"DATAFLOW_PIN": "hostalloc"})
    with pytest.raises(BackendError, match="leave it unset"):
        pin_options({"DATAFLOW_PIN_PIECES": "0"})


@pytest.mark.parametrize("nbytes,pieces", [(1, 4), (10 << 20, 3), ((64 << 20) + 1, 16),
                                           (2 << 20, 8)])
def test_piece_bounds_tile_the_range_on_aligned_starts(nbytes, pieces):
    """At most `pieces` non-empty ranges, aligned starts, covering every byte once."""
    b = piece_bounds(nbytes, pieces)
    assert 1 <= len(b) <= pieces
    assert b[0][0] == 0 and sum(n for _, n in b) == nbytes
    assert all(n > 0 and lo % (2 << 20) == 0 for lo, n in b)
    assert all(lo0 + n0 == lo1 for (lo0, n0), (lo1, _) in zip(b, b[1:]))


def test_run_ahead_ops_reads_the_environment_and_names_a_bad_value():
    from dataflow.backend import BackendError
    from dataflow.backends.cupy_backend import RUN_AHEAD_OPS, run_ahead_ops

    assert run_ahead_ops({}) == RUN_AHEAD_OPS
    assert run_ahead_ops({"DATAFLOW_RUN_AHEAD_OPS": "64"}) == 64
    for bad in ("0", "6", "x"):
        with pytest.raises(BackendError, match="DATAFLOW_RUN_AHEAD_OPS"):
            run_ahead_ops({"DATAFLOW_RUN_AHEAD_OPS": bad})

"""precision='fp8' on the CuPy backend (docs/fp8.md): set_precision swaps the FP8 linear ops in
and out; the FP8 linear ops (dataflow.ops_cuda_fp8)
equal the NumPy FP8 table's (the same quantised bytes, fp32 sums in another order: within the
output's rounding) on fresh random inputs, and a tiny engine trains in fp8 with the NumPy fp8
engine's losses within 1e-3 relative. GPU only (sm_89+)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu import require_gpu  # noqa: E402

cp = require_gpu()
if int(cp.cuda.Device().compute_capability) < 89:
    pytest.skip("FP8 needs sm_89+", allow_module_level=True)

from dataflow import ops_fp8_numpy  # noqa: E402
from dataflow.backend import Stream  # noqa: E402
from dataflow.backends import make_backend  # noqa: E402
from dataflow.engine import Engine  # noqa: E402
from dataflow.memplan import get_profile, make_plan  # noqa: E402
from dataflow.memplan.plan.plan import Budget  # noqa: E402
from dataflow.models.config import load_config  # noqa: E402
from tests.gpu import dev, host  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


def _bf(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(BF16)


def test_fp8_puts_the_fp8_linears_in_the_table_and_bf16_takes_them_out():
    be = make_backend("cupy")
    try:
        bf16 = be.ops.linear_fwd
        be.set_precision("fp8")
        assert be.ops.linear_fwd != bf16 and be.precision == "fp8"
        be.set_precision("bf16")
        assert be.ops.linear_fwd == bf16 and be.precision == "bf16"
    finally:
        be.close()


def test_the_fp8_linear_ops_equal_the_numpy_table(rng):
    be = make_backend("cupy")
    try:
        be.set_precision("fp8")
        t, i, o = 256, 512, 384
        x, w, dy = _bf(rng, (t, i)), _bf(rng, (o, i), 0.05), _bf(rng, (t, o), 1e-3)
        be.lend_scratch({"fp8_a": cp.empty(t * max(i, o), np.uint8),
                         "fp8_b": cp.empty(max(o * i, t * i), np.uint8),
                         "fp8_scales": cp.empty((2, 4), np.float32),
                         "fp8_amax": cp.empty(1024, np.float32)})
        y, dx = cp.empty((t, o), BF16), cp.empty((t, i), BF16)
        dw = cp.zeros((o, i), np.float32)
        be.ops.linear_fwd(dev(x), dev(w), y)
        be.ops.linear_bwd_x(dev(dy), dev(w), dx)
        be.ops.linear_bwd_w(dev(dy), dev(x), dw, False)
        want_y, want_dx = np.empty((t, o), BF16), np.empty((t, i), BF16)
        want_dw = np.zeros((o, i), np.float32)
        ops_fp8_numpy.linear_fwd(x, w, want_y)
        ops_fp8_numpy.linear_bwd_x(dy, w, want_dx)
        ops_fp8_numpy.linear_bwd_w(dy, x, want_dw, False)
        f = [v.astype(np.float64) for v in (x, w, dy)]
        # The same FP8 products summed in two orders: each side within its output's rounding
        # (2^-8 bf16, 2^-24 fp32) and its sum's error over the magnitudes' sum (the operands'
        # quantisation, at most 2^-3 of each, allowed for in the magnitude): K fp32 roundings
        # for NumPy, and Hopper's FP8 tensor cores keep only about 14 bits of a partial sum
        # (DeepSeek-V3's report, 3.3.2; 2^-12.9 of the magnitudes seen for dw on the H200): 2^-11.
        for name, got, want, unit, k, mag in (
                ("y", host(y), want_y, 2.0 ** -8, i, np.abs(f[0]) @ np.abs(f[1]).T),
                ("dx", host(dx), want_dx, 2.0 ** -8, o, np.abs(f[2]) @ np.abs(f[1])),
                ("dw", host(dw), want_dw, 2.0 ** -24, t, np.abs(f[2]).T @ np.abs(f[0]))):
            g, wv = got.astype(np.float64), want.astype(np.float64)
            bound = 2 * unit * np.abs(wv) + (2 * k * 2.0 ** -24 + 2.0 ** -11) * mag * 1.3
            assert (np.abs(g - wv) <= bound).all(), (name, np.max(np.abs(g - wv) / bound))
            if unit == 2.0 ** -8:  # a bf16 output mostly rounds to the same value
                assert np.median(np.abs(g - wv) / (np.abs(wv) + 1e-30)) < unit, name
    finally:
        be.close()


def _fp8_backend(a_bytes: int, b_bytes: int):
    """A CuPy backend in fp8 with FP8 operand scratch of these sizes lent (as a plan lends it)."""
    be = make_backend("cupy")
    be.set_precision("fp8")
    be.lend_scratch({"fp8_a": cp.empty(a_bytes, np.uint8), "fp8_b": cp.empty(b_bytes, np.uint8),
                     "fp8_scales": cp.empty((2, 4), np.float32),
                     "fp8_amax": cp.empty(1024, np.float32)})
    return be


def test_an_operand_quantised_once_is_reused_until_something_writes_it(rng):
    """q, k and v from one x (x quantised once), then x rewritten by a copy: the next op
    quantises the new x (the backend forgot the old copy)."""
    t, i, o = 128, 256, 128
    be = _fp8_backend(t * i, o * i)
    try:
        x, x2 = _bf(rng, (t, i)), _bf(rng, (t, i), 3.0)
        ws = [_bf(rng, (o, i), 0.05) for _ in range(3)]
        # Every device array lives to the end: a freed one's memory could come back as another
        # tensor at the same address (the engine's arena views never do that unseen).
        xd, x2d, wds = dev(x), dev(x2), [dev(w) for w in ws]
        outs = [cp.empty((t, o), BF16) for _ in range(4)]
        for wd, y in zip(wds, outs):
            be.launch(Stream.COMPUTE, "linear_fwd", xd, wd, y)
        be.copy(xd, x2d, Stream.COMPUTE)
        be.launch(Stream.COMPUTE, "linear_fwd", xd, wds[0], outs[3])
        be.synchronize()
        for src, w, y in zip((x, x, x, x2), (*ws, ws[0]), outs):
            want = np.empty((t, o), BF16)
            ops_fp8_numpy.linear_fwd(src, w, want)
            g, wv = host(y).astype(np.float64), want.astype(np.float64)
            mag = np.abs(src.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
            assert (np.abs(g - wv) <= 2 ** -7 * np.abs(wv) + 2.0 ** -10 * mag).all()
    finally:
        be.close()


def _losses(plan, backend):
    rng = np.random.default_rng(7)
    with Engine.from_plan(plan, backend=backend, lr=1e-2) as eng:
        return [eng.train_step(rng.integers(0, 256, (eng.seqs_per_step, 129))).loss
                for _ in range(3)]


def test_a_tiny_engine_trains_in_fp8_as_the_numpy_one():
    plan = make_plan(load_config("tiny"), 128, Budget.from_gib(1, 0.5), get_profile("cpu"),
                     precision="fp8")
    gpu, cpu = _losses(plan, "cupy"), _losses(plan, "numpy")
    assert all(abs(a - b) < 1e-3 * b for a, b in zip(gpu, cpu)), (gpu, cpu)


def test_a_tensor_asked_for_in_its_other_layout_keeps_its_scale(rng, monkeypatch):
    """dx = dy w, an op that writes something else, then dw = dy^T x: dy's amax runs once and
    the second op only casts it again (its scale is still in the region), with the NumPy
    table's results; an op that writes dy in between makes the next op quantise it anew."""
    from dataflow import ops_cuda_fp8

    counts = {"fp8_quantise": 0, "fp8_cast": 0}
    for name in counts:
        real = getattr(ops_cuda_fp8.K, name)

        def counted(*a, _real=real, _name=name, **kw):
            counts[_name] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(ops_cuda_fp8.K, name, counted)
    t, i, o = 128, 256, 128
    be = _fp8_backend(t * o, o * i)
    try:
        dy, w, x = _bf(rng, (t, o)), _bf(rng, (o, i), 0.05), _bf(rng, (t, i))
        dyd, wd, xd, other = dev(dy), dev(w), dev(x), cp.empty(64, np.float32)
        dx, dw, dw2 = cp.empty((t, i), BF16), cp.zeros((o, i), np.float32), \
            cp.zeros((o, i), np.float32)
        be.launch(Stream.COMPUTE, "linear_bwd_x", dyd, wd, dx)
        be.launch(Stream.COMPUTE, "fill_", other, 0.0)  # writes neither dy nor x
        be.launch(Stream.COMPUTE, "linear_bwd_w", dyd, xd, dw)
        assert counts == {"fp8_quantise": 3, "fp8_cast": 1}  # dy, w^T, x^T; dy^T cast again
        staged = np.empty((t, o), BF16)  # a bf16 host array (no memoryview of it exists)
        be.copy(staged, dyd, Stream.COMPUTE)  # reads dy, writes host memory: nothing dropped
        be.launch(Stream.COMPUTE, "linear_bwd_x", dyd, wd, dx)
        assert counts == {"fp8_quantise": 4, "fp8_cast": 2}  # dy cast back; w^T anew (x^T)
        be.launch(Stream.COMPUTE, "scale_", dyd, 1.0)  # writes dy (same values, new tensor)
        be.launch(Stream.COMPUTE, "linear_bwd_w", dyd, xd, dw2)
        assert counts == {"fp8_quantise": 6, "fp8_cast": 2}  # dy^T anew, x^T anew (w^T held)
        be.synchronize()
        want_dx = np.empty((t, i), BF16)
        ops_fp8_numpy.linear_bwd_x(dy, w, want_dx)
        want_dw = np.zeros((o, i), np.float32)
        ops_fp8_numpy.linear_bwd_w(dy, x, want_dw)
        assert np.array_equal(host(dw), host(dw2))
        for got, want, mag in ((dx, want_dx, np.abs(dy.astype(np.float64)) @ np.abs(
                w.astype(np.float64))), (dw, want_dw, np.abs(dy.astype(np.float64)).T @ np.abs(
                x.astype(np.float64)))):
            g, wv = host(got).astype(np.float64), want.astype(np.float64)
            assert (np.abs(g - wv) <= 2 ** -7 * np.abs(wv) + 2.0 ** -10 * mag).all()
    finally:
        be.close()


def test_reusing_fp8_operands_gives_the_bits_of_quantising_every_one(monkeypatch):
    """A tiny fp8 engine with the operand reuse (the same tensor's copy or scale kept while
    nothing writes it) trains to the same losses, bit for bit, as with every operand
    quantised anew: the reuse changes which passes run, never a byte."""
    from dataflow.ops_cuda_fp8 import Fp8Linears

    plan = make_plan(load_config("tiny"), 128, Budget.from_gib(1, 0.5), get_profile("cpu"),
                     precision="fp8")
    reused = _losses(plan, "cupy")
    real = Fp8Linears._quantise

    def always(self, region, *a, **kw):
        self._held = [None, None]
        return real(self, region, *a, **kw)
    monkeypatch.setattr(Fp8Linears, "_quantise", always)
    assert _losses(plan, "cupy") == reused


def test_guessed_scales_give_the_bits_of_current_scaling(monkeypatch):
    """A tiny fp8 engine whose quantisations guess their scales from their sites
    (DATAFLOW_FP8_SCALES=guessed; the plan lends 'fp8_guess', the backend names each op's
    site) trains to the same losses, bit for bit, as with every scale from its own amax pass
    first: a guess changes which passes run, never a byte. Most guesses hold after the first
    round (the counts the backend reports). A bad DATAFLOW_FP8_SCALES is refused by name."""
    from dataflow.ops_cuda_fp8 import Fp8Linears

    monkeypatch.setenv("DATAFLOW_FP8_SCALES", "guessed")
    plan = make_plan(load_config("tiny"), 128, Budget.from_gib(1, 0.5), get_profile("cpu"),
                     precision="fp8")
    counts = []
    real_close = Engine.close

    def close(self):
        counts.append(self.be.precision_counts())
        return real_close(self)
    monkeypatch.setattr(Engine, "close", close)
    guessed = _losses(plan, "cupy")
    assert counts[0] is not None and counts[0]["guessed"] > 0, counts
    assert counts[0]["missed"] < counts[0]["guessed"] / 2, counts
    monkeypatch.setattr(Fp8Linears, "_slot", lambda self, region, transposed: None)
    assert _losses(plan, "cupy") == guessed
    assert counts[1] is None
    monkeypatch.setenv("DATAFLOW_FP8_SCALES", "sometimes")
    be = make_backend("cupy")
    try:
        with pytest.raises(ValueError, match="DATAFLOW_FP8_SCALES='sometimes'"):
            be.set_precision("fp8")
    finally:
        be.close()

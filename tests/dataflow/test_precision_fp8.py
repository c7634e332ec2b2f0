"""precision='fp8' (issue 53) on the NumPy backend: the op table's linear ops are the FP8 recipe
of kernels/reference/fp8.py exactly (quantise, fp32 products scaled once, one rounding, beta = 1
accumulation in fp32); a non-finite input makes NaN instead of raising, so the step is dropped as
non-finite; every other op is the bf16 table's own; an Engine and dataflow-demo train in it, close
to bf16 but not equal (the rounding happened), the same bits on every run; a precision that
does not exist, or one a backend does not have, is refused by name."""

from __future__ import annotations

import json
import shutil
import types

import ml_dtypes
import numpy as np
import pytest

from dataflow import ops_fp8_numpy, ops_numpy
from dataflow.backend import Backend, BackendError
from dataflow.backends import make_backend
from dataflow.cli.demo import main as demo_main
from dataflow.engine import Engine
from dataflow.kernels.reference import fp8 as ref
from dataflow.models.errors import ConfigError

BF16 = np.dtype(ml_dtypes.bfloat16)


def _bf(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(BF16)


def test_the_fp8_linear_ops_are_the_recipe(rng):
    t, i, o = 48, 96, 80
    x, w, dy = _bf(rng, (t, i)), _bf(rng, (o, i), 0.05), _bf(rng, (t, o), 1e-3)
    table = ops_fp8_numpy.op_table()
    y = np.empty((t, o), BF16)
    table.linear_fwd(x, w, y)
    y_ref, qx, qw = ref.fp8_linear_fwd(x, w, np.float32)
    assert np.array_equal(y.view(np.uint16), y_ref.astype(BF16).view(np.uint16))
    dx, dw = np.empty((t, i), BF16), np.zeros((o, i), np.float32)
    table.linear_bwd_x(dy, w, dx)
    table.linear_bwd_w(dy, x, dw, False)
    dx_ref, dw_ref = ref.fp8_linear_bwd(qx, qw, dy)
    assert np.array_equal(dx.view(np.uint16), dx_ref.astype(BF16).view(np.uint16))
    assert np.array_equal(dw, dw_ref)
    # accumulate: the earlier value plus the product in fp32, rounded once (cuBLASLt's beta = 1)
    y0 = _bf(rng, (t, o))
    y = y0.copy()
    table.linear_fwd(x, w, y, True)
    want = (y0.astype(np.float32) + y_ref).astype(BF16)
    assert np.array_equal(y.view(np.uint16), want.view(np.uint16))
    assert not np.array_equal(y_ref, x.astype(np.float32) @ w.astype(np.float32).T)


def test_a_non_finite_input_gives_nan_not_an_exception(rng):
    x, w = _bf(rng, (16, 32)), _bf(rng, (48, 32))
    x[3, 4] = np.inf
    y = np.zeros((16, 48), BF16)
    ops_fp8_numpy.linear_fwd(x, w, y)
    assert np.isnan(y.astype(np.float32)).all()


def test_a_shape_fp8_cannot_take_runs_the_bf16_op(rng):
    """A size that is not a multiple of 16 (cuBLASLt's FP8 rule): the bf16 op, here as on the
    GPU."""
    x, w = _bf(rng, (16, 40)), _bf(rng, (32, 40))
    y, want = np.empty((16, 32), BF16), np.empty((16, 32), BF16)
    ops_fp8_numpy.linear_fwd(x, w, y)
    ops_numpy.linear_fwd(x, w, want)
    assert np.array_equal(y.view(np.uint16), want.view(np.uint16))


def test_only_the_linear_ops_change():
    table = ops_fp8_numpy.op_table()
    for name in ops_numpy.WRITES:
        mine = getattr(table, name)
        if name in ops_fp8_numpy.FP8_LINEAR_OPS:
            assert mine is getattr(ops_fp8_numpy, name)
        else:
            assert mine is getattr(ops_numpy, name), name


def _losses(precision, seed, steps=4):
    rng = np.random.default_rng(seed)
    with Engine("tiny", host_gb=1, dev_gb=0.25, seqlen=64, backend="numpy", lr=1e-2,
                precision=precision) as eng:
        assert eng.be.precision == precision
        return [eng.train_step(rng.integers(0, 256, (eng.seqs_per_step, 65))).loss
                for _ in range(steps)]


def test_the_engine_trains_in_fp8_close_to_bf16(rng):
    seed = int(rng.integers(0, 2**31))
    bf16, fp8 = _losses("bf16", seed), _losses("fp8", seed)
    assert fp8 == _losses("fp8", seed)  # the same bits every run
    assert fp8 != bf16
    assert all(abs(a - b) < 0.01 * b for a, b in zip(fp8, bf16)), (fp8, bf16)
    assert fp8[-1] < fp8[0]


def test_precisions_are_checked_by_name():
    with pytest.raises(ConfigError, match="choose one of bf16, fp8"):
        Engine("tiny", host_gb=1, dev_gb=0.25, seqlen=64, backend="numpy", precision="fp16")
    fake = types.SimpleNamespace(name="cupy", precision="bf16")
    with pytest.raises(BackendError, match="not built for the cupy backend"):
        Backend.set_precision(fake, "fp8")
    Backend.set_precision(fake, "bf16")
    null = make_backend("null")
    null.set_precision("fp8")
    assert null.precision == "fp8"


def test_dataflow_demo_trains_in_fp8_and_says_so(capsys):
    assert demo_main(["1", "0.25", "64", "tiny", "--steps", "2", "--backend", "numpy",
                      "--precision", "fp8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["precision"] == "fp8" and len(out["steps"]) == 2
    assert demo_main(["1", "0.25", "64", "tiny", "--precision", "fp4"]) == 2
    assert "invalid choice: 'fp4'" in capsys.readouterr().err


@pytest.mark.parametrize("saved, resumed", [("fp8", "bf16"), ("bf16", "fp8")])
def test_a_checkpoint_of_one_precision_resumes_in_the_other(saved, resumed, tmp_path, capsys):
    """The checkpoint's format does not depend on the precision: a run saved in one resumes in
    the other, and its last step's loss is within FP8's gap of the run that went on."""
    run = ["1", "0.25", "64", "tiny", "--steps", "2", "--backend", "numpy", "--json",
           "--checkpoint-dir", str(tmp_path / "ck")]
    assert demo_main(run + ["--precision", saved, "--save-every", "1"]) == 0
    whole = json.loads(capsys.readouterr().out)["steps"][-1]["loss"]
    shutil.rmtree(tmp_path / "ck" / "step_00000002")
    assert demo_main(run + ["--precision", resumed, "--resume"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["precision"] == resumed and [s["step"] for s in out["steps"]] == [2]
    assert abs(out["steps"][-1]["loss"] - whole) < 1e-2 * whole


def test_a_ring_trains_in_fp8_as_one_device_does(tmp_path, rng):
    """dataflow-ring's precision reaches every rank: a ring of 2 in fp8 gives one device's fp8
    losses bit for bit (no clipping), which differ from bf16's."""
    # Imported here: the ring's launcher and its batches are only this test's.
    from dataflow.memplan import get_profile, make_plan
    from dataflow.memplan.plan.plan import Budget
    from dataflow.ring.job import RingJob, batches, model_config
    from dataflow.ring.launch import launch

    seed = int(rng.integers(0, 2**31))
    job = RingJob(gpus=2, model="tiny", seqlen=64, host_gb=0.5, dev_gb=0.25, steps=2, seed=seed,
                  data=f"random:{seed}", lr=1e-2, max_grad_norm=None, precision="fp8",
                  timeout_s=60, out_dir=str(tmp_path), save_weights=False,
                  constraints=(("chunk_tokens", 128), ("chunks_per_round", 2),
                               ("rounds_per_step", 2)))
    res = launch(job)
    assert res.exit_codes == (0, 0), res
    ring = json.loads((tmp_path / "rank0.json").read_text())["losses"]
    cfg = model_config(job.model)
    one = {}
    for precision in ("fp8", "bf16"):
        plan = make_plan(cfg, job.seqlen, Budget.from_gib(job.host_gb, job.dev_gb),
                         get_profile("cpu"), precision=precision, **dict(job.constraints))
        with Engine.from_plan(plan, backend="numpy", seed=seed, lr=job.lr,
                              max_grad_norm=None) as eng:
            assert eng.be.precision == precision
            one[precision] = [eng.train_step(b).loss
                              for b in batches(job, cfg, plan.chunking.seqs_per_step)]
    assert ring == one["fp8"] != one["bf16"]

"""Issue 20, the Engine under bad input and interruptions: load_state_dict checks everything
before writing anything (and reads bf16 that np.savez stored as void bytes), loads weights
alone, and a failed, interrupted or non-finite step stops the engine until a state is reloaded
instead of letting the next step apply half-accumulated gradients."""

from __future__ import annotations

import io

import ml_dtypes
import numpy as np
import pytest

from dataflow.data import token_stream
from dataflow.engine import Engine
from dataflow.models.errors import ConfigError, NonFiniteError, StepFailedError
from tests.faults import fail_on as _fail_on

BF16 = np.dtype(ml_dtypes.bfloat16)


def _engine(**kw):
    kw.setdefault("lr", 1e-3)
    return Engine("tiny", host_gb=0.5, dev_gb=0.25, seqlen=64, backend="numpy", **kw)


def _batch(eng, start=0):
    return token_stream(64, eng.seqs_per_step, 512, start=start)


def _perturbed(state: dict, rng) -> dict:
    """The state with every float tensor moved by fresh noise (so a load visibly changes it)."""
    out = {}
    for k, v in state.items():
        if v.dtype == BF16:
            out[k] = (v.astype(np.float32) + rng.standard_normal(v.shape).astype(np.float32)
                      * 0.01).astype(BF16)
        else:
            out[k] = v
    return out


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k].view(np.uint16) if a[k].dtype == BF16 else a[k],
                              b[k].view(np.uint16) if b[k].dtype == BF16 else b[k]), k


def test_load_state_dict_with_one_bad_tensor_writes_nothing(rng):
    """A wrong shape in layer 1 is refused before the embedding or layer 0 are overwritten."""
    with _engine() as eng:
        before = eng.state_dict()
        bad = _perturbed(before, rng)
        bad["model.layers.1.mlp.up_proj.weight"] = bad["model.layers.1.mlp.up_proj.weight"][:, :3]
        with pytest.raises(ConfigError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
            eng.load_state_dict(bad)
        _assert_same_state(eng.state_dict(), before)


def test_load_state_dict_lists_every_problem_and_refuses_unknown_keys(rng):
    """Missing, unknown, integer and non-finite tensors are all named in one refusal."""
    with _engine() as eng:
        state = _perturbed(eng.state_dict(), rng)
        del state["model.norm.weight"]
        state["model.layers.9.mlp.up_proj.weight"] = state["lm_head.weight"]
        state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"].astype(np.int32)
        nan = state["lm_head.weight"].astype(np.float32)
        nan[rng.integers(nan.shape[0]), rng.integers(nan.shape[1])] = np.nan
        state["lm_head.weight"] = nan
        with pytest.raises(ConfigError) as info:
            eng.load_state_dict(state)
        msg = str(info.value)
        for name in ("model.norm.weight", "model.layers.9.mlp.up_proj.weight",
                     "model.embed_tokens.weight", "lm_head.weight", "NaN"):
            assert name in msg, (name, msg)
        assert "\n" not in msg


def test_load_state_dict_reads_bf16_that_np_savez_stored_as_void_bytes(rng):
    """np.savez turns bf16 into '|V2'; loading views those bytes as bf16, bit for bit."""
    with _engine() as eng:
        want = _perturbed(eng.state_dict(), rng)
        buf = io.BytesIO()
        np.savez(buf, **want)
        buf.seek(0)
        loaded = dict(np.load(buf))
        assert loaded["lm_head.weight"].dtype == np.dtype("V2")
        eng.load_state_dict(loaded)
        _assert_same_state(eng.state_dict(), want)


def test_load_state_dict_refuses_other_raw_bytes_naming_tensor_and_fix(rng):
    """A 4-byte void tensor cannot be bf16: the refusal names it and says how to save bf16."""
    with _engine() as eng:
        state = _perturbed(eng.state_dict(), rng)
        w = state["model.norm.weight"].astype(np.float32)
        state["model.norm.weight"] = w.view(np.dtype("V4"))
        with pytest.raises(ConfigError, match=r"model\.norm\.weight.*ml_dtypes\.bfloat16"):
            eng.load_state_dict(state)


def test_weights_only_load_zeroes_adamw_state_and_restarts_the_step_count(rng):
    """Weights from elsewhere (no optimizer keys) load with m = v = 0 and step 0."""
    with _engine() as a:
        a.train_step(_batch(a))
        trained = a.state_dict()
    weights = {k: v for k, v in _perturbed(trained, rng).items()
               if not k.startswith("optimizer.")}
    with _engine(seed=3) as b:
        b.train_step(_batch(b))  # non-zero m and v, step 1
        b.load_state_dict(weights, weights_only=True)
        got = b.state_dict()
        assert int(got["optimizer.step"]) == 0 and b.optimizer.step_count == 0
        for k, v in got.items():
            if k.startswith("optimizer.") and k != "optimizer.step":
                assert not np.any(v.astype(np.float32)), k
            elif not k.startswith("optimizer."):
                assert np.array_equal(v.view(np.uint16), weights[k].view(np.uint16)), k
        assert np.isfinite(b.train_step(_batch(b)).loss)
    with _engine() as c, pytest.raises(ConfigError, match="exp_avg"):
        c.load_state_dict(weights)  # a full load still needs the optimizer state



@pytest.mark.parametrize("exc", [RuntimeError("injected"), KeyboardInterrupt()])
def test_a_step_that_fails_midway_stops_the_engine_until_a_state_is_reloaded(exc):
    """After an exception or interrupt in the backward the next step is refused (it would apply
    the half-accumulated gradients); reloading the state gives exactly a clean run's step."""
    with _engine() as clean:
        state0 = clean.state_dict()
        want = clean.train_step(_batch(clean)).loss
    with _engine() as eng:
        fired = _fail_on(eng, "b.", exc)
        with pytest.raises(type(exc)):
            eng.train_step(_batch(eng))
        assert fired, "the injected failure never ran"
        with pytest.raises(StepFailedError, match=r"step 1 failed.*load_state_dict"):
            eng.train_step(_batch(eng))
        eng.load_state_dict(state0)
        assert eng.train_step(_batch(eng)).loss == want


def test_load_checkpoint_after_a_failed_step_trains_again_as_a_clean_run(tmp_path):
    """A checkpoint loaded after a step failed in the backward: the half-accumulated gradients
    are discarded and the next step is exactly a clean run's (it was refused before: the failed
    step stayed recorded)."""
    with _engine() as clean:
        path = clean.save_checkpoint(tmp_path / "ck")
        want = clean.train_step(_batch(clean)).loss
    with _engine() as eng:
        fired = _fail_on(eng, "b.", RuntimeError("injected"))
        with pytest.raises(RuntimeError):
            eng.train_step(_batch(eng))
        assert fired
        with pytest.raises(StepFailedError, match="load_checkpoint"):
            eng.train_step(_batch(eng))
        eng.load_checkpoint(path)
        assert eng.train_step(_batch(eng)).loss == want


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the blow-up overflows on purpose
def test_non_finite_loss_raises_naming_step_and_lr_and_stops_the_engine():
    """lr 1e9 blows the weights up: the first NaN/inf loss raises NonFiniteError naming the step
    and lr (with the bad StepResult attached), and further steps are refused."""
    with _engine(lr=1e9) as eng:
        saved = eng.state_dict()
        with pytest.raises(NonFiniteError) as info:
            for i in range(4):
                eng.train_step(_batch(eng, 1000 * i))
        err = info.value
        assert err.what == "loss" and not np.isfinite(err.value) and err.lr == 1e9
        assert f"at step {err.step} (lr 1e+09)" in str(err)
        assert err.result is not None and err.result.step == err.step
        with pytest.raises(StepFailedError):
            eng.train_step(_batch(eng))
        eng.load_state_dict(saved)
        assert eng.optimizer.step_count == 0


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_non_finite_grad_norm_raises_when_clipping_measures_it():
    """With clipping on, an infinite/NaN gradient norm is caught too (what='grad norm' or the
    loss, whichever the step shows first), never returned as a normal result."""
    with _engine(lr=1e9, max_grad_norm=1.0) as eng:
        with pytest.raises(NonFiniteError) as info:
            for i in range(6):
                r = eng.train_step(_batch(eng, 1000 * i))
                assert np.isfinite(r.loss) and np.isfinite(r.grad_norm)
        assert info.value.what in ("loss", "grad norm")

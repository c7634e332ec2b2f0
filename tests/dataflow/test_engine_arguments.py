"""Issue 51, part B: every numeric Engine argument is checked by name (a ConfigError saying what it
got, not a bare TypeError from deep inside), and a batch given as a list of lists is taken
deliberately (a tokenizer's input_ids without return_tensors) while ragged rows are refused."""

from __future__ import annotations

import numpy as np
import pytest

from dataflow.engine import Engine
from dataflow.engine_options import EngineOptions, RunOptions
from dataflow.models.errors import ConfigError

BASE = dict(host_gb=1, dev_gb=0.25, seqlen=64, backend="numpy")


@pytest.mark.parametrize("keyword,value,words", [
    ("host_gb", "1", "host_gb must be a number, got '1' (a string)"),
    ("dev_gb", b"1", "dev_gb must be a number, got b'1' (a bytes object)"),
    ("lr", "1e-3", "lr must be a number, got '1e-3' (a string)"),
    ("eps", [1e-8], "eps must be a number, got [1e-08] (a list)"),
    ("weight_decay", True, "weight_decay must be a number, got True (a bool)"),
    ("max_grad_norm", "1", "max_grad_norm must be a number or None, got '1' (a string)"),
    ("seqlen", 64.0, "seqlen must be a whole number, got 64.0 (a float)"),
    ("seqs_per_step", "4", "seqs_per_step must be a whole number or None, got '4' (a string)"),
    ("seed", 1.5, "seed must be a whole number, got 1.5 (a float)"),
    ("betas", (0.9,), "betas must be a pair of numbers"),
])
def test_engine_names_a_numeric_argument_of_the_wrong_type(keyword, value, words):
    """Engine(..., host_gb="1") and friends raise a ConfigError naming the argument and its type."""
    with pytest.raises(ConfigError) as info:
        Engine("tiny", **{**BASE, keyword: value})
    assert words in str(info.value)


def test_options_records_check_their_numbers_too():
    """EngineOptions and RunOptions built directly refuse the same values by name."""
    with pytest.raises(ConfigError, match="host_gb must be a number"):
        EngineOptions(host_gb="1", dev_gb=0.25, seqlen=64)
    with pytest.raises(ConfigError, match="lr must be a number"):
        RunOptions(lr="1e-3")
    assert RunOptions(lr=np.float32(1e-3), seed=np.int64(3)).seed == 3  # NumPy scalars pass


def test_a_list_of_lists_batch_is_the_same_step_as_its_array(rng):
    """A rectangular list of lists of ids trains exactly as the array NumPy makes of it."""
    with Engine("tiny", **BASE, seed=1) as a, Engine("tiny", **BASE, seed=1) as b:
        tokens = rng.integers(0, 256, (a.seqs_per_step, 65))
        ra = a.train_step(tokens)
        rb = b.train_step(tokens.tolist())
    assert ra.loss == rb.loss and ra.grad_norm == rb.grad_norm


def test_a_ragged_list_of_lists_batch_is_refused_by_name(rng):
    """Rows of different lengths: one ConfigError naming the lengths, not NumPy's ValueError."""
    with Engine("tiny", **BASE) as eng:
        rows = rng.integers(0, 256, (eng.seqs_per_step, 65)).tolist()
        rows[1] = rows[1][:40]
        with pytest.raises(ConfigError, match=r"rows have different lengths \(40, 65\)"):
            eng.train_step(rows)
        assert eng.step == 0

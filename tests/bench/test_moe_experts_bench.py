"""bench/moe_experts_bench.py without a GPU: the shape it times comes from the zoo's MoE block,
and a dense model or a bad count is refused before CuPy is imported."""

import pytest

from dataflow.bench import moe_experts_bench


def test_the_timed_shape_is_the_models_moe_block():
    shape = moe_experts_bench._shape("olmoe-1b-7b", 8192)
    assert shape == {"model": "olmoe-1b-7b", "tokens": 8192, "d": 2048, "f": 1024,
                     "n_experts": 64, "top_k": 8}


def test_a_dense_model_and_bad_counts_are_refused(capsys):
    with pytest.raises(SystemExit, match="not a mixture-of-experts"):
        moe_experts_bench.main(["8b"])
    with pytest.raises(SystemExit) as exc:
        moe_experts_bench.main(["olmoe-1b-7b", "--repeat", "0"])
    assert exc.value.code == 2 and "--repeat 0" in capsys.readouterr().err

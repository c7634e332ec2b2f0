"""dataflow.fp8_sites: the keys guessed FP8 scales are looked up by (docs/fp8.md). A site is the
layer visit without its chunk, the op and its call in the visit; on a real fp8 engine's op
names (the NumPy backend, which the CuPy backend names alike) every key recurs in every round
and step, distinct operands get distinct keys, and slots are handed out up to a capacity.
bench.fp8_guess_rate counts how often a scale equals its site's last one."""

from __future__ import annotations

import collections

import numpy as np

from dataflow.backends.numpy_backend import NumpyBackend
from dataflow.bench.fp8_guess_rate import ScaleRecorder, table
from dataflow.engine import Engine
from dataflow.fp8_sites import Fp8Sites
from dataflow.ops_fp8_numpy import FP8_LINEAR_OPS


def test_a_site_is_the_visit_without_its_chunk_the_op_and_its_call():
    s = Fp8Sites(capacity=3)
    assert s.key(0, False) is None and s.slot(0, False) is None  # no op named yet
    keys = []
    for name in ("f.L3.c0.linear_fwd", "f.L3.c0.linear_fwd", "f.L3.c1.linear_fwd",
                 "b.L3.c1.linear_bwd_x", "b.L3.c1.linear_bwd_w", "b.L3.c1.linear_bwd_x",
                 "f.L3.c0.linear_fwd"):
        s.at(name)
        keys.append(s.key(0, False))
    assert keys[0] == (("f.L3", "linear_fwd", 0), 0, False)
    assert keys[1] == (("f.L3", "linear_fwd", 1), 0, False)
    assert keys[2] == keys[0] and keys[6] == keys[0]  # another chunk, another round: the same
    assert keys[3][0] == ("b.L3", "linear_bwd_x", 0) and keys[5][0] == ("b.L3", "linear_bwd_x", 1)
    assert keys[4][0] == ("b.L3", "linear_bwd_w", 0)
    s.at("f.L4.c0.linear_fwd.lora_b")  # a tag after the op is part of the op's name
    assert s.site == ("f.L4", "linear_fwd.lora_b", 0)
    assert [s.slot(r, t) for r, t in ((0, False), (1, False), (0, False), (1, True), (0, True))] \
        == [0, 1, 0, 2, None]  # the fourth key finds no slot left
    s.clear()
    assert len(s) == 0 and s.slot(0, True) == 0


class _Names(NumpyBackend):
    """Records each FP8 op's name, per step."""

    def __init__(self):
        super().__init__()
        self.step, self.names = 0, collections.defaultdict(list)

    def launch(self, stream, op, *args, name=""):
        if op in FP8_LINEAR_OPS:
            self.names[self.step].append(name)
        super().launch(stream, op, *args, name=name)


def test_an_fp8_engines_sites_recur_in_every_round_and_step():
    """tiny (2 layers) at 2 chunks x 2 rounds: each step's keys are the same set, each key is
    met once per round and chunk, and no layer has more than 56 keys (the plan's slots assume
    it: memplan.plan.buffers.FP8_GUESS_VALUES)."""
    be = _Names()
    rng = np.random.default_rng(3)
    with Engine("tiny", host_gb=1, dev_gb=0.5, seqlen=64, backend=be, precision="fp8",
                tokens_per_step=256, plan_options={"chunk_tokens": 64}) as eng:
        ch = eng.plan.chunking
        assert ch.chunks_per_round * ch.rounds_per_step == 4
        for step in (1, 2):
            be.step = step
            eng.train_step(rng.integers(0, 256, (eng.seqs_per_step, 65)))
    per_step = []
    for step in (1, 2):
        sites = Fp8Sites(capacity=10_000)
        seen = collections.Counter()
        for name in be.names[step]:
            sites.at(name)
            seen[sites.key(0, False)] += 1
        per_step.append(seen)
    assert per_step[0] == per_step[1]
    uses = set(per_step[0].values())
    assert uses <= {ch.chunks_per_round * ch.rounds_per_step, ch.rounds_per_step}, uses
    layers = collections.Counter(k[0][0].split(".")[1] for k in per_step[0])
    # 7 forward, 7 recomputed, 7 dx and 7 dw ops at most, two operands each (one layout an op)
    assert max(layers.values()) * 2 <= 56


def test_the_guess_rate_bench_counts_every_fp8_operand():
    """bench.fp8_guess_rate's recorder on tiny: every scale of step 1 misses at its first use
    and every operand of each FP8 op is counted; the table covers the three kinds."""
    be = ScaleRecorder()
    rng = np.random.default_rng(5)
    with Engine("tiny", host_gb=1, dev_gb=0.5, seqlen=64, backend=be, precision="fp8",
                tokens_per_step=128) as eng:
        for step in (1, 2, 3):
            be.step = step
            eng.train_step(rng.integers(0, 256, (eng.seqs_per_step, 65)))
    text, numbers = table(be.counts, 3)
    assert {"activation", "weight", "output gradient", "all"} <= set(numbers)
    assert numbers["all"]["step1_missed"] >= len(be.last)  # each key's first use misses
    assert numbers["weight"]["later_seen"] > 0 and "weight" in text
    assert [s["seen"] for s in numbers["per_step"]] == [numbers["all"]["step1_seen"]] + \
        [numbers["all"]["later_seen"] // 2] * 2

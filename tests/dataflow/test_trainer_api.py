"""The Engine as another trainer drives it (issue 21), on the NumPy backend against the reference
trainer: masked labels, packed documents (loss and gradients equal to running the documents
separately), a trainer-chosen batch under two budgets, eval_step leaving all state bit-identical,
per-step learning rate and clipping, and refusals that name the bad value."""

from __future__ import annotations

import numpy as np
import pytest

from dataflow.batch import make_batch
from dataflow.engine import Engine
from dataflow.optimizer import AdamW, AdamWConfig
from dataflow.reference_model import forward_backward
from dataflow.reference_trainer import ReferenceTrainer
from dataflow.kernels.reference import IGNORE
from dataflow.memplan.plan.plan import GradAccum
from dataflow.models.config import load_config
from dataflow.models.errors import ConfigError
from dataflow.models.init import init_model
from tests.dataflow.plans import path_plans, split_plans

LR = 1e-3
LOSS_REL = 1e-2
"""Loss against the reference trainer (bf16 storage on both sides), as test_executor bounds it."""
GRAD_REL = 3e-2
"""Relative L2 error of a block's gradient against the reference's (bf16 activations and
bf16 gradient accumulation on the engine's side; fp32 accumulation on the reference's)."""


UPDATE_REL = 5e-2
"""Relative L2 of a block's weight update against the reference's, as test_executor bounds it."""


def _blocks0(cfg, seed=0):
    w = init_model(cfg, seed)
    return [b.astype(np.float64) for b in (w.embed, *w.layers, w.head)]


def _tokens(rng, rows, seqlen, vocab=512):
    return rng.integers(0, vocab, size=(rows, seqlen + 1))


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


class _GradProbe(AdamW):
    """AdamW at lr 0 that snapshots every block's accumulated gradient when the executor asks
    for the step's hyperparameters (between the rounds and the updates)."""

    def __init__(self, ex):
        super().__init__(AdamWConfig(lr=0.0))
        self.ex, self.grads = ex, None

    def begin_step(self, *args):
        ex = self.ex
        ex.be.synchronize()
        self.grads = [ex.download(b.device("grads") if b.device("grads") is not None
                                  else b.home("grads")).astype(np.float64) for b in ex.blocks()]
        return super().begin_step(*args)


def _engine_grads(plan, batch, seed=0):
    """(loss, per-block gradients) of one step of `plan` on a dataflow.batch.Batch."""
    eng = Engine.from_plan(plan, backend="numpy", seed=seed, sanitize=True)
    with eng:
        probe = _GradProbe(eng.ex)
        stats = eng.ex.step(batch, probe)
        return stats.loss, probe.grads


def _reference_grads(cfg, seed, docs, labels=None):
    """Loss and gradients of running each document (a 1-D token array) on its own through the
    reference model; gradients of the mean over all their targets."""
    w = init_model(cfg, seed)
    labels = labels or [None] * len(docs)
    count = sum(int(np.count_nonzero((d if lab is None else lab)[1:] != IGNORE))
                for d, lab in zip(docs, labels))
    loss, total = 0.0, None
    for d, lab in zip(docs, labels):
        s, _, g = forward_backward(cfg, w, d, 1.0 / count, labels=lab)
        loss += s
        total = g.blocks() if total is None else [a + b for a, b in zip(total, g.blocks())]
    return loss / count, total


def _pack(rng, rows, seqlen, min_len=3):
    """Rows of seqlen + 1 tokens cut into documents of random lengths (>= min_len tokens):
    (tokens, doc_ids, documents as 1-D arrays)."""
    tokens = _tokens(rng, rows, seqlen)
    doc_ids = np.zeros_like(tokens)
    docs = []
    for r in range(rows):
        cuts = sorted(rng.choice(np.arange(min_len, seqlen + 1 - min_len), size=3,
                                 replace=False))
        cuts = [c for i, c in enumerate(cuts) if i == 0 or c - cuts[i - 1] >= min_len]
        bounds = [0, *cuts, seqlen + 1]
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            doc_ids[r, a:b] = 10 * r + i
            docs.append(tokens[r, a:b])
    return tokens, doc_ids, docs


# -- labels --------------------------------------------------------------------------------------
def test_masked_labels_match_reference_trainer_and_count_only_kept_targets(rng):
    """Prompts and random positions labelled -100 contribute nothing: the loss (the mean over
    the kept targets) and token count match the reference trainer's through train_step, and
    every block's gradient matches the reference's within the bf16 bound."""
    cfg = load_config("tiny")
    tokens = _tokens(rng, 8, 64)
    labels = tokens.copy()
    for r in range(8):
        labels[r, :rng.integers(1, 40)] = IGNORE                   # the prompt
    labels[rng.random(labels.shape) < 0.1] = IGNORE
    with Engine("tiny", host_gb=1, dev_gb=0.25, seqlen=64, backend="numpy", lr=LR,
                seqs_per_step=8, sanitize=True) as eng:
        result = eng.train_step(tokens, labels)
    want = ReferenceTrainer(cfg, init_model(cfg, 0), lr=LR).train_step(tokens, labels)
    assert result.loss_tokens == want.n_tokens == np.count_nonzero(labels[:, 1:] != IGNORE)
    assert abs(result.loss - want.loss_mean) <= LOSS_REL * want.loss_mean
    plan = path_plans(cfg)[2][1]                                    # streamed, 2 rounds
    loss, grads = _engine_grads(plan, make_batch(tokens, labels, vocab_size=cfg.vocab_size,
                                                 rows=8, seqlen=64))
    want_loss, want_grads = _reference_grads(cfg, 0, list(tokens), list(labels))
    assert abs(loss - want_loss) <= LOSS_REL * want_loss
    errors = [_rel(g, w) for g, w in zip(grads, want_grads)]
    assert max(errors) < GRAD_REL, errors


def test_fully_masked_rows_contribute_exactly_nothing(rng):
    """Rows whose labels are all -100 add nothing: changing their tokens leaves the loss and
    every gradient bit-identical (their backward carries exact zeros)."""
    cfg = load_config("tiny")
    plan = path_plans(cfg)[0][1]
    ch = plan.chunking
    tokens = _tokens(rng, ch.seqs_per_step, ch.seqlen)
    labels = tokens.copy()
    labels[1] = IGNORE
    labels[-1] = IGNORE
    other = tokens.copy()
    other[[1, -1]] = _tokens(rng, 2, ch.seqlen)
    kw = dict(vocab_size=cfg.vocab_size, rows=ch.seqs_per_step, seqlen=ch.seqlen)
    loss_a, a = _engine_grads(plan, make_batch(tokens, labels, **kw))
    loss_b, b = _engine_grads(plan, make_batch(other, labels, **kw))
    assert loss_a == loss_b and all(np.array_equal(x, y) for x, y in zip(a, b))


# -- packed documents ------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["packed", "split", "streamed"])
def test_packed_documents_equal_running_documents_separately(rng, which):
    """Rows cut into documents (doc_ids): loss and every block's gradient equal those of running
    each document alone through the reference model, within the bf16 bound; the same rows
    without doc_ids (attention across documents) miss that bound by far."""
    cfg = load_config("tiny")
    plan = {"packed": path_plans(cfg)[0][1], "split": split_plans(cfg)[0][1],
            "streamed": path_plans(cfg)[2][1]}[which]
    ch = plan.chunking
    tokens, doc_ids, docs = _pack(rng, ch.seqs_per_step, ch.seqlen)
    batch = make_batch(tokens, doc_ids=doc_ids, vocab_size=cfg.vocab_size,
                       rows=ch.seqs_per_step, seqlen=ch.seqlen)
    assert batch.counted == sum(d.size - 1 for d in docs)
    loss, grads = _engine_grads(plan, batch)
    want_loss, want = _reference_grads(cfg, 0, docs)
    assert abs(loss - want_loss) <= LOSS_REL * want_loss
    errors = [_rel(g, w) for g, w in zip(grads, want)]
    assert max(errors) < GRAD_REL, errors
    # Teeth: the same targets with attention across documents and positions not restarting.
    labels = np.where(np.concatenate([np.zeros((ch.seqs_per_step, 1), bool),
                                      doc_ids[:, 1:] != doc_ids[:, :-1]], axis=1), IGNORE, tokens)
    crossing = make_batch(tokens, labels, vocab_size=cfg.vocab_size, rows=ch.seqs_per_step,
                          seqlen=ch.seqlen)
    _, wrong = _engine_grads(plan, crossing)
    assert max(_rel(g, w) for g, w in zip(wrong, want)) > 3 * max(errors)


def test_position_ids_that_restart_mark_the_same_documents_as_doc_ids(rng):
    """position_ids restarting at 0 per document (transformers' packing) give bit-identical
    results to the equivalent doc_ids."""
    cfg = load_config("tiny")
    plan = split_plans(cfg)[0][1]
    ch = plan.chunking
    tokens, doc_ids, _ = _pack(rng, ch.seqs_per_step, ch.seqlen)
    pos = np.zeros_like(tokens)
    for r in range(tokens.shape[0]):
        start = 0
        for j in range(tokens.shape[1]):
            if j and doc_ids[r, j] != doc_ids[r, j - 1]:
                start = j
            pos[r, j] = j - start
    kw = dict(vocab_size=cfg.vocab_size, rows=ch.seqs_per_step, seqlen=ch.seqlen)
    a = _engine_grads(plan, make_batch(tokens, doc_ids=doc_ids, **kw))
    b = _engine_grads(plan, make_batch(tokens, position_ids=pos, **kw))
    assert a[0] == b[0] and all(np.array_equal(x, y) for x, y in zip(a[1], b[1]))


# -- the trainer's batch -----------------------------------------------------------------------------
def test_trainer_batch_is_kept_under_two_budgets_and_both_match_the_reference(rng):
    """tokens_per_step = 12 sequences under a roomy device budget and one just below what its
    plan uses: the plans differ, both take exactly 12 sequences, and two steps of each match the
    reference trainer within the bf16 bound and each other (bit for bit when only placement
    differs)."""
    from dataflow.data import token_stream

    cfg = load_config("tiny")
    # Text, as test_executor trains on (uniform random ids leave the embedding's AdamW update
    # at the mercy of sign flips of near-zero gradients), from a random place.
    batches = [token_stream(64, 12, 512, start=int(rng.integers(0, 50_000))) for _ in range(2)]
    ref = ReferenceTrainer(cfg, init_model(cfg, 0), lr=LR)
    want = [ref.train_step(b).loss_mean for b in batches]
    from dataflow.memplan import make_plan
    from dataflow.memplan.plan.plan import Budget
    from dataflow.memplan.plan.profiles import get_profile

    roomy = make_plan(cfg, 64, Budget.from_gib(1, 0.25), get_profile("cpu"), seqs_per_step=12,
                      grad_accum=GradAccum.FP32)
    tight_gib = (roomy.memory.device_bytes - 4096) / 2**30   # just below what roomy's plan uses
    runs = []
    for dev_gb in (tight_gib, 0.25):
        with Engine("tiny", host_gb=1, dev_gb=dev_gb, seqlen=64, backend="numpy", lr=LR,
                    max_grad_norm=None,  # the reference trainer does not clip
                    tokens_per_step=12 * 64, plan_options={"grad_accum": GradAccum.FP32}) as eng:
            assert eng.seqs_per_step == 12
            losses = [eng.train_step(b).loss for b in batches]
            w = eng.weights()
            runs.append((eng.plan, losses, [w.embed, *w.layers, w.head]))
    assert runs[0][0] != runs[1][0]
    for _, losses, blocks in runs:
        for got, exp in zip(losses, want):
            assert abs(got - exp) <= LOSS_REL * exp
        # Layers and head; the embedding's AdamW update flips sign on its near-zero gradients
        # (rows of rare bytes) and was seen 5-6 % off, so the second step's loss stands for it.
        for a, b, w0 in list(zip(blocks, ref.blocks, _blocks0(cfg)))[1:]:
            assert _rel(a.astype(np.float64) - w0, b.astype(np.float64) - w0) < UPDATE_REL
    if runs[0][0].chunking == runs[1][0].chunking:  # placement alone differs: same bits
        assert runs[0][1] == runs[1][1]
        assert all(np.array_equal(a, b) for a, b in zip(runs[0][2], runs[1][2]))
    else:
        assert runs[0][1][0] == pytest.approx(runs[1][1][0], rel=1e-3)


def test_planner_keeps_the_batch_or_names_the_smallest_budgets_for_it():
    """make_plan(seqs_per_step=N) always plans N sequences per step (odd N too); a budget too
    small is refused naming the batch and the smallest budgets; a tokens_per_step that is not a
    multiple of seqlen names the nearest ones."""
    from dataflow.memplan import make_plan
    from dataflow.memplan.plan.errors import InfeasibleBudget
    from dataflow.memplan.plan.plan import Budget
    from dataflow.memplan.plan.profiles import get_profile

    cfg = load_config("tiny")
    for n in (1, 7, 12, 64):
        plan = make_plan(cfg, 64, Budget.from_gib(1, 0.25), get_profile("cpu"), seqs_per_step=n)
        assert plan.chunking.seqs_per_step == n
    plan = make_plan(load_config("8b"), 8192, Budget.from_gib(80, 24), get_profile("h100"),
                     seqs_per_step=24)
    assert plan.chunking.seqs_per_step == 24
    with pytest.raises(InfeasibleBudget, match="with 24 sequences per step.*dev_gb"):
        make_plan(load_config("8b"), 8192, Budget.from_gib(80, 2), get_profile("h100"),
                  seqs_per_step=24)
    with pytest.raises(ConfigError, match="try 640 or 704"):
        make_plan(cfg, 64, Budget.from_gib(1, 0.25), get_profile("cpu"), tokens_per_step=650)


# -- eval_step -------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", [0, 1, 2])
def test_eval_step_leaves_weights_and_adamw_state_bit_identical(rng, which):
    """Between two train steps, eval_step changes no weight, AdamW m or v, or step count (bit for
    bit, on resident and streamed plans, sanitizer on); its loss equals bit for bit the loss the
    next train_step reports on the same batch, and a partial round of rows is padded."""
    cfg = load_config("tiny")
    plan = path_plans(cfg)[which][1]
    ch = plan.chunking
    with Engine.from_plan(plan, backend="numpy", lr=LR, sanitize=True) as eng:
        eng.train_step(_tokens(rng, ch.seqs_per_step, ch.seqlen))
        before = eng.state_dict()
        batch = _tokens(rng, ch.seqs_per_step, ch.seqlen)
        labels = batch.copy()
        labels[:, :5] = IGNORE
        loss = eng.eval_step(batch, labels)
        after = eng.state_dict()
        assert before.keys() == after.keys()
        assert all(np.array_equal(before[k], after[k]) for k in before)
        assert eng.train_step(batch, labels).loss == loss
        part = eng.eval_step(batch[:ch.seqs_per_round + 1])       # one row past a round
        ref = ReferenceTrainer(cfg, eng.weights(), lr=LR)
        want, _, _ = ref.accumulate_grads(batch[:ch.seqs_per_round + 1])
        assert abs(part - want) <= LOSS_REL * want


# -- learning rate and clipping per call ---------------------------------------------------------
def test_per_step_lr_set_lr_and_per_call_clipping_equal_configured_ones(rng):
    """train_step(lr=...) and set_lr give bit-identical weights to an engine built with that lr;
    max_grad_norm per call equals the configured clipping, inf clips nothing."""
    b1, b2 = _tokens(rng, 4, 64), _tokens(rng, 4, 64)
    kw = dict(host_gb=1, dev_gb=0.25, seqlen=64, backend="numpy", seqs_per_step=4)

    def run(lr, calls, **extra):
        with Engine("tiny", lr=lr, **kw, **extra) as eng:
            results = calls(eng)
            w = eng.weights()
            return results, [w.embed, *w.layers, w.head]

    _, base = run(2e-3, lambda e: [e.train_step(b1), e.train_step(b2)])
    _, per_call = run(5e-4, lambda e: [e.train_step(b1, lr=2e-3), e.train_step(b2, lr=2e-3)])

    def via_set_lr(e):
        e.set_lr(2e-3)
        return [e.train_step(b1), e.train_step(b2)]

    _, via_set = run(5e-4, via_set_lr)
    assert all(np.array_equal(a, b) for a, b in zip(base, per_call))
    assert all(np.array_equal(a, b) for a, b in zip(base, via_set))
    [clipped], w_cfg = run(2e-3, lambda e: [e.train_step(b1)], max_grad_norm=0.05)
    [clip_call], w_call = run(2e-3, lambda e: [e.train_step(b1, max_grad_norm=0.05)])
    assert clipped.grad_norm == clip_call.grad_norm > 0.05
    assert all(np.array_equal(a, b) for a, b in zip(w_cfg, w_call))
    (inf, r2), w_inf = run(2e-3, lambda e: [e.train_step(b1, max_grad_norm=float("inf")),
                                            e.train_step(b2)])
    assert inf.grad_norm == clipped.grad_norm
    assert all(np.array_equal(a, b) for a, b in zip(w_inf, base))
    assert inf.lr == 2e-3 and inf.loss_tokens == 4 * 64 and inf.step_time_s > 0


# -- refusals --------------------------------------------------------------------------------------
def test_train_step_refuses_bad_labels_documents_and_lr_naming_the_value(rng):
    """Labels of the wrong shape, a label that is neither a token nor -100, all labels -100,
    doc_ids with position_ids, a negative position and a negative lr are refused before
    anything runs, and the engine keeps training."""
    with Engine("tiny", host_gb=1, dev_gb=0.25, seqlen=64, backend="numpy",
                seqs_per_step=4) as eng:
        t = _tokens(rng, 4, 64)
        with pytest.raises(ConfigError, match=r"labels has shape \(4, 64\)"):
            eng.train_step(t, t[:, 1:])
        bad = t.copy()
        bad[1, 7] = -1
        with pytest.raises(ConfigError, match="label -1 .*-100"):
            eng.train_step(t, bad)
        with pytest.raises(ConfigError, match="every label"):
            eng.train_step(t, np.full_like(t, IGNORE))
        with pytest.raises(ConfigError, match="not both"):
            eng.train_step(t, doc_ids=t, position_ids=t)
        with pytest.raises(ConfigError, match="position id -3"):
            eng.train_step(t, position_ids=np.full_like(t, -3))
        with pytest.raises(ConfigError, match="lr"):
            eng.train_step(t, lr=-1.0)
        assert np.isfinite(eng.train_step(t).loss)

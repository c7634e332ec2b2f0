"""The Engine's contract with a trainer that embeds it (issue 37, rows 2-8): calls from several
threads take turns, a checkpoint directory as the model resumes it, close() releases memory and
refuses later calls by name, a misspelt option names the closest valid one, one clipping
convention, read-only lr / step / optimizer, resume judges only the lr the run uses, a step's
batch in pieces, and StepResult.to_dict."""

from __future__ import annotations

import inspect
import json
import re
import threading
import warnings

import numpy as np
import pytest

from dataflow.engine import Engine
from dataflow.engine_options import EngineOptions, RunOptions, UnknownOptionError
from dataflow.lr_schedule import WarmupCosine
from dataflow.models.errors import ConfigError
from dataflow.optimizer import AdamWConfig

SEQLEN = 64
VOCAB = 512  # tiny's


def _engine(**kw):
    kw = {"lr": 1e-3, "seqs_per_step": 8, **kw}
    return Engine("tiny", host_gb=0.5, dev_gb=0.25, seqlen=SEQLEN, backend="numpy", **kw)


def _tokens(rng, rows=8):
    return rng.integers(0, VOCAB, size=(rows, SEQLEN + 1))


def _same_state(a: dict, b: dict) -> None:
    """Two state_dicts hold the same tensors, bit for bit."""
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k].dtype, a[k].shape) == (b[k].dtype, b[k].shape), k
        assert a[k].tobytes() == b[k].tobytes(), k


# -- row 2: threads ------------------------------------------------------------------------------
def test_concurrent_train_steps_take_turns_and_match_sequential_steps(rng):
    """Two threads stepping one engine at once: both results are real steps (1 and 2), and the
    losses and final state are the bits of running them one after the other in that order."""
    batches = [_tokens(rng), _tokens(rng)]
    results = [None, None]
    with _engine() as eng:
        start = threading.Barrier(2)

        def work(i):
            start.wait()
            results[i] = eng.train_step(batches[i])

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        threaded = eng.state_dict()
    assert sorted(r.step for r in results) == [1, 2]
    order = sorted(range(2), key=lambda i: results[i].step)
    with _engine() as eng:
        sequential = [eng.train_step(batches[i]) for i in order]
        _same_state(threaded, eng.state_dict())
    assert [results[i].loss for i in order] == [r.loss for r in sequential]
    assert all(r.loss > 1.0 for r in results)  # not the 0.0 of interleaved work


def test_eval_in_a_background_thread_leaves_training_bit_identical(rng):
    """eval_step looping in another thread while three train_steps run: the train losses and
    the final state are those of training alone, and every evaluation is a real loss."""
    batches = [_tokens(rng) for _ in range(3)]
    held_out = _tokens(rng, 4)
    with _engine() as eng:
        alone = [eng.train_step(b).loss for b in batches]
        alone_state = eng.state_dict()
    evals: list[float] = []
    stop = threading.Event()
    with _engine() as eng:
        def evaluate():
            while not stop.is_set():
                evals.append(eng.eval_step(held_out))

        t = threading.Thread(target=evaluate)
        t.start()
        try:
            losses = [eng.train_step(b).loss for b in batches]
        finally:
            stop.set()
            t.join()
        _same_state(eng.state_dict(), alone_state)
    assert losses == alone
    assert evals and all(np.isfinite(x) and x > 1.0 for x in evals)


# -- row 3: a checkpoint directory as the model -------------------------------------------------
def test_engine_on_a_checkpoint_directory_resumes_it_bit_for_bit(rng, tmp_path):
    """Engine('<root>/step_00000002') and Engine('<root>') load the checkpoint's weights, AdamW
    state, step and lr (left at the default, it takes the checkpoint's), and the next step is
    the bits of the engine that saved it continuing."""
    batches = [_tokens(rng) for _ in range(3)]
    with _engine(lr=2e-3, weight_decay=0.1) as eng:
        for b in batches[:2]:
            eng.train_step(b)
        path = eng.save_checkpoint(tmp_path / "ck")
        saved = eng.state_dict()
        fresh = eng.eval_step(batches[2])
        go_on = eng.train_step(batches[2])
        after = eng.state_dict()
    assert path.name == "step_00000002"
    for source in (path, tmp_path / "ck"):
        with Engine(source, host_gb=0.5, dev_gb=0.25, seqlen=SEQLEN, backend="numpy",
                    seqs_per_step=8) as eng:
            assert eng.step == 2 and eng.lr == 2e-3
            assert eng.optimizer.config.weight_decay == 0.1
            _same_state(eng.state_dict(), saved)
            assert eng.eval_step(batches[2]) == fresh
            r = eng.train_step(batches[2])
            assert (r.step, r.loss, r.grad_norm) == (3, go_on.loss, go_on.grad_norm)
            _same_state(eng.state_dict(), after)


def test_engine_on_a_checkpoint_refuses_weights_too_and_keeps_explicit_settings(rng, tmp_path):
    """A checkpoint plus weights= is refused by name; an lr passed with a checkpoint is kept."""
    with _engine() as eng:
        eng.train_step(_tokens(rng))
        path = eng.save_checkpoint(tmp_path)
        weights = eng.weights()
    with pytest.raises(ConfigError, match="checkpoint.*weights="):
        Engine(path, host_gb=0.5, dev_gb=0.25, seqlen=SEQLEN, backend="numpy", weights=weights)
    with Engine(path, host_gb=0.5, dev_gb=0.25, seqlen=SEQLEN, backend="numpy",
                seqs_per_step=8, lr=4e-4) as eng:
        assert eng.step == 1 and eng.lr == 4e-4


# -- row 4: close ---------------------------------------------------------------------------------
def test_close_releases_host_memory_without_del_or_gc(rng):
    """Closing an engine that trained a step gives back (RSS) at least 80 % of what building
    and stepping it took, while the engine object is still referenced."""
    psutil = pytest.importorskip("psutil")
    proc = psutil.Process()

    def build():
        eng = Engine("small", host_gb=1, dev_gb=0.5, seqlen=SEQLEN, backend="numpy",
                     seqs_per_step=8)
        eng.train_step(rng.integers(0, eng.plan.model.vocab_size, size=(8, SEQLEN + 1)))
        return eng

    for _ in range(2):  # imports, numba kernels and allocator pools: a plan that streams
        build().close()  # layers warms ~24 MiB more in its second engine, once
    before = proc.memory_info().rss
    eng = build()
    grown = proc.memory_info().rss - before
    eng.close()
    dropped = before + grown - proc.memory_info().rss
    assert grown > 16 << 20, f"the engine took only {grown >> 20} MiB; the test measures nothing"
    assert dropped >= 0.8 * grown, f"close gave back {dropped >> 20} of {grown >> 20} MiB"
    assert eng.ex is None and eng.be is None


CALLS = {  # every public call, as (engine, a batch, a block) -> call
    "train_step": lambda e, b, ref: e.train_step(b),
    "eval_step": lambda e, b, ref: e.eval_step(b),
    "state_dict": lambda e, b, ref: e.state_dict(),
    "load_state_dict": lambda e, b, ref: e.load_state_dict({}),
    "weights": lambda e, b, ref: e.weights(),
    "read_block": lambda e, b, ref: e.read_block(ref),
    "write_block": lambda e, b, ref: e.write_block(ref, np.zeros(4)),
    "block_refs": lambda e, b, ref: e.block_refs(),
    "layout": lambda e, b, ref: e.layout(ref),
    "save_checkpoint": lambda e, b, ref: e.save_checkpoint("/nonexistent/ck"),
    "load_checkpoint": lambda e, b, ref: e.load_checkpoint("/nonexistent/ck"),
    "save_pretrained": lambda e, b, ref: e.save_pretrained("/nonexistent/hf"),
    "set_lr": lambda e, b, ref: e.set_lr(0.1),
    "memory_used_bytes": lambda e, b, ref: e.memory_used_bytes(),
    "step_progress": lambda e, b, ref: e.step_progress(),
}


def test_every_call_after_close_is_refused_by_name(rng):
    """After close, each public call raises ConfigError 'Engine is closed: <call> ...'; a second
    close does nothing, and step / lr still read."""
    eng = _engine()
    ref = eng.block_refs()[0]
    eng.train_step(_tokens(rng))
    eng.close()
    eng.close()
    for name, call in CALLS.items():
        with pytest.raises(ConfigError, match=f"Engine is closed: {name} "):
            call(eng, _tokens(rng), ref)
    assert eng.step == 1 and eng.lr == 1e-3


# -- row 5: the constructor's keywords ----------------------------------------------------------
def test_constructor_shows_its_options_and_names_the_closest_to_a_misspelt_one():
    """help(Engine) lists lr, backend, seed, max_grad_norm... as keyword-only arguments; a
    misspelt one (Engine() or from_plan) is a TypeError and a ConfigError naming both words."""
    params = inspect.signature(Engine.__init__).parameters
    for name in ("lr", "backend", "seed", "max_grad_norm", "weight_decay", "lr_schedule",
                 "trace", "deferred_update", "seqs_per_step"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    for name, p in params.items():  # every keyword is documented
        if p.kind is inspect.Parameter.KEYWORD_ONLY:
            assert re.search(rf"\b{name}\b", Engine.__init__.__doc__), name
    for bad, good in (("max_grad_nrom", "max_grad_norm"), ("learning_rte", None),
                      ("backnd", "backend"), ("sead", "seed")):
        with pytest.raises(TypeError, match=f"'{bad}'") as exc:
            _engine(**{bad: 1})
        assert isinstance(exc.value, ConfigError) and exc.value.suggestion == good
        if good:
            assert f"did you mean '{good}'" in str(exc.value)
    with _engine() as eng:
        plan = eng.plan
    with pytest.raises(UnknownOptionError, match="'weight_decy'.*'weight_decay'"):
        Engine.from_plan(plan, backend="numpy", weight_decy=0.1)


def test_one_options_object_builds_the_engine_the_keywords_build(rng):
    """Engine(model, EngineOptions(...)) and from_plan(plan, RunOptions(...)) train the same bits
    as the same values passed as keywords; options beside keywords, or of another type, are
    refused by name, and a missing budget is Python's own TypeError."""
    batch = _tokens(rng)
    with _engine(weight_decay=0.1) as eng:
        want = eng.train_step(batch).loss, eng.state_dict()
        plan = eng.plan
    options = EngineOptions(host_gb=0.5, dev_gb=0.25, seqlen=SEQLEN, seqs_per_step=8,
                            run=RunOptions(backend="numpy", lr=1e-3, weight_decay=0.1))
    for make in (lambda: Engine("tiny", options), lambda: Engine("tiny", options=options),
                 lambda: Engine.from_plan(plan, options.run)):
        with make() as eng:
            assert eng.train_step(batch).loss == want[0]
            _same_state(eng.state_dict(), want[1])
    with pytest.raises(ConfigError, match="options and the keyword.*lr"):
        Engine("tiny", options, lr=1e-3)
    with pytest.raises(ConfigError, match="options and the keyword.*seed"):
        Engine.from_plan(plan, options.run, seed=1)
    with pytest.raises(TypeError, match="EngineOptions, not RunOptions"):
        Engine("tiny", options.run)
    with pytest.raises(TypeError, match="missing 2 required keyword-only arguments: 'dev_gb' "
                                        "and 'seqlen'"):
        Engine("tiny", host_gb=1)
    assert options.keywords() == {"host_gb": 0.5, "dev_gb": 0.25, "seqlen": SEQLEN,
                                  "seqs_per_step": 8, "backend": "numpy", "lr": 1e-3,
                                  "weight_decay": 0.1}


# -- row 6: clipping, lr, step, optimizer, resume -----------------------------------------------
def test_default_clips_at_one_and_zero_or_none_turn_clipping_off(rng):
    """The engine clips at 1.0 unless told; 0 and None are the same "off" in the constructor
    and in a step (the same bits), and a real clip changes the step."""
    batches = [_tokens(rng) for _ in range(2)]

    def run(**kw):
        step_clip = kw.pop("step_clip", "configured")
        with _engine(**kw) as eng:
            clip = eng.optimizer.config.max_grad_norm
            extra = {} if step_clip == "configured" else {"max_grad_norm": step_clip}
            out = [(r.loss, r.grad_norm) for r in (eng.train_step(b, **extra)
                                                   for b in batches)]
            return clip, out, eng.state_dict()

    clip, default_out, default_state = run()
    assert clip == 1.0
    assert run(max_grad_norm=1.0)[1] == default_out
    off = run(max_grad_norm=0)
    assert off[0] is None
    assert run(max_grad_norm=None)[1:2] == off[1:2] == run(step_clip=0)[1:2]
    _same_state(run(step_clip=None)[2], off[2])
    tight = run(max_grad_norm=0.01)
    assert tight[1][1] != off[1][1]  # clipping at 0.01 changes step 2 (norms are ~0.2)
    assert AdamWConfig().max_grad_norm == 1.0 and AdamWConfig(max_grad_norm=0) == \
        AdamWConfig(max_grad_norm=None)
    with pytest.raises(ConfigError, match="max_grad_norm.*-1"):
        _engine(max_grad_norm=-1)
    with pytest.raises(ConfigError, match="backward_update.*max_grad_norm=0"):
        _engine(backward_update=True)


def test_lr_and_step_are_read_only_and_the_optimizer_cannot_be_broken_by_assignment(rng):
    """eng.lr follows the constructor, set_lr and a schedule; eng.step counts steps; assigning
    either, eng.optimizer or eng.optimizer.lr raises AttributeError and the engine still trains."""
    sched = WarmupCosine(lr=2e-3, total_steps=10, warmup_steps=2, min_lr=2e-4)
    with _engine(lr=5e-4) as eng:
        assert (eng.lr, eng.step) == (5e-4, 0)
        for name in ("lr", "step", "optimizer"):
            with pytest.raises(AttributeError):
                setattr(eng, name, 0.1)
        with pytest.raises(AttributeError, match="set_lr"):
            eng.optimizer.lr = 0.1
        with pytest.raises(AttributeError, match="set_lr"):
            eng.optimizer.learning_rate = 0.1
        r = eng.train_step(_tokens(rng))
        assert (r.lr, eng.step) == (5e-4, 1) and np.isfinite(r.loss)
        eng.set_lr(7e-4)
        assert eng.lr == 7e-4 and eng.train_step(_tokens(rng)).lr == 7e-4
    with _engine(lr_schedule=sched) as eng:
        assert eng.lr == sched(1)
        r = eng.train_step(_tokens(rng))
        assert r.lr == sched(1) and eng.lr == sched(2)


def test_resume_judges_only_the_lr_the_run_uses(rng, tmp_path):
    """A checkpoint saved at lr 1e-3 without a schedule: an engine at lr 5e-4 loads it with a
    warning naming both (its steps' lr= then continue the saved run bit for bit); an engine
    with a schedule the run never had, or another weight decay, is still refused."""
    batches = [_tokens(rng) for _ in range(2)]
    with _engine(lr=1e-3) as eng:
        eng.train_step(batches[0])
        path = eng.save_checkpoint(tmp_path)
        go_on = eng.train_step(batches[1])
        after = eng.state_dict()
    with _engine(lr=5e-4) as eng:
        with pytest.warns(UserWarning, match=r"lr 0\.001.*lr is 0\.0005"):
            assert eng.load_checkpoint(path).step == 1
        r = eng.train_step(batches[1], lr=1e-3)
        assert (r.loss, r.grad_norm) == (go_on.loss, go_on.grad_norm)
        _same_state(eng.state_dict(), after)
    sched = WarmupCosine(lr=1e-3, total_steps=10, warmup_steps=2, min_lr=1e-4)
    with _engine(lr=5e-4, lr_schedule=sched) as eng:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ConfigError, match="schedule"):  # the saved run had none
                eng.load_checkpoint(path)
    with _engine(lr=1e-3, weight_decay=0.1) as eng:
        with pytest.raises(ConfigError, match="optimizer.weight_decay"):
            eng.load_checkpoint(path)


def test_resume_under_the_same_schedule_ignores_the_constructor_lr(rng, tmp_path):
    """Trained under a schedule, a checkpoint resumes into an engine with that schedule and any
    constructor lr (never read under a schedule): no warning, no refusal."""
    sched = WarmupCosine(lr=1e-3, total_steps=10, warmup_steps=2, min_lr=1e-4)
    with _engine(lr=1e-3, lr_schedule=sched) as eng:
        eng.train_step(_tokens(rng))
        path = eng.save_checkpoint(tmp_path)
    with _engine(lr=3e-4, lr_schedule=sched) as eng:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert eng.load_checkpoint(path).step == 1
        assert eng.lr == sched(2)


# -- row 7: a batch in pieces ---------------------------------------------------------------------
def test_a_batch_in_pieces_is_the_bits_of_one_array(rng):
    """Steps whose tokens (and labels, doc_ids) arrive as a list or an iterator of row blocks
    give the losses, norms and state of the same rows in one array; rows that do not add up
    are refused naming the counts."""
    steps = []
    for _ in range(3):
        tokens = _tokens(rng)
        labels = tokens.copy()
        labels[rng.random(labels.shape) < 0.3] = -100
        docs = np.cumsum(rng.random(tokens.shape) < 0.05, axis=1)
        steps.append((tokens, labels, docs))
    with _engine() as eng:
        whole = [eng.train_step(t, l, doc_ids=d) for t, l, d in steps]
        whole_state = eng.state_dict()
    cuts = [(0, 3, 8), (0, 1, 2, 8), (0, 8)]
    with _engine() as eng:
        with pytest.raises(ConfigError, match=r"hold 7 rows \(3 \+ 4\).*8"):
            eng.train_step([steps[0][0][:3], steps[0][0][3:7]])
        with pytest.raises(ConfigError, match=r"piece 1 has shape \(5, 10\)"):
            eng.train_step([steps[0][0][:3], steps[0][0][3:, :10]])
        pieces = []
        for (t, l, d), cut in zip(steps, cuts):
            split = [(a, b) for a, b in zip(cut, cut[1:])]
            pieces.append(eng.train_step((t[a:b] for a, b in split),
                                         [l[a:b] for a, b in split],
                                         doc_ids=tuple(d[a:b] for a, b in split)))
        _same_state(eng.state_dict(), whole_state)
    assert [(r.loss, r.grad_norm, r.loss_tokens) for r in pieces] == \
        [(r.loss, r.grad_norm, r.loss_tokens) for r in whole]


# -- row 8: StepResult.to_dict --------------------------------------------------------------------
def test_step_result_to_dict_is_plain_json_with_a_nested_breakdown(rng):
    """to_dict holds every field in JSON's types; with trace=True the breakdown is a nested
    dict, without it None; json round-trips it unchanged."""
    for trace in (False, True):
        with _engine(trace=trace) as eng:
            r = eng.train_step(_tokens(rng))
        d = r.to_dict()
        assert json.loads(json.dumps(d)) == d
        assert d["step"] == 1 and d["loss"] == r.loss and d["lr"] == 1e-3
        assert d["round_losses"] == list(r.round_losses)
        if trace:
            assert isinstance(d["breakdown"], dict) and d["breakdown"]["step"] == 1
            assert d["breakdown"]["wall_s"] == r.breakdown.wall_s
        else:
            assert d["breakdown"] is None

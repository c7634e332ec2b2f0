"""bench/setup_speed.py without a GPU: arguments are parsed and bad ones refused with the choices,
a fake probe's numbers reach the JSON record (device, commit, config, every measurement) and the
table, a variant that fails or would not fit in host memory is recorded rather than fatal; and
dataflow.warmup lists the attention shapes a plan's chunks produce and warms the host kernels."""

import json

import numpy as np
import pytest

from dataflow.bench import setup_speed as ss
from dataflow.warmup import AttentionShape, attention_shapes, warm_host_kernels
from dataflow.memplan import make_plan
from dataflow.memplan.plan.plan import Budget
from dataflow.memplan.plan.profiles import get_profile
from dataflow.models.hf_config import model_config


class _FakeProbe:
    """Canned numbers in the shapes CudaProbe returns; `fail` names a variant that raises."""

    def __init__(self, fail: str | None = None, avail: int | None = 1 << 40):
        self.fail, self.avail = fail, avail
        self.runs, self.pins = [], []

    def device(self):
        return {"name": "FAKE H100", "cupy": "14.2.0", "host_mem_available_bytes": self.avail}

    def pin(self, variant, nbytes, pieces):
        self.pins.append((variant, nbytes, pieces))
        if variant == self.fail:
            raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered")
        rec = {"variant": variant, "nbytes": nbytes, "pin_s": 2.0, "pin_gib_per_s": 20.0,
               "free_s": 0.5, "h2d_bytes_per_s": 5.5e10, "d2h_bytes_per_s": 5.4e10}
        if variant.startswith("register"):
            rec.update({"map_s": 0.0, "touch_s": 1.5, "register_s": 0.5, "pieces": pieces})
        if variant == "register-pieces":
            rec["h2d_across_pieces_bytes_per_s"] = 5.0e9
        return rec

    def engine_run(self, args, spec, env):
        self.runs.append((spec.label, dict(env)))
        return {"run": spec.label, "status": "ok", "setup_s": 9.0, "warmup_s": 1.0,
                "setup_phases_s": {"executor": 5.0, "zero_state": 1.0, "init_weights": 3.0},
                "pin": {"method": spec.pin, "seconds": 4.5},
                "steps": [{"wall_s": 2.5}, {"wall_s": 1.25}], "step1_minus_step2_s": 1.25,
                "time_to_first_step_s": 14.0}


def test_defaults_measure_40_gib_and_three_engine_runs_of_1b():
    """The defaults are the ~4-minute configuration the lead runs: 40 GiB, 1b at 8192, 40/16."""
    a = ss.parse_args(["--out", "x.json"])
    assert (a.gib, a.model, a.seqlen, a.host_gb, a.dev_gb, a.steps) == (40.0, "1b", 8192, 40.0,
                                                                         16.0, 2)
    assert a.variant_list == ("alloc", "register", "register-pieces")
    assert [r.label for r in a.run_list] == ["register:warm", "register:warm", "alloc:cold"]


@pytest.mark.parametrize("argv,words", [
    (["--runs", "hostalloc:warm"], "PIN:warm"),
    (["--runs", "register:hot"], "PIN:warm"),
    (["--variants", "alloc,mmap"], "known: alloc"),
    (["--gib", "-3"], "positive"),
    (["--steps", "1"], "at least 2"),
    (["--steps", "-1"], ">= 0"),
])
def test_bad_arguments_exit_2_naming_the_fix(capsys, argv, words):
    """Each mistake exits with argparse's status 2 and a message saying what would work."""
    with pytest.raises(SystemExit) as exc:
        ss.parse_args(["--out", "x.json", *argv])
    assert exc.value.code == 2
    assert words in capsys.readouterr().err


def test_record_holds_device_commit_config_and_every_measurement(tmp_path, capsys):
    """main with a fake probe writes one JSON record with everything and prints the table last."""
    out = tmp_path / "rec" / "s.json"
    probe = _FakeProbe()
    assert ss.main(["--out", str(out), "--gib", "2", "--pieces", "4"], probe=probe) == 0
    rec = json.loads(out.read_text())
    assert rec["device"]["name"] == "FAKE H100"
    assert "commit" in rec and rec["config"]["gib"] == 2.0 and rec["config"]["pieces"] == 4
    assert [p["variant"] for p in rec["pinning"]] == ["alloc", "register", "register-pieces"]
    assert all(p["status"] == "ok" for p in rec["pinning"])
    assert probe.pins[0] == ("alloc", 2 << 30, 4)
    assert [r["run"] for r in rec["engine_runs"]] == ["register:warm", "register:warm",
                                                      "alloc:cold"]
    # every engine run shares one fresh set of caches, so run 2 sees what run 1 compiled
    envs = [env for _, env in probe.runs]
    assert envs[0] == envs[1] == envs[2] and set(envs[0]) == {"CUPY_CACHE_DIR", "NUMBA_CACHE_DIR",
                                                                 "DATAFLOW_CUDNN_CACHE_DIR"}
    text = capsys.readouterr().out
    assert "register-pieces" in text and "alloc:cold" in text and "FAKE H100" in text
    assert text.rstrip().splitlines()[-1].startswith("record written to")


def test_a_failing_or_oversized_variant_is_recorded_and_the_rest_still_run(tmp_path):
    """One variant raising, or --gib above 90 % of available memory, is a status, not a crash."""
    out = tmp_path / "s.json"
    assert ss.main(["--out", str(out), "--runs", "", "--variants", "alloc,register"],
                   probe=_FakeProbe(fail="alloc")) == 0
    rec = json.loads(out.read_text())
    assert "cudaErrorHostMemoryAlreadyRegistered" in rec["pinning"][0]["status"]
    assert rec["pinning"][1]["status"] == "ok" and rec["engine_runs"] == []
    assert ss.main(["--out", str(out), "--runs", "", "--gib", "100"],
                   probe=_FakeProbe(avail=64 << 30)) == 0
    rec = json.loads(out.read_text())
    assert all(p["status"].startswith("skipped") and "--gib" in p["status"]
               for p in rec["pinning"])


def test_keep_caches_passes_no_cache_directories():
    """--keep-caches leaves CUPY_CACHE_DIR / NUMBA_CACHE_DIR to the user's environment."""
    probe = _FakeProbe()
    args = ss.parse_args(["--out", "x", "--keep-caches", "--variants", "", "--runs",
                          "register:cold"])
    rec = ss.collect(args, probe, log=lambda m: None)
    assert probe.runs == [("register:cold", {})] and "cache_dirs" not in rec


def test_attention_shapes_of_a_split_sequence_are_one_per_chunk_context():
    from dataflow.memplan.plan.buffers import attention_key_block

    """A sequence split into chunks gives one shape per chunk position, offsets 0, T, 2T, ..."""
    plan = make_plan(model_config("8b"), 65536, Budget.from_gib(96, 30), get_profile("h100"))
    ch = plan.chunking
    shapes = attention_shapes(plan)
    assert ch.chunks_per_seq > 1
    block = attention_key_block(plan.model, ch.chunk_tokens, ch.seqlen)
    assert shapes == tuple(AttentionShape(ch.chunk_tokens, i * ch.chunk_tokens, block)
                           for i in range(ch.chunks_per_seq))
    assert [s.self_only for s in shapes] == [True] + [False] * (ch.chunks_per_seq - 1)


def test_attention_shapes_of_packed_short_sequences_are_one_per_sequence():
    """Several whole sequences in one chunk attend to themselves only: one shape (seqlen, 0)."""
    plan = make_plan(model_config("1b"), 1024, Budget.from_gib(40, 16), get_profile("h100"))
    assert plan.chunking.seqs_per_chunk >= 1
    assert attention_shapes(plan) == (AttentionShape(1024, 0),)


def test_warm_host_kernels_calls_each_kernel_with_the_executors_dtypes(monkeypatch):
    """AdamW, embedding scatter and sum of squares, each with bf16 and fp32 gradients and the
    dtypes and layouts the executor passes (bf16 params, int32 ids, C-contiguous arrays): numba
    compiles per signature, so a different dtype would warm the wrong one. Fakes stand in for
    the kernels (compiling them takes tens of seconds; they have their own tests)."""
    from dataflow.kernels.host import adamw, embedding, norms

    seen = []
    monkeypatch.setattr(adamw, "adamw_step", lambda p, g, m, v, *hp: seen.append(
        ("adamw", p.dtype.name, g.dtype.name, m.dtype.name, v.dtype.name, len(hp))))
    monkeypatch.setattr(embedding, "embedding_bwd", lambda ids, dx, t: seen.append(
        ("embedding_bwd", ids.dtype.name, dx.dtype.name, dx.ndim, t.dtype.name, t.ndim)))
    monkeypatch.setattr(norms, "sumsq", lambda x: seen.append(("sumsq", x.dtype.name, x.ndim)))
    seconds = warm_host_kernels()
    assert len(seconds) == 6 and all(v >= 0 for v in seconds.values())
    assert sorted(seen) == sorted([
        ("adamw", "bfloat16", "bfloat16", "bfloat16", "bfloat16", 7),
        ("adamw", "bfloat16", "float32", "bfloat16", "bfloat16", 7),
        ("embedding_bwd", "int32", "bfloat16", 2, "bfloat16", 2),
        ("embedding_bwd", "int32", "bfloat16", 2, "float32", 2),
        ("sumsq", "bfloat16", 1), ("sumsq", "float32", 1)])


def test_warm_up_with_a_schedule_warms_only_the_host_kernels_it_runs(monkeypatch):
    """A schedule with host-stream AdamW and a HOME embedding's scatter and sum of squares warms
    exactly those, at the plan's gradient dtype; one with none warms none (each numba compile
    costs seconds of setup)."""
    import dataflow.warmup as W
    from dataflow.memplan.step.compile import HostTask, Update

    class _Sched:
        def __init__(self, events):
            self.events = events

    host = _Sched([Update("u", "layer0", 0, 8, None, None, None, None, stream="host"),
                   HostTask("s", "embed_scatter"), HostTask("g", "grad_sumsq"),
                   HostTask("t", "tokens_stage")])
    device = _Sched([Update("u", "layer0", 0, 8, None, None, None, None)])
    assert W.host_kernels_used(host) == {"adamw", "embedding_bwd", "sumsq"}
    assert W.host_kernels_used(device) == frozenset()
    calls = []
    monkeypatch.setattr(W, "warm_host_kernels", lambda k=W.HOST_KERNELS, g=None: calls.append(
        (sorted(k), None if g is None else [np.dtype(x).name for x in g])) or {})
    plan = make_plan(model_config("1b"), 8192, Budget.from_gib(40, 16), get_profile("h100"))
    W.warm_up(plan, object(), device)
    W.warm_up(plan, object(), host)
    gname = "float32" if plan.grad_accum.value == "fp32" else "bfloat16"
    assert calls == [([], [gname]), (["adamw", "embedding_bwd", "sumsq"], [gname])]


def test_the_plan_names_the_host_kernels_its_schedule_runs():
    """host_kernels_of_plan (known before the schedule is compiled, so the background compile can
    start first) gives what host_kernels_used reads off the compiled schedule, for every path
    plan and both ranks of a ring (the rank without the embedding runs no scatter)."""
    from dataflow.warmup import host_kernels_of_plan, host_kernels_used
    from dataflow.memplan.search.ring_plan import make_rank_plans
    from dataflow.memplan.step.ring_compile import compile_ring_schedule
    from dataflow.memplan.step.compile import compile_schedule
    from dataflow.models.config import load_config
    from tests.dataflow.plans import path_plans

    cfg = load_config("tiny")
    seen = set()
    for _, plan in path_plans(cfg):
        want = host_kernels_used(compile_schedule(plan))
        assert host_kernels_of_plan(plan) == want
        seen |= want
    assert seen == {"adamw", "embedding_bwd", "sumsq"}
    for rp in make_rank_plans(cfg, 64, Budget.from_gib(1, 0.25), get_profile("cpu"), 2):
        assert host_kernels_of_plan(rp.plan) == host_kernels_used(compile_ring_schedule(rp))


def test_the_background_compile_fills_numbas_cache_for_warm_up(tmp_path, monkeypatch):
    """start_host_compile compiles the plan's host kernels in another process into numba's cache
    (here a fresh NUMBA_CACHE_DIR); warm_up waits for it; a process that has the kernels loaded
    starts none."""
    import dataflow.warmup as W
    from dataflow.models.config import load_config
    from tests.dataflow.plans import path_plans

    plan = dict(path_plans(load_config("tiny")))["streamed_1_slot_host_opt"]  # AdamW only
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(W, "_WARM", set())
    proc = W.start_host_compile(plan)
    assert proc is not None
    W._join(proc)
    assert proc.returncode == 0
    assert list(tmp_path.rglob("*.nbi")), "nothing reached numba's cache"
    monkeypatch.setattr(W, "_WARM", {("adamw", "bfloat16")})
    assert W.start_host_compile(plan) is None


def test_prebuild_runs_the_backends_build_in_a_thread_and_survives_its_failure(monkeypatch,
                                                                              caplog):
    """start_prebuild hands the plan's attention shapes to the backend's prebuild in a thread
    and join() returns its seconds; a failing build is logged (warm_up builds instead), and
    there is none for a backend without prebuild or with DATAFLOW_PREBUILD=0. An engine on the
    NumPy backend reports no prebuild."""
    import threading

    from dataflow.engine import Engine
    from dataflow.warmup import start_prebuild

    cfg = model_config("1b")
    plan = make_plan(cfg, 32768, Budget.from_gib(40, 16), get_profile("h100"))

    class Fake:
        def __init__(self, fail=False):
            self.fail, self.calls = fail, []

        def prebuild(self, shapes, h, kh, e):
            self.calls.append((shapes, h, kh, e, threading.current_thread().name))
            if self.fail:
                raise RuntimeError("no cuDNN today")
            return {"cuda_modules": 0.5, "attention_graphs": 1.5}

    be = Fake()
    parts = start_prebuild(plan, be).join()
    assert parts["attention_graphs"] == 1.5 and parts["total"] >= 0
    shapes, h, kh, e, thread = be.calls[0]
    assert shapes == attention_shapes(plan) and (h, kh, e) == (32, 8, 64)
    assert thread == "dataflow-prebuild"
    parts = start_prebuild(plan, Fake(fail=True)).join()
    assert set(parts) == {"total"} and "no cuDNN today" in caplog.text
    assert start_prebuild(plan, object()) is None
    monkeypatch.setenv("DATAFLOW_PREBUILD", "0")
    assert start_prebuild(plan, Fake()) is None
    with Engine("tiny", host_gb=0.25, dev_gb=0.25, seqlen=64, backend="numpy") as eng:
        assert eng.prebuild_parts == {}

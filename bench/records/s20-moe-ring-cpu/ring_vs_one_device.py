import dataclasses, numpy as np
from dataflow.engine import Engine
from dataflow.ring.engine import Ring
from dataflow.ring.launch import RankEnv
from tests.ring.test_ring_moe import CFG, SEQLEN, CHUNKING  # run from the repo root: PYTHONPATH=. python bench/records/s20-moe-ring-cpu/ring_vs_one_device.py
from tests.ring.threads import in_threads
for seed in range(5):
    rng = np.random.default_rng(seed)
    cfg = dataclasses.replace(CFG, name="olmoe-tiny4", n_layers=4)
    common = dict(host_gb=1, dev_gb=0.5, seqlen=SEQLEN, backend="numpy", seed=seed, lr=1e-2, plan_options=dict(CHUNKING))
    with Engine(cfg, **common) as eng:
        rows = eng.seqs_per_step
        data = [rng.integers(0, cfg.vocab_size, (rows, SEQLEN + 1), dtype=np.int32) for _ in range(3)]
        want = [eng.train_step(b) for b in data]
    def rank(r, run_id):
        env = RankEnv(rank=r, world_size=2, local_rank=r, master_addr="127.0.0.1", master_port=0, run_id=run_id)
        with Engine(cfg, ring=Ring(env=env, replicas=1, timeout_s=30), **common) as e:
            return [e.train_step(b) for b in data]
    got = in_threads(rank, 2)[0]
    print(seed, [abs(g.loss - w.loss) / w.loss for g, w in zip(got, want)], [abs(g.aux_loss - w.aux_loss) / w.aux_loss for g, w in zip(got, want)])

"""The checkpoint round trip the family tests share: an engine trains a step, saves, trains the
rest, evaluates on its own and on the host (dataflow.host_forward); a second engine opened from
the checkpoint trains the same rest. Never asserts: the tests compare what it returns."""

from __future__ import annotations

from pathlib import Path


def train_save_resume(open_engine, batches, ck: Path):
    """open_engine(source) -> Engine (source None: the fresh one, else the checkpoint path).
    Returns (losses after the save, the engine's eval loss of batches[0], the host's, the
    resumed engine's losses, the resumed engine's ModelConfig)."""
    from dataflow.host_forward import eval_loss

    with open_engine(None) as eng:
        eng.train_step(batches[0])
        eng.save_checkpoint(ck)
        first = [eng.train_step(b).loss for b in batches[1:]]
        ours = eng.eval_step(batches[0])
        host = eval_loss(eng, batches[0])
    with open_engine(str(ck)) as eng:
        resumed = [eng.train_step(b).loss for b in batches[1:]]
        cfg = eng.plan.model
    return first, ours, host, resumed, cfg

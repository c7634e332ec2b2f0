"""One rank of a ring as a trainer: its RingExecutor, AdamW and the state of the blocks it owns,
initialised exactly as the single-device Engine initialises the same blocks (by global layer
index), so a ring and one device start from the same bits. Owns no placement decisions and
talks to other ranks only through its transport."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import ml_dtypes
import numpy as np

from dataflow.batch import Batch, make_batch
from dataflow.block_io import init_weights, read_part, write_part, zero_state
from dataflow.engine import BLOCK_PARTS, BlockRef
from dataflow.executor import StepStats
from dataflow.instrument import TracingBackend
from dataflow.optimizer import AdamW, AdamWConfig
from dataflow.memplan.plan.ranks import RankPlan, head_rows
from dataflow.models import init
from dataflow.models.hf import HFWeights
from dataflow.models.hf_config import is_hf_dir
from dataflow.models.storage import load_block_into
from dataflow.models.errors import ConfigError
from dataflow.models.layout import BlockKind, head_layout
from dataflow.ring.executor import RingExecutor
from dataflow.ring.transport import Transport
from dataflow.warmup import start_host_compile, warm_up


BF16 = np.dtype(ml_dtypes.bfloat16)


class RingRank:
    """rank `rp.rank` of a ring: `train_step(batch)` with the whole global batch (every rank
    gets the same tokens: the embedding's rank reads the ids, the head's rank the targets)."""

    def __init__(self, rp: RankPlan, be, transport: Transport, *, seed: int = 0,
                 optimizer: AdamWConfig | None = None, lr_schedule=None,
                 deferred_update: bool = True):
        """deferred_update: each step's AdamW of this rank's blocks runs inside the next step's
        first round (dataflow.executor.Executor); weights() runs a pending one first. As the
        Engine, it warms up before the first step (dataflow.warmup: CUDA modules, cuDNN graphs,
        numba host kernels), so step 1 builds nothing."""
        self.rp, self.be = rp, be
        self.last_breakdown = None
        """The last step's dataflow.instrument.StepBreakdown where `be` is a TracingBackend."""
        self._steps = 0
        background = start_host_compile(rp.plan)  # numba's compile, beside the setup
        try:
            self.ex = RingExecutor(rp, be, transport, deferred_update=deferred_update)
            self.optimizer = AdamW(optimizer or AdamWConfig(), lr_schedule)
            self._init_state(seed)
            be.synchronize()
        except BaseException:
            if background is not None:
                background.kill()
                background.wait()
            raise
        self.warm_up_parts = warm_up(rp.plan, be, self.ex.schedule, background)
        """warm_up's seconds per part (and, on a GPU, the cuDNN graphs built / read from disk)."""


    def _init_state(self, seed: int) -> None:
        """Zero grads, m and v; initialise each owned block's weights (the global model's)
        straight into where it lives, as the Engine does (dataflow.block_io.init_weights). A
        temporary per block, as this once made, held two blocks at a time beside the pinned
        slab, outside the plan's host bytes: 0.8 GiB of RSS on an 8b rank, 1.8 on a 32b rank,
        2.4 on 32b's embedding or head rank."""
        cfg = self.rp.plan.model  # same shapes as the global model; n_layers is the rank's
        self.be.synchronize()
        for ref in self.block_refs():  # global layer indices
            b = self._block(ref)
            zero_state(self.be, b)
            if ref.kind is BlockKind.EMBED:
                fill = functools.partial(init.init_embed_block, cfg, seed)
            elif ref.kind is BlockKind.HEAD and self.rp.vocab_parallel:
                fill = functools.partial(_init_head_shard, cfg, self.rp, seed)
            elif ref.kind is BlockKind.HEAD:
                fill = functools.partial(init.init_head_block, cfg, seed)
            else:  # the initialiser keys on the global layer index, not on n_layers
                g = ref.layer
                fill = functools.partial(init.init_layer_block, _with_layers(cfg, g + 1), g, seed)
            init_weights(self.ex, self.be, b, fill)

    # -- block access (what dataflow.checkpoint reads and writes, as on the Engine) -------------
    def block_refs(self) -> tuple[BlockRef, ...]:
        """The blocks this rank owns, in model order, by global layer index."""
        rp = self.rp
        refs = [BlockRef(BlockKind.EMBED)] if rp.has_embed else []
        refs += [BlockRef(BlockKind.LAYER, g) for g in rp.layers]
        return tuple(refs + ([BlockRef(BlockKind.HEAD)] if rp.holds_head_block else []))

    def _block(self, ref: BlockRef):
        ex, rp = self.ex, self.rp
        owned = (ref.kind is BlockKind.EMBED and rp.has_embed) or (
            ref.kind is BlockKind.HEAD and rp.holds_head_block) or (
            ref.kind is BlockKind.LAYER and ref.layer in rp.layers)
        if not owned:
            raise ConfigError(f"block {ref.name} is not on ring rank {rp.rank} (it owns "
                              f"{', '.join(r.name for r in self.block_refs())})")
        if ref.kind is BlockKind.LAYER:
            return ex.layers[rp.layers.index(ref.layer)]
        return ex.embed if ref.kind is BlockKind.EMBED else ex.head

    def layout(self, ref: BlockRef):
        return self._block(ref).layout

    def read_block(self, ref: BlockRef, part: str = "weights") -> np.ndarray:
        """A host copy of an owned block's weights, AdamW m or v, after the last step's update
        (a deferred one runs now; it moves no message, so no other rank takes part)."""
        _check_part(part)
        self._refuse_split_state(ref, part)
        self.ex.flush()
        return read_part(self.ex, self.be, self._block(ref), part)

    def _refuse_split_state(self, ref: BlockRef, part: str) -> None:
        """A split update's replica holds a layer's or the head's m / v for its part only."""
        rp = self.rp
        if part in ("m", "v") and rp.split_update and rp.replicas > 1 and \
                ref.kind is not BlockKind.EMBED:
            raise ConfigError(f"block part '{part}' of a split update's replica holds its 1/"
                              f"{rp.replicas} part only (--split-update); read or write "
                              "'weights', or train without the flag")

    def load_weights(self, path) -> None:
        """Each owned block's weights from the model directory `path` (a Hugging Face
        directory or a saved dataflow model), read one block at a time and only this rank's,
        so a fine-tune on a ring starts from the model's own weights as one device does."""
        path = Path(path)
        cfg = self.rp.plan.model
        whole_cfg = dataclasses.replace(cfg, head_vocab_rows=0)  # the directory's whole head

        def layout(ref):  # a vocabulary shard reads the whole head, then keeps its rows
            if ref.kind is BlockKind.HEAD and self.rp.vocab_parallel:
                return head_layout(whole_cfg)
            return self.layout(ref)

        if is_hf_dir(path):
            hf = HFWeights(path)

            def read(ref):
                return hf.block(ref.kind, ref.layer, layout(ref))
        else:
            def read(ref):
                out = np.empty(layout(ref).numel, BF16)
                return load_block_into(path, ref.kind, ref.layer, out)
        for ref in self.block_refs():
            block = read(ref)
            if ref.kind is BlockKind.HEAD and self.rp.vocab_parallel:
                block = _head_shard(cfg, self.rp, block)
            self.write_block(ref, block)

    def write_block(self, ref: BlockRef, array: np.ndarray, part: str = "weights") -> None:
        """Overwrite an owned block's weights, AdamW m or v (numel bf16 elements)."""
        _check_part(part)
        self._refuse_split_state(ref, part)
        self.ex.flush()  # else the pending update would land on top of the written bytes
        write_part(self.ex, self.be, self._block(ref), array, part)
        self.be.synchronize()

    def train_step(self, batch) -> StepStats:
        """The global batch, the same on every process: (replicas * seqs_per_step, seqlen + 1)
        int token ids, or a dataflow.batch.Batch of that many rows. Replica q trains rows
        [q * seqs_per_step, (q + 1) * seqs_per_step), scaling its gradients by the global batch's
        count of targets, so the replicas' summed gradients are the global batch's."""
        ch, rp = self.rp.plan.chunking, self.rp
        rows = ch.seqs_per_step * rp.replicas
        if not isinstance(batch, Batch):
            batch = np.asarray(batch)
            want = (rows, ch.seqlen + 1)
            if batch.shape != want:
                raise ConfigError(f"train_step got tokens of shape {batch.shape}; this ring takes "
                                  f"{want} (replicas x seqs_per_step, seqlen + 1)")
            batch = make_batch(batch, vocab_size=rp.plan.model.vocab_size, rows=rows,
                               seqlen=ch.seqlen)
        if batch.rows != rows:
            raise ConfigError(f"a ring step takes {rows} rows (replicas x seqs_per_step), the "
                              f"batch has {batch.rows}")
        tracer = self.be if isinstance(self.be, TracingBackend) else None
        self._steps += 1
        if tracer is not None:
            tracer.begin_step(self._steps)
        try:
            stats = self.ex.step(replica_slice(batch, self.ex.transport.replica,
                                               ch.seqs_per_step), self.optimizer)
        except BaseException:
            if tracer is not None:
                try:
                    tracer.end_step()  # close the window; the step's own error is reported
                except Exception:  # noqa: BLE001
                    pass
            raise
        if tracer is not None:
            self.last_breakdown = tracer.end_step().breakdown()
        return stats

    def evaluate(self, batch: Batch) -> StepStats:
        """Forward only over the global evaluation batch (the same on every process, its rows a
        multiple of replicas x seqs_per_round): each replica evaluates its equal share of the
        rows; the loss is over all of them. Collective; changes no weight or AdamW state."""
        q, per_round = self.rp.replicas, self.rp.plan.chunking.seqs_per_round
        if batch.rows % (q * per_round):
            raise ConfigError(f"a ring evaluation takes whole rounds on every replica: rows in "
                              f"multiples of {q * per_round}, got {batch.rows}")
        return self.ex.evaluate(replica_slice(batch, self.ex.transport.replica, batch.rows // q))

    def weights(self) -> dict[str, np.ndarray]:
        """Host copies of the owned blocks' weights, by global key ('embed', 'layer3', 'head'),
        after the last step's update (a deferred one runs now)."""
        return {_key(ref): self.read_block(ref) for ref in self.block_refs()}

    def close(self) -> None:
        self.be.synchronize()
        self.ex.transport.close()
        self.be.close()


def replica_slice(batch: Batch, replica: int, rows: int) -> Batch:
    """Replica `replica`'s `rows` rows of the global batch; `counted` stays the global batch's
    (the executor scales gradients by 1 / counted)."""
    sl = slice(replica * rows, (replica + 1) * rows)
    return dataclasses.replace(
        batch, ids=batch.ids[sl], targets=batch.targets[sl], positions=batch.positions[sl],
        doc_starts=None if batch.doc_starts is None else batch.doc_starts[sl])


def _key(ref: BlockRef) -> str:
    """The key weights() uses: 'embed', 'layer<global index>' or 'head'."""
    return f"layer{ref.layer}" if ref.kind is BlockKind.LAYER else ref.kind.value


def whole_head(cfg, n_ranks: int, head_owner: int, shards: dict[int, np.ndarray]) -> np.ndarray:
    """The head block of the whole model `cfg` from the head blocks of a vocabulary-parallel
    ring's ranks ({rank: block}): the head's rank's final norm and every rank's lm_head rows in
    rank order (a rank's own norm copy is never read or trained)."""
    whole_lay = head_layout(cfg)
    out = np.zeros(whole_lay.numel, BF16)
    for r in range(n_ranks):
        a, b = head_rows(cfg.vocab_size, n_ranks, r)
        lay = head_layout(dataclasses.replace(cfg, head_vocab_rows=b - a))
        whole_lay.view(out, "lm_head")[a:b] = lay.view(shards[r], "lm_head")
        if r == head_owner:
            whole_lay.view(out, "norm")[...] = lay.view(shards[r], "norm")
    return out


def _check_part(part: str) -> None:
    if part not in BLOCK_PARTS:
        raise ConfigError(f"block part '{part}' is not one of {', '.join(BLOCK_PARTS)}")


def _init_head_shard(cfg, rp: RankPlan, seed: int, out=None) -> np.ndarray:
    """A vocabulary-parallel rank's head block: the whole model's initial head (the same bits
    one device starts from), of which it keeps the final norm and its own lm_head rows. The
    whole head passes through a host temporary (V x D bf16: 1 GiB at 8b) once, at setup."""
    whole = init.init_head_block(dataclasses.replace(cfg, head_vocab_rows=0), seed)
    return _head_shard(cfg, rp, whole, out)


def _head_shard(cfg, rp: RankPlan, whole: np.ndarray, out=None) -> np.ndarray:
    """Rank rp.rank's head block (the final norm, its lm_head rows) of the whole head block."""
    whole_cfg = dataclasses.replace(cfg, head_vocab_rows=0)
    a, b = head_rows(cfg.vocab_size, rp.n_ranks, rp.rank)
    lay, whole_lay = head_layout(cfg), head_layout(whole_cfg)
    if out is None:
        out = np.empty(lay.numel, BF16)
    out[...] = 0  # alignment padding
    lay.view(out, "norm")[...] = whole_lay.view(whole, "norm")
    lay.view(out, "lm_head")[...] = whole_lay.view(whole, "lm_head")[a:b]
    return out


def _with_layers(cfg, n_layers: int):
    return dataclasses.replace(cfg, n_layers=n_layers)

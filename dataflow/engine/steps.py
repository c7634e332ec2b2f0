"""The Engine's training step: a trainer's batch checked and handed to the executor (one optimizer
step, or a forward-only evaluation), its StepResult (loss, throughput, MFU / HFU, bytes moved),
the refusal of a step after a failed one, and the settling of a deferred AdamW before the model
is read. Never decides placement and never runs a kernel itself: the executor does."""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from dataflow.batch import make_batch
from dataflow.engine_options import join_pieces
from dataflow.instrument import StepBreakdown, TracingBackend
from dataflow.memplan.plan.lora import adapter_model_flops_per_seq
from dataflow.models.errors import ConfigError, NonFiniteError, StepFailedError
from dataflow.models.flops import flop_model_version, model_flops_per_seq


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    step: int
    loss: float
    """Mean cross-entropy over the step's counted targets (labels other than -100), as
    transformers computes it."""
    round_losses: tuple[float, ...]
    tokens: int
    """Tokens processed (seqs_per_step * seqlen): the numerator of tok/s."""
    step_time_s: float
    tok_per_s: float
    model_tflop_per_s: float
    mfu: float
    hfu: float
    flop_model_version: str
    h2d_bytes: int
    d2h_bytes: int
    lr: float
    grad_norm: float | None
    """Global L2 norm of the step's gradients before clipping (every training step)."""
    breakdown: StepBreakdown | None = None
    """Where the step's time and bytes went; None unless the engine traces (trace=True)."""
    loss_tokens: int | None = None
    """Targets counted in the loss (not -100); the loss is their mean."""
    aux_loss: float | None = None
    """MoE models (ModelConfig.moe): the router's load-balancing loss, unscaled by
    router_aux_loss_coef: each round is one forward (transformers' micro-batch) with its own,
    and this is their mean over the step's rounds; the objective trained is loss +
    router_aux_loss_coef * aux_loss (+ router_z_loss_coef * z_loss). None when dense."""
    z_loss: float | None = None
    """MoE models: the router z-loss (mean logsumexp^2 over a round's rows), the mean over the
    step's rounds, unscaled; None when dense."""

    def to_dict(self) -> dict:
        """The result as plain JSON types (str, int, float, None, lists, dicts): every field by
        name, breakdown as a nested dict (or None), for json.dumps, a TensorBoard or W&B log."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FailedStep:
    """A step that raised or was interrupted, which blocks further steps until a state is
    reloaded."""

    step: int
    reason: str
    """One line: the exception's type and text, 'interrupted', or the non-finite value."""
    state_whole: bool
    """The weights, AdamW m and v and the step count are provably those before the step: it
    began with no deferred update pending and stopped before the optimizer counted it, so no
    AdamW event of any step ran (its rounds touch gradients only). Saving is then safe."""


CONFIGURED = object()
"""train_step's max_grad_norm default: the clipping the engine was built with."""


class StepRunner:
    """Runs an engine's steps and evaluations on its executor and keeps what a step leaves
    behind: the failed step that blocks further ones (`failed_step`, a FailedStep or None)
    and the last step's trace (`last_trace`, when the backend traces)."""

    def __init__(self, plan, be, ex, optimizer, round_extra_flops: float):
        self.plan, self.be, self.ex, self.optimizer = plan, be, ex, optimizer
        self.round_extra_flops = round_extra_flops
        self.failed_step: FailedStep | None = None
        self.last_trace = None

    def check_usable(self) -> None:
        """Refuse to go on after a failed step (its state may be half-updated)."""
        if self.failed_step is not None:
            step, reason = self.failed_step.step, self.failed_step.reason
            raise StepFailedError(
                f"step {step} failed ({reason}), so gradients and AdamW state may be half-"
                "updated; reload a saved state with load_checkpoint(path) or "
                "load_state_dict(state) (or weights only with weights_only=True), or create a "
                "new Engine", step=step, reason=reason)

    def check_savable(self, call: str, allow_failed_step: bool) -> dict | None:
        """Refuse (StepFailedError) to save the state after a failed step unless it is provably
        whole (FailedStep.state_whole) or allow_failed_step; returns what a forced save records
        ({"step", "reason"}), None when nothing failed or the state is whole."""
        failed = self.failed_step
        if failed is None or failed.state_whole:
            return None
        if not allow_failed_step:
            raise StepFailedError(
                f"step {failed.step} failed ({failed.reason}) after an AdamW update had begun "
                "or the step was counted, so the weights, AdamW state or step count may be "
                f"half-updated and {call} refuses to save them; reload a saved state "
                "(load_state_dict, or a new Engine from a checkpoint), or pass "
                "allow_failed_step=True to save anyway (a checkpoint is then marked as saved "
                "after a failed step)",
                step=failed.step, reason=failed.reason)
        return {"step": failed.step, "reason": failed.reason}

    def settle(self) -> None:
        """Apply a deferred AdamW still pending, so reads, writes and evaluations see the model
        after the last step (a failed step's update is dropped instead: see train)."""
        if self.ex.update_pending:
            if self.failed_step is not None:
                self.ex.drop_pending()
            else:
                self.ex.flush()

    def train(self, tokens, labels, doc_ids, position_ids, lr: float | None,
              max_grad_norm) -> StepResult:
        """Engine.train_step (which documents it), under the engine's lock."""
        self.check_usable()
        ch, cfg = self.plan.chunking, self.plan.model
        rows, seqlen = ch.seqs_per_step, ch.seqlen
        tokens, labels, doc_ids, position_ids = (
            join_pieces(value, name, rows, seqlen) for name, value in
            (("tokens", tokens), ("labels", labels), ("doc_ids", doc_ids),
             ("position_ids", position_ids)))
        batch = make_batch(tokens, labels, doc_ids=doc_ids, position_ids=position_ids,
                           vocab_size=cfg.vocab_size, rows=rows, seqlen=seqlen)
        if batch.counted == 0:
            raise ConfigError("every label of the batch is -100, so the step has no target to "
                              "learn from; keep at least one label, or skip the batch")
        opt = self.optimizer
        step = opt.step_count + 1
        if lr is None:
            lr = opt.schedule(step) if opt.schedule else opt.config.lr
        clip = opt.config.max_grad_norm if max_grad_norm is CONFIGURED else max_grad_norm
        # Validates lr and clip (AdamWConfig's checks) before anything runs.
        call_config = dataclasses.replace(opt.config, lr=lr, max_grad_norm=clip)
        stats = self._run_step(batch, step, call_config)
        result = self.result(stats, lr, batch.counted)
        for what, value in (("loss", result.loss), ("grad norm", result.grad_norm)):
            if value is not None and not np.isfinite(value):
                # The step was counted (and without a deferred update, applied): not whole.
                self.failed_step = FailedStep(step=step, reason=f"{what} {value}",
                                              state_whole=False)
                self.ex.drop_pending()  # deferred: the blown-up update never lands
                raise NonFiniteError(
                    f"{what} became {_nonfinite_name(value)} at step {step} (lr {lr:g}); lower "
                    "the learning rate or clip gradients (max_grad_norm), then reload a state "
                    "saved before the blow-up (load_state_dict)",
                    step=step, lr=lr, what=what, value=float(value), result=result)
        return result

    def _run_step(self, batch, step: int, call_config):
        """The executor's step under this call's AdamW settings (the engine's restored after),
        traced when the backend traces; a step that stops part way is recorded as failed."""
        opt = self.optimizer
        tracer = self.be if isinstance(self.be, TracingBackend) else None
        if tracer is not None:
            tracer.begin_step(step)
        saved = opt.config, opt.schedule
        # What makes a failure harmless to the saved state: no earlier update left to run in
        # this step's first round, and the optimizer never counted this step (begin_step
        # comes before any AdamW event of the step, in every schedule the executor runs).
        pending_before, count_before = self.ex.update_pending, opt.step_count
        opt.config, opt.schedule, opt.last_grad_norm = call_config, None, None
        try:
            stats = self.ex.step(batch, opt)
            opt.last_grad_norm = stats.grad_norm
        except BaseException as exc:  # KeyboardInterrupt too: the step stopped part way
            self.failed_step = FailedStep(
                step=step, reason="interrupted" if isinstance(exc, KeyboardInterrupt)
                else f"{type(exc).__name__}: {exc}",
                state_whole=not pending_before and opt.step_count == count_before)
            self.ex.drop_pending()
            self.last_trace = None
            if tracer is not None:
                try:
                    tracer.end_step()  # close the window so a reloaded engine can trace again
                except Exception:  # noqa: BLE001 - the step's own error is the one to report
                    pass
            raise
        finally:
            opt.config, opt.schedule = saved
        self.last_trace = tracer.end_step() if tracer is not None else None
        return stats

    def evaluate(self, tokens, labels, doc_ids, position_ids) -> float:
        """Engine.eval_step (which documents it), under the engine's lock."""
        self.check_usable()
        ch, cfg = self.plan.chunking, self.plan.model
        batch = make_batch(tokens, labels, doc_ids=doc_ids, position_ids=position_ids,
                           vocab_size=cfg.vocab_size, seqlen=ch.seqlen,
                           pad_rows_to=ch.seqs_per_round)
        if batch.counted == 0:
            raise ConfigError("every label of the evaluation batch is -100; keep at least one")
        self.settle()
        return self.ex.evaluate(batch).loss

    def result(self, stats, lr: float, loss_tokens: int) -> StepResult:
        """The StepResult of the executor's `stats` at `lr`."""
        plan, cfg, ch = self.plan, self.plan.model, self.plan.chunking
        fz = plan.frozen  # frozen blocks run no weight-gradient GEMM: not counted
        model_flops = (model_flops_per_seq(cfg, ch.seqlen, frozen_layers=len(fz.layers),
                                           frozen_head=fz.head)
                       + adapter_model_flops_per_seq(cfg, plan.lora, ch.seqlen)) \
            * ch.seqs_per_step  # LoRA's adapters run: counted (docs/flops.md)
        hw_flops = model_flops + self.round_extra_flops * ch.rounds_per_step
        t = max(stats.step_time_s, 1e-12)
        peak = plan.profile.peak_bf16_flop_per_s
        return StepResult(
            step=self.optimizer.step_count, loss=stats.loss,
            round_losses=tuple(r.loss_sum / max(r.tokens, 1) for r in stats.rounds),
            tokens=stats.tokens, step_time_s=stats.step_time_s, tok_per_s=stats.tokens / t,
            model_tflop_per_s=model_flops / t / 1e12, mfu=model_flops / t / peak,
            hfu=hw_flops / t / peak, flop_model_version=flop_model_version(cfg, plan.lora is not None),
            h2d_bytes=stats.h2d_bytes, d2h_bytes=stats.d2h_bytes, lr=lr,
            grad_norm=self.optimizer.last_grad_norm,
            breakdown=self.last_trace.breakdown() if self.last_trace is not None else None,
            loss_tokens=loss_tokens, aux_loss=stats.aux_loss, z_loss=stats.z_loss)


def _plain(value):
    """`value` in JSON's types: dataclasses as dicts, enums by value, NumPy scalars as Python."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, dict):
        return {str(k.value if isinstance(k, enum.Enum) else k): _plain(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _nonfinite_name(value: float) -> str:
    return "NaN" if np.isnan(value) else ("+inf" if value > 0 else "-inf")

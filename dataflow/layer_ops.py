"""One transformer layer on one chunk, forward and backward, as a sequence of op-table launches on
the compute stream. Reads weights and saved activations from views the executor hands in, writes
the next residual (forward) or the input gradient (backward), and recomputes whatever the saved
level left out. Never decides placement and never issues copies between host and device.

Families (ModelConfig.attention_bias, qk_norm): a biased projection fills its output with the
bias and accumulates x @ w.T onto it (one rounding); QK-norm projects q and k into the
workspace's 'qpre'/'kpre' and normalises each head from there into q and k (an RMSNorm over
rows of E; OLMoE's qk_norm_whole over each token's whole projection). The saved levels keep no
QK-norm input: the backward re-forms it (the K projection always, the Q projection at FULL too:
dataflow.models.flops.level_recompute_flops counts it).

Mixture-of-experts layers (ModelConfig.moe) run dataflow.moe_ffn's FFN in place of the dense
SwiGLU; the attention half is the same. Only the forward proper adds a chunk's routing to its
round's totals (`routing`); recomputes re-form the same routing without counting it."""

from __future__ import annotations

import dataclasses
import types

from dataflow.backend import Backend, Stream
from dataflow.moe_ffn import MoeFfn, RoundRouting
from dataflow.rope import rope_table
from dataflow.memplan.plan.buffers import lora_saved_name
from dataflow.memplan.plan.lora import HF_NAMES
from dataflow.models.config import ModelConfig
from dataflow.models.flops import SavedLevel


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkInfo:
    index: int
    rows: slice
    """This chunk's rows in the round's token arrays and residual buffers."""
    segments: tuple[tuple[int, int, int], ...]
    """(start, end, key_start) per attention call: rows [start, end) of the chunk are one
    document (or a packed sequence), whose keys are rows [key_start, context + end) of its
    sequence — the context buffer when split, else this chunk's own K/V (key_start == start).
    Fixed by the plan without documents; per round when the trainer packs documents."""
    split: bool
    """The chunk is part of a sequence spanning several chunks (attention uses the context)."""
    context: int
    """Tokens of its sequence before this chunk (the attention offset)."""
    first_of_seq: bool
    last_of_seq: bool


def lse_rows(lse, a: int, b: int):
    """The log-sum-exp of rows [a, b) of a chunk as a contiguous (H, b - a) view: segment s of an
    (H, T) buffer is stored at flat offset a*H, so every attention call gets dense stats (cuDNN
    needs them dense; producer and consumer use this same view)."""
    h = lse.shape[0]
    return lse.reshape(-1)[a * h:b * h].reshape(h, b - a)


LORA_TARGET_OF = types.MappingProxyType({v: k for k, v in HF_NAMES.items()})
"""Layer-block tensor name -> LoRA target ('self_attn.q_proj' -> 'q')."""

WEIGHT_GRAD_OPS = types.MappingProxyType({"linear_bwd_w": 2, "bias_bwd": 1})
"""Ops that form only a weight gradient, by the position of that gradient among their
arguments: skipped when it is None (a frozen layer). rms_norm_bwd takes a None weight
gradient itself (it forms dx too)."""


class FrozenGrads(dict):
    """The gradient views of a frozen layer: None for every tensor, so no weight gradient is
    formed (WEIGHT_GRAD_OPS are skipped, rms_norm_bwd forms dx alone)."""

    def __missing__(self, key):
        return None


class LayerCompute:
    def __init__(self, be: Backend, cfg: ModelConfig, ws: dict, ctx: dict, base=None):
        self.be, self.cfg, self.ws, self.ctx = be, cfg, ws, ctx
        self.moe = MoeFfn(cfg, ws) if cfg.moe is not None else None
        self.adapters = None
        self.formed: dict = {}
        """LoRA target -> its (T, r) product s (x a^T) formed since this visit began (the
        forward's, or the backward's recompute): _lin_bwd_w reads it for db instead of
        re-forming it (the same op on the same x, so the same bits)."""
        self.keep: dict = {}
        """The forward's saved activation when it keeps the adapters' products (FULL with
        LoRA: dataflow.memplan.plan.buffers.lora_saved_name), else empty."""
        self.base = base
        """An fp8 base's decoder (dataflow.fp8_base.BaseDequant): each base GEMM then reads its
        weight decoded into lora.base_dequant; None reads w[name] itself."""

    def adapt(self, adapters) -> None:
        """The LoRA adapters (dataflow.lora_adapters.LayerAdapters) of the layer the next call
        runs, or None: the executor sets them per event, as it hands in the weights."""
        self.adapters = adapters

    def _lin(self, name: str, x, w, out, accumulate: bool = False) -> None:
        """out (=|+=) x @ w[name].T, plus its LoRA adapter's s (x a^T) b^T when adapted.

        The adapter's rank-r product goes into `out` first and the base GEMM adds onto it: the
        rank-r GEMM is memory-bound (a read of `out` would cost as much as its write), while
        the base GEMM is compute-bound and reads `out` in its epilogue for nothing measurable."""
        ad = self._adapter(name)
        if ad is None:
            self._op("linear_fwd", x, self._w(w, name), out, accumulate)
            return
        target, t = LORA_TARGET_OF[name], x.shape[0]
        u = self.keep.get(lora_saved_name(target))
        if u is None or u.shape[0] != t:
            u = self.adapters.xa[target][:t]
        # s folded into the GEMM's alpha: u = s (x a^T), rounded once, in the target's own
        # buffer (or a FULL activation's, `keep`), where the backward's db finds it (formed)
        self._op("linear_fwd", x, ad.a, u, False, self.adapters.scale, tag=".lora_a")
        self.formed[target] = u
        self._op("linear_fwd", u, ad.b, out.reshape(t, -1), accumulate, tag=".lora_b")
        self._op("linear_fwd", x, self._w(w, name), out, True)

    def _w(self, w, name: str):
        """The base weight `name` as its GEMM reads it (an fp8 base's decoded just now)."""
        return w[name] if self.base is None else self.base.weight(w[name], f"{self.tag}.{name}")

    def _adapter(self, name: str):
        if self.adapters is None:
            return None
        return self.adapters.by_target.get(LORA_TARGET_OF[name])

    def _lin_bwd_x(self, name: str, dy, w, dx, accumulate: bool = False) -> None:
        """dx (=|+=) dy @ w[name], plus the adapter's s (dy b) a (first, as in _lin); leaves
        s (dy b) in u for _lin_bwd_w."""
        ad = self._adapter(name)
        if ad is None:
            self._op("linear_bwd_x", dy, self._w(w, name), dx, accumulate)
            return
        u = self.adapters.u[:dy.shape[0]]
        self._op("linear_bwd_x", dy, ad.b, u, False, self.adapters.scale, tag=".lora_u")
        self._op("linear_bwd_x", u, ad.a, dx, accumulate, tag=".lora_dx")
        self._op("linear_bwd_x", dy, self._w(w, name), dx, True)

    def _lin_bwd_w(self, name: str, dy, x, g) -> None:
        """The base weight's gradient (none when frozen) and the adapter's: da += u^T x with
        the u _lin_bwd_x left, db += dy^T s (x a^T), the product this visit's recompute formed
        from the same x (`formed`), else re-formed here (lora_xa)."""
        self._op("linear_bwd_w", dy, x, g[name], True)
        ad = self._adapter(name)
        if ad is not None:
            t, target = dy.shape[0], LORA_TARGET_OF[name]
            self._op("linear_bwd_w", self.adapters.u[:t], x, ad.da, True, tag=".lora_da")
            xa = self.formed.get(target)
            if xa is None:
                xa = self.adapters.xa[target][:t]
                self._op("linear_fwd", x, ad.a, xa, False, self.adapters.scale,
                         tag=".lora_xa")
            self._op("linear_bwd_w", dy, xa, ad.db, True, tag=".lora_db")

    def _op(self, op: str, *args, tag: str = "") -> None:
        if op in WEIGHT_GRAD_OPS and args[WEIGHT_GRAD_OPS[op]] is None:
            return  # a frozen layer's weight gradient: not formed
        self.be.launch(Stream.COMPUTE, op, *args, name=f"{self.tag}.{op}{tag}")

    def _kv(self, chunk: ChunkInfo, t: int, own):
        """This chunk's K and V: its rows of the sequence context for a split chunk, else `own`
        (the (k, v) views the caller forms or reads them in)."""
        if chunk.split:
            a, b = chunk.context, chunk.context + t
            return self.ctx["k_ctx"][a:b], self.ctx["v_ctx"][a:b]
        return own

    def _attn_inputs(self, chunk: ChunkInfo, k, v):
        """(start, end, keys, values, q_offset) of each attention call: one per segment, its
        queries at rows [start, end) attending to its document's keys only."""
        if chunk.split:
            kc, vc, at = self.ctx["k_ctx"], self.ctx["v_ctx"], chunk.context
            return [(a, b, kc[ks:at + b], vc[ks:at + b], at + a - ks)
                    for a, b, ks in chunk.segments]
        return [(a, b, k[a:b], v[a:b], 0) for a, b, _ in chunk.segments]

    # -- forward --------------------------------------------------------------------------------
    def forward(self, tag: str, w: dict, x, out, pos, chunk: ChunkInfo, save: dict,
                level: SavedLevel, input_saved: bool = False, attn_out=None,
                routing: RoundRouting | None = None) -> None:
        """x (T, D) -> out (T, D); fills `save` (views of a saved-activation region) at `level`,
        or keeps nothing when `save` is None (evaluation). `input_saved`: x already is
        save["x"] (a segment recompute, whose output may overwrite the rows x came from).
        `routing`: an MoE layer adds this chunk's routing to the round's totals (the forward
        proper passes it; a recompute must not).
        `attn_out`: this chunk's attention output as the forward formed it (a segment
        boundary's saved "o", with `save` None): Q and the attention are skipped (K/V too
        unless the chunk is one of a split sequence, whose later chunks attend to them); the
        rest is the same kernels on the same values, so the same bits."""
        self.tag, self.formed, self.keep = tag, {}, save if save is not None else {}
        cfg, op = self.cfg, self._op
        t, h, e = x.shape[0], cfg.n_heads, cfg.head_dim
        if attn_out is not None:
            if save is not None:
                raise ValueError("a forward from a saved attention output keeps nothing")
            hres = self.ws["h"][:t]
            if chunk.split:  # later chunks of the sequence may attend to this one's K/V
                k, v = self._kv(chunk, t, None)
                xn = self.ws["xn"][:t]
                op("rms_norm_fwd", x, w["input_layernorm"], cfg.norm_eps, xn,
                   self.ws["rstd"][:t], hres)
                self._proj(w, xn, "k", k)
                self._proj(w, xn, "v", v)
                op("rope_fwd", k, pos, rope_table(cfg), k)
            else:
                op("cast", x, hres)
            self._lin("self_attn.o_proj", attn_out.reshape(t, h * e), w, hres, True)
            self._ffn_out(w, hres, out, None, routing)
            return
        # Tensors the level keeps are formed in the saved region itself, not copied there after:
        # the copies were 9 to 13 device copies per (layer, chunk), 4.5 % of a 1b step.
        ws = self._forming(save, t)
        q, o, lse = ws["q"], ws["o"], ws["lse"]
        k, v = self._kv(chunk, t, (ws["k"], ws["v"]))
        hres = ws["h"]
        # The residual stream's copies (x into h, h into out, which the projections then add
        # into) come out of the RMSNorm kernels that read those rows anyway.
        self._qkv(w, x, self.ws["xn"][:t], ws["rstd"], q, k, v, pos, copy=hres)
        for a, b, kk, vv, off in self._attn_inputs(chunk, k, v):
            op("attention_fwd", q[a:b], kk, vv, off, o[a:b], lse_rows(lse, a, b))
        self._lin("self_attn.o_proj", o.reshape(t, h * e), w, hres, True)
        self._ffn_out(w, hres, out, save, routing, ws)
        if save is None:
            return
        if not input_saved:
            op("cast", x, save["x"])
        for name, view in dict(ws, k=k, v=v).items():  # a split chunk's K/V: context rows
            if name in save and view is not save[name]:
                op("cast", view, save[name])

    _FORMED = ("q", "k", "v", "o", "h", "gate", "up", "rstd", "rstd2")

    def _forming(self, save: dict | None, t: int) -> dict:
        """Where the forward forms each tensor it may keep: the saved region's view when the
        level keeps it at this shape, else the chunk workspace (the backward and evaluation)."""
        out = {n: self.ws[n][:t] for n in self._FORMED if n in self.ws}  # MoE: no dense gate/up
        out["lse"] = self.ws["lse"]
        for n in out:
            if save is not None and n in save and save[n].shape == out[n].shape:
                out[n] = save[n]
        return out

    def rebuild_kv(self, tag: str, w: dict, x, k, v, pos) -> None:
        """A split chunk's K/V re-formed from its saved input x into its context rows k, v
        (Plan.kv_rebuild): the forward's RMSNorm, K and V projections and RoPE, the same
        kernels on the same shapes into the same rows, so the same bits."""
        self.tag, self.formed, self.keep = tag, {}, {}
        cfg, op = self.cfg, self._op
        t = x.shape[0]
        xn = self.ws["xn"][:t]
        op("rms_norm_fwd", x, w["input_layernorm"], cfg.norm_eps, xn, self.ws["rstd"][:t])
        self._proj(w, xn, "k", k)
        self._proj(w, xn, "v", v)
        op("rope_fwd", k, pos, rope_table(cfg), k)

    def _qkv(self, w, x, xn, rstd, q, k, v, pos, copy=None) -> None:
        """Input norm (and x into `copy`), Q/K/V projections, RoPE on Q and K."""
        cfg, op = self.cfg, self._op
        op("rms_norm_fwd", x, w["input_layernorm"], cfg.norm_eps, xn, rstd, copy)
        self._proj(w, xn, "q", q)
        self._proj(w, xn, "k", k)
        self._proj(w, xn, "v", v)
        op("rope_fwd", q, pos, rope_table(cfg), q)
        op("rope_fwd", k, pos, rope_table(cfg), k)

    def _proj(self, w, xn, name: str, out) -> None:
        """xn (T, D) -> out (T, heads, E): projection `name` ('q', 'k' or 'v'), its bias
        (attention_bias: out starts as the bias, the GEMM accumulates onto it), and for q and k
        with qk_norm the per-head RMSNorm (OLMoE's: over the whole projection, _qk_rows): the
        projection goes to the workspace's '{name}pre' and its rows are normalised from there
        into out, their rstd in '{name}rstd' (what _proj_bwd reads)."""
        cfg, op = self.cfg, self._op
        t = xn.shape[0]
        normed = cfg.qk_norm and name != "v"
        dst = self.ws[f"{name}pre"][:t] if normed else out
        if cfg.attention_bias:
            op("bias_fill", w[f"self_attn.{name}_proj.bias"], dst.reshape(t, -1))
        self._lin(f"self_attn.{name}_proj", xn, w, dst.reshape(t, -1), cfg.attention_bias)
        if normed:
            e, rstd = self._qk_rows(name, t)
            op("rms_norm_fwd", dst.reshape(-1, e), w[f"self_attn.{name}_norm"], cfg.norm_eps,
               out.reshape(-1, e), rstd)

    def _qk_rows(self, name: str, t: int):
        """(width, rstd view) of QK-norm's rows for projection `name` of t tokens: rows of E
        per head (Qwen3's), or one row per token over the whole projection (OLMoE's,
        qk_norm_whole), whose T rstd values take the first T of the (T, heads) buffer."""
        width = self.cfg.qk_norm_dims[0 if name == "q" else 1]
        rstd = self.ws[f"{name}rstd"][:t].reshape(-1)
        heads = self.cfg.n_heads if name == "q" else self.cfg.n_kv_heads
        return width, rstd[:t * heads * self.cfg.head_dim // width]

    def _proj_bwd(self, w, g, name: str, dy) -> None:
        """dy (T, heads, E), the gradient of projection `name`'s output after QK-norm (RoPE's
        backward already taken), in place -> the gradient of the projection itself: through
        the per-head RMSNorm (its weight's gradient accumulates into g; reads the '{name}pre'
        and '{name}rstd' that _proj formed for this chunk), then the bias's gradient."""
        cfg, op = self.cfg, self._op
        t = dy.shape[0]
        if cfg.qk_norm and name != "v":
            e, rstd = self._qk_rows(name, t)
            rows = dy.reshape(-1, e)
            op("rms_norm_bwd", self.ws[f"{name}pre"][:t].reshape(-1, e),
               w[f"self_attn.{name}_norm"], rstd, rows, rows, g[f"self_attn.{name}_norm"])
        if cfg.attention_bias:
            op("bias_bwd", dy.reshape(t, -1), g[f"self_attn.{name}_proj.bias"])

    def _ffn_out(self, w, hres, out, save: dict | None, routing, ws: dict | None = None) -> None:
        """The FFN of the residual hres, added onto out (the FFN norm first copies hres into
        out): the dense SwiGLU's down projection accumulates onto it, an MoE layer's combine
        adds its weighted experts' rows (forming what `save` keeps in it)."""
        t = hres.shape[0]
        if self.moe is None:
            self._ffn_fwd(w, hres, tag="", ws=ws, copy=out)
            self._lin("mlp.down_proj", self.ws["act"][:t], w, out, True)
            return
        xn2 = self._ffn_norm(w, hres, (ws or {}).get("rstd2", self.ws["rstd2"][:t]), out)
        self.moe.forward(self._op, w, xn2, self.moe.tensors(save, t), out, routing)

    def _ffn_norm(self, w, hres, rstd2, copy=None):
        """The FFN's RMSNorm of hres into the workspace's xn2 (returned), its rstd into rstd2,
        hres into `copy`."""
        t = hres.shape[0]
        xn2 = self.ws["xn2"][:t]
        self._op("rms_norm_fwd", hres, w["post_attention_layernorm"], self.cfg.norm_eps, xn2,
                 rstd2, copy)
        return xn2

    def _ffn_fwd(self, w, hres, tag: str, ws: dict | None = None, act: bool = True,
                 copy=None) -> None:
        """The FFN's norm (and hres into `copy`), gate and up projections and (`act`) SwiGLU
        into act; rstd2, gate and up go to `ws` (the forward's forming views) or the chunk
        workspace."""
        cfg, op = self.cfg, self._op
        t, xn2 = hres.shape[0], self.ws["xn2"]
        ws = ws or {n: self.ws[n][:t] for n in ("rstd2", "gate", "up")}
        op("rms_norm_fwd", hres, w["post_attention_layernorm"], cfg.norm_eps, xn2[:t],
           ws["rstd2"], copy)
        self._lin("mlp.gate_proj", xn2[:t], w, ws["gate"])
        self._lin("mlp.up_proj", xn2[:t], w, ws["up"])
        if act:
            op("swiglu_fwd", ws["gate"], ws["up"], self.ws["act"][:t])

    # -- backward -------------------------------------------------------------------------------
    def backward(self, tag: str, w: dict, g: dict, save: dict, level: SavedLevel, dy, dx, pos,
                 chunk: ChunkInfo, routing: RoundRouting | None = None) -> None:
        """dy (T, D) gradient of the layer output -> dx (T, D); weight grads accumulate into g,
        or none are formed when g is None (a frozen layer: Plan.frozen). For split chunks the
        caller has filled k_ctx/v_ctx with the sequence's K/V up to here.
        `routing`: an MoE layer's round totals and auxiliary-loss scale (required with moe)."""
        # db reads the adapters' products a FULL activation kept, or those this backward's own
        # recompute forms (`formed`); the forward's buffers were since overwritten by later
        # layers' (one buffer per target).
        self.tag, self.keep = tag, {}
        self.formed = {} if self.adapters is None else {
            target: save[lora_saved_name(target)] for target in self.adapters.by_target
            if lora_saved_name(target) in save}
        cfg, ws, ctx, op = self.cfg, self.ws, self.ctx, self._op
        t, h, e = dy.shape[0], cfg.n_heads, cfg.head_dim
        g = FrozenGrads() if g is None else g
        x = save["x"]
        xn = ws["xn"][:t]
        k, v = self._kv(chunk, t, (save.get("k"), save.get("v")))  # a shared boundary: none
        # Recompute what the level did not keep. Same kernels as the forward: bit-identical.
        full = level is SavedLevel.FULL
        op("rms_norm_fwd", x, w["input_layernorm"], cfg.norm_eps, xn, ws["rstd"][:t],
           None if full else ws["h"][:t])  # below the level: x is where h starts
        if cfg.qk_norm:
            # QK-norm's backward needs the projections before the norm and their rstd, which no
            # level keeps: re-form K's (the saved or context K stays the attention's input;
            # ws["k"] only takes the norm's output), and Q's at FULL (likewise into ws["q"]).
            self._proj(w, xn, "k", ws["k"][:t])
            if full:
                self._proj(w, xn, "q", ws["q"][:t])
        if full:
            q, o, lse, hres = save["q"], save["o"], save["lse"], save["h"]
            op("rms_norm_fwd", hres, w["post_attention_layernorm"], cfg.norm_eps, ws["xn2"][:t],
               ws["rstd2"][:t])
            ffn = save
        else:
            q = ws["q"][:t]
            self._proj(w, xn, "q", q)
            op("rope_fwd", q, pos, rope_table(cfg), q)
            if level is SavedLevel.INP_ATTN:
                o, lse = save["o"], save["lse"]
            else:
                o, lse = ws["o"][:t], ws["lse"]
                for a, b, kk, vv, off in self._attn_inputs(chunk, k, v):
                    op("attention_fwd", q[a:b], kk, vv, off, o[a:b], lse_rows(lse, a, b),
                       tag=".re")
            hres = ws["h"][:t]
            self._lin("self_attn.o_proj", o.reshape(t, h * e), w, hres, True)
            if self.moe is None:
                self._ffn_fwd(w, hres, tag=".re", act=False)
            else:  # router and experts again: the same ops on the same input, the same bits
                self._ffn_norm(w, hres, ws["rstd2"][:t])
                self.moe.forward(op, w, ws["xn2"][:t], self.moe.tensors(None, t), tag=".re")
            ffn = {n: ws[n][:t] for n in ("gate", "up") if n in ws}
        dxn, dh, xn2 = ws["dxn"][:t], ws["dh"][:t], ws["xn2"][:t]
        if self.moe is None:
            self._dense_ffn_bwd(w, g, ffn["gate"], ffn["up"], xn2, dy, dxn)
        else:
            self.moe.backward(op, w, g, xn2, self.moe.tensors(ffn if full else None, t), dy,
                              dxn, routing, permuted=not full)
        op("rms_norm_bwd", hres, w["post_attention_layernorm"], ws["rstd2"][:t], dxn, dh,
           g["post_attention_layernorm"], dy)  # + dy: the residual branch
        # attention
        do, dq = ws["do"][:t], ws["dq"][:t]
        if self.adapters is None:  # the base's own order without LoRA
            op("linear_bwd_w", dh, o.reshape(t, h * e), g["self_attn.o_proj"], True)
        self._lin_bwd_x("self_attn.o_proj", dh, w, do.reshape(t, h * e))
        if self.adapters is not None:
            self._lin_bwd_w("self_attn.o_proj", dh, o.reshape(t, h * e), g)
        dk, dv = ws["dk"][:t], ws["dv"][:t]
        if chunk.split:
            dk_all, dv_all = ctx["dk_ctx"], ctx["dv_ctx"]
            if chunk.last_of_seq:  # first chunk of its sequence in backward order
                op("fill_", dk_all, 0.0)
                op("fill_", dv_all, 0.0)
            at = chunk.context
            for a, b, ks in chunk.segments:  # each document's keys only
                op("attention_bwd", q[a:b], ctx["k_ctx"][ks:at + b], ctx["v_ctx"][ks:at + b],
                   o[a:b], lse_rows(lse, a, b), do[a:b], at + a - ks, dq[a:b],
                   dk_all[ks:at + b], dv_all[ks:at + b])
            op("cast", dk_all[at:at + t], dk)
            op("cast", dv_all[at:at + t], dv)
        else:
            # The segments tile the chunk and each attends to its own rows only, so one call
            # gives a segment's dK/dV whole: written straight in bf16, with no fp32 sum to
            # clear, add into and cast (the same values; 0.4 s of an 8b step at 8k).
            for a, b, _ in chunk.segments:
                op("attention_bwd_own", q[a:b], k[a:b], v[a:b], o[a:b], lse_rows(lse, a, b),
                   do[a:b], dq[a:b], dk[a:b], dv[a:b])
        op("rope_bwd", dq, pos, rope_table(cfg), dq)
        op("rope_bwd", dk, pos, rope_table(cfg), dk)
        for name, d in (("q", dq), ("k", dk), ("v", dv)):
            self._proj_bwd(w, g, name, d)
        if self.adapters is None:  # the base's own order without LoRA
            # v, k, q: in FP8, dq's scale is then still in its region for dq @ w_q just below
            # (dataflow.ops_cuda_fp8); each gradient is its own sum, so the bits do not move.
            for name, d in (("v", dv), ("k", dk), ("q", dq)):
                op("linear_bwd_w", d.reshape(t, -1), xn, g[f"self_attn.{name}_proj"], True)
        for i, (name, d) in enumerate((("q", dq), ("k", dk), ("v", dv))):
            self._lin_bwd_x(f"self_attn.{name}_proj", d.reshape(t, -1), w, dxn, i > 0)
            if self.adapters is not None:
                self._lin_bwd_w(f"self_attn.{name}_proj", d.reshape(t, -1), xn, g)
        op("rms_norm_bwd", x, w["input_layernorm"], ws["rstd"][:t], dxn, dx,
           g["input_layernorm"], dh)

    def _dense_ffn_bwd(self, w, g, gate, up, xn2, dy, dxn) -> None:
        """The SwiGLU FFN's backward: dy (T, D) -> dxn (T, D), the gradient of its normed input
        xn2; the three weight gradients accumulate into g."""
        ws, op, t = self.ws, self._op, dy.shape[0]
        dact, dgate, dup, act = ws["dact"][:t], ws["dgate"][:t], ws["dup"][:t], ws["act"][:t]
        # SwiGLU's output for the down projection's weight gradient comes out of its backward
        # (one pass over gate and up instead of two).
        self._lin_bwd_x("mlp.down_proj", dy, w, dact)
        op("swiglu_bwd", gate, up, dact, dgate, dup, act)
        self._lin_bwd_w("mlp.down_proj", dy, act, g)  # act: formed by swiglu_bwd just now
        # Each projection's dx and then its dw, with and without LoRA: in FP8 the second reads
        # the same dy's scale and only casts it again (dataflow.ops_cuda_fp8), which saves more
        # than quantising xn2^T once for both weight gradients would.
        for i, (name, d) in enumerate((("mlp.gate_proj", dgate), ("mlp.up_proj", dup))):
            self._lin_bwd_x(name, d, w, dxn, i > 0)
            self._lin_bwd_w(name, d, xn2, g)

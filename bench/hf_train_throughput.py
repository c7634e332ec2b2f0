"""transformers' own training throughput for a model of the zoo (or a config file), the baseline
issue 41 sets beside `dataflow-demo` (olmoe-1b-7b at 8192: transformers' OlmoeForCausalLM trained
with torch's AdamW on the whole GPU at the same sequence length, the largest batch that fits):
the model built by transformers from our config's Hugging Face fields (random init, bf16
parameters, no offloading), torch.optim.AdamW (fused on a GPU), optionally gradient
checkpointing; batches of random token ids. It tries the batch sizes of --batches, largest first,
and keeps the first that trains a step without running out of memory; then times --steps steps
(the first one, which warms up, is reported but left out of tok/s). MFU on the model FLOPs of
dataflow.models.flops (active FLOPs for an MoE model, as the engine reports it). Needs torch and
transformers (never dependencies of the project):

    python -m dataflow.bench.hf_train_throughput olmoe-1b-7b --seqlen 8192 --out hf.json

Prints one JSON document (and writes it to --out): the device, the batch that fit, the step
times, tok/s, MFU and torch's peak allocated memory."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dataflow.memplan.plan.profiles import profile_for_device
from dataflow.models.flops import model_flops_per_seq


def _model(cfg, torch, device, checkpointing: bool):
    import transformers

    from dataflow.models.hf import hf_config_dict  # loads numba (about 2 s): see main

    fields = hf_config_dict(cfg)
    conf = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    conf.use_cache = False
    # Built on the device: a 7B-parameter random init on the CPU took longer than the whole
    # measurement's budget (bench/records/s20-h200x2-138f195).
    with device:
        model = transformers.AutoModelForCausalLM.from_config(conf, dtype=torch.bfloat16)
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model.to(device).train()


def _step(model, opt, tokens) -> float:
    opt.zero_grad(set_to_none=True)
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    opt.step()
    return float(loss.detach())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataflow.bench.hf_train_throughput",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="zoo name or config path (its Hugging Face fields build it)")
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--steps", type=int, default=3, help="steps timed, the first a warm-up")
    p.add_argument("--batches", default="16,8,4,2,1",
                   help="batch sizes to try, largest first (default 16,8,4,2,1)")
    p.add_argument("--checkpointing", action="store_true",
                   help="gradient checkpointing (transformers' own): larger batches fit")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke test)")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    try:
        import torch
    except ImportError as exc:
        print(f"hf_train_throughput needs torch and transformers: {exc}", file=sys.stderr)
        return 2
    # dataflow.models.hf loads numba (about 2 s): imported after the torch check and --help
    from dataflow.models.hf_config import model_config

    if args.steps < 2:
        p.error("--steps must be at least 2 (the first warms up)")
    cfg = model_config(args.model)
    dev = torch.device(args.device)
    gpu = dev.type == "cuda"
    name = torch.cuda.get_device_name(dev) if gpu else "cpu"
    torch.manual_seed(0)
    model = _model(cfg, torch, dev, args.checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0, fused=gpu)
    gen = torch.Generator(device="cpu").manual_seed(1)
    out = {"model": cfg.name, "family": cfg.family, "device": name, "seqlen": args.seqlen,
           "checkpointing": args.checkpointing, "dtype": "bf16 parameters, torch AdamW",
           "tried": []}
    batch = None
    for b in (int(x) for x in args.batches.split(",")):
        tokens = torch.randint(0, cfg.vocab_size, (b, args.seqlen), generator=gen).to(dev)
        try:  # two steps: the first creates AdamW's state, which the second must fit beside
            _step(model, opt, tokens)
            _step(model, opt, tokens)
            if gpu:
                torch.cuda.synchronize()
            batch = b
            out["tried"].append({"batch": b, "fits": True})
            break
        except torch.OutOfMemoryError:
            out["tried"].append({"batch": b, "fits": False})
        # outside the handler: its traceback holds the failed step's activations
        opt.zero_grad(set_to_none=True)
        if gpu:
            torch.cuda.empty_cache()
    if batch is None:
        out["error"] = f"no batch of {args.batches} fits"
        print(json.dumps(out, indent=1))
        return 1
    if gpu:
        torch.cuda.reset_peak_memory_stats(dev)
    times, losses = [], []
    for _ in range(args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (batch, args.seqlen), generator=gen).to(dev)
        t0 = time.perf_counter()
        losses.append(_step(model, opt, tokens))
        if gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    steady = times[1:]
    step_s = sum(steady) / len(steady)
    tokens_per_step = batch * args.seqlen
    flops = model_flops_per_seq(cfg, args.seqlen) * batch
    peak = profile_for_device(name).peak_bf16_flop_per_s if gpu else float("nan")
    out.update(batch=batch, tokens_per_step=tokens_per_step, step_times_s=times, losses=losses,
               tok_per_s=tokens_per_step / step_s, mfu=flops / step_s / peak,
               peak_allocated_gib=(torch.cuda.max_memory_allocated(dev) / 2**30 if gpu
                                   else None))
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

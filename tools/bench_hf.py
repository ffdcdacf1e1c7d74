"""A transformers model's training step (forward + backward) through the "rtk" attention backend
against transformers' SDPA path, same model and batches, same run (GPU host with torch and
transformers; PYTHONPATH=.).

    PYTHONPATH=. python tools/bench_hf.py [--layers 4 --tokens 16384 --rounds 5]

Layouts (the same tokens per step): ``dense`` (rows of --seqlen), ``packed`` (sequences of
64-4096 tokens in one row, position ids restarting; transformers' packed mask: SDPA gets a
materialized block-diagonal mask, rtk the sequences as varlen rows), ``padded`` (rows of --seqlen
right-padded to 25-100% tokens; SDPA gets the padding mask, rtk gathers the tokens).  Milliseconds
per step (median of the rounds, the backends interleaved), the host syncs inside a step included.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchutil  # noqa: E402


def _model(transformers, torch, attn: str, layers: int):
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                   num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8,
                                   max_position_embeddings=8192, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    model.set_attn_implementation(attn)
    return model


def _batches(torch, layout: str, tokens: int, seqlen: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    if layout == "dense":
        ids = torch.randint(0, 32000, (tokens // seqlen, seqlen), generator=g)
        return {"input_ids": ids.cuda(), "labels": ids.cuda()}
    if layout == "packed":
        lengths = []
        while sum(lengths) < tokens:
            lengths.append(min(int(torch.randint(64, 4097, (), generator=g)), tokens - sum(lengths)))
        ids = torch.randint(0, 32000, (1, tokens), generator=g)
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        return {"input_ids": ids.cuda(), "position_ids": pos.cuda(), "labels": ids.cuda(), "lengths": lengths}
    rows = tokens // seqlen
    ids = torch.randint(1, 32000, (rows, seqlen), generator=g)
    keep = torch.randint(seqlen // 4, seqlen + 1, (rows,), generator=g)
    mask = (torch.arange(seqlen)[None, :] < keep[:, None]).long()
    return {"input_ids": ids.masked_fill(mask == 0, 0).cuda(), "attention_mask": mask.cuda(),
            "labels": ids.masked_fill(mask == 0, -100).cuda(), "lengths": keep.tolist()}


def main() -> None:
    p = benchutil.parser(__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="steps timed per round")
    p.add_argument("--layouts", default="dense,packed,padded")
    args = p.parse_args()
    import torch
    import transformers

    import rtkernels.torch as rtt
    rtt.register_transformers()
    backends = ("sdpa", "rtk")
    models = {b: _model(transformers, torch, b, args.layers) for b in backends}
    rows = []
    for layout in args.layouts.split(","):
        batch = _batches(torch, layout, args.tokens, args.seqlen)
        lengths = batch.pop("lengths", None)

        def step(model):
            model.zero_grad(set_to_none=True)
            model(**batch).loss.backward()

        for b in backends:   # warm up: compiles, allocator
            step(models[b])
        times = {b: [] for b in backends}
        for _ in range(args.rounds):
            for b in backends:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step(models[b])
                torch.cuda.synchronize()
                times[b].append((time.perf_counter() - t0) * 1e3 / args.steps)
        ms = {b: statistics.median(v) for b, v in times.items()}
        row = {"layout": layout, "tokens": args.tokens, "sequences": len(lengths) if lengths else args.tokens // args.seqlen,
               "mean_len": round(statistics.mean(lengths), 1) if lengths else args.seqlen,
               **{f"{b}_ms": round(ms[b], 2) for b in backends}, "sdpa_over_rtk": round(ms["sdpa"] / ms["rtk"], 3)}
        rows.append(row)
        print(row, flush=True)
    cols = ["layout", "tokens", "sequences", "mean_len", "sdpa_ms", "rtk_ms", "sdpa_over_rtk"]
    print(benchutil.table(rows, cols))
    benchutil.save(args.out, "bench_hf", {"env": benchutil.environment(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()

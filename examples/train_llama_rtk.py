"""A few training steps of a small Llama (random init) with every attention layer on rtk,
then greedy generation - transformers' model, rtkernels' attention forward and backward.

    python examples/train_llama_rtk.py [--steps 20 --compare]

``rtkernels.torch.register_transformers()`` registers the "rtk" attention (and its mask
function); ``model.set_attn_implementation("rtk")`` switches the layers to
``torch.ops.rtk.attention``, whose backward is ``torch.ops.rtk.attention_backward``.
``--compare`` trains an SDPA copy of the same model on the same batches beside it.  ``--packed``
packs each step's sequences into one row with restarting position ids (as
``DataCollatorWithFlattening`` does): the backend runs them as varlen sequences, no attention
across them and no padding.
"""
from __future__ import annotations

import argparse
import time


def make_model(attn: str, seed: int = 0):
    import torch
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    model.set_attn_implementation(attn)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--compare", action="store_true", help="train an SDPA copy beside it")
    ap.add_argument("--packed", action="store_true", help="the batch's sequences packed into one row")
    ns = ap.parse_args()
    import torch
    import rtkernels.torch as rtt

    rtt.register_transformers()
    models = {"rtk": make_model("rtk")}
    if ns.compare:
        models["sdpa"] = make_model("sdpa")
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(ns.steps):
        # a learnable toy task: each sequence repeats its first 64 tokens
        head = torch.randint(0, 4096, (ns.batch, 64), device="cuda", generator=gen)
        ids = head.repeat(1, ns.seqlen // 64)
        inputs = {"input_ids": ids, "labels": ids}
        if ns.packed:   # one row, positions restarting per sequence; transformers finds them without a cache
            pos = torch.arange(ns.seqlen, device="cuda").repeat(ns.batch)[None]
            inputs = {"input_ids": ids.reshape(1, -1), "labels": ids.reshape(1, -1), "position_ids": pos,
                      "use_cache": False}
        line = []
        for name, model in models.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = model(**inputs).loss
            loss.backward()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            line.append(f"{name} loss {loss.item():.4f} ({(time.perf_counter() - t0) * 1e3:.1f} ms)")
        print(f"step {step:3d}: " + "   ".join(line))
    prompt = ids[:2, :80]
    with torch.no_grad():
        for name, model in models.items():
            out = model.eval().generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32,
                                        do_sample=False, pad_token_id=0)
            copied = (out[:, 80:80 + 32] == ids[:2, 80:80 + 32]).float().mean().item()
            print(f"{name}: greedy continuation repeats the sequence for {copied:.0%} of 32 tokens")


if __name__ == "__main__":
    main()

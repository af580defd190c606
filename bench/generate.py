"""Generation speed: tinylm's KV-cache path beside its full-recompute path and transformers' generate.

    python bench/generate.py                    # both configs, markdown table on stdout
    python bench/generate.py --configs default --new-tokens 50 --repeats 1

For each config one model (random weights: speed does not depend on them) is run three ways on
the same short prompt, each producing the same number of new tokens inside the context:

    cached      tinylm.generating.generate: prefill once, then one position per token (KV cache)
    recompute   tinylm.generating.generate_reference: the whole context for every token (the oracle)
    hf          transformers' LlamaForCausalLM.generate (with its own cache) on the exported model:
                the weights and config.json that `tinylm export` writes (llama_state_dict, hf_configs)

Greedy decoding (temperature 0 / do_sample=False) and sampling (temperature 0.8, top-p 0.95 /
do_sample=True with the same values) are both measured. Repeats are interleaved (cached, recompute,
hf, cached, ...) in one process so that load from elsewhere slows each alike, after a short
warm-up of each; the median is reported. Greedy ids of the three must be equal (checked).
Float32, CPU, 2 threads.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from tinylm.export import hf_configs, llama_state_dict
from tinylm.generating import generate, generate_reference
from tinylm.model import Transformer
from tinylm.tokenizer import Tokenizer

CONFIGS = {
    "default": dict(vocab_size=2048, context_length=256, d_model=128, num_layers=4, num_heads=4, d_ff=344),
    "small": dict(vocab_size=10_000, context_length=256, d_model=512, num_layers=4, num_heads=16, d_ff=1344),
}
SAMPLING = {"greedy": (0.0, 1.0), "sampling": (0.8, 0.95)}


def exported_hf_model(model: Transformer) -> LlamaForCausalLM:
    """The model transformers loads from our export: config.json's values and model.safetensors' tensors."""
    # hf_configs needs the tokenizer only for the <|endoftext|> id; the bytes and that token will do.
    tokenizer = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    config = hf_configs(model, tokenizer, "float32")["config.json"]
    hf = LlamaForCausalLM(LlamaConfig(**config)).eval()
    hf.load_state_dict(llama_state_dict(model))
    hf.generation_config.eos_token_id = None  # random weights: never stop early
    hf.generation_config.pad_token_id = 0
    hf.generation_config.do_sample = False
    return hf


def bench_config(name: str, new_tokens: int, prompt_len: int, repeats: int) -> list[dict]:
    cfg = CONFIGS[name]
    torch.manual_seed(0)
    model = Transformer(**cfg).eval()
    hf = exported_hf_model(model)
    prompt = torch.randint(
        cfg["vocab_size"], (prompt_len,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    C = cfg["context_length"]
    assert prompt_len + new_tokens <= C, "stay inside the context: transformers does not crop"

    def run(
        path: str, temperature: float, top_p: float, new_tokens: int = new_tokens
    ) -> tuple[float, list[int]]:
        generator = torch.Generator().manual_seed(0)
        start = time.perf_counter()
        if path == "cached":
            ids = generate(model, prompt, new_tokens, C, temperature, top_p, None, generator)
        elif path == "recompute":
            ids = generate_reference(model, prompt, new_tokens, C, temperature, top_p, None, generator)
        else:
            sampling = dict(do_sample=True, temperature=temperature, top_p=top_p) if temperature else {}
            with torch.no_grad():
                out = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, **sampling)
            ids = out[0, prompt_len:].tolist()
        return time.perf_counter() - start, ids

    rows = []
    for mode, (temperature, top_p) in SAMPLING.items():
        paths = ["cached", "recompute", "hf"]
        for path in paths:  # warm-up
            run(path, temperature, top_p, new_tokens=10)
        times = {path: [] for path in paths}
        ids = {}
        for i in range(repeats):
            for path in paths if i % 2 == 0 else paths[::-1]:
                seconds, ids[path] = run(path, temperature, top_p)
                times[path].append(seconds)
        for path in paths:
            assert len(ids[path]) == new_tokens, (path, len(ids[path]))
        if mode == "greedy":
            assert ids["cached"] == ids["recompute"] == ids["hf"], "greedy ids differ"
        else:
            assert ids["cached"] == ids["recompute"], "sampled ids of the two tinylm paths differ"
        for path in paths:
            seconds = statistics.median(times[path])
            rows.append(
                dict(config=name, mode=mode, path=path, seconds=seconds, tokens_per_s=new_tokens / seconds)
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    import transformers

    load_before = os.getloadavg()
    rows = [
        row
        for name in args.configs
        for row in bench_config(name, args.new_tokens, args.prompt_len, args.repeats)
    ]
    load_after = os.getloadavg()

    print(
        f"{args.new_tokens} new tokens after a {args.prompt_len}-token prompt, median of {args.repeats} "
        f"interleaved runs after a 10-token warm-up; float32, CPU, {args.threads} thread(s); "
        f"torch {torch.__version__}, "
        f"transformers {transformers.__version__}, Python {platform.python_version()}; load average "
        f"before/after: {' '.join(f'{x:.2f}' for x in load_before)} / "
        f"{' '.join(f'{x:.2f}' for x in load_after)}."
    )
    print()
    print("| config | decoding | path | seconds | new tokens/s | cached vs this |")
    print("|---|---|---|---:|---:|---:|")
    by_key = {(r["config"], r["mode"], r["path"]): r for r in rows}
    for r in rows:
        cached = by_key[(r["config"], r["mode"], "cached")]
        print(
            f"| {r['config']} | {r['mode']} | {r['path']} | {r['seconds']:.3f} | {r['tokens_per_s']:,.0f} | "
            f"{cached['tokens_per_s'] / r['tokens_per_s']:.2f}x |"
        )
    print()
    for name in args.configs:
        for mode in SAMPLING:
            c, f, h = (by_key[(name, mode, p)]["tokens_per_s"] for p in ("cached", "recompute", "hf"))
            print(
                f"- {name}, {mode}: cached / recompute **{c / f:.2f}x**, "
                f"cached / transformers **{c / h:.2f}x**"
            )


if __name__ == "__main__":
    main()

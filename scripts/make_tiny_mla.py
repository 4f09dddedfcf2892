"""Write a tiny random-weight DeepSeek-V2-shaped (MLA) checkpoint that vLLM 0.32's CPU MLA
backend serves: latent 512 + rotary 64 (= 576, the one size CPU_MLA takes), hidden 64,
2 heads, 4 layers (1 dense, 3 with 4 tiny experts), the suite's trained tokenizer.
Random weights: plumbing only (``nexus_vllm.hf.tiny_mla``).

    python scripts/make_tiny_mla.py /tmp/tiny_mla
    vllm serve /tmp/tiny_mla --dtype float32 --enforce-eager              # stock
    vllm serve /tmp/tiny_mla --dtype float32 --enforce-eager \\
        --kv-eviction nexus --kv-budget 128                                # evicting
"""

from __future__ import annotations

import argparse

from nexus_vllm.hf.tiny_mla import save_tiny_deepseek_v2


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="where to write the checkpoint (created)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dense-layers", type=int, default=1,
                        help="leading layers with a dense MLP; the rest are MoE")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(save_tiny_deepseek_v2(args.out_dir, layers=args.layers,
                                dense_layers=args.dense_layers, seed=args.seed))


if __name__ == "__main__":
    main()

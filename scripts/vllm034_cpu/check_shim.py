"""Self-check of ``cpu_ops_shim.py`` (test-only vLLM 0.34 build; not product code).

Compares each pure-torch fallback with a literal, element-by-element transcription of the
Triton kernel it replaces (program by program, lane by lane), on random inputs shaped like
the CPU runner's. Also checks the murmur3 hash against a plain-Python murmur3_32.

    .venv/bin/python scripts/vllm034_cpu/check_shim.py        # any torch env will do
"""

from __future__ import annotations

import math
import pathlib
import random
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import cpu_ops_shim as shim  # noqa: E402

M32 = 0xFFFFFFFF
PAD = -1


def rand_batch(rng: random.Random, max_reqs: int = 8, width: int = 16, bs: int = 4,
               model_len: int = 64) -> dict:
    num_reqs = rng.randint(1, max_reqs - 1)
    idx = rng.sample(range(max_reqs), num_reqs)
    lens = [rng.randint(0, 6) for _ in range(num_reqs)]
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    computed = [rng.randint(0, 20) for _ in range(max_reqs)]
    prefill = [rng.randint(1, 40) for _ in range(max_reqs)]
    return dict(
        num_reqs=num_reqs, idx=idx, lens=lens, qsl=qsl, computed=computed, prefill=prefill,
        block_table=torch.randint(0, 1000, (max_reqs, width), dtype=torch.int32),
        num_blocks=torch.randint(0, width + 1, (max_reqs,), dtype=torch.int32),
        all_ids=torch.randint(0, 500, (max_reqs, model_len), dtype=torch.int32),
        max_reqs=max_reqs, width=width, bs=bs, model_len=model_len,
    )


def check_gather(rng: random.Random) -> None:
    b = rand_batch(rng)
    padded = min(b["max_reqs"], b["num_reqs"] + rng.randint(0, 2))
    out0 = torch.randint(0, 9, (b["max_reqs"], b["width"]), dtype=torch.int32)
    out1 = out0.clone()
    shim.gather_block_table_cpu(b["block_table"], out0, torch.tensor(b["idx"], dtype=torch.int32),
                                b["num_blocks"], padded)
    for row in range(padded):  # _gather_block_tables_kernel, MASK_SLIDING_WINDOW=False
        if row >= b["num_reqs"]:
            out1[row].zero_()
            continue
        req = b["idx"][row]
        for i in range(int(b["num_blocks"][req])):
            out1[row, i] = b["block_table"][req, i]
    assert torch.equal(out0, out1)


def check_slot_mapping(rng: random.Random) -> None:
    b = rand_batch(rng)
    idx = list(b["idx"])
    if rng.random() < 0.3:
        idx[0] = -1
    total = b["qsl"][-1]
    max_tokens = total + 5
    pos = torch.zeros(max_tokens, dtype=torch.int64)
    for t in range(total):
        pos[t] = rng.randint(0, b["width"] * b["bs"] - 1)
    enabled = rng.random() < 0.8
    sm0 = torch.randint(0, 9, (max_tokens,), dtype=torch.int64)
    sm1 = sm0.clone()
    shim.compute_slot_mapping_cpu(b["block_table"], sm0, torch.tensor(idx, dtype=torch.int32),
                                  torch.tensor(b["qsl"], dtype=torch.int32), pos, b["bs"],
                                  enabled, PAD)
    for i in range(total, max_tokens):
        sm1[i] = PAD
    for r, req in enumerate(idx):
        for t in range(b["qsl"][r], b["qsl"][r + 1]):
            p = int(pos[t])
            bi = p // b["bs"] if enabled else 0
            num = int(b["block_table"][req, bi]) if req >= 0 else 0
            slot = num * b["bs"] + p % b["bs"]
            sm1[t] = slot if (enabled and req >= 0) else PAD
    assert torch.equal(sm0, sm1), (sm0, sm1)


def check_prefill_inputs(rng: random.Random) -> None:
    b = rand_batch(rng)
    total = b["qsl"][-1]
    ids0 = torch.randint(0, 9, (total + 3,), dtype=torch.int32)
    ids1 = ids0.clone()
    nxt0 = torch.randint(0, 9, (1, b["max_reqs"]), dtype=torch.int32)
    nxt1 = nxt0.clone()
    shim.prepare_prefill_inputs_cpu(ids0, nxt0, torch.tensor(b["idx"], dtype=torch.int32),
                                    torch.tensor(b["qsl"], dtype=torch.int32), b["all_ids"],
                                    torch.tensor(b["prefill"], dtype=torch.int32),
                                    torch.tensor(b["computed"], dtype=torch.int32))
    for r, req in enumerate(b["idx"]):
        pl, nc = b["prefill"][req], b["computed"][req]
        if nc >= pl:
            continue
        qs, qe = b["qsl"][r], b["qsl"][r + 1]
        for i in range(qe - qs):
            ids1[qs + i] = b["all_ids"][req, nc + i]
        p = nc + qe - qs
        nxt1[0, req] = b["all_ids"][req, p] if p < pl else 0
    assert torch.equal(ids0, ids1) and torch.equal(nxt0, nxt1)


def check_pos_seq_lens(rng: random.Random) -> None:
    b = rand_batch(rng)
    total = b["qsl"][-1]
    pos0 = torch.randint(0, 9, (total + 3,), dtype=torch.int64)
    pos1 = pos0.clone()
    sl0 = torch.randint(0, 9, (b["max_reqs"],), dtype=torch.int32)
    sl1 = sl0.clone()
    shim.prepare_pos_seq_lens_cpu(torch.tensor(b["idx"], dtype=torch.int32),
                                  torch.tensor(b["qsl"], dtype=torch.int32),
                                  torch.tensor(b["computed"], dtype=torch.int32), pos0, sl0)
    for r, req in enumerate(b["idx"]):
        nc = b["computed"][req]
        qs, qe = b["qsl"][r], b["qsl"][r + 1]
        sl1[r] = nc + qe - qs
        for i in range(qe - qs):
            pos1[qs + i] = nc + i
    sl1[b["num_reqs"]:] = 0
    assert torch.equal(pos0, pos1) and torch.equal(sl0, sl1)


def check_combine(rng: random.Random) -> None:
    b = rand_batch(rng)
    n = b["num_reqs"]
    # Like the CPU runner: one logit per request, no draft tokens.
    qsl = [0]
    for _ in range(n):
        qsl.append(qsl[-1] + rng.randint(1, 5))
    seq = torch.tensor([rng.randint(1, 45) for _ in range(n)], dtype=torch.int32)
    last = torch.randint(0, 500, (b["max_reqs"], 1), dtype=torch.int64)
    ids0 = torch.randint(0, 9, (qsl[-1] + 2,), dtype=torch.int32)
    ids1 = ids0.clone()
    cu = torch.arange(n + 1, dtype=torch.int32)
    prefill = torch.tensor(b["prefill"], dtype=torch.int32)
    li = shim.combine_sampled_and_draft_tokens_cpu(
        ids0, torch.tensor(b["idx"], dtype=torch.int32), last,
        torch.tensor(qsl, dtype=torch.int32), seq, prefill, last[:, :0], cu, n, 1)
    want = []
    for r, req in enumerate(b["idx"]):
        num_logits = 1
        start = qsl[r + 1] - num_logits
        want.append(start)
        s, pl = int(seq[r]), int(prefill[req])
        if s <= pl:
            continue
        if s - num_logits >= pl:
            ids1[start] = last[req, 0]
    assert li.tolist() == want and torch.equal(ids0, ids1)


def check_post_update(rng: random.Random) -> None:
    b = rand_batch(rng)
    n, vocab = b["num_reqs"], 50
    idx = list(b["idx"])
    if rng.random() < 0.3:
        idx[-1] = -1
    sampled = torch.randint(0, vocab, (n, 1), dtype=torch.int64)
    ns = torch.tensor([rng.randint(0, 1) for _ in range(n)], dtype=torch.int32)
    nrej = torch.tensor([rng.randint(0, 1) for _ in range(n)], dtype=torch.int32)
    qsl = torch.tensor(b["qsl"], dtype=torch.int32)
    state = dict(
        computed=torch.tensor(b["computed"], dtype=torch.int32),
        last=torch.randint(0, vocab, (b["max_reqs"], 1), dtype=torch.int64),
        bins=torch.randint(0, 3, (b["max_reqs"], vocab), dtype=torch.int32),
        all_ids=b["all_ids"].clone(),
        total=torch.randint(0, 40, (b["max_reqs"],), dtype=torch.int32),
    )
    s1 = {k: v.clone() for k, v in state.items()}
    shim.post_update_cpu(torch.tensor(idx, dtype=torch.int32), state["computed"], state["last"],
                         state["bins"], sampled, ns, nrej, qsl, state["all_ids"], state["total"])
    for r, req in enumerate(idx):
        if req < 0:
            continue
        total, k = int(s1["total"][req]), int(ns[r])
        if k > 0:
            s1["last"].view(-1)[req] = sampled[r, k - 1]
            s1["total"][req] = total + k
        for i in range(k):
            tok = int(sampled[r, i])
            s1["all_ids"][req, total + i] = tok
            s1["bins"][req, tok] += 1
        delta = (b["qsl"][r + 1] - b["qsl"][r]) - int(nrej[r])
        if delta:
            s1["computed"][req] += delta
    for name in state:
        assert torch.equal(state[name], s1[name]), name


def murmur3_32_ref(words: list[int], seed: int = 0) -> int:
    """Standard MurmurHash3 x86_32 over 32-bit words, then ``^ len`` and fmix."""
    h = seed
    for k in words:
        k = (k * 0xCC9E2D51) & M32
        k = ((k << 15) | (k >> 17)) & M32
        k = (k * 0x1B873593) & M32
        h ^= k
        h = ((h << 13) | (h >> 19)) & M32
        h = (h * 5 + 0xE6546B64) & M32
    h ^= 4 * len(words)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def check_murmur(rng: random.Random) -> None:
    seeds = [rng.randint(-(2**63), 2**63 - 1) for _ in range(4)]
    pos = [rng.randint(0, 2**31) for _ in range(4)]
    keys = [rng.randint(0, 2**17) for _ in range(6)]
    for domain in (0, 0x9E3779B9):
        got = shim._murmur3_hash32(torch.tensor(seeds), torch.tensor(pos), torch.tensor(keys),
                                   domain)
        for i, (s, p) in enumerate(zip(seeds, pos)):
            for j, k in enumerate(keys):
                words = [s & M32, (s >> 32) & M32, p & M32, k]
                assert int(got[i, j]) == murmur3_32_ref(words, domain), (domain, s, p, k)


def check_gumbel(rng: random.Random) -> None:
    vocab, max_reqs = 300, 4
    logits = torch.randn(3, vocab)
    temp = torch.tensor([0.0, 0.7, 1.0, 1.3])
    seeds = torch.tensor([rng.randint(-(2**63), 2**63 - 1) for _ in range(max_reqs)])
    idx = torch.tensor([0, 1, 3], dtype=torch.int32)
    pos = torch.tensor([5, 6, 7], dtype=torch.int64)
    for fp64 in (False, True):
        a = shim.gumbel_sample_cpu(logits, idx, temp, seeds, pos, True, False, fp64)
        again = shim.gumbel_sample_cpu(logits, idx, temp, seeds, pos, True, False, fp64)
        assert torch.equal(a, again)  # deterministic given seed and position
        assert int(a[0]) == int(torch.argmax(logits[0]))  # greedy row
        for row in (1, 2):
            t, s, p = float(temp[int(idx[row])]), int(seeds[int(idx[row])]), int(pos[row])
            best, arg = -math.inf, -1
            for k in range(vocab):
                h = murmur3_32_ref([s & M32, (s >> 32) & M32, p & M32, k],
                                   0)
                if fp64:
                    hi = murmur3_32_ref([s & M32, (s >> 32) & M32, p & M32, k], 0x9E3779B9)
                    u = ((((hi << 32) | h) >> 11) + 0.5) * 2.0**-53
                    g = -math.log(-math.log(u))
                else:
                    u = (h >> 16) * 2.0**-16 + ((h & 0xFFFF) + 0.5) * 2.0**-32
                    g = -math.log(-math.log1p(-u))
                v = float(logits[row, k]) / t + g
                if v > best:
                    best, arg = v, k
            assert int(a[row]) == arg, (fp64, row, int(a[row]), arg)
    # The sampled distribution follows softmax(logits / T).
    small = torch.tensor([[0.0, 1.0, 2.0]])
    counts = [0, 0, 0]
    for p in range(4000):
        tok = shim.gumbel_sample_cpu(small, torch.tensor([0]), torch.tensor([1.0]),
                                     torch.tensor([1234]), torch.tensor([p]), True, False, False)
        counts[int(tok)] += 1
    probs = torch.softmax(small[0], 0).tolist()
    for c, pr in zip(counts, probs):
        assert abs(c / 4000 - pr) < 0.03, (counts, probs)


def check_logit_bias(rng: random.Random) -> None:
    vocab, max_reqs = 20, 3
    logits0 = torch.randn(3, vocab)
    logits1 = logits0.clone()
    idx = torch.tensor([0, 1, 2])
    pos = torch.tensor([3, 3, 10])
    n_allowed = torch.tensor([3, 0, 0], dtype=torch.int32)
    allowed = torch.zeros(max_reqs, 8, dtype=torch.int32)
    allowed[0, :3] = torch.tensor([1, 5, 7])
    n_bias = torch.tensor([0, 2, 0], dtype=torch.int32)
    bias_ids = torch.zeros(max_reqs, 8, dtype=torch.int32)
    bias_ids[1, :2] = torch.tensor([2, 4])
    bias = torch.zeros(max_reqs, 8)
    bias[1, :2] = torch.tensor([5.0, -5.0])
    min_lens = torch.tensor([0, 10, 8], dtype=torch.int32)
    n_stop = torch.tensor([0, 1, 1], dtype=torch.int32)
    stop = torch.zeros(max_reqs, 4, dtype=torch.int32)
    stop[1, 0], stop[2, 0] = 9, 9
    restore = torch.zeros(max_reqs, dtype=torch.int32)
    shim.apply_logit_bias_cpu(logits0, idx, pos, n_allowed, allowed, n_bias, bias_ids, bias,
                              min_lens, n_stop, restore, stop, False)
    keep = logits1[0, [1, 5, 7]].clone()
    logits1[0] = -math.inf
    logits1[0, [1, 5, 7]] = keep
    logits1[1, 2] += 5.0
    logits1[1, 4] -= 5.0
    logits1[1, 9] = -math.inf  # pos 3 + 1 < 10
    # row 2: pos 10 + 1 >= 8, unchanged
    assert torch.equal(logits0, logits1)


def check_prompt_logprob_ids(rng: random.Random) -> None:
    b = rand_batch(rng)
    total = b["qsl"][-1]
    computed = [min(c, b["model_len"] - 8) for c in b["computed"]]
    got = shim.get_prompt_logprobs_token_ids_cpu(
        total, torch.tensor(b["qsl"], dtype=torch.int32),
        torch.tensor(b["idx"], dtype=torch.int32), torch.tensor(computed, dtype=torch.int32),
        b["all_ids"])
    for r, req in enumerate(b["idx"]):
        for i in range(b["qsl"][r + 1] - b["qsl"][r]):
            assert int(got[b["qsl"][r] + i]) == int(b["all_ids"][req, computed[req] + 1 + i])


def check_mrope(rng: random.Random) -> None:
    b = rand_batch(rng)
    dims, total = 3, b["qsl"][-1]
    positions0 = torch.zeros(dims, total + 2, dtype=torch.int64)
    positions1 = positions0.clone()
    prefill_pos = torch.randint(0, 99, (b["max_reqs"] * dims, b["model_len"]), dtype=torch.int32)
    delta = torch.randint(-5, 5, (b["max_reqs"],), dtype=torch.int32)
    shim.prepare_mrope_positions_cpu(positions0, prefill_pos, delta,
                                     torch.tensor(b["idx"], dtype=torch.int32),
                                     torch.tensor(b["qsl"], dtype=torch.int32),
                                     torch.tensor(b["prefill"], dtype=torch.int32),
                                     torch.tensor(b["computed"], dtype=torch.int32))
    for r, req in enumerate(b["idx"]):
        nc = b["computed"][req]
        for i in range(b["qsl"][r + 1] - b["qsl"][r]):
            for j in range(dims):
                if nc < b["prefill"][req]:
                    v = int(prefill_pos[dims * req + j, nc + i])
                else:
                    v = nc + i + int(delta[req])
                positions1[j, b["qsl"][r] + i] = v
    assert torch.equal(positions0, positions1)


def main() -> int:
    rng = random.Random(0)
    checks = [check_gather, check_slot_mapping, check_prefill_inputs, check_pos_seq_lens,
              check_combine, check_post_update, check_prompt_logprob_ids, check_mrope]
    for check in checks:
        for _ in range(200):
            check(rng)
    check_murmur(rng)
    check_gumbel(rng)
    check_logit_bias(rng)
    print(f"check_shim: {len(checks) + 3} checks passed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

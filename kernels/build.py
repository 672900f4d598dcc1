"""Build the CPU kernels now, into $GENSERVE_CACHE_DIR, and exit non-zero if they cannot be built:
``python -m genserve.kernels.build`` (the Docker image runs it at image build time)."""

from __future__ import annotations

import sys

from genserve.kernels import _cpu_library


def main() -> int:
    status = _cpu_library.status()
    print(f"genserve CPU kernels: {status.reason} (cache {_cpu_library.cache_dir()})")
    return 0 if status.available else 1


if __name__ == "__main__":
    sys.exit(main())

"""``python -m pagellm.kernels``: build every compiled CPU kernel shipped with this install and
report each one; exit status 1 if any fails (a wheel missing a source or header shows up here).

Without it a failed kernel is only a logged warning, and the engine quietly runs the slower pure
PyTorch path."""

from __future__ import annotations

import os
import sys

from pagellm import kernels


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    sources = sorted(f for f in os.listdir(here) if f.endswith(".c"))
    if not sources:
        print(f"no kernel sources in {here}", file=sys.stderr)
        return 1
    failed = 0
    for name in sources:
        try:
            kernels.build_source(os.path.join(here, name))
            print(f"ok      {name}")
        except Exception as e:  # report every kernel, not just the first failure
            failed += 1
            print(f"FAILED  {name}: {e}")
    print(f"{len(sources) - failed}/{len(sources)} kernels built from {here}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Same as the `rtk` console script, for a checkout without `pip install`:

    PYTHONPATH=. python tools/rtk_inspect.py inspect vector_add --param dtype=float16 --out dump/
    PYTHONPATH=. python tools/rtk_inspect.py report elementwise --sweep dtype=float16,bfloat16,float32
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rtkernels.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

"""``python -m fastcast.kernels``: build the fused C++ kernels ahead of their first use
(``make`` runs it before the tests and benchmarks)."""

import sys

from .build import main

sys.exit(main())

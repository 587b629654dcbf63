"""``python -m cuda_kernels.gemm [--clear]``: where the persistent kernel cache is and what it
holds; ``--clear`` empties it (:func:`cuda_kernels.gemm.kernel_cache.main`)."""

import sys

from .kernel_cache import main

sys.exit(main())

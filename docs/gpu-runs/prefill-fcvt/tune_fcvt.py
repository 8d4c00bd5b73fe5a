"""The GPU table maker (python -m anychip.kernels.gpu.tuning) with the GEMM's FCVT form on, for the A/B's call:
its argv is the tuner's."""
import sys

from anychip.kernels.gpu import launch, tuning

_options = launch._gemm_options.__wrapped__  # lru_cache underneath


def _with_fcvt(*args):
    return dict(_options(*args), FCVT=True)


launch._gemm_options = _with_fcvt
sys.exit(tuning.main(sys.argv[1:]))

"""Session 41: the warp-specialized Gluon GEMM (gluon_ws.py) bit for bit against the shipped Triton GEMM, then
timed beside it and cuBLAS BF16 (same process, CUDA-graph replays over rotating weight copies). Run in its own
process under a timeout: a hand-over error between partitions would hang, not fail.
python docs/gpu-runs/session41/ws_check.py OUT.json   (PYTHONPATH=$PWD)"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import ab  # noqa: E402
import gluon_ws  # noqa: E402

VARIANTS = {"ws_u4": dict(), "ws_u2": dict(unroll=2), "ws_u4_s6": dict(stages=6), "ws_u8": dict(unroll=8)}


def main(out_path: str) -> None:
    ab.run(out_path, [(4096, 2048, (512, 4096)), (2048, 6144, (512, 4096)), (4096, 640, (100,))],  # last: tails
           {name: (gluon_ws.run, kw, True) for name, kw in VARIANTS.items()})


if __name__ == "__main__":
    main(sys.argv[1])

# Session 46: a NaN in a norm weight of a W4A8 model must stop a GPU engine (compat.install_gpu_model_hook).
# usage: nan_gpu.py TINY_W4A8_DIR WORKDIR
import os, shutil, sys
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

if __name__ == "__main__":
    src, work = sys.argv[1], sys.argv[2]
    import torch
    from safetensors.torch import load_file, save_file
    dst = os.path.join(work, "tiny-nan")
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    files = [f for f in os.listdir(dst) if f.endswith(".safetensors")]
    done = False
    for f in files:
        t = load_file(os.path.join(dst, f))
        for k in t:
            if k.endswith("input_layernorm.weight") and not done:
                t[k] = t[k].clone(); t[k][3] = float("nan"); done = True; print("poisoned", k)
        save_file(t, os.path.join(dst, f), metadata={"format": "pt"})
    from vllm import LLM
    try:
        LLM(model=dst, max_model_len=256, gpu_memory_utilization=0.3, enforce_eager=True)
        print("NAN CHECK: engine started (not refused)")
    except Exception as exc:  # noqa: BLE001
        print("NAN CHECK: refused:", type(exc).__name__, str(exc)[:300])

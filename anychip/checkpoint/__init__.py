"""The on-disk W4A8 checkpoint: pack/unpack, quantize (RTN, GPTQ), manifest, verify, the default model."""

"""Arithmetic: a torch reference for every op, the CPU (C++) and GPU (Triton) implementations, and the
dispatch table that says which implementation serves which device and instruction set."""

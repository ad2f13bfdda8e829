"""Kernel benchmarks (GPU): each fused CODA program against its bare GEMM, eager torch, torch.compile
and Liger. ``common`` holds the timing and one ``Setup`` of shared inputs per d; ``bf16`` and
``fp8`` one setup function per program; ``kernels`` the command line."""

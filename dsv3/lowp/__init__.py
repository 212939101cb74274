"""Low precision (paper §3.3), applied to the built model from outside: `quant` converts the dense linears through
torchao and swaps in the routed experts' low-precision implementations; `fp8_kernels` holds their Triton kernels."""

BLOCK = 128  # DeepSeek-V3's FP8 tile and weight block edge (§3.3.2); DeepGEMM's groups start at multiples of it

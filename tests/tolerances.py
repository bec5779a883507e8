"""Tolerances for comparing with numbers recorded in a file, by another processor than the one running the test
(devtools/recorded_numbers.py refuses bit equality there; `make test` reruns those tests under
ATEN_CPU_CAPABILITY=default). Bit equality stays right between two computations of the same process."""

# float32 logits of order 1 (|logit| <= 3) from a tiny model (2 layers, width <= 64): another processor, SIMD width
# or thread count sums in another order, a few ulp per operation (2.4e-7 at 2). Seen: <= 2.6e-6 between the Intel
# Xeon that recorded them and an AMD EPYC, under AVX2 and ATEN_CPU_CAPABILITY=default, on 1 and 2 threads. 2e-5 is
# 8x that, and 50x below what a changed layout moves them by (>= 1e-3).
RECORDED_FLOAT32_LOGITS = {"rtol": 1e-5, "atol": 2e-5}

# float64 outputs of the official code, recomputed by memlm: round-off compounds to ~1e-15 (seen <= 4.4e-15) on any
# processor; 1e-9 leaves six orders of magnitude for another one's summation order, and a real difference of the
# models (a missing term, another option) moves them by more than 1e-6.
OFFICIAL_FLOAT64 = 1e-9

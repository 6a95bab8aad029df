#!/usr/bin/env python3
"""The key side's block-wide query ranges (`KeySide` in
crates/cuda/kernels/attention_mma.cu), simulated on the CPU and checked
against the per-key binary search (`SgKeys::last_query` in
kernels/common.cuh) for random documents, windows and lengths. No GPU needed:
it checks the algorithm; the GPU tests check the kernel.

    python3 scripts/attention-variants/key_ranges_sim.py
"""
import random
def first(pos, window, i):
    lo = max(i + 1 - window, 0) if window > 0 else 0
    if pos is not None: lo = max(lo, i - pos[i])
    return max(min(lo, i), 0)
def last_query(pos, window, T, j):
    hi = T - 1
    if window > 0: hi = min(hi, j + window - 1)
    if pos is None or hi <= j: return hi
    lo = j
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        if first(pos, window, mid) <= j: lo = mid
        else: hi = mid - 1
    return lo
def keyside(pos, window, T, k0, ROWS=128, NTH=256):
    kl = min(k0 + ROWS, T) - 1
    lo, hi = kl, T - 1
    if window > 0: hi = min(hi, kl + window - 1)
    starts = None
    if pos is not None:
        dfirst = lambda i: max(min(i - pos[i], i), 0)
        starts = [dfirst(k0 + t) if k0 + t <= kl else 0x7fffffff for t in range(ROWS)]
        while lo < hi:
            n = hi - lo; m = min(n, NTH)
            cnt = sum(1 for t in range(m) if dfirst(lo + (t + 1) * n // m) <= kl)
            # monotone check
            preds = [dfirst(lo + (t + 1) * n // m) <= kl for t in range(m)]
            assert preds == sorted(preds, reverse=True)
            nlo = lo if cnt == 0 else lo + cnt * n // m
            hi = hi if cnt == m else lo + (cnt + 1) * n // m - 1
            lo = nlo
    last = lo if pos is not None else hi
    def of(j):
        if j > kl: return T - 1
        l = last
        if pos is not None and starts[kl - k0] > j:
            a, z = j - k0 + 1, kl - k0
            while a < z:
                mid = (a + z) >> 1
                if starts[mid] > j: z = mid
                else: a = mid + 1
            l = k0 + a - 1
        return min(l, j + window - 1) if window > 0 else l
    return last, of
random.seed(1)
checked = 0
for trial in range(400):
    T = random.choice([1, 5, 64, 127, 128, 129, 300, 1000, 2048, 5000])
    mode = random.choice(["none", "docs", "docs1", "longdoc"])
    pos = None
    if mode != "none":
        pos = []
        while len(pos) < T:
            L = random.choice([1, 2, 3, 50, 100, 700, 1500]) if mode == "docs" else (1 if mode == "docs1" else 10**9)
            L = min(L, T - len(pos))
            pos.extend(range(L))
    window = random.choice([0, 0, 1, 7, 128, 200, 4096, 2**31 - 1])
    for k0 in range(0, T, 128):
        last, of = keyside(pos, window, T, k0)
        kl = min(k0 + 128, T) - 1
        # nq = side.last / 64 + 1 must equal last_query(kl)/64+1
        assert last == last_query(pos, window, T, kl), (T, mode, window, k0, last, last_query(pos, window, T, kl))
        for j in range(k0, k0 + 128):
            want = last_query(pos, window, T, j) if j < T else T - 1
            if j >= T:
                got = of(j)
                assert got == T - 1
                continue
            got = of(j)
            assert got == want, (T, mode, window, k0, j, got, want)
            checked += 1
print("ok", checked)

"""The compiled kernels behind the NumPy modules' fused softmax, exp(X − u 𝟏ᵀ), P ⊙ (dP − D 𝟏ᵀ), σ and softplus
(numpy_runtime.fused_row_softmax, exp_rows, shifted_product, sigmoid, softplus): numba, optional, compiled on
first use.

Real code, linted and tested; ``GeneratedNumPyPrinter`` copies these functions' source into the generated
NumPy modules that call them (numba imported inside, where it may be absent: the NumPy passes then).
"""

from __future__ import annotations

import numpy as np


def _fused_kernels():
    """The numba kernels of fused_row_softmax, compiled on first use (each dtype on its first call) and shared by
    every generated module of the process (kept in sys.modules under a private name: one compilation, not one
    per module); None without numba or with the environment variable SYMATTN_NUMBA=0 (the NumPy passes then)."""
    made = _fused_kernels.__dict__.get("made", False)
    if made is not False:
        return made
    import os
    import sys
    import types

    shared = sys.modules.get("_symattn_fused_softmax_5")  # the version of these kernels: bump it on a change
    if shared is not None and os.environ.get("SYMATTN_NUMBA", "1") != "0":
        _fused_kernels.made = shared.made
        return shared.made

    try:
        if os.environ.get("SYMATTN_NUMBA", "1") == "0":
            raise ImportError("SYMATTN_NUMBA=0")
        import numba
        from numba.extending import intrinsic
    except ImportError:
        _fused_kernels.made = None
        return None
    made = _numba_softmax(numba, intrinsic)
    _fused_kernels.made = made
    shared = sys.modules["_symattn_fused_softmax_5"] = types.ModuleType("_symattn_fused_softmax_5")
    shared.made = made
    return made


def _numba_softmax(numba, intrinsic):
    """The kernels ({dtype name: {kernel name: kernel}}: softmax, exp_rows, shifted_product, sigmoid, softplus),
    compiled lazily by numba."""

    @intrinsic
    def as_float(typingctx, bits):  # int32 / int64 bits -> float32 / float64: 2^k from its exponent bits
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(signature.return_type))

        return {numba.int32: numba.float32, numba.int64: numba.float64}[bits](bits), codegen

    # exp as a polynomial (Cephes): numba's np.exp is a scalar libm call, which does not vectorize (no SVML);
    # no reassoc flag here: it would merge the two parts of ln 2 that keep the argument reduction exact
    exact = {"nsz", "contract", "arcp"}

    @numba.njit(fastmath=exact, inline="always")
    def exp32(x):
        """exp(x) for float32 x (Cephes expf); x below -87.34 (-inf too) gives 0, above 88.72 inf, NaN NaN."""
        low, high = x < np.float32(-87.33654), x > np.float32(88.72283)
        x = min(max(x, np.float32(-87.33654)), np.float32(88.72283))
        k = np.floor(x * np.float32(1.442695) + np.float32(0.5))
        r = x - k * np.float32(0.693359375) - k * np.float32(-2.12194440e-4)
        y = np.float32(1.9875691500e-4) * r + np.float32(1.3981999507e-3)
        y = y * r + np.float32(8.3334519073e-3)
        y = y * r + np.float32(4.1665795894e-2)
        y = y * r + np.float32(1.6666665459e-1)
        y = y * r + np.float32(5.0000001201e-1)
        y = y * (r * r) + r + np.float32(1.0)
        half = np.int64(k) >> 1  # 2^k as 2^half 2^(k - half): each a normal number for k up to 128
        y = y * as_float(np.int32((half + 127) << 23)) * as_float(np.int32((np.int64(k) - half + 127) << 23))
        return np.float32(0.0) if low else (np.float32(np.inf) if high else y)

    @numba.njit(fastmath=exact, inline="always")
    def exp64(x):
        """exp(x) for float64 x (Cephes exp, a Padé form); x below -708.40 (-inf too) gives 0, above 709.78
        inf."""
        low, high = x < -708.3964185322641, x > 709.782712893384
        x = min(max(x, -708.3964185322641), 709.782712893384)
        k = np.floor(x * 1.4426950408889634 + 0.5)
        r = x - k * 6.93145751953125e-1 - k * 1.42860682030941723212e-6
        rr = r * r
        p = r * ((1.26177193074810590878e-4 * rr + 3.02994407707441961300e-2) * rr + 9.99999999999999999910e-1)
        q = ((3.00198505138664455042e-6 * rr + 2.52448340349684104192e-3) * rr + 2.27265548208155028766e-1) * rr
        y = 1.0 + 2.0 * (p / (q + 2.00000000000000000009e0 - p))
        half = np.int64(k) >> 1  # 2^k as 2^half 2^(k - half): each a normal number for k up to 1024
        y = y * as_float((half + 1023) << 52) * as_float((np.int64(k) - half + 1023) << 52)
        return 0.0 if low else (np.inf if high else y)

    # log(1 + u) for u in [0, 1] as 2 atanh(s), s = u / (2 + u) in [0, 1/3]: no cancellation for small u, and the
    # series Σ s^(2j+1) / (2j+1) past its last term below half an ulp ((1/9)^j / (2j + 1): j = 8, 18)
    atanh32 = tuple(np.float32(1 / (2 * j + 1)) for j in range(8))[::-1]
    atanh64 = tuple(1 / (2 * j + 1) for j in range(18))[::-1]

    @numba.njit(fastmath=exact, inline="always", error_model="numpy")
    def log1p32(u):
        s = u / (np.float32(2.0) + u)
        z, y = s * s, np.float32(0.0)
        for c in atanh32:
            y = y * z + c
        return np.float32(2.0) * s * y

    @numba.njit(fastmath=exact, inline="always", error_model="numpy")
    def log1p64(u):
        s = u / (2.0 + u)
        z, y = s * s, 0.0
        for c in atanh64[:6]:  # (loops of six terms: LLVM unrolls them, and the loop over entries vectorizes)
            y = y * z + c
        for c in atanh64[6:12]:
            y = y * z + c
        for c in atanh64[12:]:
            y = y * z + c
        return 2.0 * s * y

    return {
        "float32": _numba_row_kernels(numba, exact, exp32) | _numba_entry_kernels(numba, exact, exp32, log1p32),
        "float64": _numba_row_kernels(numba, exact, exp64) | _numba_entry_kernels(numba, exact, exp64, log1p64),
    }


def _numba_entry_kernels(numba, exact, exp, log1p):
    """The entrywise kernels with the exp and log1p (on [0, 1]) given, in place on a flat array, compiled lazily.
    NumPy's error model: a division is not checked for a zero divisor (numba's Python model raises, and its
    test on every entry keeps the loop from vectorizing)."""

    @numba.njit(fastmath=exact, error_model="numpy")
    def sigmoid(a, one):
        """a = 1 / (1 + exp(−a)) in place (exp(−a) = inf gives 0)."""
        for j in range(a.shape[0]):
            a[j] = one / (one + exp(-a[j]))

    @numba.njit(fastmath=exact, error_model="numpy")
    def softplus(a, one):
        """a = log(1 + exp(a)) = max(a, 0) + log1p(exp(−|a|)) in place: no overflow, and to a few ulps for a far
        below 0 too (where it is about exp(a)), down to the smallest normal number (0 below it)."""
        for j in range(a.shape[0]):
            x = a[j]
            a[j] = max(x, one - one) + log1p(exp(-abs(x)))

    return dict(sigmoid=sigmoid, softplus=softplus)  # (by the names of numpy_runtime's helpers)


def _numba_row_kernels(numba, exact, exp):
    """The row kernels with the exp given ({kernel name: kernel}), compiled lazily by numba."""

    @numba.njit(fastmath=exact | {"reassoc"})  # reassoc: the row sum vectorizes
    def softmax(a, top, one, sums):
        """Row softmax of a (N, m) in place, given its row maxima top (0 for a row of -inf): exp(a - top)
        and its sum (into sums) in one sweep, then the scale (1 / the sum, at least 1 unless the row is all
        -inf)."""
        for i in range(a.shape[0]):
            total, shift = one - one, top[i]
            for j in range(a.shape[1]):
                e = exp(a[i, j] - shift)
                a[i, j] = e
                total += e
            sums[i] = total
            scale = one / max(total, one)
            for j in range(a.shape[1]):
                a[i, j] *= scale

    @numba.njit(fastmath=exact)
    def exp_rows(a, shift):
        """a = exp(a - shift) in place, a (N, k, m), one shift a row (N, k); +inf in shift gives 0. (One
        array read and written: a kernel with a separate output would find it may alias a, and not vectorize.)"""
        for b in range(a.shape[0]):
            for i in range(a.shape[1]):
                s = shift[b, i]
                for j in range(a.shape[2]):
                    a[b, i, j] = exp(a[b, i, j] - s)

    @numba.njit(fastmath=exact)
    def shifted_product(p, a, shift):
        """a = p ⊙ (a - shift) in place, p and a (N, k, m), one shift a row (N, k)."""
        for b in range(a.shape[0]):
            for i in range(a.shape[1]):
                s = shift[b, i]
                for j in range(a.shape[2]):
                    a[b, i, j] = p[b, i, j] * (a[b, i, j] - s)

    return {"exp_normalize": softmax, "exp_rows": exp_rows, "shifted_product": shifted_product}

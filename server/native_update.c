/* wstream's native update kernels (server/native.py builds and loads this file; NOTE [Native
 * kernels] there says why they exist and what they must match).
 *
 * Each function works on one contiguous range and runs on the calling thread; the caller splits a
 * stage into ranges across threads (ctypes releases the GIL for the call). Plain C99, built with
 * -O3 -march=native: the loops vectorise; on x86 with AVX the sum streams its stores (no read for
 * ownership of a destination nobody reads before the update).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

/* The interface's version: native.py refuses a library that reports another. */
int wstream_native_version(void) { return 1; }

/* float -> bfloat16, rounding to nearest even (as torch's conversion); NaN stays a quiet NaN. */
static inline uint16_t to_bf16(float f) {
    union { float f; uint32_t u; } x;
    x.f = f;
    uint32_t u = x.u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#if defined(__AVX__)
/* Sum of the sources' 8 floats at i, in source order. */
static inline __m256 sum8(const float *const *srcs, int nsrc, int64_t i) {
    __m256 x = _mm256_loadu_ps(srcs[0] + i);
    for (int k = 1; k < nsrc; k++) x = _mm256_add_ps(x, _mm256_loadu_ps(srcs[k] + i));
    return x;
}

/* acc_lo, acc_hi += the squares of x's low and high halves, in float64 (exact squares). */
#if defined(__FMA__)
#define WSTREAM_SQUARES(acc_lo, acc_hi, x)                                     \
    do {                                                                        \
        __m256d lo_ = _mm256_cvtps_pd(_mm256_castps256_ps128(x));               \
        __m256d hi_ = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));             \
        acc_lo = _mm256_fmadd_pd(lo_, lo_, acc_lo);                             \
        acc_hi = _mm256_fmadd_pd(hi_, hi_, acc_hi);                             \
    } while (0)
#else
#define WSTREAM_SQUARES(acc_lo, acc_hi, x)                                     \
    do {                                                                        \
        __m256d lo_ = _mm256_cvtps_pd(_mm256_castps256_ps128(x));               \
        __m256d hi_ = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));             \
        acc_lo = _mm256_add_pd(acc_lo, _mm256_mul_pd(lo_, lo_));                \
        acc_hi = _mm256_add_pd(acc_hi, _mm256_mul_pd(hi_, hi_));                \
    } while (0)
#endif

/* 32 elements from i: their sum stored with STORE, their squares added when SQUARE. Eight named
 * accumulators, so that the float64 adds' latency overlaps (an array of them, or a branch inside
 * the loop, ran 2.5x slower on 32 M elements). */
#define WSTREAM_SUM_BLOCK(STORE, SQUARE)                                                                  \
    do {                                                                                                  \
        __m256 x0 = sum8(srcs, nsrc, i), x1 = sum8(srcs, nsrc, i + 8);                                    \
        __m256 x2 = sum8(srcs, nsrc, i + 16), x3 = sum8(srcs, nsrc, i + 24);                              \
        if (SQUARE) {                                                                                     \
            WSTREAM_SQUARES(a0, a1, x0); WSTREAM_SQUARES(a2, a3, x1);                                     \
            WSTREAM_SQUARES(a4, a5, x2); WSTREAM_SQUARES(a6, a7, x3);                                     \
        }                                                                                                 \
        STORE(dst + i, x0); STORE(dst + i + 8, x1); STORE(dst + i + 16, x2); STORE(dst + i + 24, x3);     \
    } while (0)
#endif

/* dst[i] = sum_k srcs[k][i] for i in [0, n), each sum in float32 in source order (as torch adds
 * them; to add into dst, the caller passes dst as the first source); and, for each piece of
 * `piece` elements below `norm_n`, the squared norm of dst's piece summed in float64, into
 * piece_sums[p]. `n` and `norm_n` count from the range's start, which the caller puts on a piece
 * boundary of the whole tensor, so the pieces (and so the norm's float) do not depend on how a
 * stage was split across threads. `stream`: store past the cache. */
void wstream_sum_sumsq(float *dst, const float *const *srcs, int nsrc, int64_t n, int64_t norm_n, int64_t piece,
                       double *restrict piece_sums, int stream) {
    for (int64_t start = 0, p = 0; start < n; start += piece, p++) {
        int64_t end = start + piece < n ? start + piece : n;
        int64_t stop = norm_n < start ? start : (norm_n < end ? norm_n : end); /* the norm's part: buffers follow */
        int64_t i = start;
        double s = 0.0;
#if defined(__AVX__)
        __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        if (((uintptr_t)(dst + i) & 31u) == 0) {
            if (stream) {
                for (; i + 32 <= stop; i += 32) WSTREAM_SUM_BLOCK(_mm256_stream_ps, 1);
            } else {
                for (; i + 32 <= stop; i += 32) WSTREAM_SUM_BLOCK(_mm256_store_ps, 1);
            }
            __m256d total = _mm256_add_pd(_mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3)),
                                          _mm256_add_pd(_mm256_add_pd(a4, a5), _mm256_add_pd(a6, a7)));
            double lanes[4];
            _mm256_storeu_pd(lanes, total);
            s = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
        }
#endif
        for (; i < stop; i++) {
            float x = srcs[0][i];
            for (int k = 1; k < nsrc; k++) x += srcs[k][i];
            dst[i] = x;
            s += (double)x * (double)x;
        }
#if defined(__AVX__)
        if (((uintptr_t)(dst + i) & 31u) == 0) { /* past the norm's part: no squares */
            if (stream) {
                for (; i + 32 <= end; i += 32) WSTREAM_SUM_BLOCK(_mm256_stream_ps, 0);
            } else {
                for (; i + 32 <= end; i += 32) WSTREAM_SUM_BLOCK(_mm256_store_ps, 0);
            }
        }
#endif
        for (; i < end; i++) {
            float x = srcs[0][i];
            for (int k = 1; k < nsrc; k++) x += srcs[k][i];
            dst[i] = x;
        }
        if (start < norm_n) piece_sums[p] = s;
    }
#if defined(__AVX__)
    if (stream) _mm_sfence(); /* streamed stores visible before another thread reads dst */
#endif
}

/* One AdamW step (torch.optim.AdamW's decoupled weight decay, amsgrad off) of the range, the
 * gradient divided by `grad_scale`, and the new parameters written to `out` as well: bfloat16
 * (out_kind 1) or float32 (out_kind 2); out_kind 0: no copy. The step's scalars come computed in
 * float64 by the caller and rounded to float32, as torch's fused CPU kernel computes them: `decay`
 * = 1 - lr * weight_decay, `lerp_weight` = 1 - beta1, `sq_weight` = 1 - beta2, `neg_step_size` =
 * -lr / (1 - beta1^t), `bias2_sqrt` = sqrt(1 - beta2^t). The per-element arithmetic is that
 * kernel's vectorised loop's (torch 2.13), operation for operation: built with -ffp-contract=off,
 * its two fused multiply-adds (the lerp's and the second moment's) are fmaf here, so the results
 * are the same floats, but in a parameter's last numel % 16 elements, which torch runs through
 * another loop of its own (within a rounding there). tests/test_native.py checks both against the
 * installed torch. */
void wstream_adamw(float *restrict param, float *restrict exp_avg, float *restrict exp_avg_sq, const float *restrict grad,
                   int64_t n, float decay, float lerp_weight, float beta2, float sq_weight, float eps, float grad_scale,
                   float neg_step_size, float bias2_sqrt, void *restrict out, int out_kind, int stream) {
    const int small = fabsf(lerp_weight) < 0.5f; /* exp_avg.lerp_(grad, lerp_weight), as torch takes it */
    const float coeff = small ? lerp_weight : lerp_weight - 1.0f;
    uint16_t *out16 = (uint16_t *)out;
    float *out32 = (float *)out;
#define WSTREAM_ADAMW_BODY                                                      \
    float g = grad[i] / grad_scale;                                             \
    float p = param[i] * decay;                                                 \
    float m0 = exp_avg[i];                                                      \
    float m = fmaf(coeff, g - m0, small ? m0 : g);                              \
    float v = fmaf(sq_weight * g, g, exp_avg_sq[i] * beta2);                    \
    exp_avg[i] = m;                                                             \
    exp_avg_sq[i] = v;                                                          \
    p = p + neg_step_size * m / (sqrtf(v) / bias2_sqrt + eps);                  \
    param[i] = p;
    int64_t i0 = 0;
#if defined(__AVX__)
    /* A large fp32 copy streams its stores, 64 bytes at a time: nobody reads it before the next
     * fetch, and a store that misses the cache would read its line first (measured: 10.5 -> 9.5
     * ms per 32 M on 2 threads; a bf16 copy gained nothing so, and keeps the plain loop). */
    if (stream && out_kind == 2 && ((uintptr_t)out32 & 31u) == 0) {
        for (; i0 + 16 <= n; i0 += 16) {
            float block[16] __attribute__((aligned(32)));
            for (int64_t i = i0; i < i0 + 16; i++) { WSTREAM_ADAMW_BODY block[i - i0] = p; }
            _mm256_stream_ps(out32 + i0, _mm256_load_ps(block));
            _mm256_stream_ps(out32 + i0 + 8, _mm256_load_ps(block + 8));
        }
    }
#endif
    if (out_kind == 1) {
        for (int64_t i = i0; i < n; i++) { WSTREAM_ADAMW_BODY out16[i] = to_bf16(p); }
    } else if (out_kind == 2) {
        for (int64_t i = i0; i < n; i++) { WSTREAM_ADAMW_BODY out32[i] = p; }
    } else {
        for (int64_t i = 0; i < n; i++) { WSTREAM_ADAMW_BODY }
    }
#undef WSTREAM_ADAMW_BODY
#if defined(__AVX__)
    if (stream) _mm_sfence();
#endif
}

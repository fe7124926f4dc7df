/* Weight-only INT8 linear layer for CPUs: out[m, n] = scale[n] * sum_k x[m, k] * q[n, k] (+ bias[n]).
 *
 * Built by tandem/kernels/int8_cpu.py with the host's C compiler (-O3 -march=native -fopenmp) and loaded
 * with ctypes: plain C, no torch headers, so it compiles in about a second. The weight is read once per
 * call from memory as int8 (a quarter of fp32's bytes): a tile of TN rows is widened to fp32 in a buffer
 * that stays in L1, then multiplied with every row of x (the few rows of a decode step), TN
 * accumulators at a time so that the FMAs are not waiting on each other. Weight rows are split among
 * `threads` OpenMP threads. With AVX2 and FMA the inner loop is written with intrinsics; elsewhere a
 * plain loop that the compiler vectorizes. The scheme is gpt-fast's and torchao's int8 weight-only
 * ("W8A16", per output channel); the loop is ours. */
#include <stdint.h>
#include <stddef.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define TN 4

static void tile(const float *x, const int8_t *q, const float *scale, const float *bias, float *out,
                 int64_t M, int64_t N, int64_t K, int64_t n0, int64_t tn, float *w) {
    for (int64_t r = 0; r < tn; r++)
        for (int64_t k = 0; k < K; k++) w[r * K + k] = (float)q[(n0 + r) * K + k];
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * K;
        float acc[TN] = {0};
        int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
        if (tn == TN) {
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
                   a3 = _mm256_setzero_ps();
            for (; k + 8 <= K; k += 8) {
                __m256 xv = _mm256_loadu_ps(xr + k);
                a0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + k), a0);
                a1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + K + k), a1);
                a2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 2 * K + k), a2);
                a3 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 3 * K + k), a3);
            }
            __m256 v[4] = {a0, a1, a2, a3};
            for (int r = 0; r < 4; r++) {
                __m128 h = _mm_add_ps(_mm256_castps256_ps128(v[r]), _mm256_extractf128_ps(v[r], 1));
                h = _mm_hadd_ps(h, h);
                h = _mm_hadd_ps(h, h);
                acc[r] = _mm_cvtss_f32(h);
            }
        }
#endif
        for (int64_t r = 0; r < tn; r++)
            for (int64_t kk = k; kk < K; kk++) acc[r] += xr[kk] * w[r * K + kk];
        for (int64_t r = 0; r < tn; r++)
            out[m * N + n0 + r] = acc[r] * scale[n0 + r] + (bias ? bias[n0 + r] : 0.0f);
    }
}

void w8_linear_f32(const float *x, const int8_t *q, const float *scale, const float *bias, float *out,
                   int64_t M, int64_t N, int64_t K, int threads) {
    int64_t tiles = (N + TN - 1) / TN;
#pragma omp parallel num_threads(threads)
    {
        float w[TN * K];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            int64_t n0 = t * TN, tn = N - n0 < TN ? N - n0 : TN;
            tile(x, q, scale, bias, out, M, N, K, n0, tn, w);
        }
    }
}

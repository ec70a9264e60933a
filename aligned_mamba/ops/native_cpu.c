/* The torch backend's position-invariant ops as single loops, for the CPU.

   Each function computes, element by element, the IEEE operations its torch form runs as whole-tensor
   ops (ops/elementwise.py, reduce.py, norm.py, conv1d.py), in the same order and with the same
   float32 roundings: one pass over memory instead of one per operation. Built with
   -ffp-contract=off and without fast-math, so the compiler neither fuses a multiply and an add nor
   reorders a sum; vectorising across elements changes no element's operations. The bits equal the
   torch forms' (tests/ops/test_native.py checks them against each other).

   Arrays are contiguous. dtype codes: 0 float32, 1 bfloat16 (stored as uint16, rounded to nearest
   even as torch rounds). */

#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

typedef int64_t i64;

static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bf16_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }
static inline uint16_t f32_bf16(float f) {
    if (f != f) return 0x7FC0;
    uint32_t u = f32_bits(f);
    return (uint16_t)((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16);
}
static inline float load(const void *p, i64 i, int dt) {
    return dt ? bf16_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static inline void store(void *p, i64 i, int dt, float v) {
    if (dt) ((uint16_t *)p)[i] = f32_bf16(v);
    else ((float *)p)[i] = v;
}
/* torch.clamp: nan stays nan */
static inline float clamp_lo(float x, float lo) { return x < lo ? lo : x; }
static inline float clamp_hi(float x, float hi) { return x > hi ? hi : x; }

/* -- elementwise.py ------------------------------------------------------------------------------ */

#define EXP_LO ((float)(-87.3365447505531 - 0.7))
#define EXP_HI ((float)88.3762626647949)
#define LOG2E ((float)1.44269504088896341)
#define LN2_HI ((float)0.693359375)
#define LN2_LO ((float)-2.12194440e-4)
#define ROUND_MAGIC ((float)12582912.0)

static inline float am_exp1(float x) {
    float xc = clamp_hi(clamp_lo(x, EXP_LO), EXP_HI);
    float n = xc * LOG2E;
    n = n + ROUND_MAGIC;
    n = n - ROUND_MAGIC;
    n = clamp_lo(n, -127.0f);
    float r = xc - n * LN2_HI;
    r = r - n * LN2_LO;
    float p = r * (float)1.9875691500e-4;
    p = p + (float)1.3981999507e-3;
    p = p * r; p = p + (float)8.3334519073e-3;
    p = p * r; p = p + (float)4.1665795894e-2;
    p = p * r; p = p + (float)1.6666665459e-1;
    p = p * r; p = p + (float)5.0000001201e-1;
    float rr = r * r;
    p = p * rr;
    p = p + r;
    p = p + 1.0f;
    /* torch converts nan to INT32_MIN; the product is nan whatever the scale */
    int32_t ni = (n != n) ? INT32_MIN : (int32_t)n;
    uint32_t scale = ((uint32_t)ni + 127u) << 23;
    return p * bits_f32(scale);
}

static inline float am_log1(float x, int finite) {
    int32_t bits = (int32_t)f32_bits(x);
    int32_t e = ((bits >> 23) & 0xFF) - 127;
    float m = bits_f32(((uint32_t)bits & 0x007FFFFFu) | 0x3F800000u);
    int big = m > (float)(2.0 * 0.70710678118654752);
    m = big ? m * 0.5f : m;
    float ef = (float)(big ? e + 1 : e);
    float s = (m - 1.0f) / (m + 1.0f);
    float s2 = s * s;
    float p = s2 * (float)(1.0 / 11.0);
    p = p + (float)(1.0 / 9.0);
    p = p * s2; p = p + (float)(1.0 / 7.0);
    p = p * s2; p = p + (float)(1.0 / 5.0);
    p = p * s2; p = p + (float)(1.0 / 3.0);
    p = p * s2;
    float logm = (s + s * p) * 2.0f;
    float y = ef * LN2_HI + logm;
    y = y + ef * LN2_LO;
    if (finite) return y;
    if (x == 0.0f) y = bits_f32(0xFF800000u);  /* -inf */
    if (x < 0.0f) y = bits_f32(0x7FC00000u);   /* nan */
    if (x != x || (x > 0.0f && x == bits_f32(0x7F800000u))) y = x;
    return y;
}

static inline float am_log1p1(float x, int finite) {
    float w = x + 1.0f;
    float d = w - 1.0f;
    float safe_d = d == 0.0f ? 1.0f : d;
    float y = am_log1(w, finite) * (x / safe_d);
    if (!finite && x > 0.0f && x == bits_f32(0x7F800000u)) y = x;
    return d == 0.0f ? x : y;
}

static inline float am_softplus1(float x, float threshold) {
    float y = am_log1p1(am_exp1(clamp_hi(x, threshold)), 1);
    return x > threshold ? x : y;
}

static inline float am_sigmoid1(float x) { return 1.0f / (am_exp1(-x) + 1.0f); }
static inline float am_silu1(float x) { return x / (am_exp1(-x) + 1.0f); }

/* op: 0 exp, 1 log, 2 log1p, 3 softplus (arg: threshold), 4 sigmoid, 5 silu */
void am_unary(int op, const float *x, float *y, i64 n, float arg) {
    switch (op) {
    case 0: for (i64 i = 0; i < n; i++) y[i] = am_exp1(x[i]); break;
    case 1: for (i64 i = 0; i < n; i++) y[i] = am_log1(x[i], 0); break;
    case 2: for (i64 i = 0; i < n; i++) y[i] = am_log1p1(x[i], 0); break;
    case 3: for (i64 i = 0; i < n; i++) y[i] = am_softplus1(x[i], arg); break;
    case 4: for (i64 i = 0; i < n; i++) y[i] = am_sigmoid1(x[i]); break;
    case 5: for (i64 i = 0; i < n; i++) y[i] = am_silu1(x[i]); break;
    default: break;
    }
}

/* -- reduce.py: tree_sum --------------------------------------------------------------------------- */

static i64 pow2_at_least(i64 n) {
    i64 w = 1;
    while (w < n) w <<= 1;
    return w;
}

/* The pairwise tree of reduce.tree_sum over buf[0..n) zero-padded to width (buf holds width floats). */
static inline float tree(float *buf, i64 n, i64 width) {
    for (i64 i = n; i < width; i++) buf[i] = 0.0f;
    for (i64 w = width / 2; w >= 1; w /= 2)
        for (i64 i = 0; i < w; i++) buf[i] = buf[i] + buf[i + w];
    return buf[0];
}

/* x [rows, n] -> y [rows]; scratch: pow2_at_least(max(n, 2)) floats. */
void am_tree_sum(const float *x, float *y, i64 rows, i64 n, float *scratch) {
    i64 width = n == 0 ? 2 : pow2_at_least(n);
    for (i64 r = 0; r < rows; r++) {
        memcpy(scratch, x + r * n, (size_t)n * sizeof(float));
        y[r] = tree(scratch, n, width);
    }
}

/* -- norm.py -------------------------------------------------------------------------------------- */

/* norm._normalize of v[0..d) in place: v * (1 / sqrt(tree(v*v) / d + eps)). scratch: width floats. */
static inline void normalize(float *v, i64 d, float eps, float *scratch) {
    i64 width = pow2_at_least(d);
    for (i64 i = 0; i < d; i++) scratch[i] = v[i] * v[i];
    float var = tree(scratch, d, width) / (float)d;
    float inv = 1.0f / __builtin_sqrtf(var + eps);
    for (i64 i = 0; i < d; i++) v[i] = v[i] * inv;
}

/* weight * normalised x, rounded once to the output dtype (norm.rms_norm), rows of d.
   x [M, d] in dtype xdt; residual (optional, [M, d] in rdt): the fused residual add first
   (backend.add_norm: res_out = residual + x in rdt, then the norm of res_out as stored);
   w [d] already in odt; out [M, d] in odt. scratch: 2 * pow2_at_least(d) floats. */
void am_rms_norm(const void *x, int xdt, const void *residual, void *res_out, int rdt, const void *w,
                 void *out, int odt, i64 M, i64 d, float eps, float *scratch) {
    float *v = scratch, *sq = scratch + pow2_at_least(d);
    for (i64 r = 0; r < M; r++) {
        for (i64 i = 0; i < d; i++) {
            float xi = load(x, r * d + i, xdt);
            if (residual) {
                float s = load(residual, r * d + i, rdt) + xi;
                store(res_out, r * d + i, rdt, s);
                xi = load(res_out, r * d + i, rdt);
            }
            v[i] = xi;
        }
        normalize(v, d, eps, sq);
        for (i64 i = 0; i < d; i++) store(out, r * d + i, odt, load(w, i, odt) * v[i]);
    }
}

/* norm.gated_rms_norm: weight * norm_g(y * silu(z)), groups of d / G. y, z, out [M, d] and
   w [d] in dt. scratch: 2 * pow2_at_least(d / G) floats. */
void am_gated_norm(const void *y, const void *z, const void *w, void *out, int dt, i64 M, i64 d, i64 G,
                   float eps, float *scratch) {
    i64 dg = d / G;
    float *v = scratch, *sq = scratch + pow2_at_least(dg);
    for (i64 r = 0; r < M; r++)
        for (i64 g = 0; g < G; g++) {
            i64 o = r * d + g * dg;
            for (i64 i = 0; i < dg; i++) v[i] = load(y, o + i, dt) * am_silu1(load(z, o + i, dt));
            normalize(v, dg, eps, sq);
            for (i64 i = 0; i < dg; i++) store(out, o + i, dt, load(w, g * dg + i, dt) * v[i]);
        }
}

/* -- conv1d.py ------------------------------------------------------------------------------------ */

/* conv1d._tap_sum (+ SiLU): out[t, c] = silu(0 + bias_c + w_c0 x_0 + ... + w_c(K-1) x_(K-1)), added
   in that order. taps [T, K, Cd] in dt; w [Cd, K] and bias [Cd] (optional) float32; out [T, Cd] in dt. */
static inline __attribute__((always_inline)) void tap_row(const void *taps, int dt, const float *w,
                                                           const float *bias, void *out, i64 t, i64 K, i64 Cd,
                                                           int activation, float *acc) {
    for (i64 c = 0; c < Cd; c++) acc[c] = 0.0f;
    if (bias)
        for (i64 c = 0; c < Cd; c++) acc[c] = acc[c] + bias[c];
    for (i64 k = 0; k < K; k++)
        for (i64 c = 0; c < Cd; c++) acc[c] = acc[c] + load(taps, (t * K + k) * Cd + c, dt) * w[c * K + k];
    for (i64 c = 0; c < Cd; c++) store(out, t * Cd + c, dt, activation ? am_silu1(acc[c]) : acc[c]);
}

/* scratch: Cd floats */
void am_tap_sum(const void *taps, int dt, const float *w, const float *bias, void *out, i64 T, i64 K, i64 Cd,
                int activation, float *scratch) {
    for (i64 t = 0; t < T; t++) {
        if (dt) tap_row(taps, 1, w, bias, out, t, K, Cd, activation, scratch);
        else tap_row(taps, 0, w, bias, out, t, K, Cd, activation, scratch);
    }
}

/* -- ssd/decode.py: the token's row tile ---------------------------------------------------------- */

/* Steps 1 and 2 of decode.replay_decode for S sequences, sequence i in slot slots[i] with its token
   at chunk row pos[i]. The tokens' rows, each contiguous, at row strides ldx, lddt, ldB, ldC: x
   [S, H * P], raw dt [S, H], B and C [S, G * N]. Writes x, dt and B into row pos[i] of the slot's
   buffers bx [slots, H, L, P], bdt [slots, H, L], bB [slots, G, L, N] (all in dtype dt; s_x, s_dt,
   s_B their slot strides in elements, each slot's block contiguous), then builds, float32:
   dtc [S, H, L] = dt_softplus(raw dt + dt_bias) (clamped to [lo, hi] if limit) up to the token,
   +0.0 past it; a [S, H, L] = cumsum(dtc * A) as torch.cumsum sums float32 on the CPU (each
   product rounded to float32, the running sum in double, each prefix rounded to float32); Cr
   [S, G, N] and xt [S, H, P], the tokens' C and x widened. */
static inline __attribute__((always_inline)) void decode_dt(const void *restrict bdt, int dt, i64 off, i64 n, float bias,
                                                             int limit, float lo, float hi, float *restrict out) {
    for (i64 s = 0; s < n; s++) out[s] = am_softplus1(load(bdt, off + s, dt) + bias, 20.0f);
    if (limit)
        for (i64 s = 0; s < n; s++) out[s] = clamp_hi(clamp_lo(out[s], lo), hi);
}

void am_decode_put(void *bx, void *bdt, void *bB, const void *x, i64 ldx, const void *dtn, i64 lddt,
                   const void *Bn, i64 ldB, const void *Cn, i64 ldC, int dt, i64 s_x, i64 s_dt, i64 s_B,
                   const i64 *slots, const i64 *pos, i64 S, i64 H, i64 G, i64 L, i64 P, i64 N, const float *dt_bias,
                   const float *A, int limit, float lo, float hi, float *dtc, float *a, float *Cr, float *xt) {
    i64 es = dt ? 2 : 4;
    for (i64 i = 0; i < S; i++) {
        i64 sl = slots[i], t = pos[i];
        for (i64 h = 0; h < H; h++) {
            memcpy((char *)bx + ((sl * s_x) + (h * L + t) * P) * es, (const char *)x + (i * ldx + h * P) * es,
                   (size_t)(P * es));
            memcpy((char *)bdt + (sl * s_dt + h * L + t) * es, (const char *)dtn + (i * lddt + h) * es, (size_t)es);
        }
        for (i64 g = 0; g < G; g++)
            memcpy((char *)bB + ((sl * s_B) + (g * L + t) * N) * es, (const char *)Bn + (i * ldB + g * N) * es,
                   (size_t)(N * es));
        for (i64 j = 0; j < G * N; j++) Cr[i * G * N + j] = load(Cn, i * ldC + j, dt);
        for (i64 j = 0; j < H * P; j++) xt[i * H * P + j] = load(x, i * ldx + j, dt);
        for (i64 h = 0; h < H; h++) {
            float *o = dtc + (i * H + h) * L, *ah = a + (i * H + h) * L;
            if (dt) decode_dt(bdt, 1, sl * s_dt + h * L, t + 1, dt_bias[h], limit, lo, hi, o);
            else decode_dt(bdt, 0, sl * s_dt + h * L, t + 1, dt_bias[h], limit, lo, hi, o);
            for (i64 s = t + 1; s < L; s++) o[s] = 0.0f;
            double acc = 0.0;
            for (i64 s = 0; s < L; s++) {
                acc += (double)(o[s] * A[h]);
                ah[s] = (float)acc;
            }
        }
    }
}

/* chunk.tile_outputs' elementwise work for one live row per tile (S tiles, the token's, of R rows):
   from a = cumsum(dtc * A) and dtc [S, H, L] and C.B, CB [S * G, Q, L], the intra GEMM's left
   operand, tiles [S * H, Q, L] ((C.B * decay) * dt in the live row, zero in the others), and the
   boundary state's decay e_in [S * H] = exp(a at the token). Q = R: whole tiles, the live row in
   its place (the "tiles" GEMMs); Q = 1: the live row alone (the lanes). */
void am_decode_scores(const float *a, const float *dtc, const float *CB, const i64 *pos, i64 S, i64 H, i64 G,
                      i64 L, i64 R, i64 Q, float *tiles, float *e_in) {
    const float neg_inf = bits_f32(0xFF800000u);
    i64 Hg = H / G;
    memset(tiles, 0, (size_t)(S * H * Q * L) * sizeof(float));
    for (i64 i = 0; i < S; i++) {
        i64 t = pos[i], live = t % R, t0 = t - live, q = Q == 1 ? 0 : live;
        for (i64 h = 0; h < H; h++) {
            const float *ah = a + (i * H + h) * L, *dh = dtc + (i * H + h) * L;
            const float *cb = CB + ((i * G + h / Hg) * Q + q) * L;
            float *row = tiles + ((i * H + h) * Q + q) * L;
            float a0 = ah[t0], aq = ah[t];
            float e_row = am_exp1(aq - a0);
            for (i64 s = 0; s < L; s++) {
                float decay;
                if (s >= t0 && s < t0 + R) decay = am_exp1(s - t0 <= live ? aq - ah[s] : neg_inf);
                else decay = e_row * am_exp1(s < t0 ? a0 - ah[s] : neg_inf);
                row[s] = (cb[s] * decay) * dh[s];
            }
            e_in[i * H + h] = am_exp1(aq);
        }
    }
}

/* The token's output row: (C.h_in * e_in + intra) + D x_t, y [S, H, P] float32. inter [S * G, Q, Hg * P]
   and intra [S * H, Q, P]: the GEMMs' outputs (Q as in am_decode_scores), the live row taken here;
   D [H] (d_per_p 0) or [H, P]; xt [S, H, P] the tokens' x, float32; y rounded to dtype ydt. */
void am_decode_combine(const float *inter, const float *intra, const float *e_in, const float *D, int d_per_p,
                       const float *xt_all, const i64 *pos, i64 S, i64 H, i64 G, i64 P, i64 R, i64 Q, void *y,
                       int ydt) {
    i64 Hg = H / G;
    for (i64 i = 0; i < S; i++) {
        i64 live = pos[i] % R, q = Q == 1 ? 0 : live;
        for (i64 h = 0; h < H; h++) {
            const float *ir = inter + ((i * G + h / Hg) * Q + q) * Hg * P + (h % Hg) * P;
            const float *tr = intra + ((i * H + h) * Q + q) * P;
            const float *xt = xt_all + (i * H + h) * P;
            float e = e_in[i * H + h];
            for (i64 p = 0; p < P; p++) {
                float d = D[d_per_p ? h * P + p : h];
                store(y, (i * H + h) * P + p, ydt, (ir[p] * e + tr[p]) + d * xt[p]);
            }
        }
    }
}

/* -- linear.py: the lane GEMM ---------------------------------------------------------------------- */

/* out[m, n] = sum over k of x[m, k] w[n, k] as linear.lane_matmul defines it: eight partial sums,
   lane j taking k = j, j + 8, ... in order (acc = acc + x w: the product rounded, then the sum),
   then the fixed tree ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)). Every output is its own
   chain, so a row's bits depend on neither M nor the blocking, and vectorising the lanes changes
   no lane's operations. Where the products are exact (bfloat16 x and w: 8 x 8 significant bits),
   a fused multiply-add rounds once, like the separate add: the same bits. */

typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

static inline float tree8(v8f l) {
    float b0 = l[0] + l[4], b1 = l[1] + l[5], b2 = l[2] + l[6], b3 = l[3] + l[7];
    return (b0 + b2) + (b1 + b3);
}

static inline v8f load8_f32(const float *p) { v8f v; memcpy(&v, p, sizeof v); return v; }
#ifdef __AVX2__
/* one 256-bit zero extension (the generic form compiles to two 128-bit halves and a merge) */
static inline v8f load8_bf16(const uint16_t *p) {
    __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    return (v8f)_mm256_castsi256_ps(u);
}
#else
static inline v8f load8_bf16(const uint16_t *p) {
    v8h h;
    memcpy(&h, p, sizeof h);
    v8u u = __builtin_convertvector(h, v8u) << 16;
    v8f v;
    memcpy(&v, &u, sizeof v);
    return v;
}
#endif
/* acc + x w with one rounding of the product and one of the sum; the fused form rounds once, which
   is the same where the product is exact */
static inline v8f madd(v8f acc, v8f x, v8f w) { return acc + x * w; }
static inline v8f fmadd(v8f acc, v8f x, v8f w) {
#ifdef __FMA__
    return __builtin_ia32_vfmaddps256(x, w, acc);
#else
    for (int j = 0; j < 8; j++) acc[j] = __builtin_fmaf(x[j], w[j], acc[j]);
    return acc;
#endif
}

#define LANE_BLOCK(NAME, WBF16, FMA, MR, NR)                                                          \
    static void NAME(const float *x, i64 ldx, const void *w, i64 ldw, float *out, i64 ldo, i64 KB) {  \
        v8f acc[MR][NR];                                                                               \
        for (int m = 0; m < MR; m++)                                                                   \
            for (int n = 0; n < NR; n++) acc[m][n] = (v8f){0, 0, 0, 0, 0, 0, 0, 0};                    \
        /* the next block's weight rows (contiguous after these), a share per step of k */             \
        const char *pf = (const char *)w + NR * ldw * (WBF16 ? 2 : 4);                                 \
        i64 pstep = (NR * ldw * (WBF16 ? 2 : 4) + KB - 1) / KB;                                        \
        for (i64 kb = 0; kb < KB; kb++) {                                                              \
            for (i64 o = 0; o < pstep; o += 64) __builtin_prefetch(pf + kb * pstep + o, 0, 0);         \
            v8f wv[NR];                                                                                \
            for (int n = 0; n < NR; n++)                                                               \
                wv[n] = WBF16 ? load8_bf16((const uint16_t *)w + n * ldw + kb * 8)                     \
                              : load8_f32((const float *)w + n * ldw + kb * 8);                        \
            for (int m = 0; m < MR; m++) {                                                             \
                v8f xm = load8_f32(x + m * ldx + kb * 8);                                              \
                for (int n = 0; n < NR; n++)                                                           \
                    acc[m][n] = FMA ? fmadd(acc[m][n], xm, wv[n]) : madd(acc[m][n], xm, wv[n]);        \
            }                                                                                          \
        }                                                                                              \
        for (int m = 0; m < MR; m++)                                                                   \
            for (int n = 0; n < NR; n++) out[m * ldo + n] = tree8(acc[m][n]);                          \
    }

/* One row: blocks of 8 columns. Several rows: column blocks outside, row quads (or pairs) inside, so
   a block of weight columns comes from memory once and from L1 for the other rows. */
#define LANE_FAMILY(P, WBF16, FMA)                                                                     \
    LANE_BLOCK(P##_4x2, WBF16, FMA, 4, 2)                                                              \
    LANE_BLOCK(P##_4x1, WBF16, FMA, 4, 1)                                                              \
    LANE_BLOCK(P##_2x4, WBF16, FMA, 2, 4)                                                              \
    LANE_BLOCK(P##_2x1, WBF16, FMA, 2, 1)                                                              \
    LANE_BLOCK(P##_1x8, WBF16, FMA, 1, 8)                                                              \
    LANE_BLOCK(P##_1x4, WBF16, FMA, 1, 4)                                                              \
    LANE_BLOCK(P##_1x1, WBF16, FMA, 1, 1)                                                              \
    static void P(const float *x, const void *w, float *out, i64 M, i64 N, i64 Kp, i64 ldo) {          \
        i64 KB = Kp / 8, M2 = M / 2 * 2;                                                               \
        size_t es = WBF16 ? 2 : 4;                                                                     \
        if (M == 1) {                                                                                  \
            i64 n = 0;                                                                                 \
            for (; n + 8 <= N; n += 8) P##_1x8(x, Kp, (const char *)w + n * Kp * es, Kp, out + n, ldo, KB);\
            for (; n < N; n++) P##_1x1(x, Kp, (const char *)w + n * Kp * es, Kp, out + n, ldo, KB);    \
            return;                                                                                    \
        }                                                                                              \
        i64 n = 0, M4 = M / 4 * 4;                                                                     \
        if (M4) {                                                                                      \
            for (; n + 2 <= N; n += 2) {                                                               \
                const char *wn = (const char *)w + n * Kp * es;                                        \
                for (i64 m = 0; m < M4; m += 4) P##_4x2(x + m * Kp, Kp, wn, Kp, out + m * ldo + n, ldo, KB);\
                for (i64 m = M4; m < M; m++) {                                                         \
                    P##_1x1(x + m * Kp, Kp, wn, Kp, out + m * ldo + n, ldo, KB);                       \
                    P##_1x1(x + m * Kp, Kp, wn + Kp * es, Kp, out + m * ldo + n + 1, ldo, KB);         \
                }                                                                                      \
            }                                                                                          \
            for (; n < N; n++) {                                                                       \
                const char *wn = (const char *)w + n * Kp * es;                                        \
                for (i64 m = 0; m < M4; m += 4) P##_4x1(x + m * Kp, Kp, wn, Kp, out + m * ldo + n, ldo, KB);\
                for (i64 m = M4; m < M; m++) P##_1x1(x + m * Kp, Kp, wn, Kp, out + m * ldo + n, ldo, KB);\
            }                                                                                          \
            return;                                                                                    \
        }                                                                                              \
        for (; n + 4 <= N; n += 4) {                                                                   \
            const char *wn = (const char *)w + n * Kp * es;                                            \
            for (i64 m = 0; m < M2; m += 2) P##_2x4(x + m * Kp, Kp, wn, Kp, out + m * ldo + n, ldo, KB);\
            if (M2 < M) P##_1x4(x + M2 * Kp, Kp, wn, Kp, out + M2 * ldo + n, ldo, KB);                 \
        }                                                                                              \
        for (; n < N; n++) {                                                                           \
            const char *wn = (const char *)w + n * Kp * es;                                            \
            for (i64 m = 0; m < M2; m += 2) P##_2x1(x + m * Kp, Kp, wn, Kp, out + m * ldo + n, ldo, KB);\
            if (M2 < M) P##_1x1(x + M2 * Kp, Kp, wn, Kp, out + M2 * ldo + n, ldo, KB);                 \
        }                                                                                              \
    }

LANE_FAMILY(lane_f32, 0, 0)
LANE_FAMILY(lane_f32_fma, 0, 1)
LANE_FAMILY(lane_bf16, 1, 0)
LANE_FAMILY(lane_bf16_fma, 1, 1)

/* -- a second thread -------------------------------------------------------------------------------

   The GEMMs below may hand part of their outputs to one worker thread. Each output is still one
   thread's chain, so the split changes no bit. One worker per process (made again after a fork);
   a call that finds it busy (another caller's) runs alone. */

typedef void (*part_fn)(void *ctx, i64 lo, i64 hi);

static struct {
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    pthread_mutex_t busy;
    pid_t pid;
    int pending, finished;
    part_fn fn;
    void *ctx;
    i64 lo, hi;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_MUTEX_INITIALIZER,
          0, 0, 0, NULL, NULL, 0, 0};

static void *pool_worker(void *arg) {
    (void)arg;
    pthread_mutex_lock(&pool.mu);
    for (;;) {
        while (!pool.pending) pthread_cond_wait(&pool.go, &pool.mu);
        part_fn fn = pool.fn;
        void *ctx = pool.ctx;
        i64 lo = pool.lo, hi = pool.hi;
        pool.pending = 0;
        pthread_mutex_unlock(&pool.mu);
        fn(ctx, lo, hi);
        pthread_mutex_lock(&pool.mu);
        pool.finished = 1;
        pthread_cond_signal(&pool.done);
    }
    return NULL;
}

/* fn(ctx, 0, split) here and fn(ctx, split, n) on the worker, or fn(ctx, 0, n) here alone. */
static void run_split(part_fn fn, void *ctx, i64 n, i64 split, int threads) {
    if (threads < 2 || split <= 0 || split >= n || pthread_mutex_trylock(&pool.busy) != 0) {
        fn(ctx, 0, n);
        return;
    }
    if (pool.pid != getpid()) {  /* first use in this process (a forked child has no worker) */
        pthread_t th;
        pthread_mutex_init(&pool.mu, NULL);
        pthread_cond_init(&pool.go, NULL);
        pthread_cond_init(&pool.done, NULL);
        pool.pending = 0;
        if (pthread_create(&th, NULL, pool_worker, NULL) != 0) {
            pthread_mutex_unlock(&pool.busy);
            fn(ctx, 0, n);
            return;
        }
        pthread_detach(th);
        pool.pid = getpid();
    }
    pthread_mutex_lock(&pool.mu);
    pool.fn = fn, pool.ctx = ctx, pool.lo = split, pool.hi = n;
    pool.finished = 0, pool.pending = 1;
    pthread_cond_signal(&pool.go);
    pthread_mutex_unlock(&pool.mu);
    fn(ctx, 0, split);
    pthread_mutex_lock(&pool.mu);
    while (!pool.finished) pthread_cond_wait(&pool.done, &pool.mu);
    pthread_mutex_unlock(&pool.mu);
    pthread_mutex_unlock(&pool.busy);
}

/* Work below which a call runs alone: waking the worker costs tens of microseconds, more than it
   saves on a decode step's GEMMs (a few million multiply-adds each), and in a vLLM engine its
   threads share the cores with the worker. */
#define SPLIT_MACS 33554432

typedef struct {  /* one call's operands, shared by the two threads (K: Kp for the lanes' [N, Kp] form) */
    const float *x;
    i64 sx;
    const void *w;
    i64 sw;
    int wbf16, exact;
    float *out;
    i64 M, N, K;
    const i64 *index, *klen;  /* the kn form's: each group's slot and term count, or NULL */
    i64 hb, sh;               /* its matrices per group and their stride in a slot */
} lane_job;

static void lane_part(const float *x, const void *w, int wbf16, int exact, float *out, i64 M, i64 N, i64 Kp,
                      i64 ldo) {
    if (wbf16 && exact) lane_bf16_fma(x, w, out, M, N, Kp, ldo);
    else if (wbf16) lane_bf16(x, w, out, M, N, Kp, ldo);
    else if (exact) lane_f32_fma(x, w, out, M, N, Kp, ldo);
    else lane_f32(x, w, out, M, N, Kp, ldo);
}

/* matrix b's w: (s, h) = (b / hb, b % hb) at row[s] * sw + h * sh elements, row[s] = index[s] (or s) */
static const char *lane_w(const lane_job *j, i64 b) {
    i64 s = b / j->hb;
    return (const char *)j->w + ((j->index ? j->index[s] : s) * j->sw + (b % j->hb) * j->sh) * (j->wbf16 ? 2 : 4);
}

static void lane_batches(void *ctx, i64 lo, i64 hi) {  /* matrices lo .. hi-1 */
    lane_job *j = ctx;
    for (i64 b = lo; b < hi; b++)
        lane_part(j->x + b * j->sx, lane_w(j, b), j->wbf16, j->exact, j->out + b * j->M * j->N, j->M, j->N, j->K, j->N);
}

static void lane_columns(void *ctx, i64 lo, i64 hi) {  /* one matrix, output columns lo .. hi-1 */
    lane_job *j = ctx;
    size_t es = j->wbf16 ? 2 : 4;
    lane_part(j->x, lane_w(j, 0) + lo * j->K * es, j->wbf16, j->exact, j->out + lo, j->M, hi - lo, j->K, j->N);
}

/* nb GEMMs: x [nb][M, Kp] float32 and w [N, Kp] matrices (float32, or bfloat16 if wbf16), both
   zero-padded to Kp, a multiple of 8, each matrix contiguous; x's batch stride sx in elements.
   Matrix b is (s, h) = (b / hb, b % hb), its w at row[s] * sw + h * sh elements, row[s] = index[s]
   (or s where index is NULL; sw = sh = 0: one matrix for all), so a slot-indexed state is read in
   place. out [nb][M, N] float32, contiguous. exact: every product is exact (bfloat16 values in
   both), so fused multiply-adds give the same bits. threads: 1, or 2 to let the worker take part
   of the outputs. */
void am_lane_gemm(const float *x, i64 sx, const void *w, i64 sw, const i64 *index, i64 hb, i64 sh, int wbf16,
                  float *out, i64 nb, i64 M, i64 N, i64 Kp, int exact, int threads) {
    lane_job job = {x, sx, w, sw, wbf16, exact, out, M, N, Kp, index, NULL, hb, sh};
    if (nb * M * N * Kp < SPLIT_MACS) threads = 1;
    if (nb == 1) run_split(lane_columns, &job, N, N / 16 * 8, threads);  /* a multiple of 8 columns each side */
    else run_split(lane_batches, &job, nb, nb / 2, threads);
}

/* The lanes with the right operand as [K, N] (N contiguous): out[b, m, n] = the lanes' sum over k of
   x[b, m, k] w[b, k, n], lane j taking k = j, j + 8, ... in order, the tree as tree8: each output the
   chain am_lane_gemm computes for w transposed, vectorised over n instead of over the lanes. x [nb][M, K]
   float32, w [nb][K, N] float32 or bfloat16; K past the last whole lane counts as zero-padded. Matrix b
   is (s, h) = (b / hb, b % hb): x at b * sx, w at row[s] * sw + h * sh elements, row[s] = index[s]
   (or s where index is NULL). klen (or NULL): its terms stop at k = klen[s], which is exact where
   x[b, :, k] is +0.0 and w[b, k] finite from there on (a +0.0 or -0.0 product added to a lane leaves
   it as it is: a lane starts at +0.0, and a sum of floats is -0.0 only where both addends are).
   out [nb][M, N] float32. */
static void kn_batches(void *ctx, i64 lo, i64 hi) {
    lane_job *j = ctx;
    i64 M = j->M, N = j->N, K = j->K, Kp = (K + 7) / 8 * 8;
    float *acc = malloc((size_t)(8 * N) * sizeof(float));
    if (!acc) return;
    for (i64 b = lo; b < hi; b++)
        for (i64 m = 0; m < M; m++) {
            const float *xm = j->x + b * j->sx + m * K;
            i64 sq = b / j->hb, wb = (j->index ? j->index[sq] : sq) * j->sw + (b % j->hb) * j->sh;
            i64 Ke = j->klen && j->klen[sq] < K ? j->klen[sq] : Kp;
            for (i64 i = 0; i < 8 * N; i++) acc[i] = 0.0f;
            for (i64 k = 0; k < Ke; k++) {
                float *a = acc + (k % 8) * N;
                if (k >= K) {
                    for (i64 n = 0; n < N; n++) a[n] = a[n] + 0.0f * 0.0f;
                    continue;
                }
                float xv = xm[k];
                if (j->wbf16) {
                    const uint16_t *wk = (const uint16_t *)j->w + wb + k * N;
                    if (j->exact)
                        for (i64 n = 0; n < N; n++) a[n] = __builtin_fmaf(xv, bf16_f32(wk[n]), a[n]);
                    else
                        for (i64 n = 0; n < N; n++) a[n] = a[n] + xv * bf16_f32(wk[n]);
                } else {
                    const float *wk = (const float *)j->w + wb + k * N;
                    if (j->exact)
                        for (i64 n = 0; n < N; n++) a[n] = __builtin_fmaf(xv, wk[n], a[n]);
                    else
                        for (i64 n = 0; n < N; n++) a[n] = a[n] + xv * wk[n];
                }
            }
            float *o = j->out + (b * M + m) * N;
            for (i64 n = 0; n < N; n++) {
                float b0 = acc[n] + acc[4 * N + n], b1 = acc[N + n] + acc[5 * N + n];
                float b2 = acc[2 * N + n] + acc[6 * N + n], b3 = acc[3 * N + n] + acc[7 * N + n];
                o[n] = (b0 + b2) + (b1 + b3);
            }
        }
    free(acc);
}

void am_lane_gemm_kn(const float *x, i64 sx, const void *w, i64 sw, const i64 *index, i64 hb, i64 sh, int wbf16,
                     float *out, i64 nb, i64 M, i64 N, i64 K, const i64 *klen, int exact, int threads) {
    lane_job job = {x, sx, w, sw, wbf16, exact, out, M, N, K, index, klen, hb, sh};
    run_split(kn_batches, &job, nb, nb / 2, nb * M * N * K < SPLIT_MACS ? 1 : threads);
}

/* linear.linear in the lanes' form, whole: x [M, K] (row stride ldx, dtype xdt) widened and
   zero-padded to Kp, the lanes against w [N, Kp] (bfloat16 if wbf16), then + bias (dtype bdt, or
   NULL) in float32 and one rounding to xdt: out [M, N]. exact: x and w both bfloat16. scratch:
   M * Kp + M * N floats. */
void am_linear(const void *x, int xdt, i64 ldx, const void *w, int wbf16, const void *bias, int bdt, void *out,
               i64 M, i64 N, i64 K, i64 Kp, int exact, float *scratch, int threads) {
    float *xp = scratch, *acc = scratch + M * Kp;
    for (i64 m = 0; m < M; m++)
        for (i64 k = 0; k < Kp; k++) xp[m * Kp + k] = k < K ? load(x, m * ldx + k, xdt) : 0.0f;
    am_lane_gemm(xp, 0, w, 0, NULL, 1, 0, wbf16, acc, 1, M, N, Kp, exact, threads);
    for (i64 m = 0; m < M; m++)
        for (i64 n = 0; n < N; n++) {
            float v = acc[m * N + n];
            if (bias) v = v + load(bias, n, bdt);
            store(out, m * N + n, xdt, v);
        }
}

/* conv1d.causal_conv1d_step for S sequences with their windows in place: taps = window[slot] ++ x
   (x [S, Cd] with row stride ldx), out [S, Cd] = the tap sum + SiLU (am_tap_sum), then
   window[slot] = taps[1:]. windows [slots, K-1, Cd] with slot stride sw, all in dtype dt; w [Cd, K]
   and bias [Cd] float32. scratch: K * Cd + Cd floats' room. */
void am_conv_step(void *windows, i64 sw, const i64 *slots, const void *x, i64 ldx, int dt, const float *w,
                  const float *bias, void *out, i64 S, i64 K, i64 Cd, int activation, float *scratch) {
    i64 es = dt ? 2 : 4;
    char *taps = (char *)scratch;
    float *acc = scratch + K * Cd;
    for (i64 i = 0; i < S; i++) {
        char *win = (char *)windows + slots[i] * sw * es;
        memcpy(taps, win, (size_t)((K - 1) * Cd * es));
        memcpy(taps + (K - 1) * Cd * es, (const char *)x + i * ldx * es, (size_t)(Cd * es));
        if (dt) tap_row(taps, 1, w, bias, (char *)out + i * Cd * es, 0, K, Cd, activation, acc);
        else tap_row(taps, 0, w, bias, (char *)out + i * Cd * es, 0, K, Cd, activation, acc);
        memcpy(win, taps + Cd * es, (size_t)((K - 1) * Cd * es));
    }
}

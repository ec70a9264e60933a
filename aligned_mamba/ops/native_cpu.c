/* The torch backend's position-invariant ops as single loops, for the CPU.

   Each function computes, element by element, the IEEE operations its torch form runs as whole-tensor
   ops (ops/elementwise.py, reduce.py, norm.py, conv1d.py), in the same order and with the same
   float32 roundings: one pass over memory instead of one per operation. Built with
   -ffp-contract=off and without fast-math, so the compiler neither fuses a multiply and an add nor
   reorders a sum; vectorising across elements changes no element's operations. The bits equal the
   torch forms' (tests/test_ops_native.py checks them against each other).

   Arrays are contiguous. dtype codes: 0 float32, 1 bfloat16 (stored as uint16, rounded to nearest
   even as torch rounds). */

#include <stdint.h>
#include <string.h>

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

/* weight * (normalised x rounded to the output dtype) (norm.rms_norm), rows of d.
   x [M, d] in dtype xdt; residual (optional, [M, d] in rdt): the fused residual add first
   (backend.add_norm: res_out = residual + x in rdt, then the norm of res_out rounded to odt);
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
                if (odt) xi = bf16_f32(f32_bf16(xi));  /* residual.to(dtype) */
            }
            v[i] = xi;
        }
        normalize(v, d, eps, sq);
        for (i64 i = 0; i < d; i++) {
            float y = odt ? bf16_f32(f32_bf16(v[i])) : v[i];
            store(out, r * d + i, odt, load(w, i, odt) * y);
        }
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
            for (i64 i = 0; i < dg; i++) {
                float gi = dt ? bf16_f32(f32_bf16(v[i])) : v[i];
                store(out, o + i, dt, load(w, g * dg + i, dt) * gi);
            }
        }
}

/* -- conv1d.py ------------------------------------------------------------------------------------ */

/* conv1d._tap_sum (+ SiLU): out[t, c] = silu(0 + bias_c + w_c0 x_0 + ... + w_c(K-1) x_(K-1)), added
   in that order. taps [T, K, Cd] in dt; w [Cd, K] and bias [Cd] (optional) float32; out [T, Cd] in dt. */
void am_tap_sum(const void *taps, int dt, const float *w, const float *bias, void *out, i64 T, i64 K, i64 Cd,
                int activation) {
    for (i64 t = 0; t < T; t++)
        for (i64 c = 0; c < Cd; c++) {
            float acc = 0.0f;
            if (bias) acc = acc + bias[c];
            for (i64 k = 0; k < K; k++) acc = acc + load(taps, (t * K + k) * Cd + c, dt) * w[c * K + k];
            store(out, t * Cd + c, dt, activation ? am_silu1(acc) : acc);
        }
}

/* The encoder of `encoder.c` on 256-bit registers, for CPUs without AVX-512: included twice by
   `encoder256.c`, once for AVX2 (+ FMA) and once for AVX-VNNI, each time inside a
   `#pragma GCC target` of its own, with SUFFIX naming its functions and VNNI choosing the product.

   The products are `encoder.c`'s, bit for bit: the same int8 rounding of each group of 32
   activations, the same record layout (a 64-byte chunk holds 4 inputs' 4-bit weights for 16 output
   rows; here each half, 8 rows, is one 32-byte load), the same integer sums. Without VNNI, vpmaddubsw
   multiplies the unsigned 4-bit weights with the signed int8 activations, summing pairs into int16:
   a pair is at most 2 * 15 * 127 = 3,810 in magnitude, so a group's 8 such products (32 inputs) sum
   to at most 30,480 and stay exact in int16; one vpmaddwd by ones per group then widens them to
   int32 (llama.cpp's trick: the widening once a group, not once a product). With AVX-VNNI, vpdpbusd
   does both at once, as `encoder.c` does on 512 bits. Rows go 4 to a pass over a tile, not 8: 16
   registers hold 4 rows' sums and the tile's weights. */

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SUFFIX)
#define P_ROWS 4

static inline float
FN(hsum)(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float
FN(hmax)(__m256 v)
{
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* x [m, k] -> int8 x_q per group of 32 (to nearest, as `quantize8`), each group's scale, and
   -8 * sum(x_q) */
static void
FN(quantize8)(const float *x, int64_t m, int64_t k, int8_t *xq, float *scale, int32_t *offset)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t i = 0; i < m * k / E_GROUP; i++) {
        const float *g = x + i * E_GROUP;
        const __m256 a0 = _mm256_loadu_ps(g), a1 = _mm256_loadu_ps(g + 8);
        const __m256 a2 = _mm256_loadu_ps(g + 16), a3 = _mm256_loadu_ps(g + 24);
        const float top = FN(hmax)(_mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a0), _mm256_andnot_ps(sign, a1)),
                                                 _mm256_max_ps(_mm256_andnot_ps(sign, a2), _mm256_andnot_ps(sign, a3))));
        const float d = top / 127.0f, inverse = d > 0 ? 1.0f / d : 0.0f;
        const __m256 inv = _mm256_set1_ps(inverse);
        const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(a0, inv)), q1 = _mm256_cvtps_epi32(_mm256_mul_ps(a1, inv));
        const __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(a2, inv)), q3 = _mm256_cvtps_epi32(_mm256_mul_ps(a3, inv));
        /* packs work within 128-bit lanes: the permutation puts the 4-byte runs back in order */
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
        _mm256_storeu_si256((__m256i *)(xq + i * E_GROUP), _mm256_permutevar8x32_epi32(packed, order));
        const __m256i total = _mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3));
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
        scale[i] = d;
        offset[i] = -8 * _mm_cvtsi128_si32(s);
    }
}

/* Output rows j0 .. j0 + 15 of y (bias added) for `rows` rows of quantized x: one half of the tile
   (8 output rows) after the other. */
static inline __attribute__((always_inline)) void
FN(tile8)(const int8_t *xq, const float *xs, const int32_t *offset, int64_t k, const uint8_t *w, const float *bias,
          float *y, int64_t n, int64_t j0, const int rows)
{
    const int64_t groups = k / E_GROUP;
    const uint8_t *tile = w + j0 / E_TILE * groups * E_RECORD;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
#if !VNNI
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    for (int half = 0; half < 2; half++) {
        __m256 acc[P_ROWS];
        for (int r = 0; r < rows; r++)
            acc[r] = bias ? _mm256_loadu_ps(bias + j0 + 8 * half) : _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *b = tile + g * E_RECORD;
            __m256i sums[P_ROWS];
            for (int r = 0; r < rows; r++)
#if VNNI
                sums[r] = _mm256_set1_epi32(offset[r * groups + g]);
#else
                sums[r] = _mm256_setzero_si256(); /* int16 pairs here, widened after the group */
#endif
            for (int h = 0; h < 4; h++) {
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * half));
                const __m256i first = _mm256_and_si256(bytes, low4);
                const __m256i second = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
                for (int r = 0; r < rows; r++) {
                    const int32_t *quads = (const int32_t *)(xq + r * k + g * E_GROUP);
                    const __m256i x0 = _mm256_set1_epi32(quads[2 * h]), x1 = _mm256_set1_epi32(quads[2 * h + 1]);
#if VNNI
                    sums[r] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(sums[r], first, x0), second, x1);
#else
                    sums[r] = _mm256_add_epi16(sums[r], _mm256_add_epi16(_mm256_maddubs_epi16(first, x0),
                                                                         _mm256_maddubs_epi16(second, x1)));
#endif
                }
            }
            const __m256 d = _mm256_loadu_ps((const float *)(b + 256) + 8 * half);
            for (int r = 0; r < rows; r++) {
#if VNNI
                const __m256i total = sums[r];
#else
                const __m256i total = _mm256_add_epi32(_mm256_madd_epi16(sums[r], ones),
                                                       _mm256_set1_epi32(offset[r * groups + g]));
#endif
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, _mm256_set1_ps(xs[r * groups + g])),
                                         acc[r]);
            }
        }
        for (int r = 0; r < rows; r++)
            _mm256_storeu_ps(y + r * n + j0 + 8 * half, acc[r]);
    }
}

/* `matmul8` on 256 bits: tile by tile of the output, every pass of (at most 4) rows over it. */
static void
FN(matmul8)(const float *x, int64_t m, int64_t k, const uint8_t *w, const float *bias, float *y, int64_t n,
            void *scratch)
{
    int8_t *xq = (int8_t *)scratch;
    float *xs = (float *)(xq + m * k);
    int32_t *offset = (int32_t *)(xs + m * k / E_GROUP);
    FN(quantize8)(x, m, k, xq, xs, offset);
    const int64_t groups = k / E_GROUP, passes = (m + P_ROWS - 1) / P_ROWS;
    for (int64_t j = 0; j < n; j += E_TILE)
        for (int64_t p = 0; p < passes; p++) {
            const int64_t r0 = m * p / passes, rows = m * (p + 1) / passes - r0;
            const int8_t *q = xq + r0 * k;
            const float *s = xs + r0 * groups;
            const int32_t *sum = offset + r0 * groups;
            float *out = y + r0 * n;
            switch (rows) {
            case 1: FN(tile8)(q, s, sum, k, w, bias, out, n, j, 1); break;
            case 2: FN(tile8)(q, s, sum, k, w, bias, out, n, j, 2); break;
            case 3: FN(tile8)(q, s, sum, k, w, bias, out, n, j, 3); break;
            default: FN(tile8)(q, s, sum, k, w, bias, out, n, j, 4); break;
            }
        }
}

/* e^x for x <= ~88 (`exp16`'s polynomial; 2^n built in the exponent bits, x clamped at -87 so n
   stays a normal exponent) */
static inline __m256
FN(exp8)(__m256 x)
{
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.693147180559945309f));
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* `gelu` (the same erf approximation), 8 lanes at a time */
static void
FN(gelu)(float *x, int64_t count)
{
    const __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f), sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < count; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const __m256 z = _mm256_mul_ps(v, _mm256_set1_ps(0.70710678118654752f));
        const __m256 a = _mm256_andnot_ps(sign, z);
        const __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(a, _mm256_set1_ps(0.3275911f), one));
        __m256 p = _mm256_set1_ps(1.061405429f);
        p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-1.453152027f));
        p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.421413741f));
        p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-0.284496736f));
        p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.254829592f));
        p = _mm256_mul_ps(p, t);
        const __m256 erf_a = _mm256_fnmadd_ps(p, FN(exp8)(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(a, a))), one);
        const __m256 erf_z = _mm256_or_ps(erf_a, _mm256_and_ps(z, sign));
        _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_mul_ps(v, half), _mm256_add_ps(one, erf_z)));
    }
}

/* `add_norm`: x = LayerNorm(x + add) per row of `hidden` (a multiple of 8); `add` may be NULL */
static void
FN(add_norm)(float *x, const float *add, const float *weight, const float *bias, int64_t rows, int64_t hidden,
             float eps)
{
    for (int64_t t = 0; t < rows; t++) {
        float *row = x + t * hidden;
        __m256 sum = _mm256_setzero_ps();
        for (int64_t i = 0; i < hidden; i += 8) {
            __m256 v = _mm256_loadu_ps(row + i);
            if (add)
                v = _mm256_add_ps(v, _mm256_loadu_ps(add + t * hidden + i));
            _mm256_storeu_ps(row + i, v);
            sum = _mm256_add_ps(sum, v);
        }
        const __m256 mean = _mm256_set1_ps(FN(hsum)(sum) / (float)hidden);
        __m256 var = _mm256_setzero_ps();
        for (int64_t i = 0; i < hidden; i += 8) {
            const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(row + i), mean);
            var = _mm256_fmadd_ps(d, d, var);
        }
        const __m256 inverse = _mm256_set1_ps(1.0f / sqrtf(FN(hsum)(var) / (float)hidden + eps));
        for (int64_t i = 0; i < hidden; i += 8) {
            const __m256 d = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(row + i), mean), inverse);
            _mm256_storeu_ps(row + i, _mm256_fmadd_ps(d, _mm256_loadu_ps(weight + i), _mm256_loadu_ps(bias + i)));
        }
    }
}

/* `attend_segments` (head dim 32: four registers a vector) */
static void
FN(attend_segments)(const float *qkv, int64_t hidden, int64_t heads, const int64_t *segments, int64_t num_segments,
                    float *out, float *scores)
{
    const int64_t width = 3 * hidden, dim = hidden / heads;
    const __m256 scale = _mm256_set1_ps(1.0f / sqrtf((float)dim));
    for (int64_t s = 0; s < num_segments; s++) {
        const int64_t begin = segments[s], end = segments[s + 1], length = end - begin;
        for (int64_t t = begin; t < end; t++)
            for (int64_t h = 0; h < heads; h++) {
                const float *q = qkv + t * width + h * dim;
                const __m256 q0 = _mm256_mul_ps(_mm256_loadu_ps(q), scale), q1 = _mm256_mul_ps(_mm256_loadu_ps(q + 8), scale);
                const __m256 q2 = _mm256_mul_ps(_mm256_loadu_ps(q + 16), scale);
                const __m256 q3 = _mm256_mul_ps(_mm256_loadu_ps(q + 24), scale);
                float best = -INFINITY;
                for (int64_t u = 0; u < length; u++) {
                    const float *key = qkv + (begin + u) * width + hidden + h * dim;
                    const __m256 a = _mm256_fmadd_ps(q1, _mm256_loadu_ps(key + 8), _mm256_mul_ps(q0, _mm256_loadu_ps(key)));
                    const __m256 b = _mm256_fmadd_ps(q3, _mm256_loadu_ps(key + 24),
                                                     _mm256_mul_ps(q2, _mm256_loadu_ps(key + 16)));
                    scores[u] = FN(hsum)(_mm256_add_ps(a, b));
                    best = scores[u] > best ? scores[u] : best;
                }
                const __m256 top = _mm256_set1_ps(best);
                float total = 0;
                int64_t u = 0;
                for (; u + 8 <= length; u += 8) {
                    const __m256 e = FN(exp8)(_mm256_sub_ps(_mm256_loadu_ps(scores + u), top));
                    _mm256_storeu_ps(scores + u, e);
                    total += FN(hsum)(e);
                }
                for (; u < length; u++) {
                    scores[u] = expf(scores[u] - best);
                    total += scores[u];
                }
                const float norm = 1.0f / total;
                __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
                for (u = 0; u < length; u++) {
                    const float *value = qkv + (begin + u) * width + 2 * hidden + h * dim;
                    const __m256 p = _mm256_set1_ps(scores[u] * norm);
                    a0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(value), a0);
                    a1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(value + 8), a1);
                    a2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(value + 16), a2);
                    a3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(value + 24), a3);
                }
                float *o = out + t * hidden + h * dim;
                _mm256_storeu_ps(o, a0), _mm256_storeu_ps(o + 8, a1), _mm256_storeu_ps(o + 16, a2), _mm256_storeu_ps(o + 24, a3);
            }
    }
}

/* `e5_encode` on this path */
int
FN(e5_encode)(float *x, int64_t rows, const int64_t *segments, int64_t num_segments, const struct e5_layer *layers,
              const struct e5_shape *s)
{
    const int64_t hidden = s->hidden, inter = s->inter;
    if (s->heads <= 0 || hidden / s->heads != 32 || hidden % E_GROUP || inter % E_GROUP || (3 * hidden) % E_TILE
        || inter % E_TILE)
        return -1;
    int64_t longest = 1;
    for (int64_t i = 0; i < num_segments; i++)
        longest = segments[i + 1] - segments[i] > longest ? segments[i + 1] - segments[i] : longest;
    const int64_t widest = inter > 3 * hidden ? inter : 3 * hidden;
    float *wide = malloc(sizeof(float) * (size_t)(rows * widest));
    float *narrow = malloc(sizeof(float) * (size_t)(rows * hidden));
    float *context = malloc(sizeof(float) * (size_t)(rows * hidden));
    float *scores = malloc(sizeof(float) * (size_t)longest);
    void *scratch = malloc((size_t)(rows * inter) + sizeof(float) * (size_t)(2 * rows * inter / E_GROUP));
    int status = wide && narrow && context && scores && scratch ? 0 : -1;
    for (int64_t l = 0; !status && l < s->layers; l++) {
        const struct e5_layer *layer = layers + l;
        FN(matmul8)(x, rows, hidden, layer->qkv, layer->qkv_bias, wide, 3 * hidden, scratch);
        FN(attend_segments)(wide, hidden, s->heads, segments, num_segments, context, scores);
        FN(matmul8)(context, rows, hidden, layer->out, layer->out_bias, narrow, hidden, scratch);
        FN(add_norm)(x, narrow, layer->attn_norm_w, layer->attn_norm_b, rows, hidden, s->eps);
        FN(matmul8)(x, rows, hidden, layer->up, layer->up_bias, wide, inter, scratch);
        FN(gelu)(wide, rows * inter);
        FN(matmul8)(wide, rows, inter, layer->down, layer->down_bias, narrow, hidden, scratch);
        FN(add_norm)(x, narrow, layer->ffn_norm_w, layer->ffn_norm_b, rows, hidden, s->eps);
    }
    free(wide), free(narrow), free(context), free(scores), free(scratch);
    return status;
}

/* `e5_norm` on this path */
void
FN(e5_norm)(float *x, int64_t rows, int64_t hidden, const float *weight, const float *bias, float eps)
{
    FN(add_norm)(x, 0, weight, bias, rows, hidden, eps);
}

#undef P_ROWS
#undef FN
#undef CAT
#undef CAT_

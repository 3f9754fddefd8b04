/* kvgate's CPU kernels for the engine's decode step (loaded with ctypes by `kernels.py`; built by
   setup.py as an optional extension; AVX-512F, checked by `q4_supported`, else the engine
   keeps its torch path). No Python API, so no Python headers.

   q4_matmul: y = x @ W.T for 4-bit weights and float32 activations ("int4-f32"); q4_matmul16,
   the same with activations rounded to int16 ("int4", below: "Products with int16 activations").

   W is held in groups of 32 weights along the input dimension, each weight = q * d + m with q in
   0..15 and a scale d and minimum m per group: Q4_1, the grid SmolLM2's GGUF file ships. A block
   holds two groups of one output row: 32 bytes of q, then d0, m0, d1, m1 as float32 (48 bytes).
   16-bit word i of the 32 bytes holds, in its nibble t, q of the block's weight 16 t + i; widened
   to 32-bit lanes and shifted right by 4 t bits, the block gives 16 weights in order as the
   indices of a vpermps (which reads the low 4 bits of each lane) into the group's 16 possible
   weights, q * d + m for q = 0..15. Each group is so de-quantized in registers, once per output
   row and call, and multiplied with every activation row in float32: the result is the float32
   product up to summation order.

   Blocks are laid out in the order the kernel reads them: for each tile of COLS output rows, the
   first block of each of its rows, then the second, and so on, so that a tile is one sequential
   stream. Decoding one token reads every weight once, and at one thread the de-quantizing, not
   the memory, is what limits it: float32 scales (24 bytes a group, read by a broadcast load) beat
   GGUF's float16 ones (20 bytes, but converted and shuffled into place) by ~25% in one and two
   threads, and one stream per output row was ~15% slower. */

#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 32
#define COLS 4 /* output rows computed together: independent accumulator chains */
#define ROWS 4 /* activation rows per pass over the weights */
#define BLOCK_BYTES 48 /* two groups: 32 bytes of 4-bit values, then d0, m0, d1, m1 as float32 */
#define BLOCK_BYTES_8 72 /* two Q8_0 groups: 64 bytes of 8-bit values, then d0, d1 as float32 */

/* One tile: output rows j0 .. j0 + COLS - 1 for the first `rows` rows of x, from 4-bit blocks
   (above) or, with bits 8, Q8_0's: 64 bytes of signed 8-bit q for two groups, then d0, d1 as
   float32 (72 bytes), weight = q * d. Inlined with constant `rows` and `bits`, so the accumulators
   live in registers. */
static inline __attribute__((always_inline, target("avx512f"))) void
tile(const float *x, int64_t k, const uint8_t *w, float *y, int64_t n, int64_t j0, const int rows, const int bits)
{
    const int64_t pairs = k / (2 * GROUP), block_bytes = bits == 4 ? BLOCK_BYTES : BLOCK_BYTES_8;
    const __m512 steps = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 acc[COLS * ROWS];
    for (int i = 0; i < COLS * rows; i++)
        acc[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const float *xp = x + p * 2 * GROUP;
        for (int c = 0; c < COLS; c++) {
            const uint8_t *block = w + ((j0 / COLS * pairs + p) * COLS + c) * block_bytes;
            for (int t = 0; t < 2; t++) {
                __m512 w0, w1;
                if (bits == 4) {
                    const __m512i packed = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)block));
                    const float *dm = (const float *)(block + 32);
                    /* the group's 16 possible weights, then each weight looked up by its 4-bit
                       value (vpermps reads the low 4 bits of each lane) */
                    const __m512 values = _mm512_fmadd_ps(steps, _mm512_set1_ps(dm[2 * t]), _mm512_set1_ps(dm[2 * t + 1]));
                    w0 = _mm512_permutexvar_ps(_mm512_srli_epi32(packed, 8 * t), values);
                    w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(packed, 8 * t + 4), values);
                } else {
                    const __m512 d = _mm512_set1_ps(((const float *)(block + 64))[t]);
                    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                        _mm_loadu_si128((const __m128i *)(block + 32 * t)))), d);
                    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                        _mm_loadu_si128((const __m128i *)(block + 32 * t + 16)))), d);
                }
                for (int r = 0; r < rows; r++) {
                    const float *xr = xp + r * k + t * GROUP;
                    acc[c * rows + r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[c * rows + r]);
                    acc[c * rows + r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc[c * rows + r]);
                }
            }
        }
    }
    for (int c = 0; c < COLS; c++)
        for (int r = 0; r < rows; r++)
            y[r * n + j0 + c] = _mm512_reduce_add_ps(acc[c * rows + r]);
}

#define TILES(rows)                                     \
    for (int64_t j = j_begin; j < j_end; j += COLS)         \
        if (bits == 4)                                      \
            tile(x, k, w, y, n, j, rows, 4);                \
        else                                                \
            tile(x, k, w, y, n, j, rows, 8)

/* Output rows [j_begin, j_end) of y [m, n] for every activation row of x [m, k]. */
__attribute__((target("avx512f"))) static void
span(const float *x, int64_t m, int64_t k, const uint8_t *w, int bits, float *y, int64_t n,
     int64_t j_begin, int64_t j_end)
{
    for (int64_t r0 = 0; r0 < m; r0 += ROWS, x += ROWS * k, y += ROWS * n) {
        switch (m - r0 < ROWS ? m - r0 : ROWS) {
        case 1: TILES(1); break;
        case 2: TILES(2); break;
        case 3: TILES(3); break;
        default: TILES(4); break;
        }
    }
}

/* ---- Products with int16 activations (AVX-512 VNNI) ------------------------------------------

   With float32 activations a product costs one multiply-add lane per weight and row, which bounds
   a batch of rows (16 lanes a cycle here). With each row's group of 32 activations rounded to int16
   on its own scale (absmax / 32767: 15 bits, against bfloat16's 8), vpdpwssd multiplies two int16
   pairs per 32-bit lane, twice the lanes, the integer sums exact; a group's sum is scaled to float32
   once per row and 16 output rows: sum(x w) = s_x d sum(x_q q) + m sum(x), the last sum from the
   float32 activations. Greedy decoding agrees with float32 on every one of `kvgate bench engine`'s
   50 prompts.

   Layout ("int16 layout"): tiles of 16 output rows, each group of 32 along the input for the 16
   rows as one record. 4-bit (Q4_1): 8 chunks of 32 bytes, byte 2 j + p of chunk c holding in its
   low nibble q of output row j at input 4 c + p and in its high nibble the one at 4 c + 2 + p
   (widened to int16 lanes, the low nibbles are the pairs for inputs 4 c, 4 c + 1 and the high ones
   for 4 c + 2, 4 c + 3, lane j per output row); then d and m for the 16 rows as float32 (384 bytes).
   8-bit (Q8_0): 16 chunks of 32 signed bytes, chunk v for inputs 2 v, 2 v + 1 the same way, then d
   (576 bytes). */

#define TILE16 16
#define ROWS16 8
#define RECORD_Q4 384
#define RECORD_Q8 576

/* x [m, k] -> int16 x_q, each group's scale and float32 sum ([m, k / 32]) */
__attribute__((target("avx512f,avx512bw"))) static void
quantize16(const float *x, int64_t m, int64_t k, int16_t *xq, float *scale, float *sum)
{
    for (int64_t i = 0; i < m * k / GROUP; i++) {
        const __m512 a = _mm512_loadu_ps(x + i * GROUP), b = _mm512_loadu_ps(x + i * GROUP + 16);
        const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        sum[i] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
        scale[i] = top / 32767.0f;
        const __m512 inverse = _mm512_set1_ps(top > 0 ? 32767.0f / top : 0.0f);
        _mm256_storeu_si256((__m256i *)(xq + i * GROUP), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(a, inverse))));
        _mm256_storeu_si256((__m256i *)(xq + i * GROUP + 16), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(b, inverse))));
    }
}

/* Output rows j0 .. j0 + 15 for `rows` rows of quantized x. With few rows, each row sums into four
   independent chains (the multiply-add's latency), else two. */
static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vnni"))) void
tile16(const int16_t *xq, const float *xs, const float *xsum, int64_t k, const uint8_t *w, float *y, int64_t n,
       int64_t j0, const int rows, const int bits)
{
    const int64_t groups = k / GROUP, record = bits == 4 ? RECORD_Q4 : RECORD_Q8;
    const int chains = rows <= 2 ? 4 : 2;
    const __m512i low4 = _mm512_set1_epi16(0x0F);
    const uint8_t *tile = w + j0 / TILE16 * groups * record;
    __m512 acc[ROWS16];
    for (int r = 0; r < rows; r++)
        acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *b = tile + g * record;
        __m512i sums[ROWS16][4];
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < chains; c++)
                sums[r][c] = _mm512_setzero_si512();
        for (int c = 0; c < 8; c++) {
            __m512i first, second;
            if (bits == 4) {
                const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 32 * c)));
                first = _mm512_and_si512(bytes, low4);
                second = _mm512_srli_epi16(bytes, 4);
            } else {
                first = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(b + 64 * c)));
                second = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(b + 64 * c + 32)));
            }
            const int chain = chains == 4 ? 2 * (c & 1) : 0;
            for (int r = 0; r < rows; r++) {
                const int32_t *pairs = (const int32_t *)(xq + r * k + g * GROUP);
                sums[r][chain] = _mm512_dpwssd_epi32(sums[r][chain], first, _mm512_set1_epi32(pairs[2 * c]));
                sums[r][chain + 1] = _mm512_dpwssd_epi32(sums[r][chain + 1], second, _mm512_set1_epi32(pairs[2 * c + 1]));
            }
        }
        const __m512 d = _mm512_loadu_ps((const float *)(b + (bits == 4 ? 256 : 512)));
        for (int r = 0; r < rows; r++) {
            __m512i total = _mm512_add_epi32(sums[r][0], sums[r][1]);
            if (chains == 4)
                total = _mm512_add_epi32(total, _mm512_add_epi32(sums[r][2], sums[r][3]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(d, _mm512_set1_ps(xs[r * groups + g])),
                                     acc[r]);
            if (bits == 4)
                acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps((const float *)(b + 320)),
                                         _mm512_set1_ps(xsum[r * groups + g]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++)
        _mm512_storeu_ps(y + r * n + j0, acc[r]);
}

#define TILES16(rows)                                                      \
    for (int64_t j = j_begin; j < j_end; j += TILE16)                      \
        if (bits == 4)                                                     \
            tile16(xq, xs, xsum, k, w, y, n, j, rows, 4);                  \
        else                                                               \
            tile16(xq, xs, xsum, k, w, y, n, j, rows, 8)

/* Output rows [j_begin, j_end) of y [m, n] from quantized x (`quantize16`). */
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void
span16(const int16_t *xq, const float *xs, const float *xsum, int64_t m, int64_t k, const uint8_t *w, int bits,
       float *y, int64_t n, int64_t j_begin, int64_t j_end)
{
    const int64_t groups = k / GROUP;
    for (int64_t r0 = 0; r0 < m; r0 += ROWS16, xq += ROWS16 * k, xs += ROWS16 * groups, xsum += ROWS16 * groups,
                 y += ROWS16 * n) {
        switch (m - r0 < ROWS16 ? m - r0 : ROWS16) {
        case 1: TILES16(1); break;
        case 2: TILES16(2); break;
        case 3: TILES16(3); break;
        case 4: TILES16(4); break;
        case 5: TILES16(5); break;
        case 6: TILES16(6); break;
        case 7: TILES16(7); break;
        default: TILES16(8); break;
        }
    }
}

/* Helper threads: each waits for a new job generation, runs its share of the output rows, and
   counts itself done. The caller runs the first share itself. Waiting spins a little, then sleeps
   on a condition variable, so idle helpers cost nothing between decode steps. */

#define MAX_THREADS 64
#define SPIN 20000

struct job {
    const float *x;
    int64_t m, k;
    const uint8_t *w;
    int bits, act16; /* weight bits; activations as int16 (the int16 layout) or float32 */
    float *y;
    int64_t n;
    int parts;
    const int16_t *xq; /* act16: x quantized (`quantize16`) */
    const float *xs, *xsum;
};

static struct job current;
static atomic_long generation;
static atomic_int pending;
static int helpers;
static long born[MAX_THREADS];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t busy = PTHREAD_MUTEX_INITIALIZER; /* held by the call the helpers work for */
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;

static void
run_part(const struct job *job, int part)
{
    /* whole tiles to each part */
    const int64_t width = job->act16 ? TILE16 : COLS, tiles = (job->n + width - 1) / width;
    const int64_t begin = tiles * part / job->parts * width;
    int64_t end = tiles * (part + 1) / job->parts * width;
    if (end > job->n)
        end = job->n;
    if (begin >= end)
        return;
    if (job->act16)
        span16(job->xq, job->xs, job->xsum, job->m, job->k, job->w, job->bits, job->y, job->n, begin, end);
    else
        span(job->x, job->m, job->k, job->w, job->bits, job->y, job->n, begin, end);
}

static void *
helper_main(void *arg)
{
    const int part = (int)(intptr_t)arg;
    long seen = born[part]; /* the generation when it was started: jobs before it are not its own */
    for (;;) {
        long now = atomic_load_explicit(&generation, memory_order_acquire);
        for (int spin = 0; now == seen && spin < SPIN; spin++) {
            _mm_pause();
            now = atomic_load_explicit(&generation, memory_order_acquire);
        }
        if (now == seen) {
            pthread_mutex_lock(&lock);
            while ((now = atomic_load_explicit(&generation, memory_order_acquire)) == seen)
                pthread_cond_wait(&wake, &lock);
            pthread_mutex_unlock(&lock);
        }
        seen = now;
        if (part < current.parts)
            run_part(&current, part);
        atomic_fetch_sub_explicit(&pending, 1, memory_order_acq_rel);
    }
    return 0;
}

/* Non-zero if this CPU runs the kernels (AVX-512F). */
int
q4_supported(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}

/* Non-zero if it runs the int16-activation ones too (AVX-512 BW and VNNI). */
int
act16_supported(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vnni");
}

static void
matmul(const float *x, int64_t m, int64_t k, const uint8_t *w, int bits, int act16, float *y, int64_t n, int threads)
{
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    struct job job = {x, m, k, w, bits, act16, y, n, 1, 0, 0, 0};
    int16_t *xq = 0;
    if (act16) {
        const int64_t groups = m * k / GROUP;
        xq = malloc(m * k * sizeof(int16_t) + 2 * groups * sizeof(float));
        float *xs = (float *)(xq + m * k);
        quantize16(x, m, k, xq, xs, xs + groups);
        job.xq = xq, job.xs = xs, job.xsum = xs + groups;
    }
    if (threads <= 1 || n < 64 * threads || pthread_mutex_trylock(&busy) != 0) {
        run_part(&job, 0);
        free(xq);
        return;
    }
    while (helpers < threads - 1) {
        pthread_t thread;
        born[helpers + 1] = atomic_load_explicit(&generation, memory_order_acquire);
        if (pthread_create(&thread, 0, helper_main, (void *)(intptr_t)(helpers + 1)) != 0)
            break;
        pthread_detach(thread);
        helpers++;
    }
    if (threads > helpers + 1)
        threads = helpers + 1;
    job.parts = threads;
    current = job;
    atomic_store_explicit(&pending, helpers, memory_order_release);
    pthread_mutex_lock(&lock);
    atomic_fetch_add_explicit(&generation, 1, memory_order_acq_rel);
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&lock);
    run_part(&current, 0);
    while (atomic_load_explicit(&pending, memory_order_acquire) > 0)
        _mm_pause();
    pthread_mutex_unlock(&busy);
    free(xq);
}

/* y [m, n] = x [m, k] @ W.T, W as `w`: 4-bit blocks (above); k a multiple of 64, n of COLS.
   `threads` parts of the output rows run at once: the caller's thread and threads - 1 helpers,
   started on first use. A call made while another holds the helpers (KV Fuse on the restore
   thread beside the model thread) runs on its caller's thread alone. */
void
q4_matmul(const float *x, int64_t m, int64_t k, const uint8_t *w, float *y, int64_t n, int threads)
{
    matmul(x, m, k, w, 4, 0, y, n, threads);
}

/* The same with Q8_0 blocks (`tile`): SmolLM2's vocabulary head ships as Q8_0. */
void
q8_matmul(const float *x, int64_t m, int64_t k, const uint8_t *w, float *y, int64_t n, int threads)
{
    matmul(x, m, k, w, 8, 0, y, n, threads);
}

/* The same from the int16 layout (above): activations rounded to int16 per group of 32; k a
   multiple of 32, n of 16. */
void
q4_matmul16(const float *x, int64_t m, int64_t k, const uint8_t *w, float *y, int64_t n, int threads)
{
    matmul(x, m, k, w, 4, 1, y, n, threads);
}

void
q8_matmul16(const float *x, int64_t m, int64_t k, const uint8_t *w, float *y, int64_t n, int threads)
{
    matmul(x, m, k, w, 8, 1, y, n, threads);
}

/* ---- One decoder layer for a batch of decoding sequences (one new token each) ----------------

   What `lean.py`'s forward does for a Llama layer, for rows that each decode one token: RMSNorm,
   the Q/K/V product, RoPE, the new K/V row written into the sequence's pool slot, attention over
   the slot's rows up to the token (each row its own length, no padding), the output product and
   residual, RMSNorm, gate/up, SiLU, down and residual. In torch that is ~20 operator calls a layer
   whose dispatch costs more than their arithmetic at one token; here it is one call. Float32
   throughout, as the torch path; exp is a polynomial within a few float32 ulps. */

#define MAX_DIM 256

/* e^x for x <= ~88 (2^(x log2 e), the fraction by its Taylor series to degree 7: relative error
   below 1e-8 before rounding) */
static inline __attribute__((always_inline, target("avx512f"))) __m512
exp512(__m512 x)
{
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

/* out = x / sqrt(mean(x^2) + eps) * weight, one row of `hidden` (a multiple of 16) */
__attribute__((target("avx512f"))) static void
rms_norm(const float *x, const float *weight, float eps, int64_t hidden, float *out)
{
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < hidden; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        sum = _mm512_fmadd_ps(v, v, sum);
    }
    const __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(sum) / (float)hidden + eps));
    for (int64_t i = 0; i < hidden; i += 16)
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), scale),
                                                _mm512_loadu_ps(weight + i)));
}

/* x[i] * cos[i] + x[(i + dim / 2) % dim] * signed_sin[i]: rotate_half's RoPE, as lean.py */
static void
rope(float *x, const float *cos, const float *signed_sin, int64_t dim)
{
    float rotated[MAX_DIM];
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < dim; i++)
        rotated[i] = x[i] * cos[i] + x[(i + half) % dim] * signed_sin[i];
    for (int64_t i = 0; i < dim; i++)
        x[i] = rotated[i];
}

/* softmax(q . K[:length] / sqrt(dim)) @ V[:length] for one head; K, V rows of `dim` (a multiple
   of 16) floats; `scores` holds `length` floats rounded up to 16 */
__attribute__((target("avx512f"))) static void
attend(const float *q, const float *keys, const float *values, int64_t length, int64_t dim, float *scores,
       float *out)
{
    const float scale = 1.0f / sqrtf((float)dim);
    float best = -INFINITY;
    for (int64_t t = 0; t < length; t++) {
        __m512 dot = _mm512_setzero_ps();
        for (int64_t i = 0; i < dim; i += 16)
            dot = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(keys + t * dim + i), dot);
        scores[t] = _mm512_reduce_add_ps(dot) * scale;
        best = scores[t] > best ? scores[t] : best;
    }
    const __m512 top = _mm512_set1_ps(best);
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < length; t += 16) {
        const __mmask16 live = length - t >= 16 ? 0xFFFF : (__mmask16)((1u << (length - t)) - 1);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, scores + t), top));
        _mm512_mask_storeu_ps(scores + t, live, e);
        total = _mm512_add_ps(total, _mm512_maskz_mov_ps(live, e));
    }
    const float norm = 1.0f / _mm512_reduce_add_ps(total);
    __m512 acc[MAX_DIM / 16];
    for (int64_t i = 0; i < dim / 16; i++)
        acc[i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < length; t++) {
        const __m512 p = _mm512_set1_ps(scores[t]);
        for (int64_t i = 0; i < dim / 16; i++)
            acc[i] = _mm512_fmadd_ps(p, _mm512_loadu_ps(values + t * dim + 16 * i), acc[i]);
    }
    for (int64_t i = 0; i < dim / 16; i++)
        _mm512_storeu_ps(out + 16 * i, _mm512_mul_ps(acc[i], _mm512_set1_ps(norm)));
}

/* lane u = the sum of v[u]'s 16 lanes: pairs of vectors folded together, halving the lanes each
   holds per key, four times (45 shuffles and adds for 16 sums, against ~8 each alone) */
static inline __attribute__((always_inline, target("avx512f"))) __m512
sum_lanes16(const __m512 v[16])
{
    __m512 pairs[8], quads[4], halves[2];
    for (int i = 0; i < 8; i++) /* each 128-bit lane: v[2i]'s partial sums at 0 and 2, v[2i + 1]'s at 1 and 3 */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* each 128-bit lane: keys 4i .. 4i + 3, one partial sum each */
        quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                                 _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++) /* 128-bit lanes 0, 1: quads[2i]'s (halves), 2, 3: quads[2i + 1]'s */
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                                  _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                         _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

/* `attend` for dim 64 (SmolLM2's heads), its vectors in registers: the scores two multiply-add
   chains a key, the weighted sum of values over four sets of accumulators (one set, updated once a
   key, made the latency of a multiply-add the time per key: most of a decode step at 16 rows). */
__attribute__((target("avx512f"))) static void
attend64(const float *q, const float *keys, const float *values, int64_t length, float *scores, float *out)
{
    const __m512 scale = _mm512_set1_ps(0.125f); /* 1 / sqrt(64) */
    const __m512 q0 = _mm512_mul_ps(_mm512_loadu_ps(q), scale), q1 = _mm512_mul_ps(_mm512_loadu_ps(q + 16), scale);
    const __m512 q2 = _mm512_mul_ps(_mm512_loadu_ps(q + 32), scale), q3 = _mm512_mul_ps(_mm512_loadu_ps(q + 48), scale);
    __m512 highest = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= length; t += 16) { /* 16 keys' products, summed across lanes together */
        __m512 dots[16];
        for (int u = 0; u < 16; u++) {
            const float *k = keys + (t + u) * 64;
            const __m512 a = _mm512_fmadd_ps(q1, _mm512_loadu_ps(k + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(k)));
            const __m512 b = _mm512_fmadd_ps(q3, _mm512_loadu_ps(k + 48), _mm512_mul_ps(q2, _mm512_loadu_ps(k + 32)));
            dots[u] = _mm512_add_ps(a, b);
        }
        const __m512 sums = sum_lanes16(dots);
        _mm512_storeu_ps(scores + t, sums);
        highest = _mm512_max_ps(highest, sums);
    }
    float best = _mm512_reduce_max_ps(highest);
    for (; t < length; t++) {
        const float *k = keys + t * 64;
        const __m512 a = _mm512_fmadd_ps(q1, _mm512_loadu_ps(k + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(k)));
        const __m512 b = _mm512_fmadd_ps(q3, _mm512_loadu_ps(k + 48), _mm512_mul_ps(q2, _mm512_loadu_ps(k + 32)));
        scores[t] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
        best = scores[t] > best ? scores[t] : best;
    }
    const __m512 top = _mm512_set1_ps(best);
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < length; t += 16) {
        const __mmask16 live = length - t >= 16 ? 0xFFFF : (__mmask16)((1u << (length - t)) - 1);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, scores + t), top));
        _mm512_mask_storeu_ps(scores + t, live, e);
        total = _mm512_add_ps(total, _mm512_maskz_mov_ps(live, e));
    }
    __m512 acc[4][4];
    for (int u = 0; u < 4; u++)
        for (int i = 0; i < 4; i++)
            acc[u][i] = _mm512_setzero_ps();
    for (t = 0; t + 4 <= length; t += 4)
        for (int u = 0; u < 4; u++) {
            const __m512 p = _mm512_set1_ps(scores[t + u]);
            for (int i = 0; i < 4; i++)
                acc[u][i] = _mm512_fmadd_ps(p, _mm512_loadu_ps(values + (t + u) * 64 + 16 * i), acc[u][i]);
        }
    for (; t < length; t++) {
        const __m512 p = _mm512_set1_ps(scores[t]);
        for (int i = 0; i < 4; i++)
            acc[0][i] = _mm512_fmadd_ps(p, _mm512_loadu_ps(values + t * 64 + 16 * i), acc[0][i]);
    }
    const __m512 norm = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
    for (int i = 0; i < 4; i++)
        _mm512_storeu_ps(out + 16 * i, _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(acc[0][i], acc[1][i]),
                                                                   _mm512_add_ps(acc[2][i], acc[3][i])), norm));
}

/* gate_up [2 * inter] -> silu(gate) * up [inter] (inter a multiple of 16) */
__attribute__((target("avx512f"))) static void
silu_mul(const float *gate_up, int64_t inter, float *out)
{
    for (int64_t i = 0; i < inter; i += 16) {
        const __m512 g = _mm512_loadu_ps(gate_up + i);
        const __m512 sig = _mm512_div_ps(_mm512_set1_ps(1.0f),
                                         _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(g, sig), _mm512_loadu_ps(gate_up + inter + i)));
    }
}

struct layer {
    const float *attn_norm, *mlp_norm;
    const uint8_t *qkv, *out, *gate_up, *down; /* int4 weights as q4_matmul (or, with act16, q4_matmul16) reads them */
    float *keys, *values;                      /* this layer's pool: [slots, kv_heads, capacity, dim] */
};

struct shape {
    int64_t hidden, heads, kv_heads, dim, inter, capacity;
    int64_t act16; /* the weights in the int16 layout, products with int16 activations */
    float eps;
};

/* One layer for `rows` decoding sequences: x [rows, hidden] (the residual stream, updated in
   place); row b is the token at `positions[b]` of the sequence in pool slot `slots[b]`, with
   `cos`/`signed_sin` [rows, dim] for its position. `work` holds rows * (hidden + (heads + 2 *
   kv_heads) * dim + heads * dim + 3 * inter) + capacity + 16 floats. Returns 0, or -1 for a shape
   it does not handle (dims not multiples of 16, head_dim above MAX_DIM). */
__attribute__((target("avx512f"))) int
q4_decode_layer(float *x, int64_t rows, const struct layer *layer, const struct shape *s, const float *cos,
                const float *signed_sin, const int64_t *slots, const int64_t *positions, float *work, int threads)
{
    const int64_t hidden = s->hidden, dim = s->dim, q_width = s->heads * dim, kv_width = s->kv_heads * dim;
    const int64_t qkv_width = q_width + 2 * kv_width, group = s->heads / s->kv_heads;
    if (hidden % 16 || dim % 16 || dim > MAX_DIM || s->inter % 16 || s->heads % s->kv_heads)
        return -1;
    float *normed = work, *qkv = normed + rows * hidden, *attn = qkv + rows * qkv_width;
    float *gate_up = attn + rows * q_width, *act = gate_up + rows * 2 * s->inter, *scores = act + rows * s->inter;

    for (int64_t b = 0; b < rows; b++)
        rms_norm(x + b * hidden, layer->attn_norm, s->eps, hidden, normed + b * hidden);
    matmul(normed, rows, hidden, layer->qkv, 4, (int)s->act16, qkv, qkv_width, threads);
    for (int64_t b = 0; b < rows; b++) {
        float *row = qkv + b * qkv_width;
        for (int64_t h = 0; h < s->heads + s->kv_heads; h++)  /* the query heads, then the key heads */
            rope(row + h * dim, cos + b * dim, signed_sin + b * dim, dim);
        for (int64_t g = 0; g < s->kv_heads; g++) {
            const int64_t at = ((slots[b] * s->kv_heads + g) * s->capacity + positions[b]) * dim;
            memcpy(layer->keys + at, row + q_width + g * dim, dim * sizeof(float));
            memcpy(layer->values + at, row + q_width + kv_width + g * dim, dim * sizeof(float));
        }
        for (int64_t h = 0; h < s->heads; h++) {
            const int64_t base = (slots[b] * s->kv_heads + h / group) * s->capacity * dim;
            if (dim == 64)
                attend64(row + h * dim, layer->keys + base, layer->values + base, positions[b] + 1, scores,
                         attn + b * q_width + h * dim);
            else
                attend(row + h * dim, layer->keys + base, layer->values + base, positions[b] + 1, dim, scores,
                       attn + b * q_width + h * dim);
        }
    }
    matmul(attn, rows, q_width, layer->out, 4, (int)s->act16, normed, hidden, threads);
    for (int64_t i = 0; i < rows * hidden; i++)
        x[i] += normed[i];
    for (int64_t b = 0; b < rows; b++)
        rms_norm(x + b * hidden, layer->mlp_norm, s->eps, hidden, normed + b * hidden);
    matmul(normed, rows, hidden, layer->gate_up, 4, (int)s->act16, gate_up, 2 * s->inter, threads);
    for (int64_t b = 0; b < rows; b++)
        silu_mul(gate_up + b * 2 * s->inter, s->inter, act + b * s->inter);
    matmul(act, rows, s->inter, layer->down, 4, (int)s->act16, normed, hidden, threads);
    for (int64_t i = 0; i < rows * hidden; i++)
        x[i] += normed[i];
    return 0;
}

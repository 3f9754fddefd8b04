/* The encoder (`encoder.c`) for CPUs without AVX-512: `encoder256.h` built twice, for AVX2 + FMA
   (`e5_encode_avx2`) and for AVX-VNNI (`e5_encode_avxvnni`, vpdpbusd on 256 bits: Intel since
   Alder Lake, AMD since Zen 5). `e5.py` picks one at run time (`encoder_paths`); none of these
   functions runs before its CPU check. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "encoder.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define SUFFIX _avx2
#define VNNI 0
#include "encoder256.h"
#undef SUFFIX
#undef VNNI
#pragma GCC pop_options

/* AVX-VNNI needs GCC 11 or clang 12; an older compiler builds the other paths, not none. */
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define HAVE_AVXVNNI 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,avxvnni")
#define SUFFIX _avxvnni
#define VNNI 1
#include "encoder256.h"
#undef SUFFIX
#undef VNNI
#pragma GCC pop_options
#else
#define HAVE_AVXVNNI 0
int
e5_encode_avxvnni(void)
{
    return -1;
}

void
e5_norm_avxvnni(void)
{
}
#endif

/* Which encoder paths this CPU runs: bit 0 AVX-512 (F, BW, VNNI: `e5_encode`), bit 1 AVX-VNNI
   (`e5_encode_avxvnni`), bit 2 AVX2 + FMA (`e5_encode_avx2`). */
int
encoder_paths(void)
{
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vnni");
#if HAVE_AVXVNNI
    const int avxvnni = avx2 && __builtin_cpu_supports("avxvnni");
#else
    const int avxvnni = 0;
#endif
    return (avx512 ? 1 : 0) | (avxvnni ? 2 : 0) | (avx2 ? 4 : 0);
}

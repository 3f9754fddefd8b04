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

#pragma GCC push_options
#pragma GCC target("avx2,fma,avxvnni")
#define SUFFIX _avxvnni
#define VNNI 1
#include "encoder256.h"
#undef SUFFIX
#undef VNNI
#pragma GCC pop_options

/* Which encoder paths this CPU runs: bit 0 AVX-512 (F, BW, VNNI: `e5_encode`), bit 1 AVX-VNNI
   (`e5_encode_avxvnni`), bit 2 AVX2 + FMA (`e5_encode_avx2`). */
int
encoder_paths(void)
{
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vnni");
    return (avx512 ? 1 : 0) | (avx2 && __builtin_cpu_supports("avxvnni") ? 2 : 0) | (avx2 ? 4 : 0);
}

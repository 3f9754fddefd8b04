/* What the encoder's paths share (`encoder.c`: AVX-512; `encoder256.c`: AVX2 and AVX-VNNI): the
   record layout's sizes and the structures `responsecache/semantic/e5.py` hands them. */

#ifndef KVGATE_ENCODER_H
#define KVGATE_ENCODER_H

#include <stdint.h>

#define E_GROUP 32
#define E_TILE 16
#define E_RECORD 320

struct e5_layer {
    const uint8_t *qkv, *out, *up, *down; /* records (encoder.c) */
    const float *qkv_bias, *out_bias, *up_bias, *down_bias;
    const float *attn_norm_w, *attn_norm_b, *ffn_norm_w, *ffn_norm_b;
};

struct e5_shape {
    int64_t hidden, heads, inter, layers;
    float eps;
};

#endif

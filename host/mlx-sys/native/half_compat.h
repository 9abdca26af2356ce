/* For bindgen on non-aarch64 targets: mlx-c declares its float16/bfloat16
 * accessors only where the C compiler has __fp16/__bf16. mlx-rs needs them
 * everywhere; half_accessors.cpp implements them on 16-bit storage. */
#include <stdint.h>
typedef uint16_t float16_t;
typedef uint16_t bfloat16_t;
#define HAS_FLOAT16
#define HAS_BFLOAT16

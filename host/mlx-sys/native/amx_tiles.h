// What mlxhost's AMX kernels (amx_matmul.cpp, prefill_attention_amx.cpp)
// share: whether AMX code is compiled here, and the one tile configuration
// both use.
#pragma once

#if defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>

#include <cstdint>

#define MLXHOST_AMX 1

namespace mlxhost_cpu {

// Loads palette 1 with all 8 tiles at 16 rows x 64 bytes: 16 x 32 bfloat16
// operands (A: rows x K; B: K / 2 pairs x 16 columns) and 16 x 16 float32
// accumulators. Per thread; pair with `_tile_release()`.
__attribute__((target("amx-tile"))) inline void configure_tiles_16x64() {
  struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; t++) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

} // namespace mlxhost_cpu
#endif

// float16/bfloat16 accessors that mlx-c defines only on aarch64 (see
// half_compat.h). Values are passed as their IEEE 16-bit storage.
#include <cstdint>
#include <cstring>
#include <exception>

#include "mlx/c/error.h"
#include "mlx/c/private/array.h"

extern "C" int mlx_array_item_float16(uint16_t* res, const mlx_array arr) {
  try {
    auto v = mlx_array_get_(arr).item<mlx::core::float16_t>();
    std::memcpy(res, &v, sizeof(uint16_t));
  } catch (std::exception& e) {
    mlx_error(e.what());
    return 1;
  }
  return 0;
}

extern "C" int mlx_array_item_bfloat16(uint16_t* res, const mlx_array arr) {
  try {
    auto v = mlx_array_get_(arr).item<mlx::core::bfloat16_t>();
    std::memcpy(res, &v, sizeof(uint16_t));
  } catch (std::exception& e) {
    mlx_error(e.what());
    return 1;
  }
  return 0;
}

extern "C" const uint16_t* mlx_array_data_float16(const mlx_array arr) {
  try {
    return reinterpret_cast<const uint16_t*>(mlx_array_get_(arr).data<mlx::core::float16_t>());
  } catch (std::exception& e) {
    mlx_error(e.what());
    return nullptr;
  }
}

extern "C" const uint16_t* mlx_array_data_bfloat16(const mlx_array arr) {
  try {
    return reinterpret_cast<const uint16_t*>(mlx_array_get_(arr).data<mlx::core::bfloat16_t>());
  } catch (std::exception& e) {
    mlx_error(e.what());
    return nullptr;
  }
}

// A census of the unevaluated graph behind some arrays: how many primitives
// of each kind an `eval` of them would run. Each primitive is one kernel
// launch on a GPU backend (views such as Reshape, Slice and Broadcast cost
// none when their input is contiguous), so the census says where a decode
// step's launches go; `mlxhost bench --census` prints it.
//
// Output: "Name count\n" lines, most frequent first, written into `buf`
// (truncated to `len - 1` bytes, always NUL-terminated). Returns the total
// number of primitives, or -1 after reporting an error through mlx-c.

#include <algorithm>
#include <cstdio>
#include <exception>
#include <map>
#include <string>
#include <unordered_set>
#include <vector>

#include "mlx/c/error.h"
#include "mlx/c/private/array.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

extern "C" int mlxhost_graph_census(
    const mlx_array* arrays,
    int count,
    char* buf,
    int len) {
  try {
    std::vector<mx::array> stack;
    for (int i = 0; i < count; i++)
      stack.push_back(mlx_array_get_(arrays[i]));
    std::unordered_set<std::uintptr_t> seen_arrays;
    std::unordered_set<std::uintptr_t> seen_primitives;
    std::map<std::string, int> kinds;
    int total = 0;
    while (!stack.empty()) {
      mx::array a = stack.back();
      stack.pop_back();
      if (!seen_arrays.insert(a.id()).second)
        continue;
      if (!a.has_primitive() || a.is_available())
        continue;
      // Siblings (multi-output primitives) share one primitive: one launch.
      if (seen_primitives.insert(a.primitive_id()).second) {
        kinds[a.primitive().name()]++;
        total++;
      }
      for (const auto& in : a.inputs())
        stack.push_back(in);
    }
    std::vector<std::pair<std::string, int>> sorted(kinds.begin(), kinds.end());
    std::stable_sort(sorted.begin(), sorted.end(), [](auto& x, auto& y) {
      return x.second > y.second;
    });
    std::string text;
    for (const auto& [name, n] : sorted)
      text += name + " " + std::to_string(n) + "\n";
    if (len > 0) {
      const size_t n = std::min(text.size(), size_t(len - 1));
      std::copy(text.begin(), text.begin() + n, buf);
      buf[n] = '\0';
    }
    return total;
  } catch (const std::exception& e) {
    mlx_error(e.what());
    return -1;
  }
}

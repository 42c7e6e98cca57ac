// The rows of x of a GEMM path in near-equal groups of at most a register tile's rows, each
// group run by the tile instantiated for its row count (float_matmul.cc's packed tiles and
// quant_matmul.cc's weight-only GEMM): 64 rows at 12 a tile are 11, 11, 11, 11, 10, 10,
// where 5 x 12 + 4 would leave a 4-row tile that loads each weight for a third of the work.
#pragma once

#include <cstdint>
#include <type_traits>

namespace xlm {

// fn(std::integral_constant<int, R>{}) with R = rows, clamped to [1, kMax]: a group's row
// count as the tile's template argument.
template <int kMax, class Fn>
inline void WithRows(int64_t rows, Fn&& fn) {
  if constexpr (kMax > 1) {
    if (rows < kMax) return WithRows<kMax - 1>(rows, fn);
  }
  fn(std::integral_constant<int, kMax>{});
}

// fn(r, R) for each group [r, r + R) of m rows, at most kMax rows a group, all within one
// row of each other, R a compile-time constant (WithRows).
template <int kMax, class Fn>
inline void ForRowGroups(int64_t m, Fn&& fn) {
  const int64_t groups = (m + kMax - 1) / kMax;
  for (int64_t g = 0, r = 0; g < groups; ++g) {
    const int64_t rows = m / groups + (g < m % groups ? 1 : 0);
    WithRows<kMax>(rows, [&](auto mr) { fn(r, mr); });
    r += rows;
  }
}

}  // namespace xlm

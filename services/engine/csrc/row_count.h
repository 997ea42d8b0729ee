// A run-time row count as a compile-time one, for the CPU kernels' register tiles.
#pragma once

#include <cstdint>

// tile.operator()<r>() for r = rows (1 <= r <= MaxRows) as a compile-time count: each row count
// runs a micro-kernel of its own, unrolled for its rows.
template <int MaxRows, typename Tile>
inline void for_row_count(int64_t rows, const Tile& tile) {
  if constexpr (MaxRows > 1) {
    if (rows >= MaxRows) return tile.template operator()<MaxRows>();
    return for_row_count<MaxRows - 1>(rows, tile);
  } else {
    return tile.template operator()<1>();
  }
}

// The CPU kernels' tuning knobs and test hooks. They come from Python's fastcl.config (one
// typed configuration, read from the environment once: docs/configuration.md) through the op
// fastcl::set_cpu_options, whenever that configuration changes; nothing here reads the
// environment.
#pragma once

#include <atomic>
#include <cstdint>
#include <string_view>

namespace fastcl::cpu {

enum class Gemm : int { kAuto = 0, kOwn = 1, kMkl = 2 };

struct Options {
  std::atomic<int64_t> tile{0};                          // a row block's [H, N] element budget; 0: automatic
  std::atomic<int> gemm{static_cast<int>(Gemm::kAuto)};  // step 1's GEMM (lse_cpu.cpp, own_gemm_wanted)
  // test hooks (cpp.test_*: tests and measurements cross edges with them)
  std::atomic<int64_t> test_rows{0};         // force the row-block height H; 0: automatic
  std::atomic<int64_t> test_chunk{0};        // cap every GEMM call's candidates; 0: no cap
  std::atomic<int64_t> test_keep_bytes{-1};  // largest block buffer kept between calls; -1: 16 MiB, 0: none
};

// The one instance, shared by every translation unit of the library.
inline Options& options() {
  static Options instance;
  return instance;
}

// fastcl::set_cpu_options(tile, gemm, test_rows, test_chunk, test_keep_bytes): refuses a value it
// cannot honour (a negative tile, an unknown GEMM, "own" without the AVX-512 build, a test hook
// out of range) with a RuntimeError, keeping the old ones.
void set_options(int64_t tile, std::string_view gemm, int64_t test_rows, int64_t test_chunk, int64_t test_keep_bytes);

}  // namespace fastcl::cpu

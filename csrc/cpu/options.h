// The CPU kernels' tuning knobs. They come from Python's fastcl.config (one typed
// configuration, read from the environment once: docs/configuration.md) through the op
// fastcl::set_cpu_options, whenever that configuration changes; nothing here reads the
// environment. (Test hooks that only tests set are environment variables read per call by
// env_int, checks.h: _FASTCL_TEST_CPP_ROWS, _FASTCL_TEST_CPP_CHUNK, _FASTCL_TEST_CPP_KEEP_BYTES.)
#pragma once

#include <atomic>
#include <cstdint>
#include <string_view>

namespace fastcl::cpu {

enum class Gemm : int { kAuto = 0, kOwn = 1, kMkl = 2 };

struct Options {
  std::atomic<int64_t> tile{0};                          // a row block's [H, N] element budget; 0: automatic
  std::atomic<int> gemm{static_cast<int>(Gemm::kAuto)};  // step 1's GEMM (lse_cpu.cpp, own_gemm_wanted)
};

// The one instance, shared by every translation unit of the library.
inline Options& options() {
  static Options instance;
  return instance;
}

// fastcl::set_cpu_options(tile, gemm): refuses a value it cannot honour (a negative tile, an
// unknown GEMM, "own" without the AVX-512 build) with a RuntimeError, keeping the old ones.
void set_options(int64_t tile, std::string_view gemm);

}  // namespace fastcl::cpu

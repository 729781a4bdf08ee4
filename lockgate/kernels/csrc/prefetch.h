// A software-prefetch cursor that spreads the next tile's bytes over the current tile's steps.
//
// The matmul kernels walk their weights tile by tile; the hardware prefetchers start on a tile's
// streams only after its first misses, so a tile that is not fetched ahead begins at memory
// latency. Each thread therefore fetches its next tile's bytes while it multiplies the current
// one: the cursor holds up to three byte ranges (the next tile's weights or codes, then its up
// blocks or its scales, then its offsets), and each step() of the current tile issues `lines`
// prefetches of the next lines, range after range, so that the whole next tile is on its way by
// the time the current one ends (``spread(steps)`` sets `lines` for a tile of that many steps).
// The ranges are plain fields and step() a chain of compares: it runs once per column pair of
// every register block of lockgate's bf16 matmul, where an indexed loop cost measurable time.
//
// Invariants: a prefetch never changes what is computed (the cursor only issues hints, never
// loads); an empty cursor (or one whose ranges are used up) makes step() three compares; the
// bytes of each range are fetched front to back, each 64-byte line once.
#pragma once

#include <algorithm>
#include <cstdint>

namespace lockgate {

struct TilePrefetch {
  static constexpr int64_t kLine = 64;
  const char* at = nullptr;
  const char* end = nullptr;
  const char* at2 = nullptr;  // taken after the first range
  const char* end2 = nullptr;
  const char* at3 = nullptr;  // and this after the second
  const char* end3 = nullptr;
  int64_t lines = 1;  // lines per step()

  // Adds [p, p + bytes) after the ranges already held (ignored when bytes <= 0 or three are held).
  void add(const void* p, int64_t bytes) {
    if (bytes <= 0) return;
    const char* c = static_cast<const char*>(p);
    if (at == nullptr) {
      at = c, end = c + bytes;
    } else if (at2 == nullptr) {
      at2 = c, end2 = c + bytes;
    } else if (at3 == nullptr) {
      at3 = c, end3 = c + bytes;
    }
  }

  int64_t bytes() const { return (end - at) + (end2 - at2) + (end3 - at3); }

  // As many lines per step as fetch every byte held within `steps` steps.
  void spread(int64_t steps) {
    const int64_t need = (bytes() + kLine - 1) / kLine;
    lines = std::max<int64_t>(1, (need + steps - 1) / std::max<int64_t>(steps, 1));
  }

  inline void step() {
    for (int64_t i = 0; i < lines; ++i) {
      if (at < end) {
        __builtin_prefetch(at, 0, 2);  // read, into L2 and up (_MM_HINT_T1)
        at += kLine;
      } else if (at2 < end2) {
        __builtin_prefetch(at2, 0, 2);
        at2 += kLine;
      } else if (at3 < end3) {
        __builtin_prefetch(at3, 0, 2);
        at3 += kLine;
      } else {
        return;
      }
    }
  }
};

}  // namespace lockgate

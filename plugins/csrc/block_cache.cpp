// A CPU allocator for torch that keeps freed large blocks for reuse (kiln.plugins.block_cache installs it).
//
// Why: glibc serves every allocation above its mmap threshold (at most 32 MB) with a fresh mmap and unmaps it on
// free, so each prefill step's largest activations ([tokens, 2 x ffn] out of gate_up: 46 MB in fp32 at 2048 tokens
// on the 246m) arrive as untouched pages, and the GEMM that writes them first takes a page fault and a zeroed page
// per 4 KiB, in both threads at once. Measured on a 2-core Zen 5 (docs/benchmarks.md, "Large blocks"), the fault
// path cost 25-38 ms of a 5632x1024 fp32 GEMM's 75 ms at M = 2048. Tensors of at least min_bytes are served from
// blocks freed earlier (the best fit within 25% slack, sizes rounded up to 2 MiB); freed ones are kept up to
// cap_bytes in all, the oldest returned to glibc first. Smaller tensors go to torch's default CPU allocator as
// before (with its profiler reporting; the cached blocks are not reported to the memory profiler).

#include "kiln_kernels.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <algorithm>
#include <cstdint>
#include <list>
#include <mutex>
#include <unordered_map>

namespace {

constexpr size_t GRANULE = size_t(2) << 20;  // 2 MiB: step sizes that differ by a few tokens share a block

class BlockCache final : public c10::Allocator {
 public:
  explicit BlockCache(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    if (n < min_bytes_) return base_->allocate(n);
    const size_t need = (n + GRANULE - 1) / GRANULE * GRANULE;
    void* p = nullptr;
    size_t size = need;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto best = free_.end();
      for (auto it = free_.begin(); it != free_.end(); ++it)
        if (it->size >= need && it->size <= need + need / 4 && (best == free_.end() || it->size < best->size)) best = it;
      if (best != free_.end()) {
        p = best->ptr;
        size = best->size;
        cached_ -= size;
        free_.erase(best);
        ++hits_;
      } else {
        ++misses_;
      }
    }
    if (p == nullptr) p = c10::alloc_cpu(size);
    {
      std::lock_guard<std::mutex> g(mu_);
      live_[p] = size;
    }
    return {p, p, &release_any, c10::Device(c10::DeviceType::CPU)};
  }

  // Every pointer this allocator hands out, large or small (raw_allocate gives small ones from base_).
  c10::DeleterFnPtr raw_deleter() const override { return &release_any; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void configure(size_t cap, size_t min_bytes) {
    std::lock_guard<std::mutex> g(mu_);
    cap_ = cap;
    min_bytes_ = std::max<size_t>(min_bytes, 1);
    trim_locked(0);
  }

  void stats(int64_t* out) {
    std::lock_guard<std::mutex> g(mu_);
    out[0] = int64_t(cap_);
    out[1] = int64_t(min_bytes_);
    out[2] = int64_t(cached_);
    out[3] = int64_t(free_.size());
    out[4] = int64_t(hits_);
    out[5] = int64_t(misses_);
  }

  static BlockCache* instance;

 private:
  struct Block {
    void* ptr;
    size_t size;
  };

  static void release_any(void* p) { instance->release(p); }

  void release(void* p) {
    std::unique_lock<std::mutex> g(mu_);
    auto it = live_.find(p);
    if (it == live_.end()) {  // a small block (raw_deallocate of base_'s allocation)
      g.unlock();
      c10::free_cpu(p);
      return;
    }
    const size_t size = it->second;
    live_.erase(it);
    if (size > cap_) {
      g.unlock();
      c10::free_cpu(p);
      return;
    }
    trim_locked(size);
    free_.push_front({p, size});  // newest first; trim_locked frees from the back
    cached_ += size;
  }

  // Free the oldest cached blocks until `incoming` more bytes fit under the cap.
  void trim_locked(size_t incoming) {
    while (!free_.empty() && cached_ + incoming > cap_) {
      cached_ -= free_.back().size;
      c10::free_cpu(free_.back().ptr);
      free_.pop_back();
    }
  }

  c10::Allocator* base_;
  std::mutex mu_;
  std::list<Block> free_;
  std::unordered_map<void*, size_t> live_;
  size_t cap_ = 0, min_bytes_ = SIZE_MAX, cached_ = 0;
  int64_t hits_ = 0, misses_ = 0;
};

BlockCache* BlockCache::instance = nullptr;

}  // namespace

extern "C" {

// Install the cache as torch's CPU allocator (once per process and library copy; later calls set the bounds).
// 0: installed; 1: another allocator of a higher priority holds the slot.
int kiln_block_cache_install(int64_t cap_bytes, int64_t min_bytes) {
  static std::once_flag once;
  std::call_once(once, [] {
    BlockCache::instance = new BlockCache(c10::GetDefaultCPUAllocator());  // never freed: tensors outlive callers
  });
  BlockCache::instance->configure(size_t(std::max<int64_t>(cap_bytes, 0)), size_t(std::max<int64_t>(min_bytes, 1)));
  if (c10::GetCPUAllocator() != BlockCache::instance) c10::SetCPUAllocator(BlockCache::instance, /*priority=*/1);
  return c10::GetCPUAllocator() == BlockCache::instance ? 0 : 1;
}

// out[6]: cap bytes, min bytes, cached bytes, cached blocks, hits, misses; 1 when never installed.
int kiln_block_cache_stats(int64_t* out) {
  if (BlockCache::instance == nullptr) return 1;
  BlockCache::instance->stats(out);
  return 0;
}

}  // extern "C"

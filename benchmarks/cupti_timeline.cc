// benchmarks/cupti_timeline.h on CUPTI's activity API (or UNIMPLEMENTED without it).
#include "benchmarks/cupti_timeline.h"

#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#ifdef TPSERVE_HAVE_CUPTI
#include <cupti.h>
#include <cxxabi.h>
#endif

namespace tpserve {

#ifdef TPSERVE_HAVE_CUPTI
namespace {

// CUPTI hands completed buffers to a thread of its own.
struct Collected {
  std::mutex mu;
  bool on = false;
  std::vector<KernelRecord> records;
  uint64_t dropped = 0;
  std::unordered_map<std::string, std::string> demangled;  // mangled -> demangled
};

Collected& State() {
  static Collected* c = new Collected;  // never destroyed: CUPTI may call in at exit
  return *c;
}

constexpr size_t kBufferBytes = size_t{8} << 20;

void CUPTIAPI BufferRequested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer == nullptr ? 0 : kBufferBytes;
  *max_records = 0;  // as many as fit
}

std::string Demangle(Collected& c, const char* mangled) {
  if (mangled == nullptr) return "?";
  auto it = c.demangled.find(mangled);
  if (it != c.demangled.end()) return it->second;
  int status = 0;
  char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string name = status == 0 && d != nullptr ? std::string(d) : std::string(mangled);
  std::free(d);
  c.demangled.emplace(mangled, name);
  return name;
}

void CUPTIAPI BufferCompleted(CUcontext context, uint32_t stream_id, uint8_t* buffer, size_t,
                              size_t valid) {
  Collected& c = State();
  {
    std::lock_guard<std::mutex> lock(c.mu);
    CUpti_Activity* record = nullptr;
    while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
      if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL &&
          record->kind != CUPTI_ACTIVITY_KIND_KERNEL) {
        continue;
      }
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      KernelRecord r;
      r.label = ShortKernelLabel(Demangle(c, k->name),
                                 int64_t{k->gridX} * int64_t{k->gridY} * int64_t{k->gridZ});
      r.start_ns = k->start;
      r.end_ns = k->end;
      c.records.push_back(std::move(r));
    }
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(context, stream_id, &dropped) == CUPTI_SUCCESS) {
      c.dropped += dropped;
    }
  }
  std::free(buffer);
}

Status CuptiError(const char* what, CUptiResult r) {
  const char* message = nullptr;
  cuptiGetResultString(r, &message);
  return InternalError(std::string(what) + ": " + (message != nullptr ? message : "unknown"));
}

}  // namespace

Status StartKernelTracing() {
  Collected& c = State();
  std::lock_guard<std::mutex> lock(c.mu);
  if (c.on) return FailedPreconditionError("kernel tracing is already on");
  if (CUptiResult r = cuptiActivityRegisterCallbacks(BufferRequested, BufferCompleted);
      r != CUPTI_SUCCESS) {
    return CuptiError("cuptiActivityRegisterCallbacks", r);
  }
  if (CUptiResult r = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
      r != CUPTI_SUCCESS) {
    return CuptiError("cuptiActivityEnable(CONCURRENT_KERNEL)", r);
  }
  c.on = true;
  return Status::Ok();
}

uint64_t CuptiTimestampNs() {
  uint64_t t = 0;
  return cuptiGetTimestamp(&t) == CUPTI_SUCCESS ? t : 0;
}

StatusOr<std::vector<KernelRecord>> CollectKernelRecords(uint64_t* dropped) {
  Collected& c = State();
  {
    std::lock_guard<std::mutex> lock(c.mu);
    if (!c.on) return FailedPreconditionError("kernel tracing is not on");
  }
  // Completed buffers are handed to BufferCompleted before this returns.
  if (CUptiResult r = cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED); r != CUPTI_SUCCESS) {
    return CuptiError("cuptiActivityFlushAll", r);
  }
  std::lock_guard<std::mutex> lock(c.mu);
  std::vector<KernelRecord> out = std::move(c.records);
  c.records.clear();
  if (dropped != nullptr) *dropped = c.dropped;
  return out;
}

#else  // !TPSERVE_HAVE_CUPTI

namespace {
Status NoCupti() {
  return UnimplementedError(
      "kernel tracing: this build has no CUPTI (the CUDA toolkit's libcupti)");
}
}  // namespace

Status StartKernelTracing() { return NoCupti(); }

uint64_t CuptiTimestampNs() { return 0; }

StatusOr<std::vector<KernelRecord>> CollectKernelRecords(uint64_t*) { return NoCupti(); }

#endif

}  // namespace tpserve

// Where a graph-replayed step's time goes, from the GPU's own kernel timestamps: which kernel
// holds the step's critical path for how long, and how long no kernel runs at all. Kernels
// launched with programmatic dependent launch start before the kernel ahead of them ends (their
// CTAs wait inside), so a kernel's duration says little about what it costs the step; what it
// adds beyond every kernel that started before it does.
//
// Pure (no CUDA): tpserve-bench-decode --timeline fills the records from CUPTI
// (benchmarks/cupti_timeline.h); tests/kernel_timeline_test.cc checks the arithmetic.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "benchmarks/median.h"

namespace tpserve {

struct KernelRecord {
  std::string label;  // what the summary groups by (ShortKernelLabel: name and grid)
  uint64_t start_ns = 0, end_ns = 0;
};

// One window of a step (host timestamps on the records' clock, around Step()).
struct TimelineWindow {
  uint64_t begin_ns = 0, end_ns = 0;
};

// A kernel's share of one step: `exposed` is the part of it that ends after every kernel that
// started before it had ended (its end minus the later of its start and that frontier), `idle`
// the time between the frontier and its start when it starts after the frontier. Over a step the
// exposed and idle times add up to the span from the first kernel's start to the last end.
struct KernelShare {
  std::string label;
  double duration_us = 0, exposed_us = 0, idle_before_us = 0;
};

// The kernels whose start falls inside `w`, in start order, each with its share. Records need
// not be sorted.
inline std::vector<KernelShare> StepShares(const std::vector<KernelRecord>& records,
                                           const TimelineWindow& w) {
  std::vector<const KernelRecord*> in;
  for (const KernelRecord& r : records) {
    if (r.start_ns >= w.begin_ns && r.start_ns < w.end_ns) in.push_back(&r);
  }
  std::stable_sort(in.begin(), in.end(), [](const KernelRecord* a, const KernelRecord* b) {
    return a->start_ns < b->start_ns;
  });
  std::vector<KernelShare> out;
  uint64_t frontier = in.empty() ? 0 : in.front()->start_ns;
  for (const KernelRecord* r : in) {
    const uint64_t end = std::max(r->end_ns, r->start_ns);
    KernelShare s;
    s.label = r->label;
    s.duration_us = static_cast<double>(end - r->start_ns) * 1e-3;
    if (r->start_ns > frontier)
      s.idle_before_us = static_cast<double>(r->start_ns - frontier) * 1e-3;
    const uint64_t from = std::max(frontier, r->start_ns);
    if (end > from) s.exposed_us = static_cast<double>(end - from) * 1e-3;
    frontier = std::max(frontier, end);
    out.push_back(std::move(s));
  }
  return out;
}

// Per label over many steps: launches a step, the median duration of one launch, and the
// median over steps of the label's exposed and idle-before time summed within a step.
struct LabelSummary {
  std::string label;
  double launches_per_step = 0;
  double duration_us_median = 0;
  double exposed_us_per_step = 0;
  double idle_us_per_step = 0;
};

struct TimelineSummary {
  int steps = 0;
  double span_us_median = 0;         // first kernel start to last kernel end of a step
  double idle_us_median = 0;         // of that span, no kernel running
  std::vector<LabelSummary> labels;  // in first-appearance order
};

inline TimelineSummary SummarizeTimeline(const std::vector<KernelRecord>& records,
                                         const std::vector<TimelineWindow>& windows) {
  TimelineSummary out;
  // Pass 1: each step's shares, and every label in first-appearance order.
  std::vector<std::vector<KernelShare>> steps;
  std::map<std::string, size_t> index;
  for (const TimelineWindow& w : windows) {
    std::vector<KernelShare> shares = StepShares(records, w);
    if (shares.empty()) continue;
    for (const KernelShare& s : shares) {
      if (index.emplace(s.label, index.size()).second) out.labels.push_back({s.label});
    }
    steps.push_back(std::move(shares));
  }
  out.steps = static_cast<int>(steps.size());
  if (steps.empty()) return out;
  // Pass 2: per step, each label's exposed and idle time (0 where it did not run).
  const size_t n = out.labels.size();
  std::vector<std::vector<double>> durations(n), exposed(n), idle(n);
  std::vector<double> launches(n, 0.0), spans, idles;
  for (const std::vector<KernelShare>& shares : steps) {
    std::vector<double> step_exposed(n, 0.0), step_idle(n, 0.0);
    double span = 0, step_idle_total = 0;
    for (const KernelShare& s : shares) {
      const size_t i = index.at(s.label);
      durations[i].push_back(s.duration_us);
      step_exposed[i] += s.exposed_us;
      step_idle[i] += s.idle_before_us;
      launches[i] += 1;
      span += s.exposed_us + s.idle_before_us;
      step_idle_total += s.idle_before_us;
    }
    for (size_t i = 0; i < n; ++i) {
      exposed[i].push_back(step_exposed[i]);
      idle[i].push_back(step_idle[i]);
    }
    spans.push_back(span);
    idles.push_back(step_idle_total);
  }
  out.span_us_median = Median(spans);
  out.idle_us_median = Median(idles);
  for (size_t i = 0; i < n; ++i) {
    out.labels[i].launches_per_step = launches[i] / out.steps;
    out.labels[i].duration_us_median = Median(durations[i]);
    out.labels[i].exposed_us_per_step = Median(exposed[i]);
    out.labels[i].idle_us_per_step = Median(idle[i]);
  }
  return out;
}

// "name grid N" from a demangled kernel name: the function's unqualified name with its
// template arguments (namespaces and the parameter list dropped, at most 60 characters) and
// the grid's block count, which tells apart the same kernel at different shapes (a decode
// step's qkv, o and down GEMMs).
inline std::string ShortKernelLabel(const std::string& demangled, int64_t grid_blocks) {
  std::string name = demangled;
  // Drop the parameter list: the '(' that matches the name's final ')' (a namespace such as
  // "(anonymous namespace)" or a template argument may hold parentheses too).
  size_t paren = std::string::npos;
  if (!name.empty() && name.back() == ')') {
    int depth = 0;
    for (size_t i = name.size(); i-- > 0;) {
      if (name[i] == ')') ++depth;
      if (name[i] == '(' && --depth == 0) {
        paren = i;
        break;
      }
    }
  }
  if (paren != std::string::npos) name.resize(paren);
  // Drop a leading return type ("void ") and the namespaces before the name.
  size_t tmpl = name.find('<');
  const std::string head = tmpl == std::string::npos ? name : name.substr(0, tmpl);
  size_t cut = head.rfind("::");
  if (cut != std::string::npos) {
    name = name.substr(cut + 2);
  } else if (const size_t space = head.rfind(' '); space != std::string::npos) {
    name = name.substr(space + 1);
  }
  if (name.size() > 60) name = name.substr(0, 57) + "...";
  return name + " grid " + std::to_string(grid_blocks);
}

}  // namespace tpserve

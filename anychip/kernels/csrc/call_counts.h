// Coverage counts kept by the kernels themselves: the W4A8 ops bump table[layer_id, slot] = [calls, tokens] in C++,
// so that no Python runs per linear call.  The table is the coverage recorder's (anychip/vllm_plugin/recorder.py,
// installed through anychip/kernels/hooks.py): counts (layers, slots, 2) int64 and slot (1,) int32, the phase slot
// of the model step now running, which the recorder's step hook writes before each step.  No table: nothing counts.
#pragma once

#include <torch/extension.h>

#include <atomic>
#include <memory>
#include <tuple>
#include <vector>

namespace anychip {

struct CallCounts {
  at::Tensor counts, slot;  // held, so the raw pointers below stay valid while the table is installed
  int64_t* cells = nullptr;
  const int32_t* current = nullptr;
  int64_t layers = 0, slots = 0;
};

inline std::shared_ptr<const CallCounts>& installed_counts() {
  static std::shared_ptr<const CallCounts> table;  // swapped with std::atomic_store, read with std::atomic_load
  return table;
}

using CountTensors = std::tuple<c10::optional<at::Tensor>, c10::optional<at::Tensor>>;

// Installs (counts, slot), or removes the table when both are None; returns the previous pair.
inline CountTensors set_call_counts(const c10::optional<at::Tensor>& counts, const c10::optional<at::Tensor>& slot) {
  std::shared_ptr<const CallCounts> table;
  if (counts.has_value() || slot.has_value()) {
    TORCH_CHECK(counts.has_value() && slot.has_value(), "anychip set_call_counts: pass both counts and slot, or neither");
    TORCH_CHECK(counts->device().is_cpu() && counts->scalar_type() == at::kLong && counts->is_contiguous() &&
                    counts->dim() == 3 && counts->size(2) == 2,
                "anychip set_call_counts: counts must be a contiguous CPU (layers, slots, 2) int64 tensor, got ",
                counts->scalar_type(), " ", counts->sizes());
    TORCH_CHECK(slot->device().is_cpu() && slot->scalar_type() == at::kInt && slot->numel() == 1,
                "anychip set_call_counts: slot must be a (1,) int32 CPU tensor");
    auto t = std::make_shared<CallCounts>();
    t->counts = *counts;
    t->slot = *slot;
    t->cells = t->counts.data_ptr<int64_t>();
    t->current = t->slot.data_ptr<int32_t>();
    t->layers = counts->size(0);
    t->slots = counts->size(1);
    table = std::move(t);
  }
  const std::shared_ptr<const CallCounts> previous = std::atomic_exchange(&installed_counts(), table);
  if (!previous) return {c10::nullopt, c10::nullopt};
  return {previous->counts, previous->slot};
}

// The ops' `layer_id` argument: a (1,) int64 CPU tensor (anychip/kernels/ops.py layer_tensor), or None: -1.
inline int64_t layer_index(const c10::optional<at::Tensor>& layer_id) {
  if (!layer_id.has_value()) return -1;
  TORCH_CHECK(layer_id->device().is_cpu() && layer_id->scalar_type() == at::kLong && layer_id->numel() == 1,
              "anychip: layer_id must be a (1,) int64 CPU tensor (ops.layer_tensor) or None, got ",
              layer_id->scalar_type(), " ", layer_id->sizes(), " on ", layer_id->device());
  return *layer_id->data_ptr<int64_t>();
}

// One call of layer `layer` over `tokens` rows; layers outside the table (and layer -1) are not counted.
inline void count_call(int64_t layer, int64_t tokens) {
  if (layer < 0) return;
  const std::shared_ptr<const CallCounts> t = std::atomic_load(&installed_counts());
  if (!t || layer >= t->layers) return;
  const int32_t slot = *t->current;
  if (slot < 0 || slot >= t->slots) return;
  int64_t* cell = t->cells + (layer * t->slots + slot) * 2;
  __atomic_fetch_add(cell, 1, __ATOMIC_RELAXED);  // the report thread reads while the model runs
  __atomic_fetch_add(cell + 1, tokens, __ATOMIC_RELAXED);
}

// What ran inside a layer's kernels ahead of it (the fused ops, w4a8_cpu.cpp), for the coverage report: a flag per
// layer id, not a count (bits kFusedNorm, kFusedSiluMul), kept for the process lifetime as hooks.py's own flags are.
constexpr uint8_t kFusedNorm = 1, kFusedSiluMul = 2;
constexpr int64_t kFusedFlagLayers = int64_t(1) << 16;  // layer ids beyond this are not flagged

inline std::atomic<uint8_t>* fused_flags() {
  static std::atomic<uint8_t> flags[kFusedFlagLayers] = {};
  return flags;
}

inline void note_fused(int64_t layer, uint8_t bit) {
  if (bit == 0 || layer < 0 || layer >= kFusedFlagLayers) return;
  std::atomic<uint8_t>& f = fused_flags()[layer];
  if (!(f.load(std::memory_order_relaxed) & bit)) f.fetch_or(bit, std::memory_order_relaxed);
}

// (layer id, bits) of every flagged layer.
inline std::vector<std::tuple<int64_t, int64_t>> fused_layers() {
  std::vector<std::tuple<int64_t, int64_t>> out;
  for (int64_t i = 0; i < kFusedFlagLayers; ++i)
    if (const uint8_t b = fused_flags()[i].load(std::memory_order_relaxed)) out.emplace_back(i, b);
  return out;
}

}  // namespace anychip

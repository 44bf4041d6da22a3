// The Metal simulator as a lily::gpu::Device.
#pragma once

#include <cstdint>
#include <memory>

#include "gpu/device.h"

namespace lily::sim {

enum class StageOrder { forward, reverse, random };

struct SimOptions {
  // Encode and count (dispatches, barrier stages, declared bytes) without executing
  // kernels or allocating buffer storage.
  bool record_only = false;
  // Order in which the dispatches of one barrier-free stage execute. A correct schedule
  // gives identical results in every order.
  StageOrder order = StageOrder::forward;
  uint64_t seed = 0;  // for StageOrder::random
  // Fill new buffers and threadgroup memory with 0xFF bytes (NaN in every float type).
  bool poison = true;
  // After each dispatch, check that no byte outside its declared write ranges changed
  // in any buffer it binds (HazardError otherwise).
  bool verify_writes = false;
};

std::unique_ptr<gpu::Device> make_sim_device(const SimOptions& options = {});

}  // namespace lily::sim

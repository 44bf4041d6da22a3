// The Metal backend of the device interface (Objective-C++ in metal_device.mm; this
// header is plain C++).
#pragma once

#include <memory>
#include <string>

#include "gpu/device.h"

namespace lily::metal {

// Opens the system default MTLDevice and loads the kernel library. metallib_path empty:
// $LILY_METALLIB if set, else lily.metallib beside the loaded _core module.
// Throws lily::gpu::Error when there is no Metal device, the GPU is not an Apple-silicon
// GPU, or the library cannot be loaded.
std::unique_ptr<gpu::Device> make_metal_device(const std::string& metallib_path = "");

// "apple9", "apple8", "apple7", ... "mac2", or "unknown" (for messages and benchmarks).
std::string gpu_family(const gpu::Device& device);

}  // namespace lily::metal

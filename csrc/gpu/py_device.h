// Registers the device layer's Python classes on lily._core.
#pragma once
#include <nanobind/nanobind.h>

#include "gpu/device.h"

namespace lily::gpu {
void bind_device(nanobind::module_& m);

// Counters and dispatch records as dicts, for CommandBuffer and for the runtime's counting
// (which adds its traffic and work-table entries). `declared`: the byte counts are named
// declared_bytes_read / declared_bytes_written, apart from the bytes a step really moves.
nanobind::dict counters_dict(const Counters& c, bool declared = false);
nanobind::dict record_dict(const DispatchRecord& r);
}  // namespace lily::gpu

// Registers the device layer's Python classes on lily._core.
#pragma once
#include <nanobind/nanobind.h>

namespace lily::gpu {
void bind_device(nanobind::module_& m);
}

// Registers the per-family dispatch builders (lily._core.encode_*) on lily._core.
#pragma once
#include <nanobind/nanobind.h>

namespace lily::runtime {
void bind_families(nanobind::module_& m);
}  // namespace lily::runtime

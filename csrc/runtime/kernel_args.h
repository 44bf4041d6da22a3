// The kernels' argument structs as the host sees them: the headers under metal/ that hold
// only 32-bit `uint`/`float` fields (and inline functions of them, like gdn_ring) and include
// nothing are included here with `uint` defined as uint32_t, so host and kernels share one
// definition (docs/conventions.md: one header of argument structs included by both sides).
#pragma once

#include <cstdint>

namespace lily::kernels {
using uint = uint32_t;
#include "decode_args.h"
#include "mixer_args.h"
#include "sample_args.h"
#include "prefill_args.h"
}  // namespace lily::kernels

// The layouts the kernels expect (all fields 4 bytes, no padding).
static_assert(sizeof(lily::kernels::GemvArgs) == 8 && sizeof(lily::kernels::EmbedArgs) == 8, "arg layout");
static_assert(sizeof(lily::kernels::MoeArgs) == 20 && sizeof(lily::kernels::GdnDecodeArgs) == 24, "arg layout");
static_assert(sizeof(lily::kernels::MoeRouteArgs) == 24 && sizeof(lily::kernels::NormGemvArgs) == 36,
              "arg layout");
static_assert(sizeof(lily::kernels::AttnFusedArgs) == 36 && sizeof(lily::kernels::AttnCombineArgs) == 16, "arg layout");
static_assert(sizeof(lily::kernels::GatedNormArgs) == 12, "arg layout");
static_assert(sizeof(lily::kernels::SampleArgs) == 56 && sizeof(lily::kernels::MoeTile) == 16, "arg layout");

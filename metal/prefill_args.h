// Argument structs of the prefill kernels (docs/prefill.md), shared by the kernels and the
// host runtime: the host includes this file too, so every field is a 32-bit `uint` or
// `float` (the host defines `uint` as uint32_t) and the file includes nothing. Each struct is
// bound as `constant T& args [[buffer(n)]]` (setBytes).
#ifndef LILY_PREFILL_ARGS_H
#define LILY_PREFILL_ARGS_H

// ---- GEMM (metal/gemm.metal, tensor-op path) ------------------------------------------

// ---- expert routing --------------------------------------------------------------------

// One tile of the grouped expert GEMMs: slots [begin, begin + rows) of the grouped order,
// all routed to `expert`; 1 <= rows <= the tile height.
struct MoeTile {
  uint expert;
  uint begin;
  uint rows;
  uint pad;  // 0; keeps the struct 16 bytes
};

// ---- Gated DeltaNet --------------------------------------------------------------------

// gdn_conv_chunk (metal/gdn_prefill.metal): causal depthwise conv (K = 4 taps) of one chunk
// over [conv state | qkv rows], then SiLU; the conv state is carried in and out (the output
// may be the input state's own bytes). Grid: ceil(C / tg) x ceil(M / RB) threadgroups.
struct GdnConvChunkArgs {
  uint conv_dim;         // C = 2*Hk*Dk + Hv*Dv channels per row (8192); row stride of qkv and out
  uint rows;             // M: tokens in the chunk, >= 1; M * C < 2^32
  uint rows_per_thread;  // RB: consecutive rows one thread convolves (grid y = ceil(M / RB)); < K-1 acts as K-1
};

// gdn_scan_k<Dk>_v<Dv> (metal/gdn_prefill.metal): L2 norms, gates, delta rule over the chunk
// with the recurrent state held in registers, gated RMSNorm. Grid: Hv threadgroups x 1024.
struct GdnScanArgs {
  uint num_k_heads;  // Hk: key heads (16)
  uint num_v_heads;  // Hv: value heads (32), a multiple of Hk; value head h uses key head h / (Hv / Hk)
  uint rows;         // M: tokens in the chunk, >= 1
  float norm_eps;    // eps of the gated RMSNorm over Dv (1e-6)
  float l2_eps;      // eps added to the sum of squares in the q/k L2 norm (1e-6)
};

// ---- attention -------------------------------------------------------------------------

#endif  // LILY_PREFILL_ARGS_H

// Argument structs of the batched decode kernels (issue 31: several sequences' rows of one
// decode step in one dispatch, each weight chunk loaded once for all of them; docs/decode.md
// "Batched decode"), bound beside the batch-1 kernel's own struct, and the constants the host
// shares with them. Included by the kernels (gemv.metal) and the host runtime
// (csrc/runtime/kernel_args.h): every field is a 32-bit `uint` and the file includes nothing
// (the host defines `uint`, and `constant` as nothing). LILY_ARGS_<T> lists a struct's fields
// in order (decode_args.h says how the host reflects them).
#ifndef LILY_BATCH_ARGS_H
#define LILY_BATCH_ARGS_H

// Rows a batched kernel takes at most (the scheduler's max_batch). The kernels are built for
// kBatchRowSizes rows (their `b` parameter: norm_gemv_batch_q4_b4); fewer rows run the next
// larger size with `rows` below it.
constant constexpr uint kBatchMaxRows = 8;

// norm_gemv_batch_q*_b*: norm_gemv_q* (NormGemvArgs) of each row r < rows: its own x
// (x + r * x_stride), norm and outputs (y_m + r * y_stride[m]); with write_xn, xn + r * x_stride.
struct NormGemvBatchArgs {
  uint rows;         // 1 .. the kernel's b
  uint x_stride;     // floats between two rows of x (and of xn); a multiple of 4
  uint y_stride[4];  // floats between two rows of each matrix's output
};
#define LILY_ARGS_NormGemvBatchArgs(F) F(rows) F(x_stride) F(y_stride)

// gemv_batch_q*_b*_add / gemv_gated_batch_q*_b*_add: gemv_q*_add (GemvArgs) of each row
// r < rows on x + r * x_stride into y + r * y_stride; the gated form also reads row r's z
// (z + r * x_stride) and partial sums of squares (ssq + r * ssq_stride).
struct GemvBatchArgs {
  uint rows;        // 1 .. the kernel's b
  uint x_stride;    // floats between two rows of x (and z); a multiple of 4
  uint y_stride;    // floats between two rows of y
  uint ssq_stride;  // floats between two rows of ssq (gated form; else unused)
};
#define LILY_ARGS_GemvBatchArgs(F) F(rows) F(x_stride) F(y_stride) F(ssq_stride)

// moe_route_gate_up_batch_q4_b* / moe_down_batch_q4_b*: the batch-1 MoE kernels' work
// (MoeRouteArgs / MoeArgs) for each row r < rows: its normalised x (x + r * x_stride; gate/up)
// or residual (x + r * x_stride; down), router logits (logits + r * logits_stride), expert
// hidden vector h + r * h_stride, expert ids ids + r * ids_stride and routing weights
// weights + r * w_stride.
struct MoeBatchArgs {
  uint rows;           // 1 .. the kernel's b
  uint x_stride;       // floats between two rows of x (xn, or the residual); a multiple of 4
  uint h_stride;       // floats between two rows of h; a multiple of 4
  uint ids_stride;     // uints between two rows of ids
  uint w_stride;       // floats between two rows of the routing weights
  uint logits_stride;  // floats between two rows of the router logits (gate/up)
};
#define LILY_ARGS_MoeBatchArgs(F) F(rows) F(x_stride) F(h_stride) F(ids_stride) F(w_stride) F(logits_stride)

// moe_down_batch_q4_b*: (slot, chunk) pairs of a row's down index space at most,
// (top_k * inter + inter_shared) / 32 (the model's 144), and a slot no row picked.
constant constexpr uint kMoeBatchMaxChunks = 160;
constant constexpr uint kMoeNoSlot = 0xFFFFFFFF;

#define LILY_BATCH_ARG_STRUCTS(S) S(NormGemvBatchArgs) S(GemvBatchArgs) S(MoeBatchArgs)
#define LILY_BATCH_CONSTANTS(C) C(kBatchMaxRows) C(kMoeBatchMaxChunks) C(kMoeNoSlot)

#endif  // LILY_BATCH_ARGS_H
